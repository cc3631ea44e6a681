"""Group-wise int4 (round-to-nearest) and AWQ: a hand-worked small case step by step against the paper's
procedure, bytes against the formula, folding is exact, AWQ beats RTN where a few channels are salient,
and clear errors for bad input. (The comparison with AutoAWQ itself is bench/awq_parity.py.)"""

import copy
import math

import pytest
import torch
import torch.nn as nn

from labkit.models.gpt import GPT, GPTConfig
from labkit.quant import (
    AWQConfig,
    Int4Linear,
    awq_groups,
    awq_linear,
    awq_quantize,
    awq_scale,
    collect_inputs,
    dequantize_int4,
    fake_quantize_int4,
    input_stats,
    int4_bytes_for,
    keep_salient,
    linear_names,
    quantize_int4,
    rtn_quantize,
    search_clip,
    search_scale,
)
from labkit.quant.awq import _fold, output_mse, scaled_weight_error
from labkit.quant.int4 import INT4_DEQUANT_BYTES_PER_WEIGHT, int4_codes

F32 = torch.finfo(torch.float32).eps


# ---- int4 round to nearest, by hand ---------------------------------------------------------------------
@pytest.mark.parity
def test_int4_round_trip_by_hand():
    # one group of 4: min -0.25, max 0.6875 -> step 0.9375 / 15 = 0.0625 (exact in fp16), zero 0.25/0.0625 = 4
    w = torch.tensor([[0.125, -0.25, 0.3125, 0.6875], [0.1, 0.0, 0.0, 0.0]])
    q = quantize_int4(w, group=4)
    assert q.scale[0, 0].item() == 0.0625 and q.zero[0, 0].item() == 4
    assert int4_codes(q)[0].tolist() == [6, 0, 9, 15]  # round(w / step) + zero
    assert q.packed[:2].tolist() == [6 << 4 | 0, 9 << 4 | 15]  # two codes per byte, the first in the high nibble
    assert dequantize_int4(q)[0].tolist() == w[0].tolist()  # every value is on the grid: exact
    # row 2: [0, 0.1] -> step 0.1/15 (rounded to fp16), zero 0, 0.1 -> code 15 and back to 15 fp16 steps
    step = torch.tensor(0.1 / 15).half().float().item()
    assert q.zero[1, 0].item() == 0 and dequantize_int4(q)[1, 0].item() == pytest.approx(15 * step, rel=F32)
    assert torch.equal(dequantize_int4(q), fake_quantize_int4(w, 4))


def test_int4_error_is_at_most_half_a_step():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    q = quantize_int4(w, 64)
    err = (dequantize_int4(q) - w).abs().view(64, 4, 64)
    assert (err <= q.scale.float()[..., None] / 2 * (1 + 8 * F32)).all()


@pytest.mark.parametrize("shape,group,kept", [((64, 256), 128, False), ((384, 1536), 128, True),
                                              ((96, 64), 32, True), ((128, 128), 64, False)])
def test_bytes_equal_the_formula(shape, group, kept):
    lin = nn.Linear(shape[1], shape[0])
    s = torch.rand(shape[1]) + 0.5 if kept else None
    layer = Int4Linear.from_linear(lin, group, input_scale=s)
    n = shape[0] * shape[1]
    expected = n // 2 + 3 * n // group + (2 * shape[1] if kept else 0)
    assert layer.nbytes == int4_bytes_for(shape, group, kept) == expected
    held = sum(t.numel() * t.element_size() for t in layer.buffers())
    assert held == expected
    assert layer.nbytes * 8 / n == pytest.approx(4 + 24 / group + (16 / shape[0] if kept else 0))


def test_int4_linear_output_and_input_gradient():
    torch.manual_seed(0)
    lin = nn.Linear(128, 32)
    s = torch.rand(128) + 0.5
    layer = Int4Linear.from_linear(lin, 64, input_scale=s)
    w_hat = fake_quantize_int4(lin.weight * s.half().float(), 64) / s.half().float()
    assert torch.allclose(layer.dequantized_weight(), w_hat, rtol=4 * F32, atol=0)
    x = torch.randn(5, 128, requires_grad=True)
    y = layer(x)
    torch.testing.assert_close(y, x @ w_hat.T + lin.bias, rtol=128 * F32, atol=128 * F32)
    y.sum().backward()
    torch.testing.assert_close(x.grad, w_hat.sum(0).expand(5, -1), rtol=64 * F32, atol=64 * F32)
    assert not any(p.requires_grad for p in layer.buffers())


def test_dequantize_peak_is_the_stated_bytes_per_weight():
    from labkit.memory import Ledger

    q = quantize_int4(torch.randn(256, 512), 128)
    for dtype in (torch.float32, torch.bfloat16):
        with Ledger() as led:
            w = dequantize_int4(q, dtype)
            del w
        peak = max(b.total for b in led.measurement().phases.values())
        assert peak == INT4_DEQUANT_BYTES_PER_WEIGHT * 256 * 512, dtype


# ---- AWQ, step by step on a hand-worked case ----------------------------------------------------------------
@pytest.mark.parity
def test_awq_steps_by_hand():
    """The paper's procedure on a 1 x 4 weight, one group, two tokens, channel 0 salient."""
    x = torch.tensor([[8.0, 1.0, -1.0, 2.0], [-8.0, -1.0, 1.0, 2.0]])
    w = torch.tensor([[0.3, -0.2, 0.5, 0.1]])
    # 1. s_x = mean |x| per channel
    st = input_stats(x)
    assert st.mean_abs.tolist() == [8.0, 1.0, 1.0, 2.0] and st.tokens == 2
    # 2. s = s_x^alpha / sqrt(max * min): alpha 0.5 -> [sqrt 8, 1, 1, sqrt 2] / 8^(1/4)
    s = awq_scale(st.mean_abs, 0.5)
    by_hand = [math.sqrt(8) / 8 ** 0.25, 1 / 8 ** 0.25, 1 / 8 ** 0.25, math.sqrt(2) / 8 ** 0.25]
    assert s.tolist() == pytest.approx(by_hand, rel=2 * F32)
    # 3. Q(W s) / s: one group; min and max of W s set the step, zero = round(-min / step)
    ws = [wi * si for wi, si in zip(w[0].tolist(), by_hand)]
    step = (max(ws) - min(min(ws), 0)) / 15
    zero = round(-min(ws) / step)
    w_hat = [(min(max(round(v / step) + zero, 0), 15) - zero) * step / si for v, si in zip(ws, by_hand)]
    lib = fake_quantize_int4(w * s, 4, scale_dtype=torch.float32) / s
    assert lib[0].tolist() == pytest.approx(w_hat, rel=16 * F32, abs=16 * F32)
    # 4. the error: mean over tokens and outputs of (x w_hat^T - x w^T)^2
    err = sum(sum(xi * (a - b) for xi, a, b in zip(row, w_hat, w[0].tolist())) ** 2 for row in x.tolist()) / 2
    assert scaled_weight_error([w], st, s, 4, torch.float32) == pytest.approx(err, rel=1e-5, abs=1e-9)
    # 5. the search: the alpha of the grid with the smallest error (ties to the smaller alpha), alpha 0 = RTN
    res = search_scale([w], x, group=4, scale_dtype=torch.float32)
    direct = [((x @ (fake_quantize_int4(w * awq_scale(st.mean_abs, a), 4, scale_dtype=torch.float32)
                    / awq_scale(st.mean_abs, a)).T - x @ w.T) ** 2).mean().item() for a in res.alphas]
    assert res.errors == pytest.approx(direct, rel=1e-4, abs=1e-9)
    assert res.alphas == [i / 20 for i in range(20)] and res.alpha == res.alphas[direct.index(min(direct))]
    assert res.rtn_error == pytest.approx(((x @ (fake_quantize_int4(w, 4, scale_dtype=torch.float32) - w).T) ** 2)
                                          .mean().item(), rel=1e-4)
    assert res.best_error < res.rtn_error  # here scaling the salient channel pays


def test_gram_error_equals_the_direct_error():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(300, 128, generator=g), torch.randn(40, 128, generator=g)
    w_hat = fake_quantize_int4(w, 64)
    direct = ((x @ w_hat.T - x @ w.T) ** 2).mean().item()
    assert output_mse(w, w_hat, input_stats(x)) == pytest.approx(direct, rel=1e-4)


@pytest.mark.parity
def test_clip_search_by_brute_force():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(200, 128, generator=g), torch.randn(8, 128, generator=g)
    w[0, 3] = 8.0  # an outlier weight: clipping it pays
    ratios = search_clip(w, x, 64)
    grid = [1 - i / 20 for i in range(10)]
    for r in range(8):
        for k in range(2):
            cols = slice(64 * k, 64 * k + 64)
            errs = []
            for c in grid:
                clip = torch.ones(8, 2)
                clip[r, k] = c
                d = fake_quantize_int4(w, 64, clip)[r, cols] - w[r, cols]
                errs.append(((x[:, cols] @ d) ** 2).mean().item())
            best = min(range(10), key=lambda i: (errs[i], i))
            assert ratios[r, k].item() == pytest.approx(grid[best]), (r, k, errs)
    assert ratios[0, 0] < 1


def salient_layer(seed=0, d_in=256, d_out=64, tokens=512):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, d_in, generator=g)
    x[:, :3] *= 40  # three salient channels (about 1 %)
    return x, torch.randn(d_out, d_in, generator=g) * 0.02


def test_awq_beats_rtn_on_salient_channels():
    x, w = salient_layer()
    res = search_scale([w], x, group=128)
    assert res.alpha > 0 and res.best_error < 0.7 * res.rtn_error
    st = input_stats(x)
    lin = nn.Linear(256, 64, bias=False)
    lin.weight.data = w.clone()
    awq = Int4Linear.from_linear(lin, 128, input_scale=res.scale)
    rtn = Int4Linear.from_linear(lin, 128)
    assert output_mse(w, awq.dequantized_weight(), st) < 0.7 * output_mse(w, rtn.dequantized_weight(), st)
    # the paper's table 1: keeping the 1 % salient channels (by activation) in full precision helps too
    kept = nn.Linear(256, 64, bias=False)
    kept.weight.data = w.clone()
    stats = {"": st}
    keep_salient(kept, stats, 128, 0.01, "activation")
    assert output_mse(w, kept.weight, st) < output_mse(w, rtn.dequantized_weight(), st)


# ---- the whole model: folding, groups, report ------------------------------------------------------------
def tiny_gpt(seed=0):
    torch.manual_seed(seed)
    m = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=64))
    with torch.no_grad():  # LayerNorm gains with a few large channels, as trained models have
        for blk in m.blocks:
            for ln in (blk.ln_1, blk.ln_2):
                ln.weight.mul_(torch.rand(64) + 0.5)
                ln.weight[:2] *= 10
                ln.bias.normal_(0, 0.1)
            blk.attn.c_attn.bias.normal_(0, 0.1)
    return m.eval()


def test_gpt_groups_fold_where_the_paper_does():
    m = tiny_gpt()
    groups = {g.linears[0]: g for g in awq_groups(m, linear_names(m))}
    assert groups["blocks.0.attn.c_attn"].prev == "blocks.0.ln_1"
    assert groups["blocks.0.attn.c_proj"].prev == "blocks.0.attn.c_attn"
    assert groups["blocks.0.attn.c_proj"].prev_rows == (128, 192)  # the v rows of the fused q, k, v
    assert groups["blocks.0.mlp.c_fc"].prev == "blocks.0.ln_2"
    assert groups["blocks.0.mlp.c_proj"].prev is None  # after the GELU: kept
    assert "lm_head" not in groups  # tied to the embedding


def test_folding_is_exact():
    m = tiny_gpt()
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = m(idx)
        for g in awq_groups(m, linear_names(m)):
            if g.prev is not None:
                d_in = m.get_submodule(g.linears[0]).in_features
                _fold(m, g, torch.rand(d_in, generator=torch.Generator().manual_seed(1)) * 3 + 0.2)
        torch.testing.assert_close(m(idx), ref, rtol=1e-4, atol=1e-4)  # fp32 through 2 blocks, scales <= 3.2


def test_awq_model_beats_rtn_and_bytes_match():
    m = tiny_gpt()
    gen = torch.Generator().manual_seed(0)
    calib = [torch.randint(0, 64, (4, 32), generator=gen) for _ in range(2)]
    test = torch.randint(0, 64, (4, 32), generator=gen)
    with torch.no_grad():
        ref = m(test)
    rtn, awq = rtn_quantize(copy.deepcopy(m), 64), copy.deepcopy(m)
    report = awq_quantize(awq, calib, AWQConfig(64))
    with torch.no_grad():
        e_rtn, e_awq = ((rtn(test) - ref) ** 2).mean(), ((awq(test) - ref) ** 2).mean()
    assert e_awq < e_rtn
    assert set(report.alpha) == set(linear_names(m)) and report.folded["blocks.1.mlp.c_proj"] is None
    assert all(report.awq_error[n] <= report.rtn_error[n] for n in report.alpha)
    for name in linear_names(m):
        layer = awq.get_submodule(name)
        assert isinstance(layer, Int4Linear)
        kept = report.folded[name] is None
        assert (layer.input_scale is not None) == kept
        assert layer.nbytes == int4_bytes_for((layer.out_features, layer.in_features), 64, kept)


def test_awq_config_checks_its_fields_and_reaches_every_search():
    """One ValueError per bad field; awq_quantize without folding makes, layer by layer, what awq_linear makes
    with the same config (its grid of alphas, paper's scale form, no clip search)."""
    for bad, msg in ((dict(group=3), "^group must be an even integer"), (dict(grid=0), "^grid must be a positive"),
                     (dict(duo=1), "^duo must be True or False"), (dict(clip="yes"), "^clip must be True or False")):
        with pytest.raises(ValueError, match=msg):
            AWQConfig(**bad)
    m = tiny_gpt()
    calib = [torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(0))]
    stats = collect_inputs(m, linear_names(m), calib)
    cfg = AWQConfig(64, grid=5, duo=False, clip=False)
    awq = copy.deepcopy(m)
    report = awq_quantize(awq, None, cfg, fold=False, stats=stats)
    assert set(report.alpha.values()) <= {i / 5 for i in range(5)}
    for n in linear_names(m):
        one, got = awq_linear(m.get_submodule(n), stats[n], cfg).state_dict(), awq.get_submodule(n).state_dict()
        assert one.keys() == got.keys() and all(torch.equal(one[k], got[k]) for k in one)


def test_collect_inputs_is_mean_abs_and_gram_over_all_tokens():
    m = tiny_gpt()
    calib = [torch.randint(0, 64, (3, 8), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    seen = []
    h = m.blocks[0].mlp.c_proj.register_forward_pre_hook(lambda mod, a: seen.append(a[0].reshape(-1, 256)))
    st = collect_inputs(m, ["blocks.0.mlp.c_proj"], calib)["blocks.0.mlp.c_proj"]
    h.remove()
    x = torch.cat(seen)
    assert st.tokens == 48
    torch.testing.assert_close(st.mean_abs, x.abs().mean(0))
    torch.testing.assert_close(st.gram, x.T @ x / 48)


# ---- bad input ------------------------------------------------------------------------------------------
def test_bad_input_errors():
    lin = nn.Linear(96, 8)
    with pytest.raises(ValueError, match="group size 64 does not divide the 96 input features"):
        Int4Linear.from_linear(lin, 64)
    with pytest.raises(ValueError, match="does not divide"):
        int4_bytes_for((8, 96), 128)
    with pytest.raises(ValueError, match="even integer"):
        quantize_int4(torch.randn(8, 96), 3)
    m = tiny_gpt()
    with pytest.raises(ValueError, match="AWQ needs calibration data"):
        awq_quantize(m, [], AWQConfig(64))
    with pytest.raises(ValueError, match="AWQ needs calibration data"):
        awq_quantize(m, None, AWQConfig(64))
    with pytest.raises(ValueError, match="group size 128 does not divide the 64 input features of blocks.0.attn.c_attn"):
        awq_quantize(m, [torch.zeros(1, 4, dtype=torch.long)], AWQConfig(128))
    with pytest.raises(ValueError, match="one value per input feature"):
        Int4Linear.from_linear(nn.Linear(64, 8), 64, input_scale=torch.ones(8))


# ---- the estimator and the command line: --quant int4 / int4-awq under LoRA ---------------------------------
from labkit.cli import main  # noqa: E402
from labkit.estimate import Recipe, estimate  # noqa: E402
from labkit.estimate.spec import spec_from  # noqa: E402
from labkit.estimate.peft_terms import resolve_targets  # noqa: E402
from labkit.memory import Category  # noqa: E402
from labkit.run import build_model, measure_step  # noqa: E402

G64 = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64)


# quant_set "targets" (torchtune's): only q and v are int4; group 32 would not divide the 172 inputs
# of llama-tiny's down_proj, which the default "all-linear" set (transformers + bitsandbytes')
# quantizes too; group 4 does
@pytest.mark.parametrize("model,group,quant,dtype,targets,qset", [
    (G64, 64, "int4-awq", "fp32", "all-linear", "all-linear"),
    (G64, 32, "int4", "fp32", "all-linear", "all-linear"),
    ("llama-tiny", 32, "int4-awq", "fp32", "q_proj,v_proj", "targets"),
    ("llama-tiny", 4, "int4-awq", "fp32", "q_proj,v_proj", "all-linear"),
    ("gpt2-tiny", 64, "int4-awq", "fp32", "all-linear", "all-linear"),
    (G64, 64, "int4-awq", "mixed-bf16", "all-linear", "all-linear")])
def test_estimate_equals_the_ledger(model, group, quant, dtype, targets, qset):
    torch.set_num_threads(1)
    kw = dict(lora_rank=8, quant=quant, quant_group=group, lora_targets=targets, quant_set=qset)
    e = estimate(model, 2, 32, dtype, "adamw", **kw)
    m = measure_step(Recipe.of(model, 2, 32, dtype=dtype, optimizer="adamw", **kw), steps=2)
    assert abs(e.peak.total - m.peak.total) <= 0.03 * m.peak.total, (e.peak.total, m.peak.total)
    for phase, cat in (("optimizer", Category.GRAD), ("backward", Category.OPT), ("optimizer", Category.PARAM)):
        assert e.phases[phase][cat] == m.phases[phase][cat], (phase, cat)
    own = sum(b.numel() * b.element_size() for b in build_model(model, dtype).buffers())  # e.g. rotary inv_freq
    assert e.phases["optimizer"][Category.BUFFER] + own == m.phases["optimizer"][Category.BUFFER]
    # the buffers are the formula's: n/2 + 3 n/group (+ 2 d_in, AWQ's kept scale) per quantized one
    stored = resolve_targets(spec_from(model), targets if qset == "targets" else "all-linear")
    formula = sum(d_in * d_out // 2 + 3 * d_in * d_out // group + (2 * d_in if quant == "int4-awq" else 0)
                  for _, d_in, d_out, _ in stored)
    assert e.phases["optimizer"][Category.BUFFER] == formula


def test_int4_awq_sits_between_int8_and_nf4_bases():
    kw = dict(lora_rank=16)
    b = {q: estimate("llama2-7b", 1, 1024, "bf16", "adamw", device="cuda", quant=q, **kw).phases["optimizer"]
         [Category.BUFFER] for q in ("int8", "nf4", "int4", "int4-awq")}
    assert b["int8"] > b["int4-awq"] > b["int4"] > b["nf4"]  # 4.19 (+ the kept scales) vs 4.127 bits per weight


@pytest.mark.parametrize("kw, match", [
    (dict(lora_rank=8, quant="int4-awq"), "quant_group: int4 group size 128 does not divide the 64 input "
                                          "features of LoRA target blocks.0.attn.c_attn"),
    (dict(lora_rank=8, quant="int4", quant_group=48), "does not divide the 64 input features"),
    (dict(lora_rank=8, quant="int4", quant_group=0), "quant_group must be a positive integer"),
    (dict(lora_rank=8, quant="nf4", quant_group=64), "quant_group is int4's group size"),
])
def test_bad_int4_options(kw, match):
    with pytest.raises(ValueError, match=match):
        estimate(G64, 2, 16, **kw)


def test_apply_peft_awq_needs_calibration():
    from labkit.run.step import apply_peft

    with pytest.raises(ValueError, match="AWQ needs calibration data"):
        apply_peft(build_model(G64), "fp32", 8, "all-linear", "int4-awq", None, 64, calib=None)


def test_cli_quant_int4_awq(capsys):
    import json

    base = ["estimate", "--model", "gpt2-tiny", "--batch", "2", "--seq", "32", "--dtype", "fp32", "--device", "cpu",
            "--json", "--lora-rank", "8"]
    code = main(base + ["--quant", "int4-awq", "--quant-group", "32"])
    d = json.loads(capsys.readouterr()[0])
    e = estimate("gpt2-tiny", 2, 32, "fp32", "adamw", lora_rank=8, quant="int4-awq", quant_group=32)
    assert code == 0 and d["peak"] == e.peak.total and d["options"]["quant_group"] == 32
    code = main([a for a in base if a != "--json"] + ["--quant", "int4-awq", "--quant-group", "64", "--all-terms"])
    assert code == 0 and "INT4-AWQ frozen base (buffers)" in capsys.readouterr()[0]


@pytest.mark.parametrize("argv, message", [
    (["--quant", "nf4", "--quant-group", "64"], "--quant-group 64 is int4's group size"),
    (["--quant", "int4-awq", "--quant-group", "0"], "--quant-group must be a positive integer"),
    (["--quant", "int4-awq"], "--quant-group: int4 group size 128 does not divide the 64 input features"),
])
def test_cli_bad_int4_input_is_one_line_and_status_2(capsys, argv, message):
    code = main(["estimate", "--model", "gpt2-tiny", "--batch", "1", "--seq", "8", "--lora-rank", "8", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("labkit estimate: error: ") and message in err, err


@pytest.mark.parity
def test_duo_scaling_by_hand():
    """AutoAWQ's default: s = s_x^alpha / (s_w^(1 - alpha) + 1e-4), s_w = mean over rows of |W| / its group's max."""
    w = torch.tensor([[0.5, -1.0, 0.25, 0.5], [2.0, 1.0, -1.0, 0.5]])
    from labkit.quant.awq import weight_mean

    s_w = weight_mean([w], 4)
    assert s_w.tolist() == pytest.approx([(0.5 + 1.0) / 2, (1.0 + 0.5) / 2, (0.25 + 0.5) / 2, (0.5 + 0.25) / 2], rel=1e-5)
    s_x = torch.tensor([8.0, 1.0, 1.0, 2.0])
    raw = [sx ** 0.5 / (sw ** 0.5 + 1e-4) for sx, sw in zip(s_x.tolist(), s_w.tolist())]
    by_hand = [r / math.sqrt(max(raw) * min(raw)) for r in raw]
    assert awq_scale(s_x, 0.5, s_w).tolist() == pytest.approx(by_hand, rel=1e-6)
    x, w2 = salient_layer()
    res = search_scale([w2], x, 128, duo=True)
    assert res.best_error <= res.rtn_error == pytest.approx(search_scale([w2], x, 128).rtn_error, rel=1e-6)
    flat = torch.randn(8, 128)  # nothing salient, weights alike: RTN may win, and then the scale is exactly 1
    r = search_scale([flat], torch.randn(64, 128), 128, duo=True)
    assert (r.alpha is None and torch.equal(r.scale, torch.ones(128))) or r.best_error < r.rtn_error
