"""LoRA from scratch: freeze a Linear's weight W and train a low-rank update B @ A beside it.

y = x W^T + b + scaling * (dropout(x) A^T) B^T, with A (r, d_in), B (d_out, r), scaling = alpha / r
(or alpha / sqrt(r) with rsLoRA). A starts Kaiming-uniform(a=sqrt(5)), B starts at zero, so at step 0
the adapted model computes exactly what the base model did (the defaults of peft's LoraConfig).

Two versions, teaching first:

- `LoRALinearNaive` builds the merged weight W + scaling * B @ A in every forward. Simple, but it
  allocates a full (d_out, d_in) matrix each step and autograd keeps it for backward: the frozen
  weight's bytes come back as activations.
- `LoRALinear` (the real one, what peft does) adds the low-rank path to the base output: only the
  (N, r) intermediate is extra. Bytes per adapted Linear in fp32 with AdamW: 4 per base weight
  (frozen: no gradient, no state) + 16 per adapter parameter (4 weight + 4 grad + 8 Adam), with
  adapter_numel(d_in, d_out, r) = r * (d_in + d_out) adapter parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

ADAPTER_NAMES = ("lora_A", "lora_B")


def _check_rank(r, alpha) -> None:
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise ValueError(f"LoRA rank r must be a positive integer (typical: 4 to 64), got {r!r}")
    if not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ValueError(f"LoRA alpha must be a positive number (peft's default is 8), got {alpha!r}")


@dataclass(frozen=True)
class LoRAConfig:
    """Which Linears get adapters and what the adapters are (peft's LoraConfig): apply_qlora's, and the tasks'."""

    targets: str | tuple = "all-linear"  # module names or endings (a list is kept as a tuple), or "all-linear"
    r: int = 8  # the adapters' rank
    alpha: float = 8  # the update is scaled by alpha / r (alpha / sqrt(r) with rslora)
    dropout: float = 0.0  # dropout on the adapter path's input
    rslora: bool = False  # rsLoRA's scaling alpha / sqrt(r)
    train_also: tuple = ()  # names or endings of modules that stay fully trainable (a new classification head)

    def __post_init__(self) -> None:
        _check_rank(self.r, self.alpha)
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        for name in ("targets", "train_also"):
            v = getattr(self, name)
            if not isinstance(v, str):
                object.__setattr__(self, name, tuple(v))  # lists are welcome; kept as tuples, as a frozen config wants


def adapter_numel(d_in: int, d_out: int, r: int) -> int:
    """Trainable values LoRA adds beside one (d_out, d_in) Linear: r * (d_in + d_out), A (r, d_in) + B (d_out, r).
    Source: Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models" (section 4.1); peft's LoraLayer."""
    for name, v in (("d_in", d_in), ("d_out", d_out), ("r", r)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return r * (d_in + d_out)


def lora_scaling(r: int, alpha: float, rslora: bool = False) -> float:
    """alpha / r (Hu et al. 2021), or alpha / sqrt(r) with rsLoRA (Kalajdzievski 2023)."""
    _check_rank(r, alpha)
    return alpha / math.sqrt(r) if rslora else alpha / r


def _init_adapters(A: torch.Tensor, B: torch.Tensor) -> None:
    nn.init.kaiming_uniform_(A, a=math.sqrt(5))  # what nn.Linear does to its weight, peft does to A
    nn.init.zeros_(B)  # B = 0: the update B @ A starts at exactly zero


# ---- (a) the teaching version: merge in every forward ---------------------------------------------
class LoRALinearNaive(nn.Module):
    """W' = W + scaling * B @ A, then one Linear. Same outputs and gradients; a full-size W' per forward."""

    def __init__(self, base: nn.Linear, r: int = 8, alpha: float = 8, rslora: bool = False):
        super().__init__()
        self.scaling = lora_scaling(r, alpha, rslora)
        self.base = base.requires_grad_(False)
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(r, w.shape[1], dtype=w.dtype, device=w.device))  # (r, d_in)
        self.lora_B = nn.Parameter(torch.empty(w.shape[0], r, dtype=w.dtype, device=w.device))  # (d_out, r)
        _init_adapters(self.lora_A, self.lora_B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        merged = self.base.weight + self.scaling * (self.lora_B @ self.lora_A)  # (d_out, d_in): bytes of W again
        return F.linear(x, merged, self.base.bias)  # autograd saves `merged` to compute dL/dx


# ---- (b) the real one: a low-rank side path --------------------------------------------------------
class LoRALinear(nn.Module):
    """A frozen base layer plus a trainable low-rank path; `merge()` folds it into W for inference.

    base: an nn.Linear, or any module with in_features/out_features and a forward (e.g. NF4Linear).
    dropout: applied to the adapter's input only, as in peft.
    """

    def __init__(self, base: nn.Module, r: int = 8, alpha: float = 8, dropout: float = 0.0, rslora: bool = False,
                 adapter_dtype: torch.dtype | None = None):
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout!r}")
        self.r, self.alpha, self.rslora = r, alpha, rslora
        self.scaling = lora_scaling(r, alpha, rslora)
        self.base = base.requires_grad_(False)
        self.in_features, self.out_features = base.in_features, base.out_features
        ref = next(iter([*base.parameters(), *base.buffers()]), None)  # where the base lives
        device = ref.device if ref is not None else None
        floats = [p for p in base.parameters() if p.dtype.is_floating_point]
        dtype = adapter_dtype or (floats[0].dtype if floats else torch.float32)
        self.lora_A = nn.Parameter(torch.empty(r, self.in_features, dtype=dtype, device=device))  # (r, d_in)
        self.lora_B = nn.Parameter(torch.empty(self.out_features, r, dtype=dtype, device=device))  # (d_out, r)
        _init_adapters(self.lora_A, self.lora_B)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.merged = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)  # (..., d_out); frozen: autograd keeps x only for dL/dx
        if self.merged:
            return out
        h = self.dropout(x.to(self.lora_A.dtype))  # peft casts the input to the adapter dtype
        delta = F.linear(F.linear(h, self.lora_A), self.lora_B) * self.scaling  # (..., r) then (..., d_out)
        return (out + delta).to(out.dtype)

    def delta_weight(self) -> torch.Tensor:
        """scaling * B @ A: (d_out, d_in), what merge() adds to W."""
        return (self.lora_B @ self.lora_A) * self.scaling

    def _base_weight(self) -> torch.Tensor:
        w = getattr(self.base, "weight", None)
        if not isinstance(w, torch.Tensor) or not w.dtype.is_floating_point or w.shape != (self.out_features, self.in_features):
            raise TypeError(f"cannot merge into a {type(self.base).__name__} base: merge() needs a float weight of "
                            f"shape ({self.out_features}, {self.in_features}); dequantize the base first")
        return w

    @torch.no_grad()
    def merge(self) -> None:
        """W += scaling * B @ A; the forward then runs the base layer alone (no adapter cost)."""
        if not self.merged:
            w = self._base_weight()
            w += self.delta_weight().to(w.dtype)
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """W -= scaling * B @ A (exact up to rounding in W's dtype)."""
        if self.merged:
            w = self._base_weight()
            w -= self.delta_weight().to(w.dtype)
            self.merged = False

    def extra_repr(self) -> str:
        return f"r={self.r}, alpha={self.alpha}, scaling={self.scaling:g}, merged={self.merged}"


# ---- adapting a whole model ------------------------------------------------------------------------
def _is_conv1d(m: nn.Module) -> bool:
    return type(m).__name__ == "Conv1D" and hasattr(m, "weight") and m.weight.dim() == 2  # transformers' GPT-2


def conv1d_as_linear(conv: nn.Module) -> nn.Linear:
    """transformers' Conv1D (GPT-2: y = x W + b, W of shape (d_in, d_out)) as the equal nn.Linear (W transposed).
    Same outputs and bytes; a merged model then holds Linear weights, (d_out, d_in), where GPT-2 had Conv1D."""
    w = conv.weight  # (d_in, d_out)
    lin = nn.Linear(w.shape[0], w.shape[1], bias=conv.bias is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w.t())
        if conv.bias is not None:
            lin.bias.copy_(conv.bias)
    return lin.requires_grad_(w.requires_grad)


def linear_names(model: nn.Module) -> list[str]:
    """Full names of the model's nn.Linear (and GPT-2 Conv1D) modules that LoRA can adapt (not the bases of
    adapted ones)."""
    bases = {id(m.base) for m in model.modules() if isinstance(m, (LoRALinear, LoRALinearNaive))}
    return [n for n, m in model.named_modules()
            if (isinstance(m, nn.Linear) or _is_conv1d(m)) and n and id(m) not in bases]


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)  # peft's rule: a full name or its ending


def _available(model: nn.Module) -> str:
    names = linear_names(model)
    leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
    shown = ", ".join(names[:12]) + (f", ... ({len(names)} in all)" if len(names) > 12 else "")
    return f"Linear modules here: {shown}; their endings: {', '.join(leaves) or 'none'}"


def find_targets(model: nn.Module, targets: str | Sequence[str], exclude: Sequence[str] = ("lm_head",)) -> list[str]:
    """Names of the Linear modules `targets` selects; "all-linear" takes every Linear but `exclude`.

    A target that selects nothing raises ValueError naming the Linear modules there are.
    """
    names = linear_names(model)
    if targets == "all-linear":
        return [n for n in names if not any(_matches(n, e) for e in exclude)]
    if isinstance(targets, str):
        targets = [targets]
    if not targets:
        raise ValueError(f"targets is empty: name the Linear modules to adapt, e.g. ['c_attn'], or 'all-linear'; {_available(model)}")
    chosen = []
    for t in targets:
        hit = [n for n in names if _matches(n, t)]
        if not hit:
            raise ValueError(f"target {t!r} matches no Linear module; {_available(model)}")
        chosen += [n for n in hit if n not in chosen]
    return chosen


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def apply_lora(model: nn.Module, targets: str | Sequence[str] = "all-linear", r: int = 8, alpha: float = 8,
               dropout: float = 0.0, rslora: bool = False, train_also: Iterable[str] = (),
               wrap=None) -> nn.Module:
    """Replace the targeted nn.Linear modules (transformers' Conv1D: converted to the equal nn.Linear first) by
    LoRALinear in place, freeze every other parameter; return the model.

    targets: module names or endings ("c_attn", "attn.c_proj") or "all-linear" (all but lm_head).
    train_also: names or endings of modules that stay fully trainable (a new classification head).
    wrap: how a targeted Linear becomes an adapted one (default LoRALinear); QLoRA passes its own.
    """
    _check_rank(r, alpha)
    chosen = find_targets(model, targets)
    keep = list(train_also)
    for t in keep:
        if not any(_matches(n, t) for n, _ in model.named_modules()):
            raise ValueError(f"train_also: no module named {t!r}; module names look like {', '.join(n for n, _ in list(model.named_modules())[1:6])}")
    model.requires_grad_(False)
    wrap = wrap or (lambda lin: LoRALinear(lin, r=r, alpha=alpha, dropout=dropout, rslora=rslora))
    for name in chosen:
        base = model.get_submodule(name)
        _replace(model, name, wrap(conv1d_as_linear(base) if _is_conv1d(base) else base))
    for name, m in model.named_modules():
        if any(_matches(name, t) for t in keep):
            m.requires_grad_(True)
    return model


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def merge_lora(model: nn.Module, merge: bool = True) -> nn.Module:
    """merge() (or unmerge()) every LoRALinear in the model."""
    for m in lora_modules(model).values():
        m.merge() if merge else m.unmerge()
    return model


def lora_state_dict(model: nn.Module, include_trainable: bool = True) -> dict[str, torch.Tensor]:
    """The adapters (keys ending in lora_A / lora_B) and, by default, every other trainable parameter."""
    return {k: v for k, v in model.state_dict(keep_vars=True).items()
            if k.rsplit(".", 1)[-1] in ADAPTER_NAMES or (include_trainable and v.requires_grad)}


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that require grad, each once (tied weights count once): what the optimizer gets."""
    seen, out = set(), []
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


class ParamCounts(NamedTuple):
    trainable: int  # elements that get gradients and optimizer state
    total: int  # all parameter elements (a packed 4-bit weight counts its stored elements)

    def __str__(self) -> str:
        return f"trainable {self.trainable:,} of {self.total:,} ({100 * self.trainable / max(self.total, 1):.2f}%)"


def count_parameters(model: nn.Module) -> ParamCounts:
    """(trainable, total) parameter elements, tied weights counted once, like peft's print_trainable_parameters."""
    return ParamCounts(sum(p.numel() for p in trainable_parameters(model)), sum(p.numel() for p in model.parameters()))
