"""Shared result types: a byte breakdown by category, an estimate, and a measurement."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Category(str, enum.Enum):
    """What a block of memory is for. The same six tags in the estimator and the ledger."""

    PARAM = "parameters"
    BUFFER = "buffers"
    GRAD = "gradients"
    OPT = "optimizer state"
    ACT = "activations"  # saved by the forward pass for the backward pass
    TEMP = "temporaries"  # short-lived: op workspaces, gradients in flight, casts

    def __str__(self) -> str:
        return self.value


CATEGORIES: tuple[Category, ...] = tuple(Category)
PHASES: tuple[str, ...] = ("forward", "backward", "optimizer")


@dataclass
class Breakdown:
    """Bytes per category at one moment (for example the peak of a phase)."""

    bytes: dict[Category, int] = field(default_factory=lambda: {c: 0 for c in CATEGORIES})

    def __post_init__(self) -> None:
        for c in CATEGORIES:
            self.bytes.setdefault(c, 0)

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    def __getitem__(self, cat: Category) -> int:
        return self.bytes[Category(cat)]

    def as_dict(self) -> dict[str, int]:
        """Plain {category name: bytes} plus 'total', for JSON and tables."""
        out = {c.name.lower(): int(self.bytes[c]) for c in CATEGORIES}
        out["total"] = int(self.total)
        return out


@dataclass
class Term:
    """One named term of an estimate: its bytes, the formula that gave them, and its source."""

    name: str
    category: Category
    bytes: int
    formula: str
    source: str = ""


@dataclass
class Estimate:
    """The estimator's prediction for one training step."""

    label: str  # e.g. "gpt2 B=4 S=256 mixed-bf16 adamw"
    n_params: int
    phases: dict[str, Breakdown]  # phase name -> breakdown at that phase's peak
    terms: list[Term] = field(default_factory=list)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda p: self.phases[p].total)

    @property
    def peak(self) -> Breakdown:
        return self.phases[self.peak_phase]


@dataclass
class Timeline:
    """Live bytes per category after each allocation or free, with phase markers."""

    bytes: dict[Category, list[int]]  # category -> bytes after event i
    phase_starts: list[tuple[int, str, int]]  # (event index, phase, step number)

    @property
    def total(self) -> list[int]:
        cols = [self.bytes[c] for c in CATEGORIES]
        return [sum(v) for v in zip(*cols)] if cols and cols[0] else []


@dataclass
class Measurement:
    """What the ledger saw: the peak of each phase by category, the timeline, and what was live at the end."""

    label: str
    phases: dict[str, Breakdown]  # phase name -> breakdown at that phase's peak (over all steps)
    timeline: Timeline
    baseline: Breakdown  # live bytes when tracking started
    allocator: dict[str, int] | None = None  # CUDA only: allocated, reserved, max_allocated, ...
    final: Breakdown | None = None  # live bytes when the ledger stopped (e.g. all optimizer state after the last step)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda p: self.phases[p].total)

    @property
    def peak(self) -> Breakdown:
        return self.phases[self.peak_phase]
