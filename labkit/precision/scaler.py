"""A dynamic loss scaler written from scratch: scale, unscale with an inf/nan check, skip, back off, grow.

fp16's smallest subnormal is 2**-24 (about 6e-8): gradients below it flush to zero. Multiplying the
loss by S multiplies every gradient by S, lifting small ones into range; before the optimizer step
the gradients are divided by S again. If any scaled gradient overflowed to inf/nan the step is
skipped and S halves; after `growth_interval` clean steps in a row S doubles.

It keeps torch.amp.GradScaler's contract (torch/amp/grad_scaler.py and the `_amp_update_scale_` and
`_amp_foreach_non_finite_check_and_unscale_` kernels):

- S is an fp32 number: every new value is rounded to fp32, and S grows only if the grown value is
  finite in fp32 (the growth counter restarts either way);
- the unscale multiplies each gradient by fp32(1 / S) (the reciprocal taken in double) and flags
  inf/nan in the *scaled* gradient;
- state is kept per optimizer: each one is unscaled at most once and stepped at most once per
  iteration (a RuntimeError otherwise), an inf/nan skips only that optimizer's step, and `update()`
  backs off if any optimizer of the iteration found one;
- `step()` returns what `optimizer.step()` returned, or None when it skipped the step;
- enabled=False makes it a pass-through: scale returns its input, step just steps, update and
  unscale_ do nothing, get_scale is 1.0 and state_dict is {}.

Where it deliberately differs: bad constructor, `update(new_scale=...)` and state-dict values raise a
ValueError/TypeError (GradScaler asserts on two factors and takes the rest as given); misuse that
GradScaler reports with an AssertionError (update() with no optimizer checked, step() on an optimizer
without gradients, pickling mid-iteration) raises a RuntimeError; a closure passed positionally is
refused like one passed by keyword; and a back-off that would take S so low that 1/S overflows fp32
raises instead of going on (GradScaler then multiplies gradients by an infinite 1/S that it no longer
flags, which writes nan into the weights). `unscale_()` returns whether that optimizer's gradients held
an inf/nan (GradScaler returns None). There is no lazy first call: S exists from the constructor, so
calling step() before any scale() is not an error here.
"""

from __future__ import annotations

import math
import numbers
import struct
from enum import Enum

import torch

FP32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max
INT32_MAX = 2**31 - 1  # GradScaler's growth tracker is an int32 tensor


def _fp32(x: float) -> float:
    """x rounded to the nearest fp32 value (inf past fp32's range), as a Python float."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


def _scale_value(name: str, value) -> float:
    """A loss scale: positive, finite in fp32, with 1/S finite in fp32 too. Returns it rounded to fp32."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.requires_grad:
            raise ValueError(f"{name} as a tensor must have one element and no grad, got shape "
                             f"{tuple(value.shape)}, requires_grad={value.requires_grad}")
        if value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name} as a tensor must be real, got dtype {value.dtype}")
        value = value.item()
    s = _fp32(_real(name, value))
    if not s > 0:
        raise ValueError(f"{name} must be > 0 (after rounding to fp32), got {value!r}")
    if not (math.isfinite(s) and math.isfinite(_fp32(1.0 / s))):
        raise ValueError(f"{name} must lie within fp32's range with room for 1/{name} "
                         f"(about 2.9e-39 to {FP32_MAX:.4g}), got {value!r}")
    return s


def _growth_factor(value) -> float:
    value = _real("growth_factor", value)
    if not value > 1.0:
        raise ValueError(f"growth_factor must be > 1, got {value!r}")
    return value


def _backoff_factor(value) -> float:
    value = _real("backoff_factor", value)
    if not 0.0 < value < 1.0:
        raise ValueError(f"backoff_factor must be in (0, 1), got {value!r}")
    return value


def _growth_interval(value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"growth_interval must be an integer, got {type(value).__name__} {value!r}")
    if not 1 <= value <= INT32_MAX:
        raise ValueError(f"growth_interval must be in [1, 2**31 - 1], got {value!r}")
    return int(value)


def _check_optimizer(optimizer) -> None:
    if not (hasattr(optimizer, "param_groups") and callable(getattr(optimizer, "step", None))):
        raise TypeError(f"expected a torch.optim.Optimizer (param_groups and step()), got {type(optimizer).__name__}")


def _setting(attr: str, check) -> property:
    """A property reading self.<attr>; assigning stores check(value), so a bad value raises as in the constructor."""
    return property(lambda self: getattr(self, attr), lambda self, value: setattr(self, attr, check(value)))


class _Stage(Enum):
    READY, UNSCALED, STEPPED = range(3)


class _OptimizerState:
    """One optimizer's progress through the current iteration."""
    __slots__ = ("stage", "found_inf")

    def __init__(self):
        self.stage = _Stage.READY
        self.found_inf: bool | None = None  # None: no gradient was checked (none present)


class DynamicLossScaler:
    """Same arguments, scale trajectory, skip decisions and misuse errors as torch.amp.GradScaler."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True):
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {type(enabled).__name__} {enabled!r}")
        self._scale = _scale_value("init_scale", init_scale)  # S, always an fp32 value
        self._growth_factor = _growth_factor(growth_factor)
        self._backoff_factor = _backoff_factor(backoff_factor)
        self._growth_interval = _growth_interval(growth_interval)
        self._enabled = enabled
        self._growth_tracker = 0  # clean steps since the last change of S
        self._per_optimizer: dict[int, _OptimizerState] = {}  # this iteration's, keyed by id(optimizer)

    # ---- settings: read them as attributes; setting one checks it as the constructor does ----
    @property
    def enabled(self) -> bool:
        return self._enabled

    def is_enabled(self) -> bool:
        return self._enabled

    growth_factor = _setting("_growth_factor", _growth_factor)
    backoff_factor = _setting("_backoff_factor", _backoff_factor)
    growth_interval = _setting("_growth_interval", _growth_interval)

    @property
    def growth_tracker(self) -> int:
        """Clean steps since S last changed (GradScaler's `_growth_tracker`)."""
        return self._growth_tracker if self._enabled else 0

    # ---- one iteration: scale -> backward -> [unscale_ -> clip] -> step (each optimizer) -> update ----
    def scale(self, outputs):
        """outputs * S: a tensor, or a (nested) list/tuple/iterable of tensors (backward then yields S x grads)."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            return outputs * self._scale
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        if isinstance(outputs, (str, bytes)) or not hasattr(outputs, "__iter__"):
            raise ValueError(f"outputs must be a Tensor or an iterable of Tensors, got {type(outputs).__name__}")
        return map(self.scale, outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide `optimizer`'s gradients by S in place (call before clipping), once per iteration.

        Returns whether any of them held an inf/nan (that optimizer's step will then be skipped).
        """
        if not self._enabled:
            return False
        _check_optimizer(optimizer)
        state = self._per_optimizer.setdefault(id(optimizer), _OptimizerState())
        if state.stage is _Stage.UNSCALED:
            raise RuntimeError("unscale_() was already called for this optimizer since the last update(): "
                               "its gradients are already unscaled")
        if state.stage is _Stage.STEPPED:
            raise RuntimeError("unscale_() called after step() for this optimizer: unscale_ comes before step, "
                               "then update() starts the next iteration")
        grads = []  # check every gradient before touching any, so a refused call changes nothing
        for group in optimizer.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if g.dtype == torch.float16:
                    raise ValueError("cannot unscale fp16 gradients: keep fp32 master parameters "
                                     "(as torch.amp.GradScaler: 'Attempting to unscale FP16 gradients')")
                grads.append(g._values() if g.is_sparse else g)  # a sparse gradient: its stored values
        inv = _fp32(1.0 / self._scale)  # as GradScaler: 1/S in double, then rounded to fp32
        finite: dict[torch.device, list[torch.Tensor]] = {}
        with torch.no_grad():
            for g in grads:
                finite.setdefault(g.device, []).append(torch.isfinite(g).all())  # the *scaled* value
                g.mul_(inv)  # in g's dtype; bf16 via fp32 math, as the fused kernel
        if finite:  # one host sync per device
            state.found_inf = any(not bool(torch.stack(flags).all()) for flags in finite.values())
        state.stage = _Stage.UNSCALED
        return bool(state.found_inf)

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """Unscale if not done yet, then optimizer.step(*args, **kwargs) unless a gradient was inf/nan.

        Returns optimizer.step's return value, or None when the step was skipped (as GradScaler).
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs or any(callable(a) for a in args):
            raise RuntimeError("a closure cannot be used with an enabled loss scaler: call backward on "
                               "scaler.scale(loss), then step(optimizer)")
        _check_optimizer(optimizer)
        state = self._per_optimizer.setdefault(id(optimizer), _OptimizerState())
        if state.stage is _Stage.STEPPED:
            raise RuntimeError("step() was already called for this optimizer since the last update(): "
                               "call update() once per iteration, after stepping every optimizer")
        if state.stage is _Stage.READY:
            self.unscale_(optimizer)
        if state.found_inf is None:
            raise RuntimeError("step(): this optimizer has no gradients to check (every .grad is None); "
                               "call backward() on scaler.scale(loss) first")
        retval = None if state.found_inf else optimizer.step(*args, **kwargs)  # skipped: weights untouched
        state.stage = _Stage.STEPPED
        return retval

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """End the iteration: back off if any optimizer found inf/nan, else count a clean step and grow S
        after growth_interval of them (only if the grown S is finite in fp32). new_scale sets S instead
        (the clean-step count is kept, as GradScaler)."""
        if not self._enabled:
            return
        if new_scale is not None:
            self._scale = _scale_value("new_scale", new_scale)
            self._per_optimizer.clear()
            return
        checked = [s.found_inf for s in self._per_optimizer.values() if s.found_inf is not None]
        self._per_optimizer.clear()
        if not checked:
            raise RuntimeError("update(): no optimizer was unscaled or stepped (with gradients) since the last "
                               "update(); call step(optimizer) first")
        if any(checked):
            backed_off = _fp32(self._scale * self._backoff_factor)
            if not (backed_off > 0 and math.isfinite(_fp32(1.0 / backed_off))):
                raise RuntimeError(f"the loss scale underflowed: backing off from {self._scale!r} leaves 1/S "
                                   f"beyond fp32; gradients are inf/nan at every scale (is the loss nan?)")
            self._scale, self._growth_tracker = backed_off, 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self._growth_interval:
                grown = _fp32(self._scale * self._growth_factor)
                if math.isfinite(grown):  # never grow past fp32's range
                    self._scale = grown
                self._growth_tracker = 0

    def get_scale(self) -> float:
        """S as a Python float (an fp32 value), or 1.0 when disabled."""
        return self._scale if self._enabled else 1.0

    # ---- checkpoints: the same keys as GradScaler's, so either loads the other's ----
    def state_dict(self) -> dict:
        if not self._enabled:
            return {}
        return {"scale": self._scale, "growth_factor": self._growth_factor, "backoff_factor": self._backoff_factor,
                "growth_interval": self._growth_interval, "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        """Load a state_dict() of this class or of torch.amp.GradScaler (a no-op when disabled)."""
        if not self._enabled:
            return
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict from state_dict(), got {type(state).__name__}")
        if len(state) == 0:
            raise RuntimeError("the state dict is empty: it was probably saved from a disabled scaler")
        if "_growth_tracker" not in state and "growth_tracker" in state:  # this class's older key
            state = {**state, "_growth_tracker": state["growth_tracker"]}
        missing = [k for k in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
                   if k not in state]
        if missing:
            raise KeyError(f"state dict lacks {', '.join(missing)}")
        scale = _scale_value("scale", state["scale"])  # check everything before changing anything
        growth, backoff = _growth_factor(state["growth_factor"]), _backoff_factor(state["backoff_factor"])
        interval, tracker = _growth_interval(state["growth_interval"]), state["_growth_tracker"]
        if isinstance(tracker, bool) or not isinstance(tracker, numbers.Integral) or not 0 <= tracker < interval:
            raise ValueError(f"_growth_tracker must be an integer in [0, growth_interval={interval}), got {tracker!r}")
        self._scale, self._growth_factor, self._backoff_factor = scale, growth, backoff
        self._growth_interval, self._growth_tracker = interval, int(tracker)

    def __getstate__(self) -> dict:
        if self._per_optimizer:
            raise RuntimeError("a loss scaler can be pickled or copied only between iterations (before any "
                               "unscale_/step, or after update())")
        return self.__dict__.copy()

    def __repr__(self) -> str:
        return (f"DynamicLossScaler(scale={self.get_scale()!r}, growth_factor={self._growth_factor!r}, "
                f"backoff_factor={self._backoff_factor!r}, growth_interval={self._growth_interval!r}, "
                f"enabled={self._enabled!r})")
