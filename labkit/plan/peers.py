"""What the published memory calculators say, each reproduced with its own conventions, beside labkit's
textbook and exact figures, with one line per difference saying which convention or which bytes cause it.

- accelerate's `accelerate estimate-memory` (docs: https://huggingface.co/docs/accelerate/usage_guides/
  model_size_estimator). It builds `AutoModel` (the base model: no LM head) on the meta device in fp32 and
  sums its parameters and buffers. "Training using Adam" is, in float32, 4 x that (weights, gradients and two
  Adam moments); in float16/bfloat16 the largest single item of {fp32 weights, 1.5 x for the gradients and
  the GEMM, 2 x for the moments, 2 x for the step}: 2 x the fp32 weights. Its "MB" and "GB" are 2**20 and
  2**30 bytes, printed rounded to 2 decimals (accelerate 1.16's `estimate_training_usage`, `convert_bytes`).
- ZeRO's Figure 1 (Rajbhandari et al. 2020, arXiv 1910.02054): model states per device of (2 + 2 + K) psi
  bytes for mixed-precision Adam (K = 12: fp32 weights, momentum, variance), stage by stage divided over
  N_d devices; its GB are 10**9 bytes.
- DeepSpeed's `estimate_zero2_model_states_mem_needs` and `estimate_zero3_model_states_mem_needs`
  (https://deepspeed.readthedocs.io/en/latest/memory.html; the formulas of the installed 0.19.8): GPU and
  host bytes of the model states only, the host's times additional_buffer_factor = 1.5.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

import torch

from labkit.estimate import estimate
from labkit.estimate.recipe import Recipe
from labkit.memory import Category
from labkit.memory.units import fmt_bytes

ACCELERATE = "accelerate estimate-memory (1.16)"
DEEPSPEED = "DeepSpeed 0.19.8 estimate_zero{stage}_model_states_mem_needs"
ZERO_FIGURE = "ZeRO Figure 1 (arXiv 1910.02054)"


# ----------------------------------------------------------------------------- the formulas


def accelerate_training(fp32_bytes: int, dtype: str) -> int:
    """accelerate's "Training using Adam" for a model of fp32_bytes (parameters and buffers in fp32).
    float32: weights + gradients + 2 moments = 4 x; float16/bfloat16: the largest of the fp32 weights,
    1.5 x (gradients and GEMM), 2 x (moments) and 2 x (step) = 2 x."""
    if dtype == "float32":
        return 4 * fp32_bytes
    if dtype in ("float16", "bfloat16"):
        return max(fp32_bytes, fp32_bytes + fp32_bytes // 2, 2 * fp32_bytes)
    raise ValueError(f"accelerate's training figure has float32, float16 and bfloat16 rows, not {dtype!r}")


def accelerate_shown(n_bytes: float) -> str:
    """A size as accelerate prints it: 1024-based units named KB, MB, GB, rounded to 2 decimals."""
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if n_bytes < 1024.0:
            return f"{round(n_bytes, 2)} {unit}"
        n_bytes /= 1024.0
    return f"{round(n_bytes, 2)} PB"


def zero_figure1(psi: float, nd: int, k: int = 12) -> dict[int, float]:
    """Model-state bytes per device of ZeRO's Figure 1: stage 0 (2 + 2 + K) psi; stage 1 (P_os)
    4 psi + K psi / N_d; stage 2 (P_os+g) 2 psi + (2 + K) psi / N_d; stage 3 (P_os+g+p) (4 + K) psi / N_d."""
    return {0: (4 + k) * psi, 1: 4 * psi + k * psi / nd, 2: 2 * psi + (2 + k) * psi / nd, 3: (4 + k) * psi / nd}


def deepspeed_zero2(total_params: int, gpus_per_node: int = 1, nodes: int = 1, cpu_offload: bool = False,
                    buffer_factor: float = 1.5) -> tuple[int, int]:
    """(host, GPU) bytes for ZeRO-2 as DeepSpeed 0.19.8 computes them. GPU: 2 psi of 16-bit parameters,
    plus 18 psi / N of 16- and 32-bit gradients, 32-bit parameters and Adam's two moments; offloaded,
    the GPU keeps 2 psi and the host max(4 N, 16) psi x 1.5."""
    n = gpus_per_node * nodes
    if cpu_offload:
        return int(total_params * max(4 * n, 16) * buffer_factor), 2 * total_params
    return int(total_params * 4 * gpus_per_node * buffer_factor), 2 * total_params + int(18 * total_params / n)


def deepspeed_zero3(total_params: int, largest_layer_params: int, gpus_per_node: int = 1, nodes: int = 1,
                    cpu_offload: bool = False, buffer_factor: float = 1.5) -> tuple[int, int]:
    """(host, GPU) bytes for ZeRO-3 with zero_init, as DeepSpeed 0.19.8 computes them: the GPU holds the
    largest layer's parameters in fp32 (4 x) plus 18 psi / N; offloaded (states and parameters) only the
    largest layer, and the host 18 psi / nodes x 1.5."""
    n = gpus_per_node * nodes
    largest = 4 * largest_layer_params
    if cpu_offload:
        return int(total_params * 18 / nodes * buffer_factor), largest
    return int(largest_layer_params * 4 * gpus_per_node * buffer_factor), largest + int(18 * total_params / n)


# ----------------------------------------------------------------------------- the model's sizes


@dataclass(frozen=True)
class Sizes:
    """What the calculators read off a model built on the meta device."""

    params: int  # every parameter (a tied one once), the causal-LM model labkit trains
    base_params: int  # AutoModel's: the same without the LM head (what accelerate builds)
    base_buffers: int  # AutoModel's buffer bytes in fp32 (accelerate counts them)
    largest_layer_params: int  # the most parameters one module holds itself (DeepSpeed's zero3 input)


def fp32_bytes(module: torch.nn.Module) -> int:
    """A module's parameters and buffers in bytes with every floating-point tensor in fp32 (accelerate's
    model size: it builds the model in fp32 and sums both)."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * (4 if t.is_floating_point() else t.element_size()) for t in tensors)


def model_sizes(model_name: str) -> Sizes:
    from transformers import AutoModel

    from labkit.models import hf

    lm = hf.build(model_name)  # meta device
    with torch.device("meta"):
        base = AutoModel.from_config(hf.get_config(model_name))
    buffers = fp32_bytes(base) - 4 * hf.count_params_of(base)
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in lm.modules())
    return Sizes(hf.count_params_of(lm), hf.count_params_of(base), buffers, largest)


# ----------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class PeerRow:
    """One calculator's figure for the recipe, as it prints it, and why it differs from labkit's."""

    tool: str
    what: str  # which of its figures
    bytes: int
    shown: str  # the figure in the tool's own units
    differences: tuple[str, ...] = ()


@dataclass(frozen=True)
class Comparison:
    recipe: Recipe
    rows: tuple[PeerRow, ...]
    textbook: int  # labkit's textbook layer (the published formulas it sums)
    exact: int  # labkit's exact peak

    def table(self) -> str:
        """Text within 100 columns: each tool, its figures (bytes, and as it prints them), the differences."""
        lines, tool = [], None
        for r in self.rows:
            if r.tool != tool:
                tool = r.tool
                lines.append(tool)
            lines.append(f"  {r.what:<40} {fmt_bytes(r.bytes):>12}   it prints {r.shown}")
            for d in r.differences:
                lines += textwrap.wrap(d, 100, initial_indent="    - ", subsequent_indent="      ",
                                       break_on_hyphens=False)
        lines.append("labkit")
        lines.append(f"  {'textbook layer (the published formulas)':<40} {fmt_bytes(self.textbook):>12}")
        lines.append(f"  {'exact (the peak moment)':<40} {fmt_bytes(self.exact):>12}")
        return "\n".join(lines)


def _live(e) -> str:
    b = e.peak
    return (f"labkit's peak holds {fmt_bytes(b[Category.ACT])} of activations and "
            f"{fmt_bytes(b[Category.TEMP])} of temporaries, which no model-state formula has")


def compare(recipe: Recipe) -> Comparison:
    """The calculators' figures for `recipe`'s model (a labkit preset name) beside labkit's."""
    if not isinstance(recipe.model, str):
        raise ValueError("compare needs a model name (a labkit preset): the calculators read a model by name")
    e = estimate(recipe)
    s = model_sizes(recipe.model)
    rows = []
    fp32 = 4 * s.base_params + s.base_buffers
    for dtype in ("float32", "bfloat16"):
        fig = accelerate_training(fp32, dtype)
        diffs = ["its MB and GB are 2**20 and 2**30 bytes (MiB and GiB)"]
        if s.params != s.base_params:
            head = s.params - s.base_params
            diffs.append(f"it builds AutoModel, without the LM head: {head:,} parameters "
                         f"({fmt_bytes(4 * head)} in fp32) fewer")
        if s.base_buffers:
            diffs.append(f"it counts the model's buffers as weights ({fmt_bytes(s.base_buffers)})")
        if dtype == "float32":
            diffs.append("4 x the fp32 weights: weights, gradients and two Adam moments, summed")
        else:
            diffs.append("in 16 bits it takes the largest single item (the two Adam moments, 2 x the fp32 "
                         "weights), not the sum of weights, gradients and moments")
        diffs.append(_live(e))
        rows.append(PeerRow(ACCELERATE, f"training using Adam, {dtype}", fig, accelerate_shown(fig),
                            tuple(diffs)))
    nd = max(recipe.dp, 1)
    for stage, b in zero_figure1(s.params, nd).items():
        rows.append(PeerRow(ZERO_FIGURE, f"stage {stage}, N_d = {nd}", int(b), f"{b / 1e9:.3g} GB",
                            ("its GB are 10**9 bytes", "K = 12: mixed-precision Adam's fp32 weights and "
                             "two moments; 2 + 2 bytes of 16-bit weights and gradients", _live(e))
                            if stage == 0 else ()))
    for stage, fn in ((2, deepspeed_zero2), (3, deepspeed_zero3)):
        args = (s.params,) if stage == 2 else (s.params, s.largest_layer_params)
        host, gpu = fn(*args, gpus_per_node=nd)
        rows.append(PeerRow(DEEPSPEED.format(stage=stage), f"per GPU of {nd}, no offload", gpu,
                            f"{gpu / 2**30:.2f}GB", (f"model states only (host: {fmt_bytes(host)}, "
                                                      "x 1.5 additional_buffer_factor)",)))
    textbook = sum(t.bytes for t in e.textbook)
    return Comparison(recipe, tuple(rows), textbook, e.peak.total)
