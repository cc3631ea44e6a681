"""Lion: a sign-of-momentum optimizer with one state tensor, half of Adam's optimizer memory.

Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms" (arXiv 2302.06675); reference
implementation github.com/lucidrains/lion-pytorch. Per step, with the update's sign taken BEFORE the
momentum moves:

    p *= 1 - lr*wd                           # decoupled weight decay
    p -= lr * sign(b1*m + (1-b1)*g)          # every coordinate moves by exactly lr
    m  = b2*m + (1-b2)*g                     # a slower average (b2 > b1) is what is remembered

Every update has the same size lr per coordinate, so lr must be 3-10x smaller than AdamW's (and
weight decay 3-10x larger, to keep lr*wd).
"""

from __future__ import annotations

import math

import torch

from .base import KeepStateDtypes, check_betas, check_number, params_with_grads, run_closure


def state_bytes_for(shape, dtype_bytes: int = 4) -> int:
    """State bytes of one parameter tensor under Lion: dtype_bytes * prod(shape), its one momentum m in the
    parameter's dtype (4 per element in fp32, half of AdamW's m and v); no step counter.
    Source: Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms" (Lion keeps only the momentum);
    lion-pytorch's Lion (state "exp_avg")."""
    return dtype_bytes * math.prod(shape)


# ---- the teaching version: the three lines above, on one tensor ---------------------------------------
@torch.no_grad()
def lion_update_naive(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, lr: float = 1e-4,
                      betas=(0.9, 0.99), weight_decay: float = 0.0) -> None:
    """One Lion step on p and its momentum m, in place, as the paper's pseudocode writes it."""
    b1, b2 = betas
    p.mul_(1 - lr * weight_decay)
    p.sub_(lr * torch.sign(b1 * m + (1 - b1) * g))  # bytes: 3 temporaries the size of p
    m.copy_(b2 * m + (1 - b2) * g)


# ---- the real one ------------------------------------------------------------------------------------------
class Lion(KeepStateDtypes, torch.optim.Optimizer):
    """Lion with lion-pytorch's arguments and results (parity with `lion_pytorch.Lion`).

    decoupled_weight_decay: divide weight_decay by the initial lr, so lr*wd stays as given (as
        lion-pytorch does). State per parameter: "exp_avg" (m), in the parameter's dtype.
    The step makes one temporary the size of the parameter (the interpolation, signed in place).
    """

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0,
                 decoupled_weight_decay: bool = False):
        defaults = dict(lr=check_number("lr", lr, low_open=True), betas=check_betas(betas, high_open=False),
                        weight_decay=check_number("weight_decay", weight_decay))
        self.init_lr, self.decoupled_weight_decay = float(lr), bool(decoupled_weight_decay)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        for p, group in params_with_grads(self, "Lion"):
            (b1, b2), lr, wd = group["betas"], group["lr"], group["weight_decay"]
            if self.decoupled_weight_decay:
                wd = wd / self.init_lr
            g, state = p.grad, self.state[p]
            if not state:
                state["exp_avg"] = torch.zeros_like(p)  # bytes: p's dtype per value
            m = state["exp_avg"]
            p.mul_(1 - lr * wd)
            u = m.mul(b1).add_(g, alpha=1 - b1).sign_()  # bytes: 1 temporary the size of p
            p.add_(u, alpha=-lr)
            del u
            m.mul_(b2).add_(g, alpha=1 - b2)
        return loss
