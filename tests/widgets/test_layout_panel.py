"""Drive LayoutPanel through its widgets: per-rank bars and the bubble follow the controls."""

import matplotlib

matplotlib.use("Agg")

from fractions import Fraction  # noqa: E402

import pytest  # noqa: E402

from labkit.memory import Category  # noqa: E402
from labkit.models.gpt import GPTConfig  # noqa: E402
from labkit.viz.layout import LayoutPanel  # noqa: E402

CFG = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=64)


@pytest.fixture
def panel():
    return LayoutPanel(CFG, batch=8, seq=64)


def test_controls_redraw_bars_and_bubble(panel):
    assert len(panel.last_estimates) == 2 and bytes(panel.bars.value).startswith(b"\x89PNG")
    assert panel.last_bubble == pytest.approx(float(Fraction(1, 5)))  # p=2, m=4: 1/5
    one_f = panel.last_estimates[0].peak[Category.ACT]
    panel.schedule.value = "gpipe"  # stage 0 holds all 4 micro-batches, not 2
    assert panel.last_estimates[0].peak[Category.ACT] > 1.5 * one_f
    panel.micro.value = 8
    assert panel.last_bubble == pytest.approx(1 / 9)
    panel.tp.value = 2
    assert len(panel.last_estimates) == 4
    params = panel.last_estimates[0].peak[Category.PARAM]
    panel.tp.value = 4
    assert panel.last_estimates[0].peak[Category.PARAM] < params
    act = panel.last_estimates[0].peak[Category.ACT]
    panel.sp.value = True
    assert panel.last_estimates[0].peak[Category.ACT] < act
    assert "largest rank" in panel.words.value


def test_bad_layout_says_why(panel):
    panel.pp.value = 5  # 4 layers
    assert panel.last_estimates is None and "at least one block" in panel.words.value
    panel.pp.value = 2
    assert panel.last_estimates is not None


def _png_width(png: bytes) -> int:
    return int.from_bytes(png[16:20], "big")  # the IHDR chunk's width


def test_reset_returns_to_a_readable_default_and_the_panel_says_why_it_does_not_measure(panel):
    two_ranks = _png_width(bytes(panel.bars.value))
    panel.pp.value, panel.tp.value, panel.sp.value = 4, 4, True
    assert len(panel.last_estimates) == 16
    assert _png_width(bytes(panel.bars.value)) > 1.4 * two_ranks  # 16 bars get a wider figure, not thinner bars
    panel.schedule.value = "gpipe"
    panel.reset()
    assert (panel.pp.value, panel.micro.value, panel.schedule.value, panel.tp.value, panel.sp.value) == (
        2, 4, "1f1b", 1, False)
    assert len(panel.last_estimates) == 2 and panel.last_bubble == pytest.approx(1 / 5)
    assert _png_width(bytes(panel.bars.value)) == two_ranks
    assert "no measure button" in panel.note.value and "Section 4 measured" in panel.note.value
