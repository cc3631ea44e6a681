"""The optimizer's moments: its step after backward (GaLore: steady and refreshing), or under step in
backward each moment a parameter steps inside backward (labkit.estimate.moments)."""

from __future__ import annotations

import dataclasses

from labkit.memory.report import Moment, Term, Variant

from .held import REPLAY_SOURCE, StepContext, at_block, saved_terms, split_recomputed
from .step_bytes import A_, G_, K, MK, O_, P_, T_, REFRESH, STEADY, StepBytes, custom, moment



def optimizer_moments(st: StepContext, hb, end: Moment, block_steps: list[Moment] | None) -> list[Moment]:
    """The optimizer's candidates: after backward (GaLore: a steady step and a projector-refresh one), or under
    step in backward the moments inside backward where a parameter steps (`hb`: the head's backward)."""
    b, sfx = st.b, st.sfx
    if st.step_in_backward:  # (always with replays: the blocks' steps are in block_steps)
        head, head_freed = hb.head, b.head_freed
        if st.chunked:  # the head's summed dW steps after the last chunk: every chunk's dX (cast) beside it;
            # the chunks' matmuls have returned, their weight copy and saved inputs freed (on the device)
            head = moment(MK.HEAD_AFTER, None, "backward", "after the last chunk's backward" + sfx,
                      [*hb.around, custom(K.HEAD_BACKWARD, "the chunks' input gradients (not yet concatenated)", T_,
                                          b.stream, "r x h x d",
                                          "each chunk's matmul backward (and its cast to the stream)")])
            head_freed = (0, 0, 0) if st.offload else (b.head_copy, b.chunk_inputs, 0)
        return [*_steps_in_backward(b, head, end, sfx, head_freed), *(block_steps or [])]
    opt = [*st.base_states, *st.buffers, *b.state("G"), b.term("inputs")]
    if b.opt_refresh:  # GaLore: a projector-refresh step and a steady one
        return [moment(MK.OPTIMIZER_STEP, None, "optimizer", f"the optimizer step, {STEADY}" + sfx,
                   [*opt, b.term("opt_temp")], STEADY),
                moment(MK.OPTIMIZER_STEP, None, "optimizer", f"the optimizer step, {REFRESH}" + sfx,
                   [*opt, b.term("opt_refresh"), *freed_projector(b.refresh_freed)], REFRESH)]
    return [moment(MK.OPTIMIZER_STEP, None, "optimizer", "the optimizer step" + sfx,
               [*opt, b.term("opt_temp"), b.term("opt_cast")])]


def block_step_moments(b: StepBytes, terms: list[Term], w, k: int, sfx: str, plain: bool = False,
                 sel: bool = False) -> list[Moment]:
    """Block k's backward when one of its parameters steps (labkit.optim.StepInBackward: as soon as its node
    has returned): what is alive then, that gradient, and a step's temporaries (the block's largest tensor's).
    What is alive is split by lesson 00's categories as the block's backward is: plain (nothing recomputed
    or offloaded), the forward's saved tensors are activations (`saved_terms`); recomputed, `split_recomputed`'s
    (sel: selective's cached outputs are activations). GaLore: one moment in a steady step and one in a
    projector-refresh step (its SVD's temporaries, the old projector freed), as `_steps_in_backward`'s."""
    grad, op = (w.grads, w.op) if w is not None else (0, "")
    name = f"block {k} backward when a parameter's gradient is ready: live"
    formula = "replay: the backward up to that node"
    if w is None:
        live = [custom(K.LAYER_TEMPS, name, T_, 0, formula, REPLAY_SOURCE)]
    elif plain:
        live = [*saved_terms(w, k), custom(K.LAYER_TEMPS, name, T_, w.live - w.saved, formula, REPLAY_SOURCE)]
    else:
        live = split_recomputed(K.LAYER_TEMPS, name, w.live, w.params, w.kept if sel else 0, formula)
    runs = [(b.block_step, "", None)]
    if b.block_refresh is not None:
        runs = [(b.block_step, f", {STEADY}", STEADY), (b.block_refresh, f", {REFRESH}", REFRESH)]
    return [moment(MK.PARAMETER_STEP, k, "optimizer", f"block {k} backward, {at_block(op, k)}" + kind + sfx, [
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
        *freed_projector(-step[3] if len(step) > 3 else 0)], v) for step, kind, v in runs]


def freed_projector(nbytes: int) -> list:
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
        return moment(MK.PARAMETER_STEP, x.block, "optimizer", where + sfx, [
            *keep,
            custom(K.GRADIENTS, "the stepping parameter's gradient", G_, step[0], "largest gradient of the unit x d",
                   "labkit.optim.StepInBackward"),
            custom(K.OPTIMIZER_TEMPS,
                   "its optimizer step's temporaries", T_, step[1], "one tensor's step (optim_terms.tensor_step_bytes)",
                   "torch.optim single-tensor step; labkit.optim's update of one tensor"),
            custom(K.STEP_CAST,
                   "its step's fp32 working copy of the parameter", P_, step[2], "4 x its elements (16-bit) or 0",
                   "labkit.optim: p.float(), counted as parameter memory"),
            *freed_projector(-step[3] if len(step) > 3 else 0),
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
