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
