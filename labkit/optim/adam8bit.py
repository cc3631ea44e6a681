"""8-bit Adam and AdamW: m and v kept as 1-byte dynamic-map codes plus one fp32 absmax per 256 values.

Every step dequantizes m and v to fp32, does the ordinary Adam update, and quantizes them back
(bitsandbytes' blockwise "static 8-bit" optimizer: Dettmers et al. 2022, "8-bit Optimizers via
Block-wise Quantization", arXiv 2110.02861; blocks of 256 since bitsandbytes PR #1365, in 0.44.0):

    m = qmap_signed[m_codes] * m_absmax[block];  v = qmap_unsigned[v_codes] * v_absmax[block]
    m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g*g
    p *= 1 - lr*wd                                  # decoupled, for Adam8bit and AdamW8bit alike
    p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)
    absmax = max|m| per block;  m_codes = nearest code to m/absmax      (the same for v)

Tensors with fewer than `min_8bit_size` (4096) elements keep fp32 m and v, as bitsandbytes does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from labkit.quant.dynamic import (code_map, dequantize_blockwise, dequantize_blockwise_, dynamic_map,
                                  quantize_blockwise, quantize_blockwise_)

from .base import KeepStateDtypes, check_betas, check_int, check_number, params_with_grads, run_closure

BLOCKSIZE = 256  # values per absmax block (bitsandbytes >= 0.44; 2048 in the paper)
MIN_8BIT_SIZE = 4096  # smaller tensors keep fp32 state (bitsandbytes' min_8bit_size)
CHUNK_SIZE = 1 << 20  # values Adam8bit dequantizes at a time (its step temporaries: about 16 bytes each)


def state_bytes_for(shape, blocksize: int = BLOCKSIZE, min_8bit_size: int = MIN_8BIT_SIZE) -> int:
    """State bytes of one tensor of n = prod(shape) values under 8-bit Adam (m and v):

        8n                          if n < min_8bit_size (4096): fp32 m and v
        2n + 8 * ceil(n / blocksize) otherwise: a uint8 code per value for m and for v, plus an fp32
                                    absmax per block of `blocksize` (256) for each

    about 2.03 bytes per value instead of fp32 Adam's 8. The one owner of this rule: GaLore's 8-bit
    moments (labkit.optim.galore8bit) and the estimator (labkit.memory) call it.
    Source: Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization"; bitsandbytes'
    Optimizer2State (min_8bit_size=4096; block size 256 since bitsandbytes 0.44, 2048 before)."""
    n = math.prod(shape)
    if n < min_8bit_size:
        return 8 * n
    return 2 * n + 8 * math.ceil(n / blocksize)


# ---- the teaching version: the whole tensor at once, with labkit.quant ------------------------------
@dataclass(frozen=True)
class Adam8bitHP:
    """The teaching version's hyperparameters (bitsandbytes' names and defaults)."""

    lr: float = 1e-3  # learning rate
    betas: tuple = (0.9, 0.999)  # decay rates of m and v
    eps: float = 1e-8  # added to the bias-corrected sqrt(v)
    weight_decay: float = 0.0  # decoupled: p *= 1 - lr * weight_decay
    blocksize: int = BLOCKSIZE  # values per absmax block

    def __post_init__(self) -> None:
        check_number("lr", self.lr)
        check_betas(self.betas)
        check_number("eps", self.eps)
        check_number("weight_decay", self.weight_decay)
        check_int("blocksize", self.blocksize)


@torch.no_grad()
def adam8bit_update_naive(p: torch.Tensor, g: torch.Tensor, state: dict, step: int,
                          hp: Adam8bitHP = Adam8bitHP()) -> None:
    """One 8-bit Adam step on p (fp32) in place; state holds m_codes, m_absmax, v_codes, v_absmax.

    Readable, not frugal: m and v are dequantized whole, so the step briefly holds about 5 fp32
    copies of p (m, v, sqrt(v), the quantizer's normalized copy and its int32 indices).
    """
    lr, eps, weight_decay, blocksize = hp.lr, hp.eps, hp.weight_decay, hp.blocksize
    b1, b2 = hp.betas
    qm, qv = dynamic_map(signed=True), dynamic_map(signed=False)
    m = dequantize_blockwise(state["m_codes"], state["m_absmax"], qm, blocksize)  # fp32, p.shape
    v = dequantize_blockwise(state["v_codes"], state["v_absmax"], qv, blocksize)
    m.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    c1, c2 = 1 - b1**step, math.sqrt(1 - b2**step)  # bias corrections
    if weight_decay > 0:
        p.mul_(1 - lr * weight_decay)
    p.addcdiv_(m, (v.sqrt() / c2).add_(eps), value=-lr / c1)
    for name, x, q in (("m", m, qm), ("v", v, qv)):
        codes, absmax = quantize_blockwise(x, q, blocksize)
        state[f"{name}_codes"].copy_(codes)
        state[f"{name}_absmax"].copy_(absmax)


# ---- the real one: a torch.optim.Optimizer that works through each tensor a chunk at a time -------
class Adam8bit(KeepStateDtypes, torch.optim.Optimizer):
    """8-bit Adam with bitsandbytes' semantics (parity with `bitsandbytes.optim.Adam8bit`).

    Weight decay is decoupled here, `p *= 1 - lr*wd`, exactly as in bitsandbytes, where Adam8bit and
    AdamW8bit run the same kernel and differ only in the default weight_decay (0 vs 1e-2): so
    `Adam8bit(weight_decay=x)` is NOT the L2 term that torch.optim.Adam adds to the gradient.

    blocksize: values per absmax block; min_8bit_size: tensors with fewer elements keep fp32 m, v.
    chunk_size: elements dequantized at a time (a multiple of blocksize); it bounds the step's
        temporaries at about 16 bytes x chunk_size and does not change the result.

    State per parameter: "step" (a Python int), and either "m_codes", "v_codes" (uint8, p's shape)
    with "m_absmax", "v_absmax" (fp32, one per block), or fp32 "m", "v" for small tensors.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, blocksize: int = BLOCKSIZE, min_8bit_size: int = MIN_8BIT_SIZE,
                 chunk_size: int = CHUNK_SIZE):
        defaults = dict(lr=check_number("lr", lr), betas=check_betas(betas), eps=check_number("eps", eps),
                        weight_decay=check_number("weight_decay", weight_decay),
                        blocksize=check_int("blocksize", blocksize),
                        min_8bit_size=check_int("min_8bit_size", min_8bit_size, low=0))
        self.chunk_size = check_int("chunk_size", chunk_size, multiple_of=blocksize)
        super().__init__(params, defaults)
        for p in (p for g in self.param_groups for p in g["params"]):  # made now, not inside the first step
            code_map(True, p.device), code_map(False, p.device)

    def _init_state(self, p: torch.Tensor, state: dict, group: dict) -> None:
        state["step"] = 0
        n = p.numel()
        if n < group["min_8bit_size"]:
            state["m"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)  # bytes: 4 per value
            state["v"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            return
        blocks = math.ceil(n / group["blocksize"])
        for name in ("m", "v"):
            state[f"{name}_codes"] = torch.zeros(p.shape, dtype=torch.uint8, device=p.device)  # bytes: 1 per value
            state[f"{name}_absmax"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)  # bytes: 4 per block

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        for p, group in params_with_grads(self, "Adam8bit"):
            state = self.state[p]
            if not state:
                self._init_state(p, state, group)
            state["step"] += 1
            if "m" in state:
                self._update_fp32(p, state, group)
            else:
                self._update_8bit(p, state, group)
        return loss

    def _update_fp32(self, p, state, group) -> None:
        """Small tensors, as bitsandbytes' 32-bit kernel orders the same arithmetic."""
        (b1, b2), lr, wd, t = group["betas"], group["lr"], group["weight_decay"], state["step"]
        g, m, v = p.grad.float(), state["m"], state["v"]
        p32 = p.float()
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        c1, c2 = 1 - b1**t, math.sqrt(1 - b2**t)
        if wd > 0:
            p32.mul_(1 - lr * wd)
        p32.add_(m / v.sqrt().add_(group["eps"] * c2), alpha=-lr * c2 / c1)  # = m/c1 / (sqrt(v)/c2 + eps)
        if p32 is not p:
            p.copy_(p32)

    def _update_8bit(self, p, state, group) -> None:
        (b1, b2), lr, wd, t, bs = group["betas"], group["lr"], group["weight_decay"], state["step"], group["blocksize"]
        c1, c2 = 1 - b1**t, math.sqrt(1 - b2**t)
        work = p if p.is_contiguous() else p.contiguous()
        pf, gf = work.view(-1), p.grad.reshape(-1)
        mc, vc = state["m_codes"].view(-1), state["v_codes"].view(-1)
        chunk = max(bs, self.chunk_size // bs * bs)  # chunk boundaries fall on block boundaries
        for s in range(0, pf.numel(), chunk):
            e = min(s + chunk, pf.numel())
            blk = slice(s // bs, math.ceil(e / bs))
            ma, va = state["m_absmax"][blk], state["v_absmax"][blk]
            g, pc = gf[s:e].float(), pf[s:e]
            p32 = pc.float()
            m = dequantize_state(mc[s:e], ma, True, bs)  # fp32 (chunk,): 4 B per value
            v = dequantize_state(vc[s:e], va, False, bs)
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            quantize_state(v.clone(), vc[s:e], va, False, bs)  # v's new codes; v stays for the denominator
            denom = v.sqrt_().div_(c2).add_(group["eps"])  # in place: sqrt(v)/c2 + eps
            if wd > 0:
                p32.mul_(1 - lr * wd)
            p32.addcdiv_(m, denom, value=-lr / c1)
            del v, denom
            quantize_state(m, mc[s:e], ma, True, bs)  # m is not needed after this: normalized in place
            if p32 is not pc:
                pc.copy_(p32)
        if work is not p:
            p.copy_(work)


def dequantize_state(codes: torch.Tensor, absmax: torch.Tensor, signed: bool, bs: int) -> torch.Tensor:
    """uint8 codes -> fp32 code[codes] * absmax of each value's block (labkit.quant.dynamic), codes' shape."""
    code, _ = code_map(signed, codes.device)
    return dequantize_blockwise_(codes, absmax, code, bs).view(codes.shape)  # bytes: 4 (int32 index, freed) + 4 per value


def quantize_state(x: torch.Tensor, codes_out: torch.Tensor, absmax_out: torch.Tensor, signed: bool, bs: int) -> None:
    """fp32 x, overwritten -> codes_out (uint8, x's shape) and absmax_out (fp32 per block): a moment stored in 8 bits."""
    _, mids = code_map(signed, x.device)
    quantize_blockwise_(x.view(-1), codes_out.view(-1), absmax_out, mids, bs)  # bytes: 4 per value (int32 indices)


class AdamW8bit(Adam8bit):
    """8-bit AdamW: Adam8bit with weight_decay=1e-2 by default (bitsandbytes.optim.AdamW8bit)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, **kwargs):
        super().__init__(params, lr, betas, eps, weight_decay, **kwargs)
