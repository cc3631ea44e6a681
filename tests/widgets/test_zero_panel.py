"""Drive ZeroPanel through its widgets: the bars follow the controls, the button runs 2 real ranks."""

import matplotlib

matplotlib.use("Agg")

from labkit.viz.zero_panel import ZeroPanel  # noqa: E402


def test_controls_redraw_the_per_rank_bars():
    p = ZeroPanel()
    png, ests = bytes(p.prediction.value), p.last_estimates
    assert png.startswith(b"\x89PNG") and set(ests) == {0, 1, 2, 3}
    p.ranks.value = 64
    assert p.last_estimates[3].peak.total < ests[3].peak.total  # more ranks, smaller shards
    assert bytes(p.prediction.value) != png
    p.model.value = "gpt2-xl (1.6B)"
    assert p.button.disabled and "does not fit" in p.verdict.value  # too big to run here, and for 10 MiB
    p.ranks.value, p.stage.value = 1, 3
    assert p.last_estimates[3].peak.total > 0  # one rank: ZeRO shards over 1


def test_button_runs_two_ranks_and_compares():
    p = ZeroPanel(stage=3, rows=2, seq=16)
    assert not p.button.disabled
    p.button.click()
    assert p.last_error is None, p.last_error
    assert len(p.last_measurements) == 2 and p.last_figure is not None
    assert "within" in p.message.value
