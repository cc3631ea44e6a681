"""Drive WaterfallPanel through its widgets: a config's knobs as checkboxes, the bars follow them."""

import matplotlib

matplotlib.use("Agg")

from labkit.plan.waterfall import Knob  # noqa: E402
from labkit.viz.waterfall_panel import WaterfallPanel  # noqa: E402


def test_the_bars_follow_the_config_and_the_knobs():
    p = WaterfallPanel("torchtune_llama3_2_3B_lora.yaml", budget_gib=24, layers=2)
    w = p.last
    assert p.last_error is None and bytes(p.chart.value).startswith(b"\x89PNG")
    # fused AdamW: the OPTIMIZER knob (no foreach temporaries); no 8-bit states, no offload, one device
    # torchtune's CEWithChunkedOutputLoss is read as 8 loss chunks: a knob of its own, not a note
    assert [s.knob for s in w.steps[1:]] == [Knob.PRECISION, Knob.OPTIMIZER, Knob.PEFT, Knob.CHECKPOINT,
                                             Knob.LOSS_CHUNKS, Knob.MICRO_BATCH]
    assert p.knobs[Knob.ZERO].disabled and not p.knobs[Knob.CHECKPOINT].disabled
    assert "fits" in p.verdict.value and "chunks" not in p.notes.value
    assert w.steps[5].saved > 0  # the chunks keep less than the whole logits and their fp32 copy
    peak = w.steps[-1].peak
    p.knobs[Knob.CHECKPOINT].value = False  # take checkpointing out: the recipe's peak rises
    assert Knob.CHECKPOINT not in [s.knob for s in p.last.steps]
    assert p.last.steps[-1].peak > peak and "activation checkpointing" in p.verdict.value
    p.budget.value = 0.01  # GiB
    assert "does not fit" in p.verdict.value
    p.config.value = "torchtune_llama3_1_8B_full_single_device.yaml"
    assert Knob.STEP_IN_BACKWARD in [s.knob for s in p.last.steps]
    assert p.knobs[Knob.PEFT].disabled
