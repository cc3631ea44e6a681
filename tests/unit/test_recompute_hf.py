"""labkit.recompute on transformers GPT-2 and Llama, and with LoRA / QLoRA / LISA: the same gradients as
without checkpointing or offload (the recompute replays the same ops on the same inputs, RNG restored)."""

import contextlib

import pytest
import torch

from labkit.peft import LISA
from labkit.recompute import checkpoint_blocks, find_blocks, offload_activations
from labkit.run import apply_peft, build_model, make_optimizer

LAYERS = {"gpt2-tiny": "n_layer", "llama-tiny": "num_hidden_layers"}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _model(name, dtype="fp32", peft=None, **ov):
    torch.manual_seed(0)
    m = build_model(name, dtype, **{LAYERS[name]: 3, **ov})
    apply_peft(m, dtype, **(peft or {}))
    return m


def _grads(m, ctx, dtype="fp32"):
    """Loss and every parameter gradient of one forward/backward under ctx (a fresh context each call)."""
    g = torch.Generator().manual_seed(1)
    t = torch.randint(0, m.config.vocab_size, (2, 33), generator=g)
    m.zero_grad(set_to_none=True)
    torch.manual_seed(123)  # dropout draws the same masks in each run
    low = {"mixed-bf16": torch.bfloat16}.get(dtype)
    with ctx:
        with torch.autocast("cpu", dtype=low or torch.float32, enabled=low is not None):
            loss = m(input_ids=t[:, :-1], labels=t[:, 1:], use_cache=False).loss
        loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def _same(a, b):
    assert a[0] == b[0]
    assert a[1].keys() == b[1].keys() and a[1]
    for n in a[1]:  # the recompute runs the same kernels on the same inputs: bit for bit
        assert torch.equal(a[1][n], b[1][n]), n


POLICIES = [dict(policy="full"), dict(policy="sqrt"), dict(policy="selective"), dict(policy="full", segments=2),
            dict(policy="full", style="reentrant")]


@pytest.mark.parity
@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("kw", POLICIES, ids=lambda kw: "-".join(map(str, kw.values())))
def test_checkpointed_gradients_equal_plain(name, kw):
    m = _model(name, attn_pdrop=0.1) if name == "gpt2-tiny" else _model(name)  # GPT-2 with dropout: RNG replayed
    ref = _grads(m, contextlib.nullcontext())
    kw = dict(kw)
    h = checkpoint_blocks(m, kw.pop("policy"), kw.pop("segments", None), **kw)
    _same(_grads(m, h), ref)
    assert all("forward" not in b.__dict__ for b in find_blocks(m))  # left as it was


@pytest.mark.parity
@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("dtype", ["fp32", "mixed-bf16"])
def test_offload_and_checkpoint_with_offload(name, dtype):
    m = _model(name)
    ref = _grads(m, contextlib.nullcontext(), dtype)
    _same(_grads(m, offload_activations(), dtype), ref)
    with checkpoint_blocks(m, "full"):
        _same(_grads(m, offload_activations(), dtype), ref)


@pytest.mark.parity
@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("peft", [dict(lora_rank=4), dict(lora_rank=4, quant="nf4")], ids=["lora", "qlora"])
def test_adapters_under_checkpoint_and_offload(name, peft):
    m = _model(name, peft=peft)
    ref = _grads(m, contextlib.nullcontext())
    assert all(n.endswith(("lora_A", "lora_B")) for n in ref[1])  # only the adapters train
    with checkpoint_blocks(m, "full"):
        _same(_grads(m, contextlib.nullcontext()), ref)
    with checkpoint_blocks(m, "selective"):
        _same(_grads(m, contextlib.nullcontext()), ref)
    _same(_grads(m, offload_activations()), ref)


@pytest.mark.parity
@pytest.mark.parametrize("name", list(LAYERS))
def test_lisa_under_checkpoint(name):
    m = _model(name)
    LISA(m, make_optimizer(m, "sgd"), gamma=1, interval=5, seed=0).step()  # one layer trains, the others frozen
    ref = _grads(m, contextlib.nullcontext())
    with checkpoint_blocks(m, "full"):
        _same(_grads(m, contextlib.nullcontext()), ref)


def test_qlora_checkpoint_option_on_transformers_models():
    from labkit.peft import LoRAConfig, NF4Config, apply_qlora

    torch.manual_seed(0)
    m = build_model("llama-tiny", num_hidden_layers=2)
    apply_qlora(m, LoRAConfig(r=4), NF4Config(torch.float32), checkpoint="full")
    assert m.qlora_checkpoint.segments == 2
    m.qlora_checkpoint.remove()


def test_find_blocks_and_bad_models():
    for name, path in (("gpt2-tiny", "transformer.h"), ("llama-tiny", "model.layers")):
        m = build_model(name)
        obj = m
        for part in path.split("."):
            obj = getattr(obj, part)
        assert find_blocks(m) is obj
    with pytest.raises(ValueError, match=r"^model: expected a non-empty ModuleList of blocks"):
        find_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    m = build_model("gpt2-tiny")
    enable = getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable  # renamed in 5.x
    enable()
    with pytest.raises(ValueError, match=r"^model: transformers' own gradient checkpointing is on"):
        checkpoint_blocks(m, "full")
