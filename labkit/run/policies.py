"""Measure one training step's saved activations, backward peak and FLOPs, for comparing recompute policies."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

from functools import partial

from labkit.memory import Category, Ledger, Measurement
from labkit.memory.units import fmt_bytes
from labkit.recompute import SelectivePolicy, checkpoint_blocks, sqrt_segments

from .step import make_optimizer, train_step


@dataclass
class StepFigures:
    """What one training step cost under one policy (logical bytes, as the Ledger counts them)."""

    label: str
    saved: int  # ACT when backward starts: everything the forward kept for backward
    act_at_peak: int  # ACT at the moment of the backward pass's peak
    backward_peak: int  # all categories at that moment
    temp_at_peak: int  # TEMP at that moment (recomputed activations live here)
    flops: int  # FlopCounterMode's total for the whole step (matmul-like ops only)

    def ratios(self, base: "StepFigures") -> dict[str, float]:
        """This policy's figures as fractions of `base`'s (usually no checkpointing)."""
        return {k: getattr(self, k) / max(getattr(base, k), 1) for k in ("saved", "act_at_peak", "backward_peak", "flops")}

    def extra_flops(self, base: "StepFigures") -> int:
        """FLOPs this policy recomputes on top of `base`'s step."""
        return self.flops - base.flops

    def row(self, base: "StepFigures | None" = None) -> str:
        r = self.ratios(base) if base else None
        tail = f"  (x{r['saved']:.2f} saved, x{r['backward_peak']:.2f} peak, x{r['flops']:.3f} FLOPs)" if r else ""
        return (f"{self.label:<22} saved {fmt_bytes(self.saved):>10}  ACT@peak {fmt_bytes(self.act_at_peak):>10}  "
                f"bwd peak {fmt_bytes(self.backward_peak):>10}  FLOPs {self.flops / 1e9:8.3f} G{tail}")


def format_report(rows: list[StepFigures]) -> str:
    """One line per policy, ratios against the first row (no checkpointing), then a summary line."""
    base = rows[0]
    best = min(rows, key=lambda r: r.backward_peak)
    lines = [r.row(base) for r in rows]
    lines.append(f"lowest backward peak: {best.label} at x{best.backward_peak / base.backward_peak:.2f} of "
                 f"{base.label}, for x{best.flops / max(base.flops, 1):.3f} its FLOPs")
    return "\n".join(lines)


def saved_bytes(m: Measurement) -> int:
    """ACT when backward starts (`Measurement.saved`)."""
    return m.saved


def measure_training_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, label: str = "",
                          setup: Callable[[torch.nn.Module], contextlib.AbstractContextManager] | None = None,
                          optimizer: str = "sgd", dtype: str = "fp32", copy_model: bool = True) -> StepFigures:
    """Run one training step of `model` on (x, y) under the Ledger and FlopCounterMode.

    setup(model): a context manager that applies the policy (e.g. `lambda m: checkpoint_blocks(m, "full")`)
    for the step. copy_model: work on a deep copy so the caller's model and its gradients are untouched.
    """
    m = copy.deepcopy(model) if copy_model else model
    opt = make_optimizer(m, optimizer)
    ctx = setup(m) if setup is not None else contextlib.nullcontext()
    with ctx, Ledger(m, opt, label=label) as led, FlopCounterMode(display=False) as fc:
        train_step(m, opt, x, y, dtype)
    meas = led.measurement()
    peak = meas.phases["backward"]
    return StepFigures(label, saved_bytes(meas), peak[Category.ACT], peak.total, peak[Category.TEMP],
                       int(fc.get_total_flops()))


def activation_flops_report(model, x: torch.Tensor, y: torch.Tensor, ks=None, *, style: str = "hooks",
                            selective="matmuls", optimizer: str = "sgd") -> list[StepFigures]:
    """One measured training step per setting: no checkpointing (row 0), then k = 1..n segments (or
    `ks`), then sqrt(n) and selective. Each row (`StepFigures`): ACT saved when backward starts, ACT and
    the total at the backward peak, and the step's FLOPs (`row.extra_flops(rows[0])` is the recompute).
    `labkit.run.policies.format_report(rows)` prints them with ratios."""
    n = len(model.blocks)
    ks = list(range(1, n + 1)) if ks is None else list(ks)
    settings = [("none", None, "none")] + [(f"full k={k}", k, "full") for k in ks]
    settings += [(f"sqrt k={sqrt_segments(n)}", None, "sqrt"), (f"selective {SelectivePolicy.of(selective).name}", None, "selective")]
    rows = []
    for label, k, policy in settings:
        setup = partial(checkpoint_blocks, policy=policy, segments=k, style=style if policy != "selective" else "hooks",
                        selective=selective)
        rows.append(measure_training_step(copy.deepcopy(model), x, y, label, setup, optimizer, copy_model=False))
    return rows
