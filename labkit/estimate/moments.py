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

from labkit.memory.report import Moment

from .held import segments_of, step_context  # noqa: F401  (segments_of: lessons' and tests' import)
from .moments_backward import blocks_and_embedding, head_moments
from .moments_forward import forward_moments
from .moments_step import optimizer_moments
from .recipe import POLICIES  # noqa: F401  (labkit.recompute.segments' table)
from .step_bytes import REFRESH, STEADY, MomentKind, StepBytes  # noqa: F401  (REFRESH: Estimate.without's key)


def step_moments(b: StepBytes, n_layer: int, policy: str = "none", segments: int | None = None,
                 offload: bool = False, grads_exist: bool = False, step_in_backward: bool = False,
                 tag: str = "", ready: bool = False) -> list[Moment]:
    """Every candidate moment of one step. grads_exist: a later micro-batch (all gradients already made;
    `tag` names it). step_in_backward: each gradient is stepped and freed when made, so backward holds about
    one at a time; the optimizer's moments are then those inside backward where a parameter steps.
    A checkpointed or offloaded step takes its blocks' moments from the replays of their ops
    (labkit.estimate.tape; moments_forward and moments_backward). ready: also each plain block's moment
    when its last parameter gradient is made (MomentKind.GRADIENTS_READY, for ZeRO-2's reduce)."""
    st = step_context(b, n_layer, policy, segments, offload, grads_exist, step_in_backward, tag, ready)
    hb = head_moments(st)
    blocks, end, block_steps = blocks_and_embedding(st)
    return [*forward_moments(st), *hb.moments, *blocks, *optimizer_moments(st, hb, end, block_steps)]
