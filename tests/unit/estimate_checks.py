"""Estimate against measurement, phase by phase: the check the estimator's ledger tests share.

Importable from the tests in this folder (pytest puts a test's folder on sys.path: there is no __init__.py).
"""

TOL = 0.03  # of the measured peak, as every lesson states it


def assert_phases_within(e, m, tol: float = TOL) -> None:
    """Each phase's predicted total, and the peak, within `tol` of the measured peak."""
    for phase in ("forward", "backward", "optimizer"):
        assert abs(e.phases[phase].total - m.phases[phase].total) <= tol * m.peak.total, (
            phase, e.phases[phase].total, m.phases[phase].total, e.explain(phase))
    assert abs(e.peak.total - m.peak.total) <= tol * m.peak.total, (e.label, e.peak.total, m.peak.total)


def assert_categories_within(e, m, tol: float = TOL) -> None:
    """Each category at the peak (parameters, buffers, gradients, optimizer state, activations, temporaries)
    within `tol` of the measured peak: the estimate and the ledger follow lesson 00's one definition of each
    (a checkpoint's recompute makes temporaries; the forward's tensors still held in backward are activations)."""
    from labkit.memory import CATEGORIES

    for c in CATEGORIES:
        assert abs(e.peak[c] - m.peak[c]) <= tol * m.peak.total, (
            e.label, c.name, e.peak[c], m.peak[c], e.peak_phase, m.peak_phase, e.explain())


def assert_every_phase_within(e, m, tol: float) -> None:
    """Every category of every phase (each at that phase's own peak) within `tol` of the measured peak: the
    moments that are not the peak, which the peak's check leaves out, held to the same definitions."""
    from labkit.memory import CATEGORIES

    for phase in ("forward", "backward", "optimizer"):
        for c in CATEGORIES:
            assert abs(e.phases[phase][c] - m.phases[phase][c]) <= tol * m.peak.total, (
                e.label, phase, c.name, e.phases[phase][c], m.phases[phase][c], e.explain(phase))


def estimate_and_measure(recipe, tol: float = TOL, total_tol: float | None = None, steps: int = 2):
    """estimate(recipe) and measure_step(recipe, steps): the peak within `total_tol` (default `tol`) and each
    category within `tol` of the measured peak (assert_categories_within). Returns (estimate, measurement)."""
    from labkit.estimate import estimate
    from labkit.run import measure_step

    e, m = estimate(recipe), measure_step(recipe, steps=steps)
    t = tol if total_tol is None else total_tol
    assert abs(e.peak.total - m.peak.total) <= t * m.peak.total, (e.label, e.peak.total, m.peak.total)
    assert_categories_within(e, m, tol)
    return e, m
