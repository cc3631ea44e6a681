"""Drive CommPanel through its widgets: the bytes follow the controls at once; the button trains real ranks."""

import math

import matplotlib

matplotlib.use("Agg")

from labkit.distributed.compression import dense_wire_bytes  # noqa: E402
from labkit.distributed.dp_ranks import TrainRun  # noqa: E402
from labkit.viz.comm_panel import CommPanel  # noqa: E402

CFG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


def test_controls_redraw_the_bytes_per_step():
    p = CommPanel(TrainRun(CFG, steps=6, batch=8, seq=16))
    png = bytes(p.bytes_plot.value)
    assert png.startswith(b"\x89PNG")
    plan = p.last_plan
    n = sum(math.prod(s) for s in [(64, 32), (16, 32)]) + 2 * (
        3 * 32 * 32 + 3 * 32 + 32 * 32 + 32 + 4 * 32 * 32 + 4 * 32 + 4 * 32 * 32 + 32 + 4 * 32) + 2 * 32
    assert plan["dense"] == [dense_wire_bytes(n, 2)] * 6
    p.sparsity.value = 0.999
    assert p.last_plan["dgc"][-1] < plan["dgc"][-1] and bytes(p.bytes_plot.value) != png
    p.warmup.value = 0
    assert p.last_plan["dgc"][0] == p.last_plan["dgc"][-1]  # no warm-up: the final sparsity from the start
    before = p.last_plan["powersgd"][-1]
    p.rank.value = 4
    assert p.last_plan["powersgd"][-1] > before and p.last_plan["powersgd"][0] == plan["dense"][0]
    assert "less" in p.verdict.value


def test_button_trains_and_draws_the_loss_curves():
    p = CommPanel(TrainRun(CFG, steps=3, batch=4, seq=8))
    p.staleness.value = 2
    assert p.loss_plot not in p.widget.children
    p.button.click()
    assert p.last_error is None, p.last_error
    assert set(p.last_losses) == {"dense", "dgc", "powersgd", "parameter server (s=2)"}
    assert all(len(v) == 3 for v in p.last_losses.values())
    assert bytes(p.loss_plot.value).startswith(b"\x89PNG") and "final loss" in p.message.value
    assert p.loss_plot in p.widget.children
