"""The backward's moments: the loss's and the head's backward, the final norm's, each block's (recomputed,
offloaded or as the forward left it) and the embedding's (labkit.estimate.moments)."""

from __future__ import annotations

from dataclasses import dataclass

from labkit.memory.report import Moment, Term

from .held import (REPLAY_SOURCE, StepContext, at_block, checkpoint_held, head_grads, held_terms, region_kwargs,
                   saved_terms, split_recomputed, tied, unit_spans)
from .moments_step import block_step_moments
from .step_bytes import A_, G_, K, META, MK, P_, T_, StepBytes, custom, moment



@dataclass(frozen=True)
class HeadBackward:
    """The loss's and the head's backward: their moments, and what the optimizer's moments start from."""

    moments: list[Moment]  # the loss's backward, the head's, and the final norm's when replayed
    head: Moment  # the head's backward (an untied head steps there under step in backward)
    around: list[Term]  # what is held beside the head's backward


def head_moments(st: StepContext) -> HeadBackward:
    """The backward from the loss to the last block: the loss's gradients, the head's backward (its worst chunk
    under the chunked loss), the chunks' gradients concatenated, the head's gradient cast to fp32, and the final
    norm's backward."""
    b, offload, grads_exist, sfx, chunked = st.b, st.offload, st.grads_exist, st.sfx, st.chunked
    # autocast's weight copies after the forward: all kept (none), the head's only (the blocks' copies
    # are not saved by a checkpointed region; its recompute casts again), or none (offloaded)
    if offload:
        copies = []
    elif st.policy != "none":
        copies = [b.term("head_copy")] if b.C else []
    else:
        copies = [*b.state("C"), *([b.term("C_unsaved", nbytes=-b.C_unsaved)] if b.C_unsaved else [])]
    loss_grads = [b.term("loss_grad_off" if offload else "loss_grad")] if chunked else [custom(
        K.LOSS_TEMPS, "the loss's gradients (dlogits, d log-softmax)", T_, 2 * b.lsm,
        "2 x r x V x (4 | m)", "nll_loss_backward, log_softmax_backward_data")]
    if chunked and b.lsm_gone and not offload:
        loss_grads.append(custom(K.LOG_SOFTMAX, META["lsm_gone"]["name"], A_, -b.lsm_gone,
                                 META["lsm_gone"]["formula"], META["lsm_gone"]["source"]))
    if offload and not chunked:
        loss_grads.append(custom(K.LOSS_TEMPS,
                                 "log-softmax copied back for the loss's backward", T_, b.lsm, "r x V x (4 | m)",
                                 "labkit.recompute.offload_activations: unpacked on use"))
    around = [*st.states, *copies, *st.buffers, b.term("inputs"), *st.outside, *st.kwargs, *st.held_all]
    start = moment(MK.LOSS_BACKWARD, None, "backward", "start: the loss's backward" + sfx,
               [*around, *([] if offload else [b.term("lsm")]), *loss_grads])
    head_grad = ([b.term("head_new")] if b.head_new else []) if grads_exist else head_grads(b)
    # inside the head's backward the final norm's gradients are not made yet (its backward runs next): the
    # output matrix's gradient alone (a tied one in flight, TEMP, until the embedding's part is summed with it)
    in_head = ([b.term("head_new")] if b.head_new else []) if grads_exist else \
        [b.term("head_held")] if tied(b) and b.head_grad else \
        [custom(K.HEAD_GRADIENTS,
                "output matrix gradient", G_, b.head_new, "V x h x d", "made at the head's backward")] \
        if b.head_grad else []
    # the chunked loss's saved tensors (hidden states, logsumexp, count) copied back for its backward
    loss_back = [b.term("loss_saved")] if offload and b.loss_saved else []
    # under autocast the head's matmul makes a 16-bit dW: its fp32 gradient (in_head) comes after, from the
    # weight copy's own node, once the matmul's node has returned and freed the copy it saved
    cast = bool(b.head_cast and not offload and in_head)
    # chunked: the output matrix's gradient is a sum over the chunks in autograd's buffer (in
    # head_temp, or head_sum: the sum that becomes .grad) until the last chunk
    worst = ", its worst chunk" if chunked else ""
    head = moment(MK.HEAD_BACKWARD, None, "backward", "the head's backward" + worst + sfx,
              [*around, *([] if cast or chunked else in_head), *loss_back, *_inputs_freed(b, offload, every=False),
               *_head_sum(b, grads_exist), b.term("head_temp")])
    moments = [start, head]
    if b.split_cat:  # chunked: after the last chunk, split's backward cats the input gradients
        moments.append(moment(MK.HEAD_AFTER, None, "backward",
                          "the chunks' input gradients concatenated" + sfx,
                          [*around, *_copy_freed(b, offload), *_inputs_freed(b, offload), *in_head,
                           b.term("split_cat")]))
    if cast:
        moments.append(moment(MK.HEAD_AFTER, None, "backward", "the head's weight gradient cast to fp32" + sfx, [
            *around, *_copy_freed(b, offload), *_inputs_freed(b, offload), *in_head, b.term("head_cast")]))
    if b.tail is not None and not st.step_in_backward and len(b.replays) == sum(st.sizes):
        # after the head: a later micro-batch's new head gradient was summed into .grad (a tied one waits)
        after_head = ([b.term("head_held")] if b.head_held else []) if grads_exist else head_grad
        moments.append(_tail_moment(st, after_head))
    return HeadBackward(moments, head, around)


def blocks_and_embedding(st: StepContext) -> tuple[list[Moment], Moment, list[Moment] | None]:
    """Each block's (or checkpointed unit's) backward, then the embedding's (a tied matrix's gradients summed
    after it): the moments, the embedding's moment, and under step in backward the blocks' parameter steps."""
    b, grads_exist, sfx = st.b, st.grads_exist, st.sfx
    block_steps = None
    if st.replayed or st.plain:
        block_moments, block_steps = _replayed_backward(st)
    else:
        block_moments = _plain_backward(st)
    rest = [custom(K.GRADIENTS, "gradients of the parameters outside the blocks (step in backward)", G_,
                   max(b.rest_step[0], b.tied_step[0]),
                   "largest such gradient x d", "labkit.optim.StepInBackward")] if st.step_in_backward \
        else b.state("G")
    base = [*st.base_states, *st.buffers, b.term("inputs"), *rest]
    end = moment(MK.EMBEDDING_BACKWARD, None, "backward", "the embedding's backward" + sfx,
             [*base, b.term("stream"), b.term("emb_dense") if grads_exist else b.term("emb_temp")])
    summed = "the tied embedding's gradients summed (the stream's gradient freed)" + sfx
    if tied(b) and not grads_exist and not st.step_in_backward:
        # a tied matrix: the embedding's node returns (its incoming gradient, the stream, freed) before autograd
        # sums its dense gradient with the head's part: two moments, not the stream beside both
        return [*block_moments,
                moment(MK.EMBEDDING_BACKWARD, None, "backward", "the embedding's backward" + sfx,
                   [*base, b.term("stream"), custom(K.EMBEDDING_GRADIENT,
                                                    "dense embedding gradient", T_, b.head_held,
                                                    "V x h x d", "embedding_dense_backward")]),
                moment(MK.EMBEDDING_SUM, None, "backward", summed, [*base, b.term("emb_temp")])], end, block_steps
    if b.head_held and b.emb_temp == 2 * b.head_held and grads_exist and not st.step_in_backward:
        # a tied matrix, gradients already there: the head's part, held since the head's backward, and the
        # embedding's dense part are summed into a new tensor before AccumulateGrad adds it in place (the stream's
        # gradient freed by then): three V x h tensors at once
        return [*block_moments, end,
                moment(MK.EMBEDDING_SUM, None, "backward", summed,
                   [*base, b.term("head_held"),
                    custom(K.EMBEDDING_TIED_SUM,
                           "dense embedding gradient and the tied sum", T_, 2 * b.head_held,
                           "2 x V x h x d", "embedding_dense_backward; autograd's sum of the two parts")])], \
            end, block_steps
    return [*block_moments, end], end, block_steps


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


def _tail_moment(st: StepContext, head_grad: list[Term]) -> Moment:
    """The final norm's backward, after the head's and before the last block's: every block's held tensors,
    the norm's saved tensors (copied back under offload) until their last reader, its gradients and
    temporaries (transformers' Python RMSNorm: pow's backward makes x^1 and 2x beside the gradients in flight,
    the mean's gradient and the x * rsqrt part waiting to be summed)."""
    b, policy, offload, states, buffers, grads_exist, sfx = (st.b, st.policy, st.offload, st.states, st.buffers,
                                                             st.grads_exist, st.sfx)
    kwargs, held_all = st.kwargs, st.held_all
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
                            "replay: each saved tensor until its last reader", REPLAY_SOURCE))
    terms.append(custom(K.LAYER_TEMPS,
                        f"the final norm's backward, {w.op}: " + ("its copied-back saved tensors, " if offload else "")
                        + "gradients and temporaries", T_, w.live - saved,
                        "replay: the norm's ops from its output's gradient", REPLAY_SOURCE))
    if w.grads:  # (a later micro-batch: the new gradient, until it is summed into .grad)
        terms.append(custom(K.HEAD_GRADIENTS,
                            "the final norm's weight gradients made so far", T_ if grads_exist else G_, w.grads,
                            "replay: AccumulateGrad", "autograd makes a weight's gradient at its op's backward"))
    return moment(MK.FINAL_NORM_BACKWARD, None, "backward", "the final norm's backward" + sfx, terms)


def _plain_backward(st: StepContext) -> list[Moment]:
    """Each block's backward from the walk's per-block bytes, where no block has a replay: a tensor-parallel
    rank's (its ops split; estimate_ranks refuses checkpointing, offload and the step in backward there)."""
    b, sizes, states, buffers, grads_exist = st.b, st.sizes, st.states, st.buffers, st.grads_exist
    n_layer = sum(sizes)
    block_moments = []
    for j in reversed(range(n_layer)):  # the last block first
        done = n_layer - 1 - j  # blocks whose backward is finished
        terms = [*states, *buffers, b.term("inputs"), b.term("before"), *held_terms(b, "none", False, sizes, j),
                 b.term("layer", 1, "saved by the block in backward")]
        if not grads_exist:
            terms += head_grads(b)
            if done:
                terms.append(b.term("layer_grad", done, f"gradients of the {done} finished block(s)"))
        if b.C:  # each finished block's copies are freed
            terms.append(b.term("C", nbytes=b.C - b.head_copy - done * b.layer_copy,
                                name=f"autocast copies of the {n_layer - done} blocks not finished"))
        terms += [b.term("stream"), b.term("tau_grad"), b.term("tau") if b.tau >= b.dequant else b.term("dequant")]
        block_moments.append(moment(MK.BLOCK_BACKWARD, j, "backward", f"block {j} backward" + st.sfx, terms))
    return block_moments


def _replayed_backward(st: StepContext) -> tuple[list[Moment], list[Moment]]:
    """Each unit's backward: for a checkpointed unit, its recompute (every block's saved tensors made again,
    autocast weight copies included) and then each block's backward ops; for offload, each block's ops with
    their saved tensors copied back. The head's weight copy went with the head's backward."""
    b, policy, offload, sizes, states, buffers = st.b, st.policy, st.offload, st.sizes, st.states, st.buffers
    grads_exist, step_in_backward, sfx = st.grads_exist, st.step_in_backward, st.sfx
    out, steps = [], []  # the blocks' moments; under step in backward, the moments their parameters step
    spans = unit_spans(sizes)
    done_grads = 0  # gradients of the blocks whose backward is finished

    def grads_terms(extra: int) -> list[Term]:
        if grads_exist or step_in_backward:  # a tied head's gradient waits for the embedding's part
            return [b.term("head_held")] if b.head_held else []
        t = head_grads(b)
        if done_grads + extra:
            t.append(custom(K.BLOCK_GRADIENTS, "gradients of the finished blocks", G_, done_grads + extra,
                            "replay: each block's parameter gradients", "AccumulateGrad"))
        return t

    for j in reversed(range(len(spans))):
        s, e = spans[j]
        unit = f"block {s}" if e - s == 1 else f"segment {j} (blocks {s}-{e - 1})"
        base = [*states, *buffers, b.term("inputs"), *([] if offload else [b.term("before")]),
                *checkpoint_held(b, policy, offload, sizes, j)]
        kwargs = region_kwargs(b, policy, offload)  # until the first unit's recompute, the last to run
        if policy == "none" and not offload:  # nothing checkpointed or offloaded: every saved tensor is alive
            for k in reversed(range(s, e)):
                r = b.replays[k]
                w = r.plain_later if grads_exist or step_in_backward else r.plain
                terms = [*states, *buffers, b.term("inputs"), b.term("before"),
                         *held_terms(b, policy, offload, sizes, k), *grads_terms(0)]
                copies = sum(b.replays[i].copies_saved for i in range(k))
                if copies:
                    terms.append(custom(K.COPIES_16BIT, f"autocast weight copies saved by blocks 0-{k - 1}", P_, copies,
                                        "2 x the weights their matmuls save (for dx)",
                                        "autograd keeps a matmul's 16-bit weight copy until that node's backward"))
                before_input = list(terms)
                if r.input_saved:
                    terms.append(custom(K.BLOCK_INPUT, f"the input of block {k}, saved by it", A_, r.input_saved,
                                        "r x h x d", "derivatives.yaml", block=k))
                if st.ready and w.last is not None:  # ZeRO-2 reduce-scatters the block's unit then
                    out.append(_ready_moment(st, before_input, terms[len(before_input):], w.last, k))
                if step_in_backward:
                    steps += block_step_moments(b, list(terms), w.step, k, sfx, plain=True)
                terms += saved_terms(w, k)
                stolen, held = _stolen(w, k, step_in_backward)
                terms += [_bwd_term(w, k, offload=False, plain=True, less=stolen), *held]
                if w.grads:
                    terms.append(_wgrad_term(w, k, grads_exist))
                out.append(moment(MK.BLOCK_BACKWARD, k, "backward", f"block {k} backward, {at_block(w.op, k)}" + sfx, terms))
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
                out.append(moment(MK.BLOCK_BACKWARD, k, "backward", f"block {k} backward, {at_block(w.op, k)}" + sfx, terms))
                if step_in_backward:
                    steps += block_step_moments(b, terms[:-1], w.step, k, sfx)
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
                        "that reads a saved tensor", REPLAY_SOURCE)]
        if earlier:
            terms += _recomputed(b, "saved by the unit's earlier blocks (recomputed)", earlier, range(s, e - 1), sel,
                                 running=True)
        terms += split_recomputed(K.LAYER_TEMPS, f"block {e - 1} recompute, {at_block(rec.op, e - 1)}: live in the block",
                        rec_live, rec.params, rec.kept if sel else 0,
                        "replay: the block's forward with every saved tensor kept")
        out.append(moment(MK.RECOMPUTE, s if e - s == 1 else None, "backward", f"{unit} recompute" + sfx, terms))
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
                steps += block_step_moments(b, list(terms), w.step, k, sfx, sel=sel)
            if st.ready and w.last is not None:  # ZeRO-2 reduce-scatters the block's unit then
                lw, gone = w.last, [] if w.last.input_alive else kept_in
                out.append(moment(MK.GRADIENTS_READY, k, "backward", f"block {k} backward, {at_block(lw.op, k)}" + sfx, [
                    *[t for t in terms if t not in gone],
                    *split_recomputed(K.LAYER_TEMPS, f"block {k} backward, {at_block(lw.op, k)}: recomputed saved "
                                      "tensors still needed, gradients and temporaries", lw.live, lw.copies,
                                      lw.kept if sel else 0, "replay: up to the block's last parameter gradient"),
                    _wgrad_term(lw, k)]))
            stolen, held = _stolen(w, k, step_in_backward)
            terms += split_recomputed(K.LAYER_TEMPS, f"block {k} backward, {at_block(w.op, k)}: recomputed saved tensors still "
                            "needed, gradients and temporaries", w.live - stolen, w.copies, w.kept if sel else 0,
                            "replay: the output's gradient, each node's saved tensors until their last reader, "
                            "its gradients and temporaries") + held
            if w.grads:
                terms.append(_wgrad_term(w, k, grads_exist))
            out.append(moment(MK.BLOCK_BACKWARD, k, "backward", f"block {k} backward, {at_block(w.op, k)}" + sfx, terms))
            unit_grads += r.wgrad_bytes
        done_grads += unit_grads
    return out, steps


def _ready_moment(st: StepContext, terms: list[Term], block_input: list[Term], w, k: int) -> Moment:
    """Block k's backward once its last parameter gradient is made (its node returned), nothing checkpointed:
    the block's saved tensors still needed (its input too, when a later node reads it), the gradients and
    temporaries alive, and all the block's parameter gradients. labkit.distributed.Zero's hook reduce-scatters
    the block's unit at this moment (ZeRO-2 over LoRA: the adapters' last gradient, inside the block's backward;
    zero_terms._reduce_moments adds the flat copy)."""
    return moment(MK.GRADIENTS_READY, k, "backward", f"block {k} backward, {at_block(w.op, k)}" + st.sfx, [
        *terms, *(block_input if w.input_alive else []), *saved_terms(w, k),
        custom(K.LAYER_TEMPS, f"block {k} backward, {at_block(w.op, k)}: gradients and temporaries", T_,
               w.live - w.saved, "replay: the output's gradient, each node's saved tensors until their last "
               "reader, its gradients and temporaries", REPLAY_SOURCE),
        _wgrad_term(w, k)])


def _recomputed(b: StepBytes, name: str, nbytes: int, blocks, sel: bool, running: bool = False) -> list[Term]:
    """The saved tensors of a unit's earlier `blocks`, made again by its recompute (`split_recomputed`'s categories):
    each block's autocast weight copies, and under selective its cached outputs, are apart. running: the
    recompute has not returned, so its autocast cache still holds every trained weight's copy, saved or not
    (a LoRA adapter whose input needs no gradient saves none); after it, the saved copies only."""
    params = sum(b.replays[i].copies_saved for i in blocks)
    if running:
        cached = sum(b.replays[i].cached_bytes + b.replays[i].copies_frozen - b.replays[i].copies_saved
                     for i in blocks)
        nbytes, params = nbytes + cached, params + cached
    kept = sum(b.replays[i].kept_saved for i in blocks) if sel else 0
    return split_recomputed(K.RECOMPUTED, name, nbytes, params, kept, "replay: saved tensors and autocast weight copies")


def _bwd_term(w, k: int, offload: bool, plain: bool = False, less: int = 0) -> Term:
    """Block k's backward at its worst op: what lives in it then. plain (nothing recomputed or offloaded): the
    gradients and temporaries only, its saved tensors are `saved_terms`. less: bytes counted apart
    (`_stolen`)."""
    held = "recomputed saved tensors still needed, "
    what = "copied-back saved tensors, " if offload else "" if plain else held
    return custom(K.LAYER_TEMPS, f"block {k} backward, {at_block(w.op, k)}: {what}gradients and temporaries",
                  T_, w.live - (w.saved if plain else 0) - less, "replay: the output's gradient, each node's " +
                  ("saved tensors copied back (labkit.recompute.offload_activations unpacks on use)" if offload
                   else "saved tensors until their last reader") + ", its gradients and temporaries", REPLAY_SOURCE)


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
