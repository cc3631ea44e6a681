"""Data parallelism from scratch: every rank holds the whole model, runs its share of the batch, and the
ranks average their gradients so that every copy takes the same step.

Three versions, in the order the lesson builds them (picotron's `DataParallelNaive`, `DataParallelBucket`;
PyTorch's DDP, Li et al. 2020, arXiv 2006.15704, is the production one):

- `DataParallelNaive`: after backward, one all-reduce per gradient (many small messages);
- `DataParallelBucket(overlap=False)`: after backward, gradients packed into a few flat buckets of about
  `bucket_bytes` each, one all-reduce per bucket (fewer, larger messages);
- `DataParallelBucket(overlap=True)`: each bucket's all-reduce starts, asynchronously, as soon as backward
  has made its last gradient (a post-accumulate-grad hook), while backward goes on with earlier layers.

Every rank starts from rank 0's parameters (`broadcast_parameters`). Gradients are averaged: each rank's
loss is the mean over its rows, so the mean over ranks of the gradients is the gradient of the mean over
the global batch (equal rows per rank). All traffic goes through `labkit.distributed.comms`.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from . import comms

__all__ = ["broadcast_parameters", "DataParallelNaive", "DataParallelBucket", "average_in_backward", "buckets_of"]


@torch.no_grad()
def broadcast_parameters(model: nn.Module, src: int = 0, group=None) -> None:
    """Every rank's parameters and buffers become rank `src`'s (in place); `src` is a rank of `group`
    (default: the whole world)."""
    if group is not None:
        import torch.distributed as dist

        src = dist.get_global_rank(group, src)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        comms.broadcast(t.data, src=src, group=group, tag=f"broadcast {name}")


class DataParallelNaive(nn.Module):
    """Run the model; after backward call `sync_gradients()`: one all-reduce (mean) per parameter's gradient."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.module = model
        broadcast_parameters(model)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def sync_gradients(self) -> None:
        for name, p in self.module.named_parameters():
            if p.grad is not None:
                comms.all_reduce(p.grad, op="avg", tag=f"grad {name}")


def average_in_backward(model: nn.Module, group=None) -> list:
    """Each gradient averaged over the ranks (all-reduce in place) as soon as backward has accumulated it, from
    its post-accumulate-grad hook: registered before an optimizer that steps in backward
    (labkit.optim.StepInBackward), each parameter then steps on the average (hooks run in the order they
    were registered). One message per parameter (DDP's buckets would make fewer); no buffer: the all-reduce
    works in .grad. Returns the hooks' handles."""
    @torch.no_grad()
    def hook(p: torch.Tensor) -> None:
        comms.all_reduce(p.grad, op="avg", group=group, tag="grad (in backward)")

    return [p.register_post_accumulate_grad_hook(hook) for p in model.parameters() if p.requires_grad]


def buckets_of(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Parameters in the order backward makes their gradients (the reverse of the model's), cut into
    consecutive buckets of at least `bucket_bytes` each (the last may be smaller), as DDP's Reducer does."""
    if not (isinstance(bucket_bytes, int) and bucket_bytes > 0):
        raise ValueError(f"bucket_bytes must be a positive integer, got {bucket_bytes!r}")
    out, cur, size = [], [], 0
    for p in reversed(params):
        cur.append(p)
        size += p.numel() * p.element_size()
        if size >= bucket_bytes:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out


class DataParallelBucket(nn.Module):
    """Gradients averaged bucket by bucket: a flat copy of each bucket's gradients is all-reduced, then
    copied back into the `.grad`s. overlap=True starts a bucket's all-reduce inside backward, as soon as its
    last gradient exists; `sync_gradients()` (after backward) waits for them, or does them all when
    overlap=False. Bytes: one flat bucket per bucket in flight, each the size of its gradients.

    Every parameter must receive a gradient in each backward (DDP's find_unused_parameters=False)."""

    def __init__(self, model: nn.Module, bucket_bytes: int = 1 << 20, overlap: bool = True):
        super().__init__()
        self.module = model
        self.overlap = overlap
        broadcast_parameters(model)
        params = [p for p in model.parameters() if p.requires_grad]
        self.buckets = buckets_of(params, bucket_bytes)
        self._where = {p: i for i, b in enumerate(self.buckets) for p in b}
        self._ready = [0] * len(self.buckets)
        self._inflight: dict[int, tuple] = {}  # bucket -> (work, flat gradients)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params] if overlap else []

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _start(self, i: int):
        bucket = self.buckets[i]
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])  # (bucket elements,) a new flat copy
        work = comms.all_reduce(flat, op="sum", async_op=True, tag=f"grad bucket {i}")
        self._inflight[i] = (work, flat)

    @torch.no_grad()
    def _on_grad(self, p: nn.Parameter) -> None:
        i = self._where[p]
        self._ready[i] += 1
        if self._ready[i] == len(self.buckets[i]):
            self._start(i)

    @torch.no_grad()
    def sync_gradients(self) -> None:
        if not self.overlap:
            for i in range(len(self.buckets)):
                self._start(i)
        missing = [i for i in range(len(self.buckets)) if i not in self._inflight]
        if missing:
            raise RuntimeError(f"DataParallelBucket: buckets {missing} never got all their gradients; every "
                               f"parameter must be used in the forward pass")
        for i in range(len(self.buckets)):
            work, flat = self._inflight.pop(i)
            work.wait()
            comms.finish_avg(flat)
            offset = 0
            for p in self.buckets[i]:
                n = p.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
                offset += n
            del flat
        self._ready = [0] * len(self.buckets)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
