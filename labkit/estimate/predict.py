"""Predict the bytes of one training step, by category and phase, from formulas with named sources.

Peak memory is the largest of the phases' peaks (end of forward, during backward, optimizer step),
never their sum. Every term is a small function whose docstring gives its formula and source.
"""

from __future__ import annotations

import dataclasses

import re

from labkit.estimate.refusal import Refused, Refusal
from .families import WALKS
from . import optim_terms, peft_terms, textbook
from .moments import step_moments
from .step_bytes import StepBytes
from .recipe import DTYPES, OPTIMIZERS, POLICIES, STEP_AND_OFFLOAD, Recipe  # noqa: F401 (re-exported)
from labkit.memory.report import Category, Estimate, Term, TermKey as K
from .spec import ModelSpec, spec_from
from .textbook import Precision
from .tape import Tape, keep_kinds, replay_blocks, replay_tail
from .walk import Walk

_BLOCK = re.compile(r"\.\d+\.")  # a module inside the block list (its index in the name)



# ---- model states ------------------------------------------------------------------------------
def param_bytes(spec: ModelSpec, prec: Precision) -> int:
    """N x bytes per weight: 4 in fp32 and in mixed precision (the fp32 master copy is the model's own
    weights), 2 in pure fp16/bf16. Source: every predictor (ZeRO, Rajbhandari et al. 2020, section 3.1; the
    Hugging Face docs' model-memory anatomy)."""
    return textbook.param_bytes(spec.n_params, prec.weight)


def autocast_copy_bytes(spec: ModelSpec, prec: Precision) -> int:
    """2 x (parameters that enter a matmul): autocast casts each Linear weight and bias to 16-bit
    once per forward and the matmul keeps the copy until backward. This is the '2 bytes of fp16
    weights' of the 18 bytes/parameter in the Hugging Face docs (transformers' "Model training anatomy")."""
    return textbook.copy16_bytes(spec.matmul_params) if prec.autocast else 0


def grad_bytes(spec: ModelSpec, prec: Precision) -> int:
    """N x bytes per weight: gradients take the parameters' dtype, so fp32 under mixed precision
    (4N, the term Playbook discussion #104 says is missing from 16N; ml-engineering #23)."""
    return textbook.grad_bytes(spec.n_params, prec.weight)


def optimizer_state_bytes(spec: ModelSpec, prec: Precision, optimizer: str, rank: int | None = None,
                          proj_dtype: str | None = None) -> int:
    """k x N x bytes per weight + 4 bytes of step counter per tensor for Adam.
    k = 0 (SGD), 1 (momentum buffer), 2 (Adam's m and v). torch.optim keeps state in the
    parameters' dtype: 8N for fp32 Adam (12N with the master copy, as ZeRO's K = 12 counts).
    8-bit Adam, Lion, Adafactor and GaLore: see labkit.estimate.optim_terms."""
    return optim_terms.state_bytes(spec, prec.weight, optimizer, rank, proj_dtype)


def optimizer_temp_bytes(spec: ModelSpec, prec: Precision, optimizer: str, foreach: bool,
                         rank: int | None = None, refresh: bool = False, proj_dtype: str | None = None) -> int:
    """Adam's step makes sqrt(v) and sqrt(v)/c before adding eps in place: 2 temporaries the size of a
    parameter one tensor at a time, beside the previous tensor's quotient (torch.optim single-tensor path,
    CPU default), or sqrt(v) of all parameters at once in the foreach path (CUDA default). SGD works in
    place. labkit.optim's steps also copy a 16-bit parameter and its gradient to fp32 (the copy of the
    parameter is PARAM: optim_terms.cast_bytes). Every rule, GaLore's refresh step included:
    labkit.estimate.optim_terms.temp_bytes."""
    return optim_terms.temp_bytes(spec, prec.weight, optimizer, foreach, rank, refresh, proj_dtype)


# ---- activations -------------------------------------------------------------------------------
def input_bytes(batch: int, seq: int) -> int:
    """Token ids and targets (int64), the two windows of a (B, S + 1) sample (labkit.run.step._measure):
    for B > 1 each window's .contiguous() is a copy, 2 x B x S x 8 bytes; one row's windows are contiguous
    already, views of the sample, (S + 1) x 8 bytes."""
    return (seq + 1) * 8 if batch == 1 else 2 * batch * seq * 8


def walk_activations(spec: ModelSpec, prec: Precision, batch: int, seq: int, device: str, peft=None,
                     selective: str = "matmuls", base_bytes: int | None = None,
                     loss_chunks: int | None = None):
    """Bytes saved for backward by the forward walk of the model's family (labkit.estimate.families):
    per layer this reproduces Korthikanti et al.'s sbh(34 + 5as/h) for their layer and precision,
    and adds the logits' log-softmax, B x S x V (4 bytes when the loss runs in fp32).
    peft (labkit.estimate.peft_terms.Peft): frozen weights save less, adapters save a little more.
    selective: the selective checkpointing policy whose kept outputs the tape marks
    (labkit.estimate.tape.keep_kinds). base_bytes: a frozen base's bytes per weight, when they differ from
    the trained parameters' (a 16-bit base under fp32 adapters): the stream then runs in the base's dtype.
    loss_chunks: the head and the loss in chunks along the sequence
    (families.output_chunks_loss)."""
    key = (repr(spec), prec, batch, seq, device, repr(peft), selective, base_bytes, loss_chunks)
    if key in _WALKS:  # the planner asks for the same walk of an 80-layer model dozens of times
        _WALKS[key] = _WALKS.pop(key)  # most recently used last
        return _WALKS[key]
    w = Walk(x_bytes=base_bytes or prec.weight, train_bytes=prec.weight, autocast=prec.autocast, device=device,
             linears={name: (d_in, d_out, bias) for name, d_in, d_out, bias in spec.linears},
             tape=Tape(kinds=keep_kinds(selective)), loss_chunks=loss_chunks)
    peft_terms.setup_walk(w, peft)
    marks: list[int] = []
    WALKS[spec.family](w, spec, batch, seq, marks)
    w.freeze()  # read-only from here: the moments, replays and layouts share it
    marks = tuple(marks)
    _WALKS[key] = (w, marks)
    while len(_WALKS) > 32:
        _WALKS.pop(next(iter(_WALKS)))
    return w, marks


_WALKS: dict = {}  # walk_activations' last 32 walks, by everything that shapes one


def single_estimate(r: Recipe, ready: bool = False, reduced: bool = False) -> Estimate:
    """The Estimate of a recipe on one device (labkit.estimate.estimator.estimate's docstring says what each
    field does; its data, tensor and pipeline parallel layouts are built from this one). ready: with each
    block's moment when its last parameter gradient is made (ZeRO-2's reduce, labkit.estimate.zero_terms).
    reduced: each micro-batch's gradients leave .grad in its backward (ZeRO-2/3 reduce-scatter them into
    shards), so a later micro-batch makes them afresh, as the first does."""
    if r.tp > 1 or r.pp > 1 or r.dp > 1 or r.zero:
        raise ValueError("single_estimate takes a single-device recipe: use labkit.estimate.estimate")
    model, batch, seq, dtype, optimizer, device = r.model, r.batch, r.seq, r.dtype, r.optimizer, r.device
    checkpoint, segments, offload_activations, micro = r.checkpoint, r.segments, r.offload_activations, r.micro
    rank, optimizer_offload, step_in_backward = r.rank, r.optimizer_offload, r.step_in_backward
    overrides = r.config
    prec = Precision.of(dtype)
    spec = spec_from(model, **overrides)
    peft = peft_terms.of_recipe(spec, r)
    if peft is not None:
        _check_peft_options(peft, optimizer, optimizer_offload, step_in_backward)
    if optimizer.startswith("galore") and spec.galore_shapes and rank > min(min(s) for s in spec.galore_shapes):
        raise ValueError(f"rank {rank} exceeds the smaller side of a GaLore matrix "
                         f"({min(min(s) for s in spec.galore_shapes)})")
    if spec.loss_chunk is not None and step_in_backward:
        raise Refused(Refusal.GPT_LOSS_CHUNK_STEP,
                      "step_in_backward with the chunked loss (GPTConfig.loss_chunk) is not modelled yet: "
                      "drop one of them")
    if spec.max_positions and seq > spec.max_positions:
        raise ValueError(f"seq {seq} exceeds the model's {spec.max_positions} positions")
    b, w = step_bytes(spec, r, peft)
    if optimizer_offload:  # state and the step's work live in host memory
        b.O = b.opt_temp = b.opt_cast = 0
    unified = 0
    if r.paged_states:  # the states live in CUDA unified memory, outside the allocator's peak;
        unified, b.O = b.O, 0  # the step's temporaries stay on the device (Estimate.unified)
    terms = _terms(spec, prec, optimizer, micro, seq, w, b, peft, _frozen_bytes(r))
    b.states = _state_groups(_model_state_terms(spec, prec, optimizer, b, peft, _frozen_bytes(r)))
    moments = step_moments(b, spec.n_layer, checkpoint, segments, offload_activations, step_in_backward=step_in_backward,
                           ready=ready)
    if micro < batch:  # later micro-batches: every gradient already exists (or, reduced, went to the shards)
        moments += [dataclasses.replace(m, micro=2) for m in step_moments(
            b, spec.n_layer, checkpoint, segments, offload_activations, grads_exist=not reduced,
            tag="micro-batch 2 on", ready=ready)]
    extras = [f"checkpoint={checkpoint}"] * (checkpoint != "none") + ["offload"] * offload_activations
    extras += [f"selective_policy={r.selective_policy}"] * (r.selective_policy != "matmuls")
    extras += [f"micro_batch={micro}"] * (micro < batch) + [f"rank={rank}"] * optimizer.startswith("galore")
    extras += [f"proj_dtype={r.proj_dtype}"] * (r.proj_dtype is not None)
    extras += [f"optimizer_offload={optimizer_offload}"] * bool(optimizer_offload)
    extras += ["step_in_backward"] * step_in_backward + ["paged_states"] * r.paged_states
    extras += [f"attention=tiled({spec.attn_block})"] * (spec.attention == "tiled")
    extras += [f"loss_chunk={spec.loss_chunk}"] * (spec.loss_chunk is not None)
    extras += [f"loss_chunks={r.loss_chunks}"] * (r.loss_chunks is not None)
    if peft is not None:
        extras += [f"base_dtype={r.base_dtype}"] * (r.base_dtype is not None)
        extras.append(f"LISA layers={peft.lisa_layers}" if peft.lisa_layers else
                      f"{peft.method} r={peft.rank} targets={len(peft.targets)}")
        if peft.quant != "none":  # which convention's quantized set (Recipe.quant_set)
            extras.append(f"[{peft_terms.QUANT_SET_NAMES[peft.quant_set]}]")
    label = " ".join([f"{spec.name} B={batch} S={seq} {dtype} {optimizer}", *extras])
    return Estimate(label, spec.n_params, terms=terms, moments=moments, unified=unified)


def _check_peft_options(peft, optimizer, optimizer_offload, step_in_backward):
    what = "lisa_layers" if peft.lisa_layers else "lora_rank"
    if optimizer.startswith("galore"):
        raise Refused(Refusal.TWO_STATE_SHRINKERS,
                      f"{what} and GaLore are two ways to shrink the optimizer state: choose one")
    # LoRA and a quantized base step in backward within 0.4 % per category, and LoRA, QLoRA and LISA with
    # the optimizer offloaded within 0.1 % (test_estimate_peft)
    if step_in_backward and peft.lisa_layers:
        raise Refused(Refusal.LISA_STEP_IN_BACKWARD,
                      "lisa_layers with step_in_backward is not estimated yet: over 96 tiny configurations "
                      "measured, AdamW without selective checkpointing is within 0.5 %, but with 8-bit "
                      "states or selective checkpointing the measured peak falls in the optimizer phase, up "
                      "to 27 % above the estimate's; drop one of them")


def step_bytes(spec: ModelSpec, recipe: Recipe, peft=None) -> tuple[StepBytes, Walk]:
    """Every byte count the phases need, from the model states and the forward walk of a micro-batch, for one
    rank's rows of `recipe` (its dtype, optimizer, device, foreach, GaLore rank and proj_dtype, selective policy).
    peft: LoRA/QLoRA/LISA (labkit.estimate.peft_terms): only the trainable parameters get gradients and
    optimizer state; the frozen base stays in parameters (or in int8/NF4 buffers).
    Each block's ops and the final norm's are replayed (labkit.estimate.tape) for the moments inside them."""
    prec, B, micro, S, optimizer, rank, proj_dtype = (Precision.of(recipe.dtype), recipe.rank_batch, recipe.micro,
                                                      recipe.seq, recipe.optimizer, recipe.rank, recipe.proj_dtype)
    foreach = (recipe.device == "cuda") if recipe.foreach is None else recipe.foreach
    fb = _frozen_bytes(recipe)  # a frozen base's bytes per weight (2 for a 16-bit base under LoRA)
    w, marks = walk_activations(spec, prec, micro, S, recipe.device, peft, recipe.selective_policy, fb,
                                recipe.loss_chunks)
    r, h, V, gb, mm = micro * S, spec.hidden, spec.vocab, prec.weight, w.mm_bytes
    chunked = w.loss_scratch is not None  # labkit GPT's chunked loss: no (r, V) tensor outlives a chunk
    lsm = 0 if chunked else w.log_softmax.nbytes
    upcast = r * V * 4 if not chunked and lsm // (r * V) != mm else 0  # the fp32 copy the loss makes
    L = max(spec.n_layer, 1)
    layer = (marks[-1] - marks[0]) // L
    ts = spec if peft is None else peft_terms.trainable_spec(spec, peft)  # what trains
    head_trains, emb_trains = w.trains("lm_head"), w.trains("wte")
    head_grad = (V * h + 2 * h) * gb if head_trains else 0  # the output matrix (and final norm)
    units = optim_terms.step_in_backward_units(ts, gb, optimizer, foreach, rank, proj_dtype)
    # the chunked loss casts the head itself; a frozen 16-bit head needs no copy
    # a trained head's copy is cached once; a frozen head's is saved by each matmul that reads it (one per
    # chunk under Recipe.loss_chunks: Walk.copy_frozen counts them)
    frozen_head = sum(v for k, v in w.copy_frozen.items() if not _BLOCK.search("." + k + "."))
    head_copy = ((2 * V * h if head_trains or not frozen_head else frozen_head)
                 if prec.autocast and not chunked and (w.frozen_copy or head_trains) else 0)
    fields = {}
    if w.output_chunks:  # the chunked output loss (Recipe.loss_chunks)
        fields = _output_chunk_fields(w.output_chunks, r, h, V, mm, w.x_bytes, head_trains,
                                      not prec.autocast and not spec.tied, w.output_chunk_inputs,
                                      head_copy if head_trains else 0)
    if chunked:  # chunked_ce.scratch_bytes: the loss's forward temporaries, and the head's backward ones (less
        # the weight's gradient, head_grad: the fp32 accumulator itself, or its cast for a 16-bit weight)
        fields = dict(logits=w.loss_scratch[0], head_temp=w.loss_scratch[1] - V * h * gb)
    return StepBytes(
        P=param_bytes(spec, prec) if peft is None else _peft_param_bytes(spec, peft, prec.weight, fb),
        # with frozen weights the walk counts autocast's copies (Walk._count_copies)
        C=(autocast_copy_bytes(spec, prec) - (2 * V * h if prec.autocast and chunked else 0)) if peft is None
        else w.copy_bytes, C_unsaved=0 if peft is None else w.copy_unsaved, G=grad_bytes(ts, prec),
        O=optimizer_state_bytes(ts, prec, optimizer, rank, proj_dtype),
        opt_temp=optimizer_temp_bytes(ts, prec, optimizer, foreach, rank, False, proj_dtype),
        opt_cast=optim_terms.cast_bytes(ts, prec.weight, optimizer, foreach, rank),
        **_refresh_fields(ts, prec.weight, optimizer, rank, proj_dtype),
        **units,
        head_held=V * h * gb if spec.tied and head_trains else 0,  # waits for the embedding's part (not the final norm)
        head_freed=(2 * V * h if prec.autocast else 0, r * h * mm, r * V * mm + (V * h * mm if prec.autocast else 0)),
        inputs=input_bytes(B, S), before=marks[0], layer=layer,
        after=w.saved_bytes - marks[-1], lsm=lsm,
        **(fields or dict(logits=r * V * mm + upcast,
                          head_temp=r * V * mm + r * h * mm + (V * h * mm if prec.autocast and head_trains else 0))),
        head_grad=head_grad, head_new=V * h * gb if head_trains else 0, stream=r * h * w.x_bytes,
        **({} if w.output_chunks else
           dict(head_cast=r * h * mm + V * h * mm if head_copy and head_trains else 0)),
        # MLP backward: the gradients into and out of the activation are alive while its output is
        # already freed: +1 (exact GELU) or +2 (GELU/SwiGLU in Python ops) B*S*ffn tensors. Under LoRA
        # one more: a frozen down projection holds no input for that moment to free, and an adapted
        # one adds its adapter's dx to the base's (both B*S*ffn) into a third.
        tau=((1 if spec.family == "labkit-gpt" else 2) + (1 if peft is not None and not peft.lisa_layers else 0))
        * r * spec.ffn * mm,
        tau_grad=spec.ffn * h * mm if peft is None or peft.lisa_layers else ts.largest_param * mm,
        layer_grad=ts.layer_params * gb,
        layer_copy=0 if not prec.autocast else 2 * spec.layer_matmul_params if peft is None
        else max(w.copy_bytes - frozen_head, 0) // L,  # the head's copies (one per loss chunk) are not a layer's
        head_copy=head_copy,
        emb_temp=2 * V * h * gb if spec.tied and emb_trains else 0,  # tied: the dense embedding gradient and the sum
        # with gradients already there (micro-batch 2 on), each embedding table's dense gradient is a temporary
        # until AccumulateGrad adds it in place: the token table (tied or not) and the learned positions
        emb_dense=((V * h if emb_trains else 0)
                   + (spec.max_positions * h if spec.family != "llama" and emb_trains else 0)) * gb,
        replays=replay_blocks(w.tape), tail=replay_tail(w.tape),
        c_frozen_blocks=sum(v for k, v in w.copy_frozen.items() if _BLOCK.search("." + k + ".")),
        c_frozen_head=sum(v for k, v in w.copy_frozen.items() if not _BLOCK.search("." + k + ".")),
        locals_saved=w.locals_saved, final_out=w.final_out, loss_locals=w.loss_locals,
        loss_lse=r * 4 if chunked else 0,
        loss_saved=r * h * w.x_bytes + r * 4 + 8 if chunked else 0, block0_local=w.block0_local,
        block_kwargs=w.block_kwargs,
        buffers=0 if peft is None else peft_terms.base_buffer_bytes(spec, peft),
        forward_extra=w.forward_extra, forward_locals=w.forward_locals,
        dequant=0 if peft is None else peft_terms.dequant_scratch_bytes(peft, 2 if prec.autocast else gb),
    ), w


def _output_chunk_fields(rows: tuple, r: int, h: int, V: int, mm: int, x: int, head_trains: bool,
                         grad_sum: bool, inputs: tuple = (0, False), copy: int = 0) -> dict:
    """The chunked output loss's bytes (labkit.recompute.chunked_output;
    families.output_chunks_loss), rows the rows of each chunk, m = mm the matmul output's bytes, x
    the hidden states' (the stream's) bytes. Forward, at a chunk's loss: every chunk's logits (the
    model returned them: r V m), that chunk's fp32 copy (c V 4, none when m = 4) and the log-softmax
    of the chunks so far (all of them, lsm = r V 4, at the last chunk; `logits` takes off those not
    made yet when an earlier, larger chunk is the worst). Backward runs autograd's nodes latest
    first, and every loss node was made after every head matmul: so the loss's backward of every
    chunk (the last chunk first) runs before any head matmul's. At chunk j's log_softmax backward:
    nll_loss's and log_softmax's gradients (2 c V 4), the log-softmax of the chunks through it
    before freed, their dlogits (c V m each, after the .float() node's cast back) waiting for the
    head. Then each head matmul's backward (the last chunk first): the dlogits not consumed yet, its
    dX (c h m) and, for a trained head, its dW (V h m) beside the sum of the chunks' dW so far in
    autograd's buffer (V h m, from the second chunk on); once the node has returned (its dlogits
    freed) the buffer adds the new dW out of place (a third V h m; the last such sum is the .grad
    itself, `grad_sum`, for an untied head whose dW reaches AccumulateGrad without a cast); the
    chunks' input gradients so far (x bytes each, after autocast's cast node). After the last chunk,
    under autocast, the 16-bit dW sum is cast to fp32 (head_cast: that sum, the first chunk's dX not
    yet cast, the others'); then split's backward concatenates the chunks' input gradients
    (split_cat: 2 r h x). inputs: (bytes the chunks' matmuls save, each chunk's its own copy), the
    Walk's output_chunk_inputs: a chunk's copy is freed when its matmul's node returns, views of one
    tensor after the last (head_inputs_freed: at the head's worst moment; all of them after). copy: a
    trained head's 16-bit weight copy, saved by every chunk's matmul: freed when the last one returns, before
    the buffer's last sum (head_copy_freed)."""
    order = rows[::-1]
    start = (0, 0)
    for j, c in enumerate(order):  # (TEMP, log-softmax freed) at chunk j's log_softmax backward
        done = sum(order[:j])
        t = (2 * c * V * 4 + done * V * mm, done * V * 4)
        if j == 0 or t[0] - t[1] > start[0] - start[1]:
            start = t
    dw = V * h * mm if head_trains else 0
    saved_in, own = inputs

    def freed(done: int) -> int:  # bytes: the chunks' saved inputs gone once `done` rows' nodes returned
        return -(saved_in * done // r if own else saved_in if done == r else 0)

    head = (0, 0, 0, 0)  # (TEMP, GRAD, ACT freed, copy freed) at the head's worst moment
    for j, c in enumerate(order):
        dx = c * h * mm + sum(order[:j]) * h * x
        # inside chunk j's matmul backward
        cands = [(sum(order[j:]) * V * mm + dx + dw * (2 if j else 1), 0, freed(sum(order[:j])), 0)]
        if j and dw:  # its dW summed with the buffer's, out of place (chunk j's node has returned)
            end = j == len(order) - 1
            last = grad_sum and end
            left = sum(order[j + 1:]) * V * mm
            cands.append((left + dx + (2 if last else 3) * dw, dw if last else 0, freed(sum(order[:j + 1])),
                          -copy if end else 0))
        head = max([head, *cands], key=sum)
    c0 = rows[0]
    # the forward's worst chunk k: its fp32 copy (c V 4) beside the log-softmax so far (lsm is all r V 4: the
    # chunks after k have made none yet)
    # (on a tie the later chunk: the earlier chunks' losses, a few bytes each, are alive beside it)
    copy, later = max(((c * V * 4, sum(rows[k + 1:]) * V * 4) for k, c in enumerate(rows)),
                      key=lambda t: (t[0] - t[1], -t[1])) if mm != 4 else (0, 0)
    # under activation offload, at chunk j's loss backward its log-softmax is copied back (c V 4)
    off = max(3 * c * V * 4 + sum(order[:j]) * V * mm for j, c in enumerate(order))
    return dict(logits=r * V * mm + copy, lsm_not_yet=-later, loss_grad=start[0], loss_grad_off=off,
                lsm_chunk=max(rows) * V * 4,
                logits_off=r * V * mm + (max(rows) * V * 4 if mm != 4 else 0),
                lsm_gone=start[1], head_temp=head[0], head_sum=head[1], head_inputs_freed=head[2],
                head_copy_freed=head[3],
                chunk_inputs=saved_in,
                head_cast=dw + c0 * h * mm + (r - c0) * h * x if dw and x != mm else 0,
                split_cat=2 * r * h * x if len(rows) > 1 else 0)


def _refresh_fields(spec, d: int, optimizer: str, rank, proj_dtype) -> dict:
    """GaLore's projector-refresh step: its temporaries and the change of the state (optim_terms.galore_step_split)."""
    if not optimizer.startswith("galore"):
        return {}
    temp, opt = optim_terms.galore_step_split(spec, d, optimizer, rank, True, proj_dtype)
    return {"opt_refresh": temp, "refresh_freed": -opt}


def _frozen_bytes(r: Recipe) -> int:
    """Bytes per frozen base weight: base_dtype's, else the trained weights' (Recipe.frozen_dtype)."""
    return 4 if r.frozen_dtype == "fp32" else 2


def _peft_param_bytes(spec, peft, d: int, fb: int | None = None) -> int:
    """LISA: every parameter, as in full training. LoRA: the parameters left in the base's dtype, fb bytes
    (all but int8/NF4-quantized weights), + the adapters in the trained dtype, d bytes (as apply_lora makes them)."""
    if peft.lisa_layers:
        return spec.n_params * d
    fb = d if fb is None else fb
    return (spec.n_params - peft_terms.quantized_weights(spec, peft)) * fb + peft_terms.adapter_elements(peft) * d


def _model_state_terms(spec, prec, optimizer, b: StepBytes, peft, fb: int | None = None) -> list[Term]:
    d = prec.weight
    fb = d if fb is None else fb  # a frozen base's bytes per weight
    copies = Term("autocast 16-bit weight copies", Category.PARAM, b.C, "2 x matmul parameters" if peft is None else
                  "2 x (trained matmul parameters + frozen weights whose input needs grad + adapters)",
                  "torch.autocast weight cache; autograd saves a frozen weight's copy for dx", key=K.COPIES_16BIT)
    if peft is None:
        return [
            Term("parameters", Category.PARAM, b.P, f"N x {d} B = {spec.n_params:,} x {d}", "all predictors",
                 key=K.PARAMETERS),
            copies,
            Term("gradients", Category.GRAD, b.G, f"N x {d} B", "Playbook #104; ml-engineering #23", key=K.GRADIENTS),
            Term("optimizer state", Category.OPT, b.O, optim_terms.state_formula(optimizer, d),
                 "ZeRO K; HF docs; labkit.optim",
                 key=K.OPTIMIZER_STATE),
        ]
    n_train = peft_terms.trainable_spec(spec, peft).n_params
    state = optim_terms.state_formula(optimizer, d).replace("N", "N_train")
    if peft.lisa_layers:
        return [
            Term("parameters", Category.PARAM, b.P, f"N x {d} B = {spec.n_params:,} x {d}", "all predictors",
                 key=K.PARAMETERS),
            copies,
            Term("LISA active layers: gradients", Category.GRAD, b.G,
                 f"N_train x {d} B, N_train = embeddings, head, final norm + {peft.lisa_layers} layers = {n_train:,}",
                 "Pan et al. 2024; labkit.peft.LISA (frozen layers' grads released)", key=K.GRADIENTS),
            Term("LISA active layers: optimizer state", Category.OPT, b.O, state,
                 "LMFlow #729: state of frozen layers popped", key=K.OPTIMIZER_STATE),
        ]
    n_adapt = peft_terms.adapter_elements(peft)
    frozen = spec.n_params - peft_terms.quantized_weights(spec, peft)
    out = [
        Term("frozen base weights", Category.PARAM, frozen * fb,
             f"{'all N' if peft.quant == 'none' else 'N - quantized weights'} x {fb} B = {frozen:,} x {fb}",
             "labkit.peft.apply_lora freezes every parameter", key=K.FROZEN_BASE),
        Term("LoRA adapters", Category.PARAM, n_adapt * d,
             f"r (d_in + d_out) x {d} B per target, r={peft.rank}, {len(peft.targets)} targets", "Hu et al. 2021",
             key=K.ADAPTERS),
    ]
    if peft.quant != "none":
        formula, source = {
            "nf4": ("n/2 + n/64 + 4 ceil(n/16384) + 4 per weight of n (~0.516 B/weight; labkit.quant.nf4_bytes_for)",
                    "Dettmers et al. 2023 (arXiv 2305.14314), double quantization"),
            "int8": ("n + 4 d_out per weight (int8 codes + fp32 per-row scale; labkit.quant.int8_bytes_for)",
                     "labkit.quant.int8"),
            "int4": (f"n/2 + 3 n/{peft.group} per weight of n (4-bit codes + fp16 scale and uint8 zero per group "
                     f"of {peft.group}; labkit.quant.int4_bytes_for)", "Lin et al. 2024 (arXiv 2306.00978), RTN"),
            "int4-awq": (f"n/2 + 3 n/{peft.group} + 2 d_in per weight of n (int4 + AWQ's fp16 input scale kept in "
                         f"the layer; labkit.quant.int4_bytes_for)", "Lin et al. 2024 (arXiv 2306.00978)"),
        }[peft.quant]
        out.append(Term(f"{peft.quant.upper()} frozen base (buffers)", Category.BUFFER, b.buffers, formula, source,
                        key=K.QUANTIZED_BASE))
    out += [copies,
            Term("adapter gradients", Category.GRAD, b.G, f"N_train x {d} B = {n_train:,} x {d}", "Hu et al. 2021",
                 key=K.GRADIENTS),
            Term("adapter optimizer state", Category.OPT, b.O, state, "labkit.optim / torch.optim over N_train",
                 key=K.OPTIMIZER_STATE)]
    if peft.quant != "none":
        per = peft_terms.dequant_bytes_per_weight(peft.quant, 2 if prec.autocast else d)
        out.append(Term("dequantization scratch", Category.TEMP, b.dequant,
                        f"{per} B x the largest quantized weight, one layer at a time",
                        "labkit.quant.dequantize_nf4 / dequantize_int8 / dequantize_int4",
                        key=K.DEQUANT_SCRATCH))
    return out


def _state_groups(terms: list[Term]) -> dict[str, list[Term]]:
    """The model-state terms by the StepBytes field they make up: P (weights), C (autocast copies), G, O, buffers."""
    key = {Category.GRAD: "G", Category.OPT: "O", Category.BUFFER: "buffers"}
    out: dict[str, list[Term]] = {}
    for t in terms:
        if t.category is Category.PARAM:
            out.setdefault("C" if t.key is K.COPIES_16BIT else "P", []).append(t)
        elif t.category in key:
            out.setdefault(key[t.category], []).append(t)
    return out


def _terms(spec, prec, optimizer, B, S, w, b: StepBytes, peft=None, fb: int | None = None) -> list[Term]:
    scores = sum(t.nbytes for t in w.saved.values() if t.scores)
    blocks = w.saved_bytes - b.lsm - scores
    return [
        *_model_state_terms(spec, prec, optimizer, b, peft, fb),
        Term("activations saved by the blocks", Category.ACT, blocks, "forward walk per layer ~ sbh(34 + ...)",
             "Korthikanti et al. 2022",
             key=K.SAVED_ACTIVATIONS),
        Term("attention scores (s^2)", Category.ACT, scores, "L x B x a x S^2 x bytes (x2-3 with dropout)",
             "Korthikanti et al. 2022: 5as/h",
             key=K.ATTENTION_SCORES),
        Term("log-softmax of the logits", Category.ACT, b.lsm, "B x S x V x bytes (4 if the loss runs in fp32)"
             + (" = 0: the chunked loss saves a logsumexp per row" if spec.loss_chunk is not None else ""),
             "log_softmax saves its output for nll_loss's backward (derivatives.yaml)", key=K.LOG_SOFTMAX),
        Term("token ids and targets", Category.ACT, b.inputs, "2 x B x S x 8", "int64 inputs", key=K.INPUTS),
        Term("chunked output loss: every chunk's logits and one chunk's fp32 copy", Category.TEMP,
             b.logits,
             "B x S x V x m + (B x S / chunks) x V x 4 (no copy when m = 4)",
             "labkit.recompute.chunked_output (torchtune's CEWithChunkedOutputLoss)", key=K.LOGITS)
        if w.output_chunks else
        Term("logits (+ fp32 copy) during the loss", Category.TEMP, b.logits, "B x S x V x bytes",
             "lm_head's output; transformers upcasts it with .float() before the loss", key=K.LOGITS)
        if spec.loss_chunk is None else
        Term("chunked loss: one chunk's logits during the loss", Category.TEMP, b.logits,
             "2 c V x 4 + 8c (+ 16-bit copies of the hidden states and the head under autocast)",
             "labkit.recompute.chunked_ce.scratch_bytes", key=K.LOGITS),
    ]

