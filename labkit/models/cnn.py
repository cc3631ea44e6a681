"""A small CNN family scaled by EfficientNet's compound rule, with its memory predicted layer by layer.

Tan & Le, "EfficientNet: Rethinking Model Scaling for CNNs" (ICML 2019, arXiv 1905.11946), Eq. 3:
depth d = alpha^phi, width w = beta^phi, resolution r = gamma^phi, with alpha * beta^2 * gamma^2 ~ 2
(their grid search: alpha = 1.2, beta = 1.1, gamma = 1.15), so FLOPs (~ d * w^2 * r^2) about double
per unit of phi. Memory does not: parameters grow ~ d * w^2 (x1.45 per phi) and the activations
saved for backward ~ d * w * r^2 (x1.75 per phi, per image).

The network: a stem (conv 3x3 -> BatchNorm -> ReLU), then stages of the same conv-BN-ReLU block, the
first block of each stage with stride 2, then a global mean over H, W and a linear classifier.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from labkit.memory import Category, Ledger, Measurement, Term, TermKey

ALPHA, BETA, GAMMA = 1.2, 1.1, 1.15  # EfficientNet's grid search on B0 (Tan & Le 2019, section 3.3)
F32 = 4  # bytes per fp32 element


@dataclass(frozen=True)
class CNNConfig:
    phi: float = 0.0  # compound step: depth x alpha^phi, width x beta^phi, resolution x gamma^phi
    depths: tuple[int, ...] = (1, 2, 2)  # blocks per stage at phi = 0
    widths: tuple[int, ...] = (16, 24, 32)  # channels per stage at phi = 0
    stem: int = 16  # stem channels at phi = 0
    resolution: int = 32  # input height = width at phi = 0
    classes: int = 10
    alpha: float = ALPHA
    beta: float = BETA
    gamma: float = GAMMA

    def __post_init__(self) -> None:
        if self.phi < 0 or len(self.depths) != len(self.widths) or not self.depths:
            raise ValueError("phi must be >= 0 and depths, widths one entry per stage")

    def scaled_depths(self) -> list[int]:
        """ceil(d * alpha^phi) blocks per stage (a block is never split: round up, as EfficientNet does)."""
        return [math.ceil(d * self.alpha**self.phi) for d in self.depths]

    def scaled_widths(self) -> list[int]:
        return [_width(c, self.beta, self.phi) for c in self.widths]

    def scaled_stem(self) -> int:
        return _width(self.stem, self.beta, self.phi)

    def scaled_resolution(self) -> int:
        return int(round(self.resolution * self.gamma**self.phi))

    def at(self, phi: float) -> "CNNConfig":
        return replace(self, phi=phi)

    def describe(self) -> str:
        return (f"phi={self.phi:g}: depths {self.scaled_depths()}, widths {self.scaled_widths()}, "
                f"resolution {self.scaled_resolution()}")


def _width(c: int, beta: float, phi: float) -> int:
    return max(1, int(round(c * beta**phi)))


def layers(config: CNNConfig, resolution: int | None = None) -> list[tuple[str, int, int, int, int]]:
    """The conv-BN-ReLU layers: (name, in channels, out channels, stride, output side H = W)."""
    h = config.scaled_resolution() if resolution is None else resolution
    out, c_in = [], 3
    c = config.scaled_stem()
    out.append(("stem", c_in, c, 1, h))
    c_in = c
    for s, (d, c) in enumerate(zip(config.scaled_depths(), config.scaled_widths())):
        for b in range(d):
            stride = 2 if b == 0 else 1
            h = (h - 1) // stride + 1  # conv 3x3, padding 1: ceil(h / stride)
            out.append((f"stage{s + 1}.{b + 1}", c_in, c, stride, h))
            c_in = c
    return out


class CompoundCNN(nn.Module):
    def __init__(self, config: CNNConfig):
        super().__init__()
        self.config = config
        blocks = []
        for _, c_in, c_out, stride, _ in layers(config):
            blocks += [nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()]
        self.body = nn.Sequential(*blocks)
        self.head = nn.Linear(config.scaled_widths()[-1], config.classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None):
        h = self.body(x)  # (B, C, H', W')
        logits = self.head(h.mean((2, 3)))  # (B, classes); mean's backward needs only the shape
        return logits if y is None else F.cross_entropy(logits, y)


# ----------------------------------------------------------------------------- prediction


@dataclass
class CNNPrediction:
    config: CNNConfig
    batch: int
    resolution: int
    terms: list[Term] = field(default_factory=list)

    def bytes(self, category: Category) -> int:
        return sum(t.bytes for t in self.terms if t.category is category)

    @property
    def params(self) -> int:
        return self.bytes(Category.PARAM)

    @property
    def saved(self) -> int:
        """Bytes saved for backward: the ledger's ACT when backward starts."""
        return self.bytes(Category.ACT)

    @property
    def resident(self) -> int:
        """Parameters + buffers + saved activations: exactly what is live when backward starts (plain SGD,
        gradients set to None). The step's peak is a little higher: backward adds each layer's gradients
        and the activation gradients in flight while it frees the saved tensors (see `measure`)."""
        return self.params + self.bytes(Category.BUFFER) + self.saved


def predict(config: CNNConfig, batch: int, resolution: int | None = None) -> CNNPrediction:
    """Every byte term of the model's parameters, buffers and saved activations for one fp32 training step.

    Sources: the backward formulas in PyTorch's tools/autograd/derivatives.yaml: convolution saves its
    input and weight; native_batch_norm saves its input, save_mean and save_invstd (C floats each);
    relu (threshold_backward) saves its result; mean saves only sizes; addmm saves mat1 (the pooled
    features); log_softmax saves its result; nll_loss saves its input, target and total_weight.
    The input batch and targets are made outside the step (by the data loader) and not counted.
    """
    res = config.scaled_resolution() if resolution is None else resolution
    p = CNNPrediction(config, batch, res)
    src = "tools/autograd/derivatives.yaml"
    for i, (name, c_in, c_out, _, h) in enumerate(layers(config, res)):
        n = batch * c_out * h * h
        P, B, A = (dict(key=k, block=i) for k in (TermKey.PARAMETERS, TermKey.BUFFERS, TermKey.SAVED_ACTIVATIONS))
        p.terms += [
            Term(f"{name} conv weight", Category.PARAM, 9 * c_in * c_out * F32, f"3*3*{c_in}*{c_out}*4", **P),
            Term(f"{name} BN weight+bias", Category.PARAM, 2 * c_out * F32, f"2*{c_out}*4", **P),
            Term(f"{name} BN running mean+var", Category.BUFFER, 2 * c_out * F32, f"2*{c_out}*4", **B),
            Term(f"{name} BN num_batches_tracked", Category.BUFFER, 8, "one int64", **B),
            Term(f"{name} conv output (BN's saved input)", Category.ACT, n * F32, f"{batch}*{c_out}*{h}*{h}*4", src,
                 **A),
            Term(f"{name} BN save_mean+save_invstd", Category.ACT, 2 * c_out * F32, f"2*{c_out}*4", src, **A),
            Term(f"{name} ReLU output (relu's result, next conv's input)", Category.ACT, n * F32,
                 f"{batch}*{c_out}*{h}*{h}*4", src, **A),
        ]
    c, k = config.scaled_widths()[-1], config.classes
    p.terms += [
        Term("head weight+bias", Category.PARAM, (c * k + k) * F32, f"({c}*{k}+{k})*4", key=TermKey.PARAMETERS),
        Term("pooled features (addmm's mat1)", Category.ACT, batch * c * F32, f"{batch}*{c}*4", src, key=TermKey.HEAD),
        Term("log_softmax output (nll_loss's input)", Category.ACT, batch * k * F32, f"{batch}*{k}*4", src,
             key=TermKey.LOG_SOFTMAX),
        Term("nll_loss total_weight", Category.ACT, F32, "one fp32 scalar", src, key=TermKey.LOSS_TEMPS),
        Term("the loss", Category.ACT, F32, "one fp32 scalar, alive when backward starts", key=TermKey.LOSS_TEMPS),
        Term("backward's seed gradient", Category.ACT, F32,
             "ones_like(loss), one fp32 scalar: loss.backward() makes it before the graph runs",
             key=TermKey.LOSS_TEMPS),
    ]
    return p


def activation_growth_per_phi(alpha: float = ALPHA, beta: float = BETA, gamma: float = GAMMA) -> dict[str, float]:
    """The continuous rule's growth per unit phi: activations d*w*r^2, parameters d*w^2, FLOPs d*w^2*r^2."""
    return {"activations": alpha * beta * gamma**2, "parameters": alpha * beta**2, "flops": alpha * beta**2 * gamma**2}


# ----------------------------------------------------------------------------- measurement


def make_batch(config: CNNConfig, batch: int, resolution: int | None = None, seed: int = 0, device="cpu"):
    """Random images (B, 3, r, r) and labels (B,), made outside any ledger (as a data loader would)."""
    res = config.scaled_resolution() if resolution is None else resolution
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, res, res, generator=g).to(device)
    y = torch.randint(0, config.classes, (batch,), generator=g).to(device)
    return x, y


def measure(config: CNNConfig, batch: int, resolution: int | None = None, budget: int | None = None,
            device="cpu", seed: int = 0) -> Measurement:
    """One SGD training step (no optimizer state) of CompoundCNN under the ledger: exact bytes by category.
    `resident_at_backward(measurement)` is the figure `predict(...).resident` predicts."""
    torch.manual_seed(seed)
    model = CompoundCNN(config).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = make_batch(config, batch, resolution, seed, device)
    with Ledger(model, opt, budget=budget, label=f"CNN {config.describe()} B={batch}") as led:
        loss = model(x, y)
        loss.backward()
        del loss
        opt.step()
        opt.zero_grad(set_to_none=True)
    return led.measurement()


def largest_phi(config: CNNConfig, batch: int, budget: int, phis=None) -> float | None:
    """The largest phi (from `phis`, default 0, 0.5, ..., 8) whose predicted `resident` bytes fit `budget`; None if none."""
    phis = [i / 2 for i in range(17)] if phis is None else phis
    fits = [phi for phi in phis if predict(config.at(phi), batch).resident <= budget]
    return max(fits, default=None)


def progressive_schedule(config: CNNConfig, batch: int, resolutions: list[int], scale_batch: bool = False):
    """Per phase of a progressive-resizing schedule: (resolution, batch, predicted resident bytes).

    scale_batch: keep batch x resolution^2 (the pixels per step) equal to the last phase's, so the
    small phases use larger batches and the activations stay level instead of climbing to the end.
    """
    last = resolutions[-1]
    out = []
    for r in resolutions:
        b = max(1, (batch * last * last) // (r * r)) if scale_batch else batch
        out.append((r, b, predict(config, b, r).resident))
    return out


def resident_at_backward(m: Measurement) -> int:
    """Parameters + buffers + saved activations, as the ledger saw them when backward started."""
    bwd = next(i for i, phase, _ in m.timeline.phase_starts if phase == "backward")
    return sum(m.timeline.bytes[c][bwd - 1] for c in (Category.PARAM, Category.BUFFER, Category.ACT))
