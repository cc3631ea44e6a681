"""Per-rank bytes of a model split over devices: pipeline stages (by layers) and tensor parallelism (inside
layers), each rank's estimate made from the single-device one (its walk and its moments) with the rank's
share of every term.

- Pipeline (p stages, m micro-batches): stage s holds its blocks' parameters, gradients and optimizer state
  (stage 0 the embeddings, the last stage the final norm and the head, a copy of a tied embedding when
  p > 1), and the activations of every micro-batch in flight: m under GPipe, min(p - s, m) under 1F1B.
- Tensor parallel (t ranks, Megatron-LM): the attention and MLP matrices are divided by t (row-parallel
  biases stay whole), LayerNorms and embeddings replicated; per layer the activations are
  sbh(10 + 24/t + 5as/(ht)), or sbh(34/t + 5as/(ht)) with sequence parallelism (Korthikanti et al. 2022,
  arXiv 2205.05198, eq. 2-4 with 16-bit activations and 1-byte dropout masks).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass

from labkit.estimate.refusal import Refused, Refusal
from labkit.memory.report import Category, Estimate, MomentKind, Term, TermKey as K

from . import keyed, peft_terms, predict, tape, zero_terms
from .held import block_saved, checkpoint_held, segments_of
from .moments import step_moments
from .spec import spec_from
from .step_bytes import custom
from .walk import TPShare
from .textbook import in_flight, korthikanti_layer_bytes  # noqa: F401 (lesson 10 quotes them from here)



def split_layers(n_layer: int, n_stages: int) -> list[tuple[int, int]]:
    """[start, stop) of each stage's blocks (labkit.distributed.pipeline's rule: the first stages one more)."""
    from labkit.distributed.pipeline import split_layers as split

    return split(n_layer, n_stages)


# ---- Korthikanti et al.'s per-layer formula and what labkit's layer adds ------------------------------------------
@dataclass(frozen=True)
class LabkitLayer:
    """How labkit's layer runs, beyond the formula's sizes (what labkit_layer_extras adds depends on it)."""

    e: int = 2  # bytes per activation element
    device: str = "cpu"  # "cpu" or "cuda": on a CPU dropout masks take e bytes, not 1
    dropout: bool = True  # the layer has dropout (attention and residual)
    manual: bool = True  # materialised attention (labkit's "manual"): its (S, S) causal mask is saved

    def __post_init__(self) -> None:
        if isinstance(self.e, bool) or not isinstance(self.e, int) or self.e <= 0:
            raise ValueError(f"LabkitLayer.e must be a positive integer of bytes, got {self.e!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"LabkitLayer.device must be 'cpu' or 'cuda', got {self.device!r}")
        for name in ("dropout", "manual"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LabkitLayer.{name} must be True or False, got {getattr(self, name)!r}")


def labkit_layer_extras(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                        layer: LabkitLayer = LabkitLayer()) -> list[Term]:
    """What labkit's layer saves beyond the formula (its sizes as korthikanti_layer_bytes takes them), term by
    term (e = layer.e bytes per activation element): LayerNorm statistics, the (S, S) causal mask of materialised
    attention, and on a CPU dropout masks in the activations' dtype (e bytes, not 1: aten's CPU native_dropout
    returns the mask as the input's dtype)."""
    e = layer.e
    rep = t if sp else 1  # what the formula's '10' covers is divided by t only with sequence parallelism
    out = [Term("LayerNorm mean and rstd (2 norms)", Category.ACT, 2 * 2 * s * b * e // rep,
                "2 x 2 x sb x e" + (" / t" if sp else ""), "native_layer_norm saves mean and rstd",
                key=K.SAVED_ACTIVATIONS)]
    if layer.manual:
        out.append(Term("causal mask (S x S bool)", Category.ACT, s * s, "s^2", "masked_fill saves its mask",
                        key=K.SAVED_ACTIVATIONS))
    if layer.dropout and layer.device == "cpu" and e > 1:
        if layer.manual:
            out.append(Term("attention dropout mask at e bytes, not 1", Category.ACT, (e - 1) * a * s * s * b // t,
                            "(e - 1) as^2 b / t", "aten native_dropout on CPU: mask in the input's dtype",
                            key=K.SAVED_ACTIVATIONS))
        out.append(Term("residual dropout masks at e bytes, not 1", Category.ACT, 2 * (e - 1) * s * b * h // rep,
                        "2 (e - 1) sbh" + (" / t" if sp else ""), "aten native_dropout on CPU",
                        key=K.SAVED_ACTIVATIONS))
    return out


# ---- what one rank holds ---------------------------------------------------------------------------------------
_LAYER = re.compile(r"(?:blocks|h|layers)\.(\d+)\.")


@functools.lru_cache(maxsize=1 << 16)  # the planner asks for the same few hundred names millions of times
def _layer_of(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def rank_params(spec, stage: int = 0, n_stages: int = 1, t: int = 1) -> list[tuple[str, tuple]]:
    """(name, shape) of each parameter tensor rank (stage, any tp rank) holds: the stage's blocks with their
    attention and MLP matrices divided by t (column-parallel: outputs; row-parallel: inputs, bias whole),
    the embeddings on the first stage, the final norm and head on the last (a copy of a tied embedding when
    the two are different stages)."""
    start, stop = split_layers(spec.n_layer, n_stages)[stage]
    first, last = stage == 0, stage == n_stages - 1
    out = []
    for name, shape in zip(spec.param_names, spec.param_shapes):
        k = _layer_of(name)
        if k is not None:
            if not start <= k < stop:
                continue
            out.append((name, _tp_shape(name, tuple(shape), t)))
        elif any(x in name for x in ("wte", "wpe", "embed_tokens")):
            if first:
                out.append((name, tuple(shape)))
        elif last:
            out.append((name, tuple(shape)))
    if spec.tied and last and not first:  # the head's own copy of the tied matrix
        out.append(("lm_head.weight (tied copy)", (spec.vocab, spec.hidden)))
    return out


def _tp_shape(name: str, shape: tuple, t: int) -> tuple:
    if t == 1:
        return shape
    # labkit's GPT and transformers' Llama hold nn.Linear weights, (out, in): column-parallel splits the
    # outputs (and a bias), row-parallel the inputs (tensor_parallel.TPGPT, tensor_parallel.LlamaTP)
    if re.search(r"(c_attn|c_fc|q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$", name):
        return (shape[0] // t, *shape[1:])
    if re.search(r"(c_proj|o_proj|down_proj)\.weight$", name):
        return (shape[0], shape[1] // t)
    return shape


def rank_spec(spec, stage: int = 0, n_stages: int = 1, t: int = 1):
    """The ModelSpec of what one rank trains (for the optimizer-state and step rules of optim_terms)."""
    params = rank_params(spec, stage, n_stages, t)
    numels = [_numel(s) for _, s in params]
    start, stop = split_layers(spec.n_layer, n_stages)[stage]
    per_layer = dict.fromkeys(range(start, stop), 0)  # each layer's elements, one pass over the names
    for (name, _), n in zip(params, numels):
        k = _layer_of(name)
        if k in per_layer:
            per_layer[k] += n
    # GaLore's matrices are the blocks' (attention and MLP), the same per block: a stage's are its blocks'
    # (a tensor-parallel rank's slices are no GaLore matrices: refusal.Refusal.GALORE_TP)
    per = len(spec.galore_shapes) // max(spec.n_layer, 1)
    galore = list(spec.galore_shapes[start * per:stop * per]) if t == 1 else []
    return dataclasses.replace(spec, n_params=sum(numels), param_numels=numels, param_shapes=[s for _, s in params],
                               param_names=[n for n, _ in params], n_layer=stop - start,
                               layer_params=max(per_layer.values(), default=0), galore_shapes=galore, linears=[])


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def tp_layer_bytes(w, marks, t: int, sp: bool = False) -> int:
    """One layer's saved bytes on one tensor-parallel rank, from the single-device walk's record of the last
    block: what is per head or per MLP feature divided by t, the rest (norm inputs and statistics, the
    residual stream, residual dropout masks) replicated, or divided by t too with sequence parallelism."""
    if len(marks) < 2:
        return 0
    lo, hi = marks[-2], marks[-1]
    total, pos = 0.0, 0
    for root in w.saved.values():  # in the order saved
        if lo <= pos < hi:
            share = root.tp or TPShare.STREAM
            total += root.nbytes / (t if share is TPShare.HEADS or (share is TPShare.STREAM and sp) else 1)
        pos += root.nbytes
    return int(round(total))


def llama_tp_rank(r, spec):
    """The Recipe of one tensor-parallel rank of transformers' Llama, as one device runs it: a Llama with 1/t
    of the query heads, of the key/value heads (GQA's groups whole) and of the MLP features, the same width,
    head size, embeddings, norms and head (labkit.distributed.tensor_parallel.LlamaTP). The collectives add
    no bytes: copy_to_tp's backward and reduce_from_tp's forward all-reduce in place, so one device's walk of
    that Llama (its replays, checkpointing and all) is the rank's (measured within 0.05 % per category)."""
    hd = spec.head_dim or spec.hidden // spec.n_head
    narrow = {"num_attention_heads": spec.n_head // r.tp, "num_key_value_heads": spec.n_kv_head // r.tp,
              "intermediate_size": spec.ffn // r.tp, "head_dim": hd}
    return r.replace(tp=1, sequence_parallel=False, overrides=tuple({**r.config, **narrow}.items()))


# ---- the per-rank estimate -----------------------------------------------------------------------------------------
def estimate_ranks(recipe) -> list[Estimate]:
    """One Estimate per rank of a tp x pp layout, in the order (stage 0: tp ranks 0..t-1, stage 1, ...): the
    single-device step's moments with each rank's share of the terms, and the activations of the other
    micro-batches the schedule keeps in flight on that stage. With dp > 1 each of those ranks is one of dp
    replicas (labkit.distributed.mesh): it takes batch / dp rows, and with zero=1 keeps 1/dp of its
    optimizer state (ZeRO-1 over the ranks holding the same part, as Megatron-LM's distributed optimizer);
    the dp replicas of a part hold the same bytes, so one Estimate stands for each part."""
    r = recipe
    if r.zero >= 2 and r.pp > 1:
        raise Refused(Refusal.ZERO_SHARDED_GRADIENTS_PP,
                      f"ZeRO-{r.zero} with pipeline parallelism: a stage's gradients accumulate over its "
                      f"micro-batches, so they cannot be sharded as each is made (DeepSpeed refuses it too); "
                      f"use zero=1 with pp")
    if r.zero >= 2:
        raise Refused(Refusal.ZERO_SHARDED_GRADIENTS_TP, f"ZeRO-{r.zero} beside tensor parallelism is not "
                      "estimated yet: use zero=0 or 1 with tp")
    if r.zero_offload:
        raise Refused(Refusal.ZERO_OFFLOAD_LAYOUT,
                      "zero_offload beside tensor or pipeline parallelism is not "
                      "estimated yet")
    if r.optimizer.startswith("galore") and r.tp > 1:
        raise Refused(Refusal.GALORE_TP, "GaLore beside tensor parallelism: GaLore projects each weight's "
                      "whole gradient matrix on its top singular vectors, and a tensor-parallel rank holds "
                      "a slice of its columns or rows (the SVD of a slice is not a slice of the SVD)")
    if r.zero and r.optimizer != "adamw":
        raise Refused(Refusal.ZERO1_LAYOUT_OPTIMIZER, "ZeRO-1 beside tensor or pipeline parallelism runs "
                      "labkit's Zero with AdamW; other optimizers are not estimated there yet")
    if r.paged_states and r.zero:
        raise Refused(Refusal.PAGED_SHARDED, "paged_states beside ZeRO-1 over tensor or pipeline ranks is not "
                      "estimated yet (without ZeRO it is)")
    if r.optimizer_offload and r.zero:
        raise Refused(Refusal.OPTIMIZER_OFFLOAD_ZERO1_LAYOUT,
                      "optimizer_offload beside ZeRO-1: labkit's Zero "
                      "steps its shards with its own AdamW; OffloadAdamW would step the full parameters "
                      "(zero_offload offloads the shards' state, not estimated in a tp/pp layout)")
    llama_tp = r.tp > 1 and spec_from(r.model, **r.config).family == "llama"  # llama_tp_rank: one device's
    if r.offload_activations and ((r.tp > 1 and not llama_tp) or r.checkpoint != "none" or r.lora_rank):
        raise Refused(Refusal.ACTIVATION_OFFLOAD_LAYOUT, "offload_activations in a tp/pp layout: pipeline "
                      "stages of full training offload their saved tensors (estimated); with "
                      "checkpointing, LoRA or tensor parallelism they are not measured here yet")
    if (r.lisa_layers or r.step_in_backward) and not llama_tp:
        raise Refused(Refusal.LAYOUT_TECHNIQUE, "LISA and step in backward are estimated on Llama's "
                      "tensor-parallel ranks, not yet on pipeline stages or labkit GPT's tensor-parallel ranks")
    if r.lora_rank and ((r.tp > 1 and not llama_tp) or (r.quant != "none" and r.tp > 1) or r.zero):
        raise Refused(Refusal.LORA_LAYOUT, "LoRA in a tp/pp layout: estimated on pipeline stages "
                      "(labkit.distributed.pipeline; over a quantized base too) and on Llama's "
                      "tensor-parallel ranks (tensor_parallel.LoRAColumnParallel, LoRARowParallel), without "
                      "ZeRO; a quantized base on tensor-parallel ranks, ZeRO, and LoRA on labkit GPT's "
                      "tensor-parallel ranks are not estimated yet")
    spec = spec_from(r.model, **r.config)
    if r.offload_activations and (spec.dropout or spec.attn_dropout):
        raise Refused(Refusal.ACTIVATION_OFFLOAD_DROPOUT_PP,
                      "offload_activations in a pipeline with dropout: "
                      "measured 5 % off per category (stage 0's temporaries, and one (r, h) activation "
                      "more), not yet explained; give dropout=0")
    if r.checkpoint != "none" and ((r.tp > 1 and not llama_tp) or r.segments not in (None, spec.n_layer)):
        raise Refused(Refusal.CHECKPOINT_LAYOUT, "checkpointing in a tp/pp layout: estimated on pipeline "
                      "stages, each checkpointing its own blocks by the policy (full, selective, or sqrt "
                      "over the stage's blocks; segments=None); a tensor-parallel rank's checkpointed blocks "
                      "are not estimated yet")
    if spec.family not in ("labkit-gpt", "llama") and r.tp > 1:
        raise Refused(Refusal.TP_FAMILY, "tensor-parallel ranks are measured and estimated for labkit's GPT "
                      "and transformers' Llama (labkit.distributed.tensor_parallel), not yet for a "
                      f"{spec.family} model")
    from labkit.distributed.tensor_parallel import check_tp

    check_tp(spec.n_head, spec.hidden, r.tp, r.seq, r.sequence_parallel)
    if spec.family == "llama" and r.tp > 1:
        if r.sequence_parallel:
            raise Refused(Refusal.TP_FAMILY, "sequence parallelism is measured and estimated for labkit's GPT "
                          "(labkit.distributed.tensor_parallel.TPGPT), not for a llama model")
        if spec.n_kv_head % r.tp or spec.ffn % r.tp:
            raise ValueError(f"tensor parallel: {spec.n_kv_head} key/value heads and {spec.ffn} MLP features "
                             f"must divide over t={r.tp} ranks")
        if r.pp > 1:
            raise Refused(Refusal.TP_FAMILY, "pipeline stages are built for labkit's GPT and transformers' "
                          "GPT-2 (labkit.distributed.pipeline), not yet for a llama model")
        rank = llama_tp_rank(r, spec)
        e = zero_terms.data_parallel_estimate(rank) if r.dp > 1 else predict.single_estimate(rank)
        return [dataclasses.replace(e, label=f"{e.label} (a tp={r.tp} rank of {spec.name}): tp rank {k}")
                for k in range(r.tp)]
    split_layers(spec.n_layer, r.pp)
    prec = predict.Precision.of(r.dtype)
    micro, rows = r.micro, r.rank_batch
    m = rows // micro
    foreach = (r.device == "cuda") if r.foreach is None else r.foreach
    peft = peft_terms.of_recipe(spec, r)
    full, w = predict.step_bytes(spec, r, peft)
    _, marks = predict.walk_activations(spec, prec, micro, r.seq, r.device)
    # what trains: every parameter, or LoRA's adapters (no tied copy: the embedding is frozen)
    trains = None if peft is None else dataclasses.replace(peft_terms.trainable_spec(spec, peft), tied=False)
    fb = predict._frozen_bytes(r)  # bytes of a frozen base's weight (LoRA)
    t, sp, p = r.tp, r.sequence_parallel, r.pp
    d, mm = prec.weight, w.mm_bytes
    rh = micro * r.seq * spec.hidden
    out = []
    for s in range(p):
        first, last = s == 0, s == p - 1
        rs = rank_spec(spec, s, p, t)
        rt = rs if trains is None else rank_spec(trains, s, p, t)  # this rank's trained parameters
        n_blocks = rs.n_layer
        b = dataclasses.replace(full)
        b.P = rs.n_params * d if trains is None else rs.n_params * fb + rt.n_params * d
        if peft is not None and peft.quant != "none":  # QLoRA: the stage's quantized Linears leave the
            # parameters for buffers (codes and statistics); the others (embeddings, norms, head) stay
            lo, hi = split_layers(spec.n_layer, p)[s]
            on_stage = lambda lin: (k := _layer_of(lin[0])) is not None and lo <= k < hi  # noqa: E731
            mine = dataclasses.replace(peft, **{f: tuple(filter(on_stage, getattr(peft, f)))
                                                for f in ("targets", "frozen_quant")})
            b.P -= peft_terms.quantized_weights(spec, mine) * fb
            b.buffers = peft_terms.base_buffer_bytes(spec, mine)
        b.G = rt.n_params * d
        b.O = predict.optimizer_state_bytes(rt, prec, r.optimizer, r.rank, r.proj_dtype)
        b.opt_temp = predict.optimizer_temp_bytes(rt, prec, r.optimizer, foreach, r.rank, False, r.proj_dtype)
        if r.optimizer_offload:  # OffloadAdamW: the stage's state and its step's work in host memory
            b.O = b.opt_temp = b.opt_cast = 0
        unified = 0
        if r.paged_states:  # the rank's states in CUDA unified memory, outside the allocator's peak; the
            unified, b.O = b.O, 0  # step's temporaries stay on the device (as predict.single_estimate)
        b.C = (predict.autocast_copy_bytes(dataclasses.replace(rs, matmul_params=_matmul(rs, spec)), prec)
               if trains is None else n_blocks * full.layer_copy + (full.head_copy if last else 0))
        b.states = {}
        b.layer = tp_layer_bytes(w, marks, t, sp) if t > 1 else full.layer
        b.layer_grad = rt.layer_params * d
        # a stage's blocks run their ops as on one device: their replays (a tensor-parallel rank's ops are
        # split, so it takes the per-block bytes instead); only the last stage has the final norm
        start, stop = split_layers(spec.n_layer, p)[s]
        b.replays = full.replays[start:stop] if t == 1 else []
        if b.replays and not last:  # its output's gradient is received, and held until backward returns
            b.replays[-1] = tape.replay_held(w.tape, stop - 1)
        b.tail = full.tail if last and t == 1 else None
        if p > 1:  # a tied matrix's two parts are on two stages: no gradient waits for the other's part here
            b.head_held = 0
        if t > 1:
            b.tau, b.tau_grad = full.tau // t, full.tau_grad // t
            b.stream = rh * d // (t if sp else 1)
        b.inputs = (rows * r.seq * 8 if first else 0) + (rows * r.seq * 8 if last else 0)
        if not first:
            b.before, b.emb_temp, b.emb_dense = 0, 0, 0
        if not last:
            # the stage's output (the root of its backward); no head, so no output-matrix gradient either
            b.after, b.lsm, b.logits, b.head_grad, b.head_new = rh * mm, 0, 0, 0, 0
            b.head_temp = rh * mm  # the gradient received for it
            b.head_copy = 0
        elif not first and spec.tied:
            b.emb_temp = 0  # the head's copy gets its gradient in place of the embedding's
        if first and not last and spec.tied:
            # the first micro-batch's dense embedding gradient becomes .grad itself (AccumulateGrad takes it, and
            # "gradients" counts it): no head's part to sum with on this stage, nothing beside it
            b.emb_temp = 0
        # one micro-batch's activations on this stage: what its blocks save, or the checkpointed blocks' inputs
        sizes = segments_of(n_blocks, r.checkpoint, None)  # the policy over this stage's blocks
        inputs = checkpoint_held(b, r.checkpoint, False, sizes, len(sizes))
        held = (sum(x.bytes for x in inputs)
                if r.checkpoint != "none" else n_blocks * b.layer if trains is None
                else sum(block_saved(b, k) for k in range(n_blocks)))  # LoRA: blocks save unlike
        # offloaded: the saved tensors on the host, but the pipeline holds each micro-batch's received input
        # and its output (the root of its backward) on the device until that micro-batch's backward
        a_s = ((0 if first else rh * w.x_bytes) + (0 if last else b.after) if r.offload_activations
               else b.before + held + b.after)
        acts = _actions(r.schedule if p > 1 else "gpipe", m, p, s) if p > 1 else None
        k_first, k_later = _others_in_flight(acts) if acts else (0, 0)
        root = 0 if last else rh * mm  # a non-last stage's output: the root of its backward, held through it
        # and the gradient it received for that output, held as long (the last block's replay counts it)
        received = (0, -1) if last else (rh * w.x_bytes, n_blocks - 1)
        off = r.offload_activations
        moments = _with_extra(step_moments(b, n_blocks, r.checkpoint, offload=off), k_first, a_s, r.schedule, root,
                              received=received)
        if m > 1:
            # a later stage sends each micro-batch's input gradient back with isend: the earlier one's lives
            # until this backward's send waits for it, through this forward too where a backward ran before it
            # one stage (tp only): each micro-batch's forward follows the one before's backward
            interleaved = _backward_before_forward(acts) if acts else True
            sending = (0 if first else rh * w.x_bytes, bool(acts) and interleaved)
            later = step_moments(b, n_blocks, r.checkpoint, offload=off, grads_exist=True, tag="micro-batch 2 on")
            if not interleaved:  # every forward of the stage runs before its first backward: no gradient yet
                fresh = step_moments(b, n_blocks, r.checkpoint, offload=off, tag="micro-batch 2 on")
                later = [x for x in fresh if x.phase == "forward"] + [x for x in later if x.phase != "forward"]
            moments += [dataclasses.replace(x, micro=2) for x in _with_extra(later, k_later, a_s, r.schedule, root,
                                                                             sending, received)]
        if off and not first:  # the micro-batch's own received input: the pipeline holds it, its saved copy
            held_in = custom(K.BLOCK_INPUT, "this micro-batch's input, received and held by the pipeline (its saved "
                             "copy offloaded)", Category.ACT, rh * w.x_bytes, "r x h x d",
                             "labkit.distributed.pipeline keeps each received input until its backward")
            moments = [dataclasses.replace(x, terms=[*x.terms, held_in]) if x.phase != "optimizer" else x
                       for x in moments]
        label = (f"{spec.name} B={r.batch} S={r.seq} {r.dtype} {r.optimizer} tp={t}{' sp' if sp else ''} pp={p}"
                 f"{' ' + r.schedule if p > 1 else ''} m={m}: stage {s}")
        terms = [Term("parameters", Category.PARAM, b.P, f"{rs.n_params:,} x {d} B (this rank's share)",
                      "Shoeybi et al. 2019; Narayanan et al. 2021", key=K.PARAMETERS),
                 Term("gradients", Category.GRAD, b.G, f"{rs.n_params:,} x {d} B", "", key=K.GRADIENTS),
                 Term("optimizer state", Category.OPT, b.O, "per optimizer on this rank's parameters", "",
                      key=K.OPTIMIZER_STATE),
                 Term("activations of one micro-batch on this stage", Category.ACT, a_s,
                      f"{'before + ' if first else ''}{n_blocks} x "
                      f"{'block input' if r.checkpoint != 'none' else 'layer'} + {'after' if last else 'output'}",
                      "Korthikanti et al. 2022 per layer", key=K.SAVED_ACTIVATIONS)]
        if r.dp > 1:
            label += f" dp={r.dp}" + (f" zero={r.zero}" if r.zero else "")
        label += " paged_states" * r.paged_states
        if r.zero:
            lay = zero_terms.rank_layout(rs, d, r.zero, r.dp, r.optimizer)
            moments = zero_terms.rank_moments(moments, lay, r.optimizer, n_blocks)
            terms = [t_ for t_ in terms if t_.category is not Category.OPT] + [
                Term("optimizer state shards", Category.OPT, lay.opt(), f"ZeRO-1 over dp={r.dp}",
                     zero_terms.SOURCE, key=K.OPTIMIZER_STATE)]
            terms[0] = Term("parameters", Category.PARAM, lay.params(), f"the part's flat buffers, padded to dp",
                            zero_terms.SOURCE, key=K.PARAMETERS)
        names = [label + (f" tp rank {k}" if t > 1 else "") for k in range(t)]
        est = [keyed.attach(Estimate(n, rs.n_params, terms=terms, moments=moments, unified=unified), r, stage=s)
               for n in names]
        out += est
    return out


def _matmul(rs, spec) -> int:
    """Parameters of the rank that enter a matmul (autocast copies them): the blocks' Linears and the head, by
    the model's own list of Linears (spec.linears: GPT-2's c_attn..., Llama's q_proj... gate_proj...)."""
    linears = {name for name, *_ in spec.linears} | {"lm_head"}
    return sum(_numel(s) for n, s in zip(rs.param_names, rs.param_shapes)
               if n.split(" ")[0].rsplit(".", 1)[0] in linears)


def _actions(schedule: str, m: int, p: int, s: int):
    from labkit.distributed.pipeline import schedule as sched

    return sched(schedule, m, p, s)


def _others_in_flight(actions) -> tuple[int, int]:
    """Micro-batches held besides the one in backward: at the first backward, and at worst at a later one."""
    live, first, later, seen = 0, 0, 0, 0
    for kind, _ in actions:
        if kind == "B":
            if seen == 0:
                first = live - 1
            else:
                later = max(later, live - 1)
            seen += 1
            live -= 1
        else:
            live += 1
    return first, later


def _backward_before_forward(actions) -> bool:
    """Whether a stage's schedule runs a backward before its last forward (1F1B's steady state; not GPipe)."""
    kinds = [kind for kind, _ in actions]
    return "B" in kinds and kinds.index("B") < len(kinds) - 1 - kinds[::-1].index("F")


def _with_extra(moments, k: int, a_s: int, schedule: str, root: int = 0, sending: tuple = (0, False),
                received: tuple = (0, -1)):
    """The moments of one micro-batch with the activations of k others in flight added (forward and backward),
    and, inside the blocks' and embedding's backward, the stage's output (`root` bytes) that backward started from;
    sending: (bytes of the earlier micro-batch's input gradient an isend holds, whether in forward too);
    received: (bytes of the gradient received for the stage's output, held until backward returns; the block
    whose replay counts it already)."""
    extra = [custom(K.IN_FLIGHT,
                    f"activations of {k} other micro-batch(es) in flight ({schedule})", Category.ACT, k * a_s,
                    f"{k} x the stage's activations per micro-batch",
                    "GPipe keeps all m; 1F1B at most p - s (Narayanan et al. 2021)")] if k > 0 else []
    held = [custom(K.IN_FLIGHT, "the stage's output, root of this backward", Category.ACT, root, "r x h x bytes",
                   "torch.autograd.backward(output, grad) holds the output until it returns")] if root else []
    sent = [custom(K.COMM_BUFFERS, "the earlier micro-batch's input gradient, held by its send",
                   Category.TEMP, sending[0], "r x h x d", "labkit.distributed.pipeline: isend(x.grad), waited "
                   "at the next backward's send")] if sending[0] else []
    got = [custom(K.COMM_BUFFERS, "the gradient received for the stage's output, held until backward returns",
                  Category.TEMP, received[0], "r x h x d", "labkit.distributed.pipeline: recv(grad), then "
                  "torch.autograd.backward(out, grad)")] if received[0] else []
    out = []
    for mo in moments:
        if mo.phase == "optimizer":
            out.append(mo)
            continue
        inner = mo.phase == "backward" and mo.kind not in (MomentKind.LOSS_BACKWARD, MomentKind.HEAD_BACKWARD,
                                                                   MomentKind.HEAD_AFTER)
        sending_now = sent if mo.phase == "backward" or sending[1] else []
        got_now = got if inner and mo.block != received[1] else []
        out.append(dataclasses.replace(mo, terms=[*mo.terms, *extra, *(held if inner else []), *sending_now,
                                                  *got_now]))
    return out


def layout_wire_bytes(recipe) -> dict[str, float]:
    """Bytes each rank sends per step, by the collectives' definitions (labkit.distributed.comms.wire_bytes):
    pipeline: each micro-batch's activation forward and its gradient back across each stage boundary, plus the tied embedding's gradient all-reduce between the first and last
    stage; tensor parallel: 4 all-reduces of a (b, s, h) activation per layer (2 forward, 2 backward), or
    with sequence parallelism the same in all-gathers and reduce-scatters plus 2 all-gathers backward."""
    r = recipe
    spec = spec_from(r.model, **r.config)
    d = predict.Precision.of(r.dtype)
    e = 2 if d.autocast else d.weight  # a matmul's output (TP's all-reduces): 16 bits under autocast
    m = r.rank_batch // r.micro
    act = r.micro * r.seq * spec.hidden * e
    out = {}
    if r.pp > 1:  # a block's output is the residual stream, in the weights' dtype (fp32 under autocast), as the
        # walk keeps it (Walk.x_bytes)
        out["pipeline: each stage boundary, each way (m activations forward, m gradients back)"] = (
            m * r.micro * r.seq * spec.hidden * d.weight)
        if spec.tied:
            out["pipeline: tied embedding gradient all-reduce (first and last stage)"] = spec.vocab * spec.hidden * d.weight
    if r.dp > 1:  # each part's gradients over its dp replicas: an all-reduce, or ZeRO-1's reduce-scatter of the
        # gradients and all-gather of the updated parameters (the same 2 (N - 1)/N bytes)
        from labkit.distributed.comms import wire_bytes

        n = max(rank_spec(spec, s, r.pp, r.tp).n_params for s in range(r.pp))
        out[f"data parallel: the largest part's gradients over dp={r.dp} replicas"] = wire_bytes(
            "all_reduce", n * d.weight, r.dp)
    if r.tp > 1:
        t = r.tp
        layers = split_layers(spec.n_layer, r.pp)[0]
        n = layers[1] - layers[0]
        ring = (t - 1) / t * act * m
        out["tensor parallel: per layer"] = (8 if not r.sequence_parallel else 10) * ring
        out["tensor parallel: stage 0's layers"] = n * out["tensor parallel: per layer"]
    return out
