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
The forward and the backward are custom operators (torch.library.custom_op: labkit::tiled_attention, which
returns (out, logsumexp), and labkit::tiled_attention_backward), so a dispatch mode sees one op and not the
tiles: selective checkpointing (labkit.recompute.selective, PyTorch's SAC) keeps or recomputes the call as a
whole, as it does SDPA. The ledger registers their bodies (`count_inside`) to keep counting the tiles' scratch.

What it allocates, for the estimator (labkit.estimate.families.attention_tiled), n = B·heads·S·head_dim:
forward: the output (n, in the inputs' dtype, laid out (B, S, heads, head_dim) so the model's
`transpose(1, 2).contiguous()` is a view) and the logsumexp (B·heads·S fp32), both saved; per query block,
fp32 tiles only. Backward: dq, dk, dv accumulators (3n fp32, laid out as the output), tiles, then (16-bit
inputs only) their casts to the inputs' dtype.
"""

from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import register_flop_formula

from labkit.memory.ledger import count_inside


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


def _f32(t: torch.Tensor) -> torch.Tensor:
    """A tile in fp32: itself when it is fp32, else one contiguous fp32 copy (a copy that kept the tile's
    strides, as `.float()` does, would be copied once more by the matmul that reads it)."""
    return t if t.dtype == torch.float32 else t.to(torch.float32, memory_format=torch.contiguous_format)


def scratch_bytes(B: int, heads: int, S: int, head_dim: int, block: int, itemsize: int,
                  packed: bool = False) -> tuple[int, int]:
    """The most bytes one call's tiles hold at once (beyond the output, the logsumexp and, in backward, the
    gradients and their fp32 accumulators), (forward, backward), for q, k, v of `itemsize` bytes.
    packed: q, k, v (and the output's gradient) are laid out so that a tile's (B, heads) dims do not merge
    into one batch dim, as the model's views of one (B, S, 3 x heads x head_dim) projection are: a matmul
    on an fp32 tile of them copies it first (torch.matmul folds the batch dims into one, by a copy when a
    view cannot).

    With T = B x heads, b = min(block, S) rows per tile, a tile t = T b b x 4 (fp32 scores), a slice
    u = T b head_dim x 4 and a row vector r = T b x 4:
    forward, at `acc += p @ v`: the scores (in place: p), the scaled q slice, acc and p @ v (t + 3u), v's
    slice in fp32 (u: the copy of a 16-bit v, or the matmul's copy of a packed fp32 v), and m, l, m_new,
    alpha (4r);
    backward, at `dq += ds @ k`: the probabilities and ds (2t), ds @ k (u), fp32 copies of a 16-bit q, dO,
    k and v slices (4u) and D = rowsum(dO * O) (r); a packed fp32 call instead copies one slice per matmul
    (u; at `ds = dO @ v^T` that is dO's and v's, 2t + 2u + r, as much)."""
    b = min(block, S)
    t, u, r = B * heads * b * b * 4, B * heads * b * head_dim * 4, B * heads * b * 4
    low = itemsize != 4
    return (t + 3 * u + (u if low or packed else 0) + 4 * r,
            2 * t + u + (4 * u if low else u if packed else 0) + r)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int, scale: float):
    """Causal attention softmax(q k^T * scale) v in (block x block) tiles: (out, logsumexp).
    Ops run in place where they can, so that one tile's scratch is `scratch_bytes`."""
    B, H, S, D = q.shape
    with torch.autocast(q.device.type, enabled=False):
        out = torch.empty(B, S, H, D, dtype=q.dtype, device=q.device).transpose(1, 2)
        lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
        tiles = _tiles(S, block)
        for i0, i1 in tiles:
            qi = _f32(q[:, :, i0:i1]) * scale
            m = torch.full((B, H, i1 - i0), float("-inf"), dtype=torch.float32, device=q.device)
            l = torch.zeros(B, H, i1 - i0, dtype=torch.float32, device=q.device)
            acc = torch.zeros(B, H, i1 - i0, D, dtype=torch.float32, device=q.device)
            for j0, j1 in tiles:
                if j0 >= i1:  # causal: keys after the last query of this block see nothing
                    break
                s = qi @ _f32(k[:, :, j0:j1]).transpose(-2, -1)  # (B, H, bq, bk) scores
                _causal_fill(s, i0, j0)
                m_new = torch.maximum(m, s.amax(dim=-1))
                p = s.sub_(m_new.unsqueeze(-1)).exp_()  # key 0 is in the first tile: m_new is finite
                alpha = (m - m_new).exp_()  # rescales what was summed under the old maximum
                l.mul_(alpha).add_(p.sum(dim=-1))
                acc.mul_(alpha.unsqueeze(-1)).add_(p @ _f32(v[:, :, j0:j1]))
                m = m_new
                del s, p, alpha, m_new
            out[:, :, i0:i1] = acc.div_(l.unsqueeze(-1))
            lse[:, :, i0:i1] = l.log_().add_(m)
            del qi, m, l, acc
    return out, lse


def _backward(dout, q, k, v, out, lse, block: int, scale: float):
    """dq, dk, dv (in q's dtype) from the saved q, k, v, output and logsumexp, tile by tile."""
    B, H, S, D = q.shape
    with torch.autocast(q.device.type, enabled=False):

        def acc():  # fp32, laid out (B, S, H, D) like the output: the model's reshapes stay views
            return torch.zeros(B, S, H, D, dtype=torch.float32, device=q.device).transpose(1, 2)

        dq, dk, dv = acc(), acc(), acc()
        tiles = _tiles(S, block)
        for i0, i1 in tiles:
            qi = _f32(q[:, :, i0:i1])
            doi = _f32(dout[:, :, i0:i1])
            delta = (doi * out[:, :, i0:i1].float()).sum(dim=-1, keepdim=True)  # D = rowsum(dO * O)
            li = lse[:, :, i0:i1].unsqueeze(-1)
            for j0, j1 in tiles:
                if j0 >= i1:
                    break
                kj, vj = _f32(k[:, :, j0:j1]), _f32(v[:, :, j0:j1])
                s = (qi @ kj.transpose(-2, -1)).mul_(scale)
                _causal_fill(s, i0, j0)
                p = s.sub_(li).exp_()  # the probabilities, rebuilt from the saved logsumexp
                dv[:, :, j0:j1] += p.transpose(-2, -1) @ doi
                ds = (doi @ vj.transpose(-2, -1)).sub_(delta).mul_(p)  # softmax's backward: P (dP - D)
                dq[:, :, i0:i1] += (ds @ kj).mul_(scale)
                dk[:, :, j0:j1] += (ds.transpose(-2, -1) @ qi).mul_(scale)
                del kj, vj, s, p, ds
            del qi, doi, delta, li
        return tuple(g.to(t.dtype) for g, t in ((dq, q), (dk, k), (dv, v)))


# ---- one operator each way -----------------------------------------------------------------------------
# Registered as custom operators, the forward and the backward are each ONE op to a TorchDispatchMode (as
# SDPA is): a selective checkpoint decides about the attention as a whole (keep (out, lse), or recompute
# the call), instead of caching every tile's scores; PyTorch's selective checkpointing sees the same op.
# The ledger (labkit.memory.ledger) runs their Python bodies under itself, so it still counts the tiles.
@torch.library.custom_op("labkit::tiled_attention", mutates_args=())
def tiled_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, block, scale)


@torch.library.custom_op("labkit::tiled_attention_backward", mutates_args=())
def tiled_attention_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, lse: torch.Tensor, block: int,
                                scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(dout, q, k, v, out, lse, block, scale)


@tiled_attention_op.register_fake
def _(q, k, v, block, scale):
    B, H, S, D = q.shape
    return q.new_empty(B, S, H, D).transpose(1, 2), q.new_empty(B, H, S, dtype=torch.float32)


@tiled_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, block, scale):
    B, H, S, D = q.shape
    return tuple(t.new_empty(B, S, H, D).transpose(1, 2) for t in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, block, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.block, ctx.scale = block, scale
    ctx.set_materialize_grads(False)  # no zeros made for the logsumexp's (absent) gradient


def _autograd_backward(ctx, dout, dlse):  # the logsumexp is an internal output: no gradient flows into it
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:  # the output did not reach the loss
        return None, None, None, None, None
    return (*tiled_attention_backward_op(dout, q, k, v, out, lse, ctx.block, ctx.scale), None, None)


tiled_attention_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def tile_flops(B: int, heads: int, S: int, head_dim: int, block: int) -> tuple[int, int]:
    """(forward, backward) FLOPs of the tiles' matmuls: every (query block, key block) pair at or below the
    diagonal, 2 of them per pair forward (scores, p @ v), 5 backward (scores again, dv, dp, dq, dk)."""
    tiles = _tiles(S, block)
    pairs = sum((i1 - i0) * (j1 - j0) for i0, i1 in tiles for j0, j1 in tiles if j0 < i1)
    one = 2 * B * heads * pairs * head_dim
    return 2 * one, 5 * one


@register_flop_formula(torch.ops.labkit.tiled_attention)
def _(q_shape, k_shape, v_shape, block, scale, *args, out_shape=None, **kwargs) -> int:
    return tile_flops(*q_shape, block)[0]


@register_flop_formula(torch.ops.labkit.tiled_attention_backward)
def _(dout_shape, q_shape, *args, out_shape=None, **kwargs) -> int:
    return tile_flops(*q_shape, args[4])[1]
count_inside(torch.ops.labkit.tiled_attention.default, _forward)
count_inside(torch.ops.labkit.tiled_attention_backward.default, _backward)


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
    return tiled_attention_op(q, k, v, block, 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale))[0]
