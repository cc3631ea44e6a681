"""explain()'s middle table: the textbook and the exact layer key by key, and the corrections.

For each TermKey a moment holds or the textbook counts, a row gives the textbook's bytes, the exact
bytes at that moment, and the corrections: each a Term made by its own small function below from
the model's spec, the recipe and the walk's records (labkit.estimate.walk, .tape, .walk_groups),
with the op that allocates or frees the bytes as its source; none reads the moment's bytes. A
textbook key the moment does not hold says when it lives. A key only the exact layer has is shown
as its own terms (the textbook has no formula for it). What the corrections leave of a key is
printed as "not yet explained" (tests/unit/test_keyed_corrections.py bounds it on the fixed
bench configurations).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from types import SimpleNamespace

from labkit.memory.report import (Category, Estimate, KeyRow, Moment, MomentKind as MK, Term,
                                  TermKey as K, Variant)
from labkit.optim import adafactor, adam8bit, galore, galore8bit, lion

from . import peft_terms, textbook
from .held import segments_of
from .optim_terms import state_bytes
from .predict import _frozen_bytes, step_bytes
from .spec import spec_from
from .walk_groups import OpGroup, block_groups


# ---- the textbook layer of a recipe -----------------------------------------------------------
def textbook_figure(r, stage: int = 0) -> list[Term]:
    """The textbook layer's terms for a recipe (labkit.estimate.textbook.figure), with the counts it
    needs; `stage`: the pipeline stage whose micro-batches in flight it counts."""
    spec = spec_from(r.model, **r.config)
    peft = peft_terms.of_recipe(spec, r)
    if peft is None:
        return textbook.figure(spec, r, spec.n_params, stage=stage)
    n_train = peft_terms.trainable_spec(spec, peft).n_params
    return textbook.figure(spec, r, n_train, peft_terms.quantized_weights(spec, peft), stage=stage,
                           adapters=not peft.lisa_layers)


# what a data-parallel rank's corrections cover: its activations are one device's of its rows; its
# model states (ZeRO's shards, gathers and buckets) are not computed yet
_ACTIVATION_KEYS = frozenset({K.SAVED_ACTIVATIONS, K.CHECKPOINT_INPUTS, K.LOG_SOFTMAX})


def attach(est: Estimate, r, stage: int = 0) -> Estimate:
    """Give an estimate of recipe `r` its textbook layer and its corrector: one device, every
    correction below; a data-parallel rank, those of its activations (one device's of its rows);
    a tensor or pipeline rank, when each key lives (the rest: not yet explained)."""
    est.textbook = textbook_figure(r, stage)
    est.keyed = Corrector(r, est.textbook)
    return est


class Corrector:
    """moment -> its KeyRows. The walk and its records are made once, at the first explain()."""

    def __init__(self, recipe, book: list[Term]):
        self.r, self.book = recipe, book
        r = recipe
        self.single = r.tp == 1 and r.pp == 1 and r.dp == 1 and not r.zero
        self.data = r.tp == 1 and r.pp == 1 and not self.single

    @cached_property
    def ctx(self) -> "Ctx | None":
        if self.single:
            return Ctx(self.r, self.book)
        if self.data:  # a rank's rows on one device (zero_terms.data_parallel_estimate's step)
            one = self.r.replace(dp=1, batch=self.r.rank_batch, zero=0, zero_offload=False)
            return Ctx(one, self.book)
        return None

    def __call__(self, m: Moment) -> list[KeyRow]:
        return rows(self.ctx, self.r, self.book, m, None if self.single else _ACTIVATION_KEYS)


# ---- what the corrections read ----------------------------------------------------------------
@dataclass
class Ctx:
    """The model's spec, the recipe, the textbook and the walk of one device: what the corrections
    read."""

    r: object
    book: list[Term] = field(default_factory=list)

    def __post_init__(self) -> None:
        r = self.r
        self.spec = spec_from(r.model, **r.config)
        self.peft = peft_terms.of_recipe(self.spec, r)
        self.ts = (self.spec if self.peft is None
                   else peft_terms.trainable_spec(self.spec, self.peft))
        self.prec = textbook.Precision.of(r.dtype)
        self.b, self.w = step_bytes(self.spec, r, self.peft)
        self.groups = block_groups(self.spec, r, self.peft, _frozen_bytes(r))
        self.L = self.spec.n_layer
        self.e = 2 if r.dtype != "fp32" else 4  # the textbook's bytes per activation value
        replays = len(self.b.replays) == self.L
        # nothing checkpointed or offloaded: the exact layer replays each block (stepping in
        # backward too: each gradient stepped and freed as it is made)
        self.plain = r.checkpoint == "none" and not r.offload_activations and replays
        # checkpointed or offloaded: the blocks' moments from their replays (moments_backward._replayed_backward, moments_forward._replayed_forward)
        self.replayed = (r.checkpoint != "none" or r.offload_activations) and replays
        self.sizes = segments_of(self.L, r.checkpoint, r.segments)
        ends = [sum(self.sizes[:i + 1]) for i in range(len(self.sizes))]
        self.spans = list(zip([0, *ends[:-1]], ends))

    def unit(self, block: int) -> int:
        """The checkpointed unit a block belongs to."""
        return next(j for j, (s, e) in enumerate(self.spans) if s <= block < e)

    def book_of(self, key: K) -> int:
        return sum(t.bytes for t in self.book if t.key is key)

    @property
    def sbh(self) -> int:
        return self.r.micro * self.r.seq * self.spec.hidden


def _t(key: K, cat: Category, name: str, nbytes: int, formula: str, source: str) -> Term:
    return Term(name, cat, int(nbytes), formula, source, key=key)


_A, _P, _O, _G, _B = Category.ACT, Category.PARAM, Category.OPT, Category.GRAD, Category.BUFFER
_BACKWARD_BLOCK = (MK.BLOCK_BACKWARD, MK.PARAMETER_STEP)
_AFTER_BLOCKS = (MK.EMBEDDING_BACKWARD, MK.EMBEDDING_SUM, MK.OPTIMIZER_STEP)
_BEFORE_LOSS = (MK.BLOCK_FORWARD, MK.DEQUANT)
_FREES = "autograd frees a node's saved tensors once it has run"


def _later(m: Moment) -> bool:
    """A later micro-batch's moment (every .grad exists, GRADIENTS among its keys)."""
    return any(t.key is K.GRADIENTS for t in m.terms)


_NO_OP = SimpleNamespace(op="", saved=0, copies=0, grads=0)  # a block with no parameter's step recorded


def _plain_worst(c: "Ctx", m: Moment):
    """The replay's worst op of a plain block's moment (moments_backward._replayed_backward): its backward's, or
    under step in backward the one where a parameter steps (`Worst.step`). Stepping in backward, the
    replay is the one with no .grad to add into (`plain_later`), as the estimate's."""
    rep = c.b.replays[m.block]
    w = rep.plain_later if _later(m) or c.r.step_in_backward else rep.plain
    if m.kind is MK.PARAMETER_STEP:
        return w.step if w.step is not None else _NO_OP
    return w


# ---- saved activations: what each kind of op saves against Korthikanti's share ----------------
def op_groups(c: Ctx, m: Moment) -> list[Term]:
    """Per kind of op, what the walk records the model's blocks save, minus that op's share of
    Korthikanti's layer formula (walk_groups.OpGroup), over the blocks."""
    s, b, h, a = c.r.seq, c.r.micro, c.spec.hidden, c.spec.n_head
    out = []
    for g in OpGroup:
        walk, book = c.groups.group(g), c.L * g.korthikanti(s, b, h, a, c.e)
        if walk != book:
            formula = f"walk {walk:,} B over {c.L} blocks - {c.L} x ({g.formula()}), e = {c.e}"
            out.append(_t(K.SAVED_ACTIVATIONS, _A, g.what, walk - book, formula, g.source))
    return out


def blocks_freed(c: Ctx, m: Moment) -> list[Term]:
    """Inside block k's backward the blocks after it have run theirs: their saved tensors are
    freed."""
    if m.kind not in _BACKWARD_BLOCK or m.block is None or m.block + 1 >= c.L:
        return []
    k = m.block
    freed = sum(c.groups.total(j) for j in range(k + 1, c.L))
    return [_t(K.SAVED_ACTIVATIONS, _A, f"blocks {k + 1}-{c.L - 1}: freed by their backward",
               -freed, "walk: what those blocks save", _FREES)]


def block_in_progress(c: Ctx, m: Moment) -> list[Term]:
    """The block whose backward (or forward) runs holds part of its saved tensors: the replay's
    record of its worst op (labkit.estimate.tape), its input apart (the "block input" key)."""
    if m.block is None or not c.plain:
        return []
    k, rep = m.block, c.b.replays[m.block]
    total = c.groups.total(k)
    if m.kind is MK.BLOCK_FORWARD:
        w = rep.full
        return [_t(K.SAVED_ACTIVATIONS, _A, f"block {k}'s forward at {w.op}: what it saves after, "
                   "not made yet", (w.saved - w.copies) - total,
                   "replay: the block's ops, every saved tensor kept",
                   "labkit.estimate.tape.forward")]
    if m.kind not in _BACKWARD_BLOCK:
        return []
    w = _plain_worst(c, m)
    return [_t(K.SAVED_ACTIVATIONS, _A, f"block {k}'s backward at {w.op}: saved tensors released "
               "so far (its input: 'block input')", (w.saved - w.copies) - total,
               "replay: each saved tensor until its last reader", "labkit.estimate.tape.backward")]


# ---- checkpointed activations -----------------------------------------------------------------
def checkpoint_inputs(c: Ctx, m: Moment) -> list[Term]:
    """Full/sqrt: one input per checkpointed segment, in the residual stream's dtype; selective:
    each block's input and the outputs its policy caches, against Korthikanti's sbh(16e + 2); and
    the blocks' other arguments (position ids, rotary tables, a mask), which each region keeps."""
    full = len(c.b.replays) == c.L
    inputs = sum(c.b.replays[s].input_bytes for s, _ in c.spans) if full else 0
    k, esbh = len(c.sizes), c.e * c.sbh
    keeps = "labkit.recompute.checkpoint keeps a region's inputs"
    out = []
    if c.r.checkpoint == "selective":
        kept, book = sum(r.kept_bytes for r in c.b.replays), c.L * c.sbh * (16 * c.e + 2)
        out += [_t(K.CHECKPOINT_INPUTS, _A, "each checkpointed block keeps its input", inputs,
                   "L x r h x d", keeps),
                _t(K.CHECKPOINT_INPUTS, _A, f"the outputs the {c.r.selective_policy!r} policy "
                   "caches, not Korthikanti's sbh(16e + 2)", kept - book,
                   "replay: the policy's op outputs - L sbh(16e + 2)",
                   "labkit.recompute.selective (torch SAC policy MUST_SAVE)")]
    else:
        if k < c.L:
            out.append(_t(K.CHECKPOINT_INPUTS, _A, f"one input per checkpointed segment: {k} of "
                          f"{c.L} blocks", -(c.L - k) * esbh, f"-({c.L} - {k}) x e sbh",
                          "labkit.recompute.segment_bounds"))
        if inputs != k * esbh:
            out.append(_t(K.CHECKPOINT_INPUTS, _A, "the inputs: the residual stream, in its dtype",
                          inputs - k * esbh, f"{k} x r h x ({c.w.x_bytes} - e)",
                          "the model's hidden states"))
    kw = c.b.block_kwargs[0] - c.b.block_kwargs[1]
    if kw:
        out.append(_t(K.CHECKPOINT_INPUTS, _A, "the blocks' other arguments, kept by each region",
                      kw,
                      "S x 8 position ids (+ rotary cos, sin) (+ B x S x S mask)",
                      "labkit.recompute.checkpoint keeps a region's arguments until its recompute"))
    return out


def units_freed(c: Ctx, m: Moment) -> list[Term]:
    """Inside a checkpointed unit's recompute or backward: the later units' inputs (and cached
    outputs) are freed; the unit's own input goes after its recompute unless its first block saves
    it; selective's cached outputs are handed to the recompute, those autograd saves wait for their
    reader; the regions' arguments go after the first unit's recompute."""
    if c.replayed and m.kind is MK.BLOCK_FORWARD and m.block is not None:
        return _last_forward(c, m)
    if not c.replayed or m.block is None or m.kind not in (*_BACKWARD_BLOCK, MK.RECOMPUTE):
        return []
    b, j = c.b, c.unit(m.block)
    s, e = c.spans[j]
    sel = c.r.checkpoint == "selective"

    def held(span) -> int:
        kept = sum(b.replays[i].kept_bytes for i in range(*span)) if sel else 0
        return b.replays[span[0]].input_bytes + kept

    out = [_t(K.CHECKPOINT_INPUTS, _A, "the later units' inputs (and cached outputs): freed by "
              "their backward", -sum(held(sp) for sp in c.spans[j + 1:]),
              "replay: r h x d (+ kept outputs) each",
              "labkit.recompute.checkpoint releases a region's inputs after its backward")]
    kept_unit = sum(b.replays[i].kept_bytes for i in range(s, e)) if sel else 0
    if m.kind is MK.RECOMPUTE:
        last = b.replays[e - 1]
        rec = last.recompute_sel if sel else last.recompute
        now = (sum(b.replays[i].kept_bytes + b.replays[i].kept_saved for i in range(s, e - 1))
               + rec.kept if sel else 0)
        out.append(_t(K.CHECKPOINT_INPUTS, _A, "the unit's cached outputs during its recompute",
                      now - kept_unit, "replay: handed back to the recompute",
                      "labkit.recompute.selective"))
        return [t for t in out if t.bytes]
    r = b.replays[m.block]
    w = r.recomputed_later if _later(m) or c.r.step_in_backward else r.recomputed
    first = b.replays[s]
    out.append(_t(K.CHECKPOINT_INPUTS, _A, "the unit's input: released after its recompute (kept "
                  "where its first block saves it)", first.input_saved - first.input_bytes,
                  "input saved - r h x d", "labkit.recompute.checkpoint"))
    if sel:
        at = w if m.kind is not MK.PARAMETER_STEP else w.step  # a step moment: when the parameter steps
        now = sum(b.replays[i].kept_saved for i in range(s, m.block)) + (at.kept if at is not None else 0)
        out.append(_t(K.CHECKPOINT_INPUTS, _A, "the unit's cached outputs: those autograd saves "
                      "wait for their reader", now - kept_unit, "replay",
                      "labkit.recompute.selective"))
    kw = c.b.block_kwargs[0] - c.b.block_kwargs[1]
    if j == 0 and kw:
        out.append(_t(K.CHECKPOINT_INPUTS, _A, "the regions' arguments: freed after the first "
                      "unit's recompute", -kw, "S x 8 (+ rotary, mask)",
                      "labkit.recompute.checkpoint"))
    return [t for t in out if t.bytes]


def _last_forward(c: Ctx, m: Moment) -> list[Term]:
    """Inside the last block's forward: the blocks' other arguments are still the forward's locals
    (not yet a region's), and selective checkpointing has cached only the outputs made so far."""
    out = []
    kw = c.b.block_kwargs[0] - c.b.block_kwargs[1]
    if kw and c.r.checkpoint != "none":
        out.append(_t(K.CHECKPOINT_INPUTS, _A, "the blocks' other arguments: still the forward's "
                      "locals (forward locals)", -kw, "S x 8 (+ rotary, mask)",
                      "the model's forward holds them until it returns"))
    if c.r.checkpoint == "selective":
        last = c.b.replays[m.block]
        out.append(_t(K.CHECKPOINT_INPUTS, _A, f"block {m.block}'s outputs cached so far, at "
                      f"{last.kept.op}", last.kept.saved - last.kept_bytes,
                      "replay: the policy's outputs made by then - all of them",
                      "labkit.recompute.selective"))
    return [t for t in out if t.bytes]


# ---- weight copies ----------------------------------------------------------------------------
def not_cast(c: Ctx, m: Moment) -> list[Term]:
    """Autocast casts only what a matmul reads: the norms' weights and the embedding tables (but a
    tied head's) are not copied; the chunked loss casts the head chunk by chunk, not once."""
    if not c.prec.autocast or c.peft is not None:
        return []
    out = [_t(K.COPIES_16BIT, _P, "parameters no matmul reads (norms, position and untied "
              "embedding tables): not cast", -2 * (c.spec.n_params - c.spec.matmul_params),
              "-2 x (N - matmul parameters)",
              "torch.autocast: embedding and layer_norm run in fp32 (its op lists)")]
    if c.w.loss_scratch is not None:
        out.append(_t(K.COPIES_16BIT, _P, "the chunked loss casts the head per chunk (a loss "
                      "temporary)", -2 * c.spec.vocab * c.spec.hidden, "-2 x V x h",
                      "labkit.recompute.chunked_ce"))
    return out


def peft_copies(c: Ctx, m: Moment) -> list[Term]:
    """Under LoRA/QLoRA/LISA the walk counts the copies: trained matmul weights cached, a frozen
    weight's copy only where autograd saves it for dx; a 16-bit or quantized base is not cast."""
    if not c.prec.autocast or c.peft is None:
        return []
    frozen = sum(c.w.copy_frozen.values())
    return [_t(K.COPIES_16BIT, _P, "frozen weights' copies autograd saves for dx", frozen,
               "walk: 2 x their elements",
               "autograd saves a frozen matmul weight's 16-bit copy for the input's gradient"),
            _t(K.COPIES_16BIT, _P, "trained matmul weights' copies (the cache), not 2 x every "
               "weight",
               c.b.C - frozen - c.book_of(K.COPIES_16BIT),
               "walk: 2 x trained matmul weights - the textbook's 2 x N",
               "torch.autocast caches a leaf's cast until the forward ends")]


def copies_freed(c: Ctx, m: Moment) -> list[Term]:
    """In backward the copies go: the head's with its matmul's backward, each block's with its
    nodes' backward (a checkpointed or offloaded step: copies_replayed)."""
    b, out = c.b, []
    if c.replayed and m.phase != "optimizer" and b.C:
        return copies_replayed(c, m)
    if m.kind not in _BACKWARD_BLOCK or m.block is None or not b.C:
        return out
    k = m.block
    out.append(_t(K.COPIES_16BIT, _P, "the head's copy: freed with the head's backward",
                  -b.head_copy, "2 x V x h", _FREES))
    if c.plain:
        saved = [r.copies_saved for r in b.replays]
        w = _plain_worst(c, m)
        out += [_t(K.COPIES_16BIT, _P, f"blocks {k}-{c.L - 1}'s copies: freed by their backward "
                   f"(block {k}'s still needed: below)", -sum(saved[k:]),
                   "replay: 2 x the weights their matmuls save", _FREES),
                _t(K.COPIES_16BIT, _P, f"block {k}'s copies still needed at {w.op}", w.copies,
                   "replay: until their node's backward", "labkit.estimate.tape.backward"),
                _t(K.COPIES_16BIT, _P, "cached copies no node saves: freed as the forward's "
                   "autocast exits", -(b.C - b.head_copy - sum(saved)),
                   "C - the head's - the saved ones",
                   "torch.autocast")]
    else:
        done = c.L - 1 - k
        out.append(_t(K.COPIES_16BIT, _P, f"the {done} finished blocks' copies",
                      -done * b.layer_copy,
                      "blocks x 2 x their matmul weights", _FREES))
    return [t for t in out if t.bytes]


def copies_after_forward(c: Ctx, m: Moment) -> list[Term]:
    """Nothing checkpointed or offloaded: as the forward's autocast exits its cache is cleared, so the
    trained copies no op saves go (the loss's and the head's backward); from the final norm's backward on
    only what the blocks' matmuls save is left (the head's copy went with its backward)."""
    if c.r.checkpoint != "none" or c.r.offload_activations or not c.b.C:
        return []
    if m.kind in (MK.LOSS_BACKWARD, MK.HEAD_BACKWARD, MK.HEAD_AFTER) and c.b.C_unsaved:
        return [_t(K.COPIES_16BIT, _P, "trained copies no op saves: freed as the forward's autocast exits",
                   -c.b.C_unsaved, "walk: 2 x (biases + weights whose input needs no gradient)",
                   "torch.autocast clears its cache on exit")]
    if m.kind is MK.FINAL_NORM_BACKWARD and c.plain:
        saved = sum(r.copies_saved for r in c.b.replays)
        return [_t(K.COPIES_16BIT, _P, "the blocks' copies their matmuls save are left (the head's and the "
                   "unsaved ones freed)", saved - c.b.C, "replay: 2 x the weights the blocks' matmuls save - C",
                   _FREES)]
    return []


def copies_replayed(c: Ctx, m: Moment) -> list[Term]:
    """A checkpointed or offloaded step: a frozen weight's copy is saved by no block on the device
    (the checkpoint drops it, or it is offloaded); a checkpointed block's cached copies go when the
    forward ends (its recompute casts again); the head's copy goes with the head's backward."""
    b, out = c.b, []
    off = c.r.offload_activations
    if m.phase == "forward":
        frozen = b.c_frozen_blocks + (b.c_frozen_head if off else 0)
        out.append(_t(K.COPIES_16BIT, _P, "frozen weights' copies: saved by no block on the device",
                      -frozen, "walk: 2 x the frozen weights their matmuls read",
                      "labkit.recompute (checkpoint, offload)"))
        if m.kind is MK.BLOCK_FORWARD and m.block is not None:
            last = b.replays[m.block]
            w = last.kept if c.r.checkpoint == "selective" else last.free
            head = 0 if off and b.c_frozen_head else b.head_copy
            out += [_t(K.COPIES_16BIT, _P, "the head's copy: made after the blocks", -head,
                       "2 x V x h", "torch.autocast casts a weight when its matmul runs"),
                    _t(K.COPIES_16BIT, _P, f"block {m.block}'s copies after {w.op}: not cast yet",
                       w.cached - last.cached_bytes, "replay: the block's cache so far - all of it",
                       "labkit.estimate.tape.forward")]
        return [t for t in out if t.bytes]
    if off and c.r.checkpoint == "none":
        return []  # offloaded: the key is not held in backward (lives says so)
    out.append(_t(K.COPIES_16BIT, _P, "checkpointed blocks keep no weight copies after the "
                  "forward: their recompute casts again", -(b.C - b.head_copy),
                  "-(C - the head's copy)",
                  "torch.autocast's cache ends with the forward; labkit.recompute.checkpoint"))
    if m.kind in (MK.BLOCK_BACKWARD, MK.RECOMPUTE, MK.PARAMETER_STEP):
        out.append(_t(K.COPIES_16BIT, _P, "the head's copy: freed with the head's backward",
                      -b.head_copy, "2 x V x h", _FREES))
    return [t for t in out if t.bytes]


def copies_recomputed(c: Ctx, m: Moment) -> list[Term]:
    """Inside a checkpointed unit's backward: the copies its recompute made again, the earlier
    blocks' waiting for their backward and the running block's still needed (tape records)."""
    if not c.replayed or c.r.checkpoint == "none" or m.block is None or not c.b.C:
        return []
    b, k = c.b, m.block
    s, e = c.spans[c.unit(k)]
    if m.kind is MK.RECOMPUTE:
        last = b.replays[e - 1]
        rec = last.recompute_sel if c.r.checkpoint == "selective" else last.recompute
        # the recompute still running: its autocast cache holds the earlier blocks' trained copies too
        made = sum(b.replays[i].cached_bytes + b.replays[i].copies_frozen for i in range(s, e - 1))
        made, op = made + rec.params, rec.op
    elif m.kind in _BACKWARD_BLOCK:
        r = b.replays[k]
        w = r.recomputed_later if _later(m) or c.r.step_in_backward else r.recomputed
        if m.kind is MK.PARAMETER_STEP:
            w = w.step
        made = (sum(b.replays[i].copies_saved for i in range(s, k))
                + (w.copies if w is not None else 0))
        op = w.op if w is not None else ""
    else:
        return []
    return [_t(K.COPIES_16BIT, _P, f"made again by the unit's recompute: its earlier blocks' and "
               f"block {k}'s still needed at {op}", made,
               "replay: 2 x the weights their matmuls save",
               "torch.autocast casts again in the recompute")] if made else []


# ---- stepping in backward ---------------------------------------------------------------------
def _stepping(c: Ctx, m: Moment) -> tuple[tuple, tuple]:
    """At a moment a parameter outside the blocks steps in backward (moments_step._steps_in_backward): (its
    step's (gradient, temporaries, cast[, change of the state]), what was freed before it (copy, saved
    input, transient gradients)). Which parameter: the head (the head's backward keys), the position
    table (the tied head's held gradient), else the tied embedding."""
    b, keys = c.b, {t.key for t in m.terms}
    refresh = m.variant is Variant.REFRESH
    rest = b.rest_refresh if refresh else b.rest_step
    if K.TIED_HEAD_GRADIENT in keys:
        return rest, (0, 0, 0)
    if K.HEAD_BACKWARD in keys:  # chunked: every chunk's matmul has returned (on the device)
        if b.loss_grad:
            return rest, (0, 0, 0) if c.r.offload_activations else (b.head_copy, b.chunk_inputs, 0)
        return rest, b.head_freed
    return (b.tied_refresh if refresh else b.tied_step), (0, 0, b.emb_temp)


def grads_stepped(c: Ctx, m: Moment) -> list[Term]:
    """Stepping in backward, each gradient is freed as soon as its parameter steps: one at a
    time."""
    if not c.r.step_in_backward or m.phase == "forward":
        return []
    how = "labkit.optim.StepInBackward"
    if m.kind in (MK.EMBEDDING_BACKWARD, MK.EMBEDDING_SUM):
        left = max(c.b.rest_step[0], c.b.tied_step[0])
        return [_t(K.GRADIENTS, _G, "stepped and freed as made: the largest outside the blocks is "
                   "left", left - c.b.G, "largest gradient - N x d", how)]
    if m.kind is not MK.PARAMETER_STEP:
        return []
    if c.replayed and m.block is not None:  # a checkpointed block's parameter: its recompute's replay
        w = c.b.replays[m.block].recomputed_later.step
        grad = w.grads if w is not None else 0
    elif m.block is not None:  # a plain block's parameter: its replay
        grad = _plain_worst(c, m).grads
    else:  # one outside the blocks (the embeddings, the head)
        grad = _stepping(c, m)[0][0]
    return [_t(K.GRADIENTS, _G, "stepped and freed as made: only the stepping parameter's gradient "
               "exists", grad - c.b.G, "its gradient - N x d", how)]


def freed_for_step(c: Ctx, m: Moment) -> list[Term]:
    """Before a matrix steps in backward its matmul's node has run: its 16-bit copy and saved input
    are gone (in the block's moment after the MLP's output projection stepped, that input too)."""
    if not c.r.step_in_backward or m.kind not in _BACKWARD_BLOCK:
        return []
    if m.block is not None or m.kind is not MK.PARAMETER_STEP:  # a block's: its replay's worst op holds
        return []  # what is left
    freed = _stepping(c, m)[1]
    out = [_t(K.COPIES_16BIT, _P, "the stepped matrix's 16-bit copy: freed by its node before the "
              "step", -freed[0], "its 2 x elements", _FREES),
           _t(K.SAVED_ACTIVATIONS, _A, "the stepped matmul's saved input: freed by its node before "
              "the step", -freed[1], "its r x d_in x m", _FREES)]
    return [t for t in out if t.bytes]


# ---- the head's backward ----------------------------------------------------------------------
def head_freed(c: Ctx, m: Moment) -> list[Term]:
    """Inside the head's backward (chunked: its worst chunk) the chunks whose matmul has run freed
    their saved inputs; after it (its weight gradient's cast, the chunks' input gradients
    concatenated) every chunk's, and the head's 16-bit weight copy. Offloaded, both were on the
    host."""
    if m.kind not in (MK.HEAD_BACKWARD, MK.HEAD_AFTER) or c.r.offload_activations:
        return []
    after = m.kind is MK.HEAD_AFTER
    out = [_t(K.SAVED_ACTIVATIONS, _A, "the chunks' saved inputs: freed as their matmuls' nodes "
              "return", -c.b.chunk_inputs if after else c.b.head_inputs_freed,
              "rows done x h x m (views of one tensor: all, after the last chunk)", _FREES)]
    if after or c.b.head_copy_freed:  # (inside: at the last chunk's sum, after its matmul)
        out.append(_t(K.COPIES_16BIT, _P, "the head's copy: freed with its matmul's backward",
                      -c.b.head_copy if after else c.b.head_copy_freed, "2 x V x h", _FREES))
    return [t for t in out if t.bytes]


# ---- optimizer state, quantized base, log-softmax ---------------------------------------------
_STATE_RULES = {"adamw8bit": adam8bit, "adam8bit": adam8bit, "lion": lion, "adafactor": adafactor}


def state_layout(c: Ctx, m: Moment) -> list[Term]:
    """The state as the optimizer stores it, against the textbook's states per parameter: Adam's
    step counters; 8-bit blocks' scales; Lion, Adafactor and GaLore by their modules' rules."""
    opt, d, shapes = c.r.optimizer, c.prec.weight, c.ts.param_shapes
    book = c.book_of(K.OPTIMIZER_STATE)
    if opt in ("adam", "adamw"):
        return [_t(K.OPTIMIZER_STATE, _O, "Adam's step counters", 4 * len(shapes),
                   "4 B x trained tensors", "torch.optim.Adam keeps a float32 step per tensor")]
    if opt in _STATE_RULES:
        mod = _STATE_RULES[opt]
        stored = sum(mod.state_bytes_for(s, d) if mod is lion else mod.state_bytes_for(s)
                     for s in shapes)
        return [_t(K.OPTIMIZER_STATE, _O, f"{opt} as its module stores each tensor's state",
                   stored - book, "sum of state_bytes_for(shape) - the textbook's",
                   mod.__name__ + ".state_bytes_for")]
    if opt.startswith("galore"):
        mod = galore8bit if opt.endswith("8bit") else galore
        stored = state_bytes(c.ts, d, opt, c.r.rank, c.r.proj_dtype)
        return [_t(K.OPTIMIZER_STATE, _O, "GaLore projects the blocks' matrices only (the rest: "
                   "Adam states), projector dtype and step counters", stored - book,
                   "per matrix state_bytes_for(shape, r) - the textbook's mr + 2nr",
                   mod.__name__ + ".state_bytes_for")]
    return []


def refresh_pops(c: Ctx, m: Moment) -> list[Term]:
    """GaLore's projector refresh pops a matrix's old projector before its SVD."""
    src = "labkit.optim.galore: the refresh"
    if m.kind is MK.OPTIMIZER_STEP and m.variant is Variant.REFRESH and c.b.refresh_freed:
        return [_t(K.OPTIMIZER_STATE, _O, "GaLore's refresh: the old projector popped before the "
                   "SVD",
                   -c.b.refresh_freed, "r k x its bytes", src)]
    if m.kind is MK.PARAMETER_STEP and c.r.step_in_backward:
        step = _stepping(c, m)[0]
        if len(step) > 3 and step[3]:  # (gradient, temporaries, cast, change of the state)
            return [_t(K.OPTIMIZER_STATE, _O, "GaLore's refresh in backward: the old projector "
                       "popped before the SVD", step[3], "r k x its bytes", src)]
    return []


def quant_layout(c: Ctx, m: Moment) -> list[Term]:
    """The quantizer's stored layout (codes, per-block or per-row scales) against the paper's bits
    per weight."""
    if c.peft is None or c.peft.quant == "none":
        return []
    stored = peft_terms.base_buffer_bytes(c.spec, c.peft)
    return [_t(K.QUANTIZED_BASE, _B, f"labkit.quant's {c.peft.quant} layout, not the paper's bits "
               "per weight", stored - c.book_of(K.QUANTIZED_BASE),
               "codes + scales per block, row or group",
               "labkit.quant (nf4_bytes_for, int8_bytes_for, int4_bytes_for)")]


def loss_dtype(c: Ctx, m: Moment) -> list[Term]:
    """log_softmax saves its output in the loss's dtype: fp32 when the logits are upcast
    (transformers, autocast), the logits' own 16-bit dtype otherwise (labkit's GPT in bf16/fp16)."""
    lsm = c.w.log_softmax
    if lsm is None or c.w.loss_scratch is not None or lsm.itemsize == 4:
        return []
    return [_t(K.LOG_SOFTMAX, _A, "the loss runs in the logits' 16-bit dtype",
               lsm.numel * (lsm.itemsize - 4), f"r x V x ({lsm.itemsize} - 4)",
               "walk: cross_entropy without an fp32 upcast")]


def chunks_not_run(c: Ctx, m: Moment) -> list[Term]:
    """The chunked loss's forward peaks at its worst chunk: the chunks after it have no log-softmax yet."""
    if m.kind is not MK.LOSS or not c.b.lsm_not_yet or c.r.offload_activations:
        return []
    return [_t(K.LOG_SOFTMAX, _A, "the log-softmax of the chunks after the worst one: not made yet",
               c.b.lsm_not_yet, "- rows of those chunks x V x 4", "each chunk's cross-entropy in turn")]


CORRECTIONS = {  # key -> the functions that compute its corrections, in the order they are shown
    K.SAVED_ACTIVATIONS: (op_groups, blocks_freed, block_in_progress, freed_for_step, head_freed),
    K.CHECKPOINT_INPUTS: (checkpoint_inputs, units_freed),
    K.COPIES_16BIT: (not_cast, peft_copies, copies_freed, copies_recomputed, freed_for_step,
                     head_freed, copies_after_forward),
    K.OPTIMIZER_STATE: (state_layout, refresh_pops),
    K.GRADIENTS: (grads_stepped,),
    K.QUANTIZED_BASE: (quant_layout,),
    K.LOG_SOFTMAX: (loss_dtype, chunks_not_run),
}


# ---- when a textbook key lives ----------------------------------------------------------------
def lives(r, key: K, m: Moment) -> str:
    """When a textbook key the moment does not hold has its bytes."""
    fwd, opt = m.phase == "forward", m.phase == "optimizer" or m.kind in _AFTER_BLOCKS
    off = r.offload_activations
    if key is K.GRADIENTS:
        if r.step_in_backward:
            return "gradients: each stepped and freed as soon as it is made, in backward"
        if fwd:
            return "gradients: allocated after this moment, in backward"
        return ("gradients: made in backward, block by block (those made so far are below); all "
                "of them from the end of backward")
    if key in (K.SAVED_ACTIVATIONS, K.CHECKPOINT_INPUTS):
        if off:
            return "activations: offloaded to host memory; each block's come back in its backward"
        if opt:
            return "activations: freed before this moment, each block's by its backward"
        return "activations: this moment holds them as recomputed or in-block tensors (below)"
    if key is K.LOG_SOFTMAX:
        if fwd and m.kind in _BEFORE_LOSS:
            return "log-softmax: made after this moment, by the loss"
        if off:
            return ("log-softmax: offloaded; its copy comes back for the loss's backward (loss "
                    "temporaries)")
        return "log-softmax: freed before this moment, by the loss's backward"
    if key is K.COPIES_16BIT:
        if off:
            return ("16-bit copies: the cache lives through the forward; saved copies are "
                    "offloaded with the other saved tensors")
        return ("16-bit copies: freed before this moment, the cache when the forward's autocast "
                "exits, a saved copy by its node's backward")
    if key is K.OPTIMIZER_STATE and r.optimizer_offload:
        return "optimizer state: in host memory (optimizer_offload)"
    return f"{key.value}: not held at this moment"


# ---- the rows ---------------------------------------------------------------------------------
def rows(c: Ctx | None, r, book: list[Term], m: Moment, only=None) -> list[KeyRow]:
    """The KeyRows of moment m: each textbook key with its corrections (or when it lives), then the
    exact layer's keys the textbook has no formula for, as their own terms. only: the keys whose
    corrections are computed (None: all)."""
    have: dict[K, list[Term]] = {}
    for t in m.terms:
        have.setdefault(t.key, []).append(t)
    out = []
    for t in book:
        exact = sum(x.bytes for x in have.get(t.key, []))
        if not exact:
            out.append(KeyRow(t.key, t.category, t.bytes, 0, lives=lives(r, t.key, m)))
            continue
        computed = c is not None and (only is None or t.key in only)
        fns = CORRECTIONS.get(t.key, ()) if computed else ()
        fixes = [f for fn in fns for f in fn(c, m)]
        fixes = [f for f in fixes if f.bytes and f.key is t.key]
        out.append(KeyRow(t.key, t.category, t.bytes, exact, fixes))
    keys = {t.key for t in book}
    for key, terms in have.items():
        if key in keys or not any(x.bytes for x in terms):
            continue
        own = [Term(x.name, x.category, x.bytes, x.formula, x.source, key=key)
               for x in terms if x.bytes]
        out.append(KeyRow(key, terms[0].category, 0, sum(x.bytes for x in terms), own,
                          lives="not in the textbook: the exact layer's own terms"))
    return out
