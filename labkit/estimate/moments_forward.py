"""The forward's moments: the loss, a dequantized weight, inside the last block's forward (labkit.estimate.moments)."""

from __future__ import annotations

from labkit.memory.report import Moment, Term

from .held import (REPLAY_SOURCE, StepContext, at_block, checkpoint_held, forward_copies, held_terms,
                   unit_spans)
from .step_bytes import A_, K, META, MK, P_, T_, StepBytes, custom, moment



def forward_moments(st: StepContext) -> list[Moment]:
    """The forward's candidates: the loss (every held activation, the logits and their log-softmax), the last
    block's dequantization, and inside the last block's forward."""
    b, offload, sfx = st.b, st.offload, st.sfx
    fwd_copies = forward_copies(b, st.policy, offload) if st.replayed else b.state("C")
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
        T_, b.lsm, META["lsm"]["formula"], "labkit.recompute.offload_activations packs saved tensors to the host")
    logits = [b.term("logits")]
    if offload and b.loss_grad:  # chunked output loss: one chunk's log-softmax on the device
        lsm, logits = b.term("lsm_chunk"), [b.term("logits_off")]
    elif b.lsm_not_yet:  # chunked: at the worst chunk's loss, the later chunks have no log-softmax yet
        logits.append(b.term("lsm_not_yet"))
    # the checkpointed regions hold the blocks' other arguments (the mask, rotary tables) from their forward on
    fwd = [moment(MK.LOSS, None, "forward", "the loss" + sfx, [*st.states, *fwd_copies, *st.buffers, b.term("inputs"),
                                                          *st.outside, *st.kwargs, *st.held_all, *held_final, lsm,
                                                          *logits])]
    if b.dequant and not (st.replayed or st.plain):  # no replay per block: the largest weight dequantized at the end
        head = 0 if st.replayed and offload and b.c_frozen_head else b.head_copy  # (an offloaded frozen one: gone)
        before_head = [custom(t.key, t.name + " (not the head's yet)", t.category, t.bytes - head, t.formula,
                              t.source) for t in fwd_copies[:1]] if fwd_copies and head else fwd_copies
        fwd.append(moment(MK.DEQUANT, None, "forward", "last block, dequantizing its largest weight" + sfx,
                      [*st.states, *before_head, *st.buffers, b.term("inputs"), *st.outside[:1], *st.held_all,
                       b.term("dequant")]))
    return fwd + (_replayed_forward(st) if st.replayed else _forward_block(st, st.plain))


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


def _replayed_forward(st: StepContext) -> list[Moment]:
    """Inside the last block's forward: the earlier units' held inputs, the last unit's input when the block
    is not its first, and the block's worst moment with nothing saved (or its matmul outputs cached)."""
    b, policy, offload, sizes, states, buffers = st.b, st.policy, st.offload, st.sizes, st.states, st.buffers
    sfx = st.sfx
    n_units = len(sizes)
    s, e = unit_spans(sizes)[-1]
    last = b.replays[e - 1]
    worst = last.kept if policy == "selective" else last.free
    copies = forward_copies(b, policy, offload)
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
    terms.append(custom(K.LAYER_TEMPS, f"block {e - 1} forward, {at_block(worst.op, e - 1)}: live in the block" +
                        ("" if held_in else " (its input included)"), T_, worst.live - held_in - kept,
                        "replay: the block's tensors alive then (saved tensors " +
                        ("offloaded)" if policy == "none" else "dropped by the checkpoint)"), REPLAY_SOURCE))
    if held_in:
        terms.append(custom(K.CHECKPOINT_INPUTS, f"the input of block {e - 1}, kept by its checkpoint", A_, held_in,
                            "r x h x d", "labkit.recompute.checkpoint keeps a region's inputs"))
    if kept:
        terms.append(custom(K.CHECKPOINT_INPUTS, f"block {e - 1}'s outputs selective checkpointing has cached so far",
                            A_, kept, "replay: the policy's outputs made by then", "labkit.recompute.selective"))
    return [moment(MK.BLOCK_FORWARD, e - 1,
               "forward", f"inside block {e - 1}'s forward ({at_block(worst.op, e - 1)})" + sfx, terms)]


def _forward_block(st: StepContext, plain: bool = False) -> list[Moment]:
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
        out.append(moment(MK.BLOCK_FORWARD, L - 1, "forward", f"the end of block {L - 1}" + sfx, [
            *states, *b.state("C"), *buffers, b.term("inputs"), b.term("before"),
            *held_terms(b, policy, offload, sizes, L), *extra,
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
                 *held_terms(b, policy, offload, sizes, L - 1)]
        if copies:
            terms.append(custom(K.COPIES_16BIT,
                                "autocast 16-bit weight copies made so far (the blocks before, this block's up to "
                                "the op)", P_, copies, "2 x the matmul weights passed (trained: cached; frozen: saved "
                                "for dx)", "torch.autocast's weight cast cache; autograd's saved tensors"))
        # what the block saved so far lives on into backward: activations (and a frozen weight's saved copy,
        # parameter memory) in the ledger, which tags what the forward made by whether backward starts with it
        if worst.saved - worst.copies:
            terms.append(custom(K.SAVED_ACTIVATIONS,
                                f"block {L - 1} forward, {at_block(worst.op, L - 1)}: what the block saved so far (its "
                                "input if it saves it)", A_, worst.saved - worst.copies,
                                "replay: the block's ops with every saved tensor kept", REPLAY_SOURCE))
        if worst.copies:
            terms.append(custom(K.COPIES_16BIT,
                                f"block {L - 1} forward: frozen weights' autocast copies it saved so far", P_,
                                worst.copies, "2 x the frozen matmul weights passed (saved for dx)",
                                "autograd's saved tensors"))
        terms.append(custom(K.LAYER_TEMPS,
                            f"block {L - 1} forward, {at_block(worst.op, L - 1)}: live in the block and not saved "
                            "(temporaries, its input if not saved)", T_, worst.live - worst.saved,
                            "replay: the block's ops with every saved tensor kept", REPLAY_SOURCE))
        out.append(moment(MK.BLOCK_FORWARD, L - 1,
                      "forward", f"inside block {L - 1}'s forward ({at_block(worst.op, L - 1)})" + sfx, terms))
        return out
    return out
