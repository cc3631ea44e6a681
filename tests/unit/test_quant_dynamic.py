"""The 8-bit dynamic map and blockwise quantization against bitsandbytes."""

import bitsandbytes.functional as bnb_f
import pytest
import torch

from labkit.quant import dequantize_blockwise, dynamic_map, quantize_blockwise


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parity
def test_map_equals_bitsandbytes(signed):
    ours = dynamic_map(signed=signed)
    ref = bnb_f.create_dynamic_map(signed=signed).float()
    assert ours.shape == (256,)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-7)
    if signed:
        assert ours[ours > 0].min().item() == pytest.approx(5.5e-7, rel=1e-3)
        assert ours[ours < 1].max().item() == pytest.approx(0.99297, abs=1e-5)


@pytest.mark.parametrize("n, scale", [(10_000, 3.0), (4096 * 3 + 17, 1e-3)])
@pytest.mark.parity
def test_codes_match_bitsandbytes_except_near_ties(n, scale):
    torch.manual_seed(0)
    x = torch.randn(n) * scale
    ref_codes, state = bnb_f.quantize_blockwise(x, blocksize=256)
    codes, absmax = quantize_blockwise(x, blocksize=256)
    torch.testing.assert_close(absmax, state.absmax)
    same = (codes == ref_codes).float().mean().item()
    assert same >= 0.995
    # bitsandbytes' native CPU kernel searches the code approximately (its pure-PyTorch backend uses
    # exact midpoints, as we do): every disagreement is one code step, and ours is the nearer code.
    code = dynamic_map()
    normed = x / absmax.repeat_interleave(256)[:n]
    bad = (codes != ref_codes).nonzero().flatten()
    d_ours = (normed[bad] - code[codes[bad].long()]).abs()
    d_ref = (normed[bad] - code[ref_codes[bad].long()]).abs()
    assert (d_ours <= d_ref).all()
    assert ((codes.long() - ref_codes.long()).abs() <= 1).all()
    exact = (normed.unsqueeze(1) - code).abs().argmin(dim=1)  # brute-force nearest code
    assert (codes.long() == exact).float().mean().item() >= 0.9999
    # dequantized values: equal wherever the codes agree
    ours = dequantize_blockwise(codes, absmax)
    ref = bnb_f.dequantize_blockwise(ref_codes, state)
    agree = codes == ref_codes
    torch.testing.assert_close(ours[agree], ref[agree])


def test_roundtrip_error_and_bad_blocksize():
    x = torch.randn(1000)
    codes, absmax = quantize_blockwise(x, blocksize=64)
    assert codes.dtype == torch.uint8 and absmax.numel() == 16
    assert (dequantize_blockwise(codes, absmax, blocksize=64) - x).abs().max() < 0.05 * x.abs().max()
    assert torch.equal(dequantize_blockwise(*quantize_blockwise(torch.zeros(300))), torch.zeros(300))
    x0 = x.clone()
    quantize_blockwise(x)
    assert torch.equal(x, x0)  # the in-place core works on a copy: the caller's fp32 tensor is untouched
    with pytest.raises(ValueError, match="blocksize"):
        quantize_blockwise(x, blocksize=0)
