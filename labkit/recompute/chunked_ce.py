"""Chunked cross-entropy from scratch: the loss of a language-model head without the (rows, V) logits.

`F.cross_entropy(hidden @ W.T, targets)` makes the logits (rows x V) and log_softmax saves its output, a
second rows x V tensor (fp32 under autocast), until backward: with a 50k vocabulary these are often the
largest tensors of a step. Here the head and the loss are one autograd.Function that takes the hidden states
(rows, h) and the head's weight (V, h) and walks the rows in chunks:

- forward: for each chunk, its logits (chunk x V, fp32), their logsumexp and the target's logit; the loss is
  the mean of logsumexp - logit over the rows whose target is not `ignore_index` (F.cross_entropy's mean).
  It saves the hidden states, the weight (a parameter: no new memory), the targets and one fp32 logsumexp
  per row; the chunk's logits are freed before the next chunk.
- backward: each chunk's logits are recomputed from the saved hidden states and weight (one chunk's matmul
  again: the compute the technique trades), softmax = exp(logits - logsumexp), minus 1 at the target, times
  the incoming gradient / the number of counted rows, gives dlogits; then d hidden = dlogits @ W for the
  chunk's rows and dW += dlogits^T @ hidden (an fp32 accumulator).

Saving the hidden states and the weight (not the logits) is the point: the logits are what is large. Under
autocast the matmuls run in its 16-bit dtype on 16-bit copies of the hidden states and the weight, made once
per pass (the rest in fp32), as autocast's own head would.

What it allocates, for the estimator (labkit.estimate.families), r rows, c rows per chunk, m the compute
dtype's bytes: forward: [16-bit copies of the hidden states (r h m) and of the weight (V h m)], the
logsumexp (r x 4, saved), per chunk the matmul output (c V m), its fp32 copy when m = 2, and exp(z - max)
(c V 4). Backward: the same copies again, d hidden (r h, the hidden states' dtype), the dW accumulator
(V h 4; in the weight's dtype it is the gradient itself), per chunk the matmul output and its fp32 copy, the
16-bit dlogits (m = 2), d hidden's chunk (c h m) and dW's chunk (V h m), and at the end dW cast to the
weight's dtype (when it is 16-bit).
"""

from __future__ import annotations

import torch


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    dev = t.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else t.dtype


def scratch_bytes(rows: int, hidden: int, vocab: int, chunk: int, x_itemsize: int, w_itemsize: int,
                  compute_itemsize: int) -> tuple[int, int]:
    """The most bytes one call holds at once beyond its inputs, its saved tensors (the per-row logsumexp,
    the count) and the incoming gradient: (forward, backward). x_itemsize: the hidden states' bytes per
    element, w_itemsize the weight's, compute_itemsize the matmuls' (autocast's 16-bit, else the hidden
    states'). With c = min(chunk, rows), m = compute_itemsize, r rows, h hidden, V vocabulary:
    both passes: the 16-bit copies of the hidden states (r h m) and the weight (V h m) when their dtype
    is not m;
    forward: the `targets != ignore` mask (r bools), the running total (4), and at the logsumexp's sum the
    chunk's fp32 logits, exp(z - max), the row maxima and their sums: 2 c V x 4 + 8 c (the 16-bit logits
    and their fp32 copy, c V (m + 4), are less);
    backward: d hidden (r h x_itemsize), the dW accumulator (V h x 4), g (4), and the most of: the chunk's
    16-bit logits and their fp32 copy (c V (m + 4), m = 2 only), softmax with the rows' weights, the
    targets' indices and the -weights scattered in (c V 4 + 16 c), the 16-bit dlogits with d hidden's chunk
    (c V m + c h m) or with dW's chunk (c V m + V h m); or at the end, for a 16-bit weight, dW cast to its
    dtype (V h w_itemsize)."""
    c, r, h, V, m = min(chunk, rows), rows, hidden, vocab, compute_itemsize
    copies = (r * h * m if x_itemsize != m else 0) + (V * h * m if w_itemsize != m else 0)
    fwd = copies + r + 4 + 2 * c * V * 4 + 8 * c
    chunk_worst = max(c * V * (m + 4) if m != 4 else 0, c * V * 4 + 16 * c, c * V * m + c * h * m,
                      c * V * m + V * h * m)
    bwd = copies + r * h * x_itemsize + V * h * 4 + 4 + max(chunk_worst, V * h * w_itemsize if w_itemsize != 4 else 0)
    return fwd, bwd


class ChunkedCrossEntropy(torch.autograd.Function):
    """mean over counted rows of -log softmax(hidden @ weight.T)[target], in chunks of rows. Each chunk's
    temporaries are deleted before the next, so that the scratch is `scratch_bytes`."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, ignore_index: int):
        cdt = _compute_dtype(hidden)
        rows = hidden.shape[0]
        with torch.autocast(hidden.device.type, enabled=False):
            hc, wc = hidden.to(cdt), weight.to(cdt)  # copies only under autocast
            valid = targets != ignore_index
            lse = torch.empty(rows, dtype=torch.float32, device=hidden.device)
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for c0 in range(0, rows, chunk):
                c1 = min(c0 + chunk, rows)
                z = (hc[c0:c1] @ wc.t()).float()  # (c, V): this chunk's logits only
                mx = z.amax(dim=-1, keepdim=True)
                lse_c = (z - mx).exp_().sum(dim=-1).log_().add_(mx.squeeze(-1))
                lse[c0:c1] = lse_c
                picked = z.gather(1, targets[c0:c1].clamp(min=0).unsqueeze(1)).squeeze(1)  # ignored rows: class 0
                total += ((lse_c - picked) * valid[c0:c1]).sum()  # ... counted 0 times
                del z, mx, lse_c, picked
            count = valid.sum()
            loss = (total / count).to(hidden.dtype)  # 0 / 0 = nan when every target is ignored, as F.cross_entropy
        ctx.save_for_backward(hidden, weight, targets, lse, count)
        ctx.chunk, ctx.ignore_index, ctx.cdt = chunk, ignore_index, cdt
        return loss

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, targets, lse, count = ctx.saved_tensors
        chunk, ignore_index, cdt = ctx.chunk, ctx.ignore_index, ctx.cdt
        rows = hidden.shape[0]
        with torch.autocast(hidden.device.type, enabled=False):
            hc, wc = hidden.to(cdt), weight.to(cdt)
            dh = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
            dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
            g = grad.float() / count
            for c0 in range(0, rows, chunk):
                c1 = min(c0 + chunk, rows)
                t = targets[c0:c1]
                z = (hc[c0:c1] @ wc.t()).float()
                p = z.sub_(lse[c0:c1].unsqueeze(1)).exp_()  # softmax, in place of the logits
                weights = (t != ignore_index).float().mul_(g)  # ignored rows get no gradient
                p.mul_(weights.unsqueeze(1))
                p.scatter_add_(1, t.clamp(min=0).unsqueeze(1), weights.neg().unsqueeze(1))  # - 1 at the target
                del weights
                pc = p.to(cdt)  # dlogits
                del z, p
                if dh is not None:
                    dh[c0:c1] = pc @ wc
                if dw is not None:
                    dw += pc.t() @ hc[c0:c1]
                del pc
            if dw is not None:
                dw = dw.to(weight.dtype)
        return dh, dw, None, None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int = 1024,
                          ignore_index: int = -100) -> torch.Tensor:
    """F.cross_entropy(hidden @ weight.T, targets, ignore_index=ignore_index) (the mean over counted rows),
    computed `chunk` rows at a time: hidden (rows, h), weight (V, h), targets (rows,) int64."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be (rows, h) and weight (V, h), got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if targets.shape != (hidden.shape[0],) or targets.dtype != torch.long:
        raise ValueError(f"targets must be int64 of shape ({hidden.shape[0]},), got {targets.dtype} "
                         f"{tuple(targets.shape)}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
        raise ValueError(f"chunk must be a positive integer, got {chunk!r}")
    return ChunkedCrossEntropy.apply(hidden, weight, targets, chunk, ignore_index)
