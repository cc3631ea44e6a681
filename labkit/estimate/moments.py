"""The moments of a training step, each a list of named terms; the peak is the largest moment.

Forward peaks at the loss (or inside a block, when little is held); backward is walked unit by unit
(the loss, the head, each block or checkpointed segment, the embedding); the optimizer step comes last.
What each block holds until its backward depends on the activation policy:

| policy | held per block until its backward | re-made during its backward |
|---|---|---|
| none | its saved activations A | - |
| full / sqrt (k segments) | each segment's input only | the whole segment's A (recompute) |
| selective ("matmuls") | input + matmul outputs | the rest of that block's A |
| offload | nothing on the device | that block's A, copied back |

Micro-batching runs this with the micro-batch's activations; from the second micro-batch on, every
gradient already exists, so the full gradient bytes sit under every moment.

Every number a moment uses is a field of `StepBytes`, and every field carries its name, category,
formula and source (`StepBytes.term`): a moment is a list of those terms, so its bytes are their sum.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from labkit.memory.report import Category, Moment, Term

POLICIES = ("none", "full", "sqrt", "selective")
# GaLore's optimizer moments are named by the step they describe: `Estimate.without(REFRESH)` keeps the steady ones
REFRESH, STEADY = "projector refresh", "steady (no refresh)"
P_, B_, G_, O_, A_, T_ = (Category.PARAM, Category.BUFFER, Category.GRAD, Category.OPT, Category.ACT, Category.TEMP)


def _f(cat: Category, name: str, formula: str, source: str = ""):
    return field(default=0, metadata=dict(cat=cat, name=name, formula=formula, source=source))


@dataclass
class StepBytes:
    """What one micro-batch's walk and the model states give, in bytes. r = rows of a micro-batch (B x S),
    h hidden, f MLP width, V vocabulary, d bytes per parameter element, m bytes of a matmul output
    (2 under autocast, else d), L blocks."""

    P: int = _f(P_, "parameters", "N x d", "every predictor")
    C: int = _f(P_, "autocast 16-bit weight copies", "2 x matmul parameters",
                "torch.autocast's weight cast cache, kept until backward")
    G: int = _f(G_, "gradients", "N_train x d", "gradients take the parameters' dtype (fp32 under mixed precision)")
    O: int = _f(O_, "optimizer state", "per optimizer (labkit.estimate.optim_terms)", "labkit.optim / torch.optim")
    opt_temp: int = _f(T_, "optimizer step temporaries", "per optimizer (labkit.estimate.optim_terms.temp_bytes)",
                       "the ops of each step: torch.optim's Adam sqrt(v) and its quotient, labkit.optim's fp32 copies")
    opt_cast: int = _f(P_, "the step's fp32 working copy of a 16-bit parameter", "4 x (elements or chunk) of the "
                       "stepping tensor (labkit.estimate.optim_terms.cast_bytes)",
                       "labkit.optim: p.float(), a cast of the parameter (parameter memory in the ledger)")
    opt_refresh: int = _f(T_, "GaLore projector refresh: the costliest matrix's SVD (or the steady step's temporaries)",
                          "4(m k + k + k n) U, S, Vh (+ 4 m n a 16-bit G's fp32 copy, or + 4 r k an int8 projector's "
                          "quotient), or the steady step's if larger (optim_terms.galore_step_split)",
                          "labkit.optim.galore make_projector: torch.linalg.svd(G.float(), full_matrices=False)")
    refresh_freed: int = _f(O_, "the refreshed matrix's old projector, freed before its SVD (while the SVD's output "
                                "and a 16-bit G's fp32 copy live)", "r k x its bytes (optim_terms.galore_refresh_split)",
                            "labkit.optim GaLore: state.pop('projector') before make_projector")
    inputs: int = _f(A_, "token ids and targets", "2 x B x S x 8 (int64)", "the batch")
    before: int = _f(A_, "saved before the first block", "walk: position ids, embedding dropout mask",
                     "autograd's saved tensors (derivatives.yaml)")
    layer: int = _f(A_, "saved by one block", "walk of one block ~ sbh(34 + 5as/h) for Megatron's layer",
                    "Korthikanti et al. 2022 (arXiv 2205.05198); derivatives.yaml")
    kept: int = _f(A_, "matmul outputs kept by selective checkpointing (one block)", "walk: outputs of matmul-like ops",
                   "torch.utils.checkpoint selective policy (MUST_SAVE for mm/bmm/sdpa)")
    kept_saved: int = _f(A_, "the part of the kept outputs autograd saves anyway", "walk", "")
    after: int = _f(A_, "saved after the last block", "walk: final norm input and statistics, head input, log-softmax",
                    "derivatives.yaml")
    lsm: int = _f(A_, "log-softmax of the logits", "r x V x 4 (loss in fp32) or x m",
                  "log_softmax saves its output; nll_loss reads it")
    logits: int = _f(T_, "logits (and their fp32 copy) while the loss runs", "r x V x m (+ r x V x 4 upcast)",
                     "lm_head's output; .float() or autocast's fp32 loss")
    head_temp: int = _f(T_, "head backward: dlogits, dX (and a 16-bit dW)", "r V m + r h m (+ V h m under autocast)",
                        "mm backward: grad_input = dy @ W, grad_weight = dy^T @ x")
    head_grad: int = _f(G_, "output matrix and final norm gradients", "(V h + 2h) x d", "made at the head's backward")
    stream: int = _f(T_, "gradient of the residual stream", "r x h x d", "carried from block to block in backward")
    tau: int = _f(T_, "MLP backward transient", "(1 exact GELU | 2 Python GELU/SwiGLU (+1 under LoRA)) x r x f x m",
                  "gelu_backward / mul backward: the gradients into and out of the activation alive together")
    tau_grad: int = _f(G_, "one weight gradient before accumulation", "f x h x m (LoRA: the largest trained tensor)",
                       "AccumulateGrad: a weight's gradient exists before it is stored in .grad")
    layer_grad: int = _f(G_, "gradients of one block", "block parameters x d", "")
    layer_copy: int = _f(P_, "autocast copies of one block's weights", "2 x block matmul parameters", "torch.autocast")
    head_copy: int = _f(P_, "autocast copy of the output matrix", "2 x V x h", "torch.autocast")
    seg_input: int = _f(A_, "a checkpointed segment's input", "r x h x d", "torch.utils.checkpoint saves the inputs")
    emb_temp: int = _f(T_, "dense embedding gradient (and the tied sum)", "2 x V x h x d",
                       "embedding_dense_backward; AccumulateGrad adds the head's part")
    fwd_block: int = _f(T_, "live inside one block's forward",
                        "residual in and mid 2 r h d + norm output r h (4 | d) (+ its 16-bit copy r h m) + MLP in and "
                        "out 2 r f m", "the block's forward ops, not yet freed")
    offload_back: int = _f(T_, "a block's worst backward op with offload",
                           "max(3 r f m: the MLP input copied back + two gradients of its size, 3 x probs / L + 2 r h m)",
                           "labkit.recompute.offload_activations: unpacked on use")
    emb_dense: int = _f(T_, "dense embedding-table gradients before accumulation",
                        "(V h + positions x h) x d", "embedding_dense_backward, then AccumulateGrad's in-place add")
    buffers: int = _f(B_, "int8/NF4 frozen base weights", "per weight (labkit.estimate.peft_terms)", "Dettmers et al. 2023")
    dequant: int = _f(T_, "dequantization scratch of one weight", "6 B (NF4) or 6-8 B (int8) x the largest weight",
                      "labkit.quant.dequantize_nf4 / dequantize_int8")
    # step-in-backward: (largest gradient, step temporaries, fp32 casts of the parameter) of one block's
    # parameters and of the rest;
    # head_held: the tied head's partial gradient, held from the head until the embedding's part is added;
    # step_freed: what is gone from a block's worst moment when its largest matrix, the MLP's output
    # projection (backward's first), steps: its autocast copy and saved input, and of the MLP's transient
    # gradients all but that projection's input gradient
    block_step: tuple = (0, 0, 0)
    rest_step: tuple = (0, 0, 0)  # outside the blocks, but a tied embedding
    tied_step: tuple = (0, 0, 0)  # the tied embedding (zeros when the head is untied)
    # GaLore: the same in a projector-refresh step, with a 4th item, the change of OPT (the old projector freed)
    block_refresh: tuple | None = None
    rest_refresh: tuple | None = None
    tied_refresh: tuple | None = None
    head_held: int = _f(T_, "the tied head's partial gradient", "V x h x d",
                        "held until the embedding's gradient is added (step in backward)")
    step_freed: tuple[int, int, int] = (0, 0, 0)
    head_freed: tuple[int, int, int] = (0, 0, 0)  # the same for an untied head: its copy, saved input, all but dX
    states: dict = field(default_factory=dict)  # "P", "C", "G", "O", "buffers" -> the model-state terms making it up
    # worst moments inside a block's ops (materialised attention, labkit.estimate.attention), block 0's:
    # (phase, what, saved by the block before the op, the op's saved tensors alive then, its temporaries,
    #  bytes of the block's gradients made by then in backward, matmul outputs of the block up to the op)
    points: list = field(default_factory=list)
    forward_extra: int = 0  # alive through the forward, never saved (transformers' (B, 1, S, S) float mask)
    forward_locals: int = _f(T_, "embeddings held by the model's forward function", "r h d (+ S h d positions)",
                             "transformers' GPT2Model/LlamaModel.forward keep inputs_embeds (and position_embeds) "
                             "in locals until they return")

    def state(self, key: str) -> list[Term]:
        """A model state as the estimate's own terms (e.g. frozen base + adapters for P under LoRA), when they
        add up to the field; else the field as one term."""
        parts = self.states.get(key)
        if parts and sum(t.bytes for t in parts) == getattr(self, key):
            return list(parts)
        return [self.term(key)] if getattr(self, key) else []

    def term(self, key: str, times: int = 1, name: str | None = None, nbytes: int | None = None) -> Term:
        """The field `key` as a term (times copies of it, or `nbytes` in its place), with its formula and source."""
        meta = _META[key]
        n = getattr(self, key) if nbytes is None else nbytes
        formula = meta["formula"] if times == 1 else f"{times} x [{meta['formula']}]"
        return Term(name or meta["name"], meta["cat"], times * n, formula, meta["source"])


_META = {f.name: f.metadata for f in fields(StepBytes) if f.metadata}


def custom(name: str, cat: Category, nbytes: int, formula: str, source: str = "") -> Term:
    return Term(name, cat, int(nbytes), formula, source)


def segments_of(n: int, policy: str, segments: int | None) -> list[int]:
    """Block counts of the checkpointed segments (even split, as labkit.recompute.segment_bounds)."""
    if policy in ("none", "selective"):
        return [1] * n
    k = max(1, round(n**0.5)) if policy == "sqrt" else (n if segments is None else segments)
    if not (isinstance(k, int) and 1 <= k <= n):
        raise ValueError(f"segments must be an integer from 1 to the number of blocks ({n}), got {segments!r}")
    return [(i + 1) * n // k - i * n // k for i in range(k)]


def held_per_unit(b: StepBytes, policy: str, offload: bool, sizes: list[int]) -> list[int]:
    """Bytes each unit (a segment, or a block) holds on the device from the forward to its backward. Offload moves
    what autograd saves to the host, but a checkpointed unit's input (and selective's kept outputs) are held by
    torch.utils.checkpoint itself, whose own saved-tensor hooks sit inside the offload hooks: they stay."""
    if offload and policy == "none":
        return [0] * len(sizes)
    if policy == "none":
        return [b.layer] * len(sizes)
    if policy == "selective":
        return [b.seg_input + b.kept] * len(sizes)
    return [b.seg_input] * len(sizes)


def _held_terms(b: StepBytes, policy: str, offload: bool, sizes: list[int], units: int) -> list[Term]:
    """The activations the first `units` units hold until their backward (see `held_per_unit`)."""
    if (offload and policy == "none") or units == 0:
        return []
    blocks = sum(sizes[:units])
    if policy == "none":
        return [b.term("layer", blocks, f"saved by {blocks} block(s)")]
    if policy == "selective":
        return [b.term("seg_input", units, f"inputs of {units} checkpointed block(s)"),
                b.term("kept", units, f"matmul outputs kept in {units} block(s)")]
    return [b.term("seg_input", units, f"inputs of {units} checkpointed segment(s)")]


def step_moments(b: StepBytes, n_layer: int, policy: str = "none", segments: int | None = None,
                 offload: bool = False, grads_exist: bool = False, step_in_backward: bool = False,
                 tag: str = "") -> list[Moment]:
    """Every candidate moment of one step. grads_exist: a later micro-batch (all gradients already made;
    `tag` names it). step_in_backward: each gradient is stepped and freed when made, so backward holds about
    one at a time; the optimizer's moments are then those inside backward where a parameter steps."""
    sizes = segments_of(n_layer, policy, segments)
    held = held_per_unit(b, policy, offload, sizes)
    n_units = len(sizes)
    states = [*b.state("P"), *b.state("O")]
    base_states = list(states)
    if grads_exist:
        states.append(b.term("G", name="gradients of the earlier micro-batches"))
    outside = [] if offload else [b.term("before"), b.term("after", nbytes=b.after - b.lsm,
                                                             name="saved after the last block (but the log-softmax)")]
    buffers = b.state("buffers")
    sfx = f" ({tag})" if tag else ""

    # ---- forward: the loss (all held activations), the last block's dequantization, inside a block
    fwd = [Moment("forward", "the loss" + sfx, [*states, *b.state("C"), *buffers, b.term("inputs"), *outside,
                                                 *_held_terms(b, policy, offload, sizes, n_units), b.term("lsm"),
                                                 b.term("logits")])]
    if b.dequant:  # a quantized base: the last block dequantizes its largest weight before the loss
        fwd.append(Moment("forward", "last block, dequantizing its largest weight" + sfx,
                          [*states, *b.state("C"), *buffers, b.term("inputs"), *outside[:1],
                           *_held_terms(b, policy, offload, sizes, n_units), b.term("dequant")]))
    if policy != "none" or offload:  # little is held: the peak may sit inside a block's forward
        fwd.append(Moment("forward", "inside the last block's forward" + sfx,
                          [*states, *b.state("C"), *buffers, b.term("inputs"), *outside[:1],
                           *_held_terms(b, policy, offload, sizes, n_units - 1), b.term("fwd_block")]))

    fwd += _forward_points(b, policy, offload, sizes, states, buffers, sfx)

    # autocast's weight copies after the forward: all kept (none), the head's only (the blocks' copies
    # are not saved by a checkpointed region; its recompute casts again), or none (offloaded)
    recompute = policy != "none" and not offload
    if offload:
        copies = []
    elif recompute:
        copies = [b.term("head_copy")] if b.C else []
    else:
        copies = [*b.state("C")]
    held_all = _held_terms(b, policy, offload, sizes, n_units)
    loss_grads = [custom("the loss's gradients (dlogits, d log-softmax)", T_, 2 * b.lsm, "2 x r x V x (4 | m)",
                         "nll_loss_backward, log_softmax_backward_data")]
    if offload:
        loss_grads.append(custom("log-softmax copied back for the loss's backward", T_, b.lsm, "r x V x (4 | m)",
                                 "labkit.recompute.offload_activations: unpacked on use"))
    start = Moment("backward", "start: the loss's backward" + sfx,
                   [*states, *copies, *buffers, b.term("inputs"), *outside, *held_all,
                    *([] if offload else [b.term("lsm")]), *loss_grads])
    head_grad = [] if grads_exist else [b.term("head_grad")]
    head = Moment("backward", "the head's backward" + sfx,
                  [*states, *copies, *buffers, b.term("inputs"), *outside, *held_all, *head_grad, b.term("head_temp")])
    moments = [*fwd, start, head]
    block_moments = []
    done = 0  # blocks whose backward is finished
    for j in reversed(range(n_units)):  # units, last first
        m = sizes[j]
        where = (f"block {j} backward" if m == 1 and policy != "full" and policy != "sqrt"
                 else f"segment {j} backward (blocks {sum(sizes[:j])}-{sum(sizes[:j + 1]) - 1})")
        terms = [*states, *buffers, b.term("inputs"), *([] if offload else [b.term("before")])]
        terms += _held_terms(b, policy, offload, sizes, j)
        if policy == "none" and not offload:
            terms.append(b.term("layer", m, f"saved by the block(s) in backward"))
        elif offload and policy == "none":  # copied back one by one as backward needs them, freed after use
            terms.append(b.term("offload_back"))
        else:  # recomputed: all of the unit's activations but what it held (its input, kept outputs)
            terms += _held_terms(b, policy, offload, [m], 1)
            remade = m * b.layer - b.seg_input - (b.kept_saved if policy == "selective" else 0)
            terms.append(custom("recomputed activations of the unit", T_, remade,
                                f"{m} x A_block - segment input" + (" - kept outputs" if policy == "selective" else ""),
                                "torch.utils.checkpoint re-runs the forward"))
        if not grads_exist and not step_in_backward:
            terms.append(b.term("head_grad"))
            if done:
                terms.append(b.term("layer_grad", done, f"gradients of the {done} finished block(s)"))
        if policy != "none":  # the head's copy is freed; the recomputed unit casts its weights again
            if b.C:
                terms.append(b.term("layer_copy", m, "autocast copies of the recomputed unit"))
        elif offload:
            pass  # no autocast copies left on the device
        elif b.C:  # each finished block's copies are freed
            terms.append(b.term("C", nbytes=b.C - b.head_copy - done * b.layer_copy,
                                name=f"autocast copies of the {n_layer - done} blocks not finished"))
        terms.append(b.term("tau_grad"))
        terms.append(b.term("stream"))
        if not (offload and policy == "none"):  # offload_back includes its own transient; a quantized base
            # dequantizes each weight again
            terms.append(b.term("tau") if b.tau >= b.dequant else b.term("dequant"))
        if step_in_backward and b.head_held:
            terms.append(b.term("head_held"))
        block_moments.append(Moment("backward", where + sfx, terms))
        moments += _backward_points(b, policy, offload, sizes, j, done, states, buffers, grads_exist,
                                    step_in_backward, recompute, n_layer, where, sfx)
        done += m
    rest = [custom("gradients of the parameters outside the blocks (step in backward)", G_,
                   max(b.rest_step[0], b.tied_step[0]),
                   "largest such gradient x d", "labkit.optim.StepInBackward")] if step_in_backward else b.state("G")
    end = Moment("backward", "the embedding's backward" + sfx,
                 [*base_states, *buffers, b.term("inputs"), *rest, b.term("stream"),
                  b.term("emb_dense") if grads_exist else b.term("emb_temp")])
    moments += [*block_moments, end]
    if step_in_backward:
        moments += _steps_in_backward(b, block_moments, head, end, sfx)
    elif b.opt_refresh:  # GaLore: a projector-refresh step and a steady one
        opt = [*base_states, *buffers, *b.state("G"), b.term("inputs")]
        moments.append(Moment("optimizer", f"the optimizer step, {STEADY}" + sfx, [*opt, b.term("opt_temp")]))
        moments.append(Moment("optimizer", f"the optimizer step, {REFRESH}" + sfx,
                              [*opt, b.term("opt_refresh"), *_freed_projector(b.refresh_freed)]))
    else:
        moments.append(Moment("optimizer", "the optimizer step" + sfx,
                              [*base_states, *buffers, *b.state("G"), b.term("inputs"), b.term("opt_temp"),
                               b.term("opt_cast")]))
    return moments


def _forward_points(b: StepBytes, policy, offload, sizes, states, buffers, sfx) -> list[Moment]:
    """Inside the last block's forward, at each recorded op's worst moment (labkit.estimate.attention)."""
    out = []
    n_units, L = len(sizes), sum(sizes)
    extra = [custom("transformers' 4-D float attention mask", T_, b.forward_extra, "B x S x S x d",
                    "made once per forward by the model's masking utilities")] if b.forward_extra else []
    extra += [b.term("forward_locals")] if b.forward_locals else []
    if policy == "none" and not offload and (extra or b.points):  # the blocks' end: all saved, nothing freed yet
        out.append(Moment("forward", f"the end of block {L - 1}" + sfx, [
            *states, *b.state("C"), *buffers, b.term("inputs"), b.term("before"),
            *_held_terms(b, policy, offload, sizes, L), *extra,
            b.term("stream", name="the last block's output projection and residual sum", nbytes=2 * b.stream)]))
    for phase, what, before, saved, temp, _, kept in b.points:
        if phase != "forward":
            continue
        terms = [*states, *b.state("C"), *buffers, b.term("inputs"), *extra]
        if offload:  # saved tensors leave the device; the op's temporaries stay
            terms.append(custom(f"{what} temporaries", T_, temp, "replayed ops (labkit.estimate.attention)",
                                "the op sequence of this attention path"))
        elif policy == "none":
            terms += [b.term("before"), *_held_terms(b, policy, offload, sizes, L - 1),
                      custom(f"saved by block {L - 1} before it", A_, before, "walk, block prefix", "derivatives.yaml"),
                      custom(f"{what} saved so far", A_, saved, "replayed ops (labkit.estimate.attention)",
                             "the op sequence of this attention path"),
                      custom(f"{what} temporaries", T_, temp, "replayed ops (labkit.estimate.attention)",
                             "the op sequence of this attention path")]
        else:  # inside a checkpointed region nothing is saved: the same tensors live as temporaries
            terms += [b.term("before"), *_held_terms(b, policy, offload, sizes, n_units - 1),
                      b.term("seg_input", name="the last unit's input"),
                      custom(f"{what} (no grad: tensors freed when unused)", T_, saved + temp,
                             "replayed ops (labkit.estimate.attention)", "the op sequence of this attention path")]
            if policy == "selective":  # the block's matmul outputs so far stay cached for its backward
                terms.append(custom("matmul outputs kept so far in the block (selective)", A_, kept,
                                    "walk: outputs of mm/bmm/sdpa up to the op", "torch SAC policy MUST_SAVE"))
        out.append(Moment("forward", f"block {L - 1} forward, {what}" + sfx, terms))
    return out


def _backward_points(b: StepBytes, policy, offload, sizes, j, done, states, buffers, grads_exist, step_in_backward,
                     recompute, n_layer, where, sfx) -> list[Moment]:
    """Inside unit j's backward, at each recorded op's worst moment: what the unit's earlier ops saved is still
    alive (recomputed, for a checkpointed unit), what came after it is freed, the op's temporaries on top."""
    if offload:
        return []
    out, m = [], sizes[j]
    for phase, what, before, saved, temp, grads_made, _ in b.points:
        if phase != "backward":
            continue
        terms = [*states, *buffers, b.term("inputs"), b.term("before"), *_held_terms(b, policy, offload, sizes, j)]
        if recompute:
            terms += _held_terms(b, policy, offload, [m], 1)
            terms.append(custom("recomputed activations of the unit, up to the op", T_,
                                (m - 1) * b.layer + before + saved - b.seg_input
                                - (b.kept_saved if policy == "selective" else 0),
                                "(blocks in the unit - 1) x A_block + the block's prefix - segment input",
                                "torch.utils.checkpoint re-runs the forward"))
            if b.C:
                terms.append(b.term("layer_copy", m, "autocast copies of the recomputed unit"))
        else:
            terms += [custom(f"saved by the block before {what.split(':')[0]}", A_, before, "walk, block prefix",
                             "derivatives.yaml"),
                      custom(f"{what}: saved tensors still alive", A_, saved, "replayed ops (labkit.estimate.attention)",
                             "the op sequence of this attention path")]
            if b.C:
                terms.append(b.term("C", nbytes=b.C - b.head_copy - done * b.layer_copy,
                                    name=f"autocast copies of the {n_layer - done} blocks not finished"))
        terms.append(custom(f"{what}: temporaries", T_, temp, "replayed ops (labkit.estimate.attention)",
                            "the op sequence of this attention path"))
        terms.append(b.term("stream"))
        if not grads_exist and not step_in_backward:
            terms.append(b.term("head_grad"))
            if done:
                terms.append(b.term("layer_grad", done, f"gradients of the {done} finished block(s)"))
            terms.append(custom("gradients of this block made so far", G_, grads_made,
                                "parameters after the op x d", "AccumulateGrad, in reverse order"))
        out.append(Moment("backward", f"{where}, {what}" + sfx, terms))
    return out


def _freed_projector(nbytes: int) -> list:
    """GaLore's refresh: the refreshed matrix's old projector, gone from the state at the refresh's worst moment."""
    return [custom("the refreshed matrix's old projector, freed before its SVD", O_, -nbytes,
                   "r k x its bytes (optim_terms.galore_refresh_split)",
                   "labkit.optim GaLore: state.pop('projector') before make_projector")] if nbytes else []


def _steps_in_backward(b: StepBytes, blocks: list[Moment], head: Moment, end: Moment, sfx: str) -> list[Moment]:
    """The backward moments at which a parameter steps: each block's (its largest parameter's gradient and
    step temporaries on top), and the head's (untied head) or the last one's (the tied embedding)."""
    def stepping(x: Moment, step: tuple, freed=(0, 0, 0), where: str = "") -> Moment:
        keep = [t for t in x.terms if t.category is not G_]
        return Moment("optimizer", where + sfx, [
            *keep,
            custom("the stepping parameter's gradient", G_, step[0], "largest gradient of the unit x d",
                   "labkit.optim.StepInBackward"),
            custom("its optimizer step's temporaries", T_, step[1], "one tensor's step (optim_terms.tensor_step_bytes)",
                   "torch.optim single-tensor step; labkit.optim's update of one tensor"),
            custom("its step's fp32 working copy of the parameter", P_, step[2], "4 x its elements (16-bit) or 0",
                   "labkit.optim: p.float(), counted as parameter memory"),
            *_freed_projector(-step[3] if len(step) > 3 else 0),
            custom("freed before the step: its autocast copy", P_, -freed[0], "the stepped matrix's 16-bit copy", ""),
            custom("freed before the step: its saved input", A_, -freed[1], "the stepped matmul's input", ""),
            custom("freed before the step: transient gradients", T_, -freed[2], "all but its input gradient", ""),
        ])

    runs = [(b.block_step, b.rest_step, b.tied_step, "")]
    if b.block_refresh is not None:  # GaLore: each step in a steady step and in a projector-refresh step
        runs = [(b.block_step, b.rest_step, b.tied_step, f", {STEADY}"),
                (b.block_refresh, b.rest_refresh, b.tied_refresh, f", {REFRESH}")]
    out = []
    for block_step, rest_step, tied_step, kind in runs:
        out += [stepping(x, block_step, b.step_freed, x.where.split(" (")[0] + ", its largest matrix steps" + kind)
                for x in blocks]
        # the tied matrix steps once the embedding's dense gradient is summed into it (that sum is its .grad);
        # the other parameters outside the blocks (a position embedding) step before, beside the head's part
        if b.head_held:
            out.append(stepping(end, tied_step, (0, 0, b.emb_temp), "the tied embedding steps" + kind))
            if rest_step[0]:
                held = Moment(end.phase, end.where,
                              [t for t in end.terms if t != b.term("emb_temp")] + [b.term("head_held")])
                out.append(stepping(held, rest_step,
                                    where="the position embedding steps (the tied head's gradient held)" + kind))
        else:
            out.append(stepping(head, rest_step, b.head_freed, "the head steps" + kind))
    return out
