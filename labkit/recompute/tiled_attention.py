"""Memory-efficient causal attention from scratch: tiles and an online softmax (FlashAttention's algorithm).

Textbook attention makes the (B, heads, S, S) scores and keeps the probabilities for backward: a·s² bytes per
layer per row that grow with the square of the sequence. FlashAttention (Dao et al. 2022, arXiv 2205.14135,
Algorithm 1 and its backward, Algorithm 4) never makes them: the forward walks the keys in blocks, keeping
for each query row a running maximum m and a running sum l of exp(score - m) (the online softmax of Milakov
and Gimelshein 2018), rescaling the partial output whenever m grows; it saves only q, k, v, the output O and
one logsumexp per row (L = m + log l). The backward recomputes each block's scores from q and k, rebuilds the
probabilities as exp(score - L), and forms dV, dP, dS = P (dP - D) with D = rowsum(dO * O), dQ, dK block by
block: nothing the size of S x S is ever alive, only (block x block) tiles.

Here it is plain PyTorch (the loops run in Python, so it is slower than a fused kernel, but its memory is the
algorithm's): `tiled_attention(q, k, v, block)` on (B, heads, S, head_dim) tensors, causal, no dropout.
Each tile is computed in fp32 (a 16-bit q, k, v is cast tile by tile), the output and the logsumexp are
written into preallocated tensors, and the gradients accumulate in fp32 before one cast to the inputs' dtype.

What it allocates, for the estimator (labkit.estimate.families.attention_tiled), n = B·heads·S·head_dim:
forward: the output (n, in the inputs' dtype, laid out (B, S, heads, head_dim) so the model's
`transpose(1, 2).contiguous()` is a view) and the logsumexp (B·heads·S fp32), both saved; per query block,
fp32 tiles only. Backward: dq, dk, dv accumulators (3n fp32, laid out as the output), tiles, then (16-bit
inputs only) their casts to the inputs' dtype.
"""

from __future__ import annotations

import math

import torch


def _tiles(S: int, block: int):
    return [(i, min(i + block, S)) for i in range(0, S, block)]


def _causal_fill(s: torch.Tensor, i0: int, j0: int) -> None:
    """Mask in place the scores of keys after their query (query row i0 + a, key column j0 + b, b > a + i0 - j0)."""
    bq, bk = s.shape[-2:]
    if j0 + bk - 1 <= i0:  # the whole tile is at or below the diagonal
        return
    rows = torch.arange(i0, i0 + bq, device=s.device).unsqueeze(1)
    cols = torch.arange(j0, j0 + bk, device=s.device).unsqueeze(0)
    s.masked_fill_(cols > rows, float("-inf"))


class TiledAttention(torch.autograd.Function):
    """Causal attention softmax(q k^T * scale) v in (block x block) tiles; saves q, k, v, out and the logsumexp."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int, scale: float):
        B, H, S, D = q.shape
        with torch.autocast(q.device.type, enabled=False):
            out = torch.empty(B, S, H, D, dtype=q.dtype, device=q.device).transpose(1, 2)
            lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
            tiles = _tiles(S, block)
            for i0, i1 in tiles:
                qi = q[:, :, i0:i1].float() * scale
                m = torch.full((B, H, i1 - i0), float("-inf"), dtype=torch.float32, device=q.device)
                l = torch.zeros(B, H, i1 - i0, dtype=torch.float32, device=q.device)
                acc = torch.zeros(B, H, i1 - i0, D, dtype=torch.float32, device=q.device)
                for j0, j1 in tiles:
                    if j0 >= i1:  # causal: keys after the last query of this block see nothing
                        break
                    s = qi @ k[:, :, j0:j1].float().transpose(-2, -1)  # (B, H, bq, bk)
                    _causal_fill(s, i0, j0)
                    m_new = torch.maximum(m, s.amax(dim=-1))
                    p = torch.exp(s - m_new.unsqueeze(-1))  # key 0 is in the first tile: m_new is finite
                    alpha = torch.exp(m - m_new)  # rescales what was summed under the old maximum
                    l = l * alpha + p.sum(dim=-1)
                    acc = acc * alpha.unsqueeze(-1) + p @ v[:, :, j0:j1].float()
                    m = m_new
                out[:, :, i0:i1] = acc / l.unsqueeze(-1)
                lse[:, :, i0:i1] = m + torch.log(l)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.block, ctx.scale = block, scale
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        block, scale = ctx.block, ctx.scale
        B, H, S, D = q.shape
        with torch.autocast(q.device.type, enabled=False):

            def acc():  # fp32, laid out (B, S, H, D) like the output: the model's reshapes stay views
                return torch.zeros(B, S, H, D, dtype=torch.float32, device=q.device).transpose(1, 2)

            dq, dk, dv = acc(), acc(), acc()
            tiles = _tiles(S, block)
            for i0, i1 in tiles:
                qi = q[:, :, i0:i1].float()
                doi = dout[:, :, i0:i1].float()
                delta = (doi * out[:, :, i0:i1].float()).sum(dim=-1, keepdim=True)  # D = rowsum(dO * O)
                li = lse[:, :, i0:i1].unsqueeze(-1)
                for j0, j1 in tiles:
                    if j0 >= i1:
                        break
                    kj, vj = k[:, :, j0:j1].float(), v[:, :, j0:j1].float()
                    s = (qi @ kj.transpose(-2, -1)) * scale
                    _causal_fill(s, i0, j0)
                    p = torch.exp(s - li)  # the probabilities, rebuilt from the saved logsumexp
                    dv[:, :, j0:j1] += p.transpose(-2, -1) @ doi
                    ds = p * (doi @ vj.transpose(-2, -1) - delta)  # softmax's backward: P (dP - D)
                    dq[:, :, i0:i1] += (ds @ kj) * scale
                    dk[:, :, j0:j1] += (ds.transpose(-2, -1) @ qi) * scale
            grads = tuple(g.to(t.dtype) for g, t in ((dq, q), (dk, k), (dv, v)))
        return (*grads, None, None)


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int = 64,
                    scale: float | None = None) -> torch.Tensor:
    """Causal attention on (B, heads, S, head_dim) q, k, v in tiles of `block` queries x `block` keys, as
    `F.scaled_dot_product_attention(q, k, v, is_causal=True)` (scale default 1/sqrt(head_dim)) but computed
    by FlashAttention's algorithm: no (S, S) tensor is made or saved."""
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must be (B, heads, S, head_dim) tensors of one shape, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
        raise ValueError(f"block must be a positive integer, got {block!r}")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise ValueError(f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    return TiledAttention.apply(q, k, v, block, 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale))
