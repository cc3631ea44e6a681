"""Drive the lessons' panels (03-08) through their widgets: each control moves the estimate the way it
should, a control change clears the last measurement, the button measures or explains an out-of-memory."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

from labkit.estimate import Recipe  # noqa: E402
from labkit.memory import Category, KiB, MiB  # noqa: E402
from labkit.memory.report import MomentKind  # noqa: E402
from labkit.models.gpt import GPTConfig  # noqa: E402
from labkit.viz import (AWQPanel, AccumulationPanel, CheckpointPanel, OptimizerPanel, PEFTPanel, QuantPanel,  # noqa: E402
                        RankPanel)

CFG = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32)
B, S = 2, 16
RECIPE = Recipe(CFG, B, S)  # the lesson's recipe: the panels' controls set their own fields over it
ROOMY = 64 * MiB  # far above any step here
TINY = 8 * KiB  # below the model's own weights


def opt(est):
    return est.peak[Category.OPT]


def most(est, category):  # the most of one category at any moment (at these sizes the optimizer sets the peak)
    return max(m.breakdown()[category] for m in est.moments)


def most_act(est):
    return most(est, Category.ACT)


def trainable(est):
    return est.peak[Category.GRAD] + est.peak[Category.OPT]


def measure_and_check_cleared(panel, control, value):
    """Click: a measurement appears; change `control`: it is gone (it described other settings)."""
    panel.button.click()
    assert panel.last_error is None, panel.last_error
    assert panel.last_result.fits and panel.last_result.measurement is not None and panel.last_figure is not None
    assert "fits: peak" in panel.message.value
    control.value = value
    assert panel.last_result is None and panel.last_figure is None and panel.message.value == ""


def test_checkpoint_panel_policy_and_segments():
    p = CheckpointPanel(RECIPE, ROOMY, step_flops=10**9, recompute_flops=2 * 10**8)
    full2 = p.last_estimate
    assert "x1.200" in p.verdict.value  # the recompute's FLOPs, from the lesson's counts
    p.segments.value = 1
    # one segment: its backward recomputes both blocks at once (temporaries, as lesson 00 counts a recompute's)
    assert most(p.last_estimate, Category.TEMP) > most(full2, Category.TEMP)
    p.policy.value = "none"
    assert p.segments.disabled and most_act(p.last_estimate) > 2 * most_act(full2)
    assert "x1.000" in p.verdict.value
    measure_and_check_cleared(p, p.policy, "full")
    assert not p.segments.disabled
    # the loss in chunks: the loss's backward starts beside one chunk's gradients, not the whole (B, S, V)
    start = next(m for m in p.last_estimate.moments if m.kind is MomentKind.LOSS_BACKWARD).total
    p.chunks.value = "4"
    assert "loss_chunks=4" in p.last_estimate.label
    assert next(m for m in p.last_estimate.moments if m.kind is MomentKind.LOSS_BACKWARD).total < start


def test_accumulation_panel_micro_batch():
    p = AccumulationPanel(Recipe(CFG, 4, S), ROOMY)
    assert list(p.micro.options) == [1, 2, 4] and "1 micro-batch of 4 rows" in p.verdict.value
    whole = p.last_estimate.peak[Category.ACT]
    p.micro.value = 1
    assert p.last_estimate.peak[Category.ACT] < whole and "4 micro-batches of 1 row" in p.verdict.value
    p.checkpoint.value = "full"
    assert p.last_estimate.peak[Category.ACT] < whole


def test_optimizer_panel_offload_has_a_label_and_moves_the_state():
    p = OptimizerPanel(RECIPE, ROOMY, data=torch.randint(0, CFG.vocab_size, (4096,)))
    assert p.offload.label == "none" and all(str(o).strip() for o in p.offload.options)  # no blank entry
    adamw = opt(p.last_estimate)
    p.optimizer.value = "adamw8bit"
    assert opt(p.last_estimate) < adamw  # (tensors under 4096 elements keep fp32 state, as in bitsandbytes)
    p.optimizer.value = "sgd"
    assert opt(p.last_estimate) == 0
    p.optimizer.value = "adamw"
    p.offload.value = "cpu"
    assert opt(p.last_estimate) < adamw  # the state left the device
    p.optimizer.value = "lion"  # offload is AdamW's only: explained, not raised
    assert p.last_estimate is None and "no prediction" in p.verdict.value and p.button.disabled
    p.offload.value = "none"
    assert p.last_estimate is not None and not p.button.disabled
    grads = most(p.last_estimate, Category.GRAD)
    p.in_backward.value = True  # each gradient is used and freed as soon as it is ready
    assert most(p.last_estimate, Category.GRAD) < grads / 4 and "step_in_backward" in p.last_estimate.label
    measure_and_check_cleared(p, p.in_backward, False)


def test_rank_panel_rank_and_8bit():
    p = RankPanel(RECIPE, ROOMY, rank=8, adamw_state=12345)
    assert "(AdamW: 12.06 KiB)" in p.verdict.value
    r8 = opt(p.last_estimate)
    p.rank.value = 16
    r16 = opt(p.last_estimate)
    assert r16 > r8
    p.eight_bit.value = True
    assert opt(p.last_estimate) < r16 and "galore8bit rank=16" in p.last_estimate.label


def test_peft_panel_methods():
    p = PEFTPanel(RECIPE, ROOMY, rank=8)
    lora = trainable(p.last_estimate)
    assert p.layers.disabled and not p.rank.disabled
    p.method.value = "full"
    assert trainable(p.last_estimate) > 4 * lora and p.rank.disabled
    p.method.value = "LISA"
    assert not p.layers.disabled and p.rank.disabled
    one = trainable(p.last_estimate)
    p.layers.value = 2
    assert trainable(p.last_estimate) > one
    p.method.value = "LoRA"
    p.rank.value = 32
    assert trainable(p.last_estimate) > 2 * lora
    weights = p.last_estimate.peak[Category.PARAM]
    p.quant.value = "nf4"
    assert p.last_estimate.peak[Category.PARAM] < weights
    p.targets.value = "c_attn only"
    assert trainable(p.last_estimate) < 32 / 8 * lora
    # which Linears NF4 stores: every one but the head (transformers), or the targets only (torchtune)
    assert not p.quant_set.disabled
    all_linear = p.last_estimate.peak[Category.PARAM]
    p.quant_set.value = "targets only (torchtune)"
    assert p.last_estimate.peak[Category.PARAM] > all_linear  # c_fc, c_proj, ... stay in their dtype
    assert "only the LoRA targets quantized (torchtune)" in p.last_estimate.label
    # a bf16 base under fp32 adapters (peft's way): the frozen weights halve, the trained state stays fp32
    p.quant.value = "none"
    assert p.quant_set.disabled
    fp32_base = p.last_estimate
    p.base_dtype.value = "bf16 (peft)"
    assert "base_dtype=bf16" in p.last_estimate.label and not p.base_dtype.disabled
    assert trainable(p.last_estimate) == trainable(fp32_base)
    assert p.last_estimate.phases["optimizer"][Category.PARAM] < fp32_base.phases["optimizer"][Category.PARAM]
    p.method.value = "LISA"
    assert p.base_dtype.disabled and "base_dtype" not in p.last_estimate.label


def test_budget_readout_verdict_and_an_out_of_memory_in_one_style():
    p = PEFTPanel(RECIPE, ROOMY)
    assert p.budget_readout.value == "64.00 MiB" and not p.budget.readout  # no raw GiB fraction on screen
    assert p.button.description == "Measure 2 steps" and p.button.layout.width == "auto"
    p.budget.value = 3.125 * MiB / 2**30
    assert p.budget_readout.value == "3.12 MiB"
    p.budget.value = TINY / 2**30
    assert p.budget_readout.value == "8.00 KiB"
    assert "does not fit in 8.00 KiB" in p.verdict.value and "expect an out-of-memory" in p.verdict.value
    p.button.click()
    assert p.last_error is None and p.last_result.fits is False and p.last_figure is None
    for html in (p.verdict.value, p.message.value):  # fit, does not fit and errors share one wrapping style
        assert html.startswith("<div style=") and "white-space:normal" in html and "<pre" not in html
    assert p.message.value.count("does not fit") == 1 and "8.00 KiB budget" in p.message.value
    p.method.value = "full"
    assert p.message.value == "" and p.last_result is None  # the out-of-memory was LoRA's, not full's


def test_a_panel_starts_from_the_lessons_recipe():
    from labkit.viz.lesson_panels import _fixed

    assert _fixed(RECIPE) == dict(model=CFG, batch=B, seq=S)  # defaults and the device (the panel's kind) stay out
    bf16 = Recipe(CFG, B, S, dtype="bf16", device="cuda", optimizer="sgd")
    assert _fixed(bf16) == dict(model=CFG, batch=B, seq=S, dtype="bf16", optimizer="sgd")
    p = CheckpointPanel(bf16, ROOMY)
    assert p.kind == p.device == "cuda" and p.last_estimate.label.endswith("bf16 sgd checkpoint=full")
    assert OptimizerPanel(bf16, ROOMY).last_estimate.label.endswith("bf16 adamw")  # a control's field wins


def test_quant_panel_picks_points_on_precomputed_curves():
    from labkit.quant import bits_per_param_nf4, quantize_nf4

    torch.manual_seed(0)
    w = torch.randn(64, 512)
    p = QuantPanel(w)
    assert f"{bits_per_param_nf4(*quantize_nf4(w, 64, double_quant=True)):.3f} bits/param" in p.words.value
    p.mode.value, p.blocksize.value = "int8 absmax", 128
    assert "8.250 bits/param" in p.words.value  # 8 + 32/128
    err128 = p.points["int8 absmax"][128][1]
    assert p.points["int8 absmax"][32][1] < err128 < p.points["int8 absmax"][4096][1]  # smaller blocks, less error
    assert p.last_figure is not None and bytes(p.picture.value).startswith(b"\x89PNG")
    with pytest.raises(ValueError, match="choose one of"):
        from labkit.viz.lesson_panels import quantize_report
        quantize_report(torch.randn(8, 64), "int4", 64)


def test_awq_panel_follows_method_and_group():
    from labkit.quant.awq import input_stats
    from labkit.quant.int4 import int4_bytes_for

    torch.manual_seed(0)
    x = torch.randn(256, 128)
    x[:, :2] *= 20  # two salient input channels
    w = torch.randn(32, 128) / 11
    p = AWQPanel(w, input_stats(x), method="int4 RTN", group=64)
    assert f"{8 * int4_bytes_for(w.shape, 64) / w.numel():.3f} bits/weight" in p.words.value
    assert "1.000 x RTN" in p.words.value and p.last_report[2] == 0.0  # RTN: alpha 0
    p.method.value = "int4 AWQ"
    bits, rel, alpha, _ = p.last_report
    assert rel < 1 and alpha > 0  # the salient channels make a scale worth it
    assert bits == 8 * int4_bytes_for(w.shape, 64, True) / w.numel()  # + the kept scale
    png = bytes(p.picture.value)
    p.group.value = 32
    assert bytes(p.picture.value) != png and "groups of 32" in p.words.value
    with pytest.raises(ValueError, match="choose one of"):
        from labkit.quant.compare import awq_report
        awq_report(w, input_stats(x), "int3", 64)
