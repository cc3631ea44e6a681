"""NF4 layers keep nothing weight-sized for backward, and dequantization's temporaries stay within a bound
derived from the shapes (measured with labkit.memory.Ledger)."""

import pytest
import torch
import torch.nn as nn

from labkit.memory import Category, Ledger
from labkit.peft import LoRAConfig, NF4Base, NF4Config, apply_qlora, to_nf4
from labkit.quant import NF4Linear, dequantize_nf4, nf4_linear, quantize_nf4

D_OUT, D_IN, B = 256, 512, 8


def _saved_for_backward(model, x):
    """(ACT tensors alive when backward starts, peak forward TEMP bytes) of one forward+backward."""
    seen = []
    with Ledger(model) as led:
        y = model(x)
        y.register_hook(lambda g: seen.extend(led.live_tensors(Category.ACT)))  # runs inside backward
        y.square().sum().backward()
    return seen, led.measurement().phases["forward"][Category.TEMP]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("make", ["NF4Linear", "NF4Base in apply_qlora"])
def test_nf4_forward_saves_nothing_weight_sized(dtype, make):
    torch.manual_seed(0)
    lin = nn.Linear(D_IN, D_OUT)
    if make == "NF4Linear":
        model = NF4Linear.from_linear(lin, compute_dtype=dtype)
    else:
        model = apply_qlora(nn.Sequential(lin), LoRAConfig(["0"], r=4), NF4Config(dtype))
        assert isinstance(model[0].base, NF4Base)
    x = torch.randn(B, D_IN, requires_grad=True)
    acts, fwd_temp = _saved_for_backward(model, x)
    n = D_OUT * D_IN
    assert not [a for a in acts if a[3] >= n // 8]  # no saved tensor within 8x of the weight's element count
    assert sum(a[3] for a in acts) <= 4 * B * (D_IN + D_OUT + 8)  # at most activation-sized (LoRA's x, x A^T, ...)
    # the forward's temporaries: dequantized weight + int32 byte indices (+ a 16-bit copy) + activations
    assert fwd_temp <= n * (4 + 2 + (2 if dtype != torch.float32 else 0)) + 8 * B * (D_IN + D_OUT) + 4096


def test_teaching_version_keeps_the_dequantized_weight():
    torch.manual_seed(0)
    lin = nn.Linear(D_IN, D_OUT)
    x = torch.randn(B, D_IN, requires_grad=True)
    acts, _ = _saved_for_backward(to_nf4(lin, NF4Config(torch.float32, keep_dequantized=True)), x)
    assert [a for a in acts if a[3] == 4 * D_OUT * D_IN]  # the fp32 weight: the test above can fail


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantization_temporaries_are_bounded(dtype):
    """Peak bytes of dequantize_nf4: the fp32 result (4 per weight) + (numel/2,) int32 indices (2 per weight)
    + the cast to `dtype` + per-block statistics; the int64 index version peaked at 13 per weight."""
    w = torch.randn(D_OUT, D_IN)
    packed, state = quantize_nf4(w)
    with Ledger() as led:
        out = dequantize_nf4(packed, state, dtype)
    peak = max(b.total for b in led.measurement().phases.values())
    n, blocks = w.numel(), w.numel() // 64
    cast = 0 if dtype == torch.float32 else n * out.element_size()
    assert peak <= n * (4 + 2) + cast + 3 * 4 * blocks + 1024
    assert peak >= n * 4  # the measurement sees the result itself


def test_save_nothing_gradients_equal_the_teaching_version():
    torch.manual_seed(0)
    w, bias = torch.randn(D_OUT, D_IN), torch.randn(D_OUT)
    packed, state = quantize_nf4(w)
    grads = []
    for keep in (True, False):
        x = torch.randn(2, 3, D_IN, generator=torch.Generator().manual_seed(1)).requires_grad_()
        b = bias.clone().requires_grad_()  # a trainable bias gets its gradient too
        nf4_linear(x, packed, state, b, torch.float32, keep_dequantized=keep).square().sum().backward()
        grads.append((x.grad, b.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("keep", [False, True])
def test_int8_linear_saves_nothing_weight_sized_unless_asked(keep):
    """Int8Linear shares the dequantize-on-the-fly matmul: the default keeps no weight for backward, the
    teaching version keeps the fp32 weight (4 bytes each); both give the same gradients."""
    from labkit.quant import Int8Linear

    torch.manual_seed(0)
    lin = nn.Linear(D_IN, D_OUT)
    layer = Int8Linear.from_linear(lin, "absmax", "channel", compute_dtype=torch.float32, keep_dequantized=keep)
    x = torch.randn(B, D_IN, requires_grad=True)
    acts, _ = _saved_for_backward(layer, x)
    weight_sized = [a for a in acts if a[3] >= D_OUT * D_IN]
    assert bool(weight_sized) == keep
    grad = x.grad.clone()
    x.grad = None
    y = torch.nn.functional.linear(x, layer.dequantized_weight(torch.float32), lin.bias)
    y.square().sum().backward()
    assert torch.allclose(grad, x.grad, atol=1e-5)
