"""Selective activation checkpointing from scratch: keep the outputs of expensive ops, recompute the rest.

A checkpointed region (`labkit.recompute.checkpoint.checkpoint`) normally recomputes everything.
Here two dispatch modes share a cache: during the forward, `KeepOutputs` stores the outputs of the
ops the policy keeps; during the recompute, `ReplayOutputs` hands those stored outputs back instead
of running the ops again, so only the other ops (pointwise ops, norms, the attention core...) are
recomputed. The same decision function can drive PyTorch's own selective checkpointing
(`torch_policy`), which is how labkit checks parity.

Policies:
- "matmuls": keep mm/addmm/bmm/baddbmm/linear and scaled-dot-product attention outputs (SDPA's, and
  labkit's tiled attention's: out and logsumexp); recompute LayerNorm, GELU, residual adds, dropout, softmax.
- "attention-core": Korthikanti et al. 2022's selective recompute: keep the linear layers' outputs
  (mm/addmm), the norms and the MLP activation; recompute the attention core (SDPA, labkit's tiled
  attention, or the unfused QK^T bmm, scale, mask, softmax, dropout, .V bmm), the residual adds and the dropouts.
- a set of ops (OpOverload or OpOverloadPacket): keep exactly those.

Tiled attention (labkit.recompute.tiled_attention) is a custom operator, so these modes see it as one op
and never its tiles' matmuls: caching those would keep every tile's scores, the s^2 term tiling removes.

Rules for every policy: views and in-place ops are never cached (they make no new memory or would
change a cached value), and random ops (dropout; SDPA with dropout_p > 0) are always recomputed, so
the restored RNG stream replays in the same order as in the forward.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from .checkpoint import checkpoint
from . import tiled_attention as _tiled  # noqa: F401  (registers torch.ops.labkit.tiled_attention)

aten = torch.ops.aten
_SDPA = [getattr(aten, n) for n in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                                    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
         if hasattr(aten, n)]
LINEAR_OPS = frozenset([aten.mm, aten.addmm, aten.linear, aten._scaled_mm])  # projections: x W^T (+ b)
TILED = torch.ops.labkit.tiled_attention  # labkit's tiled attention: one op, (out, logsumexp), like SDPA
MATMUL_OPS = LINEAR_OPS | frozenset([aten.bmm, aten.baddbmm, *_SDPA, TILED])  # + attention's batched matmuls
NORM_AND_ACTIVATION_OPS = frozenset([aten.native_layer_norm, aten.gelu, aten.silu])
POLICIES = {
    "matmuls": MATMUL_OPS,
    "attention-core": LINEAR_OPS | NORM_AND_ACTIVATION_OPS,  # everything else in a block is recomputed
}


@dataclass(frozen=True)
class SelectivePolicy:
    """Which ops' outputs a selective checkpoint keeps from the forward to the backward."""

    name: str  # "matmuls", "attention-core" or "custom"
    keep: frozenset  # OpOverloadPackets (all overloads) or single OpOverloads

    @classmethod
    def of(cls, policy) -> "SelectivePolicy":
        if isinstance(policy, SelectivePolicy):
            return policy
        if isinstance(policy, str):
            if policy not in POLICIES:
                raise ValueError(f"policy: unknown selective policy {policy!r}; choose one of "
                                 f"{', '.join(POLICIES)} or pass a set of aten ops")
            return cls(policy, POLICIES[policy])
        try:
            ops = frozenset(policy)
        except TypeError:
            raise ValueError(f"policy: expected a policy name or a set of aten ops, got {type(policy).__name__}") from None
        bad = [o for o in ops if not isinstance(o, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))]
        if bad or not ops:
            raise ValueError(f"policy: a custom policy is a non-empty set of aten ops (torch.ops.aten.mm, ...), got {bad or 'an empty set'}")
        return cls("custom", ops)

    def keeps(self, func, args=(), kwargs=None) -> bool:
        """True when func's output is cached in the forward and replayed in the recompute."""
        if func not in self.keep and func.overloadpacket not in self.keep:
            return False
        if func.is_view or func._schema.is_mutable:
            return False
        return not _is_random(func, args, kwargs or {})


def _is_random(func, args, kwargs) -> bool:
    """Random ops must re-run in the recompute. SDPA is tagged random but is not when dropout_p == 0."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "dropout_p":
            p = kwargs.get("dropout_p", args[i] if i < len(args) else arg.default_value)
            return bool(p)
    return True


# ---- the two dispatch modes ------------------------------------------------------------------------
@dataclass
class _Kept:
    """A cached output: an alias of the forward's tensor (same storage) and its version then."""

    tensor: torch.Tensor
    version: int

    @classmethod
    def of(cls, t: torch.Tensor) -> "_Kept":
        return cls(t.detach(), t._version)

    def get(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise RuntimeError("selective checkpoint: a kept output was modified in place after it was cached; "
                               "remove that op from the policy")
        return self.tensor


class KeepOutputs(TorchDispatchMode):
    """Forward: run every op, and cache (alias, version) of the outputs of the ops the policy keeps."""

    def __init__(self, policy: SelectivePolicy, cache: dict):
        super().__init__()
        self.policy, self.cache = policy, cache

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.policy.keeps(func, args, kwargs):  # bytes: this output stays alive until backward
            self.cache[func].append(tree_map_only(torch.Tensor, _Kept.of, out))
        return out


class ReplayOutputs(TorchDispatchMode):
    """Recompute: hand back the cached outputs of kept ops (in forward order); run all other ops."""

    def __init__(self, policy: SelectivePolicy, cache: dict):
        super().__init__()
        self.policy, self.cache = policy, cache

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.policy.keeps(func, args, kwargs):
            return func(*args, **kwargs)  # recomputed: its output is a temporary of the backward
        if not self.cache[func]:
            raise RuntimeError(f"selective checkpoint: {func} ran more often in the recompute than in the forward")
        entry = self.cache[func].popleft()  # used once: the cache lets it go
        return tree_map_only(_Kept, _Kept.get, entry)


def selective_contexts(policy="matmuls"):
    """A fresh (forward mode, recompute mode) pair sharing one cache: a `context_fn` for `checkpoint`."""
    pol = SelectivePolicy.of(policy)
    cache: dict = defaultdict(deque)
    return KeepOutputs(pol, cache), ReplayOutputs(pol, cache)


def selective_checkpoint(fn, *args, policy="matmuls", preserve_rng_state: bool = True, **kwargs):
    """Checkpoint fn(*args, **kwargs), keeping the outputs of the ops `policy` names."""
    SelectivePolicy.of(policy)  # a bad policy fails here, in the forward, not in backward
    return checkpoint(fn, *args, preserve_rng_state=preserve_rng_state,
                      context_fn=partial(selective_contexts, policy), **kwargs)


def torch_policy(policy="matmuls"):
    """The same decisions as a policy function for torch.utils.checkpoint's selective checkpointing:
    `context_fn=partial(create_selective_checkpoint_contexts, torch_policy("matmuls"))`."""
    from torch.utils.checkpoint import CheckpointPolicy

    pol = SelectivePolicy.of(policy)

    def decide(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if pol.keeps(func, args, kwargs) else CheckpointPolicy.PREFER_RECOMPUTE

    return decide
