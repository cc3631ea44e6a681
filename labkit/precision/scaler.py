"""A dynamic loss scaler written from scratch: scale, unscale with an inf/nan check, skip, back off, grow.

fp16's smallest subnormal is 2**-24 (about 6e-8): gradients below it flush to zero. Multiplying the
loss by S multiplies every gradient by S, lifting small ones into range; before the optimizer step
the gradients are divided by S again. If any scaled gradient overflowed to inf/nan the step is
skipped and S halves; after `growth_interval` clean steps in a row S doubles.
"""

from __future__ import annotations

import math

import torch


class DynamicLossScaler:
    """Same arguments, scale trajectory and skip decisions as torch.amp.GradScaler."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True):
        if not (init_scale > 0 and math.isfinite(init_scale)):
            raise ValueError(f"init_scale must be a positive finite number, got {init_scale!r}")
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor!r}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
        if not (isinstance(growth_interval, int) and growth_interval > 0):
            raise ValueError(f"growth_interval must be a positive integer, got {growth_interval!r}")
        self.scale_value = float(init_scale)  # S
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.enabled = growth_interval, enabled
        self.growth_tracker = 0  # clean steps since the last change of S
        self.found_inf = False  # did the last unscale see inf/nan?
        self._unscaled: set[int] = set()  # optimizers already unscaled this step

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """loss * S (backward then yields S-times-larger gradients)."""
        return loss * self.scale_value if self.enabled else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide every gradient by S in place (call before clipping); return True if any is inf/nan."""
        if not self.enabled or id(optimizer) in self._unscaled:
            return self.found_inf
        inv = float(1.0 / float(self.scale_value))  # as GradScaler: 1/S in double, then fp32
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.dtype == torch.float16:
                    raise ValueError("cannot unscale fp16 gradients: keep fp32 master parameters")
                if not torch.isfinite(p.grad).all():
                    self.found_inf = True
                p.grad.mul_(inv)
        self._unscaled.add(id(optimizer))
        return self.found_inf

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale if not done yet, then step unless a gradient was inf/nan. Returns whether it stepped."""
        if not self.enabled:
            optimizer.step()
            return True
        self.unscale_(optimizer)
        if self.found_inf:
            return False  # the skipped step: poisoned gradients never reach the weights
        optimizer.step()
        return True

    def update(self) -> None:
        """Back off after an overflow; grow after growth_interval clean steps; start a new step."""
        if not self.enabled:
            return
        if self.found_inf:
            self.scale_value *= self.backoff_factor
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.scale_value *= self.growth_factor
                self.growth_tracker = 0
        self.found_inf = False
        self._unscaled.clear()

    def get_scale(self) -> float:
        return self.scale_value

    def state_dict(self) -> dict:
        return {"scale": self.scale_value, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale_value = float(state["scale"])
        self.growth_factor, self.backoff_factor = state["growth_factor"], state["backoff_factor"]
        self.growth_interval, self.growth_tracker = state["growth_interval"], state["growth_tracker"]
