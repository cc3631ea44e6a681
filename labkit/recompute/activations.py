"""Memory-efficient activation functions: save only the input, recompute the rest in backward.

Written as Python ops, an activation keeps every intermediate some op needs for backward:
`x * sigmoid(x)` keeps x and sigmoid(x) (2 tensors of x's size); transformers' NewGELU,
`0.5*x*(1+tanh(c*(x+0.044715*x^3)))`, keeps x, x^3's input... in all 4 tensors of x's size
(x, tanh's output, 0.5x, 1+tanh). A custom autograd Function saves x alone and recomputes sigmoid or
tanh in backward (a few pointwise FLOPs per element), as a fused kernel would.
"""

from __future__ import annotations

import math

import torch

from labkit.memory import Ledger


_C = math.sqrt(2.0 / math.pi)  # NewGELU's constant


# ---- the naive versions: what autograd saves when each op is a Python op ---------------------------
def silu_naive(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)  # saves x and sigmoid(x)


def gelu_tanh_naive(x: torch.Tensor) -> torch.Tensor:
    """transformers' NewGELU, op by op."""
    return 0.5 * x * (1.0 + torch.tanh(_C * (x + 0.044715 * torch.pow(x, 3.0))))


# ---- the memory-efficient versions -------------------------------------------------------------------
class SiLUFunction(torch.autograd.Function):
    """silu(x) = x * s, s = sigmoid(x); d/dx = s * (1 + x * (1 - s)). Saves x only."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)  # bytes: x, which the previous op made anyway
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)  # recomputed: a temporary of backward
        return grad * s * (1 + x * (1 - s))


class GELUTanhFunction(torch.autograd.Function):
    """gelu(x) = 0.5 x (1 + tanh(u)), u = c (x + 0.044715 x^3);
    d/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 * 0.044715 x^2), t = tanh(u). Saves x only."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return 0.5 * x * (1.0 + torch.tanh(_C * (x + 0.044715 * x * x * x)))

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x2 = x * x
        t = torch.tanh(_C * x * (1.0 + 0.044715 * x2))
        return grad * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _C * (1.0 + 3 * 0.044715 * x2))


def silu(x: torch.Tensor) -> torch.Tensor:
    return SiLUFunction.apply(x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return GELUTanhFunction.apply(x)


class SiLU(torch.nn.Module):
    """Drop-in for nn.SiLU that keeps only its input for backward."""

    def forward(self, x):
        return silu(x)


class GELUTanh(torch.nn.Module):
    """Drop-in for transformers' NewGELU / nn.GELU(approximate="tanh") that keeps only its input."""

    def forward(self, x):
        return gelu_tanh(x)


ACTIVATIONS = {"silu": (silu_naive, silu), "gelu-tanh": (gelu_tanh_naive, gelu_tanh)}


def saved_activation_bytes(fn, shape=(8, 128, 512), dtype=torch.float32) -> int:
    """Bytes the Ledger sees saved for backward by fn(h), beyond its input h (a previous op's output)."""
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    with Ledger() as led:
        h = x.clone()  # (shape): the activation's input, made by a previous op
        loss = fn(h).sum()  # fn's output itself is not needed by sum's backward
        del h
        loss.backward()  # backward starts here: what is alive from the forward is ACT
    # the loss and backward's seed gradient (made by loss.backward() before the engine runs): 1 element each
    return led.measurement().saved - x.numel() * x.element_size() - 2 * loss.element_size()


def compare(shape=(8, 128, 512)) -> dict[str, tuple[int, int]]:
    """{name: (naive bytes saved, memory-efficient bytes saved)} for each activation."""
    return {name: (saved_activation_bytes(a, shape), saved_activation_bytes(b, shape)) for name, (a, b) in ACTIVATIONS.items()}
