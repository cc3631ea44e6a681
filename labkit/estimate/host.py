"""What the offload options need off the device: host RAM and disk, from the estimate's own terms.

- optimizer_offload "cpu" / "disk" runs labkit.optim.OffloadAdamW: fp32 master weights, m and v,
  4 B each per trained element (in RAM, or memmaps on disk), two fp32 scratch arrays the size of
  the largest parameter (RAM), and on CUDA a pinned staging copy of every weight in its device
  dtype (RAM).
- offload_activations runs labkit.recompute.offload_activations: one micro-batch's saved tensors
  go to host RAM, at most the activations the forward holds at the loss without offload (and,
  with nothing checkpointed, the 16-bit weight copies autograd saves under autocast).

The device's bytes are the estimate's; these are the other side of the same step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from labkit.memory.report import Category, MomentKind, TermKey

from .predict import Precision
from .recipe import Recipe
from .spec import spec_from


class Medium(str, enum.Enum):
    """Where offloaded bytes live."""

    RAM = "host RAM"
    DISK = "disk"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class HostNeed:
    """Bytes an offload option keeps off the device: where, what, how many, from which formula."""

    medium: Medium
    name: str
    bytes: int
    formula: str
    source: str
    at_most: bool = False  # an upper bound (what could be offloaded), not an exact count

    def as_dict(self) -> dict:
        return {"medium": self.medium.name.lower(), "name": self.name, "bytes": int(self.bytes),
                "formula": self.formula, "at_most": self.at_most}


OFFLOAD_ADAMW = "labkit.optim.OffloadAdamW"
OFFLOAD_ACTS = "labkit.recompute.offload_activations"


def host_needs(r: Recipe) -> list[HostNeed]:
    """Every HostNeed of the recipe's offload options (empty without them)."""
    return optimizer_offload_needs(r) + activation_offload_needs(r)


def optimizer_offload_needs(r: Recipe) -> list[HostNeed]:
    """OffloadAdamW's host arrays: master, m and v (RAM for "cpu", disk for "disk"), its scratch
    and, on CUDA, the pinned staging copy."""
    if r.optimizer_offload is None:
        return []
    spec = spec_from(r.model, **r.config)
    n, big = spec.n_params, spec.largest_param
    state = Medium.DISK if r.optimizer_offload == "disk" else Medium.RAM
    out = [HostNeed(state, "fp32 master weights, m and v", 3 * 4 * n,
                    f"3 x N x 4 B = 3 x {n:,} x 4",
                    OFFLOAD_ADAMW + (": numpy memmaps" if state is Medium.DISK else "")),
           HostNeed(Medium.RAM, "fp32 gradient and denominator scratch", 2 * 4 * big,
                    f"2 x the largest parameter x 4 B = 2 x {big:,} x 4", OFFLOAD_ADAMW)]
    if r.device == "cuda":
        w = Precision.of(r.dtype).weight
        out.append(HostNeed(Medium.RAM, "pinned staging copy of the weights", n * w,
                            f"N x {w} B = {n:,} x {w}",
                            OFFLOAD_ADAMW + ": gradients in, weights out"))
    return out


def activation_offload_needs(r: Recipe) -> list[HostNeed]:
    """The saved activations of one micro-batch in host RAM: at most what the same step without
    offload holds at the loss in activations (and, nothing checkpointed, autocast's saved 16-bit
    weight copies)."""
    if not r.offload_activations:
        return []
    from .estimator import estimate

    plain = estimate(r.replace(offload_activations=False))
    at_loss = [m for m in plain.moments if m.kind is MomentKind.LOSS]
    loss = max(at_loss or plain.moments, key=lambda m: m.breakdown()[Category.ACT])
    keys = {TermKey.COPIES_16BIT} if r.checkpoint == "none" else set()
    held = [t for t in loss.terms if t.bytes and (t.category is Category.ACT or t.key in keys)]
    return [HostNeed(Medium.RAM, "saved activations of one micro-batch", sum(t.bytes for t in held),
                     " + ".join(t.name for t in held) + " (at the loss, without offload)",
                     OFFLOAD_ACTS, at_most=True)]
