"""What every labkit optimizer shares: one-line argument checks, state byte counts, and dtype-safe resume."""

from __future__ import annotations

import math
import numbers

import torch

from labkit.memory.state import state_tensors  # noqa: F401  (re-exported: the optimizers' state walk)
from torch.utils._pytree import tree_flatten


# ---- argument checks: each raises a one-line ValueError that names the argument -----------------
def check_number(name: str, value, low: float = 0.0, high: float = math.inf, low_open: bool = False,
                 high_open: bool = True) -> float:
    """`value` as a float in the interval from `low` to `high` (open or closed at each end)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        lo, hi = "(" if low_open else "[", ")" if high_open else "]"
        raise ValueError(f"{name} must be a number in {lo}{low}, {high}{hi}, got {value!r}")
    return float(value)


def check_betas(betas, n: int = 2, high_open: bool = True) -> tuple[float, ...]:
    """A tuple of `n` betas, each in [0, 1) (or [0, 1] when high_open is False)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != n:
        raise ValueError(f"betas must be a tuple of {n} numbers, got {betas!r}")
    return tuple(check_number(f"betas[{i}]", b, 0.0, 1.0, high_open=high_open) for i, b in enumerate(betas))


def check_int(name: str, value, low: int = 1, multiple_of: int | None = None) -> int:
    """`value` as an int >= low (and a multiple of `multiple_of` if given)."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low or (
            multiple_of and value % multiple_of):
        what = f"an integer >= {low}" + (f" and a multiple of {multiple_of}" if multiple_of else "")
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return int(value)


# ---- counting ------------------------------------------------------------------------------------
def run_closure(closure):
    """The loss of `closure()` with gradients enabled (optimizers step under no_grad), or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def params_with_grads(optimizer, name: str):
    """(parameter, its group) for every parameter that has a gradient; sparse gradients are refused by `name`."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"{name} does not support sparse gradients")
            yield p, group


class StepsEachParameter:
    """Mixin: `step` runs the closure, then `self._update(p, state, group)` for every parameter with a gradient
    (a sparse one refused in the class's name)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        for p, group in params_with_grads(self, type(self).__name__):
            self._update(p, self.state[p], group)
        return loss


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor storage `state_tensors` finds (each storage once, whole), as the Ledger's OPT counts them."""
    seen, total = set(), 0
    for t in state_tensors(optimizer):
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


# ---- resuming ------------------------------------------------------------------------------------
class KeepStateDtypes:
    """Mixin: `load_state_dict` keeps each state tensor's saved dtype.

    torch.optim casts every loaded state tensor of a floating-point parameter to the parameter's
    dtype (except "step"), which would turn uint8 codes into fp32 and fp32 statistics of a bf16
    parameter into bf16. Here the tensors only move to the parameter's device.
    """

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        super().load_state_dict(state_dict)
        for i, p in zip(ids, params):
            if i in saved:
                self.state[p] = {k: v.to(p.device) if isinstance(v, torch.Tensor) else v
                                 for k, v in saved[i].items()}
