"""Drive ZeroPanel through its widgets: the bars follow the controls, the button runs 2 real ranks."""

import matplotlib

matplotlib.use("Agg")

from labkit.viz.style import FITS  # noqa: E402
from labkit.viz.zero_panel import ZeroPanel  # noqa: E402


def test_controls_redraw_the_per_rank_bars():
    p = ZeroPanel()
    png, ests = bytes(p.prediction.value), p.last_estimates
    assert png.startswith(b"\x89PNG") and set(ests) == {0, 1, 2, 3}
    p.ranks.value = 64
    assert p.last_estimates[3].peak.total < ests[3].peak.total  # more ranks, smaller shards
    assert bytes(p.prediction.value) != png
    assert not p.button.disabled and "too big to measure" not in p.verdict.value
    p.model.value = "gpt2-xl (1.6B)"
    assert p.button.disabled and "does not fit" in p.verdict.value  # too big to run here, and for 10 MiB
    # a greyed button says why, in the verdict and on hover
    assert "too big to measure here" in p.verdict.value and "64.00 MiB per rank" in p.verdict.value
    assert p.button.tooltip.startswith("too big to measure here")
    p.ranks.value, p.stage.value = 1, 3
    # one rank has nothing to shard: every stage is plain training (it lowered the peak before: issue 43 item 8)
    assert p.last_estimates[3].peak.total == p.last_estimates[0].peak.total > 0


def test_button_runs_two_ranks_and_compares():
    p = ZeroPanel(stage=3, rows=2, seq=16)
    assert not p.button.disabled
    p.button.click()
    assert p.last_error is None, p.last_error
    assert len(p.last_measurements) == 2 and p.last_figure is not None
    assert "within" in p.message.value


def test_a_run_under_a_budget_the_prediction_exceeds_shows_the_ledgers_out_of_memory():
    """Predicted not to fit: the button still runs, under that budget, and each rank's ledger raises the
    out-of-memory a device of that size would; the panel says so in red, never a green measurement."""
    from labkit.estimate import estimate
    from labkit.memory import GiB

    p = ZeroPanel(stage=3, rows=2, seq=16)
    need = estimate(p.run_recipe()).peak.total
    p.budget.value = 2 ** -12  # 256 KiB, the slider's smallest
    assert p.budget_bytes() < need and "does not fit" in p.verdict.value and not p.button.disabled
    p.button.click()
    assert p.last_measurements is None and p.last_figure is None
    assert "out of memory" in p.message.value and "does not fit" in p.message.value
    assert FITS not in p.message.value and p.budget_bytes() == int(2 ** -12 * GiB)


def test_a_change_of_control_clears_the_last_run():
    """A run's result belongs to the controls it ran with: a green measurement never stays beside a new verdict."""
    p = ZeroPanel(stage=3, rows=2, seq=16)
    p.button.click()
    assert p.last_measurements is not None and FITS in p.message.value
    p.budget.value = 2 ** -12
    assert p.message.value == "" and p.last_measurements is None and "does not fit" in p.verdict.value
