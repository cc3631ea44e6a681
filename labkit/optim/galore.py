"""GaLore: AdamW whose moments live in a rank-r projection of each weight matrix's gradient.

Zhao et al. 2024, "GaLore: Memory-Efficient LLM Training by Gradient Low-Rank Projection" (arXiv
2403.03507); reference galore-torch 1.0 (github.com/jiaweizzhao/GaLore). For a weight gradient G
(m x n), every `update_proj_gap` steps (and at step 0) the projector P is refreshed from the SVD of
G, on the smaller side:

    m <  n ("left"):  P = U[:, :r]  (m, r);   R = P.T @ G  (r, n);   dW = scale * P @ N
    m >= n ("right"): P = Vh[:r]    (r, n);   R = G @ P.T  (m, r);   dW = scale * N @ P

where R is the projected gradient, Adam's m and v are kept in R's shape, and N = m / (sqrt(v) + eps).
State per matrix: r*min(m, n) (P) + 2*r*max(m, n) (m, v) values, versus 2*m*n for AdamW.
The moments are not reprojected when P changes (as in the reference, GaLore issue #54).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from .base import KeepStateDtypes, StepsEachParameter, check_betas, check_int, check_number

PROJ_TYPES = ("std", "reverse_std", "left", "right")
GALORE_DEFAULTS = dict(update_proj_gap=200, scale=0.25, proj_type="std")  # the README's recipe


def state_bytes_for(shape, rank: int | None, dtype_bytes: int = 4) -> int:
    """State bytes of one tensor under GaLoreAdamW, in the parameter's dtype (dtype_bytes each):

        dtype_bytes * rank * (min(m, n) + 2 * max(m, n))   an (m, n) GaLore matrix: the projector
                                                           (rank x the smaller side) + Adam's m and v
                                                           (rank x the larger side each)
        dtype_bytes * 2 * prod(shape)                      rank None: a parameter left to plain AdamW

    The step counter is a Python int (no bytes). The one owner of this rule: lesson 06's checks and the
    estimator (labkit.memory) call it. Source: Zhao et al. 2024, "GaLore: Memory-Efficient LLM Training
    by Gradient Low-Rank Projection" (Table 1: optimizer states mr + 2nr for m <= n)."""
    if rank is None:
        return dtype_bytes * 2 * math.prod(shape)
    m, n = shape
    return dtype_bytes * rank * (min(m, n) + 2 * max(m, n))


# ---- the teaching version: one matrix, the "std" rule, written out -------------------------------------
@dataclass(frozen=True)
class GaLoreHP:
    """The teaching version's hyperparameters (galore-torch's names and defaults)."""

    rank: int  # r: the subspace's dimension
    lr: float = 1e-3  # learning rate
    betas: tuple = (0.9, 0.999)  # Adam's decay rates of m and v
    eps: float = 1e-6  # added to sqrt(v)
    scale: float = 0.25  # alpha: the projected-back update is scaled by it
    update_proj_gap: int = 200  # steps between projector refreshes (an SVD each)

    def __post_init__(self) -> None:
        check_int("rank", self.rank)
        check_number("lr", self.lr)
        check_betas(self.betas)
        check_number("eps", self.eps)
        check_number("scale", self.scale, low_open=True)
        check_int("update_proj_gap", self.update_proj_gap)


@torch.no_grad()
def galore_adam_naive(w: torch.Tensor, g: torch.Tensor, state: dict, hp: GaLoreHP) -> None:
    """One GaLore-Adam step on matrix w (m, n) with gradient g, in place; `state` starts as {}."""
    m_, n_ = w.shape
    t = state.get("step", 0)
    if t % hp.update_proj_gap == 0:  # new subspace: the top-r singular vectors of this gradient
        U, S, Vh = torch.linalg.svd(g.float(), full_matrices=False)  # bytes: U, S, Vh (temporary)
        state["P"] = U[:, :hp.rank].clone() if m_ < n_ else Vh[:hp.rank].clone()  # (m, r) or (r, n)
    P = state["P"]
    R = P.T @ g if m_ < n_ else g @ P.T  # (r, n) or (m, r): the gradient seen in the subspace
    if "m" not in state:
        state["m"], state["v"] = torch.zeros_like(R), torch.zeros_like(R)  # the moments are R-sized
    b1, b2 = hp.betas
    t += 1
    state["step"] = t
    state["m"].mul_(b1).add_(R, alpha=1 - b1)
    state["v"].mul_(b2).addcmul_(R, R, value=1 - b2)
    N = state["m"] / (state["v"].sqrt() + hp.eps)  # Adam's normalized step, still low-rank
    full = P @ N if m_ < n_ else N @ P  # (m, n): back to the weight's shape
    w.add_(full, alpha=-hp.lr * hp.scale * math.sqrt(1 - b2**t) / (1 - b1**t))


# ---- the real one ---------------------------------------------------------------------------------------
def projection_side(shape, proj_type: str = "std") -> str:
    """'left' (P is m x r, R is r x n) or 'right' (P is r x n, R is m x r) for a matrix of `shape`.

    "std" projects on the smaller side, and on the right for a square matrix, as galore-torch does.
    """
    m, n = shape
    if proj_type == "std":
        return "right" if m >= n else "left"
    if proj_type == "reverse_std":
        return "left" if m >= n else "right"
    return proj_type


def make_projector(grad: torch.Tensor, rank: int, side: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The top-`rank` singular vectors of grad on `side`, in `dtype` (default grad's), as a tensor of their own.

    The SVD runs in fp32 (for 16-bit weights on an fp32 copy of G: 4*m*n more bytes while it runs).
    The slice of U or Vh is copied: a view would keep all of U (m x k) or Vh (k x n) alive, as the
    reference does for fp32 weights (its projector then holds min(m, n)**2 values, not r*min(m, n)).
    torch.linalg.svd's LAPACK (cuSOLVER) workspace lives inside the call: no tensor of it outlives the op.
    """
    U, S, Vh = torch.linalg.svd(grad.float(), full_matrices=False)  # bytes: 4*(m*k + k + k*n), k=min(m,n)
    P = U[:, :rank] if side == "left" else Vh[:rank]
    return P.to(dtype or grad.dtype, memory_format=torch.contiguous_format, copy=True)  # (m, r) or (r, n): one copy


def project(grad: torch.Tensor, P: torch.Tensor, side: str) -> torch.Tensor:
    """G (m, n) -> R: P.T @ G (r, n) on the left, G @ P.T (m, r) on the right."""
    return P.t() @ grad if side == "left" else grad @ P.t()


def project_back(low: torch.Tensor, P: torch.Tensor, side: str) -> torch.Tensor:
    """N (R's shape) -> (m, n): P @ N on the left, N @ P on the right."""
    return P @ low if side == "left" else low @ P


def add_back_projected(p: torch.Tensor, low: torch.Tensor, P: torch.Tensor, side: str, alpha: float) -> None:
    """p += alpha * project_back(low) in place (addmm_), without materializing the (m, n) product."""
    if side == "left":
        p.addmm_(P, low, alpha=alpha)  # (m, r) @ (r, n)
    else:
        p.addmm_(low, P, alpha=alpha)  # (m, r) @ (r, n)


def check_galore_adam_group(group: dict) -> None:
    """Check a group of an Adam-style GaLore optimizer: lr, eps, weight_decay, betas, and the GaLore settings
    of a group that has a rank (the others run plain Adam)."""
    for name in ("lr", "eps", "weight_decay"):
        check_number(name, group[name])
    check_betas(group["betas"])
    if "rank" in group:
        check_galore_group(group)


def check_galore_group(group: dict) -> None:
    """Fill a GaLore group's defaults and check rank, update_proj_gap, scale and proj_type, in place."""
    for k, v in GALORE_DEFAULTS.items():
        group.setdefault(k, v)
    rank = check_int("rank", group["rank"])
    check_int("update_proj_gap", group["update_proj_gap"])
    check_number("scale", group["scale"], low_open=True)
    if group["proj_type"] not in PROJ_TYPES:
        raise ValueError(f"proj_type must be one of {', '.join(PROJ_TYPES)}, got {group['proj_type']!r}")
    for p in group["params"]:
        if p.dim() != 2:
            raise ValueError(f"rank: GaLore projects 2-D matrices, got a parameter of shape {tuple(p.shape)}")
        if rank > min(p.shape):
            raise ValueError(f"rank must be <= the smaller side of every matrix, got {rank} for shape {tuple(p.shape)}")


class GaLoreAdamW(StepsEachParameter, KeepStateDtypes, torch.optim.Optimizer):
    """AdamW with GaLore projection for the parameter groups that carry a "rank" (parity with galore-torch).

    Group keys for GaLore: rank (1..min(m, n)), update_proj_gap (steps between SVDs, default 200),
    scale (alpha, multiplies the back-projected update, default 0.25), proj_type ("std" default,
    "reverse_std", "left", "right"). Groups without "rank" get plain AdamW. As in the reference,
    eps is added to sqrt(v) (no bias correction on it), and weight decay comes after the update:
    p += -lr*wd*p.

    State per parameter: "step" (Python int, counting from 0 as the projector rule does), "exp_avg"
    and "exp_avg_sq" (R's shape for GaLore matrices, else p's), and "projector" for GaLore matrices.
    Step temporaries per GaLore matrix: at most two of R's size (R, then sqrt(v)+eps and N): the
    back-projection is accumulated into p by addmm_, so no (m, n) update is ever made (the reference
    makes two). Every update_proj_gap steps the SVD adds U, S, Vh (k*(m + n + 1), k = min(m, n)).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, correct_bias: bool = True):
        defaults = dict(lr=check_number("lr", lr), betas=check_betas(betas), eps=check_number("eps", eps),
                        weight_decay=check_number("weight_decay", weight_decay), correct_bias=bool(correct_bias))
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        check_galore_adam_group(self.param_groups[-1])

    def _update(self, p: torch.Tensor, state: dict, group: dict) -> None:
        if not state:
            state["step"] = 0
        grad, side = p.grad, None
        if "rank" in group:
            side = projection_side(p.shape, group["proj_type"])
            if state["step"] % group["update_proj_gap"] == 0:
                state.pop("projector", None)  # free the old one before the SVD makes the new one
                state["projector"] = make_projector(grad, group["rank"], side)
            grad = project(grad, state["projector"], side)  # (r, n) or (m, r)
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(grad, memory_format=torch.contiguous_format)  # bytes: R's size x dtype
            state["exp_avg_sq"] = torch.zeros_like(grad, memory_format=torch.contiguous_format)
        (b1, b2), lr = group["betas"], group["lr"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        state["step"] += 1
        t = state["step"]
        m.mul_(b1).add_(grad, alpha=1.0 - b1)
        v.mul_(b2).addcmul_(grad, grad, value=1.0 - b2)
        del grad  # the projected gradient (if any) is not needed past the moments
        step_size = lr
        if group["correct_bias"]:
            step_size = lr * math.sqrt(1.0 - b2**t) / (1.0 - b1**t)
        update = m / v.sqrt().add_(group["eps"])  # bytes: 2 temporaries of R's size (one freed here)
        if side is None:
            p.add_(update, alpha=-step_size)
        else:  # p += -step_size*scale * (P @ N): the GEMM accumulates into p, no (m, n) temporary
            add_back_projected(p, update, state["projector"], side, -step_size * group["scale"])
        del update
        if group["weight_decay"] > 0.0:
            p.add_(p, alpha=-lr * group["weight_decay"])


# ---- which matrices get GaLore ---------------------------------------------------------------------------
def galore_param_groups(model: nn.Module, rank: int, update_proj_gap: int = 200, scale: float = 0.25,
                        proj_type: str = "std", targets=("attn", "mlp"), **galore_group) -> list[dict]:
    """[{"params": everything else}, {"params": attention and MLP matrices, "rank": ..., ...}].

    A matrix gets GaLore when it is the weight of an nn.Linear (or transformers' Conv1D) whose module
    name contains one of `targets`, as galore-torch's torchrun_main.py chooses. Embeddings, norms,
    biases and a tied lm_head stay with plain AdamW. Extra keywords (lr, weight_decay) go to the
    GaLore group only.
    """
    chosen: dict[int, torch.Tensor] = {}
    for name, module in model.named_modules():
        w = getattr(module, "weight", None)
        linear = isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"
        if linear and isinstance(w, torch.Tensor) and w.dim() == 2 and w.requires_grad \
                and any(t in name for t in targets):
            chosen[id(w)] = w
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in chosen]
    groups = []
    if rest:
        groups.append({"params": rest})
    if chosen:
        group = {"params": list(chosen.values()), "rank": rank, "update_proj_gap": update_proj_gap,
                 "scale": scale, "proj_type": proj_type, **galore_group}
        check_galore_group(dict(group))  # fail here, naming the argument, rather than inside the optimizer
        groups.append(group)
    return groups
