"""What a step holds across its phases: the checkpointed units' inputs and arguments, the blocks' saved
activations, autocast's weight copies; and `StepContext`, what the moments of one step share
(labkit.estimate.moments)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from labkit.memory.report import Term, TermKey

from .step_bytes import A_, G_, K, P_, T_, StepBytes, custom



def tied(b: StepBytes) -> bool:
    """The head's matrix is the token embedding's (a tied matrix trained whole on this device): the embedding's
    backward makes the dense gradient and the sum with the head's part."""
    return bool(b.head_held) and b.emb_temp == 2 * b.head_held


def head_grads(b: StepBytes) -> list[Term]:
    """The head's gradients after its backward and the final norm's (first micro-batch). A tied output matrix's
    part is no .grad yet: autograd holds it until the embedding's part is added, and the sum becomes .grad, so
    until then it is a gradient in flight (TEMP), as the ledger tags it; the final norm's are gradients."""
    if not b.head_grad:
        return []
    if not tied(b):
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


def held_terms(b: StepBytes, policy: str, offload: bool, sizes: list[int], units: int) -> list[Term]:
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
                       "copies", REPLAY_SOURCE)]
    return [b.term("layer", blocks, f"saved by {blocks} block(s)")]


def block_saved(b: StepBytes, k: int) -> int:
    """Activations block k saves for backward: its replay's saved storages (a view saved keeps its whole base),
    its input when a node of the block saves it, without the autocast weight copies (model-state bytes)."""
    r = b.replays[k]
    return r.saved_bytes + r.input_saved - r.copies_saved


# ---- checkpointed and offloaded steps: the blocks' replayed ops (labkit.estimate.tape) -------------------
REPLAY_SOURCE = "labkit.estimate.tape: the block's ops replayed (families.py records them from the model's code)"


def at_block(op: str, k: int) -> str:
    """An op's name with block k's index (blocks with the same ops are replayed once, under the first's names)."""
    return re.sub(r"(?<=[A-Za-z_])\.\d+\b", f".{k}", op)


def unit_spans(sizes: list[int]) -> list[tuple[int, int]]:
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
    spans = unit_spans(sizes)[:units]
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


def region_kwargs(b: StepBytes, policy: str, offload: bool) -> list[Term]:
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


def forward_copies(b: StepBytes, policy: str, offload: bool) -> list[Term]:
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


def split_recomputed(key: TermKey, name: str, nbytes: int, params: int, kept: int, formula: str) -> list[Term]:
    """Bytes a recompute or a recomputed block's backward holds, by lesson 00's categories: the tensors the
    recompute makes are temporaries (made in backward, not by the forward), its autocast weight copies parameter
    memory (the ledger tags a cast of a parameter so), selective's cached outputs among them activations (the
    forward made them and held them until backward)."""
    out = [custom(key, name, T_, nbytes - params - kept, formula, REPLAY_SOURCE)]
    if params:
        out.append(custom(K.COPIES_16BIT, name.split(":")[0] + ": autocast weight copies made again", P_, params,
                          "2 x the weights its matmuls read", "torch.autocast casts each weight again in the "
                          "recompute; the ledger counts a parameter's cast as parameter memory"))
    if kept:
        out.append(custom(K.CHECKPOINT_INPUTS, name.split(":")[0] + ": selective's cached outputs", A_, kept,
                          "replay: the policy's outputs autograd saves", "labkit.recompute.selective hands the "
                          "forward's outputs back to the recompute"))
    return out


def saved_terms(w, k: int) -> list[Term]:
    """Nothing recomputed or offloaded: the saved tensors block k's backward still needs were made by the
    forward, so they are activations (the ledger's tag for what the forward made and backward starts with),
    and the autocast weight copies among them parameter memory (the ledger tags a parameter's cast so)."""
    out = []
    if w.saved - w.copies:
        out.append(custom(K.SAVED_ACTIVATIONS,
                          f"block {k}'s saved tensors still needed at {at_block(w.op, k)}", A_, w.saved - w.copies,
                          "replay: each saved tensor until its last reader", REPLAY_SOURCE, block=k))
    if w.copies:
        out.append(custom(K.COPIES_16BIT,
                          f"block {k}'s autocast weight copies still needed at {at_block(w.op, k)}", P_, w.copies,
                          "2 x the weights its matmuls save (for dx), until their node's backward",
                          "autograd keeps a matmul's 16-bit weight copy until that node's backward", block=k))
    return out


@dataclass(frozen=True)
class StepContext:
    """What the moments of one step share (`step_context` makes it from step_moments' checked arguments)."""

    b: StepBytes  # the step's byte counts
    policy: str  # the checkpointing policy (POLICIES)
    offload: bool  # saved activations offloaded to host memory
    sizes: list[int]  # blocks per checkpointed unit (segments_of)
    states: list[Term]  # parameters, optimizer state and, on a later micro-batch, the earlier gradients
    base_states: list[Term]  # parameters and optimizer state alone
    buffers: list[Term]  # a quantized base's buffers
    grads_exist: bool  # a later micro-batch: every gradient already made
    step_in_backward: bool  # each parameter steps when its gradient is ready
    sfx: str  # appended to every moment's `where`: " (tag)" or ""
    replayed: bool  # checkpointed or offloaded, a replay per block: the blocks' moments from the replays
    plain: bool  # nothing checkpointed or offloaded, a replay per block: every saved tensor kept
    outside: list[Term]  # what is saved before the first block and after the last (not under offload)
    held_all: list[Term]  # what every unit holds until its backward
    kwargs: list[Term]  # the blocks' other arguments a checkpointed region keeps
    chunked: bool  # the chunked output loss: one chunk's gradients at a time
    ready: bool = False  # add each plain block's moment when its last parameter gradient is ready (ZeRO-2)


def step_context(b: StepBytes, n_layer: int, policy: str, segments: int | None, offload: bool,
                 grads_exist: bool, step_in_backward: bool, tag: str, ready: bool = False) -> StepContext:
    sizes = segments_of(n_layer, policy, segments)
    replayed = (policy != "none" or offload) and len(b.replays) == n_layer
    # nothing checkpointed or offloaded: the blocks' moments from their ops replayed with every saved tensor kept
    # (stepping in backward too, each gradient stepped and freed as made); without a replay per block, the
    # per-block terms of _plain_backward
    plain = policy == "none" and not offload and len(b.replays) == n_layer
    base_states = [*b.state("P"), *b.state("O")]
    states = list(base_states)
    if grads_exist:
        states.append(b.term("G", name="gradients of the earlier micro-batches"))
    outside = [] if offload else [b.term("before"), b.term("after", nbytes=b.after - b.lsm,
                                                             name="saved after the last block (but the log-softmax)")]
    held_all = (checkpoint_held(b, policy, offload, sizes, len(sizes)) if replayed
                else held_terms(b, policy, offload, sizes, len(sizes)))
    return StepContext(b, policy, offload, sizes, states, base_states, b.state("buffers"), grads_exist, step_in_backward,
                 f" ({tag})" if tag else "", replayed, plain, outside, held_all, region_kwargs(b, policy, offload),
                 bool(b.loss_grad), ready)
