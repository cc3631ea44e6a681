"""A Recipe: one training step's setup (model, sizes, precision, recompute, optimizer, PEFT), checked once.

`labkit.estimate.estimate(recipe)` predicts it (it also takes the fields as keywords) and
`labkit.run.measure_step(recipe)` measures it, so every check lives here (plus the checks that need the
model's shapes, made when the estimator reads them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Literal, Sequence

from labkit.estimate.refusal import Refused, Refusal
from labkit.optim.galore8bit import PROJ_DTYPES  # 8-bit GaLore's projector precisions (its module owns them)
from labkit.recompute.segments import POLICIES  # the checkpoint policies (re-exported)
from labkit.recompute.selective import POLICIES as _SELECTIVE  # selective checkpointing's

DTYPES = ("fp32", "fp16", "bf16", "mixed-fp16", "mixed-bf16")
TORCH_OPTIMIZERS = ("sgd", "sgd-momentum", "adam", "adamw")
OPTIMIZERS = (*TORCH_OPTIMIZERS, "adamw8bit", "adam8bit", "lion", "adafactor", "galore", "galore8bit")
SELECTIVE_POLICIES = tuple(_SELECTIVE)
QUANTS = ("none", "int8", "nf4", "int4", "int4-awq")
INT4_QUANTS = ("int4", "int4-awq")  # group-wise int4: round-to-nearest, or AWQ (labkit.quant.awq)
# Which Linears a quantized base (quant != "none") stores quantized:
QUANT_SETS = (
    # every Linear but the head, whatever the LoRA targets: transformers + bitsandbytes
    # (load_in_4bit / BitsAndBytesConfig, the QLoRA paper's scripts); the others frozen, no adapters
    "all-linear",
    # only the LoRA-wrapped Linears, the rest of the base in its dtype: torchtune's qlora_* builders
    "targets",
)
# bitsandbytes.optim's PagedAdamW, PagedAdamW8bit, PagedAdam, PagedAdam8bit and PagedLion: states
# in CUDA unified memory (Recipe.paged_states)
PAGED_OPTIMIZERS = ("adamw", "adamw8bit", "adam", "adam8bit", "lion")
SCHEDULES = ("gpipe", "1f1b")  # pipeline schedules (pp > 1)
ZERO_STAGES = (0, 1, 2, 3)
ZERO_MIXED = ("engine", "autocast")  # how ZeRO-3 / FSDP2 runs mixed precision (Recipe.zero_mixed)
BASE_DTYPES = (None, "fp32", "bf16", "fp16")  # a frozen base's precision (None: the trained weights')
STEP_AND_OFFLOAD = "step_in_backward and optimizer_offload: OffloadAdamW steps all parameters at once; choose one"


def _positive_int(name: str, v, optional: bool = False) -> None:
    if optional and v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{name} must be a positive integer, got {v!r}")


def _check_base_dtype(r) -> None:
    """base_dtype: a frozen base's precision, so LoRA/QLoRA only, and 16 bits only under that autocast dtype."""
    b = r.base_dtype
    if b not in BASE_DTYPES:
        raise ValueError(f"base_dtype must be None, 'fp32', 'bf16' or 'fp16', got {b!r}")
    if b is None:
        return
    if r.lisa_layers is not None:
        raise ValueError("base_dtype sets the precision of a frozen LoRA/QLoRA base; LISA moves which layers "
                         "train, so its frozen layers keep the trained ones' dtype: drop base_dtype")
    if r.lora_rank is None:
        raise ValueError("base_dtype sets the precision of the frozen base under LoRA/QLoRA: give lora_rank too "
                         "(e.g. 16), or set the whole model's precision with dtype")
    own = {"fp32": "fp32", "mixed-bf16": "fp32", "mixed-fp16": "fp32", "bf16": "bf16", "fp16": "fp16"}[r.dtype]
    if b == own:
        return
    if b == "fp32":
        raise ValueError(f"base_dtype='fp32' under {r.dtype} adapters: a base wider than what trains is not "
                         f"modelled; give dtype='mixed-bf16' (fp32 adapters under autocast) or drop base_dtype")
    if r.dtype != f"mixed-{b}":
        raise ValueError(f"a {b} base under {r.dtype} adapters runs under autocast in {b}: give "
                         f"dtype='mixed-{b}' (fp32 adapters, {b} matmuls), or drop base_dtype")


def _check_loss_chunks(r) -> None:
    """loss_chunks: a positive integer up to seq, not with labkit GPT's own chunked loss."""
    n = r.loss_chunks
    if n is None:
        return
    _positive_int("loss_chunks", n)
    if n > r.seq:
        raise ValueError(f"loss_chunks={n} splits the sequence into chunks of tokens: it cannot "
                         "exceed "
                         f"seq ({r.seq})")
    own = dict(r.overrides).get("loss_chunk", getattr(r.model, "loss_chunk", None))
    own = getattr(getattr(r.model, "config", None), "loss_chunk", own)
    if own:
        raise ValueError(f"loss_chunks (torchtune's chunks along the sequence) and the model's "
                         f"loss_chunk={own} (labkit GPT's fused head + loss, rows per chunk) are "
                         "two chunked losses: choose one (set loss_chunk=0, or drop loss_chunks)")


@dataclass(frozen=True)
class Recipe:
    """What one training step does. Sizes are per step; `micro_batch` splits `batch` (gradient accumulation)."""

    model: object  # preset name, config path, hub id, GPTConfig, GPT or transformers model/config
    batch: int  # rows per optimizer step (B)
    seq: int  # tokens per row (S)
    dtype: str = "fp32"  # one of DTYPES; "mixed-*": fp32 weights + torch.autocast
    optimizer: str = "adamw"  # one of OPTIMIZERS
    device: str = "cpu"  # "cpu" or "cuda": fused attention, dropout masks and Adam's foreach path differ
    foreach: bool | None = None  # Adam's foreach path (None: on CUDA only, as torch.optim does)
    checkpoint: str = "none"  # one of POLICIES (labkit.recompute.checkpoint_blocks)
    segments: int | None = None  # checkpointed segments for "full" (None: one per block)
    selective_policy: str = "matmuls"  # with checkpoint="selective": one of SELECTIVE_POLICIES
    offload_activations: bool = False  # saved activations live in host memory
    micro_batch: int | None = None  # rows per micro-batch, dividing batch (None: the whole batch)
    rank: int | None = None  # GaLore's rank (optimizer "galore" or "galore8bit")
    proj_dtype: str | None = None  # 8-bit GaLore's projector: "param" (None: the parameters' dtype), "fp32", "int8"
    optimizer_offload: str | None = None  # None, "cpu" or "disk" (labkit.optim.OffloadAdamW)
    step_in_backward: bool = False  # each parameter steps when its gradient is ready
    # the optimizer's states in CUDA unified memory (bitsandbytes' PagedAdamW / PagedAdamW8bit),
    # outside the allocator's peak (max_memory_allocated): Estimate.unified; one of PAGED_OPTIMIZERS
    paged_states: bool = False
    lora_rank: int | None = None  # LoRA adapters of this rank on lora_targets, the base frozen
    lora_targets: str | tuple = "all-linear"  # "all-linear" or module names ("q_proj,v_proj" or a tuple)
    quant: str = "none"  # the frozen base under LoRA: "none", "int8", "nf4" (QLoRA), "int4" or "int4-awq"
    quant_group: int | None = None  # int4's group size along the input features (None: 128); int4 quants only
    quant_set: str = "all-linear"  # which Linears `quant` stores: one of QUANT_SETS (see whose)
    lisa_layers: int | None = None  # LISA: this many layers train at a time
    # The frozen base's precision under LoRA / QLoRA (one of BASE_DTYPES). None: the trained weights' (dtype's);
    # "bf16"/"fp16" with dtype "mixed-bf16"/"mixed-fp16": peft's usual setup, a 16-bit base (its matmuls need
    # no autocast copy) under fp32 adapters, their gradients and optimizer state.
    base_dtype: str | None = None
    # Layout over several devices (lessons 09-10); every size above is per optimizer step for the whole job.
    dp: int = 1  # data-parallel ranks: `batch` is the global batch, each rank takes batch / dp rows
    zero: int = 0  # ZeRO stage over the dp ranks: 1 shards optimizer states, 2 also gradients, 3 also parameters
    zero_offload: bool = False  # ZeRO-Offload: the (sharded) optimizer state and its step live in host memory
    # Mixed precision (dtype "mixed-*") under ZeRO-3, one of ZERO_MIXED:
    # "engine": what FSDP2 (MixedPrecisionPolicy(param_dtype=bf16)) and DeepSpeed's bf16 do by
    #   default: fp32 shards, each unit gathered in 16 bits while it runs, the model computing in 16
    #   bits, 16-bit gradients reduce-scattered into fp32 gradient shards; no autocast copy of the model.
    # "autocast": labkit's Zero under torch.autocast: fp32 shards gathered in fp32, autocast's 16-bit
    #   copy of every matmul weight kept from the forward to the backward.
    # Stages 0-2 keep every weight on every rank; there labkit models autocast either way.
    zero_mixed: Literal["engine", "autocast"] = "engine"
    tp: int = 1  # tensor-parallel ranks (Megatron: attention heads and the MLP split t ways)
    pp: int = 1  # pipeline stages (consecutive blocks); micro_batch sets the pipeline's micro-batches
    schedule: str = "1f1b"  # pipeline schedule when pp > 1: "gpipe" or "1f1b"
    sequence_parallel: bool = False  # with tp > 1: norms and dropouts sharded along the sequence
    # The loss of the output head: None, the head's logits whole and one cross-entropy
    # (transformers' way); N, the head and the cross-entropy in N chunks along the sequence, each
    # chunk's logits upcast to fp32 alone (torchtune's CEWithChunkedOutputLoss, 8 in its recipes;
    # labkit.recompute.chunked_output)
    loss_chunks: int | None = None
    overrides: tuple = field(default=())  # (key, value) pairs set on a preset's config, e.g. (("n_layer", 2),)

    def __post_init__(self) -> None:
        _positive_int("batch", self.batch)
        _positive_int("seq", self.seq)
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.checkpoint not in POLICIES:
            raise ValueError(f"checkpoint must be one of {', '.join(POLICIES)}, got {self.checkpoint!r}")
        _positive_int("segments", self.segments, optional=True)
        if self.selective_policy not in SELECTIVE_POLICIES:
            raise ValueError(f"selective_policy must be one of {', '.join(SELECTIVE_POLICIES)}, "
                             f"got {self.selective_policy!r}")
        if self.selective_policy != "matmuls" and self.checkpoint != "selective":
            raise ValueError(f"selective_policy chooses what checkpoint='selective' keeps: give checkpoint='selective' "
                             f"too, not {self.checkpoint!r}")
        if self.segments is not None and self.checkpoint != "full":
            raise ValueError("segments sets how many segments checkpoint='full' makes: give checkpoint='full' too")
        for name in ("dp", "tp", "pp"):
            _positive_int(name, getattr(self, name))
        if self.batch % self.dp:
            raise ValueError(f"batch ({self.batch}) is the global batch: it must divide evenly over dp={self.dp} ranks")
        if isinstance(self.zero, bool) or self.zero not in ZERO_STAGES:
            raise ValueError(f"zero must be a ZeRO stage 0, 1, 2 or 3, got {self.zero!r}")
        if self.zero_mixed not in ZERO_MIXED:
            raise ValueError(f"zero_mixed must be one of {', '.join(ZERO_MIXED)}, got {self.zero_mixed!r}")
        if self.zero_offload and self.zero == 0:
            raise ValueError("zero_offload offloads ZeRO's sharded optimizer state: give zero=1, 2 or 3 too")
        if self.zero and self.dp == 1 and not self.zero_offload:
            raise ValueError(f"ZeRO-{self.zero} shards over the data-parallel ranks, and dp=1 has one: give "
                             "dp > 1 (or zero_offload=True, ZeRO-Offload on one device)")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.schedule != "1f1b" and self.pp == 1:
            raise ValueError(f"schedule orders a pipeline's micro-batches over its stages: {self.schedule!r} "
                             "needs pp > 1")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel shards along the sequence what tensor parallelism keeps "
                             "replicated: give tp > 1 too")
        rows = self.batch // self.dp
        micro = rows if self.micro_batch is None else self.micro_batch
        if isinstance(micro, bool) or not isinstance(micro, int) or micro <= 0 or rows % micro:
            per = f"each rank's batch ({rows} = {self.batch} / dp {self.dp})" if self.dp > 1 else f"batch ({rows})"
            raise ValueError(f"micro_batch must be a positive integer dividing {per}, got {self.micro_batch!r}")
        if self.optimizer.startswith("galore"):
            _positive_int(f"rank (for {self.optimizer})", self.rank)
        elif self.rank is not None:
            raise ValueError(f"rank is GaLore's projection rank: give optimizer='galore' or 'galore8bit', "
                             f"not {self.optimizer!r}")
        if self.proj_dtype is not None:
            if self.optimizer != "galore8bit":
                raise ValueError(f"proj_dtype is 8-bit GaLore's projector precision: give optimizer='galore8bit', "
                                 f"not {self.optimizer!r}")
            if self.proj_dtype not in PROJ_DTYPES:
                raise ValueError(f"proj_dtype must be one of {', '.join(PROJ_DTYPES)}, got {self.proj_dtype!r}")
        if self.optimizer_offload not in (None, "cpu", "disk"):
            raise ValueError(f"optimizer_offload must be None, 'cpu' or 'disk', got {self.optimizer_offload!r}")
        if self.optimizer_offload and self.optimizer != "adamw":
            raise ValueError(f"optimizer_offload works with adamw (labkit.optim.OffloadAdamW), not {self.optimizer!r}")
        if self.step_in_backward and micro != self.rank_batch:
            raise Refused(Refusal.STEP_WITH_ACCUMULATION,
                          "step_in_backward cannot accumulate gradients over micro-batches")
        if self.step_in_backward and self.optimizer_offload:
            raise Refused(Refusal.STEP_WITH_OFFLOAD, STEP_AND_OFFLOAD)
        if self.paged_states is not False and self.paged_states is not True:
            raise ValueError(f"paged_states must be True or False, got {self.paged_states!r}")
        if self.paged_states and self.optimizer not in PAGED_OPTIMIZERS:
            raise ValueError(f"paged_states pages the states of bitsandbytes' paged optimizers: "
                             f"give optimizer {', '.join(map(repr, PAGED_OPTIMIZERS))}, "
                             f"not {self.optimizer!r}")
        if self.paged_states and self.optimizer_offload:
            raise Refused(Refusal.PAGED_WITH_OFFLOAD,
                          "paged_states and optimizer_offload both keep the optimizer state "
                          "off the device's allocator: choose one")
        if self.quant not in QUANTS:
            raise ValueError(f"quant must be one of {', '.join(QUANTS)}, got {self.quant!r}")
        if self.quant_group is not None:
            if self.quant not in INT4_QUANTS:
                raise ValueError(f"quant_group is int4's group size: give quant='int4' or 'int4-awq', not {self.quant!r}")
            _positive_int("quant_group", self.quant_group)
        if self.quant_set not in QUANT_SETS:
            raise ValueError(f"quant_set must be one of {', '.join(QUANT_SETS)}, "
                             f"got {self.quant_set!r}")
        if self.quant_set != "all-linear" and self.quant == "none":
            raise ValueError(f"quant_set={self.quant_set!r} chooses which Linears a quantized base "
                             "stores: give quant too (e.g. 'nf4'), or drop quant_set")
        _check_base_dtype(self)
        _check_loss_chunks(self)
        for name in ("offload_activations", "step_in_backward", "zero_offload", "sequence_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.overrides, tuple) or any(not (isinstance(kv, tuple) and len(kv) == 2)
                                                        for kv in self.overrides):
            raise ValueError("overrides must be a tuple of (key, value) pairs; use Recipe.of(..., key=value)")
        for k, v in self.overrides:
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"override {k} must be finite, got {v!r}")

    @classmethod
    def of(cls, model, batch: int, seq: int, **options) -> "Recipe":
        """A Recipe from keywords: the fields above, and any other keyword as a model config override."""
        names = {f.name for f in fields(cls)} - {"model", "batch", "seq", "overrides"}
        known = {k: v for k, v in options.items() if k in names}
        if isinstance(known.get("lora_targets"), list):
            known["lora_targets"] = tuple(known["lora_targets"])
        extra = tuple((k, v) for k, v in options.items() if k not in names)
        return cls(model, batch, seq, overrides=extra, **known)

    @property
    def micro(self) -> int:
        """Rows per micro-batch (on one data-parallel rank)."""
        return self.batch // self.dp if self.micro_batch is None else self.micro_batch

    @property
    def rank_batch(self) -> int:
        """Rows per optimizer step on one data-parallel rank (batch / dp)."""
        return self.batch // self.dp

    @property
    def world_size(self) -> int:
        """Devices the layout uses: dp x tp x pp."""
        return self.dp * self.tp * self.pp

    @property
    def distributed(self) -> bool:
        """True when the step runs on more than one device."""
        return self.world_size > 1

    @property
    def frozen_dtype(self) -> str:
        """The frozen base's storage dtype: base_dtype, else the trained weights' ("fp32" under mixed-*)."""
        if self.base_dtype is not None:
            return self.base_dtype
        return "fp32" if self.dtype in ("fp32", "mixed-bf16", "mixed-fp16") else self.dtype

    @property
    def config(self) -> dict:
        """The overrides as keywords."""
        return dict(self.overrides)

    def options(self) -> dict:
        """Every field but model, batch, seq and overrides, as keywords."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for k in ("model", "batch", "seq", "overrides"):
            out.pop(k)
        return out

    def replace(self, **changes) -> "Recipe":
        """A copy with some fields changed (checked again)."""
        from dataclasses import replace

        return replace(self, **changes)


def as_recipe(model, batch=None, seq=None, **options) -> Recipe:
    """`model` if it is a Recipe (no other arguments allowed), else Recipe.of(model, batch, seq, **options)."""
    if isinstance(model, Recipe):
        if batch is not None or seq is not None or options:
            raise TypeError("give a Recipe alone, or a model with batch, seq and options, not both")
        return model
    if batch is None or seq is None:
        raise TypeError("batch and seq are required with a model (or give a Recipe)")
    return Recipe.of(model, batch, seq, **options)
