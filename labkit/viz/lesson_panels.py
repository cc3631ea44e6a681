"""The lessons' panels (03 to 08): each names its controls and what they mean as Recipe keywords; RecipePanel
does the rest (the budget, the predicted bars, the button that measures, the messages).

Every panel takes the lesson's `labkit.estimate.Recipe` (its model config, batch, seq, dtype and `device`:
the kernels the estimate models, the lessons' KIND; the controls set their own fields over it), `budget`
in bytes, `device` (where the button runs: DEVICE) and, where the lesson trains on text, `data` (TRAIN).
QuantPanel (lesson 07) predicts no memory: it shows the
bits and error of a quantized weight matrix.
"""

from __future__ import annotations

from dataclasses import fields

import ipywidgets as widgets
from matplotlib.figure import Figure

from labkit.memory import Category, fmt_bytes
from labkit.quant.compare import INT4_GROUPS, INT4_METHODS, QUANT_BLOCKS, QUANT_MODES, awq_report, quantize_report
from labkit.recompute import POLICIES

from .panels import STYLE, RecipePanel, with_tooltip
from .style import _Panel, beside, to_png

__all__ = ["CheckpointPanel", "AccumulationPanel", "OptimizerPanel", "RankPanel", "PEFTPanel", "QuantPanel",
           "AWQPanel", "quantize_report", "QUANT_MODES", "QUANT_BLOCKS", "PEFT_TARGETS"]

_OPTIMIZERS = ("sgd", "sgd-momentum", "adamw", "adamw8bit", "lion", "adafactor")  # lesson 05's
_OFFLOAD = ("none", "cpu", "disk")  # where AdamW's state lives ("none": on the device)
# lesson 08's target choices: what the dropdown says -> labkit.peft's lora_targets
PEFT_TARGETS = {"all linear": "all-linear", "attention (c_attn, attn.c_proj)": ["c_attn", "attn.c_proj"],
                "MLP (c_fc, mlp.c_proj)": ["c_fc", "mlp.c_proj"], "c_attn only": ["c_attn"]}
# lesson 08's frozen-base choices: what the dropdown says -> the Recipe fields (labkit.estimate.Recipe.base_dtype)
PEFT_BASES = {"model dtype": {}, "bf16 (peft)": dict(dtype="mixed-bf16", base_dtype="bf16")}


def _fixed(recipe) -> dict:
    """The recipe's fields as RecipePanel's `fixed` keywords: those it sets (not its defaults), but its device (the
    panel's `kind`)."""
    return {f.name: getattr(recipe, f.name) for f in fields(recipe)
            if f.name != "device" and getattr(recipe, f.name) != f.default}


LOSS_CHUNKS = {"off": None, "2": 2, "4": 4, "8": 8}  # Recipe.loss_chunks: the head and the loss per chunk
QUANT_SET_CHOICES = {"all linear (transformers)": "all-linear", "targets only (torchtune)": "targets"}


class CheckpointPanel(RecipePanel):
    """Lesson 03: the checkpoint policy and, for "full", the number of segments k; the loss in chunks
    along the sequence (torchtune's chunked output loss: no (B, S, V) logits at once).

    step_flops, recompute_flops: FLOPs of one plain training step and of one forward of every block
    (what a full recompute adds), counted once by the lesson; given, the verdict shows the cost in FLOPs."""

    def __init__(self, recipe, budget: int, *, device=None, data=None, step_flops: int | None = None,
                 recompute_flops: int | None = None):
        n = recipe.model.n_layer
        self.step_flops, self.recompute_flops = step_flops, recompute_flops
        self.policy = widgets.Dropdown(options=POLICIES, value="full", description="checkpoint", style=STYLE)
        self.segments = widgets.IntSlider(value=n, min=1, max=n, description="segments k", style=STYLE,
                                          continuous_update=False)
        self.chunks = with_tooltip(widgets.Dropdown(options=list(LOSS_CHUNKS), value="off",
                                                    description="loss chunks", style=STYLE),
                                   "the head and the loss on this many chunks of the sequence, each chunk's "
                                   "logits upcast alone (torchtune's CEWithChunkedOutputLoss)")
        super().__init__([self.policy, self.segments, self.chunks], budget, fixed=_fixed(recipe),
                         kind=recipe.device, device=device, data=data)

    def recipe(self) -> dict:
        full = self.policy.value == "full"
        self.segments.disabled = not full  # k means something for "full" only
        return dict(checkpoint=self.policy.value, segments=self.segments.value if full else None,
                    loss_chunks=LOSS_CHUNKS[self.chunks.value])

    def describe(self, est) -> str:
        if not self.step_flops:
            return ""
        extra = self.recompute_flops if self.policy.value in ("full", "sqrt") else 0  # selective recomputes no matmul
        total = self.step_flops + (extra or 0)
        return (f"FLOPs per step {total / 1e9:.2f} G (x{total / self.step_flops:.3f}"
                + (": every checkpointed block is recomputed once)" if extra else ")"))


class AccumulationPanel(RecipePanel):
    """Lesson 04: the micro-batch (a divisor of the batch) and the checkpoint policy."""

    def __init__(self, recipe, budget: int, *, device=None, data=None):
        batch = recipe.batch
        self.micro = widgets.SelectionSlider(options=[m for m in range(1, batch + 1) if batch % m == 0], value=batch,
                                             description="micro-batch", style=STYLE, continuous_update=False)
        self.checkpoint = widgets.Dropdown(options=POLICIES, value="none", description="checkpoint", style=STYLE)
        super().__init__([self.micro, self.checkpoint], budget, fixed=_fixed(recipe), kind=recipe.device,
                         device=device, data=data)

    def recipe(self) -> dict:
        return dict(checkpoint=self.checkpoint.value, micro_batch=self.micro.value)

    def describe(self, est) -> str:
        n = self.fixed["batch"] // self.micro.value
        return f"{n} micro-batch{'es' if n > 1 else ''} of {self.micro.value} row{'s' if self.micro.value > 1 else ''}"


class OptimizerPanel(RecipePanel):
    """Lesson 05: the optimizer, stepping inside backward, and where AdamW's state lives (offload)."""

    def __init__(self, recipe, budget: int, *, device=None, data=None, optimizers=_OPTIMIZERS):
        self.optimizer = widgets.Dropdown(options=list(optimizers), value="adamw", description="optimizer", style=STYLE)
        self.in_backward = widgets.Checkbox(value=False, description="step in backward", style=STYLE)
        self.offload = with_tooltip(widgets.Dropdown(options=_OFFLOAD, value="none", description="offload",
                                                     style=STYLE),
                                    "where AdamW's state lives: on the device, in host memory or on disk")
        super().__init__([self.optimizer, self.in_backward, self.offload], budget, fixed=_fixed(recipe),
                         kind=recipe.device, device=device, data=data)

    def recipe(self) -> dict:
        return dict(optimizer=self.optimizer.value, step_in_backward=self.in_backward.value,
                    optimizer_offload=None if self.offload.value == "none" else self.offload.value)

    def describe(self, est) -> str:
        return f"optimizer state {fmt_bytes(est.peak[Category.OPT])}"


class RankPanel(RecipePanel):
    """Lesson 06: GaLore's rank, 8-bit moments and stepping inside backward.

    ranks: the ranks offered; adamw_state: AdamW's optimizer state in bytes, for comparison (optional)."""

    def __init__(self, recipe, budget: int, rank: int, *, ranks=None, device=None, data=None,
                 adamw_state: int | None = None):
        self.adamw_state = adamw_state
        ranks = sorted({*(ranks or (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)), int(rank)})
        self.rank = widgets.SelectionSlider(options=ranks, value=int(rank), description="rank", style=STYLE,
                                            continuous_update=False)
        self.eight_bit = widgets.Checkbox(value=False, description="8-bit moments", style=STYLE)
        self.in_backward = widgets.Checkbox(value=False, description="step in backward", style=STYLE)
        super().__init__([self.rank, self.eight_bit, self.in_backward], budget, fixed=_fixed(recipe),
                         kind=recipe.device, device=device, data=data)

    def recipe(self) -> dict:
        return dict(optimizer="galore8bit" if self.eight_bit.value else "galore", rank=self.rank.value,
                    step_in_backward=self.in_backward.value)

    def describe(self, est) -> str:
        words = f"optimizer state {fmt_bytes(est.peak[Category.OPT])}"
        return words + (f" (AdamW: {fmt_bytes(self.adamw_state)})" if self.adamw_state is not None else "")


class PEFTPanel(RecipePanel):
    """Lesson 08: full fine-tuning, LoRA (rank, targets, the base's quantization) or LISA (active layers)."""

    def __init__(self, recipe, budget: int, *, rank: int = 8, device=None, data=None, targets: dict | None = None):
        self.targets_map = dict(targets or PEFT_TARGETS)
        self.method = widgets.ToggleButtons(options=["full", "LoRA", "LISA"], value="LoRA", description="method",
                                            style=STYLE)
        self.rank = widgets.SelectionSlider(options=sorted({1, 2, 4, 8, 16, 32, 64, int(rank)}), value=int(rank),
                                            description="rank", style=STYLE, continuous_update=False)
        self.targets = widgets.Dropdown(options=list(self.targets_map), value=next(iter(self.targets_map)),
                                        description="targets", style=STYLE)
        self.quant = with_tooltip(widgets.Dropdown(options=["none", "int8", "nf4"], value="none", description="base",
                                                   style=STYLE),
                                  "the frozen base weights: as they are, int8, or NF4 (QLoRA)")
        self.quant_set = with_tooltip(widgets.Dropdown(options=list(QUANT_SET_CHOICES),
                                                       value=next(iter(QUANT_SET_CHOICES)),
                                                       description="quantized", style=STYLE),
                                      "which Linears a quantized base stores quantized: every one but the "
                                      "head (transformers + bitsandbytes) or the LoRA targets only (torchtune)")
        self.base_dtype = with_tooltip(widgets.Dropdown(options=list(PEFT_BASES), value=next(iter(PEFT_BASES)),
                                                        description="base dtype", style=STYLE),
                                       "the frozen base's precision: the model's dtype, or bf16 under fp32 "
                                       "adapters and autocast (how peft runs LoRA)")
        self.layers = widgets.IntSlider(value=1, min=1, max=recipe.model.n_layer, description="LISA layers",
                                        style=STYLE, continuous_update=False)
        super().__init__([self.method, self.rank, self.targets, self.quant, self.quant_set, self.base_dtype,
                          self.layers], budget,
                         fixed=_fixed(recipe),
                         kind=recipe.device, device=device, data=data)

    def recipe(self) -> dict:
        method = self.method.value
        lora = method == "LoRA"
        quantized = lora and self.quant.value != "none"
        for w, used in ((self.rank, lora), (self.targets, lora), (self.quant, lora), (self.quant_set, quantized),
                        (self.base_dtype, lora), (self.layers, method == "LISA")):
            w.disabled = not used  # each method reads its own knobs only
        if lora:
            which = dict(quant_set=QUANT_SET_CHOICES[self.quant_set.value]) if quantized else {}
            return dict(lora_rank=self.rank.value, lora_targets=self.targets_map[self.targets.value],
                        quant=self.quant.value, **which, **PEFT_BASES[self.base_dtype.value])
        return dict(lisa_layers=self.layers.value) if method == "LISA" else {}

    def describe(self, est) -> str:
        p = est.peak
        return (f"trainable state (GRAD + OPT) {fmt_bytes(p[Category.GRAD] + p[Category.OPT])}, "
                f"weights {fmt_bytes(p[Category.PARAM] + p[Category.BUFFER])}")


# ---- lesson 07: bits against error --------------------------------------------------------------
def _show(panel, fig: Figure) -> None:
    """Lesson 07's panels: the legend, the margins, and the figure into the panel's picture (kept for tests)."""
    fig.axes[0].legend(fontsize=7)
    fig.subplots_adjust(left=0.14, right=0.97, bottom=0.18, top=0.88)
    panel.last_figure = fig
    panel.picture.value = to_png(fig, dpi=80, tight=False)


class QuantPanel(_Panel):
    """Lesson 07: mode and block size pick a point on the bits-vs-error curves of one weight matrix.

    The curves (every mode at every block size) are computed once, when the panel is made; a control
    change only picks the point, writes it in words and redraws (the chosen point starred)."""

    def __init__(self, w, mode: str = "NF4 + double quant", blocksize: int = 64):
        self.points = {m: {b: quantize_report(w, m, b) for b in QUANT_BLOCKS} for m in QUANT_MODES}
        self.mode = widgets.Dropdown(options=QUANT_MODES, value=mode, description="mode", style=STYLE)
        self.blocksize = widgets.SelectionSlider(options=QUANT_BLOCKS, value=blocksize, description="block size",
                                                 style=STYLE, continuous_update=False)
        self.picture, self.words = widgets.Image(format="png"), widgets.HTML()
        self.last_figure = None
        self.widget = widgets.VBox([beside(self.mode, self.blocksize), self.words, self.picture])
        self._watch((self.mode, self.blocksize))

    def _on_change(self, _change=None) -> None:
        bits, err = self.points[self.mode.value][self.blocksize.value]
        self.words.value = (f"<b>{self.mode.value}</b>, blocks of {self.blocksize.value}: {bits:.3f} bits/param, "
                            f"relative RMSE {err:.4f}")
        fig = Figure(figsize=(6, 2.8))
        ax = fig.add_subplot(1, 1, 1)
        for m, pts in self.points.items():
            ax.plot([p[0] for p in pts.values()], [p[1] for p in pts.values()], "o-", ms=3, label=m)
        ax.plot([bits], [err], "k*", ms=12)
        ax.set(xlabel="bits per parameter", ylabel="relative RMSE", yscale="log", title="each point: one block size")
        _show(self, fig)


class AWQPanel(_Panel):
    """Lesson 07: int4 method and group size redraw bits per weight, the output error against RTN's, and the
    error over AWQ's alpha grid, for one weight matrix and its layer's input statistics."""

    def __init__(self, w, stats, method: str = "int4 AWQ", group: int = 128):
        self.w, self.stats = w, stats
        self.method = widgets.Dropdown(options=INT4_METHODS, value=method, description="method", style=STYLE)
        self.group = widgets.SelectionSlider(options=INT4_GROUPS, value=group, description="group size", style=STYLE,
                                             continuous_update=False)
        self.picture, self.words = widgets.Image(format="png"), widgets.HTML()
        self.last_figure = self.last_report = None
        self.widget = widgets.VBox([beside(self.method, self.group), self.words, self.picture])
        self._watch((self.method, self.group))

    def _on_change(self, _change=None) -> None:
        bits, rel, alpha, errors = self.last_report = awq_report(self.w, self.stats, self.method.value,
                                                                 self.group.value)
        self.words.value = (f"<b>{self.method.value}</b>, groups of {self.group.value}: {bits:.3f} bits/weight, "
                            f"output MSE {rel:.3f} x RTN's (alpha {alpha:.2f})")
        fig = Figure(figsize=(6, 2.8))
        ax = fig.add_subplot(1, 1, 1)
        grid = [i / len(errors) for i in range(len(errors))]
        ax.plot(grid, [e / errors[0] for e in errors], "o-", ms=3, label=f"groups of {self.group.value}")
        ax.plot([alpha], [rel], "k*", ms=12, label=self.method.value)
        ax.set(xlabel="alpha", ylabel="output MSE / RTN's", title="W in int4: AWQ's search")
        _show(self, fig)
