"""Checks for lesson 00 (start here): a warm-up on the bytes of a model's weights."""

from __future__ import annotations

from labkit.memory import fmt_bytes
from labkit.estimate.predict import Precision, param_bytes
from labkit.estimate.spec import spec_from

from . import close, failed, number, passed


def check_weight_bytes(answer, model) -> bool:
    """Bytes of the model's fp32 weights: parameters x 4 (a tied matrix counted once)."""
    name = "bytes of the fp32 weights"
    value = number(answer, name)
    if value is None:
        return False
    spec = spec_from(model)
    expected = param_bytes(spec, Precision.of("fp32"))
    if close(value, expected, rel=1e-9):
        return passed(f"{name}: {fmt_bytes(expected)} for {spec.n_params:,} parameters.")
    if close(value, spec.n_params, rel=1e-9):
        return failed(f"{name}: that is the number of parameters; each fp32 parameter takes 4 bytes.")
    if spec.tied and close(value, expected + 4 * spec.vocab * spec.hidden, rel=1e-9):
        return failed(f"{name}: the embedding and the output head share one matrix (tied): count it once. "
                      "model.parameters() already does.")
    return failed(f"{name}: add up p.numel() over model.parameters() and multiply by 4 bytes per fp32 number.")
