"""AWQ (activation-aware weight quantization): scale the input channels that carry large activations before
group-wise int4 quantization, with the scale searched on calibration activations, no backpropagation.

Lin et al. 2024, "AWQ: Activation-aware Weight Quantization for LLM Compression and Acceleration"
(arXiv 2306.00978), section 3. For a Linear y = x W^T with input x (tokens, d_in):

1. collect x on calibration data (forward hooks) and its per-channel mean magnitude s_x = mean |x|  (d_in,);
2. for alpha in a grid on [0, 1): s = s_x^alpha (AutoAWQ's default, "duo scaling", also divides by the
   weights' own per-channel size to the power 1 - alpha), normalised by sqrt(max s * min s), and
   W' = Q(W diag(s)) / s   (scale the columns, quantize group-wise, unscale);
   keep the alpha that minimises || x W'^T - x W^T ||^2 over the outputs of every Linear that shares x;
   plain RTN (alpha = 0 of the paper's form) is a candidate, so the search never does worse than RTN on
   its own data;
3. apply s: divide the operation that produces x by s (a LayerNorm's weight and bias, or the rows of the
   previous Linear that make those channels) and quantize W diag(s); where nothing can absorb 1/s (after
   a GELU, or where x is also the residual stream) the Int4Linear keeps s (2 bytes per input feature);
4. optionally (clip search) clamp each group of W diag(s) to +-ratio x its absmax, the ratio per group
   chosen on the same x from a grid in [0.55, 1].
A large channel's weights are multiplied by s > 1 before rounding, so their relative rounding error
shrinks by s while the error the small channels see grows a little: the salient ~1 % are protected
without keeping them in 16 bits (a mixed format no kernel likes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
import torch.nn as nn

from .int4 import INT4_GROUP, Int4Linear, check_group, fake_quantize_int4

ALPHA_GRID = 20  # alpha in {0, 0.05, ..., 0.95}: the paper's and AutoAWQ's grid of 20 points
CLIP_GRID, CLIP_MAX_SHRINK = 20, 0.5  # clip ratios 1, 0.95, ..., 0.55 (AutoAWQ's defaults)
NO_CALIBRATION = ("AWQ needs calibration data: give a non-empty list of model inputs (token tensors, or dicts "
                  "of tokenizer outputs) that look like what the model will see")


# ----------------------------------------------------------------------------- activation statistics


@dataclass
class InputStats:
    """What AWQ reads about one Linear's input x (tokens, d_in), accumulated over all calibration tokens."""

    mean_abs: torch.Tensor  # (d_in,) fp32: mean |x| per input channel (s_x)
    gram: torch.Tensor  # (d_in, d_in) fp32: x^T x / tokens, so that mean ||x D^T||^2 = trace(D gram D^T)
    tokens: int  # calibration tokens seen

    def scaled(self, s: torch.Tensor) -> "InputStats":
        """The statistics of x / s (the input after 1/s is folded in front of the layer)."""
        s = s.float()
        return InputStats(self.mean_abs / s, self.gram / (s[:, None] * s[None, :]), self.tokens)


def input_stats(x: torch.Tensor) -> InputStats:
    """InputStats of rows x (..., d_in)."""
    x = x.detach().reshape(-1, x.shape[-1]).float()
    if x.shape[0] == 0:
        raise ValueError(NO_CALIBRATION)
    return InputStats(x.abs().mean(0), x.T @ x / x.shape[0], x.shape[0])


def _run(model: nn.Module, batch: Any) -> None:
    if isinstance(batch, dict):
        model(**batch)
    elif isinstance(batch, (tuple, list)):
        model(*batch)
    else:
        model(batch)


@torch.no_grad()
def collect_inputs(model: nn.Module, names: Sequence[str], calib: Iterable[Any]) -> dict[str, InputStats]:
    """Run `calib` (model inputs: tensors, tuples or dicts) through `model` in eval mode with a forward pre-hook
    on each named Linear; return its input statistics. The model's weights are not changed."""
    calib = list(calib) if calib is not None else []
    if not calib:
        raise ValueError(NO_CALIBRATION)
    acc: dict[str, list] = {}

    def hook(name):
        def pre(_module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()  # (tokens, d_in)
            a = acc.setdefault(name, [0, 0, 0])
            a[0] = a[0] + x.abs().sum(0)
            a[1] = a[1] + x.T @ x
            a[2] += x.shape[0]
        return pre

    handles = [model.get_submodule(n).register_forward_pre_hook(hook(n)) for n in names]
    was_training = model.training
    try:
        model.eval()
        for batch in calib:
            _run(model, batch)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    missing = [n for n in names if n not in acc or not acc[n][2]]
    if missing:
        raise ValueError(f"the calibration data never reached {missing[0]}: it is not on the model's forward path")
    return {n: InputStats(acc[n][0] / acc[n][2], acc[n][1] / acc[n][2], acc[n][2]) for n in names}


# ----------------------------------------------------------------------------- the searches


def awq_scale(mean_abs: torch.Tensor, alpha: float, w_mean: torch.Tensor | None = None) -> torch.Tensor:
    """s = s_x^alpha (floored at 1e-4), divided by sqrt(max s * min s) so the scales straddle 1; fp32 (d_in,).
    w_mean: AutoAWQ's "duo scaling", s = s_x^alpha / s_w^(1 - alpha), with s_w the mean over rows of |W| relative
    to its group's max (see weight_mean)."""
    s = mean_abs.float().pow(alpha)
    if w_mean is not None:
        s = s / (w_mean.float().pow(1 - alpha) + 1e-4)
    s = s.clamp_min(1e-4)
    return s / (s.max() * s.min()).sqrt()


def weight_mean(weights: Sequence[torch.Tensor], group: int) -> torch.Tensor:
    """(d_in,) mean over all rows of |W| / max |W| of its group: how large each input channel's weights are."""
    w = torch.cat([t.detach().float() for t in weights])
    g = w.abs().view(w.shape[0], -1, group)
    return (g / (g.amax(-1, keepdim=True) + 1e-6)).view(w.shape).mean(0)


def output_mse(w: torch.Tensor, w_hat: torch.Tensor, stats: InputStats) -> float:
    """Mean over tokens and outputs of (x w_hat^T - x w^T)^2 = trace(D gram D^T) / d_out, D = w_hat - w."""
    d = (w_hat.float() - w.float())  # (d_out, d_in)
    return ((d @ stats.gram) * d).sum().item() / d.shape[0]


def scaled_weight_error(weights: Sequence[torch.Tensor], stats: InputStats, s: torch.Tensor | None, group: int,
                        scale_dtype: torch.dtype = torch.float16) -> float:
    """The output MSE of W' = Q(W s)/s (s None: plain round-to-nearest) for all the weights that share the
    input (concatenated along their outputs)."""
    w = torch.cat([t.detach().float() for t in weights])  # (sum d_out, d_in)
    if s is None:
        wq = fake_quantize_int4(w, group, scale_dtype=scale_dtype)
    else:
        s = s.to(scale_dtype).float()  # the scale as the layer stores it
        wq = fake_quantize_int4(w * s, group, scale_dtype=scale_dtype) / s
    return output_mse(w, wq, stats)


@dataclass
class ScaleSearch:
    """The result of one scale search."""

    alpha: float | None  # the best exponent (None: plain RTN won, possible only with duo scaling)
    scale: torch.Tensor  # (d_in,) fp32 s = awq_scale(s_x, alpha), or ones
    errors: list[float]  # the output MSE at each alpha of the grid
    alphas: list[float]  # the grid
    rtn_error: float  # the output MSE of plain round-to-nearest (s = 1)

    @property
    def best_error(self) -> float:
        return min(self.rtn_error, *self.errors)


def _as_stats(x: torch.Tensor | InputStats) -> InputStats:
    return x if isinstance(x, InputStats) else input_stats(x)


@torch.no_grad()
def search_scale(weights: Sequence[torch.Tensor], x: torch.Tensor | InputStats, group: int = INT4_GROUP,
                 grid: int = ALPHA_GRID, scale_dtype: torch.dtype = torch.float16, duo: bool = False) -> ScaleSearch:
    """AWQ's grid search of alpha for the weights (each (d_out_i, d_in)) that share the input x: calibration
    rows (tokens, d_in) or their InputStats. Ties keep the smaller alpha. duo: AutoAWQ's default
    s = s_x^alpha / s_w^(1 - alpha) instead of the paper's s_x^alpha (then alpha 0 is not RTN: RTN is
    evaluated too, as `rtn_error`, and wins if nothing beats it)."""
    if isinstance(grid, bool) or not isinstance(grid, int) or grid <= 0:
        raise ValueError(f"grid must be a positive integer, got {grid!r}")
    stats = _as_stats(x)
    d_in = stats.mean_abs.shape[0]
    for w in weights:
        if w.dim() != 2 or w.shape[1] != d_in:
            raise ValueError(f"every weight must be (d_out, {d_in}) to share the input, got {tuple(w.shape)}")
        check_group(d_in, group, "the weights searched")
    alphas = [i / grid for i in range(grid)]
    w_mean = weight_mean(weights, group) if duo else None
    errors = [scaled_weight_error(weights, stats, None if a == 0 and not duo else awq_scale(stats.mean_abs, a, w_mean),
                                  group, scale_dtype) for a in alphas]
    rtn = scaled_weight_error(weights, stats, None, group, scale_dtype) if duo else errors[0]
    best = min(range(grid), key=lambda i: (errors[i], i))
    if rtn <= errors[best]:  # alpha 0 of the paper's form is RTN itself: it wins ties
        return ScaleSearch(0.0 if not duo else None, torch.ones(d_in), errors, alphas, rtn)
    return ScaleSearch(alphas[best], awq_scale(stats.mean_abs, alphas[best], w_mean), errors, alphas, rtn)


@torch.no_grad()
def search_clip(w: torch.Tensor, x: torch.Tensor | InputStats, group: int = INT4_GROUP, grid: int = CLIP_GRID,
                max_shrink: float = CLIP_MAX_SHRINK, scale_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Per (row, group) of w (d_out, d_in), the ratio in {1, 1 - 1/grid, ..., > 1 - max_shrink} that minimises
    the mean squared error of that group's share of the output, x_g w_g^T, on the calibration input x
    (rows or InputStats). Returns (d_out, d_in/group) fp32 ratios for quantize_int4(clip=...)."""
    stats = _as_stats(x)
    d_out, d_in = w.shape
    check_group(d_in, group, "the weight")
    ng = d_in // group
    idx = torch.arange(ng)
    blocks = stats.gram.view(ng, group, ng, group)[idx, :, idx, :]  # (ng, G, G): the diagonal blocks
    wf = w.detach().float()
    best = torch.ones(d_out, ng)
    best_err = torch.full((d_out, ng), math.inf)
    for i in range(int(max_shrink * grid)):
        ratio = 1 - i / grid
        d = (fake_quantize_int4(wf, group, torch.full((d_out, ng), ratio), scale_dtype) - wf)
        d = d.view(d_out, ng, group).transpose(0, 1)  # (ng, d_out, G)
        err = (torch.bmm(d, blocks) * d).sum(-1).T  # (d_out, ng): d_g gram_g d_g^T
        better = err < best_err
        best_err[better], best[better] = err[better], ratio
    return best


# ----------------------------------------------------------------------------- where the scales go


@dataclass(frozen=True)
class AWQGroup:
    """Linears that share one input, and what produces that input."""

    linears: tuple[str, ...]  # names of the Linears that read the input
    prev: str | None = None  # a LayerNorm or Linear that can absorb 1/s; None: each layer keeps its own s
    prev_rows: tuple[int, int] | None = None  # for a Linear prev: the rows of its output that are this input


def _groups_gpt(model: nn.Module, names: set[str]) -> list[AWQGroup]:
    """labkit's GPT (pre-LayerNorm): ln_1 -> c_attn; the v rows of c_attn -> attn.c_proj; ln_2 -> mlp.c_fc;
    mlp.c_proj after the GELU keeps its scale."""
    out = []
    for i, blk in enumerate(model.blocks):
        p, h = f"blocks.{i}", blk.ln_1.normalized_shape[0]
        out += [AWQGroup((f"{p}.attn.c_attn",), f"{p}.ln_1"),
                AWQGroup((f"{p}.attn.c_proj",), f"{p}.attn.c_attn", (2 * h, 3 * h)),
                AWQGroup((f"{p}.mlp.c_fc",), f"{p}.ln_2"),
                AWQGroup((f"{p}.mlp.c_proj",))]
    return out


def _groups_bert(model: nn.Module, names: set[str]) -> list[AWQGroup]:
    """A BERT encoder (MiniLM): post-LayerNorm, so every LayerNorm output is also the residual stream and
    cannot absorb 1/s; the attention output projection folds into the rows of `value` (attention is linear
    in v, channel by channel). Everything else keeps its scale."""
    out = []
    prefix = "encoder.layer" if hasattr(model, "encoder") else "bert.encoder.layer"
    for i in range(len(model.get_submodule(prefix))):
        p = f"{prefix}.{i}"
        out += [AWQGroup((f"{p}.attention.self.{n}",)) for n in ("query", "key", "value")]
        out += [AWQGroup((f"{p}.attention.output.dense",), f"{p}.attention.self.value", None),
                AWQGroup((f"{p}.intermediate.dense",)), AWQGroup((f"{p}.output.dense",))]
    return out


def awq_groups(model: nn.Module, names: Sequence[str]) -> list[AWQGroup]:
    """How AWQ applies its scales to `names` (Linears): folded into the previous operation for labkit's GPT
    and BERT encoders, and a scale kept in each layer for everything else (and for any Linear of a known
    model whose predecessor is not itself being handled as planned)."""
    wanted = set(names)
    known: list[AWQGroup] = []
    if hasattr(model, "blocks") and all(hasattr(b, "ln_1") and hasattr(b, "attn") for b in model.blocks):
        known = _groups_gpt(model, wanted)
    elif any(n.endswith("attention.self.query") for n in names):
        known = _groups_bert(model, wanted)
    groups, covered = [], set()
    for g in known:
        if set(g.linears) <= wanted:
            groups.append(g)
            covered |= set(g.linears)
    groups += [AWQGroup((n,)) for n in names if n not in covered]
    return groups


# ----------------------------------------------------------------------------- the whole model


@dataclass
class AWQReport:
    """What awq_quantize did, per Linear."""

    alpha: dict[str, float] = field(default_factory=dict)  # the chosen alpha
    folded: dict[str, str | None] = field(default_factory=dict)  # where 1/s went (None: kept in the layer)
    rtn_error: dict[str, float] = field(default_factory=dict)  # the group's output MSE with RTN
    awq_error: dict[str, float] = field(default_factory=dict)  # ... with the chosen scale
    stats: dict[str, InputStats] = field(default_factory=dict)  # the calibration statistics


def linear_names(model: nn.Module, skip: Sequence[str] = ("lm_head",)) -> list[str]:
    """Every nn.Linear whose name contains none of `skip` (GPT's lm_head is tied to the embedding)."""
    return [n for n, m in model.named_modules() if type(m) is nn.Linear and not any(s in n for s in skip)]


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _check_names(model: nn.Module, names: Sequence[str], group: int) -> None:
    if not names:
        raise ValueError("no Linear layers to quantize")
    for n in names:
        m = model.get_submodule(n)
        if not isinstance(m, nn.Linear):
            raise TypeError(f"{n} is a {type(m).__name__}, not an nn.Linear")
        check_group(m.in_features, group, n)


@torch.no_grad()
def rtn_quantize(model: nn.Module, group: int = INT4_GROUP, names: Sequence[str] | None = None,
                 compute_dtype: torch.dtype | None = None) -> nn.Module:
    """Round-to-nearest int4: every named Linear (default linear_names) -> Int4Linear, in place."""
    names = linear_names(model) if names is None else list(names)
    _check_names(model, names, group)
    for n in names:
        _replace(model, n, Int4Linear.from_linear(model.get_submodule(n), group, compute_dtype=compute_dtype))
    return model


def _fold(model: nn.Module, g: AWQGroup, s: torch.Tensor) -> None:
    """Divide the producer of the group's input by s and multiply the group's columns by s (exact in real
    arithmetic: the group's outputs do not change before quantization)."""
    prev = model.get_submodule(g.prev)
    if isinstance(prev, nn.LayerNorm):
        prev.weight.div_(s)
        if prev.bias is not None:
            prev.bias.div_(s)
    elif isinstance(prev, nn.Linear):
        a, b = g.prev_rows or (0, prev.out_features)
        prev.weight[a:b].div_(s[:, None])
        if prev.bias is not None:
            prev.bias[a:b].div_(s)
    else:
        raise TypeError(f"cannot fold an AWQ scale into {g.prev} ({type(prev).__name__})")
    for n in g.linears:
        model.get_submodule(n).weight.mul_(s)


@dataclass(frozen=True)
class AWQConfig:
    """How AWQ quantizes a Linear: its int4 groups, the alpha search and the clip search."""

    group: int = INT4_GROUP  # weights per (scale, zero) along the input features: an even integer >= 2
    grid: int = ALPHA_GRID  # alpha points searched in [0, 1)
    duo: bool = True  # AutoAWQ's s = s_x^alpha / s_w^(1 - alpha) (RTN a candidate); False: the paper's s_x^alpha
    clip: bool = True  # also search each group's clip ratio (on the input the layer sees after scaling)

    def __post_init__(self) -> None:
        if isinstance(self.group, bool) or not isinstance(self.group, int) or self.group < 2 or self.group % 2:
            raise ValueError(f"group must be an even integer >= 2 (e.g. 32, 64, 128), got {self.group!r}")
        if isinstance(self.grid, bool) or not isinstance(self.grid, int) or self.grid <= 0:
            raise ValueError(f"grid must be a positive integer, got {self.grid!r}")
        for name in ("duo", "clip"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")


@torch.no_grad()
def awq_linear(linear: nn.Linear, stats: InputStats, config: AWQConfig = AWQConfig(),
               compute_dtype: torch.dtype | None = None, keep_dequantized: bool = False) -> Int4Linear:
    """One Linear -> an AWQ Int4Linear that keeps its scale (nothing folded): search alpha on `stats`
    (its input's InputStats), then the clip ratios of W s on x / s. What a LoRA base under AWQ uses."""
    group = config.group
    check_group(linear.in_features, group, "this Linear")
    res = search_scale([linear.weight], stats, group, config.grid, duo=config.duo)
    s = res.scale.half().float()  # as the layer stores it
    ratios = search_clip(linear.weight.float() * s, stats.scaled(s), group) if config.clip else None
    return Int4Linear.from_linear(linear, group, s, ratios, compute_dtype, keep_dequantized)


@torch.no_grad()
def awq_quantize(model: nn.Module, calib: Iterable[Any], config: AWQConfig = AWQConfig(),
                 names: Sequence[str] | None = None, fold: bool = True, compute_dtype: torch.dtype | None = None,
                 stats: dict[str, InputStats] | None = None) -> AWQReport:
    """AWQ int4, in place: collect the named Linears' inputs on `calib`, search each group's alpha with
    the original weights, fold the scales where the model allows (fold=False: keep every scale in its
    layer), optionally (config.clip) search the clip ratios, and swap each Linear for an Int4Linear.
    `stats`: statistics already collected with collect_inputs (then calib may be None)."""
    group = config.group
    names = linear_names(model) if names is None else list(names)
    _check_names(model, names, group)
    stats = collect_inputs(model, names, calib) if stats is None else stats
    groups = awq_groups(model, names) if fold else [AWQGroup((n,)) for n in names]
    report = AWQReport(stats=stats)
    scales = {}
    for g in groups:  # 1. search, on the original weights
        res = search_scale([model.get_submodule(n).weight for n in g.linears], stats[g.linears[0]], group,
                           config.grid, duo=config.duo)
        s = res.scale.half().float()  # as stored (kept) or as folded: the same rounding either way
        scales[g] = s
        for n in g.linears:
            report.alpha[n], report.folded[n] = res.alpha, g.prev
            report.rtn_error[n], report.awq_error[n] = res.rtn_error, res.best_error
    for g in groups:  # 2. fold
        if g.prev is not None:
            _fold(model, g, scales[g])
    for g in groups:  # 3. quantize (clip searched on the input each layer now sees)
        s = scales[g]
        for n in g.linears:
            lin = model.get_submodule(n)
            kept = None if g.prev is not None else s
            w_eff = lin.weight if kept is None else lin.weight.float() * s  # what gets quantized
            ratios = search_clip(w_eff, stats[n].scaled(s), group) if config.clip else None
            _replace(model, n, Int4Linear.from_linear(lin, group, kept, ratios, compute_dtype))
    return report


# ----------------------------------------------------------------------------- the paper's first experiment


@torch.no_grad()
def keep_salient(model: nn.Module, stats: dict[str, InputStats], group: int = INT4_GROUP, fraction: float = 0.01,
                 by: str = "activation", seed: int = 0) -> nn.Module:
    """AWQ's table 1, in place: round every Linear in `stats` to int4 (RTN) but keep `fraction` of its input
    channels in full precision, chosen by mean |x| ("activation"), by the weight column's norm ("weight")
    or at random ("random"). A mixed-precision format, for the experiment only: the weights stay nn.Linear."""
    if by not in ("activation", "weight", "random"):
        raise ValueError(f"by must be 'activation', 'weight' or 'random', got {by!r}")
    if not 0 <= fraction < 1:
        raise ValueError(f"fraction must be in [0, 1), got {fraction!r}")
    gen = torch.Generator().manual_seed(seed)
    for n, st in stats.items():
        lin = model.get_submodule(n)
        w = lin.weight
        k = max(1, round(fraction * w.shape[1])) if fraction else 0
        score = {"activation": lambda: st.mean_abs, "weight": lambda: w.float().norm(dim=0),
                 "random": lambda: torch.rand(w.shape[1], generator=gen)}[by]()
        keep = score.topk(k).indices
        wq = fake_quantize_int4(w, group)
        wq[:, keep] = w[:, keep].float()
        w.copy_(wq)
    return model
