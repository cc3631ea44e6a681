"""Shared result types: a byte breakdown by category, an estimate, and a measurement."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable

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


class TermKey(enum.Enum):
    """What a term of an estimate is, from one closed set: code decides on the key, people read the term's name.
    A layer's terms carry the layer's index in `Term.block`, not in the key."""

    PARAMETERS = "parameters"  # the trained weights (a rank's share or shards)
    FROZEN_BASE = "frozen base"  # LoRA's frozen weights left in the model's dtype
    QUANTIZED_BASE = "quantized base"  # int8/NF4/int4 codes and scales of a frozen base (buffers)
    ADAPTERS = "adapters"  # LoRA's A and B
    BUFFERS = "buffers"  # a model's own buffers (BatchNorm's running statistics)
    GATHERED_ROOT = "gathered root"  # ZeRO-3: the root unit's parameters, all-gathered
    GATHERED_BLOCKS = "gathered blocks"  # ZeRO-3: blocks' parameters, all-gathered
    COPIES_16BIT = "16-bit copies"  # autocast's weight copies (a layer's in `block`)
    STEP_CAST = "step cast"  # the optimizer step's fp32 working copy of a 16-bit parameter
    GRADIENTS = "gradients"  # .grad of every trained parameter (or its shard)
    HEAD_GRADIENTS = "head gradients"  # the output matrix's and final norm's .grad
    TIED_HEAD_GRADIENT = "tied head gradient"  # a tied head's part, in flight until the embedding's is added
    BLOCK_GRADIENTS = "block gradients"  # .grad of the blocks whose backward is finished
    GRADIENTS_SO_FAR = "gradients so far"  # a block's gradients made so far in its backward
    NEW_GRADIENT = "new gradient"  # a gradient made but not yet summed into .grad
    EMBEDDING_GRADIENT = "embedding gradient"  # the embedding's dense gradient
    EMBEDDING_TIED_SUM = "embedding tied sum"  # a tied matrix's dense gradient and its sum with the head's part
    OPTIMIZER_STATE = "optimizer state"
    OPTIMIZER_TEMPS = "optimizer temporaries"  # the step's own temporaries (GaLore's SVD included)
    INPUTS = "inputs"  # token ids and targets
    EMBEDDING = "embedding"  # what is saved before the first block (position ids, embedding dropout)
    FORWARD_LOCALS = "forward locals"  # what the model's forward function holds (embeddings, masks, outputs)
    SAVED_ACTIVATIONS = "saved activations"  # what layers save for backward (one layer's: `block` set)
    BLOCK_INPUT = "block input"  # a layer's input, saved by the layer itself (`block` set)
    CHECKPOINT_INPUTS = "checkpoint inputs"  # what checkpointed regions keep: inputs, cached outputs, arguments
    HEAD = "head"  # what the final norm and the head save after the last block
    LOGITS = "logits"
    LOG_SOFTMAX = "log-softmax"  # the loss's saved log-probabilities
    LOSS_TEMPS = "loss temporaries"  # the loss's gradients and its forward's locals
    HEAD_BACKWARD = "head backward"  # the head's backward temporaries
    RESIDUAL_GRADIENT = "residual gradient"  # the gradient carried from block to block
    LAYER_TEMPS = "layer temporaries"  # what lives inside a layer's forward, recompute or backward
    RECOMPUTED = "recomputed"  # a checkpointed unit's saved tensors made again by its recompute (temporaries)
    DEQUANT_SCRATCH = "dequantization scratch"
    COMM_BUFFERS = "communication buffers"  # all-gather outputs, reduce-scatter inputs
    IN_FLIGHT = "in flight"  # pipeline: other micro-batches' activations, a stage's output
    ATTENTION_SCORES = "attention scores"  # the summary table's (S, S) probabilities and dropout masks


class MomentKind(enum.Enum):
    """Where in a step a moment is, from one closed set (a block's moments carry its index in `Moment.block`);
    `Moment.where` says it in words."""

    LOSS = "the loss"  # forward: every activation held, the loss running
    DEQUANT = "dequantizing"  # forward: the last block dequantizing its largest weight
    BLOCK_FORWARD = "block forward"  # forward inside or at the end of a block
    LOSS_BACKWARD = "loss backward"  # backward's start: the loss's backward
    HEAD_BACKWARD = "head backward"  # inside the head's backward (chunked: its worst chunk)
    HEAD_AFTER = "after the head"  # the head's matmul(s) returned: its weight gradient's cast, the chunks' cat
    FINAL_NORM_BACKWARD = "final norm backward"
    RECOMPUTE = "recompute"  # a checkpointed unit's forward again
    BLOCK_BACKWARD = "block backward"  # inside a block's (or a segment's) backward
    EMBEDDING_BACKWARD = "embedding backward"  # the embedding's backward
    EMBEDDING_SUM = "embedding sum"  # a tied embedding's two gradient parts summed
    GRADIENTS_READY = "gradients ready"  # a block's last parameter gradient made (ZeRO-2 reduces its unit then)
    GRADIENT_REDUCE = "gradient reduce"  # ZeRO-2/3: a unit's gradients flattened for their reduce-scatter
    REDUCE_AFTER_BACKWARD = "reduce after backward"  # ZeRO-1: every gradient full, the first unit's flattened
    OPTIMIZER_STEP = "optimizer step"
    PARAMETER_STEP = "parameter step"  # step in backward: a parameter steps as its gradient is ready


class Variant(str, enum.Enum):
    """Which of two alternative steps a moment belongs to (GaLore: a projector-refresh step or a steady one);
    `Estimate.without(Variant.REFRESH)` keeps the steady step's moments."""

    REFRESH = "projector refresh"
    STEADY = "steady (no refresh)"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)
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

    name: str  # for people; code decides on `key`
    category: Category
    bytes: int
    formula: str
    source: str = ""
    key: TermKey = field(kw_only=True)  # what the term is (TermKey)
    block: int | None = field(default=None, kw_only=True)  # the layer it belongs to, when it is one layer's


@dataclass
class Moment:
    """One candidate moment of a training step: where it is, and the terms live then. Its bytes are exactly
    the sum of its terms; the estimate's peak is its largest moment."""

    phase: str  # "forward", "backward" or "optimizer"
    where: str  # for people, e.g. "block 3 backward (2nd micro-batch)", "the loss", "AdamW step"
    terms: list[Term]
    kind: MomentKind = field(kw_only=True)  # where in the step, for code (MomentKind)
    block: int | None = field(default=None, kw_only=True)  # the block it is inside, if one
    variant: Variant | None = field(default=None, kw_only=True)  # GaLore: the refresh step's or the steady one's
    micro: int = field(default=1, kw_only=True)  # 1: the first micro-batch's moment; 2: a later one's

    @property
    def total(self) -> int:
        return sum(t.bytes for t in self.terms)

    @property
    def key(self) -> tuple:
        """(phase, kind, block, variant, micro): the same point of a step in another estimate of it
        (`Estimate.moment(key)`), for code; `where` says it for people."""
        return self.phase, self.kind, self.block, self.variant, self.micro

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
        return _term_table(f"{self.phase}: {self.where}", self.terms)


def _term_table(title: str, terms: list[Term]) -> "Table":
    """Terms as a table under `title`: bytes, category, name, formula and source; their sum below."""
    from .units import fmt_bytes

    rows = [[fmt_bytes(t.bytes), str(t.category), t.name, t.formula, t.source] for t in terms if t.bytes]
    return Table(["bytes", "category", "term", "formula", "source"], rows, right={0}, caption=title, indent=2,
                 footer=[f"{fmt_bytes(sum(t.bytes for t in terms))} = the sum of the {len(rows)} terms above"])


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
    # moment -> its KeyRows, key by key (labkit.estimate.keyed makes it)
    keyed: Callable[[Moment], list["KeyRow"]] | None = field(default=None, repr=False,
                                                              compare=False)
    # bytes in CUDA unified memory (paged optimizer states), outside every moment and the device
    # peak: the driver keeps them on the device while it has room, and pages them to host RAM if not
    unified: int = 0

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

    def moment(self, key: tuple) -> Moment:
        """The moment at `key` (`Moment.key`: phase, kind, block, variant, micro), e.g. the point where another
        estimate of the same step peaks; a KeyError if this step has none or several there."""
        found = [m for m in self.moments if m.key == key]
        if len(found) != 1:
            raise KeyError(f"{len(found)} moments at {key} in {self.label}")
        return found[0]

    def term_bytes(self, key: TermKey) -> int:
        """The summary table's bytes of one kind of term (`Term.key`), 0 when the step has none: e.g.
        `e.term_bytes(TermKey.LOG_SOFTMAX)`. Code picks a term by its key; its name is for people."""
        if not isinstance(key, TermKey):
            raise TypeError(f"give a TermKey (labkit.memory.TermKey), got {key!r}")
        return sum(t.bytes for t in self.terms if t.key is key)

    def without(self, variant: Variant | str) -> "Estimate":
        """The same estimate without the moments of one step variant: e.g. GaLore's steady step,
        `e.without(Variant.REFRESH)` (labkit.estimate.moments.REFRESH). The terms table is kept."""
        if not self.moments:
            raise ValueError("this estimate was built from phases, not moments: nothing to leave out")
        try:
            v = Variant(variant)
        except ValueError:
            raise ValueError(f"every moment is left out by its step variant, one of "
                             f"{', '.join(repr(v.value) for v in Variant)}; got {variant!r}") from None
        kept = [m for m in self.moments if m.variant is not v]
        if not kept:
            raise ValueError(f"every moment is of the variant {variant!r}: nothing would be left")
        return Estimate(self.label, self.n_params, terms=list(self.terms), moments=kept,
                        textbook=list(self.textbook), keyed=self.keyed, unified=self.unified)

    def explain(self, phase: str | None = None) -> "Report":
        """Where every byte of the peak (or of `phase`'s largest moment) comes from: key by key,
        the textbook's bytes, the exact bytes and the named corrections between them (when the
        estimate has a textbook layer), then the moment's terms with formula and source. Text
        within 120 columns; HTML tables in Jupyter."""
        if not self.moments:
            raise ValueError("this estimate was built from phases, not moments: nothing to explain")
        pool = [m for m in self.moments if phase is None or m.phase == phase]
        if not pool:
            raise ValueError(f"no moment in phase {phase!r}; phases: {', '.join(self.phases)}")
        top = max(pool, key=lambda m: m.total)
        at = "peak" if phase is None else phase + " peak"
        head = wrap_line(f"{self.label}: {at} at {top.phase}, {top.where}")
        if not self.textbook:
            return Report([head, top.table()])
        from .units import fmt_bytes

        rows = self.keyed(top) if self.keyed is not None else key_rows(self.textbook, top)
        book = sum(t.bytes for t in self.textbook)
        fixes = sum(len(r.corrections) for r in rows)
        left = sum(r.unexplained for r in rows)
        off = 100 * (book - top.total) / top.total
        exact = wrap_line(f"exact: {fmt_bytes(top.total)} = {fmt_bytes(book)} (textbook) + "
                          f"{fmt_bytes(top.total - book)} ({fixes} corrections"
                          + (f", {fmt_bytes(left)} not yet explained" if left else "")
                          + f"); the textbook is {off:+.1f} % off")
        title = "textbook: the published formulas (labkit.estimate.textbook)"
        return Report([head, _term_table(title, self.textbook), _key_table(rows), exact,
                       top.table()])


@dataclass
class KeyRow:
    """One key of explain(): its textbook bytes, its exact bytes at a moment, and the corrections
    between them, each computed by its own function from the model, the recipe and the walk (never
    from the exact bytes; labkit.estimate.keyed). `lives`: a textbook key with no bytes at this
    moment says when it lives, not a negative correction. `unexplained`: what the corrections
    leave, shown as "not yet explained" (0 when they are complete)."""

    key: TermKey
    category: Category
    textbook: int
    exact: int
    corrections: list[Term] = field(default_factory=list)
    lives: str = ""

    @property
    def unexplained(self) -> int:
        if self.lives and not self.exact:
            return 0
        return self.exact - self.textbook - sum(t.bytes for t in self.corrections)


def key_rows(textbook: list[Term], moment: Moment) -> list[KeyRow]:
    """Rows with no corrections computed (an estimate without a corrector): the textbook's and the
    exact bytes per key, the whole difference not yet explained."""
    book, exact = _by_key(textbook), _by_key(moment.terms)
    cats = {t.key: t.category for t in [*textbook, *moment.terms]}
    return [KeyRow(k, cats[k], book.get(k, 0), exact.get(k, 0)) for k in {**book, **exact}]


def _by_key(terms: list[Term]) -> dict[TermKey, int]:
    out: dict[TermKey, int] = {}
    for t in terms:
        out[t.key] = out.get(t.key, 0) + t.bytes
    return out


def _key_table(rows: list[KeyRow]) -> "Table":
    """Key by key: textbook, exact, then each correction (bytes, what, formula, source)."""
    from .units import fmt_bytes

    out = []
    for r in rows:
        if not (r.textbook or r.exact or r.corrections):
            continue
        book = fmt_bytes(r.textbook) if r.textbook else "-"
        out.append([r.key.value, book, fmt_bytes(r.exact), "", r.lives, ""])
        for t in r.corrections:
            what = t.name + (f": {t.formula}" if t.formula else "")
            out.append(["", "", "", f"{t.bytes:+,} B", what, t.source])
        if r.unexplained:
            out.append(["", "", "", f"{r.unexplained:+,} B", "not yet explained", ""])
    return Table(["key", "textbook", "exact", "correction", "what", "source"], out, right={1, 2, 3},
                 caption="by key: the textbook's bytes, the exact bytes at this moment, and the "
                         "corrections between them", indent=2)


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
    unified: int = 0  # bytes taken out of the timeline as CUDA unified memory (paged states)

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
                           self.final, self.trace, self.unified)

    def as_unified(self, category: Category = Category.OPT) -> "Measurement":
        """The same measurement with `category`'s bytes moved out of the device into CUDA unified
        memory (bitsandbytes' paged optimizer states, which max_memory_allocated does not count):
        every phase's peak taken again over the timeline without them, `unified` the most held."""
        cat = Category(category)
        held = self.timeline.bytes[cat]
        left = {c: (list(v) if c is not cat else [0] * len(v))
                for c, v in self.timeline.bytes.items()}
        timeline = Timeline(left, self.timeline.phase_starts)
        total, marks = timeline.total, timeline.phase_starts
        peaks: dict[str, tuple[int, int]] = {}  # phase -> (bytes, event index), over every step
        for i, (ev, phase, _) in enumerate(marks):
            end = marks[i + 1][0] if i + 1 < len(marks) else len(total)
            for j in ([ev - 1] if ev else []) + list(range(ev, end)):  # its first moment, the rest
                if phase not in peaks or total[j] > peaks[phase][0]:
                    peaks[phase] = (total[j], j)
        order = PHASES + tuple(sorted(set(peaks) - set(PHASES)))
        phases = {p: Breakdown({c: left[c][peaks[p][1]] for c in CATEGORIES})
                  for p in order if p in peaks}
        base = Breakdown({c: (self.baseline[c] if c is not cat else 0) for c in CATEGORIES})
        final = None if self.final is None else Breakdown({c: (self.final[c] if c is not cat else 0)
                                                           for c in CATEGORIES})
        return Measurement(self.label + " (paged states in unified memory)", phases, timeline, base,
                           self.allocator, final, self.trace, max(held, default=0) + self.unified)

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
