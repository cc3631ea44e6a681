"""Per-rank bytes of data parallelism and ZeRO: which model states a rank keeps, and what it gathers for a while.

The ZeRO paper's rules (Rajbhandari et al. 2020, arXiv 1910.02054, section 5 and Figure 1), with Psi
parameters, N data-parallel ranks and K bytes of optimizer state per parameter:

    stage 0 (plain DP)   (2 + 2 + K) Psi          parameters, gradients and state on every rank
    stage 1 (P_os)       (2 + 2) Psi + K Psi / N
    stage 2 (P_os+g)     2 Psi + (2 + K) Psi / N
    stage 3 (P_os+g+p)   (2 + 2 + K) Psi / N

`paper_bytes` (labkit.estimate.textbook) is exactly that table (mixed precision: 2 B fp16 weights, 2 B fp16 gradients, K = 12: fp32
master weights, m and v). `rank_layout` gives the same rules for labkit's own ZeRO (labkit.distributed.Zero),
which is what the per-rank estimate and the per-rank measurement run: fp32 weights (d bytes each) in flat
units (each block, and the root: everything else), each padded to a multiple of N and cut in N equal shards
of s = ceil(n / N) elements; AdamW's m and v (2 d s) and a 4-byte step per unit shard. Transients on top: a
unit's full gradients and their flat copy for the reduce-scatter (stage 1 after backward; stages 2-3 at the end
of each block's backward, and the root's at the end of backward); stage 3 the root unit gathered from the
forward's start to the end of backward and one block gathered while it runs (no prefetch).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from types import SimpleNamespace

from labkit.distributed.zero import SHARD_OPTIMIZERS
from labkit.estimate.refusal import Refused, Refusal
from labkit.memory.report import Category, Estimate, Moment, MomentKind, Term, TermKey as K

from . import keyed, optim_terms
from .peft_terms import of_recipe, trainable_spec
from .predict import Precision, single_estimate
from .spec import spec_from
from .textbook import paper_bytes, zero_shares  # noqa: F401 (lessons 9 and 13 quote paper_bytes from here)

SOURCE = "ZeRO, Rajbhandari et al. 2020 (arXiv 1910.02054), section 5; labkit.distributed.Zero"
P_, G_, O_, T_ = Category.PARAM, Category.GRAD, Category.OPT, Category.TEMP


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
    # FSDP2 (fully_shard) shards each parameter on its own along dim 0, padded to N chunks: rank 0's chunk of
    # each tensor (ceil(d0 / N) x the other dims), block's and root's; empty: labkit's Zero (flat units)
    per_param: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
    # bytes per element of what a unit gathers and its unsharded gradients (0: d). 2 under the
    # engines' mixed precision (Recipe.zero_mixed "engine"): fp32 shards cast to 16 bits, gathered,
    # and 16-bit gradients reduce-scattered, then cast to the fp32 shards' dtype
    gather_bytes: int = 0
    # LoRA under FSDP2: the frozen base is sharded and gathered beside the adapters, but only the
    # adapters get gradients and optimizer state: (rank 0's chunks of a block's trained tensors,
    # the root's; the trained elements of a block, of the root). Empty: every parameter trains
    trained: tuple = ()
    # what steps the shards: torch's (state_per_elem values per element), or one of labkit.optim's that
    # step each flat shard as a 1-D tensor (labkit.distributed.zero.SHARD_OPTIMIZERS: 8-bit Adam, Lion)
    optimizer: str = "adamw"
    paged: bool = False  # the states in CUDA unified memory (bitsandbytes' paged optimizers): off the device

    @property
    def s_tblock(self) -> int:
        """Elements of a block's trained shard (gradients, optimizer state)."""
        return sum(self.trained[0]) if self.trained else self.s_block

    @property
    def s_troot(self) -> int:
        return sum(self.trained[1]) if self.trained else self.s_root

    @property
    def t_block(self) -> int:
        """Trained elements of a block (its unsharded gradients)."""
        return self.trained[2] if self.trained else self.block

    @property
    def t_root(self) -> int:
        return self.trained[3] if self.trained else self.root

    @property
    def tshard(self) -> int:
        """Elements of this rank's trained shards, every unit."""
        return self.n_blocks * self.s_tblock + self.s_troot

    @property
    def c(self) -> int:
        """Bytes per element of a gathered unit and of its unsharded gradients."""
        return self.gather_bytes or self.d

    @property
    def s_block(self) -> int:
        return sum(self.per_param[0]) if self.per_param[0] else math.ceil(self.block / self.world)

    @property
    def s_root(self) -> int:
        return sum(self.per_param[1]) if self.per_param[1] else math.ceil(self.root / self.world)

    @property
    def tensors(self) -> int:
        """Optimizer tensors: one per unit shard (labkit's Zero), one per parameter (FSDP2's DTensors)."""
        if self.trained:
            return self.n_blocks * len(self.trained[0]) + len(self.trained[1])
        if self.per_param[0] or self.per_param[1]:
            return self.n_blocks * len(self.per_param[0]) + len(self.per_param[1])
        return self.units

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
        return self.c * self.world * self.tshard

    def grads_shard(self) -> int:
        return self.d * self.tshard

    def shard_shapes(self) -> list[tuple[int]]:
        """The tensors the optimizer steps on this rank: one flat shard per unit (labkit's Zero), rank 0's
        chunk of each parameter (FSDP2), of each adapter (FSDP2 over LoRA)."""
        if self.trained:
            return [(n,) for n in self.trained[0]] * self.n_blocks + [(n,) for n in self.trained[1]]
        if self.per_param[0] or self.per_param[1]:
            return [(n,) for n in self.per_param[0]] * self.n_blocks + [(n,) for n in self.per_param[1]]
        return [(self.s_block,)] * self.n_blocks + ([(self.s_root,)] if self.root else [])

    def opt(self) -> int:
        """The optimizer state on the device: 0 offloaded (on the host) or paged (in unified memory)."""
        return 0 if self.offload or self.paged else self.state()

    def state(self) -> int:
        """The optimizer state's bytes, wherever it lives."""
        if self.optimizer not in optim_terms.TORCH_STATES:  # per shard, as labkit.optim keeps any 1-D tensor's
            return optim_terms.state_bytes(SimpleNamespace(param_shapes=self.shard_shapes()), self.d,
                                           self.optimizer)
        return self.state_per_elem * self.d * self.tshard + (4 * self.tensors if self.counters else 0)

    def opt_temp(self, optimizer: str) -> int:
        """AdamW (single tensor) on the unit shards: the largest shard's sqrt(v) and quotient beside the
        previous shard's; labkit.optim's, the worst shard's (optim_terms.step_bytes); 0 offloaded (the host
        does it)."""
        if self.offload:
            return 0
        return optim_terms.step_bytes(SimpleNamespace(param_shapes=self.shard_shapes()), self.d, optimizer,
                                      False)[1]


def rank_layout(spec, d: int, stage: int, world: int, optimizer: str = "adamw", offload: bool = False,
                gather_bytes: int = 0, paged: bool = False) -> RankLayout:
    """labkit.distributed.Zero's units for a model spec: its blocks, and the root (every other parameter).
    gather_bytes: bytes per gathered element when they differ from d (RankLayout.gather_bytes)."""
    zero_shares(0, 0, 0, world, stage)  # raises on a bad world or stage
    L = max(spec.n_layer, 0)
    block = spec.layer_params
    root = spec.n_params - L * block
    for name, n in [("a block", block), ("the root (embeddings, final norm, head)", root)]:
        if 0 < n < world:
            raise ValueError(f"{name} has {n} parameter elements, fewer than the {world} ranks to shard them over")
    k = optim_terms.TORCH_STATES.get(optimizer)
    if k is None and optimizer not in SHARD_OPTIMIZERS:
        raise ValueError(f"per-rank ZeRO estimates model torch.optim's sgd, sgd-momentum, adam and adamw, and "
                         f"labkit.optim's {', '.join(SHARD_OPTIMIZERS)} on flat shards, not {optimizer!r}")
    return RankLayout(stage, world, d, block, root, L, k or 0, optimizer in ("adam", "adamw"), offload,
                      gather_bytes=gather_bytes, optimizer=optimizer, paged=paged)


# ---- turning the single-device moments (at the rank's batch) into a rank's moments ----------------------
def _t(key: K, name: str, cat: Category, nbytes: int, formula: str) -> Term:
    return Term(name, cat, int(nbytes), formula, SOURCE, key=key)


def _gathered(lay: RankLayout, root: bool, blocks: int) -> list[Term]:
    out = []
    if root and lay.root:
        out.append(_t(K.GATHERED_ROOT,
                      "root unit gathered (embeddings, final norm, head)", P_, lay.c * lay.world * lay.s_root,
                      f"N s_root x {lay.c} B, from the forward's start to the end of backward"))
    if blocks:
        out.append(_t(K.GATHERED_BLOCKS, f"{blocks} block(s) gathered", P_, blocks * lay.c * lay.world * lay.s_block,
                      f"N s_block x {lay.c} B while the block runs"))
    return out


def rank_moments(moments: list[Moment], lay: RankLayout, optimizer: str, n_layer: int) -> list[Moment]:
    """The single-device moments of a rank's batch with the model-state terms of ZeRO stage `lay.stage`, and the
    moments of the gradient reduce (stage 1: after backward; stages 2-3: at the end of each unit's backward)."""
    d, c, st = lay.d, lay.c, lay.stage
    P = _t(K.PARAMETERS, "parameters" if st < 3 else "parameter shards", P_, lay.params(),
           f"{'N s' if st < 3 else 's'} x {d} B per unit (s = ceil(n / N), N = {lay.world})")
    O = _t(K.OPTIMIZER_STATE,
           "optimizer state shards" + (" (offloaded: on the host)" if lay.offload else ""), O_, lay.opt(),
           f"{lay.state_per_elem} x s x {d} B per unit" + (" + 4 B step per unit" if lay.counters else ""))
    shards = _t(K.GRADIENTS, "gradient shards of every unit (the earlier micro-batches')", G_, lay.grads_shard(),
                f"s x {d} B per unit")
    out = []
    for m in moments:
        terms, done = [], 0
        later = st >= 2 and m.micro > 1  # every unit's shard holds the earlier micro-batches' sum
        for t in m.terms:
            if later and t.key is K.BLOCK_GRADIENTS:  # reduced into the shards and freed, as they were made
                continue
            if later and t.key is K.GRADIENTS and m.phase == "backward":  # the embedding's backward
                terms.append(_t(K.GRADIENTS,
                                "root unit's full gradients (reduced last)", G_, c * lay.t_root, f"n_root x {c} B"))
                continue
            if t.key is K.PARAMETERS:
                terms.append(P)
            elif st == 3 and lay.trained and t.key is K.FROZEN_BASE:
                terms.append(_t(K.FROZEN_BASE, "frozen base shards", P_, d * (lay.shard - lay.tshard),
                                f"rank 0's chunks of the frozen weights x {d} B"))
            elif st == 3 and lay.trained and t.key is K.ADAPTERS:
                terms.append(_t(K.ADAPTERS, "adapter shards", P_, d * lay.tshard,
                                f"rank 0's chunks of the adapters x {d} B"))
            elif t.key is K.OPTIMIZER_STATE:
                terms.append(O if st else t)
            elif st >= 2 and t.category is G_ and t.key is K.BLOCK_GRADIENTS:
                done = round(t.bytes / (c * lay.t_block)) if lay.t_block else 0
                terms.append(_t(K.BLOCK_GRADIENTS,
                                f"gradient shards of the {done} finished block(s)", G_, done * d * lay.s_tblock,
                                f"{done} x s_block x {d} B (reduce-scattered at each block's end)"))
            elif st >= 2 and t.key is K.GRADIENTS and m.phase == "backward":  # the embedding's backward
                terms.append(_t(K.GRADIENTS,
                                "gradient shards of the blocks", G_, n_layer * d * lay.s_tblock, "L x s_block x d"))
                terms.append(_t(K.GRADIENTS,
                                "root unit's full gradients (reduced last)", G_, c * lay.t_root, f"n_root x {c} B"))
            elif st and t.key is K.GRADIENTS and m.phase == "optimizer":
                terms.append(_t(K.GRADIENTS, "gradient shards", G_, lay.grads_shard(), f"s x {d} B per unit"))
            elif st and t.key is K.OPTIMIZER_TEMPS:
                terms.append(_t(K.OPTIMIZER_TEMPS, "optimizer step temporaries (shards)", T_, lay.opt_temp(optimizer),
                                "AdamW single tensor on the unit shards (optim_terms.step_bytes)"))
            else:
                terms.append(t)
        if later and m.phase != "optimizer":
            terms.append(shards)
        if st == 3:
            in_fwd_bwd = m.phase in ("forward", "backward")
            terms += _gathered(lay, in_fwd_bwd, 1 if m.block is not None else 0)
        out.append(dataclasses.replace(m, terms=terms))
    out += _reduce_moments(out, lay, n_layer)
    return [m for m in out if m.kind is not MomentKind.GRADIENTS_READY]  # (their reduce moments are larger)


def _reduce_moments(moments: list[Moment], lay: RankLayout, n_layer: int) -> list[Moment]:
    """The moments a unit's gradients are flattened for their reduce-scatter (`torch.cat` of the unit's full
    gradients, padded): the copy and the gradients it copies are alive together; the unit's shard comes after
    the full gradients are freed.

    stage 1: after backward, every gradient full, the first unit (block 0) flattened.
    stages 2-3: where block k's last gradient is made (a GRADIENTS_READY moment: LoRA's adapters, inside the
    block's backward), that moment and the copy; else at the end of block k's backward: its full gradients and
    their copy, beside the activations the earlier blocks still hold, the finished blocks' gradient shards, the head's
    gradient and the gradient flowing into block k (twice: the residual's and the first norm's); and at the end
    of backward the root's gradients and their copy (stage 3: block k or the root gathered then)."""
    d = lay.c  # the gradients a unit reduce-scatters: in the gathered dtype
    flat_block = _t(K.COMM_BUFFERS,
                    "a block's gradients, flattened for the reduce-scatter", T_, d * lay.world * lay.s_tblock,
                    "N s_block x d B (torch.cat of the block's gradients, padded)")
    flat_root = _t(K.COMM_BUFFERS,
                   "the root's gradients, flattened for the reduce-scatter", T_, d * lay.world * lay.s_troot,
                   "N s_root x d B")
    full_block = _t(K.GRADIENTS_SO_FAR, "the block's full gradients", G_, d * lay.t_block, "n_block x d B")
    # (a later micro-batch's reduce-scatter output, added into the shard, is made once the full gradients are
    # freed: less than the moment of the copy, Zero._reduce)
    if lay.stage == 1:
        opt = next((m for m in moments if m.phase == "optimizer"), None)
        if opt is None:
            return []
        keep = [t for t in opt.terms if t.category not in (T_, G_)]
        first = flat_block if lay.t_block else flat_root
        return [Moment("backward", "after backward: the first unit's gradients flattened for its reduce-scatter",
                       [*keep, _t(K.GRADIENTS, "gradients", G_, lay.grads_full(), f"N s x {d} B per unit (all full)"),
                        first], kind=MomentKind.REDUCE_AFTER_BACKWARD)]
    out, seen = [], set()
    for m in moments:  # the unit's last gradient made inside its block's backward (LoRA's adapters): then
        if m.kind is MomentKind.GRADIENTS_READY:
            seen.add((m.block, m.micro))
            out.append(Moment("backward", m.where + ": the block's gradients flattened for the reduce-scatter",
                              [*m.terms, flat_block],
                              kind=MomentKind.GRADIENT_REDUCE, block=m.block, micro=m.micro))
    for m in moments:
        k = m.block
        if m.phase != "backward" or m.kind is not MomentKind.BLOCK_BACKWARD or k is None or (k, m.micro) in seen:
            continue
        seen.add((k, m.micro))
        # The block's replayed moment, at its end: its saved tensors and temporaries are gone (its input too:
        # the first norm was the last op to need it), its gradients are all made, and the gradient flowing into
        # the block (rows x h, the size of its input) is alive.
        def own(t: Term) -> bool:  # gone with block k's backward: its input, saved tensors, weight copies
            return t.block == k and t.key in (K.BLOCK_INPUT, K.SAVED_ACTIVATIONS, K.COPIES_16BIT)

        stream = next((t for t in m.terms if t.block == k and t.key is K.BLOCK_INPUT), None)
        terms = [t for t in m.terms if (t.category is not T_ or t.key is K.TIED_HEAD_GRADIENT) and not own(t)
                 and t.key is not K.GRADIENTS_SO_FAR]
        terms += [full_block, flat_block]
        if stream is not None:
            terms.append(_t(K.RESIDUAL_GRADIENT,
                            "gradient flowing into the block", T_, stream.bytes, "rows x h, its input's size"))
        out.append(Moment("backward", f"block {k} backward ends: its gradients flattened for the reduce-scatter", terms,
                          kind=MomentKind.GRADIENT_REDUCE, block=k, micro=m.micro))
    for micro in sorted({m.micro for m in moments}):
        end = next((m for m in moments if m.kind is MomentKind.EMBEDDING_BACKWARD and m.micro == micro), None)
        if end is None or not lay.t_root:
            continue
        # the root's last gradient is the embedding's: once its hook runs, the embedding's node has returned (the
        # residual stream's gradient freed) and its dense gradient is the .grad, or a tied matrix's sum with the
        # head's part is (both parts freed): the root's full gradients alone, then their flat copy
        gone = {K.RESIDUAL_GRADIENT, K.EMBEDDING_GRADIENT, K.EMBEDDING_TIED_SUM}
        terms = [t for t in end.terms if t.key not in gone and not (lay.stage == 3 and t.key is K.GATHERED_BLOCKS)]
        terms.append(flat_root)
        out.append(Moment("backward", "backward ends: the root's gradients flattened for the reduce-scatter" +
                          end.where.removeprefix("the embedding's backward"), terms,
                          kind=MomentKind.GRADIENT_REDUCE, micro=micro))
    return out


def engine_mixed(r) -> bool:
    """True when a recipe's ZeRO-3 runs mixed precision as FSDP2 and DeepSpeed do (Recipe.zero_mixed "engine"):
    fp32 shards, units gathered and computed in 16 bits. Stages 0-2 keep autocast over full fp32 weights."""
    return r.zero == 3 and r.dtype.startswith("mixed-") and r.zero_mixed == "engine"


def _rank_recipe(r):
    """The single-device recipe one rank runs: its rows; under the engines' mixed precision the model computes
    in 16 bits (FSDP2 casts every gathered parameter to param_dtype, so every op runs in it: no autocast)."""
    one = r.replace(dp=1, batch=r.rank_batch, zero=0, zero_offload=False)
    return one.replace(dtype=r.dtype.removeprefix("mixed-")) if engine_mixed(r) else one


def _label(single, r) -> str:
    """The single-device label with the recipe's own dtype (the engines' rank computes in 16 bits)."""
    return single.label.replace(f" {_rank_recipe(r).dtype} ", f" {r.dtype} ", 1)


def mixed_note(r) -> str:
    """Which mixed precision a ZeRO-3 estimate shows, for its label ('' when there is no choice)."""
    if r.zero != 3 or not r.dtype.startswith("mixed-"):
        return ""
    bits = r.dtype.removeprefix("mixed-")
    if engine_mixed(r):
        return f" mixed={bits} as FSDP2/DeepSpeed (fp32 shards, units gathered in {bits})"
    return f" mixed=autocast over fp32 shards (labkit's Zero)"


def _check_zero(r) -> None:
    """The ZeRO recipes labkit refuses, each with what stands in the way."""
    if r.optimizer.startswith("galore"):
        raise Refused(Refusal.GALORE_SHARDED, f"optimizer {r.optimizer!r} under ZeRO: GaLore projects each "
                      "weight's whole gradient matrix on its top singular vectors, and a ZeRO shard is a "
                      "flat slice of the model (an FSDP2 shard a block of rows), not that matrix; use "
                      "sgd, sgd-momentum, adam or adamw")
    if r.optimizer == "adafactor":
        raise Refused(Refusal.FACTORED_SHARDED, "optimizer 'adafactor' under ZeRO: Adafactor factors each "
                      "weight matrix's second moment into its row and column averages, and a ZeRO shard is "
                      "a flat slice of the model, not that matrix; use adamw8bit or lion for small states")
    if r.optimizer not in optim_terms.TORCH_STATES and r.optimizer not in SHARD_OPTIMIZERS:
        raise Refused(Refusal.OPTIMIZER_SHARDED, f"optimizer {r.optimizer!r} under ZeRO is not estimated yet: "
                      f"use sgd, sgd-momentum, adam or one of {', '.join(SHARD_OPTIMIZERS)}")
    if r.optimizer_offload is not None:
        raise Refused(Refusal.OPTIMIZER_OFFLOAD_ZERO,
                      "optimizer_offload under ZeRO: OffloadAdamW would step the full parameters that ZeRO "
                      "shards; ZeRO-Offload moves the shards' state instead: give "
                      "zero_offload=True")
    if r.zero_offload and r.optimizer != "adamw":
        raise Refused(Refusal.ZERO_OFFLOAD_OPTIMIZER,
                      "zero_offload runs labkit.optim.OffloadAdamW: give optimizer='adamw'")
    if r.zero < 3 and r.lisa_layers is not None:
        raise Refused(Refusal.LISA_SHARDED,
                      f"ZeRO-{r.zero} over a LISA model: labkit's Zero builds its units once, from the "
                      "parameters that train then, and LISA changes which layers train every few steps")
    if r.micro < r.rank_batch and r.zero == 3 and (engine_mixed(r) or r.lora_rank is not None
                                                   or r.lisa_layers is not None):
        raise Refused(Refusal.FSDP2_MICRO_BATCHES,
                      "micro_batch under FSDP2 (ZeRO-3 over LoRA or LISA, or the engines' mixed precision): "
                      "fully_shard sums each micro-batch's reduce-scattered gradients into sharded .grad "
                      "DTensors, and FSDPMemTracker, which measures a rank here, refuses several forward "
                      "calls in one step, so it is not estimated; give micro_batch=None, or zero=1/2 "
                      "(labkit's Zero, estimated with micro-batches)")
    if r.checkpoint != "none" and r.zero == 3:
        spec = spec_from(r.model, **r.config)
        per_block = r.checkpoint in ("full", "selective") and r.segments in (None, spec.n_layer)
        if not per_block:
            raise Refused(Refusal.ZERO3_SEGMENTS,
                          "ZeRO-3 with checkpointed segments of several blocks: ZeRO-3 gathers a block's "
                          "parameters in that block's own forward hook, but a segment runs "
                          "all its blocks inside its first block's call, before the others "
                          "are gathered; checkpoint each block (checkpoint='full' or "
                          "'selective', segments=None)")


def data_parallel_estimate(r) -> Estimate:
    """One data-parallel rank of a recipe: the single-device estimate of its batch (batch / dp rows), its model
    states as ZeRO stage `r.zero` keeps them."""
    if r.tp > 1 or r.pp > 1:
        raise ValueError("data_parallel_estimate takes dp and zero only: use labkit.estimate.estimate for tp/pp")
    # plain data parallelism steps in backward on each gradient averaged in place in its own hook first
    # (labkit.distributed.average_in_backward): one device's moments at the rank's batch
    if r.step_in_backward and r.zero:
        raise Refused(Refusal.STEP_IN_BACKWARD_ZERO,
                      f"step_in_backward with ZeRO-{r.zero}: each unit's shard would step once its gradients "
                      "are reduce-scattered, in the unit's hook (torchtune's optimizer_in_bwd over FSDP2); "
                      "labkit's Zero steps its shards after backward, so it is not estimated yet")
    if r.zero:
        _check_zero(r)
        if r.zero == 3 and (engine_mixed(r) or r.lora_rank is not None or r.lisa_layers is not None):
            # the engines' mixed precision, or a frozen base sharded beside its adapters: FSDP2's
            # units (labkit's Zero runs neither: fp32 or autocast, its units made of trained
            # parameters)
            if r.paged_states:
                raise Refused(Refusal.PAGED_SHARDED, "paged_states under FSDP2 (ZeRO-3 over LoRA or "
                              "LISA, or the engines' mixed precision): paged states on DTensor shards are "
                              "not estimated yet; labkit's Zero (zero=1 or 2, or zero=3 in fp32) pages its "
                              "flat shards' states")
            return fsdp2_estimate(r)
    # ZeRO-2/3 reduce-scatter a block's unit from its last gradient's hook: inside the block's backward (LoRA's
    # adapters), or while a multi-block segment's earlier blocks wait with their recomputed tensors
    single = single_estimate(_rank_recipe(r), ready=r.zero >= 2, reduced=r.zero >= 2)
    tag = f" dp={r.dp} zero={r.zero}" + (" offload" if r.zero_offload else "") + mixed_note(r) + " (per rank)"
    if r.zero == 0:  # labkit's data parallel: all-reduce in place on the .grad tensors, nothing more
        return keyed.attach(Estimate(_label(single, r) + tag, single.n_params, terms=list(single.terms),
                                     moments=list(single.moments), unified=single.unified), r)
    spec = spec_from(r.model, **r.config)
    if r.lora_rank is not None:  # ZeRO-1/2 over LoRA: the frozen base stays whole on every rank (in the
        # single-device terms); Zero's units are made of the adapters, which alone have gradients and states
        from .peft_terms import peft_of, trainable_spec

        spec = trainable_spec(spec, peft_of(spec, r.lora_rank, r.lora_targets, r.quant, None, r.quant_group,
                                            r.quant_set))
    lay = rank_layout(spec, Precision.of(r.dtype).weight, r.zero, r.dp, r.optimizer, r.zero_offload,
                      paged=r.paged_states)
    moments = rank_moments(single.moments, lay, r.optimizer, spec.n_layer)
    terms = [t for t in single.terms if t.category not in (P_, G_, O_)] + [
        _t(K.PARAMETERS, "parameters" if r.zero < 3 else "parameter shards", P_, lay.params(), "per rank"),
        _t(K.GRADIENTS, "gradient shards", G_, lay.grads_shard(), "per rank, after the reduce-scatter"),
        _t(K.OPTIMIZER_STATE, "optimizer state shards", O_, lay.opt(), "per rank")]
    est = Estimate(_label(single, r) + tag, single.n_params, terms=terms, moments=moments,
                   unified=lay.state() if lay.paged else 0)
    return keyed.attach(est, r)


def stages(recipe) -> dict:
    """{stage: the per-rank Estimate} of a data-parallel recipe at ZeRO stages 0 to 3 (its dp, zero_offload for
    stages 1-3). One rank has nothing to shard: without offload every stage is then stage 0's step."""
    def at(z: int):
        off = recipe.zero_offload and z > 0
        return recipe.replace(zero=z if recipe.dp > 1 or off else 0, zero_offload=off)

    return {z: data_parallel_estimate(at(z)) for z in (0, 1, 2, 3)}


# ---- FSDP2 (torch.distributed.fsdp.fully_shard on every block, then the root) ----------------------------------


def _chunks(names, shapes, world: int) -> tuple[list[int], list[int], int, int]:
    """Rank 0's dim-0 chunk (ceil(d0 / N) rows x the other dims) of each tensor of block 0 and of the root,
    and the elements of block 0 and of the root."""
    block, root, nb, nr = [], [], 0, 0
    for name, shape in zip(names, shapes):
        hit = re.search(r"(?:blocks|h|layers)\.(\d+)\.", name)
        if hit and int(hit.group(1)) != 0:
            continue
        rest = math.prod(shape[1:])
        chunk = math.ceil(shape[0] / world) * rest if shape else 1
        (block if hit else root).append(chunk)
        if hit:
            nb += math.prod(shape)
        else:
            nr += math.prod(shape)
    return block, root, nb, nr


def fsdp2_layout(spec, d: int, world: int, optimizer: str = "adamw", gather_bytes: int = 0,
                 trained=None, offload: bool = False) -> RankLayout:
    """Rank 0's shards under FSDP2: each parameter cut along dim 0 in N chunks of ceil(d0 / N) rows (the last
    chunks padded, rank 0's always full), so a unit's all-gather moves N x sum of its chunks, not its elements
    padded once to N (labkit's Zero flattens a unit first). trained: the ModelSpec of LoRA's adapters
    (peft_terms.trainable_spec), sharded beside the frozen base in the same units; None: all train."""
    base = rank_layout(spec, d, 3, world, optimizer)
    names, shapes = list(spec.param_names), list(spec.param_shapes)
    train = ()
    if trained is not None:
        names += list(trained.param_names)
        shapes += list(trained.param_shapes)
        tb, tr, nb, nr = _chunks(trained.param_names, trained.param_shapes, world)
        train = (tuple(tb), tuple(tr), nb, nr)
    block, root, nb, nr = _chunks(names, shapes, world)
    return RankLayout(3, world, d, nb, nr, base.n_blocks, base.state_per_elem, base.counters,
                      offload, (tuple(block), tuple(root)), gather_bytes, train)


def fsdp2_moments(moments: list[Moment], lay: RankLayout, reshard_after_forward: bool = True) -> list[Moment]:
    """FSDP2's moments from labkit's ZeRO-3 moments on its layout (rank_moments with fsdp2_layout), with what
    FSDP2 holds beside them:

    - the all-gather output: a unit is gathered into one flat buffer and copied out into its parameters; the
      buffer is freed only at the next all-gather (one unit's, N s_unit x d, at every forward moment, the
      root's before the first block);
    - reshard_after_forward=True (ZeRO-3): backward gathers again, each block prefetching the one before it,
      so inside block k's backward (and in the head's, for the last block) the next block's buffer is alive;
    - reshard_after_forward=False: a block keeps its gathered parameters from its forward to the end of its
      backward (blocks 0..k gathered at block k, every block between the forward's end and the first
      backward) and nothing is gathered in backward;
    - either way a block's post-backward reshards it (frees its gathered parameters) before its reduce-scatter;
    - the reduce-scatter input: a block's gradients copied into one padded buffer, held until the next
      reduce-scatter starts (inside block k's backward, block k + 1's; in the embedding's, block 0's)."""
    d, L = lay.c, lay.n_blocks
    unit = _t(K.COMM_BUFFERS,
              "all-gather output buffer (freed at the next all-gather)", T_, d * lay.world * lay.s_block,
              "N s_block x d B")
    rs = _t(K.COMM_BUFFERS, "the previous block's reduce-scatter input (freed at the next reduce-scatter)", T_,
            d * lay.world * lay.s_tblock, "N s_block x d B (its trained tensors)")
    out = []
    for m in moments:
        k, terms = m.block, list(m.terms)
        # rank_moments' flat copy: the reduce-scatter input itself
        ends = m.kind in (MomentKind.GRADIENT_REDUCE, MomentKind.REDUCE_AFTER_BACKWARD)
        # the loss, the head, the final norm
        head_side = k is None and not ends and m.kind not in (MomentKind.EMBEDDING_BACKWARD, MomentKind.EMBEDDING_SUM)
        if L and m.phase == "forward":  # inside the last block or after it: the last block's buffer
            terms.append(unit)
            if not reshard_after_forward:
                terms = _regather(terms, lay, L if k is None else k + 1)
        elif L and m.phase == "backward" and (head_side or k is not None):
            if reshard_after_forward and (head_side or k >= 1):
                terms.append(unit)  # the block about to run backward (or block k - 1) prefetched
            if ends or not reshard_after_forward:  # post-backward reshards block k before its reduce-scatter
                terms = _regather(terms, lay, 0 if reshard_after_forward else L if k is None else k + 1 - ends)
            if k is not None and k < L - 1 and not ends:
                terms.append(rs)
        elif L and m.phase == "backward" and not ends:  # the embedding's backward: block 0's input still held
            terms.append(rs)
        out.append(dataclasses.replace(m, terms=terms))
    return out


def _regather(terms: list[Term], lay: RankLayout, blocks: int) -> list[Term]:
    """The terms with `blocks` blocks gathered in place of rank_moments' one-at-a-time block."""
    kept = [t for t in terms if t.key is not K.GATHERED_BLOCKS]
    return kept + _gathered(lay, False, blocks)


def _check_fsdp2(r, peft) -> None:
    """The recipes FSDP2 cannot run as labkit builds them, each with its reason."""
    if peft is not None and peft.lisa_layers:
        raise Refused(Refusal.LISA_SHARDED,
                      "LISA under ZeRO-3 / FSDP2: LISA switches which layers train every few steps, and "
                      "fully_shard fixes at wrapping time which parameters a unit "
                      "reduce-scatters and steps; use LoRA, or LISA with zero=0")
    if peft is not None and peft.quant != "none":
        raise Refused(Refusal.QUANT_FSDP2,
                      f"quant={peft.quant!r} under ZeRO-3 / FSDP2: labkit's quantized base keeps its codes "
                      "in buffers, which fully_shard does not shard (torchao's NF4Tensor "
                      "implements FSDP2's all-gather extension for that); use quant='none' "
                      "with zero=3")
    if r.base_dtype is not None:
        raise Refused(Refusal.BASE_DTYPE_FSDP2,
                      "base_dtype under ZeRO-3 / FSDP2: fully_shard all-gathers a unit in one dtype, so a "
                      "16-bit base beside fp32 adapters cannot share a unit; under "
                      "zero_mixed='engine' every unit is gathered in 16 bits anyway: drop "
                      "base_dtype")
    if r.optimizer.startswith("galore"):
        raise Refused(Refusal.GALORE_SHARDED,
                      f"optimizer {r.optimizer!r} under ZeRO-3 / FSDP2: GaLore projects "
                      "each weight's whole gradient matrix, and a rank holds a dim-0 shard of it (DTensor); "
                      "use sgd, sgd-momentum, adam or adamw")
    if r.optimizer not in optim_terms.TORCH_STATES:
        raise Refused(Refusal.OPTIMIZER_SHARDED, f"optimizer {r.optimizer!r} under ZeRO-3 / FSDP2: labkit's "
                      f"{r.optimizer} keeps its state per full tensor (block-wise 8-bit or factored), not per "
                      "dim-0 shard (DTensor); not estimated yet: use sgd, sgd-momentum, adam or adamw")


def fsdp2_estimate(recipe, reshard_after_forward: bool = True):
    """Rank 0's Estimate under FSDP2 (fully_shard on every block, then the root; torch AdamW on the DTensor
    shards) for a data-parallel recipe (its dp is the world size; its zero is ignored): labkit's per-rank
    ZeRO-3 moments on FSDP2's per-parameter layout, with FSDP2's buffers (fsdp2_moments)."""
    if recipe.dp < 2:
        raise ValueError(f"fsdp2_estimate needs dp >= 2 ranks, got dp={recipe.dp}")
    # zero_offload: the optimizer state and its step on the host (DeepSpeed's offload_optimizer), as at
    # labkit's ZeRO-Offload; parameters and gradients stay on the device
    r = recipe.replace(zero=3)
    d = Precision.of(r.dtype).weight
    spec = spec_from(r.model, **r.config)
    single = single_estimate(_rank_recipe(r))
    peft = of_recipe(spec, r)
    _check_fsdp2(r, peft)
    trained = trainable_spec(spec, peft) if peft is not None else None
    lay = fsdp2_layout(spec, d, r.dp, r.optimizer, 2 if engine_mixed(r) else 0, trained,
                       r.zero_offload)
    moments = fsdp2_moments(rank_moments(single.moments, lay, r.optimizer, spec.n_layer), lay, reshard_after_forward)
    terms = [t for t in single.terms if t.category not in (P_, G_, O_)] + [
        _t(K.PARAMETERS, "parameter shards", P_, lay.params(), "rank 0's dim-0 chunk of every parameter"),
        _t(K.GRADIENTS, "gradient shards", G_, lay.grads_shard(), "the same chunks, after the reduce-scatter"),
        _t(K.OPTIMIZER_STATE,
           "optimizer state shards", O_, lay.opt(), f"{lay.state_per_elem} x s x {d} B + 4 B step per tensor")]
    off = " offload" if r.zero_offload else ""
    tag = f" dp={r.dp} FSDP2{off} reshard_after_forward={reshard_after_forward}{mixed_note(r)} (rank 0)"
    est = Estimate(_label(single, r) + tag, single.n_params, terms=terms, moments=moments,
                   unified=lay.state() if lay.paged else 0)
    return keyed.attach(est, r)
