"""Checkpoint a model's blocks in k segments (none, every block, sqrt(n), or selective), reversibly.

The blocks are labkit GPT's `model.blocks`, transformers GPT-2's `model.transformer.h` or Llama's
`model.model.layers` (`find_blocks`), also with LoRA/QLoRA/LISA applied (they replace Linears inside the
blocks, never the block list).

With k segments of an n-block model, each checkpointed segment keeps only its input until backward
(k x B x T x C x bytes) and, while it is recomputed, holds one segment's activations again
(about n/k blocks' worth). Chen et al. 2016: k + n/k is smallest at k = sqrt(n) when a block's
activations cost as much as its input; with input a and block A it is k a + (n/k) A, smallest near
k = sqrt(n A / a) (`best_segments`). A transformer block costs A ~ 16-34 a, so shallow models are best
at k = n, deeper ones below it. Every checkpointed segment costs one extra forward.

`checkpoint_blocks(model, policy)` replaces the blocks' `forward` by instance attributes: a
segment's first block runs the whole segment inside one checkpoint, the others pass their input
through. `.remove()` (or leaving the `with` block) deletes those attributes; the model's modules,
parameters and state_dict never change.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch.utils.flop_counter import FlopCounterMode

from .checkpoint import checkpoint, checkpoint_reentrant
from .selective import SelectivePolicy, selective_contexts

POLICIES = ("none", "full", "sqrt", "selective")
STYLES = ("hooks", "reentrant")


def segment_bounds(n_blocks: int, segments: int) -> list[tuple[int, int]]:
    """[start, end) of k segments as even as possible (sizes differ by at most one)."""
    if isinstance(segments, bool) or not isinstance(segments, int) or not 1 <= segments <= n_blocks:
        raise ValueError(f"segments must be an integer from 1 to the number of blocks ({n_blocks}), got {segments!r}")
    return [(i * n_blocks // segments, (i + 1) * n_blocks // segments) for i in range(segments)]


def sqrt_segments(n_blocks: int) -> int:
    """Chen et al.'s choice: k = round(sqrt(n)) segments."""
    return max(1, round(math.sqrt(n_blocks)))


def best_segments(n_blocks: int, block_bytes: int, input_bytes: int) -> int:
    """The k minimising k x input + ceil(n/k) x block: saved segment inputs + one recomputed segment."""
    return min(range(1, n_blocks + 1), key=lambda k: k * input_bytes + math.ceil(n_blocks / k) * block_bytes)


BLOCK_PATHS = ("blocks", "transformer.h", "model.layers")  # labkit GPT, transformers GPT-2, Llama


def find_blocks(model) -> torch.nn.ModuleList:
    """The model's list of transformer blocks: the first of BLOCK_PATHS that is a non-empty ModuleList."""
    for path in BLOCK_PATHS:
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, torch.nn.ModuleList) and len(obj) > 0:
            return obj
    raise ValueError(f"model: expected a non-empty ModuleList of blocks at one of {', '.join(BLOCK_PATHS)} "
                     f"(labkit GPT, transformers GPT-2 or Llama); {type(model).__name__} has none")


def _passthrough(x, *args, **kwargs):
    return x  # a block whose work its segment's first block does


class checkpoint_blocks:
    """Checkpoint the model's blocks (`find_blocks`) until `.remove()`; usable as `with checkpoint_blocks(model, "sqrt"): ...`.

    policy: "none" (no change), "full" (k segments, default k = n: every block), "sqrt" (k = round(sqrt(n))),
        "selective" (k segments, default n, keeping the outputs of `selective`'s ops).
    segments: k, for "full" and "selective". selective: "matmuls", "attention-core" or a set of aten ops.
    style: "hooks" (non-reentrant, default) or "reentrant" (not with "selective").
    keep_last: leave the last segment unchecked, as torch.utils.checkpoint.checkpoint_sequential does
        (its activations are needed first in backward; this saves one segment's recompute).

    A block is called as block(x, *args, **kwargs) (transformers passes the attention mask, position
    embeddings...); a segment passes the same extra arguments to each of its blocks, and the checkpoint
    keeps references to them (they live in the model's forward anyway). The reentrant style binds keyword
    arguments into the recomputed function, so none of them may require grad.
    """

    def __init__(self, model, policy: str = "full", segments: int | None = None, *, selective="matmuls",
                 style: str = "hooks", keep_last: bool = False):
        if policy not in POLICIES:
            raise ValueError(f"policy: unknown checkpoint policy {policy!r}; choose one of {', '.join(POLICIES)}")
        if style not in STYLES:
            raise ValueError(f"style: unknown checkpoint style {style!r}; choose one of {', '.join(STYLES)}")
        if policy == "selective" and style != "hooks":
            raise ValueError("style: selective checkpointing needs the non-reentrant style ('hooks')")
        if policy in ("none", "sqrt") and segments is not None:
            raise ValueError(f"segments: policy {policy!r} sets the segment count itself; use policy='full', segments=k")
        blocks = find_blocks(model)
        if any(getattr(b, "gradient_checkpointing", False) for b in blocks):  # transformers' GradientCheckpointingLayer
            raise ValueError("model: transformers' own gradient checkpointing is on; call "
                             "model.gradient_checkpointing_disable() first (checkpointing twice recomputes twice)")
        if any("forward" in b.__dict__ for b in blocks):
            raise ValueError("model: its blocks are already checkpointed; remove() the other handle first")
        n = len(blocks)
        k = sqrt_segments(n) if policy == "sqrt" else n if segments is None else segments
        self.model, self.blocks, self.policy, self.style = model, blocks, policy, style
        self.bounds = [] if policy == "none" else segment_bounds(n, k)
        self.selective = SelectivePolicy.of(selective) if policy == "selective" else None
        for s, e in self.bounds[:-1] if keep_last else self.bounds:
            forwards = [b.forward for b in blocks[s:e]]  # the class's forward, bound to each block
            blocks[s].forward = partial(self._run_checkpointed, forwards)
            for b in blocks[s + 1:e]:
                b.forward = _passthrough

    @staticmethod
    def _run_segment(forwards, x, *args, **kwargs):
        for f in forwards:
            x = f(x, *args, **kwargs)  # (B, T, C) -> (B, T, C); the extra arguments are the same for each block
        return x

    def _run_checkpointed(self, forwards, x, *args, **kwargs):
        run = partial(self._run_segment, forwards)
        if self.style == "reentrant":
            if any(isinstance(v, torch.Tensor) and v.requires_grad for v in kwargs.values()):
                raise ValueError("style: a keyword argument of the blocks requires grad, which the reentrant "
                                 "style cannot pass on; use style='hooks'")
            return checkpoint_reentrant(partial(run, **kwargs), x, *args)
        if self.selective is not None:
            return checkpoint(run, x, *args, context_fn=partial(selective_contexts, self.selective), **kwargs)
        return checkpoint(run, x, *args, **kwargs)

    @property
    def segments(self) -> int:
        return len(self.bounds)

    def remove(self) -> None:
        """Give the blocks back their own forward."""
        for b in self.blocks:
            b.__dict__.pop("forward", None)
        self.bounds = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


def blocks_forward_flops(model, x: torch.Tensor) -> int:
    """FLOPs of one forward of all of the model's blocks (FlopCounterMode), at the embeddings' output."""
    with torch.no_grad():
        h = model.wte(x) + model.wpe(torch.arange(x.shape[1], device=x.device))  # (B, T, C)

    def run():
        out = h
        for b in model.blocks:
            out = b(out)

    return forward_flops(run)


def forward_flops(fn: Callable[[], object]) -> int:
    """FLOPs FlopCounterMode counts for fn() run without autograd (one forward of a part of a model)."""
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        fn()
    return int(fc.get_total_flops())
