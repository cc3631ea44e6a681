"""Master weights, gradient underflow and FP8: training parity, exact byte counts, flush fractions, FP8 errors."""

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.memory import Category, Ledger
from labkit.models.gpt import GPT, GPTConfig
from labkit.precision import (DynamicLossScaler, FP8Linear, FP8Recipe, MasterWeightsOptimizer, bytes_per_param,
                              dequantize_fp8, flush_fraction, fp8_error, fp8_memory_report, gradient_underflow_report,
                              make_masters, naive_master_step, outlier_demo, overflow_fraction, quantize_fp8,
                              scaled_mm_fp8, streamed_grad_peak, swap_to_fp8)

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32)
DATA = torch.randint(0, 256, (2, 8, 33), generator=torch.Generator().manual_seed(0))  # two batches, alternated


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny CPU matmuls run faster on one thread (and far faster on a loaded 2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _loss(m, i):  # the loss in fp32, whatever the model's dtype, as mixed precision does it
    x, y = DATA[i % 2, :, :-1], DATA[i % 2, :, 1:]
    return F.cross_entropy(m(x).float().flatten(0, 1), y.flatten())


def _train(kind, steps=20, lr=3e-3):
    torch.manual_seed(0)
    m = GPT(TINY)
    if kind == "master-bf16":
        opt = MasterWeightsOptimizer(m, torch.optim.AdamW, torch.bfloat16, lr=lr)
    else:
        if kind == "pure-bf16":  # no masters: AdamW steps the bf16 weights themselves
            m.to(torch.bfloat16)
        opt = torch.optim.AdamW(m.parameters(), lr=lr)
    losses = []
    for i in range(steps):
        loss = _loss(m, i)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# ---- master weights: training ------------------------------------------------------------------------
@pytest.mark.parity
def test_bf16_masters_track_fp32_training():
    ref, ours, pure = _train("fp32"), _train("master-bf16"), _train("pure-bf16")
    assert ref[0] - ref[-1] > 1.5  # it learns: 5.55 -> 3.66
    # Tolerance: 0.01 nats at every one of 20 steps (measured 0.0015). Without masters bf16 weights
    # round updates away and drift about 50x further (measured 0.08).
    assert max(abs(a - b) for a, b in zip(ours, ref)) < 0.01
    assert max(abs(a - b) for a, b in zip(pure, ref)) > 0.03


@pytest.mark.parity
def test_fp16_masters_with_scaler_behave_like_autocast_with_gradscaler():
    """A too-large initial scale overflows; both back off by skipping steps and end at a similar S."""
    init, steps = 2.0**24, 12
    torch.manual_seed(0)
    m = GPT(TINY)
    opt = MasterWeightsOptimizer(m, torch.optim.AdamW, "fp16", scaler=DynamicLossScaler(init), lr=3e-3)
    ours = []
    for i in range(steps):
        opt.scale(_loss(m, i)).backward()
        ours.append(opt.step())
    assert all(p.dtype == torch.float16 for p in m.parameters()) and all(torch.isfinite(p).all() for p in m.parameters())
    torch.manual_seed(0)
    m = GPT(TINY)
    o = torch.optim.AdamW(m.parameters(), lr=3e-3)
    sc = torch.amp.GradScaler("cpu", init_scale=init)
    theirs = []
    for i in range(steps):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _loss(m, i)
        sc.scale(loss).backward()
        before = sc.get_scale()
        sc.step(o)
        sc.update()
        o.zero_grad()
        theirs.append(sc.get_scale() >= before)
    skipped, skipped_ref = steps - sum(ours), steps - sum(theirs)
    assert skipped >= 3 and skipped_ref >= 3 and abs(skipped - skipped_ref) <= 1  # measured 7 and 7
    assert opt.skipped_steps == skipped
    assert 0.5 <= opt.scaler.get_scale() / sc.get_scale() <= 2.0
    assert ours[-1] and theirs[-1]  # both train once the scale fits


def test_unscaling_fp16_gradients_needs_masters():
    m = nn.Linear(4, 4).half()
    m(torch.randn(2, 4).half()).sum().backward()
    with pytest.raises(ValueError, match="fp16"):
        DynamicLossScaler().unscale_(torch.optim.SGD(m.parameters(), lr=0.1))


def test_teaching_and_real_versions_give_the_same_weights():
    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    x = torch.randn(16, 32).bfloat16()
    a, b = mlp(), mlp()
    opt = MasterWeightsOptimizer(a, torch.optim.AdamW, "bf16", lr=1e-2)
    working, masters = make_masters(b, torch.bfloat16)
    inner = torch.optim.AdamW(masters, lr=1e-2)
    for _ in range(3):
        a(x).float().square().mean().backward()
        opt.step()
        b(x).float().square().mean().backward()
        naive_master_step(working, masters, inner)
    for p, q, m1, m2 in zip(a.parameters(), b.parameters(), opt.masters, masters):
        assert torch.equal(p, q) and torch.equal(m1, m2)
        assert torch.equal(p, m1.to(torch.bfloat16)) and p.grad is None and m1.grad is None


def test_state_dict_round_trip():
    m = nn.Linear(8, 8)
    opt = MasterWeightsOptimizer(m, torch.optim.AdamW, "bf16", scaler=DynamicLossScaler(2.0**8), lr=1e-2)
    x = torch.randn(4, 8).bfloat16()

    def step():
        opt.scale(m(x).float().square().mean()).backward()
        opt.step()
    step()
    saved, weight = copy.deepcopy(opt.state_dict()), m.weight.detach().clone()
    step()
    opt.load_state_dict(saved)
    assert torch.equal(m.weight, weight) and torch.equal(opt.masters[0], saved["masters"][0])
    assert opt.state[opt.masters[0]]["step"].item() == 1


# ---- master weights: bytes per parameter, measured ------------------------------------------------------
def _mlp():
    torch.manual_seed(0)  # every parameter enters a matmul, so autocast copies all of them
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32))


def _measure(scheme, naive=False):
    m, x = _mlp(), torch.randn(16, 64)
    if scheme == "fp32" or scheme == "autocast":
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False)
        numels = [p.numel() for p in m.parameters()]

        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=scheme == "autocast"):
                loss = m(x).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    else:
        low = torch.float16 if scheme == "master-fp16" else torch.bfloat16
        scaler = DynamicLossScaler(2.0**8) if low == torch.float16 else None
        if naive:
            working, masters = make_masters(m, low)
            opt = torch.optim.AdamW(masters, lr=1e-3, foreach=False)
        else:
            opt = MasterWeightsOptimizer(m, torch.optim.AdamW, low, scaler=scaler, lr=1e-3, foreach=False)
        numels, x = [p.numel() for p in m.parameters()], x.to(low)

        def step():
            loss = m(x).float().square().mean()
            (scaler.scale(loss) if scaler else loss).backward()
            naive_master_step(working, masters, opt, scaler) if naive else opt.step()
    step()  # warm-up: Adam's state exists, as in steady state
    with Ledger(m, opt) as led:
        step()
        step()
    series = led.measurement().timeline.bytes
    return {c: max(series[c]) for c in (Category.PARAM, Category.GRAD, Category.OPT)}, numels, (led, m, opt)


@pytest.mark.parametrize("scheme", ["fp32", "autocast", "master-bf16", "master-fp16"])
def test_measured_bytes_per_parameter_equal_the_formula(scheme):
    peak, numels, _ = _measure(scheme)
    N, T, bpp = sum(numels), len(numels), bytes_per_param(scheme, "adamw")
    assert peak[Category.PARAM] == bpp.param * N  # fp32: 4N; autocast: 4N + 2N copies; master: 2N + 4N
    assert peak[Category.OPT] == bpp.opt * N + 4 * T  # m and v in fp32 + a 4-byte step counter per tensor
    if scheme.startswith("master"):  # one 16-bit gradient at a time is alive beside the fp32 ones
        assert peak[Category.GRAD] == streamed_grad_peak(numels, 2) < bpp.grad * N
        assert peak[Category.GRAD] <= 4 * N + 2 * max(numels)
    else:
        assert peak[Category.GRAD] == bpp.grad * N
    assert (bpp.total, bytes_per_param("fp32").total, bytes_per_param("autocast").total) == (
        {"fp32": 16, "autocast": 18}.get(scheme, 20), 16, 18)


def test_teaching_version_holds_all_16bit_gradients_at_once():
    peak, numels, _ = _measure("master-bf16", naive=True)
    assert peak[Category.GRAD] == bytes_per_param("master-bf16").grad * sum(numels)  # 2 + 4 = 6 per parameter


def test_ledger_tags_masters_as_parameters():
    _, numels, (led, model, opt) = _measure("master-bf16")
    params = led.live_tensors(Category.PARAM)  # live while model and opt are
    by_dtype = {}
    for _, _, dtype, nbytes, _ in params:
        by_dtype[dtype] = by_dtype.get(dtype, 0) + nbytes
    assert by_dtype == {"float32": 4 * sum(numels), "bfloat16": 2 * sum(numels)}


# ---- underflow ----------------------------------------------------------------------------------------
def test_flush_fraction_exact_values():
    x = torch.tensor([2.0**-26, 2.0**-25, 2.0**-24, 1.0, 0.0])  # 4 nonzero; fp16 rounds |x| <= 2**-25 to 0
    assert flush_fraction(x, torch.float16) == 0.5
    assert flush_fraction(x, "fp16", scale=2.0) == 0.25
    assert flush_fraction(x, "bf16") == 0.0
    assert overflow_fraction(torch.tensor([1.0, 1e3]), "fp16", scale=2.0**8) == 0.5  # 256000 > 65504
    assert overflow_fraction(torch.tensor([1.0]), "fp16", scale=2.0**16) == 1.0  # 65536 rounds to inf


def test_flush_fraction_on_log_uniform_values():
    x = torch.logspace(-10, -2, 100_001, dtype=torch.float64)  # 8 decades, log-uniform
    expected = (math.log10(2.0**-25) + 10) / 8  # the share below fp16's rounding-to-zero threshold
    assert abs(flush_fraction(x, torch.float16) - expected) < 1e-4  # 0.309
    assert flush_fraction(x, torch.float16, scale=2.0**16) == 0.0  # 1e-10 * 65536 > 2**-25
    assert flush_fraction(x, torch.bfloat16) == 0.0
    assert overflow_fraction(x, torch.float16, scale=2.0**16) == 0.0


def test_gradient_underflow_on_a_tiny_gpt():
    torch.manual_seed(0)
    m = GPT(TINY)
    r = gradient_underflow_report(m, _loss(m, 0))
    assert r.n_values > 100_000 and all(p.grad is None for p in m.parameters())
    assert r.fp16[1.0] > r.fp16[2.0**16] and r.fp16[1.0] > 1e-4  # measured 1.2e-3 vs 3e-5
    assert r.bf16 == 0.0 and r.fp16_overflow[2.0**16] == 0.0


# ---- FP8 ----------------------------------------------------------------------------------------------
GRANS = [("tensor", None, ()), ("row", None, (256, 1)), ("block", (1, 128), (256, 2)), ("block", (128, 128), (2, 2))]


@pytest.mark.parametrize("gran, block, shape", GRANS)
def test_quantize_scales_saturates_and_round_trips(gran, block, shape):
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    x8, s = quantize_fp8(x, "e4m3", gran, block)
    assert x8.dtype == torch.float8_e4m3fn and x8.shape == x.shape and s.shape == shape and s.dtype == torch.float32
    assert x8.float().abs().max() == 448.0  # each group's amax lands on e4m3's max
    again = quantize_fp8(dequantize_fp8(x8, s), "e4m3", gran, block)
    assert torch.equal(again[0].float(), x8.float())  # quantizing an fp8 grid is lossless
    assert fp8_error(x, "e4m3", gran, block) < 0.035 and fp8_error(x, "e5m2", gran, block) < 0.07  # 3 vs 2 mantissa bits


def test_tensorwise_scale_formula_and_saturation():
    x = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
    x8, s = quantize_fp8(x, "e5m2")
    assert s.item() == 57344.0 / 4.0
    assert torch.equal(dequantize_fp8(x8, s), x)
    x8, s = quantize_fp8(torch.zeros(2, 16), "e4m3", "row")  # all-zero groups: finite scale, zeros
    assert torch.isfinite(s).all() and (x8.float() == 0).all()


def test_one_outlier_costs_per_tensor_scaling_its_small_values():
    d = outlier_demo(outlier=1e4)
    t, row, tile, blk = (d[k] for k in ("tensor", "row", "block 1x128", "block 128x128"))
    assert t["error_small"] > 2 * max(row["error_small"], tile["error_small"])  # 0.058 vs 0.023
    assert t["error_small"] > blk["error_small"] > max(row["error_small"], tile["error_small"])
    assert t["flushed"] > 3 * blk["flushed"] > 30 * row["flushed"]  # 1.7% vs 0.48% vs 0.01%


@pytest.mark.parity
def test_fp8_linear_forward_close_and_backward_straight_through():
    torch.manual_seed(0)
    ref = nn.Linear(256, 128)
    x = torch.randn(4, 10, 256, requires_grad=True)
    r = torch.randn(4, 10, 128)
    (ref(x) * r).sum().backward()
    gx, gw, gb = x.grad.clone(), ref.weight.grad.clone(), ref.bias.grad.clone()
    x.grad, ref.weight.grad, ref.bias.grad = None, None, None
    for recipe in (FP8Recipe(), FP8Recipe("block", "block"), FP8Recipe("tensor", "row")):
        layer = FP8Linear.from_linear(ref, recipe)
        y = layer(x)
        assert y.shape == (4, 10, 128)
        assert ((y - ref(x)).norm() / ref(x).norm()) < 0.06  # e4m3 on both operands
        (y * r).sum().backward()
        torch.testing.assert_close(x.grad, gx)  # straight-through: the fp32 linear's own gradients
        torch.testing.assert_close(ref.weight.grad, gw)
        torch.testing.assert_close(ref.bias.grad, gb)
        x.grad, ref.weight.grad, ref.bias.grad = None, None, None


@pytest.mark.parity
def test_scaled_mm_plumbing_matches_emulation_on_cpu():
    """torch._scaled_mm has a CPU kernel (torch 2.13, the CPU build the Makefile installs): check the
    reciprocal scales and the K-blocked loop here."""
    torch.manual_seed(0)
    x, w = torch.randn(40, 256), torch.randn(128, 256) * 0.05
    for act in ("tensor", "row", "block"):
        for wt in ("tensor", "row", "block"):
            recipe = FP8Recipe(act, wt)
            ab, wb = recipe.blocks()
            x8, sx = quantize_fp8(x, "e4m3", act, ab)
            w8, sw = quantize_fp8(w, "e4m3", wt, wb)
            emu = dequantize_fp8(x8, sx) @ dequantize_fp8(w8, sw).t()
            real = scaled_mm_fp8(x8, sx, w8, sw, recipe, out_dtype=torch.float32)
            assert real.shape == (40, 128) and (real - emu).norm() / emu.norm() < 5e-3  # bf16 partial sums


def test_real_kernel_on_cpu_raises():
    layer = FP8Linear(32, 32, recipe=FP8Recipe(kernel="scaled_mm"))
    with pytest.raises(RuntimeError, match="Ada/Hopper") as e:
        layer(torch.randn(2, 32))
    assert "\n" not in str(e.value)


def test_swap_to_fp8_keeps_tied_weights_and_trains():
    torch.manual_seed(0)
    m = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=128, block_size=32))
    ref = _loss(m, 0).item()
    swap_to_fp8(m, FP8Recipe("block", "block"), filter_fn=lambda name, mod: name != "lm_head")
    assert type(m.lm_head) is nn.Linear and isinstance(m.blocks[0].mlp.c_fc, FP8Linear)
    assert m.lm_head.weight is m.wte.weight
    loss = _loss(m, 0)
    loss.backward()
    assert abs(loss.item() - ref) < 0.01 and m.blocks[0].mlp.c_fc.weight.grad is not None


def test_fp8_keeps_at_least_the_bytes_of_bf16():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256))
    rep = fp8_memory_report(model, torch.randn(64, 256))
    assert rep.peaks["fp8"] >= rep.peaks["bf16"] > 0  # FP8 buys speed, not memory


# ---- bad input -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("call, arg", [
    (lambda: quantize_fp8(torch.randn(4, 128), fmt="e3m4"), "fmt"),
    (lambda: quantize_fp8(torch.randn(4, 128), granularity="column"), "granularity"),
    (lambda: quantize_fp8(torch.randn(4, 128), granularity="block", block=(1, 100)), "block"),
    (lambda: quantize_fp8(torch.randn(4, 128), granularity="block", block=(0, 128)), "block"),
    (lambda: quantize_fp8(torch.randn(4, 128), granularity="row", block=(1, 128)), "block"),
    (lambda: quantize_fp8(torch.arange(4), "e4m3"), "x"),
    (lambda: fp8_error(torch.randn(4, 128), "e4m3", "block", (128, 128)), "block"),
    (lambda: FP8Recipe(activation="col"), "activation"),
    (lambda: FP8Recipe(weight="tile"), "weight"),
    (lambda: FP8Recipe(kernel="cublas"), "kernel"),
    (lambda: FP8Linear(100, 128, recipe=FP8Recipe("block")), "in_features"),
    (lambda: FP8Linear(128, 100, recipe=FP8Recipe(weight="block")), "out_features"),
    (lambda: flush_fraction(torch.randn(4), torch.float32), "dtype"),
    (lambda: flush_fraction(torch.randn(4), "fp16", scale=-1), "scale"),
    (lambda: flush_fraction([1.0], "fp16"), "tensor"),
    (lambda: bytes_per_param("fp8"), "scheme"),
    (lambda: bytes_per_param("fp32", "lamb"), "optimizer"),
    (lambda: MasterWeightsOptimizer(nn.Linear(2, 2), torch.optim.SGD, torch.float32, lr=0.1), "dtype"),
    (lambda: MasterWeightsOptimizer(nn.Linear(2, 2), "adamw", lr=0.1), "optimizer_cls"),
])
def test_bad_input_raises_one_line_value_error(call, arg):
    with pytest.raises(ValueError, match=arg) as e:
        call()
    assert "\n" not in str(e.value)
