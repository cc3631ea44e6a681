"""Shared result types: a byte breakdown by category, an estimate, and a measurement."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .table import Report, Table, wrap_line


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
class Moment:
    """One candidate moment of a training step: where it is, and the terms live then. Its bytes are exactly
    the sum of its terms; the estimate's peak is its largest moment."""

    phase: str  # "forward", "backward" or "optimizer"
    where: str  # e.g. "block 3 backward (2nd micro-batch)", "the loss", "AdamW step"
    terms: list[Term]

    @property
    def total(self) -> int:
        return sum(t.bytes for t in self.terms)

    def breakdown(self) -> Breakdown:
        b = Breakdown()
        for t in self.terms:
            b.bytes[t.category] += t.bytes
        return b

    def explain(self) -> "Report":
        """The moment's terms as a table: bytes, category, name, formula and source; the last line the sum.
        Text within 120 columns (print it); an HTML table in Jupyter."""
        return Report([self.table()])

    def table(self) -> "Table":
        """The terms that hold bytes, one row each, under the moment's phase and where; the sum below."""
        from .units import fmt_bytes

        rows = [[fmt_bytes(t.bytes), str(t.category), t.name, t.formula, t.source] for t in self.terms if t.bytes]
        return Table(["bytes", "category", "term", "formula", "source"], rows, right={0},
                     caption=f"{self.phase}: {self.where}", indent=2,
                     footer=[f"{fmt_bytes(self.total)} = the sum of the {len(rows)} terms above"])


class _Phases:
    """The peak of a result with `phases` (phase -> Breakdown): its largest phase."""

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda p: self.phases[p].total)

    @property
    def peak(self) -> Breakdown:
        return self.phases[self.peak_phase]


@dataclass
class Estimate(_Phases):
    """The estimator's prediction for one training step: candidate moments made of terms; the peak is the
    largest moment. `phases` holds each phase's largest moment as a breakdown by category."""

    label: str  # e.g. "gpt2 B=4 S=256 mixed-bf16 adamw"
    n_params: int
    phases: dict[str, Breakdown] | None = None  # phase name -> breakdown at that phase's peak (from moments)
    terms: list[Term] = field(default_factory=list)  # the step's main terms, each once (a summary table)
    moments: list[Moment] = field(default_factory=list)
    textbook: list[Term] = field(default_factory=list)  # the published formulas' figure (labkit.estimate.textbook)

    def __post_init__(self) -> None:
        if self.phases is None:
            if not self.moments:
                raise ValueError("an Estimate needs moments (or phases)")
            best: dict[str, Moment] = {}
            for m in self.moments:
                if m.phase not in best or m.total > best[m.phase].total:
                    best[m.phase] = m
            self.phases = {p: best[p].breakdown() for p in sorted(best, key=_phase_order)}

    @property
    def peak_moment(self) -> Moment | None:
        """The largest moment (the first of equals, in step order); None for an estimate built from phases."""
        return max(self.moments, key=lambda m: m.total) if self.moments else None

    def without(self, text: str) -> "Estimate":
        """The same estimate without the moments whose `where` contains `text`: e.g. GaLore's steady step,
        `e.without("projector refresh")` (labkit.estimate.moments.REFRESH). The terms table is kept."""
        if not self.moments:
            raise ValueError("this estimate was built from phases, not moments: nothing to leave out")
        kept = [m for m in self.moments if text not in m.where]
        if not kept:
            raise ValueError(f"every moment's where contains {text!r}: nothing would be left")
        return Estimate(self.label, self.n_params, terms=list(self.terms), moments=kept, textbook=list(self.textbook))

    def explain(self, phase: str | None = None) -> "Report":
        """Where every byte of the peak (or of `phase`'s largest moment) comes from: term, formula, source.
        Text within 120 columns (print it, or read it in the CLI); HTML tables in Jupyter."""
        if not self.moments:
            raise ValueError("this estimate was built from phases, not moments: nothing to explain")
        pool = [m for m in self.moments if phase is None or m.phase == phase]
        if not pool:
            raise ValueError(f"no moment in phase {phase!r}; phases: {', '.join(self.phases)}")
        top = max(pool, key=lambda m: m.total)
        head = wrap_line(f"{self.label}: {'peak' if phase is None else phase + ' peak'} at {top.phase}, {top.where}")
        if not self.textbook:
            return Report([head, top.table()])
        from .units import fmt_bytes

        fixes = corrections(self.textbook, top.terms)
        book = sum(t.bytes for t in self.textbook)
        exact = wrap_line(f"exact: {fmt_bytes(top.total)} = {fmt_bytes(book)} (textbook) + "
                          f"{fmt_bytes(top.total - book)} ({len(fixes)} corrections); the textbook is "
                          f"{100 * (book - top.total) / top.total:+.1f} % off")
        return Report([head, Moment("textbook", "the published formulas (labkit.estimate.textbook)",
                                    self.textbook).table(),
                       Moment("corrections", "what the exact layer's ops add or take away at this moment",
                              fixes).table(), exact, top.table()])


def corrections(textbook: list[Term], exact: list[Term]) -> list[Term]:
    """What turns the textbook terms into a moment's exact terms, category by category: an exact term the textbook
    has by name, its difference; one it lacks (an op's transient, a tensor the formula omits), the term itself; a
    textbook term the moment lacks by name, minus it. The corrections sum to exact - textbook."""
    book = {t.name: t for t in textbook}
    out = []
    for t in exact:
        b = book.get(t.name)
        if b is None:
            out.append(t)
        elif t.bytes != b.bytes:
            out.append(Term(f"{t.name}: exact - textbook", t.category, t.bytes - b.bytes,
                            f"{t.formula} - ({b.formula})", t.source))
    names = {t.name for t in exact}
    out += [Term(f"{t.name}: textbook's formula, not in this moment's terms", t.category, -t.bytes, t.formula,
                 t.source) for t in textbook if t.name not in names]
    return [t for t in out if t.bytes]


def _phase_order(p: str) -> int:
    return PHASES.index(p) if p in PHASES else len(PHASES)


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
class Measurement(_Phases):
    """What the ledger saw: the peak of each phase by category, the timeline, and what was live at the end."""

    label: str
    phases: dict[str, Breakdown]  # phase name -> breakdown at that phase's peak (over all steps)
    timeline: Timeline
    baseline: Breakdown  # live bytes when tracking started
    allocator: dict[str, int] | None = None  # CUDA only: allocated, reserved, max_allocated, ...
    final: Breakdown | None = None  # live bytes when the ledger stopped (e.g. all optimizer state after the last step)
    trace: object = None  # the ledger's raw events, a labkit.memory.memviz.Trace (memviz imports this module)

    def of_step(self, step: int) -> "Measurement":
        """The same measurement with each phase's peak taken over one step only (steps count from 1, as the
        ledger's phase markers do): e.g. the last of several steps, after a first one that made the
        optimizer state (and, for GaLore, its projectors)."""
        total, marks = self.timeline.total, self.timeline.phase_starts
        if not any(s == step for _, _, s in marks):
            raise ValueError(f"step {step} was not measured; steps: {sorted({s for _, _, s in marks})}")
        peaks: dict[str, tuple[int, int]] = {}  # phase -> (bytes, event index after which they were live)
        for i, (ev, phase, s) in enumerate(marks):
            end = marks[i + 1][0] if i + 1 < len(marks) else len(total)
            if s != step:
                continue
            if ev and (phase not in peaks or total[ev - 1] > peaks[phase][0]):  # its first moment
                peaks[phase] = (total[ev - 1], ev - 1)
            for j in range(ev, end):
                if phase not in peaks or total[j] > peaks[phase][0]:
                    peaks[phase] = (total[j], j)
        phases = {p: Breakdown({c: self.timeline.bytes[c][j] for c in CATEGORIES})
                  for p in PHASES + tuple(sorted(set(peaks) - set(PHASES))) if p in peaks for j in [peaks[p][1]]}
        return Measurement(f"{self.label} (step {step})", phases, self.timeline, self.baseline, self.allocator,
                           self.final, self.trace)

    def to_memory_viz(self, path, device: int = 0):
        """Write the timeline as a snapshot PyTorch's memory viewer opens (https://pytorch.org/memory_viz):
        one block per storage, coloured by category, named by the op that made it. Returns the path."""
        if self.trace is None:
            raise ValueError("this measurement has no event trace (only a Ledger's measurement() carries one)")
        return self.trace.dump(path, device)

    @property
    def saved(self) -> int:
        """ACT when backward starts: the most ACT the timeline ever holds (ACT only shrinks in backward)."""
        return max(self.timeline.bytes[Category.ACT], default=0)
