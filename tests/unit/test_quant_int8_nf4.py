"""Int8 (absmax / zero-point) and NF4 (double-quantized) weights: error bounds, bytes, and parity with
bitsandbytes and torch's quantized tensors."""

import bitsandbytes as bnb
import bitsandbytes.functional
import pytest
import torch
import torch.nn.functional as F

from labkit.quant import (
    NF4_CODE,
    Int8Linear,
    NF4Linear,
    NF4State,
    absmax_dequantize,
    absmax_quantize,
    bits_per_param_nf4,
    dequantize_int8,
    dequantize_nf4,
    dequantize_nf4_toy,
    dynamic_map,
    int8_bytes_for,
    nbytes_nf4,
    nf4_bytes_for,
    normal_float_map,
    pack_nibbles,
    quant_error,
    quantize_int8,
    quantize_nf4,
    quantize_nf4_toy,
    unpack_nibbles,
    zeropoint_dequantize,
    zeropoint_quantize,
)


def weights(rows=256, cols=384, seed=0):
    """Normal weights with rows of very different scales, as real layers have."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * 0.02 * torch.logspace(-1, 1, rows).unsqueeze(1)


# ----------------------------------------------------------------------------- int8


def test_teaching_absmax_and_zeropoint():
    x = torch.tensor([-1.0, -0.25, 0.0, 0.5, 2.0])
    codes, scale = absmax_quantize(x)
    assert codes.dtype == torch.int8 and codes.tolist() == [-64, -16, 0, 32, 127]
    assert scale.item() == pytest.approx(2 / 127)
    assert (absmax_dequantize(codes, scale) - x).abs().max() <= scale / 2 + 1e-7
    codes, scale, zero = zeropoint_quantize(x)
    assert codes.dtype == torch.uint8 and codes.min() == 0 and codes.max() == 255  # the whole range is used
    assert scale.item() == pytest.approx(3 / 255)
    back = zeropoint_dequantize(codes, scale, zero)
    assert back[2].item() == 0.0  # zero is exact
    assert (back - x).abs().max() <= scale / 2 + 1e-7


@pytest.mark.parametrize("mode", ["absmax", "zeropoint"])
@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_int8_error_within_half_a_step(mode, granularity):
    w = weights()
    q = quantize_int8(w, mode, granularity, blocksize=64)
    assert q.codes.shape == w.shape
    assert q.codes.dtype == (torch.int8 if mode == "absmax" else torch.uint8)
    groups = {"tensor": 1, "channel": 256, "block": w.numel() // 64}[granularity]
    assert q.scale.shape == (groups,) and q.scale.dtype == torch.float32
    assert (q.zero_point is None) == (mode == "absmax")
    err = (dequantize_int8(q) - w).reshape(groups, -1).abs().amax(dim=1)
    assert (err <= q.scale / 2 * (1 + 1e-5) + 1e-9).all()
    # measured storage: 1 byte per weight + 4 per scale (+1 per zero point)
    per_group = 4 + (mode == "zeropoint")
    assert q.nbytes == w.numel() + per_group * groups
    assert q.bits_per_param == pytest.approx(8 + 8 * per_group * groups / w.numel())


def test_finer_groups_lower_error():
    w = weights()
    rmse = {g: quant_error(w, dequantize_int8(quantize_int8(w, "absmax", g, 64)))["rmse"]
            for g in ("tensor", "channel", "block")}
    assert rmse["tensor"] > 2 * rmse["channel"] and rmse["channel"] > 1.1 * rmse["block"]
    assert quantize_int8(w, granularity="channel").bits_per_param == pytest.approx(8 + 32 / 384)


def test_teaching_version_equals_per_tensor():
    w = weights()
    codes, scale = absmax_quantize(w)
    q = quantize_int8(w, "absmax", "tensor")
    assert torch.equal(codes, q.codes) and torch.equal(scale.view(1), q.scale)
    codes, scale, zero = zeropoint_quantize(w)
    q = quantize_int8(w, "zeropoint", "tensor")
    assert torch.equal(codes, q.codes) and torch.equal(zero.view(1), q.zero_point)


@pytest.mark.parity
def test_absmax_rows_match_bitsandbytes_int8_vectorwise():
    bnb_f = bnb.functional
    w = weights(1024, 384)
    ref_codes, row_absmax, _ = bnb_f.int8_vectorwise_quant(w.clone())
    q = quantize_int8(w, "absmax", "channel")
    torch.testing.assert_close(q.scale, row_absmax / 127)
    # bnb multiplies by 127/absmax, we divide by absmax/127: they may round differently at a .5 tie
    assert (q.codes == ref_codes).float().mean() >= 0.9999
    assert ((q.codes.int() - ref_codes.int()).abs() <= 1).all()


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")  # torch deprecates its quantized tensors
@pytest.mark.parity
def test_zeropoint_rows_match_torch_quint8():
    w = weights(1024, 384)
    q = quantize_int8(w, "zeropoint", "channel")
    ref = torch.quantize_per_channel(w, q.scale.double(), q.zero_point.long(), 0, torch.quint8)
    assert (ref.int_repr() == q.codes).float().mean() >= 0.9999
    assert ((ref.int_repr().int() - q.codes.int()).abs() <= 1).all()


def test_quant_error_metrics():
    x = torch.tensor([1.0, -1.0, 1.0, -1.0])
    e = quant_error(x, x + 0.1)
    assert e["max_abs"] == pytest.approx(0.1) and e["rmse"] == pytest.approx(0.1)
    assert e["rel_rmse"] == pytest.approx(0.1) and e["sqnr_db"] == pytest.approx(20.0)
    assert quant_error(x, x)["sqnr_db"] == float("inf")


def test_all_zero_groups_stay_zero():
    w = torch.zeros(4, 64)
    w[1] = torch.randn(64)
    for mode in ("absmax", "zeropoint"):
        back = dequantize_int8(quantize_int8(w, mode, "channel"))
        assert torch.isfinite(back).all() and (back[0] == 0).all()
    back = dequantize_nf4(*quantize_nf4(w))
    assert torch.isfinite(back).all() and (back[0] == 0).all()


def test_int8_linear():
    torch.manual_seed(0)
    lin = torch.nn.Linear(384, 256)
    layer = Int8Linear.from_linear(lin)
    assert layer.weight_codes.dtype == torch.int8 and layer.weight_scale.shape == (256,)
    assert not any(p.requires_grad for p in layer.parameters())  # frozen
    x = torch.randn(3, 5, 384, requires_grad=True)
    y = layer(x)
    torch.testing.assert_close(y, F.linear(x, layer.dequantized_weight(), lin.bias), rtol=0, atol=0)
    assert (y - lin(x)).abs().max() < 0.01
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    sd = layer.state_dict()
    assert sd["weight_codes"].dtype == torch.int8 and "weight" not in sd
    bf16 = Int8Linear.from_linear(lin, compute_dtype=torch.bfloat16)
    out = bf16(x)
    assert out.dtype == torch.float32  # back in the input's dtype
    torch.testing.assert_close(out, y, rtol=2e-2, atol=2e-2)
    zp = Int8Linear.from_linear(lin, mode="zeropoint", granularity="block", blocksize=128)
    assert zp.weight_codes.dtype == torch.uint8 and (zp(x) - lin(x)).abs().max() < 0.01


def test_int8_bad_input():
    w = torch.randn(8, 48)
    with pytest.raises(ValueError, match="unknown int8 mode"):
        quantize_int8(w, mode="minmax")
    with pytest.raises(ValueError, match="unknown granularity"):
        quantize_int8(w, granularity="rows")
    with pytest.raises(ValueError, match="does not divide"):
        quantize_int8(w, granularity="block", blocksize=256)
    for bad in (0, -64, 3.5, True):
        with pytest.raises(ValueError, match="positive integer"):
            quantize_int8(w, granularity="block", blocksize=bad)
    with pytest.raises(TypeError, match="floating-point"):
        quantize_int8(torch.ones(4, dtype=torch.long))
    with pytest.raises(ValueError, match="2-D"):
        Int8Linear(quantize_int8(torch.randn(64), granularity="tensor"))


# ----------------------------------------------------------------------------- NF4


def test_nf4_levels():
    levels = normal_float_map()
    torch.testing.assert_close(levels, NF4_CODE, rtol=0, atol=1.2e-7)
    assert (NF4_CODE < 0).sum() == 7 and (NF4_CODE == 0).sum() == 1 and (NF4_CODE > 0).sum() == 8
    assert NF4_CODE[0] == -1 and NF4_CODE[-1] == 1 and (NF4_CODE.diff() > 0).all()


def test_pack_high_nibble_first():
    idx = torch.tensor([1, 2, 15, 0, 7, 9], dtype=torch.uint8)
    packed = pack_nibbles(idx)
    assert packed.tolist() == [0x12, 0xF0, 0x79]
    assert torch.equal(unpack_nibbles(packed), idx)


def test_toy_equals_real_nf4():
    w = weights(4, 64)
    packed, state = quantize_nf4(w, double_quant=False)
    for b in range(4):
        idx, absmax = quantize_nf4_toy(w[b])
        assert torch.equal(idx, unpack_nibbles(packed)[64 * b:64 * (b + 1)])
        assert absmax == state.absmax[b]
        torch.testing.assert_close(dequantize_nf4_toy(idx, absmax), dequantize_nf4(packed, state)[b])


def test_nf4_ties_go_to_the_lower_level():
    mids = (NF4_CODE[1:] + NF4_CODE[:-1]) / 2
    block = torch.cat([torch.ones(1), mids, torch.zeros(48)])  # 64 values; absmax 1, so each mid is a tie
    idx = unpack_nibbles(quantize_nf4(block, double_quant=False)[0])
    assert idx[1:16].tolist() == list(range(15))


@pytest.mark.parametrize("double_quant", [False, True])
def test_nf4_bits_per_param(double_quant):
    w = weights(1024, 1024)
    packed, state = quantize_nf4(w, 64, double_quant)
    assert packed.dtype == torch.uint8 and packed.numel() == w.numel() // 2
    blocks = w.numel() // 64
    if double_quant:
        assert state.absmax.dtype == torch.uint8 and state.absmax_scale.shape == (blocks // 256,)
        expected = w.numel() // 2 + blocks + 4 * (blocks // 256) + 4  # codes, 8-bit absmax, fp32 per 256, offset
        assert bits_per_param_nf4(packed, state) == pytest.approx(4 + 8 / 64 + 32 / (64 * 256), abs=1e-4)
    else:
        expected = w.numel() // 2 + 4 * blocks
        assert bits_per_param_nf4(packed, state) == 4.5
    assert nbytes_nf4(packed, state) == expected == nf4_bytes_for(w.numel(), 64, double_quant)


@pytest.mark.parametrize("shape, blocksize", [((64, 64), 64), ((3, 128), 32), ((300, 64), 128), ((256, 256), 64)])
def test_nf4_bytes_formula_equals_what_quantize_nf4_keeps(shape, blocksize):
    """The one NF4 byte rule (nf4_bytes_for, which the estimator sums) against the tensors quantize_nf4 makes,
    including a last second-level group that is not full (blocks not a multiple of 256)."""
    w = torch.randn(shape)
    w0 = w.clone()
    for dq in (True, False):
        assert nbytes_nf4(*quantize_nf4(w, blocksize, dq)) == nf4_bytes_for(w.numel(), blocksize, dq)
    assert torch.equal(w, w0)  # the fp32 input is not normalised in place


def test_int8_bytes_formula_equals_what_quantize_int8_keeps():
    for shape in ((384, 384), (10, 7), (5,), (3, 4, 8)):
        for mode in ("absmax", "zeropoint"):
            for granularity, bs in (("tensor", None), ("channel", None), ("block", shape[-1])):
                q = quantize_int8(torch.randn(shape), mode, granularity, bs)
                assert q.nbytes == int8_bytes_for(shape, mode, granularity, bs), (shape, mode, granularity)
    assert int8_bytes_for((512, 256)) == 512 * 256 + 4 * 512  # per-row absmax: one fp32 scale per output row
    with pytest.raises(ValueError, match="does not divide"):
        int8_bytes_for((10, 7), "absmax", "block", 3)
    with pytest.raises(ValueError, match="unknown granularity"):
        int8_bytes_for((10, 7), "absmax", "row")


def test_nf4_error_is_bounded():
    w = weights()
    packed, state = quantize_nf4(w, double_quant=False)
    err = (dequantize_nf4(packed, state) - w).view(-1, 64).abs().amax(dim=1)
    assert (err <= NF4_CODE.diff().max() / 2 * state.absmax * (1 + 1e-6)).all()  # half the widest gap
    assert dequantize_nf4(packed, state, torch.bfloat16).dtype == torch.bfloat16


def test_nf4_bad_input():
    w = torch.randn(3, 64)
    for bad in (0, 7, -64, 64.0, True):
        with pytest.raises(ValueError, match="blocksize"):
            quantize_nf4(w, blocksize=bad)
    with pytest.raises(ValueError, match="does not divide"):
        quantize_nf4(w, blocksize=128)
    with pytest.raises(TypeError, match="floating-point"):
        quantize_nf4(torch.ones(64, dtype=torch.int32))
    packed, state = quantize_nf4(w)
    with pytest.raises(ValueError, match="do not fit"):
        dequantize_nf4(packed[:-1], state)


# ----------------------------------------------------------------------------- NF4 vs bitsandbytes


def _bnb_state(qs, shape):
    """A bitsandbytes QuantState as our NF4State."""
    nested = qs.nested
    return NF4State(qs.absmax, torch.Size(shape), qs.dtype, qs.blocksize,
                    qs.state2.absmax if nested else None, qs.offset if nested else None)


@pytest.mark.parity
def test_nf4_levels_equal_bitsandbytes():
    assert torch.equal(NF4_CODE, bnb.functional.get_4bit_type("nf4", device="cpu"))


@pytest.mark.parity
def test_nf4_ties_like_bitsandbytes():
    mids = (NF4_CODE[1:] + NF4_CODE[:-1]) / 2
    block = torch.cat([torch.ones(1), mids, -mids, torch.zeros(33)])  # exact ties, both signs
    ref, _ = bnb.functional.quantize_4bit(block, blocksize=64, quant_type="nf4", compress_statistics=False)
    assert torch.equal(quantize_nf4(block, double_quant=False)[0], ref.view(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parity
def test_nf4_codes_and_values_match_bitsandbytes(dtype):
    w = weights(768, 384).to(dtype)
    ref_packed, ref_state = bnb.functional.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
    packed, state = quantize_nf4(w, double_quant=False)
    # bitsandbytes' CPU 4-bit quantizer is its pure-PyTorch kernel: exact midpoints, ties to the lower level
    assert (unpack_nibbles(packed) == unpack_nibbles(ref_packed)).float().mean() >= 0.999
    assert torch.equal(packed, ref_packed.view(-1))  # in practice every byte agrees
    assert torch.equal(state.absmax, ref_state.absmax)
    torch.testing.assert_close(dequantize_nf4(packed, state), bnb.functional.dequantize_4bit(ref_packed, ref_state),
                               rtol=0, atol=0)


@pytest.mark.parity
def test_nf4_double_quant_matches_bitsandbytes():
    w = weights(1536, 384)
    ref_packed, ref_state = bnb.functional.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    packed, state = quantize_nf4(w, double_quant=True)
    assert torch.equal(packed, ref_packed.view(-1))
    assert torch.equal(state.absmax_offset, ref_state.offset)
    assert torch.equal(state.absmax_scale, ref_state.state2.absmax)
    # the absmax codes: bnb's native CPU blockwise kernel rounds approximately near the dynamic map's
    # decision boundaries (see test_quant_dynamic.py), so a few are one step apart
    q, ref_q = state.absmax.int(), ref_state.absmax.int()
    assert (q == ref_q).float().mean() >= 0.995 and ((q - ref_q).abs() <= 1).all()
    ref = bnb.functional.dequantize_4bit(ref_packed, ref_state)
    ours = dequantize_nf4(packed, state)
    same_block = (q == ref_q).repeat_interleave(64).view(w.shape)
    torch.testing.assert_close(ours[same_block], ref[same_block], rtol=1e-6, atol=1e-9)
    assert (ours - ref).abs().max() <= 0.01 * w.abs().max()
    # our dequantization reads bnb's own state: equal up to the dynamic map's float32 rounding (1 ulp)
    torch.testing.assert_close(dequantize_nf4(ref_packed, _bnb_state(ref_state, w.shape)), ref, rtol=1e-6, atol=1e-9)


def _linear4bit(bnb, lin, compute_dtype, double_quant):
    layer = bnb.nn.Linear4bit(lin.in_features, lin.out_features, quant_type="nf4",
                              compute_dtype=compute_dtype, compress_statistics=double_quant)
    layer.weight = bnb.nn.Params4bit(lin.weight.data.clone(), requires_grad=False, quant_type="nf4",
                                     compress_statistics=double_quant)
    layer.bias = torch.nn.Parameter(lin.bias.data.clone())
    layer = layer.to("cpu")  # Params4bit quantizes lazily, on its first .to(device): on CPU too
    assert layer.weight.bnb_quantized and layer.weight.dtype == torch.uint8
    return layer


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parity
def test_nf4_linear_matches_linear4bit(double_quant, compute_dtype):
    torch.manual_seed(0)
    lin = torch.nn.Linear(384, 512)
    ref_layer = _linear4bit(bnb, lin, compute_dtype, double_quant)
    ours = NF4Linear.from_linear(lin, double_quant=double_quant, compute_dtype=compute_dtype)
    same = NF4Linear(ref_layer.weight.data.view(-1), _bnb_state(ref_layer.weight.quant_state, (512, 384)),
                     lin.bias, compute_dtype)  # our layer on bnb's quantized weight
    assert not any(p.requires_grad for p in ours.parameters())
    x = torch.randn(4, 7, 384, requires_grad=True)
    ref = ref_layer(x)
    y_same, y_ours = same(x), ours(x)
    assert ref.dtype == y_ours.dtype == torch.float32
    if compute_dtype == torch.float32:
        torch.testing.assert_close(y_same, ref, rtol=1e-6, atol=1e-6)
        # with our own double quantization a few block scales differ by one 8-bit step: the outputs may
        # differ by at most |x| @ |W_ours - W_bnb|^T
        bound = x.abs() @ (ours.dequantized_weight() - same.dequantized_weight()).abs().T
        assert ((y_ours - ref).abs() <= bound + 1e-5).all()
        if not double_quant:
            torch.testing.assert_close(y_ours, ref, rtol=1e-6, atol=1e-6)
    else:  # bf16 matmuls: two bf16 rounding steps apart at most
        torch.testing.assert_close(y_same, ref, rtol=1.6e-2, atol=1.6e-2)
        torch.testing.assert_close(y_ours, ref, rtol=1.6e-2, atol=1.6e-2)
    (g_ref,) = torch.autograd.grad(ref.sum(), x)
    (g_ours,) = torch.autograd.grad(y_same.sum(), x)
    tol = 1e-5 if compute_dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(g_ours, g_ref, rtol=tol, atol=tol)  # only the input gets a gradient


@pytest.mark.parity
def test_dynamic_map_is_the_absmax_map():
    # the double-quantization map: ours and bnb's agree to float32 rounding, which is why our
    # dequantization of a bnb state is 1e-6-close rather than bit-equal
    torch.testing.assert_close(dynamic_map(), bnb.functional.create_dynamic_map(signed=True).float(),
                               rtol=0, atol=1e-7)
