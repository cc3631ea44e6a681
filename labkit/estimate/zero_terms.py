"""Per-rank bytes of data parallelism and ZeRO: which model states a rank keeps, and what it gathers for a while.

The ZeRO paper's rules (Rajbhandari et al. 2020, arXiv 1910.02054, section 5 and Figure 1), with Psi
parameters, N data-parallel ranks and K bytes of optimizer state per parameter:

    stage 0 (plain DP)   (2 + 2 + K) Psi          parameters, gradients and state on every rank
    stage 1 (P_os)       (2 + 2) Psi + K Psi / N
    stage 2 (P_os+g)     2 Psi + (2 + K) Psi / N
    stage 3 (P_os+g+p)   (2 + 2 + K) Psi / N

`paper_bytes` is exactly that table (mixed precision: 2 B fp16 weights, 2 B fp16 gradients, K = 12: fp32
master weights, m and v). `rank_layout` gives the same rules for labkit's own ZeRO (labkit.distributed.Zero),
which is what the per-rank estimate and the per-rank measurement run: fp32 weights (d bytes each) in flat
units (each block, and the root: everything else), each padded to a multiple of N and cut in N equal shards
of s = ceil(n / N) elements; AdamW's m and v (2 d s) and a 4-byte step per unit shard. Transients on top: a
unit's full gradients and their flat copy for the reduce-scatter (stage 1 after backward; stages 2-3 at the end
of each block's backward, and the root's at the end of backward); stage 3 the root unit gathered from the
forward's start to the end of backward and one block gathered while it runs (no prefetch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

from labkit.memory.report import Category, Moment, Term

from . import optim_terms

HELD = "the tied head's partial gradient"  # a gradient in flight until the embedding's part is added (moments.py)
SOURCE = "ZeRO, Rajbhandari et al. 2020 (arXiv 1910.02054), section 5; labkit.distributed.Zero"
P_, G_, O_, T_ = Category.PARAM, Category.GRAD, Category.OPT, Category.TEMP


def paper_bytes(n_params: float, world: int, stage: int, k: int = 12) -> float:
    """Bytes per rank of the model states in the paper's Figure 1: 2 B weights + 2 B gradients + K B state per
    parameter, the parts stage `stage` shards divided by N = world."""
    _check(world, stage)
    p, g, o = 2 * n_params, 2 * n_params, k * n_params
    return {0: p + g + o, 1: p + g + o / world, 2: p + (g + o) / world, 3: (p + g + o) / world}[stage]


def _check(world: int, stage: int) -> None:
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"the number of data-parallel ranks must be an integer >= 1, got {world!r}")
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"zero must be a ZeRO stage 0, 1, 2 or 3, got {stage!r}")


@dataclass(frozen=True)
class RankLayout:
    """What one rank of labkit's Zero keeps, in elements (d bytes each) unless named bytes."""

    stage: int
    world: int
    d: int  # bytes per parameter element
    block: int  # elements of one block
    root: int  # elements outside the blocks
    n_blocks: int
    state_per_elem: int  # optimizer-state values per element (2 for Adam, 1 momentum, 0 SGD)
    counters: bool  # Adam's 4-byte step per tensor (one per unit shard)
    offload: bool

    @property
    def s_block(self) -> int:
        return math.ceil(self.block / self.world)

    @property
    def s_root(self) -> int:
        return math.ceil(self.root / self.world)

    @property
    def units(self) -> int:
        return self.n_blocks + (1 if self.root else 0)

    @property
    def shard(self) -> int:
        """Elements of this rank's shards, every unit."""
        return self.n_blocks * self.s_block + self.s_root

    @property
    def padded(self) -> int:
        """Elements of every unit's flat buffer (padded to N shards)."""
        return self.world * self.shard

    # ---- the three model states, bytes on this rank -------------------------------------------------
    def params(self) -> int:
        return self.d * (self.shard if self.stage == 3 else self.padded)

    def grads_full(self) -> int:
        return self.d * self.padded

    def grads_shard(self) -> int:
        return self.d * self.shard

    def opt(self) -> int:
        if self.offload:
            return 0
        return self.state_per_elem * self.d * self.shard + (4 * self.units if self.counters else 0)

    def opt_temp(self, optimizer: str) -> int:
        """AdamW (single tensor) on the unit shards: the largest shard's sqrt(v) and quotient beside the
        previous shard's (optim_terms.step_bytes); 0 offloaded (the host does it)."""
        if self.offload:
            return 0
        shapes = [(self.s_block,)] * self.n_blocks + ([(self.s_root,)] if self.root else [])
        return optim_terms.step_bytes(SimpleNamespace(param_shapes=shapes), self.d, optimizer, False)[1]


def rank_layout(spec, d: int, stage: int, world: int, optimizer: str = "adamw", offload: bool = False) -> RankLayout:
    """labkit.distributed.Zero's units for a model spec: its blocks, and the root (every other parameter)."""
    _check(world, stage)
    L = max(spec.n_layer, 0)
    block = spec.layer_params
    root = spec.n_params - L * block
    for name, n in [("a block", block), ("the root (embeddings, final norm, head)", root)]:
        if 0 < n < world:
            raise ValueError(f"{name} has {n} parameter elements, fewer than the {world} ranks to shard them over")
    k = optim_terms.TORCH_STATES.get(optimizer)
    if k is None:
        raise ValueError(f"per-rank ZeRO estimates model torch.optim's sgd, sgd-momentum, adam and adamw, "
                         f"not {optimizer!r}")
    return RankLayout(stage, world, d, block, root, L, k, optimizer in ("adam", "adamw"), offload)


# ---- turning the single-device moments (at the rank's batch) into a rank's moments ----------------------
def _t(name: str, cat: Category, nbytes: int, formula: str) -> Term:
    return Term(name, cat, int(nbytes), formula, SOURCE)


def _gathered(lay: RankLayout, root: bool, blocks: int) -> list[Term]:
    out = []
    if root and lay.root:
        out.append(_t("root unit gathered (embeddings, final norm, head)", P_, lay.d * lay.world * lay.s_root,
                      f"N s_root x {lay.d} B, from the forward's start to the end of backward"))
    if blocks:
        out.append(_t(f"{blocks} block(s) gathered", P_, blocks * lay.d * lay.world * lay.s_block,
                      f"N s_block x {lay.d} B while the block runs"))
    return out


def rank_moments(moments: list[Moment], lay: RankLayout, optimizer: str, n_layer: int) -> list[Moment]:
    """The single-device moments of a rank's batch with the model-state terms of ZeRO stage `lay.stage`, and the
    moments of the gradient reduce (stage 1: after backward; stages 2-3: at the end of each unit's backward)."""
    d, st = lay.d, lay.stage
    P = _t("parameters" if st < 3 else "parameter shards", P_, lay.params(),
           f"{'N s' if st < 3 else 's'} x {d} B per unit (s = ceil(n / N), N = {lay.world})")
    O = _t("optimizer state shards" + (" (offloaded: on the host)" if lay.offload else ""), O_, lay.opt(),
           f"{lay.state_per_elem} x s x {d} B per unit" + (" + 4 B step per unit" if lay.counters else ""))
    out = []
    for m in moments:
        where = m.where
        block = _block_of(where)
        terms, done = [], 0
        for t in m.terms:
            if t.name == "parameters":
                terms.append(P)
            elif t.name == "optimizer state":
                terms.append(O if st else t)
            elif st >= 2 and t.category is G_ and "finished block" in t.name:
                done = round(t.bytes / (d * lay.block)) if lay.block else 0
                terms.append(_t(f"gradient shards of the {done} finished block(s)", G_, done * d * lay.s_block,
                                f"{done} x s_block x {d} B (reduce-scattered at each block's end)"))
            elif st >= 2 and t.name == "gradients" and m.phase == "backward":  # the embedding's backward
                terms.append(_t("gradient shards of the blocks", G_, n_layer * d * lay.s_block, "L x s_block x d"))
                terms.append(_t("root unit's full gradients (reduced last)", G_, d * lay.root, f"n_root x {d} B"))
            elif st and t.name == "gradients" and m.phase == "optimizer":
                terms.append(_t("gradient shards", G_, lay.grads_shard(), f"s x {d} B per unit"))
            elif st and t.name == "optimizer step temporaries":
                terms.append(_t("optimizer step temporaries (shards)", T_, lay.opt_temp(optimizer),
                                "AdamW single tensor on the unit shards (optim_terms.step_bytes)"))
            else:
                terms.append(t)
        if st == 3:
            in_fwd_bwd = m.phase in ("forward", "backward")
            terms += _gathered(lay, in_fwd_bwd, 1 if block is not None else 0)
        out.append(Moment(m.phase, where, terms))
    out += _reduce_moments(out, lay, n_layer)
    return out


def _block_of(where: str) -> int | None:
    import re

    hit = re.search(r"\bblock (\d+)", where)
    return int(hit.group(1)) if hit else None


def _reduce_moments(moments: list[Moment], lay: RankLayout, n_layer: int) -> list[Moment]:
    """The moments a unit's gradients are flattened for their reduce-scatter (`torch.cat` of the unit's full
    gradients, padded): the copy and the gradients it copies are alive together; the unit's shard comes after
    the full gradients are freed.

    stage 1: after backward, every gradient full, the first unit (block 0) flattened.
    stages 2-3: at the end of block k's backward (its last gradient made): block k's full gradients and their
    copy, beside the activations the earlier blocks still hold, the finished blocks' gradient shards, the head's
    gradient and the gradient flowing into block k (twice: the residual's and the first norm's); and at the end
    of backward the root's gradients and their copy (stage 3: block k or the root gathered then)."""
    d = lay.d
    flat_block = _t("a block's gradients, flattened for the reduce-scatter", T_, d * lay.world * lay.s_block,
                    "N s_block x d B (torch.cat of the block's gradients, padded)")
    flat_root = _t("the root's gradients, flattened for the reduce-scatter", T_, d * lay.world * lay.s_root,
                   "N s_root x d B")
    full_block = _t("the block's full gradients", G_, d * lay.block, "n_block x d B")
    if lay.stage == 1:
        opt = next((m for m in moments if m.phase == "optimizer"), None)
        if opt is None:
            return []
        keep = [t for t in opt.terms if t.category not in (T_, G_)]
        first = flat_block if lay.block else flat_root
        return [Moment("backward", "after backward: the first unit's gradients flattened for its reduce-scatter",
                       [*keep, _t("gradients", G_, lay.grads_full(), f"N s x {d} B per unit (all full)"), first])]
    out, seen = [], set()
    for m in moments:
        k = _block_of(m.where)
        if m.phase != "backward" or k is None or not m.where.startswith(f"block {k} backward") or k in seen:
            continue
        seen.add(k)
        # The block's replayed moment, at its end: its saved tensors and temporaries are gone (its input too:
        # the first norm was the last op to need it), its gradients are all made, and the gradient flowing into
        # the block (rows x h, the size of its input) is alive.
        block_input = f"the input of block {k}, saved by it"
        stream = next((t for t in m.terms if t.name == block_input), None)
        own = (f"block {k}'s saved tensors", f"block {k}'s autocast weight copies")  # gone with its backward
        terms = [t for t in m.terms if (t.category is not T_ or t.name.startswith(HELD)) and t.name != block_input
                 and not t.name.startswith(own) and not t.name.endswith("parameter gradients made so far")]
        terms += [full_block, flat_block]
        if stream is not None:
            terms.append(_t("gradient flowing into the block", T_, stream.bytes, "rows x h, its input's size"))
        out.append(Moment("backward", f"block {k} backward ends: its gradients flattened for the reduce-scatter", terms))
    end = next((m for m in moments if m.where == "the embedding's backward"), None)
    if end is not None and lay.root:
        terms = []
        for t in end.terms:
            if t.name == "dense embedding gradient (and the tied sum)":  # the sum is .grad now; the dense part waits
                terms.append(_t("the embedding's dense gradient, still in autograd's buffer", T_, t.bytes // 2,
                                "V x h x d (embedding_dense_backward's output)"))
            elif not (lay.stage == 3 and t.name.endswith("block(s) gathered")):
                terms.append(t)
        terms.append(flat_root)
        out.append(Moment("backward", "backward ends: the root's gradients flattened for the reduce-scatter", terms))
    return out


def per_rank_estimate(single, spec, r, prec_weight: int):
    """The per-rank Estimate of a data-parallel recipe from the single-device estimate of one rank's batch."""
    from labkit.memory.report import Estimate

    tag = f" dp={r.dp} zero={r.zero}" + (" offload" if r.zero_offload else "") + " (per rank)"
    if r.zero == 0:  # labkit's data parallel: all-reduce in place on the .grad tensors, nothing more
        return Estimate(single.label + tag, single.n_params, terms=list(single.terms), moments=list(single.moments))
    lay = rank_layout(spec, prec_weight, r.zero, r.dp, r.optimizer, r.zero_offload)
    moments = rank_moments(single.moments, lay, r.optimizer, spec.n_layer)
    terms = [t for t in single.terms if t.category not in (P_, G_, O_)] + [
        _t("parameters" if r.zero < 3 else "parameter shards", P_, lay.params(), "per rank"),
        _t("gradient shards", G_, lay.grads_shard(), "per rank, after the reduce-scatter"),
        _t("optimizer state shards", O_, lay.opt(), "per rank")]
    return Estimate(single.label + tag, single.n_params, terms=terms, moments=moments)


def stages(recipe) -> dict:
    """{stage: the per-rank Estimate} of a recipe at ZeRO stages 0 to 3 (its dp, zero_offload for stages 1-3)."""
    from .predict import estimate

    return {z: estimate(recipe.replace(zero=z, zero_offload=recipe.zero_offload and z > 0)) for z in (0, 1, 2, 3)}
