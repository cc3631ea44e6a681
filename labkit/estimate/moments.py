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

Categories follow lesson 00's one definition, as the ledger does (labkit.memory.ledger): what the forward
made and backward still holds is ACT (a checkpointed unit's input, selective's cached outputs, also while a
recompute or a block's backward reads them); what a recompute makes during backward is TEMP, the tensors
autograd saves for the unit's backward included, but for autocast's weight copies, PARAM wherever made.

Micro-batching runs this with the micro-batch's activations; from the second micro-batch on, every
gradient already exists, so the full gradient bytes sit under every moment.

The blocks' moments come from replaying each block's ops (labkit.estimate.tape: the family walks record
every allocation, when the code lets it go, and each autograd node's backward), for every family and for
frozen or adapted weights. With no policy: the forward inside the last block with every saved tensor kept
(LoRA's fp32 copy of an adapter's input, Llama's fp32 softmax input), each block's backward op by op, and
the final norm's backward between the head's and the last block's. Checkpointed or offloaded: the forward
inside the last block with nothing saved (or selective's cached outputs), each unit's recompute (every saved tensor
and autocast weight copy made again), each block's backward (recomputed tensors freed after their last
reader; under offload each node's saved tensors copied back and freed when it returns).

Every number a moment uses is a field of `StepBytes`, and every field carries its name, category,
formula and source (`StepBytes.term`): a moment is a list of those terms, so its bytes are their sum.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field, fields

from labkit.memory.report import Category, Moment, MomentKind, Term, TermKey, Variant

from .recipe import POLICIES  # labkit.recompute.segments' table

# GaLore's optimizer moments are named by the step they describe: `Estimate.without(REFRESH)` keeps the steady ones
REFRESH, STEADY = Variant.REFRESH, Variant.STEADY
P_, B_, G_, O_, A_, T_ = (Category.PARAM, Category.BUFFER, Category.GRAD, Category.OPT, Category.ACT, Category.TEMP)
K, MK = TermKey, MomentKind


def _f(key: TermKey, cat: Category, name: str, formula: str, source: str = ""):
    return field(default=0, metadata=dict(key=key, cat=cat, name=name, formula=formula, source=source))


@dataclass
class StepBytes:
    """What one micro-batch's walk and the model states give, in bytes. r = rows of a micro-batch (B x S),
    h hidden, f MLP width, V vocabulary, d bytes per parameter element, m bytes of a matmul output
    (2 under autocast, else d), L blocks."""

    P: int = _f(K.PARAMETERS, P_, "parameters", "N x d", "every predictor")
    C: int = _f(K.COPIES_16BIT, P_, "autocast 16-bit weight copies", "2 x matmul parameters",
                "torch.autocast's weight cast cache, kept until backward")
    C_unsaved: int = _f(K.COPIES_16BIT, P_, "freed as the forward's autocast exits: trained copies no op saves",
                        "2 x (biases + weights whose input needs no gradient)",
                        "torch.autocast clears its cache on exit; a matmul saves W only for dx")
    G: int = _f(K.GRADIENTS,
                G_, "gradients", "N_train x d", "gradients take the parameters' dtype (fp32 under mixed precision)")
    O: int = _f(K.OPTIMIZER_STATE,
                O_, "optimizer state", "per optimizer (labkit.estimate.optim_terms)", "labkit.optim / torch.optim")
    opt_temp: int = _f(K.OPTIMIZER_TEMPS,
                       T_, "optimizer step temporaries", "per optimizer (labkit.estimate.optim_terms.temp_bytes)",
                       "the ops of each step: torch.optim's Adam sqrt(v) and its quotient, labkit.optim's fp32 copies")
    opt_cast: int = _f(K.STEP_CAST,
                       P_, "the step's fp32 working copy of a 16-bit parameter", "4 x (elements or chunk) of the "
                       "stepping tensor (labkit.estimate.optim_terms.cast_bytes)",
                       "labkit.optim: p.float(), a cast of the parameter (parameter memory in the ledger)")
    opt_refresh: int = _f(K.OPTIMIZER_TEMPS,
                          T_, "GaLore projector refresh: the costliest matrix's SVD (or the steady step's temporaries)",
                          "4(m k + k + k n) U, S, Vh (+ 4 m n a 16-bit G's fp32 copy, or + 4 r k an int8 projector's "
                          "quotient), or the steady step's if larger (optim_terms.galore_step_split)",
                          "labkit.optim.galore make_projector: torch.linalg.svd(G.float(), full_matrices=False)")
    refresh_freed: int = _f(K.OPTIMIZER_STATE,
                            O_, "the refreshed matrix's old projector, freed before its SVD (while the SVD's output "
                                "and a 16-bit G's fp32 copy live)", "r k x its bytes (optim_terms.galore_refresh_split)",
                            "labkit.optim GaLore: state.pop('projector') before make_projector")
    inputs: int = _f(K.INPUTS, A_, "token ids and targets", "2 x B x S x 8 (int64)", "the batch")
    before: int = _f(K.EMBEDDING, A_, "saved before the first block", "walk: position ids, embedding dropout mask",
                     "autograd's saved tensors (derivatives.yaml)")
    layer: int = _f(K.SAVED_ACTIVATIONS,
                    A_, "saved by one block", "walk of one block ~ sbh(34 + 5as/h) for Megatron's layer",
                    "Korthikanti et al. 2022 (arXiv 2205.05198); derivatives.yaml")
    after: int = _f(K.HEAD,
                    A_, "saved after the last block", "walk: final norm input and statistics, head input, log-softmax",
                    "derivatives.yaml")
    lsm: int = _f(K.LOG_SOFTMAX, A_, "log-softmax of the logits", "r x V x 4 (loss in fp32) or x m",
                  "log_softmax saves its output; nll_loss reads it")
    logits: int = _f(K.LOGITS, T_, "logits (and their fp32 copy) while the loss runs", "r x V x m (+ r x V x 4 upcast)",
                     "lm_head's output; .float() or autocast's fp32 loss")
    head_temp: int = _f(K.HEAD_BACKWARD,
                        T_, "head backward: dlogits, dX (and a 16-bit dW)", "r V m + r h m (+ V h m under autocast)",
                        "mm backward: grad_input = dy @ W, grad_weight = dy^T @ x")
    head_cast: int = _f(K.HEAD_BACKWARD,
                        T_, "head backward after its matmul: dX and the 16-bit dW being cast to fp32", "r h m + V h m",
                        "the mm node frees its saved weight copy and dlogits once it returns; ToCopyBackward casts dW")
    head_grad: int = _f(K.HEAD_GRADIENTS,
                        G_, "output matrix and final norm gradients", "(V h + 2h) x d", "made at the head's backward")
    head_new: int = _f(K.NEW_GRADIENT,
                       T_, "the output matrix's new gradient, before it is summed into .grad (or held for the tied "
                           "embedding's part)", "V x h x d", "AccumulateGrad adds it into the .grad of the earlier "
                           "micro-batches")
    stream: int = _f(K.RESIDUAL_GRADIENT,
                     T_, "gradient of the residual stream", "r x h x d", "carried from block to block in backward")
    tau: int = _f(K.LAYER_TEMPS,
                  T_, "MLP backward transient", "(1 exact GELU | 2 Python GELU/SwiGLU (+1 under LoRA)) x r x f x m",
                  "gelu_backward / mul backward: the gradients into and out of the activation alive together")
    tau_grad: int = _f(K.NEW_GRADIENT,
                       G_, "one weight gradient before accumulation", "f x h x m (LoRA: the largest trained tensor)",
                       "AccumulateGrad: a weight's gradient exists before it is stored in .grad")
    layer_grad: int = _f(K.BLOCK_GRADIENTS, G_, "gradients of one block", "block parameters x d", "")
    layer_copy: int = _f(K.COPIES_16BIT,
                         P_, "autocast copies of one block's weights", "2 x block matmul parameters", "torch.autocast")
    head_copy: int = _f(K.COPIES_16BIT, P_, "autocast copy of the output matrix", "2 x V x h", "torch.autocast")
    emb_temp: int = _f(K.EMBEDDING_TIED_SUM, T_, "dense embedding gradient (and the tied sum)", "2 x V x h x d",
                       "embedding_dense_backward; AccumulateGrad adds the head's part")
    emb_dense: int = _f(K.EMBEDDING_GRADIENT, T_, "dense embedding-table gradients before accumulation",
                        "(V h + positions x h) x d", "embedding_dense_backward, then AccumulateGrad's in-place add")
    buffers: int = _f(K.QUANTIZED_BASE,
                      B_, "int8/NF4 frozen base weights", "per weight (labkit.estimate.peft_terms)",
                      "Dettmers et al. 2023")
    dequant: int = _f(K.DEQUANT_SCRATCH,
                      T_, "dequantization scratch of one weight", "6 B (NF4) or 6-8 B (int8) x the largest weight",
                      "labkit.quant.dequantize_nf4 / dequantize_int8")
    # step-in-backward: (largest gradient, step temporaries, fp32 casts of the parameter) of one block's
    # parameters and of the rest;
    # head_held: the tied head's partial gradient, held from the head until the embedding's part is added
    block_step: tuple = (0, 0, 0)
    rest_step: tuple = (0, 0, 0)  # outside the blocks, but a tied embedding
    tied_step: tuple = (0, 0, 0)  # the tied embedding (zeros when the head is untied)
    # GaLore: the same in a projector-refresh step, with a 4th item, the change of OPT (the old projector freed)
    block_refresh: tuple | None = None
    rest_refresh: tuple | None = None
    tied_refresh: tuple | None = None
    head_held: int = _f(K.TIED_HEAD_GRADIENT,
                        T_, "the tied head's partial gradient (a gradient in flight, not yet a .grad)", "V x h x d",
                        "autograd holds it in the shared weight's input buffer until the embedding's part is added; "
                        "that sum becomes .grad")
    # an untied head stepping in backward: what its node freed before (its copy, saved input, all but dX)
    head_freed: tuple[int, int, int] = (0, 0, 0)
    states: dict = field(default_factory=dict)  # "P", "C", "G", "O", "buffers" -> the model-state terms making it up
    # checkpointed / offloaded steps: each block's replays (labkit.estimate.tape.BlockReplay), the frozen
    # weights' autocast copies (saved for dx, not cached) inside the blocks and of the head, and the model's
    # forward locals that are also saved (position ids, rotary tables)
    replays: list = field(default_factory=list)
    tail: object = None  # the final norm's backward replayed (labkit.estimate.tape.TailReplay), or None
    c_frozen_blocks: int = 0
    c_frozen_head: int = 0
    locals_saved: int = 0
    final_out: tuple = (0, 0)  # transformers' last_hidden_state through the loss: (bytes, bytes no op saves)
    loss_locals: tuple = (0, 0)  # labkit GPT's forward locals while its loss runs: (bytes, bytes no op saves)
    loss_saved: int = _f(K.LOSS_TEMPS,
                         T_, "the chunked loss's saved tensors copied back (hidden states, logsumexp, count)",
                         "r x h x d + r x 4 + 8", "labkit.recompute.offload_activations unpacks them for its backward")
    loss_lse: int = _f(K.LOSS_TEMPS, T_, "the chunked loss's logsumexp, filled chunk by chunk", "r x 4",
                       "labkit.recompute.chunked_ce: saved (so offloaded) only when its forward returns")
    # the chunked output loss (Recipe.loss_chunks, labkit.recompute.chunked_output): at the loss's
    # backward, one chunk's gradients, the dlogits of the chunks before and their log-softmax
    # (freed); in the head's backward, the output matrix's gradient summed over the chunks; after the
    # last chunk, the chunks' input gradients and their concatenation (the split's backward)
    loss_grad: int = _f(K.LOSS_TEMPS, T_, "the loss's gradients: a chunk's (dlogits, "
                        "d log-softmax) and the dlogits of the chunks through before it",
                        "2 c V 4 + rows before x V x m",
                        "nll_loss_backward, log_softmax_backward_data")
    lsm_not_yet: int = _f(K.LOG_SOFTMAX, A_, "not made yet: the log-softmax of the chunks after the worst one",
                          "- rows of those chunks x V x 4", "each chunk's cross-entropy runs after the one before")
    lsm_gone: int = _f(K.LOG_SOFTMAX, A_, "freed: the log-softmax of the chunks already through "
                       "backward", "rows of those chunks x V x 4",
                       "autograd releases a node's saved tensors once it ran")
    # chunked (Recipe.loss_chunks): the chunks' saved inputs (Walk.output_chunk_inputs), freed as their
    # matmuls' nodes return: those gone at the head's worst moment (<= 0), and all of them
    head_inputs_freed: int = _f(K.SAVED_ACTIVATIONS, A_,
                                "freed: the saved inputs of the chunks whose matmul has run",
                                "- rows done x h x m (each chunk's own copy; views: all after the last)",
                                "autograd releases a node's saved tensors once it has run")
    chunk_inputs: int = 0
    head_copy_freed: int = _f(K.COPIES_16BIT, P_, "freed: the head's 16-bit weight copy (the last chunk's matmul "
                              "has run)", "- 2 x V x h", "autograd releases a node's saved tensors once it has run")
    head_sum: int = _f(K.HEAD_GRADIENTS, G_,
                       "output matrix gradient: the chunks' dW summed (the .grad)",
                       "V x h x d", "autograd's buffer adds a node's inputs out of place; "
                       "AccumulateGrad keeps the sum as .grad")
    # the same under activation offload: each chunk's log-softmax leaves the device when its loss
    # returns, and comes back for its own backward only
    lsm_chunk: int = _f(K.LOG_SOFTMAX, T_, "one chunk's log-softmax (its saved copy offloaded: on "
                        "the device while its loss runs)", "c x V x 4",
                        "labkit.recompute.offload_activations packs saved tensors to the host")
    logits_off: int = _f(K.LOGITS, T_, "every chunk's logits and the largest chunk's fp32 copy",
                         "r V m + c V 4", "labkit.recompute.chunked_output")
    loss_grad_off: int = _f(K.LOSS_TEMPS, T_, "the loss's gradients: a chunk's (dlogits, "
                            "d log-softmax), its log-softmax copied back, the dlogits of the chunks "
                            "through before it",
                            "3 c V 4 + rows before x V x m",
                            "labkit.recompute.offload_activations: unpacked on use")
    split_cat: int = _f(K.HEAD_BACKWARD, T_, "the chunks' input gradients and their concatenation",
                        "2 x r x h x d",
                        "split's backward (torch.chunk): cat of the chunks' gradients")
    block0_local: int = 0  # the part of forward_locals that is block 0's input (held as a checkpointed input)
    block_kwargs: tuple = (0, 0)  # (bytes of the tensors every block gets besides its input, the part in `before`)
    forward_extra: int = 0  # alive through the forward, never saved (transformers' (B, 1, S, S) float mask)
    forward_locals: int = _f(K.FORWARD_LOCALS,
                             T_, "embeddings held by the model's forward function", "r h d (+ S h d positions)",
                             "transformers' GPT2Model/LlamaModel.forward keep inputs_embeds (and position_embeds) "
                             "in locals until they return")

    def state(self, key: str) -> list[Term]:
        """A model state as the estimate's own terms (e.g. frozen base + adapters for P under LoRA), when they
        add up to the field; else the field as one term."""
        parts = self.states.get(key)
        if parts and sum(t.bytes for t in parts) == getattr(self, key):
            return list(parts)
        return [self.term(key)] if getattr(self, key) else []

    def term(self, key: str, times: int = 1, name: str | None = None, nbytes: int | None = None,
             as_key: TermKey | None = None) -> Term:
        """The field `key` as a term (times copies of it, or `nbytes` in its place), with its formula, source and
        TermKey (the field's, or `as_key`)."""
        meta = _META[key]
        n = getattr(self, key) if nbytes is None else nbytes
        formula = meta["formula"] if times == 1 else f"{times} x [{meta['formula']}]"
        return Term(name or meta["name"], meta["cat"], times * n, formula, meta["source"], key=as_key or meta["key"])


_META = {f.name: f.metadata for f in fields(StepBytes) if f.metadata}


def _m(kind: MomentKind, block: int | None, phase: str, where: str, terms: list[Term],
       variant: Variant | None = None) -> Moment:
    return Moment(phase, where, terms, kind=kind, block=block, variant=variant)


def custom(key: TermKey, name: str, cat: Category, nbytes: int, formula: str, source: str = "",
           block: int | None = None) -> Term:
    return Term(name, cat, int(nbytes), formula, source, key=key, block=block)


def _tied(b: StepBytes) -> bool:
    """The head's matrix is the token embedding's (a tied matrix trained whole on this device): the embedding's
    backward makes the dense gradient and the sum with the head's part."""
    return bool(b.head_held) and b.emb_temp == 2 * b.head_held


def _head_grads(b: StepBytes) -> list[Term]:
    """The head's gradients after its backward and the final norm's (first micro-batch). A tied output matrix's
    part is no .grad yet: autograd holds it until the embedding's part is added, and the sum becomes .grad, so
    until then it is a gradient in flight (TEMP), as the ledger tags it; the final norm's are gradients."""
    if not b.head_grad:
        return []
    if not _tied(b):
        return [b.term("head_grad")]
    return [b.term("head_held"), custom(K.HEAD_GRADIENTS,
                                        "final norm gradients", G_, b.head_grad - b.head_held, "2h x d",
                                        "made at the final norm's backward")]


def segments_of(n: int, policy: str, segments: int | None) -> list[int]:
    """Block counts of the checkpointed segments (even split, as labkit.recompute.segment_bounds)."""
    if policy in ("none", "selective"):
        return [1] * n
    k = max(1, round(n**0.5)) if policy == "sqrt" else (n if segments is None else segments)
    if not (isinstance(k, int) and 1 <= k <= n):
        raise ValueError(f"segments must be an integer from 1 to the number of blocks ({n}), got {segments!r}")
    return [(i + 1) * n // k - i * n // k for i in range(k)]


def _held_terms(b: StepBytes, policy: str, offload: bool, sizes: list[int], units: int) -> list[Term]:
    """The activations the first `units` blocks hold until their backward (nothing checkpointed or offloaded;
    a checkpointed or offloaded step uses `checkpoint_held`): from each block's replay when there is one (blocks
    differ: LoRA's first block saves less, LISA's active ones more), else the walk's per-block average."""
    if units == 0:
        return []
    blocks = sum(sizes[:units])
    if len(b.replays) >= blocks:
        return [custom(K.SAVED_ACTIVATIONS,
                       f"saved by {blocks} block(s)", A_, sum(block_saved(b, k) for k in range(blocks)),
                       "replay: each block's saved tensors (its input when it saves it), without autocast's weight "
                       "copies", _REPLAY_SOURCE)]
    return [b.term("layer", blocks, f"saved by {blocks} block(s)")]


def block_saved(b: StepBytes, k: int) -> int:
    """Activations block k saves for backward: its replay's saved storages (a view saved keeps its whole base),
    its input when a node of the block saves it, without the autocast weight copies (model-state bytes)."""
    r = b.replays[k]
    return r.saved_bytes + r.input_saved - r.copies_saved


@dataclass(frozen=True)
class _Step:
    """What the moments of one step share (step_moments makes it from its own checked arguments)."""

    b: StepBytes  # the step's byte counts
    policy: str  # the checkpointing policy (POLICIES)
    offload: bool  # saved activations offloaded to host memory
    sizes: list[int]  # blocks per checkpointed unit (segments_of)
    states: list[Term]  # parameters, optimizer state and, on a later micro-batch, the earlier gradients
    buffers: list[Term]  # a quantized base's buffers
    grads_exist: bool  # a later micro-batch: every gradient already made
    step_in_backward: bool  # each parameter steps when its gradient is ready
    sfx: str  # appended to every moment's `where`: " (tag)" or ""


def step_moments(b: StepBytes, n_layer: int, policy: str = "none", segments: int | None = None,
                 offload: bool = False, grads_exist: bool = False, step_in_backward: bool = False,
                 tag: str = "") -> list[Moment]:
    """Every candidate moment of one step. grads_exist: a later micro-batch (all gradients already made;
    `tag` names it). step_in_backward: each gradient is stepped and freed when made, so backward holds about
    one at a time; the optimizer's moments are then those inside backward where a parameter steps.
    A checkpointed or offloaded step takes its blocks' moments from the replays of their ops
    (labkit.estimate.tape, `_replayed_forward` and `_replayed_backward`)."""
    sizes = segments_of(n_layer, policy, segments)
    n_units = len(sizes)
    replayed = (policy != "none" or offload) and len(b.replays) == n_layer
    # nothing checkpointed or offloaded: the blocks' moments from their ops replayed with every saved tensor kept
    # (stepping in backward too, each gradient stepped and freed as made); without a replay per block, the
    # per-block terms of _plain_backward
    plain = policy == "none" and not offload and len(b.replays) == n_layer
    states = [*b.state("P"), *b.state("O")]
    base_states = list(states)
    if grads_exist:
        states.append(b.term("G", name="gradients of the earlier micro-batches"))
    outside = [] if offload else [b.term("before"), b.term("after", nbytes=b.after - b.lsm,
                                                             name="saved after the last block (but the log-softmax)")]
    buffers = b.state("buffers")
    sfx = f" ({tag})" if tag else ""
    st = _Step(b, policy, offload, sizes, states, buffers, grads_exist, step_in_backward, sfx)
    held_all = (checkpoint_held(b, policy, offload, sizes, n_units) if replayed
                else _held_terms(b, policy, offload, sizes, n_units))
    fwd_copies = _forward_copies(b, policy, offload) if replayed else b.state("C")

    # ---- forward: the loss (all held activations), the last block's dequantization, inside a block
    final = b.final_out[0] if offload else b.final_out[1]
    held_final = [custom(K.FORWARD_LOCALS, "the final norm's output, held as last_hidden_state", T_, final, "r x h x d",
                         "transformers' CausalLM forward keeps the base model's output until it returns")] if final else []
    # labkit GPT runs the loss in its forward: its locals pos, x (and the chunked loss's h) are alive, and the
    # saved ones among them are counted in `outside` unless offloaded (their device storage still held)
    loss_held = b.loss_locals[0] if offload else b.loss_locals[1]
    held_final += [custom(K.FORWARD_LOCALS,
                          "GPT.forward's locals while its loss runs (pos, the last block's output x, the chunked "
                          "loss's input h)", T_, loss_held, "S x 8 + r x h x d (+ r x h x d chunked)",
                          "labkit.models.gpt.GPT.forward holds them until it returns"
                          + (" (saved ones offloaded, still held)" if offload else " (the part no op saves)"))
                   ] if loss_held else []
    # the chunked loss's logsumexp: under offload it is on the device only while the loss runs
    held_final += [b.term("loss_lse")] if offload and b.loss_lse else []
    # the loss's log-softmax output: saved for its backward (an activation); under offload the saved copy is on the
    # host, and the device tensor lives only while the loss runs (a temporary, as the ledger counts it)
    lsm = b.term("lsm") if not offload else custom(
        K.LOG_SOFTMAX, "log-softmax of the logits (its saved copy offloaded: on the device while the loss runs)",
        T_, b.lsm, _META["lsm"]["formula"], "labkit.recompute.offload_activations packs saved tensors to the host")
    logits = [b.term("logits")]
    if offload and b.loss_grad:  # chunked output loss: one chunk's log-softmax on the device
        lsm, logits = b.term("lsm_chunk"), [b.term("logits_off")]
    elif b.lsm_not_yet:  # chunked: at the worst chunk's loss, the later chunks have no log-softmax yet
        logits.append(b.term("lsm_not_yet"))
    # the checkpointed regions hold the blocks' other arguments (the mask, rotary tables) from their forward on
    fwd = [_m(MK.LOSS, None, "forward", "the loss" + sfx, [*states, *fwd_copies, *buffers, b.term("inputs"), *outside,
                                                 *_kwargs(b, policy, offload), *held_all, *held_final, lsm,
                                                 *logits])]
    if b.dequant and not (replayed or plain):  # no replay per block: the largest weight dequantized at the end
        head = 0 if replayed and offload and b.c_frozen_head else b.head_copy  # (an offloaded frozen one: gone)
        before_head = [custom(t.key, t.name + " (not the head's yet)", t.category, t.bytes - head, t.formula,
                              t.source) for t in fwd_copies[:1]] if fwd_copies and head else fwd_copies
        fwd.append(_m(MK.DEQUANT, None, "forward", "last block, dequantizing its largest weight" + sfx,
                          [*states, *before_head, *buffers, b.term("inputs"), *outside[:1], *held_all,
                           b.term("dequant")]))
    if replayed:
        fwd += _replayed_forward(st)
    else:
        fwd += _forward_block(st, plain)

    # autocast's weight copies after the forward: all kept (none), the head's only (the blocks' copies
    # are not saved by a checkpointed region; its recompute casts again), or none (offloaded)
    recompute = policy != "none" and not offload
    if offload:
        copies = []
    elif recompute:
        copies = [b.term("head_copy")] if b.C else []
    else:
        copies = [*b.state("C"), *([b.term("C_unsaved", nbytes=-b.C_unsaved)] if b.C_unsaved else [])]
    chunked = bool(b.loss_grad)  # the chunked output loss: one chunk's gradients at a time
    loss_grads = [b.term("loss_grad_off" if offload else "loss_grad")] if chunked else [custom(
        K.LOSS_TEMPS, "the loss's gradients (dlogits, d log-softmax)", T_, 2 * b.lsm,
        "2 x r x V x (4 | m)", "nll_loss_backward, log_softmax_backward_data")]
    if chunked and b.lsm_gone and not offload:
        loss_grads.append(custom(K.LOG_SOFTMAX, _META["lsm_gone"]["name"], A_, -b.lsm_gone,
                                 _META["lsm_gone"]["formula"], _META["lsm_gone"]["source"]))
    if offload and not chunked:
        loss_grads.append(custom(K.LOSS_TEMPS,
                                 "log-softmax copied back for the loss's backward", T_, b.lsm, "r x V x (4 | m)",
                                 "labkit.recompute.offload_activations: unpacked on use"))
    kwargs = _kwargs(b, policy, offload)
    start = _m(MK.LOSS_BACKWARD, None, "backward", "start: the loss's backward" + sfx,
                   [*states, *copies, *buffers, b.term("inputs"), *outside, *kwargs, *held_all,
                    *([] if offload else [b.term("lsm")]), *loss_grads])
    head_grad = ([b.term("head_new")] if b.head_new else []) if grads_exist else _head_grads(b)
    # inside the head's backward the final norm's gradients are not made yet (its backward runs next): the
    # output matrix's gradient alone (a tied one in flight, TEMP, until the embedding's part is summed with it)
    in_head = ([b.term("head_new")] if b.head_new else []) if grads_exist else \
        [b.term("head_held")] if _tied(b) and b.head_grad else \
        [custom(K.HEAD_GRADIENTS,
                "output matrix gradient", G_, b.head_new, "V x h x d", "made at the head's backward")] \
        if b.head_grad else []
    # the chunked loss's saved tensors (hidden states, logsumexp, count) copied back for its backward
    loss_back = [b.term("loss_saved")] if offload and b.loss_saved else []
    around = [*states, *copies, *buffers, b.term("inputs"), *outside, *kwargs, *held_all]
    # under autocast the head's matmul makes a 16-bit dW: its fp32 gradient (in_head) comes after, from the
    # weight copy's own node, once the matmul's node has returned and freed the copy it saved
    cast = bool(b.head_cast and not offload and in_head)
    # chunked: the output matrix's gradient is a sum over the chunks in autograd's buffer (in
    # head_temp, or head_sum: the sum that becomes .grad) until the last chunk
    worst = ", its worst chunk" if chunked else ""
    head = _m(MK.HEAD_BACKWARD, None, "backward", "the head's backward" + worst + sfx,
              [*around, *([] if cast or chunked else in_head), *loss_back, *_inputs_freed(b, offload, every=False),
               *_head_sum(b, grads_exist), b.term("head_temp")])
    moments = [*fwd, start, head]
    if b.split_cat:  # chunked: after the last chunk, split's backward cats the input gradients
        moments.append(_m(MK.HEAD_AFTER, None, "backward",
                          "the chunks' input gradients concatenated" + sfx,
                          [*around, *_copy_freed(b, offload), *_inputs_freed(b, offload), *in_head,
                           b.term("split_cat")]))
    if cast:
        moments.append(_m(MK.HEAD_AFTER, None, "backward", "the head's weight gradient cast to fp32" + sfx, [
            *around, *_copy_freed(b, offload), *_inputs_freed(b, offload), *in_head, b.term("head_cast")]))
    if b.tail is not None and not step_in_backward and len(b.replays) == n_layer:
        # after the head: a later micro-batch's new head gradient was summed into .grad (a tied one waits)
        after_head = ([b.term("head_held")] if b.head_held else []) if grads_exist else head_grad
        moments.append(_tail_moment(st, kwargs, held_all, after_head))
    block_steps = None
    if replayed or plain:
        block_moments, block_steps = _replayed_backward(st)
    else:
        block_moments = _plain_backward(st)
    rest = [custom(K.GRADIENTS, "gradients of the parameters outside the blocks (step in backward)", G_,
                   max(b.rest_step[0], b.tied_step[0]),
                   "largest such gradient x d", "labkit.optim.StepInBackward")] if step_in_backward else b.state("G")
    end = _m(MK.EMBEDDING_BACKWARD, None, "backward", "the embedding's backward" + sfx,
                 [*base_states, *buffers, b.term("inputs"), *rest, b.term("stream"),
                  b.term("emb_dense") if grads_exist else b.term("emb_temp")])
    if _tied(b) and not grads_exist and not step_in_backward:
        # a tied matrix: the embedding's node returns (its incoming gradient, the stream, freed) before autograd
        # sums its dense gradient with the head's part: two moments, not the stream beside both
        base = [*base_states, *buffers, b.term("inputs"), *rest]
        moments += [*block_moments,
                    _m(MK.EMBEDDING_BACKWARD, None, "backward", "the embedding's backward" + sfx,
                           [*base, b.term("stream"), custom(K.EMBEDDING_GRADIENT,
                                                            "dense embedding gradient", T_, b.head_held,
                                                            "V x h x d", "embedding_dense_backward")]),
                    _m(MK.EMBEDDING_SUM, None,
                       "backward", "the tied embedding's gradients summed (the stream's gradient freed)" + sfx,
                           [*base, b.term("emb_temp")])]
    elif b.head_held and b.emb_temp == 2 * b.head_held and grads_exist and not step_in_backward:
        # a tied matrix, gradients already there: the head's part, held since the head's backward, and the
        # embedding's dense part are summed into a new tensor before AccumulateGrad adds it in place (the stream's
        # gradient freed by then): three V x h tensors at once
        base = [*base_states, *buffers, b.term("inputs"), *rest]
        moments += [*block_moments, end,
                    _m(MK.EMBEDDING_SUM, None,
                       "backward", "the tied embedding's gradients summed (the stream's gradient freed)" + sfx,
                           [*base, b.term("head_held"),
                            custom(K.EMBEDDING_TIED_SUM,
                                   "dense embedding gradient and the tied sum", T_, 2 * b.head_held,
                                   "2 x V x h x d", "embedding_dense_backward; autograd's sum of the two parts")])]
    else:
        moments += [*block_moments, end]
    if step_in_backward:  # (always with replays: the blocks' steps are in block_steps)
        head_freed = b.head_freed
        if chunked:  # the head's summed dW steps after the last chunk: every chunk's dX (cast) beside it;
            # the chunks' matmuls have returned, their weight copy and saved inputs freed (on the device)
            head = _m(MK.HEAD_AFTER, None, "backward", "after the last chunk's backward" + sfx,
                      [*around, custom(K.HEAD_BACKWARD, "the chunks' input gradients (not yet concatenated)", T_,
                                       b.stream, "r x h x d",
                                       "each chunk's matmul backward (and its cast to the stream)")])
            head_freed = (0, 0, 0) if offload else (b.head_copy, b.chunk_inputs, 0)
        moments += _steps_in_backward(b, head, end, sfx, head_freed)
        moments += block_steps or []
    elif b.opt_refresh:  # GaLore: a projector-refresh step and a steady one
        opt = [*base_states, *buffers, *b.state("G"), b.term("inputs")]
        moments.append(_m(MK.OPTIMIZER_STEP, None, "optimizer", f"the optimizer step, {STEADY}" + sfx,
                          [*opt, b.term("opt_temp")], STEADY))
        moments.append(_m(MK.OPTIMIZER_STEP, None, "optimizer", f"the optimizer step, {REFRESH}" + sfx,
                          [*opt, b.term("opt_refresh"), *_freed_projector(b.refresh_freed)], REFRESH))
    else:
        moments.append(_m(MK.OPTIMIZER_STEP, None, "optimizer", "the optimizer step" + sfx,
                              [*base_states, *buffers, *b.state("G"), b.term("inputs"), b.term("opt_temp"),
                               b.term("opt_cast")]))
    return moments


def _head_sum(b: StepBytes, grads_exist: bool) -> list[Term]:
    """The chunks' summed dW of an untied head, the .grad once made; on a later micro-batch a
    temporary that AccumulateGrad adds into the existing .grad."""
    if not b.head_sum:
        return []
    if grads_exist:
        return [b.term("head_new", nbytes=b.head_sum)]
    return [b.term("head_sum")]


def _inputs_freed(b: StepBytes, offload: bool, every: bool = True) -> list[Term]:
    """Chunked: the chunks' saved inputs, freed as their matmuls' nodes return (every: all, after the last
    chunk; else those gone at the head's worst moment, and the head's weight copy if the last chunk's has
    run). Offloaded, they were on the host."""
    if offload:
        return []
    n = -b.chunk_inputs if every else b.head_inputs_freed
    out = [b.term("head_inputs_freed", nbytes=n, name="freed: the chunks' saved inputs (their matmuls have "
                  "run)" if every else None)] if n else []
    return out + ([b.term("head_copy_freed")] if not every and b.head_copy_freed else [])


def _copy_freed(b: StepBytes, offload: bool) -> list[Term]:
    """The head's 16-bit weight copy, gone once its (last chunk's) matmul backward has run."""
    if not b.head_copy or offload:
        return []
    return [custom(K.COPIES_16BIT,
                   "freed: the head's 16-bit weight copy, with its matmul's backward", P_, -b.head_copy, "2 x V x h",
                   "autograd releases a node's saved tensors once it has run")]


def _tail_moment(st: _Step, kwargs: list[Term], held_all: list[Term], head_grad: list[Term]) -> Moment:
    """The final norm's backward, after the head's and before the last block's: every block's held tensors,
    the norm's saved tensors (copied back under offload) until their last reader, its gradients and
    temporaries (transformers' Python RMSNorm: pow's backward makes x^1 and 2x beside the gradients in flight,
    the mean's gradient and the x * rsqrt part waiting to be summed)."""
    b, policy, offload, states, buffers, grads_exist, sfx = (st.b, st.policy, st.offload, st.states, st.buffers,
                                                             st.grads_exist, st.sfx)
    t = b.tail
    w = (t.offload_later if grads_exist else t.offload) if offload else (t.saved_later if grads_exist else t.saved)
    terms = [*states, *buffers, b.term("inputs"), *([] if offload else [b.term("before")]), *kwargs, *held_all]
    copies = sum(r.copies_saved for r in b.replays) if policy == "none" and not offload else 0
    if copies:
        terms.append(custom(K.COPIES_16BIT, "autocast weight copies saved by the blocks", P_, copies,
                            "2 x the weights their matmuls save (for dx)",
                            "autograd keeps a matmul's 16-bit weight copy until that node's backward"))
    terms += head_grad
    if t.input_saved and not offload:
        terms.append(custom(K.HEAD, "the last block's output, saved by the final norm", A_, t.input_saved, "r x h x d",
                            "derivatives.yaml"))
    saved = 0 if offload else w.saved  # the forward's own saved tensors (copied back ones are made in backward)
    if saved:
        terms.append(custom(K.HEAD, f"the final norm's saved tensors still needed at {w.op}", A_, saved,
                            "replay: each saved tensor until its last reader", _REPLAY_SOURCE))
    terms.append(custom(K.LAYER_TEMPS,
                        f"the final norm's backward, {w.op}: " + ("its copied-back saved tensors, " if offload else "")
                        + "gradients and temporaries", T_, w.live - saved,
                        "replay: the norm's ops from its output's gradient", _REPLAY_SOURCE))
    if w.grads:  # (a later micro-batch: the new gradient, until it is summed into .grad)
        terms.append(custom(K.HEAD_GRADIENTS,
                            "the final norm's weight gradients made so far", T_ if grads_exist else G_, w.grads,
                            "replay: AccumulateGrad", "autograd makes a weight's gradient at its op's backward"))
    return _m(MK.FINAL_NORM_BACKWARD, None, "backward", "the final norm's backward" + sfx, terms)


def _plain_backward(st: _Step) -> list[Moment]:
    """Each block's backward from the walk's per-block bytes, where no block has a replay: a tensor-parallel
    rank's (its ops split; estimate_ranks refuses checkpointing, offload and the step in backward there)."""
    b, sizes, states, buffers, grads_exist = st.b, st.sizes, st.states, st.buffers, st.grads_exist
    n_layer = sum(sizes)
    block_moments = []
    for j in reversed(range(n_layer)):  # the last block first
        done = n_layer - 1 - j  # blocks whose backward is finished
        terms = [*states, *buffers, b.term("inputs"), b.term("before"), *_held_terms(b, "none", False, sizes, j),
                 b.term("layer", 1, "saved by the block in backward")]
        if not grads_exist:
            terms += _head_grads(b)
            if done:
                terms.append(b.term("layer_grad", done, f"gradients of the {done} finished block(s)"))
        if b.C:  # each finished block's copies are freed
            terms.append(b.term("C", nbytes=b.C - b.head_copy - done * b.layer_copy,
                                name=f"autocast copies of the {n_layer - done} blocks not finished"))
        terms += [b.term("stream"), b.term("tau_grad"), b.term("tau") if b.tau >= b.dequant else b.term("dequant")]
        block_moments.append(_m(MK.BLOCK_BACKWARD, j, "backward", f"block {j} backward" + st.sfx, terms))
    return block_moments


# ---- checkpointed and offloaded steps: the blocks' replayed ops (labkit.estimate.tape) -------------------
_REPLAY_SOURCE = "labkit.estimate.tape: the block's ops replayed (families.py records them from the model's code)"


def _at(op: str, k: int) -> str:
    """An op's name with block k's index (blocks with the same ops are replayed once, under the first's names)."""
    return re.sub(r"(?<=[A-Za-z_])\.\d+\b", f".{k}", op)


def _units(sizes: list[int]) -> list[tuple[int, int]]:
    """[first, end) block indices of each unit."""
    out, s = [], 0
    for m in sizes:
        out.append((s, s + m))
        s += m
    return out


def checkpoint_held(b: StepBytes, policy: str, offload: bool, sizes: list[int], units: int) -> list[Term]:
    """What the first `units` checkpointed units hold until their backward: each one's input (the
    checkpoint keeps it) and, under selective checkpointing, the outputs its blocks cached (the policy's ops). Activation
    offload does not touch them (a region's inputs are not saved tensors; inside a region its own hooks win)."""
    if policy == "none" or units == 0:
        return []
    spans = _units(sizes)[:units]
    inputs = sum(b.replays[s].input_bytes for s, _ in spans)
    out = [custom(K.CHECKPOINT_INPUTS,
                  f"inputs of {units} checkpointed {'block' if policy == 'selective' else 'segment'}(s)", A_, inputs,
                  "r x h x d each", "labkit.recompute.checkpoint keeps a region's inputs")]
    if policy == "selective":
        kept = sum(b.replays[i].kept_bytes for s, e in spans for i in range(s, e))
        out.append(custom(K.CHECKPOINT_INPUTS, f"outputs selective checkpointing keeps in {units} block(s)", A_, kept,
                          "replay: the outputs of the policy's ops in the block (matmuls: mm/addmm/bmm/sdpa; "
                          "attention-core: the linears, norms and MLP activation)",
                          "labkit.recompute.selective (torch SAC policy MUST_SAVE)"))
    return out


def _kwargs(b: StepBytes, policy: str, offload: bool) -> list[Term]:
    """What every block gets besides its input (position ids, rotary cos and sin, the 4-D mask): each
    checkpointed region keeps its arguments until its recompute, so they outlive the forward (the part
    already counted as saved before the first block is not repeated; under offload that part left)."""
    if policy == "none":
        return []
    n = b.block_kwargs[0] - (0 if offload else b.block_kwargs[1])
    # made by the forward and held into backward (a region's boundary): activations, as lesson 00 defines them
    return [custom(K.CHECKPOINT_INPUTS, "the blocks' other arguments, kept by the checkpointed regions", A_, n,
                   "S x 8 position ids (+ 2 x S x head_dim x d cos, sin) (+ B x S x S x d mask)",
                   "labkit.recompute.checkpoint keeps a region's arguments until its recompute")] if n else []


def _forward_copies(b: StepBytes, policy: str, offload: bool) -> list[Term]:
    """Autocast's weight copies during a checkpointed or offloaded forward: the cache holds every trained
    weight's until the forward ends; a frozen weight's copy is saved only by a matmul outside the blocks
    (the head), and not at all under offload."""
    if not b.C:
        return []
    frozen = b.c_frozen_blocks + (b.c_frozen_head if offload else 0)
    return [custom(K.COPIES_16BIT, "autocast 16-bit weight copies (the cache: trained weights" +
                   ("" if offload else "; the frozen head's saved copy") + ")", P_, b.C - frozen,
                   "2 x trained matmul parameters" + ("" if offload else " (+ 2 x V x h frozen head)"),
                   "torch.autocast caches a cast of a leaf that requires grad until the forward ends")]


def _locals(b: StepBytes, offload: bool, checkpointed: bool, in_block0: bool = False) -> list[Term]:
    """Tensors the model's forward holds while its blocks run (embeddings, position ids, rotary tables, the
    4-D mask): under offload even those also saved (they leave only when the forward returns)."""
    out = []
    if b.forward_extra:
        # checkpointed: every region keeps it as an argument into backward, so an activation (lesson 00)
        out.append(custom(K.FORWARD_LOCALS, "transformers' 4-D float attention mask", A_ if checkpointed else T_,
                          b.forward_extra, "B x S x S x d", "made once per forward by the model's masking utilities"))
    # block 0's input is counted already when a checkpoint holds it, or as the input of the block running
    local = b.forward_locals - (b.block0_local if checkpointed or in_block0 else 0)
    if local:
        out.append(b.term("forward_locals", nbytes=local))
    if offload and b.locals_saved:
        out.append(custom(K.FORWARD_LOCALS,
                          "position ids / rotary tables held by the model's forward", T_, b.locals_saved,
                          "S x 8 or 2 x S x head_dim x d", "the model's forward locals (saved, offloaded, still held)"))
    return out


def _replayed_forward(st: _Step) -> list[Moment]:
    """Inside the last block's forward: the earlier units' held inputs, the last unit's input when the block
    is not its first, and the block's worst moment with nothing saved (or its matmul outputs cached)."""
    b, policy, offload, sizes, states, buffers = st.b, st.policy, st.offload, st.sizes, st.states, st.buffers
    sfx = st.sfx
    n_units = len(sizes)
    s, e = _units(sizes)[-1]
    last = b.replays[e - 1]
    worst = last.kept if policy == "selective" else last.free
    copies = _forward_copies(b, policy, offload)
    if copies:  # the head's copy is made after the blocks, the last block's as its ops run
        copies = [custom(K.COPIES_16BIT,
                         "autocast 16-bit weight copies cached so far (the blocks before, this block's up to "
                         "the op)", P_, copies[0].bytes - (0 if offload and b.c_frozen_head else b.head_copy)
                         - last.cached_bytes + worst.cached, copies[0].formula, copies[0].source)]
    terms = [*states, *copies, *buffers, b.term("inputs"), *([] if offload else [b.term("before")]),
             *_locals(b, offload, policy != "none", e == 1),
             *checkpoint_held(b, policy, offload, sizes, n_units - 1)]
    if e - 1 > s and policy != "none":
        terms.append(custom(K.CHECKPOINT_INPUTS, "the last segment's input", A_, b.replays[s].input_bytes, "r x h x d",
                            "labkit.recompute.checkpoint keeps a region's inputs"))
    # a region's input and selective's cached outputs are kept into backward: activations (lesson 00)
    held_in = last.input_bytes if policy != "none" and e - 1 == s else 0
    kept = worst.saved if policy == "selective" else 0
    terms.append(custom(K.LAYER_TEMPS, f"block {e - 1} forward, {_at(worst.op, e - 1)}: live in the block" +
                        ("" if held_in else " (its input included)"), T_, worst.live - held_in - kept,
                        "replay: the block's tensors alive then (saved tensors " +
                        ("offloaded)" if policy == "none" else "dropped by the checkpoint)"), _REPLAY_SOURCE))
    if held_in:
        terms.append(custom(K.CHECKPOINT_INPUTS, f"the input of block {e - 1}, kept by its checkpoint", A_, held_in,
                            "r x h x d", "labkit.recompute.checkpoint keeps a region's inputs"))
    if kept:
        terms.append(custom(K.CHECKPOINT_INPUTS, f"block {e - 1}'s outputs selective checkpointing has cached so far",
                            A_, kept, "replay: the policy's outputs made by then", "labkit.recompute.selective"))
    return [_m(MK.BLOCK_FORWARD, e - 1,
               "forward", f"inside block {e - 1}'s forward ({_at(worst.op, e - 1)})" + sfx, terms)]


def _replayed_backward(st: _Step) -> tuple[list[Moment], list[Moment]]:
    """Each unit's backward: for a checkpointed unit, its recompute (every block's saved tensors made again,
    autocast weight copies included) and then each block's backward ops; for offload, each block's ops with
    their saved tensors copied back. The head's weight copy went with the head's backward."""
    b, policy, offload, sizes, states, buffers = st.b, st.policy, st.offload, st.sizes, st.states, st.buffers
    grads_exist, step_in_backward, sfx = st.grads_exist, st.step_in_backward, st.sfx
    out, steps = [], []  # the blocks' moments; under step in backward, the moments their parameters step
    spans = _units(sizes)
    done_grads = 0  # gradients of the blocks whose backward is finished

    def grads_terms(extra: int) -> list[Term]:
        if grads_exist or step_in_backward:  # a tied head's gradient waits for the embedding's part
            return [b.term("head_held")] if b.head_held else []
        t = _head_grads(b)
        if done_grads + extra:
            t.append(custom(K.BLOCK_GRADIENTS, "gradients of the finished blocks", G_, done_grads + extra,
                            "replay: each block's parameter gradients", "AccumulateGrad"))
        return t

    for j in reversed(range(len(spans))):
        s, e = spans[j]
        unit = f"block {s}" if e - s == 1 else f"segment {j} (blocks {s}-{e - 1})"
        base = [*states, *buffers, b.term("inputs"), *([] if offload else [b.term("before")]),
                *checkpoint_held(b, policy, offload, sizes, j)]
        kwargs = _kwargs(b, policy, offload)  # until the first unit's recompute, the last to run
        if policy == "none" and not offload:  # nothing checkpointed or offloaded: every saved tensor is alive
            for k in reversed(range(s, e)):
                r = b.replays[k]
                w = r.plain_later if grads_exist or step_in_backward else r.plain
                terms = [*states, *buffers, b.term("inputs"), b.term("before"),
                         *_held_terms(b, policy, offload, sizes, k), *grads_terms(0)]
                copies = sum(b.replays[i].copies_saved for i in range(k))
                if copies:
                    terms.append(custom(K.COPIES_16BIT, f"autocast weight copies saved by blocks 0-{k - 1}", P_, copies,
                                        "2 x the weights their matmuls save (for dx)",
                                        "autograd keeps a matmul's 16-bit weight copy until that node's backward"))
                if r.input_saved:
                    terms.append(custom(K.BLOCK_INPUT, f"the input of block {k}, saved by it", A_, r.input_saved,
                                        "r x h x d", "derivatives.yaml", block=k))
                if step_in_backward:
                    steps += _step_moment(b, list(terms), w.step, k, sfx, plain=True)
                terms += _saved_terms(w, k)
                stolen, held = _stolen(w, k, step_in_backward)
                terms += [_bwd_term(w, k, offload=False, plain=True, less=stolen), *held]
                if w.grads:
                    terms.append(_wgrad_term(w, k, grads_exist))
                out.append(_m(MK.BLOCK_BACKWARD, k, "backward", f"block {k} backward, {_at(w.op, k)}" + sfx, terms))
                done_grads += r.wgrad_bytes
            continue
        if policy == "none":  # offloaded blocks (with checkpointing, a region's own hooks win: recomputed)
            for k in reversed(range(s, e)):
                r = b.replays[k]
                w = r.offload_later if grads_exist or step_in_backward else r.offload
                stolen, held = _stolen(w, k, step_in_backward)
                terms = [*base, *grads_terms(0), _bwd_term(w, k, offload=True, less=stolen), *held]
                if w.grads:
                    terms.append(_wgrad_term(w, k, grads_exist))
                out.append(_m(MK.BLOCK_BACKWARD, k, "backward", f"block {k} backward, {_at(w.op, k)}" + sfx, terms))
                if step_in_backward:
                    steps += _step_moment(b, terms[:-1], w.step, k, sfx)
                done_grads += r.wgrad_bytes
            continue
        unit_held = [custom(K.CHECKPOINT_INPUTS, f"the input of {unit}", A_, b.replays[s].input_bytes, "r x h x d",
                            "labkit.recompute.checkpoint keeps a region's inputs")]
        # the recompute: the unit's forward again, everything saved; the gradient of its output waits
        sel = policy == "selective"

        def saved_by(k: int) -> int:
            return b.replays[k].saved_sel if sel else b.replays[k].saved_bytes

        earlier = sum(saved_by(k) + b.replays[k + 1].input_saved for k in range(s, e - 1))
        last = b.replays[e - 1]
        rec = last.recompute_sel if sel else last.recompute
        # its input: the unit's own (held) or the block before's output (counted in `earlier` when saved)
        rec_live = rec.live - (last.input_bytes if e - 1 == s else last.input_saved)
        cached = [custom(K.CHECKPOINT_INPUTS, f"outputs selective checkpointing keeps in {unit}", A_,
                         sum(b.replays[i].kept_bytes for i in range(s, e - 1)),
                         "replay: the outputs of the policy's ops", "labkit.recompute.selective")] if sel and e - s > 1 else []
        terms = [*base, *kwargs, *unit_held, *cached, *grads_terms(0),
                 custom(K.LAYER_TEMPS,
                        "gradients made before the recompute (the unit's output's and those of the ops that "
                        "save nothing)", T_, last.offload.trigger, "replay: the backward up to the first node "
                        "that reads a saved tensor", _REPLAY_SOURCE)]
        if earlier:
            terms += _recomputed(b, "saved by the unit's earlier blocks (recomputed)", earlier, range(s, e - 1), sel,
                                 running=True)
        terms += _split(K.LAYER_TEMPS, f"block {e - 1} recompute, {_at(rec.op, e - 1)}: live in the block",
                        rec_live, rec.params, rec.kept if sel else 0,
                        "replay: the block's forward with every saved tensor kept")
        out.append(_m(MK.RECOMPUTE, s if e - s == 1 else None, "backward", f"{unit} recompute" + sfx, terms))
        # each block's backward, the unit's last first; the earlier blocks' recomputed tensors wait
        unit_grads = 0
        for k in reversed(range(s, e)):
            r = b.replays[k]
            # once recomputed, a block holds its saved tensors (selective: the cached outputs autograd saves
            # among them; the others went with the recompute), each until its last reader
            w = r.recomputed_later if grads_exist or step_in_backward else r.recomputed
            wait = sum(saved_by(i) for i in range(s, k)) + sum(b.replays[i].input_saved for i in range(s + 1, k + 1))
            # the recompute over, the region lets its input go; it stays only if the first block saved it
            kept_in = [custom(K.CHECKPOINT_INPUTS,
                              f"the input of {unit}, saved by its first block", A_, b.replays[s].input_saved,
                              "r x h x d", "the recompute's saved tensors")] if b.replays[s].input_saved else []
            terms = [*base, *(kwargs if j else []), *kept_in, *grads_terms(unit_grads)]
            if wait:
                terms += _recomputed(b, "saved by the unit's earlier blocks (recomputed), waiting", wait,
                                     range(s, k), sel)
            if step_in_backward:
                steps += _step_moment(b, list(terms), w.step, k, sfx, sel=sel)
            stolen, held = _stolen(w, k, step_in_backward)
            terms += _split(K.LAYER_TEMPS, f"block {k} backward, {_at(w.op, k)}: recomputed saved tensors still "
                            "needed, gradients and temporaries", w.live - stolen, w.copies, w.kept if sel else 0,
                            "replay: the output's gradient, each node's saved tensors until their last reader, "
                            "its gradients and temporaries") + held
            if w.grads:
                terms.append(_wgrad_term(w, k, grads_exist))
            out.append(_m(MK.BLOCK_BACKWARD, k, "backward", f"block {k} backward, {_at(w.op, k)}" + sfx, terms))
            unit_grads += r.wgrad_bytes
        done_grads += unit_grads
    return out, steps


def _split(key: TermKey, name: str, nbytes: int, params: int, kept: int, formula: str) -> list[Term]:
    """Bytes a recompute or a recomputed block's backward holds, by lesson 00's categories: the tensors the
    recompute makes are temporaries (made in backward, not by the forward), its autocast weight copies parameter
    memory (the ledger tags a cast of a parameter so), selective's cached outputs among them activations (the
    forward made them and held them until backward)."""
    out = [custom(key, name, T_, nbytes - params - kept, formula, _REPLAY_SOURCE)]
    if params:
        out.append(custom(K.COPIES_16BIT, name.split(":")[0] + ": autocast weight copies made again", P_, params,
                          "2 x the weights its matmuls read", "torch.autocast casts each weight again in the "
                          "recompute; the ledger counts a parameter's cast as parameter memory"))
    if kept:
        out.append(custom(K.CHECKPOINT_INPUTS, name.split(":")[0] + ": selective's cached outputs", A_, kept,
                          "replay: the policy's outputs autograd saves", "labkit.recompute.selective hands the "
                          "forward's outputs back to the recompute"))
    return out


def _recomputed(b: StepBytes, name: str, nbytes: int, blocks, sel: bool, running: bool = False) -> list[Term]:
    """The saved tensors of a unit's earlier `blocks`, made again by its recompute (`_split`'s categories):
    each block's autocast weight copies, and under selective its cached outputs, are apart. running: the
    recompute has not returned, so its autocast cache still holds every trained weight's copy, saved or not
    (a LoRA adapter whose input needs no gradient saves none); after it, the saved copies only."""
    params = sum(b.replays[i].copies_saved for i in blocks)
    if running:
        cached = sum(b.replays[i].cached_bytes + b.replays[i].copies_frozen - b.replays[i].copies_saved
                     for i in blocks)
        nbytes, params = nbytes + cached, params + cached
    kept = sum(b.replays[i].kept_saved for i in blocks) if sel else 0
    return _split(K.RECOMPUTED, name, nbytes, params, kept, "replay: saved tensors and autocast weight copies")


def _step_moment(b: StepBytes, terms: list[Term], w, k: int, sfx: str, plain: bool = False,
                 sel: bool = False) -> list[Moment]:
    """Block k's backward when one of its parameters steps (labkit.optim.StepInBackward: as soon as its node
    has returned): what is alive then, that gradient, and a step's temporaries (the block's largest tensor's).
    What is alive is split by lesson 00's categories as the block's backward is: plain (nothing recomputed
    or offloaded), the forward's saved tensors are activations (`_saved_terms`); recomputed, `_split`'s
    (sel: selective's cached outputs are activations). GaLore: one moment in a steady step and one in a
    projector-refresh step (its SVD's temporaries, the old projector freed), as `_steps_in_backward`'s."""
    grad, op = (w.grads, w.op) if w is not None else (0, "")
    name = f"block {k} backward when a parameter's gradient is ready: live"
    formula = "replay: the backward up to that node"
    if w is None:
        live = [custom(K.LAYER_TEMPS, name, T_, 0, formula, _REPLAY_SOURCE)]
    elif plain:
        live = [*_saved_terms(w, k), custom(K.LAYER_TEMPS, name, T_, w.live - w.saved, formula, _REPLAY_SOURCE)]
    else:
        live = _split(K.LAYER_TEMPS, name, w.live, w.params, w.kept if sel else 0, formula)
    runs = [(b.block_step, "", None)]
    if b.block_refresh is not None:
        runs = [(b.block_step, f", {STEADY}", STEADY), (b.block_refresh, f", {REFRESH}", REFRESH)]
    return [_m(MK.PARAMETER_STEP, k, "optimizer", f"block {k} backward, {_at(op, k)}" + kind + sfx, [
        *terms,
        *live,
        custom(K.GRADIENTS, "the stepping parameter's gradient", G_, grad, "replay: the parameter's gradient",
               "labkit.optim.StepInBackward"),
        custom(K.OPTIMIZER_TEMPS,
               "its optimizer step's temporaries", T_, step[1], "the block's largest tensor's step "
               "(optim_terms.tensor_step_bytes)", "torch.optim single-tensor step; labkit.optim's update of one tensor"),
        custom(K.STEP_CAST,
               "its step's fp32 working copy of the parameter", P_, step[2], "4 x its elements (16-bit) or 0",
               "labkit.optim: p.float(), counted as parameter memory"),
        *_freed_projector(-step[3] if len(step) > 3 else 0)], v) for step, kind, v in runs]


def _saved_terms(w, k: int) -> list[Term]:
    """Nothing recomputed or offloaded: the saved tensors block k's backward still needs were made by the
    forward, so they are activations (the ledger's tag for what the forward made and backward starts with),
    and the autocast weight copies among them parameter memory (the ledger tags a parameter's cast so)."""
    out = []
    if w.saved - w.copies:
        out.append(custom(K.SAVED_ACTIVATIONS,
                          f"block {k}'s saved tensors still needed at {_at(w.op, k)}", A_, w.saved - w.copies,
                          "replay: each saved tensor until its last reader", _REPLAY_SOURCE, block=k))
    if w.copies:
        out.append(custom(K.COPIES_16BIT,
                          f"block {k}'s autocast weight copies still needed at {_at(w.op, k)}", P_, w.copies,
                          "2 x the weights its matmuls save (for dx), until their node's backward",
                          "autograd keeps a matmul's 16-bit weight copy until that node's backward", block=k))
    return out


def _bwd_term(w, k: int, offload: bool, plain: bool = False, less: int = 0) -> Term:
    """Block k's backward at its worst op: what lives in it then. plain (nothing recomputed or offloaded): the
    gradients and temporaries only, its saved tensors are `_saved_terms`. less: bytes counted apart
    (`_stolen`)."""
    held = "recomputed saved tensors still needed, "
    what = "copied-back saved tensors, " if offload else "" if plain else held
    return custom(K.LAYER_TEMPS, f"block {k} backward, {_at(w.op, k)}: {what}gradients and temporaries",
                  T_, w.live - (w.saved if plain else 0) - less, "replay: the output's gradient, each node's " +
                  ("saved tensors copied back (labkit.recompute.offload_activations unpacks on use)" if offload
                   else "saved tensors until their last reader") + ", its gradients and temporaries", _REPLAY_SOURCE)


def _stolen(w, k: int, step_in_backward: bool) -> tuple[int, list[Term]]:
    """Under step in backward, the parameter gradients a block's backward has made but not yet stepped
    (`Worst.new_grads`): with no .grad before them (one micro-batch), AccumulateGrad stores each as the
    parameter's .grad itself, so they are gradient memory, not temporaries, until the hook frees them.
    Returns their bytes (to take out of the block's temporaries) and their term."""
    if not step_in_backward or not w.new_grads:
        return 0, []
    return w.new_grads, [custom(K.NEW_GRADIENT,
                                f"block {k}: a parameter's gradient, its .grad until its hook steps it", G_,
                                w.new_grads, "replay: the parameter's gradient (x d)",
                                "AccumulateGrad stores it as .grad; labkit.optim.StepInBackward frees it", k)]


def _wgrad_term(w, k: int, later: bool = False) -> Term:
    if later:  # a later micro-batch: the new gradient exists until AccumulateGrad has added it into .grad
        return custom(K.NEW_GRADIENT,
                      f"block {k}: a parameter's new gradient, before it is summed into .grad", T_, w.grads,
                      "replay: the parameter's gradient (x d)", "AccumulateGrad adds it into the existing .grad", k)
    return custom(K.GRADIENTS_SO_FAR,
                  f"block {k}'s parameter gradients made so far", G_, w.grads, "replay: AccumulateGrad in reverse",
                  "autograd makes a weight's gradient at its op's backward", k)


def _forward_block(st: _Step, plain: bool = False) -> list[Moment]:
    """Inside the last block's forward (nothing checkpointed or offloaded): at the block's end and, from the
    replay of its ops with every saved tensor kept (plain), at its worst moment."""
    b, policy, offload, sizes, states, buffers = st.b, st.policy, st.offload, st.sizes, st.states, st.buffers
    sfx = st.sfx
    out = []
    L = sum(sizes)
    extra = [custom(K.FORWARD_LOCALS, "transformers' 4-D float attention mask", T_, b.forward_extra, "B x S x S x d",
                    "made once per forward by the model's masking utilities")] if b.forward_extra else []
    extra += [b.term("forward_locals")] if b.forward_locals else []
    if extra:  # the blocks' end: all saved, nothing freed yet
        out.append(_m(MK.BLOCK_FORWARD, L - 1, "forward", f"the end of block {L - 1}" + sfx, [
            *states, *b.state("C"), *buffers, b.term("inputs"), b.term("before"),
            *_held_terms(b, policy, offload, sizes, L), *extra,
            b.term("stream", name="the last block's output projection and residual sum", nbytes=2 * b.stream,
                   as_key=K.LAYER_TEMPS)]))
    if plain:
        last = b.replays[L - 1]
        worst = last.full
        # the blocks before hold their autocast weight copies (the cache, and a frozen weight's copy saved for
        # dx); the last block's so far: cached ones apart, frozen ones among its live tensors; the head's later
        copies = b.C - b.head_copy - last.cached_bytes - last.copies_frozen + worst.cached
        terms = [*states, *buffers, b.term("inputs"), b.term("before"),
                 *_locals(b, False, False, L == 1 or b.replays[0].input_saved > 0),
                 *_held_terms(b, policy, offload, sizes, L - 1)]
        if copies:
            terms.append(custom(K.COPIES_16BIT,
                                "autocast 16-bit weight copies made so far (the blocks before, this block's up to "
                                "the op)", P_, copies, "2 x the matmul weights passed (trained: cached; frozen: saved "
                                "for dx)", "torch.autocast's weight cast cache; autograd's saved tensors"))
        # what the block saved so far lives on into backward: activations (and a frozen weight's saved copy,
        # parameter memory) in the ledger, which tags what the forward made by whether backward starts with it
        if worst.saved - worst.copies:
            terms.append(custom(K.SAVED_ACTIVATIONS,
                                f"block {L - 1} forward, {_at(worst.op, L - 1)}: what the block saved so far (its "
                                "input if it saves it)", A_, worst.saved - worst.copies,
                                "replay: the block's ops with every saved tensor kept", _REPLAY_SOURCE))
        if worst.copies:
            terms.append(custom(K.COPIES_16BIT,
                                f"block {L - 1} forward: frozen weights' autocast copies it saved so far", P_,
                                worst.copies, "2 x the frozen matmul weights passed (saved for dx)",
                                "autograd's saved tensors"))
        terms.append(custom(K.LAYER_TEMPS,
                            f"block {L - 1} forward, {_at(worst.op, L - 1)}: live in the block and not saved "
                            "(temporaries, its input if not saved)", T_, worst.live - worst.saved,
                            "replay: the block's ops with every saved tensor kept", _REPLAY_SOURCE))
        out.append(_m(MK.BLOCK_FORWARD, L - 1,
                      "forward", f"inside block {L - 1}'s forward ({_at(worst.op, L - 1)})" + sfx, terms))
        return out
    return out


def _freed_projector(nbytes: int) -> list:
    """GaLore's refresh: the refreshed matrix's old projector, gone from the state at the refresh's worst moment."""
    return [custom(K.OPTIMIZER_STATE, "the refreshed matrix's old projector, freed before its SVD", O_, -nbytes,
                   "r k x its bytes (optim_terms.galore_refresh_split)",
                   "labkit.optim GaLore: state.pop('projector') before make_projector")] if nbytes else []


_RELEASED = "autograd releases a node's saved tensors when it returns; the step runs after (AccumulateGrad's hook)"


def _steps_in_backward(b: StepBytes, head: Moment, end: Moment, sfx: str, head_freed: tuple) -> list[Moment]:
    """The backward moments at which a parameter outside the blocks steps (the blocks' are their replays'):
    the head's (untied head; head_freed: (copy, saved input, transient gradients) its node freed before) or
    the last one's (the tied embedding), and a position table's."""
    def stepping(x: Moment, step: tuple, freed=(0, 0, 0), where: str = "", variant: Variant | None = None) -> Moment:
        keep = [t for t in x.terms if t.category is not G_]
        return _m(MK.PARAMETER_STEP, x.block, "optimizer", where + sfx, [
            *keep,
            custom(K.GRADIENTS, "the stepping parameter's gradient", G_, step[0], "largest gradient of the unit x d",
                   "labkit.optim.StepInBackward"),
            custom(K.OPTIMIZER_TEMPS,
                   "its optimizer step's temporaries", T_, step[1], "one tensor's step (optim_terms.tensor_step_bytes)",
                   "torch.optim single-tensor step; labkit.optim's update of one tensor"),
            custom(K.STEP_CAST,
                   "its step's fp32 working copy of the parameter", P_, step[2], "4 x its elements (16-bit) or 0",
                   "labkit.optim: p.float(), counted as parameter memory"),
            *_freed_projector(-step[3] if len(step) > 3 else 0),
            custom(K.COPIES_16BIT,
                   "freed before the step: its autocast copy", P_, -freed[0], "the stepped matrix's 16-bit copy",
                   _RELEASED),
            custom(K.SAVED_ACTIVATIONS,
                   "freed before the step: its saved input", A_, -freed[1], "the stepped matmul's input", _RELEASED),
            custom(K.LAYER_TEMPS,
                   "freed before the step: transient gradients", T_, -freed[2], "all but its input gradient",
                   _RELEASED),
        ], variant)

    runs = [(b.rest_step, b.tied_step, "", None)]
    if b.block_refresh is not None:  # GaLore: each step in a steady step and in a projector-refresh step
        runs = [(b.rest_step, b.tied_step, f", {STEADY}", STEADY),
                (b.rest_refresh, b.tied_refresh, f", {REFRESH}", REFRESH)]
    out = []
    for rest_step, tied_step, kind, v in runs:
        # the tied matrix steps once the embedding's dense gradient is summed into it (that sum is its .grad);
        # the other parameters outside the blocks (a position embedding) step before, beside the head's part
        if b.head_held:
            out.append(stepping(end, tied_step, (0, 0, b.emb_temp), "the tied embedding steps" + kind, v))
            if rest_step[0]:
                held = dataclasses.replace(end, terms=
                              [t for t in end.terms if t != b.term("emb_temp")] + [b.term("head_held")])
                out.append(stepping(held, rest_step,
                                    where="the position embedding steps (the tied head's gradient held)" + kind,
                                    variant=v))
        elif rest_step[0]:  # (a frozen head, under LoRA, steps nothing)
            out.append(stepping(head, rest_step, head_freed, "the head steps" + kind, v))
    return out
