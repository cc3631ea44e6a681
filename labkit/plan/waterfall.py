"""What each knob of a recipe buys: from the naive step to the recipe, one knob at a time.

The naive step is the recipe's model, batch and sequence in fp32 with AdamW, no recompute, the whole
batch at once, on one device. The knobs are applied in ORDER (precision, optimizer, 8-bit states, PEFT
and quantized base, checkpointing, micro-batches, step-in-backward, offload, ZeRO/FSDP, tensor/pipeline
parallelism); after each, the estimator's peak, the bytes it saved and the term (TermKey) that fell most.

Savings depend on the order (checkpointing saves less once micro-batches are small, a ZeRO shard less
once the optimizer state is 8-bit), so `Waterfall.alone` also gives each knob's saving when it alone is
taken out of the final recipe.

    >>> w = waterfall(Recipe("llama2-7b", 8, 512, dtype="mixed-bf16", checkpoint="full"))   # doctest: +SKIP
    >>> print(w.table())                                                                    # doctest: +SKIP
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields

from labkit.estimate import estimate
from labkit.estimate.recipe import Recipe
from labkit.memory import Breakdown, TermKey
from labkit.memory.units import fmt_bytes


class Knob(enum.Enum):
    """The knobs, in the order the waterfall applies them; the value is the display name."""

    PRECISION = "precision"
    OPTIMIZER = "optimizer"
    EIGHT_BIT = "8-bit optimizer states"
    PEFT = "PEFT and quantized base"
    CHECKPOINT = "activation checkpointing"
    LOSS_CHUNKS = "chunked output loss"
    MICRO_BATCH = "micro-batches"
    STEP_IN_BACKWARD = "step in backward"
    OFFLOAD = "offload"
    ZERO = "data parallel + ZeRO/FSDP"
    PARALLEL = "tensor / pipeline parallel"


ORDER: tuple[Knob, ...] = tuple(Knob)

# The Recipe fields each knob owns (every memory-changing field belongs to exactly one knob).
FIELDS: dict[Knob, tuple[str, ...]] = {
    Knob.PRECISION: ("dtype", "base_dtype"),
    Knob.OPTIMIZER: ("optimizer", "rank", "foreach"),
    Knob.EIGHT_BIT: ("proj_dtype",),
    Knob.PEFT: ("lora_rank", "lora_targets", "quant", "quant_group", "quant_set", "lisa_layers"),
    Knob.CHECKPOINT: ("checkpoint", "segments", "selective_policy"),
    Knob.LOSS_CHUNKS: ("loss_chunks",),
    Knob.MICRO_BATCH: ("micro_batch",),
    Knob.STEP_IN_BACKWARD: ("step_in_backward",),
    Knob.OFFLOAD: ("optimizer_offload", "offload_activations", "paged_states"),
    Knob.ZERO: ("dp", "zero", "zero_offload", "zero_mixed"),
    Knob.PARALLEL: ("tp", "pp", "schedule", "sequence_parallel"),
}
# 8-bit optimizers and the 32-bit one the OPTIMIZER knob applies before EIGHT_BIT makes it 8-bit
EIGHT_BIT_OF = {"adamw8bit": "adamw", "adam8bit": "adam", "galore8bit": "galore"}


def naive(recipe: Recipe) -> Recipe:
    """The recipe's model, batch and sequence with every knob at its default: fp32, AdamW, no
    recompute, the whole batch at once, one device."""
    defaults = {f.name: f.default for f in fields(Recipe)}
    owned = {name for names in FIELDS.values() for name in names if name in defaults}
    return recipe.replace(**{name: defaults[name] for name in owned})  # its optimizer default: AdamW


def _with(recipe: Recipe, final: Recipe, knob: Knob) -> Recipe:
    """`recipe` with `knob`'s fields as in `final` (the OPTIMIZER knob takes 8-bit ones' 32-bit twin)."""
    changes = {n: getattr(final, n) for n in FIELDS[knob] if hasattr(final, n)}
    if knob is Knob.OPTIMIZER:
        changes["optimizer"] = EIGHT_BIT_OF.get(final.optimizer, final.optimizer)
    if knob is Knob.EIGHT_BIT:
        changes["optimizer"] = final.optimizer
    return recipe.replace(**changes)


def _without(recipe: Recipe, knob: Knob) -> Recipe:
    """`recipe` with `knob`'s fields back at the naive step's (the others kept): an 8-bit GaLore without
    the OPTIMIZER knob is 8-bit AdamW, without EIGHT_BIT it is GaLore."""
    start = naive(recipe)
    changes = {n: getattr(start, n) for n in FIELDS[knob] if hasattr(start, n)}
    if knob is Knob.OPTIMIZER:
        changes.update(optimizer="adamw8bit" if recipe.optimizer in EIGHT_BIT_OF else "adamw", proj_dtype=None)
    if knob is Knob.EIGHT_BIT:
        changes["optimizer"] = EIGHT_BIT_OF.get(recipe.optimizer, recipe.optimizer)
    return recipe.replace(**changes)


@dataclass(frozen=True)
class Step:
    """One bar: the recipe after a knob, its predicted peak, and what it saved against the bar before."""

    knob: Knob | None  # None for the naive start
    recipe: Recipe
    peak: int  # bytes, the estimator's peak (per device)
    phases: Breakdown  # the peak's bytes by category
    saved: int = 0  # bytes against the previous bar (negative: the knob costs memory)
    cut_key: TermKey | None = None  # the peak's term that fell most against the bar before
    measured: int | None = None  # the ledger's peak, with verify=True
    by_key: tuple = ()  # (TermKey, bytes) of the peak moment's terms, summed by key

    @property
    def cut(self) -> str:
        """The term that fell most, as people read it (e.g. "saved activations")."""
        return "" if self.cut_key is None else self.cut_key.value

    @property
    def saved_share(self) -> float:
        """The saving as a share of the previous bar's peak."""
        before = self.peak + self.saved
        return self.saved / before if before else 0.0

    @property
    def name(self) -> str:
        return "naive (fp32, AdamW, whole batch, 1 device)" if self.knob is None else self.knob.value


@dataclass(frozen=True)
class Waterfall:
    """The bars from the naive step to the recipe, and each knob's saving when it alone is taken out."""

    recipe: Recipe
    steps: tuple[Step, ...]
    alone: tuple[tuple[Knob, int | None], ...]  # (knob, final peak without it - final peak); None: refused
    refused: tuple[tuple[Knob, str], ...] = ()  # knobs the estimator could not apply, with its words

    def table(self) -> str:
        """The waterfall as text lines within 100 columns."""
        rows = [f"{'step':<44} {'peak':>11} {'saved':>11} {'saved %':>8}  the term it cut most"]
        for s in self.steps:
            saved = "" if s.knob is None else ("-" if s.saved < 0 else "") + fmt_bytes(abs(s.saved))
            share = "" if s.knob is None else f"{100 * s.saved_share:.1f} %"
            meas = "" if s.measured is None else f"  (measured {fmt_bytes(s.measured)})"
            rows.append(f"{s.name:<44} {fmt_bytes(s.peak):>11} {saved:>11} {share:>8}  {s.cut}{meas}")
        rows.append("savings depend on the order above"
                    + ("; each knob taken out of the final recipe alone:" if self.alone else "."))
        for knob, extra in self.alone:
            if extra is None:
                text = "not valid or not modelled without it"
            else:
                text = f"{'+' if extra >= 0 else '-'}{fmt_bytes(abs(extra))} without it"
            rows.append(f"  {knob.value:<42} {text}")
        rows += [f"  {knob.value}: refused by the estimator: {why}" for knob, why in self.refused]
        return "\n".join(rows)


def _cut(before: tuple, after: tuple) -> TermKey | None:
    """The key whose bytes at the peak fell most from one bar to the next (None if none fell)."""
    b, a = dict(before), dict(after)
    drops = {k: b.get(k, 0) - a.get(k, 0) for k in set(b) | set(a)}
    if not drops:
        return None
    k = max(drops, key=lambda key: (drops[key], key.value))
    return k if drops[k] > 0 else None


def _peak(recipe: Recipe) -> tuple[int, Breakdown, tuple]:
    """The estimate's peak, its categories, and its peak moment's bytes by TermKey."""
    e = estimate(recipe)
    keys: dict = {}
    for t in e.peak_moment.terms if e.moments else ():
        keys[t.key] = keys.get(t.key, 0) + t.bytes
    return e.peak.total, e.peak, tuple(keys.items())


def knobs_used(recipe: Recipe) -> list[Knob]:
    """The knobs whose fields `recipe` sets away from the naive step, in ORDER."""
    return [k for k in ORDER if _with(naive(recipe), recipe, k) != naive(recipe)]


def without(recipe: Recipe, knobs) -> Recipe:
    """`recipe` with each of `knobs` taken out (its fields back at the naive step's)."""
    for knob in knobs:
        recipe = _without(recipe, knob)
    return recipe


def waterfall(recipe: Recipe, verify: bool = False, alone: bool = True) -> Waterfall:
    """Apply `recipe`'s knobs to the naive step one at a time in ORDER; see the module docstring.

    verify: also run each bar's recipe under the ledger (labkit.run.measure_step) and record its peak:
    only for a model small enough for this device and recipes on one device.
    alone: also estimate the recipe without each knob in turn (one more estimate per knob).
    """
    current = naive(recipe)
    peak, phases, keys = _peak(current)
    steps = [Step(None, current, peak, phases, by_key=keys)]
    refused: list[tuple[Knob, str]] = []
    for knob in ORDER:
        nxt = _with(current, recipe, knob)
        if nxt == current:
            continue
        try:
            p, ph, keys = _peak(nxt)
        except ValueError as e:  # the estimator refuses a combination: named, the next knob goes on
            refused.append((knob, str(e)))
            continue
        steps.append(Step(knob, nxt, p, ph, steps[-1].peak - p, _cut(steps[-1].by_key, keys), by_key=keys))
        current = nxt
    final_peak = steps[-1].peak
    left_out = []
    for s in steps[1:] if alone else ():
        try:
            left_out.append((s.knob, _peak(_without(recipe, s.knob))[0] - final_peak))
        except ValueError:  # the recipe is not valid, or not modelled, without this knob
            left_out.append((s.knob, None))
    if verify:
        steps = [_measured(s) for s in steps]
    return Waterfall(recipe, tuple(steps), tuple(left_out), tuple(refused))


def _measured(step: Step) -> Step:
    from dataclasses import replace

    from labkit.run import measure_step

    if step.recipe.distributed:
        raise ValueError("verify measures one device: this waterfall has a multi-device bar")
    return replace(step, measured=measure_step(step.recipe).peak.total)
