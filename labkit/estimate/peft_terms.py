"""LoRA, QLoRA (NF4, int8 or int4 / AWQ frozen base) and LISA in the estimator: what trains, and what the frozen base costs.

Everything is read from the ModelSpec (module names and shapes), so no model is built. The rules follow
labkit.peft: `apply_lora` freezes every parameter and adds A (r, d_in) and B (d_out, r) beside each
targeted Linear ("all-linear": all but lm_head, as peft); `apply_qlora` stores each targeted weight as
NF4 buffers (labkit.peft.NF4Base); `LISA` trains the embeddings, final norm and head always and
`lisa_layers` of the transformer layers at a time (their gradients and Adam state released on switch).
The bytes of one adapter, one NF4, int8 or int4 weight and its dequantization scratch are the technique
modules' own (labkit.peft.lora.adapter_numel, labkit.quant.nf4.nf4_bytes_for, labkit.quant.int8.int8_bytes_for,
labkit.quant.int4.int4_bytes_for
and the *_DEQUANT_BYTES_PER_WEIGHT beside each dequantize function): this module sums them over the targets.
Sources: Hu et al. 2021 (LoRA), Dettmers et al. 2023 (QLoRA), Pan et al. 2024 (LISA), Lin et al. 2024 (AWQ).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Sequence

from labkit.peft.lisa import first_layers
from labkit.peft.lora import adapter_numel
from labkit.quant.int4 import INT4_DEQUANT_BYTES_PER_WEIGHT, INT4_GROUP, check_group, int4_bytes_for
from labkit.quant.int8 import INT8_DEQUANT_BYTES_PER_WEIGHT, int8_bytes_for
from labkit.quant.nf4 import NF4_BLOCKSIZE, NF4_DEQUANT_BYTES_PER_WEIGHT, nf4_bytes_for

from .recipe import INT4_QUANTS, QUANT_SETS, QUANTS  # noqa: E402  (the names, checked by Recipe)
NF4_BLOCK = NF4_BLOCKSIZE  # labkit.quant.nf4's: weights per absmax
_LAYER = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class Peft:
    """A parameter-efficient method, resolved against one model's modules."""

    rank: int | None  # LoRA rank r (None: no adapters)
    targets: tuple[tuple, ...]  # adapted Linears: (module name, d_in, d_out, bias elements)
    quant: str  # the frozen base under the adapters: "none", "int8", "nf4", "int4" or "int4-awq"
    lisa_layers: int | None  # LISA's gamma (None: no LISA)
    n_layers: int = 0  # the model's layers (LISA draws its active ones among them)
    group: int = INT4_GROUP  # int4's group size along the input features
    # quant_set "all-linear" (transformers + bitsandbytes): the Linears but the head that have no
    # adapter are quantized too, frozen; "targets" (torchtune): none of them (Recipe.quant_set)
    quant_set: str = "all-linear"
    frozen_quant: tuple[tuple, ...] = ()  # those Linears: (module name, d_in, d_out, bias elements)

    @property
    def quantized(self) -> tuple[tuple, ...]:
        """Every Linear stored quantized: the adapted ones and, under "all-linear", the others but
        the head."""
        return self.targets + self.frozen_quant if self.quant != "none" else ()

    @property
    def method(self) -> str:
        if self.lisa_layers:
            return "lisa"
        return {"none": "lora", "nf4": "qlora", "int8": "lora-int8", "int4": "lora-int4",
                "int4-awq": "lora-int4-awq"}[self.quant]

    @property
    def adapters(self) -> dict[str, int]:
        return {name: self.rank for name, *_ in self.targets}


def parse_targets(targets: str | Sequence[str]) -> str | list[str]:
    """'all-linear', 'q_proj,v_proj' or ['q_proj', 'v_proj'] -> 'all-linear' or a list of names."""
    if isinstance(targets, str):
        if targets.strip() == "all-linear":
            return "all-linear"
        targets = targets.split(",")
    names = [t.strip() for t in targets if isinstance(t, str) and t.strip()]
    if len(names) != len(list(targets)) or not names:
        raise ValueError(f"lora_targets must be 'all-linear' or module names such as 'q_proj,v_proj', got {targets!r}")
    return names


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)  # labkit.peft.lora's (and peft's) rule


def resolve_targets(spec, targets: str | Sequence[str]) -> list[tuple]:
    """The spec's Linear modules that `targets` selects, as labkit.peft.find_targets would pick them."""
    wanted = parse_targets(targets)
    if wanted == "all-linear":
        return [lin for lin in spec.linears if not _matches(lin[0], "lm_head")]
    chosen = []
    for t in wanted:
        hit = [lin for lin in spec.linears if _matches(lin[0], t)]
        if not hit:
            ends = sorted({lin[0].rsplit(".", 1)[-1] for lin in spec.linears})
            raise ValueError(f"LoRA target {t!r} matches no Linear module of {spec.name}; use 'all-linear' or "
                             f"some of: {', '.join(ends)}")
        seen = set(chosen)
        chosen += [lin for lin in hit if lin not in seen]
    return chosen


# the estimate's label says which convention the quantized set follows
QUANT_SET_NAMES = {"all-linear": "all linear but the head quantized (transformers + bitsandbytes)",
                   "targets": "only the LoRA targets quantized (torchtune)"}


def of_recipe(spec, r) -> Peft | None:
    """peft_of with a Recipe's fields."""
    return peft_of(spec, r.lora_rank, r.lora_targets, r.quant, r.lisa_layers, r.quant_group,
                   r.quant_set)


def peft_of(spec, lora_rank=None, lora_targets="all-linear", quant: str = "none", lisa_layers=None,
            quant_group: int | None = None, quant_set: str = "all-linear") -> Peft | None:
    """Check the options and resolve them against `spec`; None for plain (full) training."""
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {', '.join(QUANTS)}, got {quant!r}")
    if quant_set not in QUANT_SETS:
        raise ValueError(f"quant_set must be one of {', '.join(QUANT_SETS)}, got {quant_set!r}")
    if quant_set != "all-linear" and quant == "none":
        raise ValueError(f"quant_set={quant_set!r} chooses which Linears a quantized base stores: "
                         "give quant too")
    if quant_group is not None and quant not in INT4_QUANTS:
        raise ValueError(f"quant_group is int4's group size: give quant='int4' or 'int4-awq', not {quant!r}")
    if lora_rank is not None and (isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank <= 0):
        raise ValueError(f"lora_rank must be a positive integer (typical: 4 to 64), got {lora_rank!r}")
    if lisa_layers is not None:
        if isinstance(lisa_layers, bool) or not isinstance(lisa_layers, int) or not 1 <= lisa_layers <= spec.n_layer:
            raise ValueError(f"lisa_layers must be an integer from 1 to the model's {spec.n_layer} layers, "
                             f"got {lisa_layers!r}")
        if lora_rank is not None or quant != "none":
            raise ValueError("lisa_layers trains whole layers: give it without lora_rank and quant")
        return Peft(None, (), "none", lisa_layers, spec.n_layer)
    if lora_rank is None:
        if quant != "none":
            raise ValueError(f"quant={quant!r} freezes the base under LoRA adapters: give lora_rank too (e.g. 16)")
        if parse_targets(lora_targets) != "all-linear":
            raise ValueError("lora_targets selects where LoRA adapters go: give lora_rank too (e.g. 16)")
        return None
    targets = resolve_targets(spec, lora_targets)
    name, d_in, d_out, _ = min(targets, key=lambda t: min(t[1], t[2]))
    if lora_rank > min(d_in, d_out):  # B @ A has rank <= min(d_in, d_out) whatever r is: a bigger r only costs
        raise ValueError(f"lora_rank {lora_rank} exceeds the smaller side of LoRA target {name} ({min(d_in, d_out)})")
    others = ()
    if quant != "none" and quant_set == "all-linear":
        chosen = set(targets)
        others = tuple(lin for lin in resolve_targets(spec, "all-linear") if lin not in chosen)
    if quant == "nf4":
        odd = [name for name, d_in, d_out, _ in [*targets, *others] if (d_in * d_out) % NF4_BLOCK]
        if odd:
            where = ("LoRA targets" if odd[0] in {t[0] for t in targets}
                     else "Linears quant_set='all-linear' quantizes")
            raise ValueError(f"NF4 needs weights whose size divides by {NF4_BLOCK}; {odd[0]} (of "
                             f"the {where}) does not: leave it out of lora_targets, give "
                             "quant_set='targets', or use quant='int8'")
    group = INT4_GROUP if quant_group is None else quant_group
    if quant in INT4_QUANTS:
        for lin in [*targets, *others]:
            try:
                what = "LoRA target" if lin in targets else "Linear"
                check_group(lin[1], group, f"{what} {lin[0]}")
            except ValueError as e:
                raise ValueError(f"quant_group: {e}") from None
    return Peft(lora_rank, tuple(targets), quant, None, group=group, quant_set=quant_set,
                frozen_quant=others)


# ---- what trains -----------------------------------------------------------------------------------
def lisa_active(peft: Peft) -> frozenset:
    """The layers the estimate trains: those labkit.peft.LISA trains first with seed 0, as
    labkit.run.measure_step runs it. Every draw has the same model states (the layers are the same size);
    which layers train moves where in backward their gradients appear."""
    return frozenset(first_layers(peft.n_layers, peft.lisa_layers, seed=0))


def trainable_spec(spec, peft: Peft):
    """A ModelSpec of the trainable parameters only, so the optimizer formulas (optim_terms) apply as
    they are: LoRA's A (r, d_in) and B (d_out, r) per target; LISA's non-layer parameters + gamma layers."""
    if peft.lisa_layers:
        active = lisa_active(peft)
        keep = [i for i, n in enumerate(spec.param_names)
                if (m := _LAYER.search(n)) is None or int(m.group(1)) in active]
        names = [spec.param_names[i] for i in keep]
        shapes = [spec.param_shapes[i] for i in keep]
    else:
        names, shapes = [], []
        for name, d_in, d_out, _ in peft.targets:
            names += [f"{name}.lora_A", f"{name}.lora_B"]
            shapes += [(peft.rank, d_in), (d_out, peft.rank)]
    numels = [math.prod(s) for s in shapes]
    per_layer = {}
    for n, k in zip(names, numels):
        if (m := _LAYER.search(n)) is not None:
            per_layer[m.group(1)] = per_layer.get(m.group(1), 0) + k
    return replace(spec, n_params=sum(numels), param_numels=numels, param_shapes=shapes, param_names=names,
                   galore_shapes=[], layer_params=sum(per_layer.values()) // max(spec.n_layer, 1))


def adapter_elements(peft: Peft) -> int:
    """LoRA's trainable values: labkit.peft.lora.adapter_numel, r (d_in + d_out), per adapted Linear."""
    return sum(adapter_numel(d_in, d_out, peft.rank) for _, d_in, d_out, _ in peft.targets) if peft.rank else 0


def _stored(spec, peft: Peft) -> list[tuple]:
    """The Linears whose weights a quantized base stores (a head tied to the embedding stays)."""
    return [lin for lin in peft.quantized if not (spec.tied and _matches(lin[0], "lm_head"))]


def quantized_weights(spec, peft: Peft) -> int:
    """Weight elements moved from parameters into int8/NF4 buffers (a weight tied to the embedding
    stays): the adapted Linears', and under quant_set "all-linear" all others but the head's."""
    return sum(d_in * d_out for _, d_in, d_out, _ in _stored(spec, peft))


# ---- bytes --------------------------------------------------------------------------------------------
def nf4_bytes(n: int) -> int:
    """One NF4 weight of n elements, blocks of 64, double quantization: labkit.quant.nf4.nf4_bytes_for."""
    return nf4_bytes_for(n)


def int8_bytes(d_in: int, d_out: int) -> int:
    """One (d_out, d_in) int8 weight, per-row absmax (what Int8Linear.from_linear keeps):
    labkit.quant.int8.int8_bytes_for."""
    return int8_bytes_for((d_out, d_in), "absmax", "channel")


def int4_bytes(d_in: int, d_out: int, group: int, awq: bool) -> int:
    """One (d_out, d_in) int4 weight: packed codes + fp16 scale and uint8 zero per group, + AWQ's fp16
    per-input-channel scale, which a LoRA base keeps in the layer: labkit.quant.int4.int4_bytes_for."""
    return int4_bytes_for((d_out, d_in), group, input_scale=awq)


def base_buffer_bytes(spec, peft: Peft) -> int:
    """The quantized frozen bases (BUFFER): int8 codes and scales, NF4 codes and statistics, or int4 codes,
    scales, zero points (and AWQ scales)."""
    stored = _stored(spec, peft)
    if peft.quant in INT4_QUANTS:
        awq = peft.quant == "int4-awq"
        return sum(int4_bytes(d_in, d_out, peft.group, awq) for _, d_in, d_out, _ in stored)
    if peft.quant == "nf4":
        return sum(nf4_bytes(d_in * d_out) for _, d_in, d_out, _ in stored)
    if peft.quant == "int8":
        return sum(int8_bytes(d_in, d_out) for _, d_in, d_out, _ in stored)
    return 0


def frozen_param_bytes(spec, peft: Peft, d: int) -> int:
    """Parameters that stay in the model's dtype but get no gradient: all of them for LoRA, all but the
    quantized weights for QLoRA (biases, norms, embeddings, the head stay), the inactive layers for LISA."""
    if peft.lisa_layers:
        return (spec.n_params - trainable_spec(spec, peft).n_params) * d
    return (spec.n_params - quantized_weights(spec, peft)) * d


def dequant_scratch_bytes(peft: Peft, compute_bytes: int) -> int:
    """On-the-fly dequantization of the largest quantized weight: NF4 and int4 6 B per weight, int8 8 B (fp32
    compute) or 6 B (16-bit); one layer at a time, in forward and again in backward."""
    if not peft.quantized:
        return 0
    n = max(d_in * d_out for _, d_in, d_out, _ in peft.quantized)
    return dequant_bytes_per_weight(peft.quant, compute_bytes) * n


def dequant_bytes_per_weight(quant: str, compute_bytes: int) -> int:
    """Peak bytes per weight of the dequantize function each quantized base calls (its module's constant)."""
    if quant == "nf4":
        return NF4_DEQUANT_BYTES_PER_WEIGHT
    if quant in INT4_QUANTS:
        return INT4_DEQUANT_BYTES_PER_WEIGHT
    return INT8_DEQUANT_BYTES_PER_WEIGHT[compute_bytes]


def setup_walk(w, peft: Peft | None) -> None:
    """Tell the forward walk which weights train and where the adapters are."""
    if peft is None:
        return
    if peft.lisa_layers:
        w.active = lisa_active(peft)
    else:
        w.frozen, w.lora, w.quant = True, peft.adapters, peft.quant
        w.quant_modules = frozenset(name for name, *_ in peft.quantized)
