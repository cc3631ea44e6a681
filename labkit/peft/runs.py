"""Measured fine-tuning runs for labkit.peft.tasks: the result record, the training loop under the
Ledger, and building a method's model (labkit's LoRA / QLoRA, or the libraries' versions).

A method and its library reference (REFERENCES) get the same adapter values (`same_adapter_init`),
the same dropout masks (`fit(seed=)`) and the same measured steps, so their ratios compare the
implementations and nothing else.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn as nn

from labkit.memory import Category, Ledger
from .lora import LoRAConfig, apply_lora, count_parameters
from .qlora import NF4Config, apply_qlora
from .reference import bnb_qlora, hidden_bytes_bound, peft_lora, same_adapter_init, track_bnb_storage

REFERENCES = {"peft-lora": "lora", "bnb-qlora": "qlora", "lisa-naive": "lisa"}  # reference -> labkit's method


@dataclass
class TaskResult:
    method: str  # "probe", "full", "lora", "qlora", "lisa", or a reference: "peft-lora", "bnb-qlora", "lisa-naive"
    metric: str  # "accuracy" (higher is better) or "val_loss" (lower is better)
    before: float  # the metric before this method trained
    after: float  # and after
    trainable: int  # parameter elements with gradients and optimizer state
    total: int  # all parameter elements (NF4 codes count as stored: 2 weights per uint8)
    peak: object  # labkit.memory Breakdown at the peak of the measured steps (None if not measured)
    seconds: float  # wall time of the training loop
    step_seconds: float = float("nan")  # median wall time of a step outside the Ledger (nan if every step was measured)
    measured_steps: int = 0  # steps run under the Ledger
    hidden_bytes: int = 0  # bnb-qlora: bound on temporaries inside bitsandbytes ops that the Ledger cannot see
    opt_peak: int = 0  # the most optimizer-state bytes at any phase peak of the measured steps

    def row(self) -> str:
        peak = "-" if self.peak is None else f"{self.peak.total / 2**20:8.1f} MiB"
        step = "" if self.step_seconds != self.step_seconds else f"  {self.step_seconds * 1e3:7.1f} ms/step"
        return (f"{self.method:10s} {self.metric} {self.before:.3f} -> {self.after:.3f}  trainable {self.trainable:>10,}"
                f"  peak {peak}  {self.seconds:6.1f} s{step}")


def format_results(results: dict[str, TaskResult]) -> str:
    return "\n".join(r.row() for r in results.values())


def check_methods(methods, allowed) -> None:
    unknown = set(methods) - set(allowed)
    if unknown:
        raise ValueError(f"unknown methods {sorted(unknown)}: choose among {', '.join(repr(m) for m in allowed)}")


def learning_rates(defaults: dict, lr: dict | None) -> dict:
    """Learning rates: a reference uses its labkit method's unless given its own."""
    out = {**defaults, **(lr or {})}
    for ref, mine in REFERENCES.items():
        out.setdefault(ref, out.get(mine))
    return out


def adapted(base: nn.Module, method: str, lora: LoRAConfig, qdtype, seed: int, checkpoint=None) -> nn.Module:
    """A copy of `base` set up for `method` (lora.targets: full module names); LoRA methods and their references
    get the same adapter values. checkpoint: labkit's QLoRA's (apply_qlora's)."""
    model = copy.deepcopy(base)
    if method == "lora":
        apply_lora(model, lora.targets, r=lora.r, alpha=lora.alpha, dropout=lora.dropout, rslora=lora.rslora,
                   train_also=lora.train_also)
    elif method == "qlora":
        apply_qlora(model, lora, NF4Config(qdtype), checkpoint=checkpoint)
    elif method == "peft-lora":
        model = peft_lora(model, lora)
    elif method == "bnb-qlora":
        model = bnb_qlora(model, lora, qdtype)
    if method in ("lora", "qlora", "peft-lora", "bnb-qlora"):
        same_adapter_init(model, seed)
    return model


@dataclass(frozen=True)
class Fitted:
    """What `fit` saw of a training loop."""

    measurement: object  # labkit.memory Measurement of the steps under the Ledger (None: none were)
    seconds: float  # wall time of the whole loop
    step_seconds: float  # median wall time of a step outside the Ledger (nan if every step was measured)
    measured_steps: int  # steps run under the Ledger

    def __post_init__(self) -> None:
        if isinstance(self.measured_steps, bool) or not isinstance(self.measured_steps, int) or self.measured_steps < 0:
            raise ValueError(f"measured_steps must be a non-negative integer, got {self.measured_steps!r}")
        if (self.measurement is None) != (self.measured_steps == 0):
            raise ValueError(f"measured_steps ({self.measured_steps}) must be 0 exactly when there is no measurement")


def fit(model, opt, loss_at, steps: int, measure_steps: int = 2, before_step=None, seed: int | None = None) -> Fitted:
    """`steps` optimizer steps of loss_at(i), the first `measure_steps` under the Ledger (which is shown
    bitsandbytes' weight storage)."""
    model.train()
    if seed is not None:
        torch.manual_seed(seed)  # dropout masks: the same for a method and its reference
    led, times = None, []
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if measure_steps:
            led = stack.enter_context(Ledger(model, opt))
            track_bnb_storage(led, model)
        for i in range(steps):
            if i == measure_steps:
                stack.close()
            t = time.perf_counter()
            if before_step is not None:
                before_step()
            loss_at(i).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= measure_steps:
                times.append(time.perf_counter() - t)
    step = statistics.median(times) if times else float("nan")
    return Fitted(led.measurement() if led else None, time.perf_counter() - t0, step, measure_steps if led else 0)


def result(method, metric, before, after, model, run: Fitted, trainable=None) -> TaskResult:
    """`method`'s TaskResult: `metric` before and after, and what `fit` saw; trainable: default the model's count."""
    n, meas = count_parameters(model), run.measurement
    return TaskResult(method, metric, before, after, n.trainable if trainable is None else trainable, n.total,
                      meas.peak if meas else None, run.seconds, run.step_seconds, run.measured_steps,
                      hidden_bytes_bound(model),
                      max((b[Category.OPT] for b in meas.phases.values()), default=0) if meas else 0)
