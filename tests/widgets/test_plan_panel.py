"""Drive PlanPanel through its widgets: the plans follow the controls; the button verifies the top plan."""

import matplotlib

matplotlib.use("Agg")

from labkit.estimate import estimate  # noqa: E402
from labkit.memory import GiB  # noqa: E402
from labkit.viz.plan_panel import PlanPanel  # noqa: E402


def _panel():
    full = estimate("gpt2-tiny", 8, 64).peak.total
    return PlanPanel(model="gpt2-tiny", memory_gib=0.6 * full / GiB, batch=8, seq=64, min_precision="fp32"), full


def test_plans_follow_the_controls():
    p, full = _panel()
    assert p.last_plans and all(x.peak <= p.memory_bytes for x in p.last_plans)
    assert bytes(p.prediction.value).startswith(b"\x89PNG")
    assert "best:" in p.verdict.value and not p.button.disabled
    first = p.last_plans[0].summary()
    p.memory.value = 4 * full / GiB  # room for the plain step: the best plan changes
    assert p.last_plans[0].summary() != first and p.last_plans[0].peak <= p.memory_bytes
    p.memory.value = 2**-10  # 1 MiB: nothing fits; the panel says so and will not verify
    assert p.last_plans is None and "no plan" in p.verdict.value and p.button.disabled
    p.model.value = "llama2-7b"
    p.memory.value = 32  # GiB: plans, but too big to run here
    assert p.last_plans is not None
    assert p.button.disabled and "verify is off" in p.message.value


def test_button_verifies_the_top_plan():
    p, _ = _panel()
    p.button.click()
    v = p.last_verification
    assert p.last_error is None and v is not None and v.fits
    assert abs(v.error) < 0.03 and "measured peak" in p.message.value and "fits in" in p.message.value


def test_plan_bars_mark_tight_plans_wherever_they_are_drawn():
    """Lesson 13 printed its tight plans in one cell; its bars (cell 9 and the panel) drew them green."""
    from types import SimpleNamespace

    from matplotlib.colors import to_hex

    from labkit.viz.plan_panel import TIGHT, plan_bars
    from labkit.viz.style import DOES_NOT_FIT, FITS

    def plan(peak, tight):
        return SimpleNamespace(peak=peak * GiB, relative=1.0, tight=tight, headroom=0.1,
                               summary=lambda: f"full training, plan of {peak} GiB")

    fig = plan_bars([plan(17, False), plan(23.6, True), plan(30, False)], 24 * GiB)
    ax = fig.axes[0]
    colors = [to_hex(p.get_facecolor()[:3]) for p in ax.patches]
    assert colors == [to_hex(c) for c in (FITS, TIGHT, DOES_NOT_FIT)]
    assert [bool(p.get_hatch()) for p in ax.patches] == [False, True, False]
    ends = [t.get_text() for t in ax.texts]
    assert [w.endswith(", tight") for w in ends] == [False, True, False]
    assert "amber: tight (within 10% of it)" in ax.get_xlabel()
