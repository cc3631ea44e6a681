"""labkit.device: picking, describing and sizing the device (CUDA and MPS are faked where absent)."""

import os
from types import SimpleNamespace

import pytest
import torch

from labkit import device as dev
from labkit.data import get_batch
from labkit.models.gpt import GPT

GiB = 2**30


@pytest.fixture
def fake(monkeypatch):
    """Pretend which accelerators exist; LABKIT_DEVICE and LABKIT_SMOKE start unset."""
    monkeypatch.delenv("LABKIT_DEVICE", raising=False)
    monkeypatch.delenv("LABKIT_SMOKE", raising=False)

    def set_available(cuda=False, mps=False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: int(cuda))
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)

    set_available()
    return set_available


@pytest.mark.parametrize(
    "cuda, mps, expected", [(False, False, "cpu"), (False, True, "mps"), (True, True, "cuda"), (True, False, "cuda")]
)
def test_pick_device_prefers_cuda_then_mps_then_cpu(fake, cuda, mps, expected):
    fake(cuda=cuda, mps=mps)
    assert dev.pick_device() == torch.device(expected)


def test_pick_device_honours_prefer_over_env_over_default(fake, monkeypatch):
    fake(cuda=True)
    assert dev.pick_device("cpu").type == "cpu"
    monkeypatch.setenv("LABKIT_DEVICE", "cpu")
    assert dev.pick_device().type == "cpu"
    assert dev.pick_device("cuda").type == "cuda"  # prefer beats the env var
    monkeypatch.setenv("LABKIT_DEVICE", "")
    assert dev.pick_device().type == "cuda"  # empty means unset


def test_pick_device_unavailable_names_what_is_available(fake, monkeypatch):
    fake(cuda=False, mps=True)
    with pytest.raises(ValueError, match="available: mps, cpu") as err:
        dev.pick_device("cuda")
    assert "\n" not in str(err.value)
    monkeypatch.setenv("LABKIT_DEVICE", "cuda")
    with pytest.raises(ValueError, match="not available"):
        dev.pick_device()


def test_pick_device_unknown_and_bad_index(fake):
    with pytest.raises(ValueError, match="unknown device 'tpu'.*available here: cpu"):
        dev.pick_device("tpu")
    fake(cuda=True)
    assert dev.pick_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="1 CUDA device"):
        dev.pick_device("cuda:3")


@pytest.mark.parametrize(
    "value, expected",
    [("1", True), ("true", True), ("YES", True), (" yes ", True), ("0", False), ("false", False), ("", False)],
)
def test_smoke_reads_env(monkeypatch, value, expected):
    monkeypatch.setenv("LABKIT_SMOKE", value)
    assert dev.smoke() is expected


def test_smoke_unset_is_false(monkeypatch):
    monkeypatch.delenv("LABKIT_SMOKE", raising=False)
    assert dev.smoke() is False


def test_describe_cpu():
    info = dev.describe("cpu")
    assert (info.kind, info.bf16, info.fp8, info.compute_capability) == ("cpu", True, False, None)
    assert info.cores == os.cpu_count()
    assert info.total_memory == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert info.name and info.name != "unknown CPU"
    text = str(info)
    assert "\n" not in text and text.startswith("cpu: ") and "GiB" in text
    assert f"{info.total_memory / GiB:.1f} GiB" in text


def _fake_gpu(monkeypatch, name, gib, cc, bf16):
    props = SimpleNamespace(name=name, total_memory=int(gib * GiB), major=cc[0], minor=cc[1])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: props)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16 or including_emulation)
    return dev.describe(torch.device("cuda"))


def test_describe_cuda_h200_and_t4(monkeypatch):
    h200 = _fake_gpu(monkeypatch, "NVIDIA H200", 139.8, (9, 0), bf16=True)
    assert (h200.kind, h200.name, h200.compute_capability) == ("cuda", "NVIDIA H200", (9, 0))
    assert (h200.bf16, h200.fp8, h200.total_memory) == (True, True, int(139.8 * GiB))
    assert "NVIDIA H200, 139.8 GiB, cc 9.0, bf16, fp8" in str(h200)
    t4 = _fake_gpu(monkeypatch, "Tesla T4", 14.6, (7, 5), bf16=True)  # torch may say True (emulated)
    assert (t4.bf16, t4.fp8) == (False, False)  # emulated bf16 does not count: the compute capability decides
    assert dev.profile(t4, smoke_mode=False).dtype == "mixed-fp16"
    ada = _fake_gpu(monkeypatch, "NVIDIA L4", 22.0, (8, 9), bf16=True)
    assert ada.fp8 is True
    ampere = _fake_gpu(monkeypatch, "NVIDIA A100", 80.0, (8, 0), bf16=True)
    assert ampere.fp8 is False


def test_mixed_precision_t4_fp16_with_loss_scaling_a100_bf16():
    t4 = dev.mixed_precision("Tesla T4", (7, 5))
    assert t4.dtype == "mixed-fp16"
    assert "Tesla T4" in t4.why and "7.5 < 8.0" in t4.why and "loss scaling" in t4.why and "GradScaler" in t4.why
    a100 = dev.mixed_precision("NVIDIA A100-SXM4-40GB", (8, 0))
    assert a100.dtype == "mixed-bf16" and "8.0" in a100.why
    assert dev.mixed_precision("Tesla V100", (7, 0)).dtype == "mixed-fp16"
    assert dev.mixed_precision("NVIDIA H200", (9, 0)).dtype == "mixed-bf16"


@pytest.mark.parametrize("name, cc", [("", (7, 5)), (None, (7, 5)), ("T4", (7,)), ("T4", "7.5"), ("T4", (7.0, 5)),
                                      ("T4", (True, 5)), ("T4", (-1, 0))])
def test_mixed_precision_refuses_bad_input(name, cc):
    with pytest.raises(ValueError, match="mixed_precision"):
        dev.mixed_precision(name, cc)


def test_setup_says_why_a_t4_gets_fp16(monkeypatch, capsys):
    import labkit

    props = SimpleNamespace(name="Tesla T4", total_memory=int(14.6 * GiB), major=7, minor=5)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: props)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setenv("LABKIT_SMOKE", "0")
    monkeypatch.delenv("LABKIT_DEVICE", raising=False)
    lesson = labkit.setup()
    assert (lesson.kind, lesson.profile.dtype) == ("cuda", "mixed-fp16")
    assert capsys.readouterr().out == dev.mixed_precision("Tesla T4", (7, 5)).why + "\n"
    props.name, props.major, props.minor = "NVIDIA A100", 8, 0  # bf16: nothing to explain
    assert labkit.setup().profile.dtype == "mixed-bf16" and capsys.readouterr().out == ""


def _info(kind, gib, bf16=True):
    cc = (9, 0) if kind == "cuda" else None
    return dev.DeviceInfo(kind, "test", None if gib is None else int(gib * GiB), bf16, False, cc, 2)


def _meta_params(cfg) -> int:
    with torch.device("meta"):
        return GPT(cfg).num_params()


@pytest.mark.parametrize(
    "info, name, dtype, preset, params",
    [
        (_info("cpu", 16), "cpu", "fp32", "gpt2-tiny", (1e6, 10e6)),
        (_info("mps", 16), "cpu", "fp32", "gpt2-tiny", (1e6, 10e6)),
        (_info("cuda", 15, bf16=False), "small-gpu", "mixed-fp16", "gpt2", (60e6, 130e6)),
        (_info("cuda", 24, bf16=True), "small-gpu", "mixed-bf16", "gpt2", (60e6, 130e6)),
        (_info("cuda", 80), "big-gpu", "mixed-bf16", "gpt2-medium", (250e6, 400e6)),
        (_info("cuda", 140), "big-gpu", "mixed-bf16", "gpt2-medium", (250e6, 400e6)),
    ],
)
def test_profile_by_device(info, name, dtype, preset, params):
    from labkit.models.hf import PRESETS

    p = dev.profile(info, smoke_mode=False)
    assert (p.name, p.dtype, p.hf_preset) == (name, dtype, preset)
    assert preset in PRESETS
    cfg = p.gpt_config()
    assert cfg.vocab_size == 256 and cfg.dropout == 0.0 and p.seq <= cfg.block_size
    assert params[0] < _meta_params(cfg) < params[1]
    assert 0 < p.budget_gib <= info.total_memory / GiB / 2


def test_profile_shapes_follow_the_brief():
    assert dev.profile(_info("cuda", 15), smoke_mode=False).gpt_config().n_layer == 12
    big = dev.profile(_info("cuda", 140), smoke_mode=False)
    cfg = big.gpt_config()
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, big.seq, big.batch) == (24, 16, 1024, 1024, 16)


def test_profile_budget_never_above_half_the_device():
    assert dev.profile(_info("cuda", 8), smoke_mode=False).budget_gib == 4.0
    assert dev.profile(_info("cpu", None), smoke_mode=False).budget_gib == 2.0  # unknown memory: the fixed value


def test_profile_smoke_from_env_and_override(monkeypatch):
    cpu = _info("cpu", 16)
    monkeypatch.setenv("LABKIT_SMOKE", "1")
    assert dev.profile(cpu).name == "smoke"
    assert dev.profile(_info("cuda", 140)).name == "smoke"  # smoke wins on any device
    assert dev.profile(cpu, smoke_mode=False).name == "cpu"  # an explicit bool decides
    monkeypatch.setenv("LABKIT_SMOKE", "0")
    assert dev.profile(cpu).name == "cpu"
    assert dev.profile(cpu, smoke_mode=True).name == "smoke"


def test_profile_of_this_machine_uses_describe(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.delenv("LABKIT_DEVICE", raising=False)
    assert dev.profile(smoke_mode=False).name == "cpu"
    assert dev.profile("cpu", smoke_mode=True).name == "smoke"


def test_smoke_profile_trains():
    p = dev.profile(_info("cpu", 16), smoke_mode=True)
    assert (p.dtype, p.steps) == ("fp32", 3)
    torch.manual_seed(0)
    model = GPT(p.gpt_config())
    assert model.num_params() < 200_000
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = get_batch(torch.randint(0, 256, (1000,)), p.batch, p.seq, generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(p.steps):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_gpt_config_overrides_and_validation():
    p = dev.profile(_info("cpu", 16), smoke_mode=True)
    cfg = p.gpt_config(attention="manual", n_layer=3)
    assert (cfg.attention, cfg.n_layer, cfg.n_embd) == ("manual", 3, p.gpt["n_embd"])
    assert p.gpt["n_layer"] == 2  # the profile itself is untouched
    with pytest.raises(ValueError, match="dtype"):
        dev.Profile("cpu", p.gpt, dtype="int8")
    with pytest.raises(ValueError, match="block_size"):
        dev.Profile("cpu", p.gpt, seq=p.gpt["block_size"] + 1)
