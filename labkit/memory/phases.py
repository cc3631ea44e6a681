"""The phases of a training step as candidate moments, each a breakdown; the peak is the largest.

Forward peaks at the loss; backward is walked unit by unit (the loss, the head, each block, the
embedding), and what each block holds until its backward depends on the activation policy:

| policy | held per block until its backward | re-made during its backward |
|---|---|---|
| none | its saved activations A | - |
| full / sqrt (k segments) | each segment's input only | the whole segment's A (recompute) |
| selective ("matmuls") | input + matmul outputs | the rest of that block's A |
| offload | nothing on the device | that block's A, copied back |

Micro-batching runs this with the micro-batch's activations; from the second micro-batch on, every
gradient already exists, so the full gradient bytes sit under every moment.
"""

from __future__ import annotations

from dataclasses import dataclass

from .report import Breakdown, Category

POLICIES = ("none", "full", "sqrt", "selective")


@dataclass
class StepBytes:
    """What one micro-batch's walk and the model states give, in bytes."""

    P: int  # parameters (+ autocast copies, C)
    C: int  # autocast 16-bit weight copies (freed layer by layer in backward)
    G: int  # all gradients
    O: int  # optimizer state
    opt_temp: int  # the optimizer step's temporaries
    inputs: int  # token ids and targets of the whole batch
    before: int  # saved before the first block (embedding side)
    layer: int  # saved by one block
    kept: int  # kept by "matmuls" selective checkpointing in one block (matmul outputs)
    kept_saved: int  # the part of `kept` that autograd would have saved anyway
    after: int  # saved after the last block (final norm, log-softmax)
    lsm: int  # the log-softmax of the logits (part of `after`)
    logits: int  # logits and their fp32 copy while the loss runs
    head_temp: int  # head backward: gradient into the logits, dX, 16-bit dW
    head_grad: int  # the output matrix's gradient, made at the head
    stream: int  # gradient of the residual stream carried through backward
    tau: int  # a block's backward transient (MLP activation gradients)
    tau_grad: int  # one weight gradient before accumulation
    layer_grad: int  # gradients of one block's parameters
    layer_copy: int  # autocast copies of one block's weights
    head_copy: int  # autocast copy of the output matrix
    seg_input: int  # one block's input: the residual stream, B x S x h
    emb_temp: int  # the embedding's dense gradient (and the sum, when tied)
    fwd_block: int  # live inside one block's forward: residual in and mid, norm output, MLP in and out
    offload_back: int  # at a block's worst backward op with offload: the MLP input copied back and
    #                    two gradients of its size, or the same three for the attention probabilities
    buffers: int = 0  # int8/NF4 frozen base weights (BUFFER), there all the time
    dequant: int = 0  # scratch of dequantizing one quantized weight on the fly (forward and backward)
    # step-in-backward: (largest gradient, step temporaries) of one block's parameters and of the rest;
    # head_held: the tied head's partial gradient, held from the head until the embedding's part is added;
    # step_freed: what is gone from a block's worst moment when its largest matrix, the MLP's output
    # projection (backward's first), steps: its autocast copy and saved input, and of the MLP's transient
    # gradients all but that projection's input gradient
    block_step: tuple[int, int] = (0, 0)
    rest_step: tuple[int, int] = (0, 0)
    head_held: int = 0
    step_freed: tuple[int, int, int] = (0, 0, 0)
    head_freed: tuple[int, int, int] = (0, 0, 0)  # the same for an untied head: its copy, saved input, all but dX


def bd(param=0, grad=0, opt=0, act=0, temp=0) -> Breakdown:
    return Breakdown({Category.PARAM: param, Category.GRAD: grad, Category.OPT: opt,
                      Category.ACT: act, Category.TEMP: temp, Category.BUFFER: 0})


def segments_of(n: int, policy: str, segments: int | None) -> list[int]:
    """Block counts of the checkpointed segments (even split, as labkit.recompute.segment_bounds)."""
    if policy in ("none", "selective"):
        return [1] * n
    k = max(1, round(n**0.5)) if policy == "sqrt" else (n if segments is None else segments)
    if not (isinstance(k, int) and 1 <= k <= n):
        raise ValueError(f"segments must be an integer from 1 to the number of blocks ({n}), got {segments!r}")
    return [(i + 1) * n // k - i * n // k for i in range(k)]


def held_per_unit(b: StepBytes, policy: str, offload: bool, sizes: list[int]) -> list[int]:
    """Bytes each unit (a segment, or a block) holds on the device from the forward to its backward."""
    if offload:
        return [0] * len(sizes)
    if policy == "none":
        return [b.layer] * len(sizes)
    if policy == "selective":
        return [b.seg_input + b.kept] * len(sizes)
    return [b.seg_input] * len(sizes)


def step_phases(b: StepBytes, n_layer: int, policy: str = "none", segments: int | None = None,
                offload: bool = False, grads_exist: bool = False, step_in_backward: bool = False
                ) -> dict[str, Breakdown]:
    """Peak breakdown of each phase. grads_exist: a later micro-batch (all gradients already made).
    step_in_backward: each gradient is stepped and freed when made, so backward holds about one at a
    time; the "optimizer" phase is then the moments inside backward where a parameter steps (the
    ledger's phase while any optimizer's step runs): a block's moment plus the step of its largest
    parameter, and the head's (untied) or the embedding's (tied) moment plus the largest other one's."""
    sizes = segments_of(n_layer, policy, segments)
    held = held_per_unit(b, policy, offload, sizes)
    outside = 0 if offload else b.before + b.after - b.lsm  # saved outside the blocks, but the loss
    A_fwd = b.inputs + outside + sum(held)  # saved when the loss starts (the token ids stay)
    G0 = b.G if grads_exist else 0
    base = b.P + b.C
    fwd = bd(base, G0, b.O, A_fwd + b.lsm, b.logits)
    if b.dequant:  # a quantized base: the last block dequantizes its largest weight before the loss
        fwd = max(fwd, bd(base, G0, b.O, A_fwd - outside + (0 if offload else b.before), b.dequant), key=lambda x: x.total)
    if policy != "none" or offload:  # little is held: the peak may sit inside a block's forward
        in_block = bd(base, G0, b.O, b.inputs + (0 if offload else b.before) + sum(held[:-1]), b.fwd_block)
        fwd = max(fwd, in_block, key=lambda x: x.total)
    # autocast's weight copies after the forward: all kept (none), the head's only (the blocks' copies
    # are not saved by a checkpointed region; its recompute casts again), or none (offloaded)
    recompute = policy != "none" and not offload
    kept_copies = b.P + (0 if offload else b.C if not recompute else b.head_copy)
    lsm_held = 0 if offload else b.lsm
    # the loss's two B*S*V gradients (plus the log-softmax copied back, if it was offloaded)
    start = bd(kept_copies, G0, b.O, A_fwd + lsm_held, 2 * b.lsm + b.lsm - lsm_held)
    head = bd(kept_copies, b.G if grads_exist else b.head_grad, b.O, A_fwd, b.head_temp)
    moments = [start, head]
    done = 0  # blocks whose backward is finished
    for j in reversed(range(len(sizes))):  # units, last first
        m = sizes[j]
        held_before = b.inputs + (0 if offload else b.before) + sum(held[:j])  # the head's are freed
        if policy == "none" and not offload:
            act, remade = held_before + m * b.layer, 0
        elif offload:  # copied back one by one as backward needs them, freed after their last use
            act, remade = held_before, b.offload_back
        else:  # recomputed: all of the unit's activations but what it held (its input, kept outputs)
            act, remade = held_before + held[j], m * b.layer - b.seg_input - (b.kept_saved if policy == "selective" else 0)
        grads = b.G if grads_exist else 0 if step_in_backward else b.head_grad + done * b.layer_grad
        if offload:
            copies = kept_copies  # none left on the device
        elif recompute:  # the head's copy is freed; the recomputed unit casts its weights again
            copies = kept_copies - b.head_copy + m * b.layer_copy
        else:  # each finished block's copies are freed
            copies = kept_copies - b.head_copy - done * b.layer_copy
        # offload_back includes its own transient; a quantized base dequantizes each weight again
        transient = b.stream + (0 if offload else max(b.tau, b.dequant)) + (b.head_held if step_in_backward else 0)
        moments.append(bd(copies, grads + b.tau_grad, b.O, act, remade + transient))
        done += m
    moments.append(bd(b.P, b.rest_step[0] if step_in_backward else b.G, b.O, b.inputs, b.stream + b.emb_temp))
    bwd = max(moments, key=lambda x: x.total)
    if step_in_backward:
        opt = max(_steps_in_backward(b, moments), key=lambda x: x.total)
    else:
        opt = bd(b.P, b.G, b.O, b.inputs, b.opt_temp)
    for x in (fwd, bwd, opt):
        x.bytes[Category.BUFFER] += b.buffers
    return {"forward": fwd, "backward": bwd, "optimizer": opt}


def _steps_in_backward(b: StepBytes, moments: list[Breakdown]) -> list[Breakdown]:
    """The backward moments at which a parameter steps: each block's (its largest parameter's gradient and
    step temporaries on top), and the head's (untied head) or the last one's (the tied embedding)."""
    def stepping(x: Breakdown, step: tuple[int, int], freed=(0, 0, 0)) -> Breakdown:
        y = Breakdown(dict(x.bytes))
        y.bytes[Category.GRAD] = step[0]
        y.bytes[Category.TEMP] += step[1] - freed[2]
        y.bytes[Category.PARAM] -= freed[0]
        y.bytes[Category.ACT] -= freed[1]
        return y

    out = [stepping(x, b.block_step, b.step_freed) for x in moments[2:-1]]
    # the tied matrix steps once the embedding's dense gradient is summed into it (that sum is its .grad)
    out.append(stepping(moments[-1], b.rest_step, (0, 0, b.emb_temp)) if b.head_held else stepping(moments[1], b.rest_step, b.head_freed))
    return out
