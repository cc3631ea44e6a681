"""labkit.optim.offload: torch.optim.AdamW's results with no optimizer state on the device, in RAM or on disk."""

import copy
import io
import os

import pytest
import torch

from labkit.memory import Category, Ledger
from labkit.run import train_step
from labkit.models.gpt import GPT
from labkit.optim.offload import OffloadAdamW, offload_adamw_step_naive
from tiny_training import CFG, batches as _batches, same as _same, train as _train

pytestmark = pytest.mark.usefixtures("one_thread")


def _make(model, offload, tmp_path, **kw):
    folder = str(tmp_path) if offload == "disk" else None
    return OffloadAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, offload=offload, folder=folder, **kw)


@pytest.mark.parametrize("offload", ["cpu", "disk"])
@pytest.mark.parity
def test_fp32_equals_torch_adamw_bitwise(offload, tmp_path):
    torch.manual_seed(0)
    a = GPT(CFG)
    b = copy.deepcopy(a)
    batches = _batches(3)
    _train(a, torch.optim.AdamW(a.parameters(), lr=1e-2, weight_decay=0.1), batches)
    with _make(b, offload, tmp_path) as ob:
        _train(b, ob, batches)
    assert _same(a, b) and not _same(a, GPT(CFG))


@pytest.mark.parity
def test_bf16_weights_follow_fp32_master_adamw():
    """bf16 on the device, fp32 master on the host: equal to AdamW on an fp32 copy fed the bf16
    gradients, rounded to bf16 after every step."""
    torch.manual_seed(0)
    dev = GPT(CFG).to(torch.bfloat16)
    ref_dev = copy.deepcopy(dev)
    master = [p.detach().float().requires_grad_() for p in ref_dev.parameters()]
    ref_opt = torch.optim.AdamW(master, lr=1e-2, weight_decay=0.1)
    opt = OffloadAdamW(dev.parameters(), lr=1e-2, weight_decay=0.1)
    for x in _batches(3):
        train_step(dev, opt, x[:, :-1], x[:, 1:])
        ref_dev(x[:, :-1], x[:, 1:]).backward()
        for p, m in zip(ref_dev.parameters(), master):
            m.grad = p.grad.float()
            p.grad = None
        ref_opt.step()
        with torch.no_grad():
            for p, m in zip(ref_dev.parameters(), master):
                p.copy_(m)
    assert _same(dev, ref_dev)
    assert all(torch.equal(opt.host[p].master, m.detach().view(-1)) for p, m in zip(dev.parameters(), master))


def test_naive_version_matches():
    torch.manual_seed(0)
    a = GPT(CFG)
    b = copy.deepcopy(a)
    host = {}
    opt = OffloadAdamW(b.parameters(), lr=1e-2, weight_decay=0.1)
    for t, x in enumerate(_batches(3), start=1):
        a(x[:, :-1], x[:, 1:]).backward()
        offload_adamw_step_naive(list(a.parameters()), host, t, lr=1e-2, weight_decay=0.1)
        a.zero_grad(set_to_none=True)
        train_step(b, opt, x[:, :-1], x[:, 1:])
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_ledger_sees_no_optimizer_state_on_the_device(offload, tmp_path):
    """AdamW: OPT = 8 bytes per value + a 4-byte step per tensor, and 2 temporaries in the step.
    Offloaded: the device holds weights and gradients only (host arrays are made by numpy, outside
    torch's dispatch, and every host op writes in place: what a GPU would see)."""
    torch.manual_seed(0)
    base = GPT(CFG)
    n = sum(p.numel() for p in base.parameters())
    seen = {}
    for name in ("adamw", offload):
        m = copy.deepcopy(base)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2) if name == "adamw" else _make(m, offload, tmp_path)
        with Ledger(m, opt) as led:
            _train(m, opt, _batches(2))
            live = led.live()
        seen[name] = led.measurement().phases["optimizer"], live
    adamw, _ = seen["adamw"]
    off, live = seen[offload]
    assert adamw[Category.OPT] == 8 * n + 4 * len(list(base.parameters())) and adamw[Category.TEMP] > 0
    assert off[Category.OPT] == 0 and off[Category.TEMP] == 0 and live[Category.OPT] == 0
    assert off[Category.PARAM] == 4 * n


def test_disk_folder_is_made_inside_the_given_one_and_removed(tmp_path):
    m = GPT(CFG)
    opt = OffloadAdamW(m.parameters(), offload="disk", folder=tmp_path)
    (sub,) = os.listdir(tmp_path)
    n = sum(p.numel() for p in m.parameters())
    files = sorted(os.listdir(tmp_path / sub))
    assert files == ["exp_avg.f32", "exp_avg_sq.f32", "master.f32"]
    assert all(os.path.getsize(tmp_path / sub / f) == 4 * n for f in files)
    _train(m, opt, _batches(1))
    opt.close()
    assert os.listdir(tmp_path) == []
    with pytest.raises(RuntimeError, match="close"):
        opt.step()


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_resume_from_state_dict_is_identical(offload, tmp_path):
    torch.manual_seed(0)
    a = GPT(CFG).to(torch.bfloat16)
    b = copy.deepcopy(a)
    oa = _make(a, offload, tmp_path)
    batches = _batches(5)
    _train(a, oa, batches[:3])
    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "opt": oa.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    b.load_state_dict(saved["model"])
    ob = _make(b, offload, tmp_path)
    ob.load_state_dict(saved["opt"])
    _train(a, oa, batches[3:])
    _train(b, ob, batches[3:])
    assert _same(a, b)
    assert ob.param_groups[0]["lr"] == 1e-2 and saved["opt"]["state"][0]["step"] == 3
    oa.close()
    ob.close()


@pytest.mark.parametrize("kwargs, name", [
    ({"offload": "gpu"}, "offload"), ({"offload": "nvme"}, "offload"), ({"offload": None}, "offload"),
    ({"offload": "disk"}, "folder"), ({"offload": "disk", "folder": "/no/such/folder"}, "folder"),
    ({"offload": "cpu", "folder": "/tmp"}, "folder"), ({"lr": -1e-3}, "lr"), ({"betas": (0.9, 1.5)}, "betas.1."),
    ({"eps": float("nan")}, "eps"), ({"weight_decay": -0.1}, "weight_decay"),
])
def test_bad_input_raises_one_line(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}") as e:
        OffloadAdamW([torch.nn.Parameter(torch.zeros(4))], **kwargs)
    assert "\n" not in str(e.value)
