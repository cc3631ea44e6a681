"""On an Ada/Hopper GPU: FP8Linear's real torch._scaled_mm path against its emulation, forward and backward."""

import pytest
import torch
import torch.nn as nn

from labkit.precision import FP8Linear, FP8Recipe, dequantize_fp8, fp8_gemm_available, quantize_fp8, scaled_mm_fp8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(torch.cuda.is_available() and not fp8_gemm_available("cuda"),
                       reason="FP8 GEMMs need compute capability >= 8.9 (Ada/Hopper)"),
]

RECIPES = [FP8Recipe("tensor", "tensor"), FP8Recipe("row", "row"), FP8Recipe("row", "tensor"),
           FP8Recipe("block", "block"), FP8Recipe("block", "tensor")]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: f"{r.activation}-{r.weight}")
def test_scaled_mm_matches_emulation(recipe):
    """Same fp8 operands, so the only difference is accumulation order and the bf16 rounding of the
    output (and of each 128-column partial sum for blocks): tolerance 1e-2 relative (Frobenius)."""
    torch.manual_seed(0)
    x = torch.randn(100, 512, device="cuda", dtype=torch.bfloat16)  # 100 rows: padded to 112 inside
    w = (torch.randn(256, 512, device="cuda") * 0.05).to(torch.bfloat16)
    ab, wb = recipe.blocks()
    x8, sx = quantize_fp8(x, "e4m3", recipe.activation, ab)
    w8, sw = quantize_fp8(w, "e4m3", recipe.weight, wb)
    emu = dequantize_fp8(x8, sx) @ dequantize_fp8(w8, sw).t()
    real = scaled_mm_fp8(x8, sx, w8, sw, recipe, out_dtype=torch.bfloat16).float()
    assert real.shape == (100, 256)
    assert ((real - emu).norm() / emu.norm()).item() < 1e-2


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: f"{r.activation}-{r.weight}")
def test_fp8_linear_real_and_emulated_agree(recipe):
    torch.manual_seed(0)
    base = nn.Linear(512, 256, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4, 25, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    outs = []
    for kernel in ("emulate", "scaled_mm"):
        layer = FP8Linear.from_linear(base, FP8Recipe(recipe.activation, recipe.weight, kernel=kernel))
        y = layer(x)
        y.float().square().mean().backward()
        outs.append((y.detach().float(), x.grad.clone(), base.weight.grad.clone()))
        x.grad, base.weight.grad, base.bias.grad = None, None, None
    (ye, gxe, gwe), (yr, gxr, gwr) = outs
    assert ((yr - ye).norm() / ye.norm()).item() < 1e-2
    # straight-through backward in bf16 from the same weights; dy differs only through y's rounding
    assert ((gxr - gxe).float().norm() / gxe.float().norm()).item() < 2e-2
    assert ((gwr - gwe).float().norm() / gwe.float().norm()).item() < 2e-2
