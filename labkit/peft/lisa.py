"""LISA from scratch: train the embeddings, head and final norm always, and only gamma sampled layers at a time.

Layerwise Importance Sampled AdamW (Pan et al. 2024; LMFlow's DynamicLayerActivationCallback): every
K steps freeze all transformer layers, then unfreeze gamma of them sampled uniformly without
replacement. Everything outside the layer list (embeddings, final norm, head) is never frozen.

Two versions, teaching first:

- `LISANaive` does what the reference does: it only flips `requires_grad`. The optimizer keeps the
  AdamW state of every layer ever active (LMFlow #729), and `.grad` tensors of frozen layers stay
  alive when gradients are zeroed rather than set to None: memory grows with every switch until
  it reaches full fine-tuning's.
- `LISA` (the real one) also releases what a newly frozen layer holds: `p.grad = None` and
  `optimizer.state.pop(p)`. Bytes with fp32 AdamW then stay bounded by the active parameters:
  GRAD <= 4 x active, OPT <= 8 x active (+ 4 per tensor for Adam's step counter). A re-sampled
  layer restarts its Adam moments from zero, as the paper's re-launch per interval did.

The optimizer must hold all parameters (build it over model.parameters()): an optimizer built over
only those that require grad at the start never updates the layers unfrozen later (LMFlow #726).
"""

from __future__ import annotations

import random

import torch
import torch.nn as nn

from .lora import trainable_parameters

LAYER_PATHS = ("blocks", "transformer.h", "model.layers", "encoder.layer", "bert.encoder.layer", "layers")


def find_layers(model: nn.Module, path: str | None = None) -> tuple[str, nn.ModuleList]:
    """(path, ModuleList) of the transformer layers: `path`, else the first of LAYER_PATHS the model has
    (also inside a wrapper: "encoder.encoder.layer" ends with "encoder.layer")."""
    lists = {n: m for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0}
    for p in [path] if path else LAYER_PATHS:
        for name, layers in lists.items():
            if name == p or (not path and name.endswith("." + p)):
                return name, layers
    raise ValueError(f"cannot find the transformer layers{f' at {path!r}' if path else ''}: pass layers_path= one of "
                     f"the model's ModuleLists: {', '.join(lists) or 'none found'}")


def sample_layers(rng: random.Random, n_layers: int, gamma: int) -> list[int]:
    """gamma of n_layers drawn uniformly without replacement (sorted): one switch's choice."""
    return sorted(rng.sample(range(n_layers), gamma))


def first_layers(n_layers: int, gamma: int, seed: int = 0) -> list[int]:
    """The layers a LISA made with this seed trains first (its first switch)."""
    return sample_layers(random.Random(seed), n_layers, gamma)


def _check_schedule(gamma, interval, n_layers: int) -> None:
    if isinstance(gamma, bool) or not isinstance(gamma, int) or not 1 <= gamma <= n_layers:
        raise ValueError(f"LISA gamma (layers active at a time) must be an integer from 1 to the model's {n_layers} "
                         f"layers, got {gamma!r}; the paper uses 1 or 2")
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ValueError(f"LISA interval K (steps between layer switches) must be a positive integer, got {interval!r}; "
                         f"LMFlow's default is 20")


# ---- (a) the teaching version: the reference's callback ------------------------------------------
class LISANaive:
    """Call `.step()` at the start of every training step; every `interval` steps it re-samples `gamma` layers.

    optimizer: over all of the model's parameters (checked). layers_path: where the layer list is
    (default: found among LAYER_PATHS). seed: the sampling is reproducible.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, gamma: int = 2, interval: int = 20,
                 layers_path: str | None = None, seed: int = 0):
        self.path, self.layers = find_layers(model, layers_path)
        _check_schedule(gamma, interval, len(self.layers))
        in_opt = {id(p) for g in optimizer.param_groups for p in g["params"]}
        missing = [n for n, p in model.named_parameters() if id(p) not in in_opt]
        if missing:
            raise ValueError(f"the optimizer lacks {len(missing)} parameters (e.g. {missing[0]}): build it over "
                             f"model.parameters(), or layers unfrozen later never train (LMFlow #726)")
        self.model, self.optimizer, self.gamma, self.interval = model, optimizer, gamma, interval
        self.rng = random.Random(seed)
        self.steps, self.switches = 0, 0
        self.active: list[int] = []
        self.layers.requires_grad_(False)  # everything outside the layers stays as the caller set it

    def step(self) -> list[int]:
        """Before a step's forward: switch layers when the step count is a multiple of K; the active layers."""
        if self.steps % self.interval == 0:
            self.switch()
        self.steps += 1
        return self.active

    def switch(self) -> list[int]:
        """Freeze all layers, unfreeze gamma sampled ones (sorted indices)."""
        before = set(self.active)
        self.active = sample_layers(self.rng, len(self.layers), self.gamma)
        for i in before - set(self.active):
            self.layers[i].requires_grad_(False)
            self._release(self.layers[i])
        for i in self.active:
            self.layers[i].requires_grad_(True)
        self.switches += 1
        return self.active

    def _release(self, layer: nn.Module) -> None:
        pass  # the reference keeps the layer's .grad and its AdamW state: the bug the real version fixes

    def active_parameters(self) -> list[nn.Parameter]:
        """Parameters trained now: the active layers' plus everything outside the layers that requires grad."""
        return trainable_parameters(self.model)


# ---- (b) the real one: free what a frozen layer holds -------------------------------------------
class LISA(LISANaive):
    """LISANaive plus release: a layer frozen again loses its .grad and its optimizer state at once."""

    def _release(self, layer: nn.Module) -> None:
        for p in layer.parameters():
            p.grad = None  # bytes: 4 per fp32 parameter
            self.optimizer.state.pop(p, None)  # bytes: 8 per fp32 parameter (AdamW m and v) + the step counter


def lisa_bound(lisa: LISANaive, adam: bool = True) -> dict[str, int]:
    """Upper bounds for the real LISA, in bytes: what is never frozen plus the largest gamma layers."""
    in_layers = {id(p) for p in lisa.layers.parameters()}
    outside = {id(p): p for p in lisa.model.parameters() if p.requires_grad and id(p) not in in_layers}
    per_layer = sorted((sum(p.numel() * p.element_size() for p in layer.parameters()), len(list(layer.parameters())))
                       for layer in lisa.layers)[-lisa.gamma:]
    grad = sum(p.numel() * p.element_size() for p in outside.values()) + sum(b for b, _ in per_layer)
    tensors = len(outside) + sum(n for _, n in per_layer)  # AdamW keeps a 4-byte step counter per tensor
    return {"GRAD": grad, "OPT": 2 * grad + 4 * tensors if adam else grad}


def lisa_memory_trace(model: nn.Module, batches, gamma: int = 1, interval: int = 2, naive: bool = False,
                      lr: float = 1e-3, set_to_none: bool = False, seed: int = 0) -> dict:
    """Train with LISA (or LISANaive) under the Ledger; OPT and GRAD bytes live after every step.

    batches: a list of (x, y) for a model whose forward(x, y) returns the loss (labkit's GPT).
    set_to_none: how gradients are zeroed after each step; False (zeroed in place) keeps a frozen
        layer's .grad alive unless LISA frees it, True frees all gradients every step anyway.
    Returns {"steps": [{"active", "OPT", "GRAD"}...], "peak": peak bytes per category, "bound": lisa_bound}.
    """
    from labkit.memory import Category

    from labkit.memory import Ledger

    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    lisa = (LISANaive if naive else LISA)(model, opt, gamma=gamma, interval=interval, seed=seed)
    rows = []
    with Ledger(model, opt, label=f"{'naive ' if naive else ''}LISA gamma={gamma} K={interval}") as led:
        for x, y in batches:
            active = list(lisa.step())
            model(x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
            live = led.live()
            rows.append({"active": active, "OPT": live.bytes[Category.OPT], "GRAD": live.bytes[Category.GRAD]})
    meas = led.measurement()
    peak = {c.name: max(b.bytes[c] for b in meas.phases.values()) for c in (Category.OPT, Category.GRAD)}
    return {"steps": rows, "peak": peak, "bound": lisa_bound(lisa), "switches": lisa.switches}
