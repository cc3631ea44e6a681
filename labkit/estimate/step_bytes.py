"""What one micro-batch's walk and the model states give, in bytes (`StepBytes`): every number a moment uses,
each a field that carries its key, name, category, formula and source, so a moment is a list of those terms and
its bytes are their sum (labkit.estimate.moments)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from labkit.memory.report import Category, Moment, MomentKind, Term, TermKey, Variant

P_, B_, G_, O_, A_, T_ = (Category.PARAM, Category.BUFFER, Category.GRAD, Category.OPT, Category.ACT, Category.TEMP)
K, MK = TermKey, MomentKind
# GaLore's optimizer moments are named by the step they describe: `Estimate.without(REFRESH)` keeps the steady ones
REFRESH, STEADY = Variant.REFRESH, Variant.STEADY


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
        meta = META[key]
        n = getattr(self, key) if nbytes is None else nbytes
        formula = meta["formula"] if times == 1 else f"{times} x [{meta['formula']}]"
        return Term(name or meta["name"], meta["cat"], times * n, formula, meta["source"], key=as_key or meta["key"])


META = {f.name: f.metadata for f in fields(StepBytes) if f.metadata}


def moment(kind: MomentKind, block: int | None, phase: str, where: str, terms: list[Term],
       variant: Variant | None = None) -> Moment:
    return Moment(phase, where, terms, kind=kind, block=block, variant=variant)


def custom(key: TermKey, name: str, cat: Category, nbytes: int, formula: str, source: str = "",
           block: int | None = None) -> Term:
    return Term(name, cat, int(nbytes), formula, source, key=key, block=block)
