"""Full activation checkpointing from scratch: keep a region's inputs, recompute its inside in backward.

Two styles, as in `torch.utils.checkpoint`:

- `checkpoint_reentrant` (the teaching version): an autograd Function runs the region under
  `no_grad`, so autograd saves nothing inside it; its backward re-runs the region with grad and
  calls `torch.autograd.backward` on it (a backward inside the backward, hence "reentrant"). Like
  PyTorch's, it needs at least one input that requires grad, otherwise the region's output does
  not require grad and its parameters silently get no gradient.
- `checkpoint` (the real one, non-reentrant): the region runs with grad under saved-tensor hooks
  whose pack drops every tensor autograd wants to save and keeps a numbered ticket. The first
  unpack in backward re-runs the region (RNG restored) capturing the saved tensors in the same
  order, then hands each one out once and lets it go. It works with `autograd.grad`, keyword
  arguments, inputs that do not require grad, and a `context_fn` (selective checkpointing).

Bytes: a region keeps only its inputs (its first block's input: B x T x C x 4 bytes in fp32) until
backward; while it is recomputed, its activations exist again, briefly, as temporaries.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.autograd.graph import saved_tensors_hooks


# ---- what has to be the same in the recompute: random numbers and autocast ------------------------
@dataclass
class RegionState:
    """The RNG streams and autocast settings at a region's start, to replay its forward exactly."""

    cpu_rng: torch.Tensor | None  # torch.get_rng_state(): ~5 KB
    cuda_rng: dict[int, torch.Tensor]  # device index -> that GPU's generator state
    autocast: dict[str, tuple[bool, torch.dtype]]  # "cpu"/"cuda" -> (enabled, dtype)

    @classmethod
    def capture(cls, tensors, preserve_rng: bool = True) -> "RegionState":
        cuda = sorted({t.device.index or 0 for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda})
        return cls(
            cpu_rng=torch.get_rng_state() if preserve_rng else None,
            cuda_rng={d: torch.cuda.get_rng_state(d) for d in cuda} if preserve_rng else {},
            autocast={d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _autocast_devices()},
        )

    @contextlib.contextmanager
    def replay(self):
        """Run the recompute with the saved RNG and autocast; the caller's RNG is left as it was."""
        with contextlib.ExitStack() as stack:
            if self.cpu_rng is not None:
                stack.enter_context(torch.random.fork_rng(devices=list(self.cuda_rng)))
                torch.set_rng_state(self.cpu_rng)
                for d, s in self.cuda_rng.items():
                    torch.cuda.set_rng_state(s, d)
            for dev, (enabled, dtype) in self.autocast.items():
                stack.enter_context(torch.autocast(dev, dtype=dtype, enabled=enabled))
            yield


def _autocast_devices() -> list[str]:
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


# ---- (a) the reentrant style: an autograd Function --------------------------------------------------
class ReentrantCheckpoint(torch.autograd.Function):
    """forward: run fn under no_grad, save the inputs. backward: re-run fn with grad, backprop it."""

    @staticmethod
    def forward(ctx, fn, preserve_rng, *args):
        ctx.fn = fn
        ctx.state = RegionState.capture(args, preserve_rng)
        ctx.is_tensor = [isinstance(a, torch.Tensor) for a in args]
        ctx.others = [None if t else a for a, t in zip(args, ctx.is_tensor)]
        ctx.save_for_backward(*(a for a in args if isinstance(a, torch.Tensor)))  # bytes: the inputs only
        with torch.no_grad():  # nothing inside the region is saved for backward
            return fn(*args)

    @staticmethod
    def backward(ctx, *grads):
        saved = iter(ctx.saved_tensors)
        args = []
        for is_tensor, other in zip(ctx.is_tensor, ctx.others):
            if is_tensor:  # a fresh leaf: the recompute's graph ends here and its .grad is ours
                t = next(saved)
                args.append(t.detach().requires_grad_(t.requires_grad))
            else:
                args.append(other)
        with ctx.state.replay(), torch.enable_grad():
            out = ctx.fn(*args)  # the region's activations exist again, until this backward ends
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads) if isinstance(o, torch.Tensor) and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *(a.grad if isinstance(a, torch.Tensor) else None for a in args))


def checkpoint_reentrant(fn: Callable, *args, preserve_rng_state: bool = True):
    """Checkpoint fn(*args) in the reentrant style (positional tensor arguments only).

    At least one tensor argument must require grad; otherwise this raises instead of silently
    leaving fn's parameters without gradients (PyTorch only warns).
    """
    if torch.is_grad_enabled() and not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        raise ValueError("args: the reentrant checkpoint needs an input that requires grad "
                         "(use checkpoint(), the non-reentrant style, or x.requires_grad_())")
    return ReentrantCheckpoint.apply(fn, preserve_rng_state, *args)


# ---- (b) the non-reentrant style: saved-tensor hooks --------------------------------------------------
@dataclass
class _Ticket:
    """What autograd keeps instead of a saved tensor: its number in the region and its metadata."""

    index: int
    shape: torch.Size
    dtype: torch.dtype


class _Region:
    """One checkpointed call: its function and inputs, and, during backward, the recomputed tensors."""

    def __init__(self, fn, args, kwargs, state: RegionState, recompute_ctx):
        self.fn, self.args, self.kwargs, self.state = fn, args, kwargs, state
        self.recompute_ctx = recompute_ctx
        self.n_saved = 0  # tickets handed out in the forward
        self.recomputed: list[torch.Tensor | None] | None = None  # filled by the first unpack

    def pack(self, t: torch.Tensor) -> _Ticket:
        ticket = _Ticket(self.n_saved, t.shape, t.dtype)  # t itself is dropped: bytes freed
        self.n_saved += 1
        return ticket

    def unpack(self, ticket: _Ticket) -> torch.Tensor:
        if self.recomputed is None:
            self._recompute()
        t = self.recomputed[ticket.index]
        if t is None:
            raise RuntimeError(f"checkpoint: saved tensor #{ticket.index} was already used; a checkpointed "
                               "region supports one backward (do not pass retain_graph=True through it)")
        self.recomputed[ticket.index] = None  # handed out once: autograd frees it when done
        if t.shape != ticket.shape or t.dtype != ticket.dtype:
            raise RuntimeError(f"checkpoint: the recompute saved {tuple(t.shape)} {t.dtype} where the forward "
                               f"saved {tuple(ticket.shape)} {ticket.dtype}: the region is not deterministic")
        return t

    def _recompute(self) -> None:
        saved: list[torch.Tensor] = []

        def keep(t):
            saved.append(t.detach())  # an alias, not a copy
            return None

        def never(_):
            raise RuntimeError("checkpoint: a tensor saved during the recompute was unpacked")

        with self.state.replay(), torch.enable_grad(), self.recompute_ctx(), saved_tensors_hooks(keep, never):
            self.fn(*self.args, **self.kwargs)  # the outputs are dropped; only the saved tensors matter
        if len(saved) != self.n_saved:
            raise RuntimeError(f"checkpoint: the recompute saved {len(saved)} tensors, the forward {self.n_saved}: "
                               "the region is not deterministic (data-dependent control flow?)")
        self.recomputed = saved
        self.args = self.kwargs = None  # the inputs are no longer needed


def noop_contexts() -> tuple[Any, Any]:
    return contextlib.nullcontext(), contextlib.nullcontext()


def checkpoint(fn: Callable, *args, preserve_rng_state: bool = True,
               context_fn: Callable[[], tuple[Any, Any]] = noop_contexts, **kwargs):
    """Checkpoint fn(*args, **kwargs) in the non-reentrant style (saved-tensor hooks).

    context_fn: returns (forward context, recompute context), entered around the forward and the
    recompute; `labkit.recompute.selective` uses it to keep the outputs of chosen ops.
    """
    if not torch.is_grad_enabled():  # nothing would be saved: plain call
        return fn(*args, **kwargs)
    fwd_ctx, rec_ctx = context_fn()
    region = _Region(fn, args, kwargs, RegionState.capture(list(args) + list(kwargs.values()), preserve_rng_state),
                     lambda: rec_ctx)
    with saved_tensors_hooks(region.pack, region.unpack), fwd_ctx:
        return fn(*args, **kwargs)
