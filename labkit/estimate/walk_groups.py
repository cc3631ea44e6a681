"""What each kind of op saves in a model's blocks, from the forward walk (labkit.estimate.walk),
beside Korthikanti et al.'s share of the same ops in their layer formula: the activation corrections
of explain().

A walk whose primitives note which one is running: each byte `Walk.save` keeps is put down to the
outermost primitive (a LayerNorm, a Linear, the MLP's activation, a dropout) or, inside a block and
outside them all, to the family's attention code (labkit.estimate.families). Korthikanti et al. 2022
(arXiv 2205.05198, section 4.1) count, per layer and e-byte values with 1-byte masks: the two
LayerNorms' inputs 2e sbh; the inputs of the QKV, output, and the MLP's two projections 7e sbh;
attention's Q, K, V 3e sbh and its softmax and dropout outputs 2e as^2 b; the GeLU's input 4e sbh;
the dropout masks 2 sbh + as^2 b. Their sum is the textbook's sbh(16e + 2) + (2e + 1) as^2 b
(labkit.estimate.textbook.layer_activation_bytes).
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

from . import peft_terms
from .families import WALKS
from .tape import Tape, keep_kinds
from .textbook import Precision
from .walk import Walk


class OpGroup(enum.Enum):
    """A kind of op in a block: (what it saves, its share of Korthikanti's layer as (e sbh, sbh, e
    as^2 b, as^2 b) multiples, the source of what it saves)."""

    NORM = ("the norms: LayerNorm/RMSNorm input, statistics (and RMSNorm's Python ops' tensors)",
            (2, 0, 0, 0), "derivatives.yaml: native_layer_norm_backward reads input, mean, rstd")
    LINEAR = ("the projections: each Linear's saved input (its 16-bit copy under autocast)",
              (7, 0, 0, 0), "derivatives.yaml: mm/addmm's backward reads the other operand")
    ATTENTION = ("the attention core: Q, K, V, probabilities or a fused kernel's output, logsumexp",
                 (3, 0, 2, 0), "derivatives.yaml: bmm, _softmax, _scaled_dot_product_*_attention")
    ACTIVATION = ("the MLP's activation: GELU/SiLU's input (and NewGELU's or SwiGLU's Python ops)",
                  (4, 0, 0, 0), "derivatives.yaml: gelu_backward, silu_backward, mul")
    DROPOUT = ("the dropout masks (1 B on CUDA, the value's dtype on a CPU)", (0, 2, 0, 1),
               "derivatives.yaml: native_dropout_backward reads its mask")
    OTHER = ("other ops inside the blocks (casts, adds)", (0, 0, 0, 0), "derivatives.yaml")

    @property
    def what(self) -> str:
        return self.value[0]

    @property
    def source(self) -> str:
        return self.value[2]

    def korthikanti(self, s: int, b: int, h: int, a: int, e: int) -> int:
        """Bytes of this group in Korthikanti's layer formula with e-byte values (1-byte masks)."""
        k_esbh, k_sbh, k_eas2b, k_as2b = self.value[1]
        return k_esbh * e * s * b * h + k_sbh * s * b * h + (k_eas2b * e + k_as2b) * a * s * s * b

    def formula(self) -> str:
        units = (" e sbh", " sbh", " e as^2b", " as^2b")
        parts = [f"{k}{unit}" for k, unit in zip(self.value[1], units) if k]
        return " + ".join(parts) or "0"


_PRIMITIVES = {  # Walk's methods (labkit.estimate.walk) -> the group of what they save
    "layer_norm": OpGroup.NORM, "rms_norm_python": OpGroup.NORM, "linear": OpGroup.LINEAR,
    "gelu": OpGroup.ACTIVATION, "gelu_tanh_python": OpGroup.ACTIVATION, "silu": OpGroup.ACTIVATION,
    "glu_mul": OpGroup.ACTIVATION, "dropout": OpGroup.DROPOUT, "add": OpGroup.OTHER,
    "cast": OpGroup.OTHER}


class _GroupedWalk(Walk):
    """A Walk that notes, for each save, the outermost primitive running (None: the family's own
    code)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.running: list[OpGroup] = []
        # (group, bytes, whether it is an autocast weight copy)
        self.saves: list[tuple[OpGroup | None, int, bool]] = []

    def save(self, *ts) -> None:
        for t in ts:
            before = self.saved_total
            super().save(t)
            if self.saved_total != before:
                group = self.running[0] if self.running else None
                self.saves.append((group, self.saved_total - before, t.root().weight))


def _noting(method: str, group: OpGroup):
    base = getattr(Walk, method)

    @functools.wraps(base)
    def run(self, *args, **kwargs):
        self.running.append(group)
        try:
            return base(self, *args, **kwargs)
        finally:
            self.running.pop()
    return run


for _name, _group in _PRIMITIVES.items():
    setattr(_GroupedWalk, _name, _noting(_name, _group))


@dataclass(frozen=True)
class BlockGroups:
    """Bytes each block saves, by op group (autocast weight copies apart: model-state memory)."""

    blocks: tuple[dict, ...]  # per block: OpGroup -> bytes

    def total(self, k: int) -> int:
        return sum(self.blocks[k].values())

    def group(self, g: OpGroup, blocks=None) -> int:
        idx = range(len(self.blocks)) if blocks is None else blocks
        return sum(self.blocks[k].get(g, 0) for k in idx)


def block_groups(spec, recipe, peft=None, base_bytes: int | None = None) -> BlockGroups:
    """Walk one micro-batch of `recipe` (as labkit.estimate.predict.walk_activations does) and sum
    what each block saves by op group."""
    prec = Precision.of(recipe.dtype)
    linears = {n: (i, o, bias) for n, i, o, bias in spec.linears}
    w = _GroupedWalk(x_bytes=base_bytes or prec.weight, train_bytes=prec.weight,
                     autocast=prec.autocast, device=recipe.device, linears=linears,
                     tape=Tape(kinds=keep_kinds(recipe.selective_policy)))
    peft_terms.setup_walk(w, peft)
    marks: list = []
    WALKS[spec.family](w, spec, recipe.micro, recipe.seq, marks)
    bounds = marks
    blocks: list[dict] = [{} for _ in range(max(len(bounds) - 1, 0))]
    at = 0
    for group, nbytes, weight in w.saves:
        k = next((i for i in range(len(blocks)) if bounds[i] <= at < bounds[i + 1]), None)
        at += nbytes
        if k is None or weight:
            continue
        g = group or OpGroup.ATTENTION
        blocks[k][g] = blocks[k].get(g, 0) + nbytes
    return BlockGroups(tuple(blocks))
