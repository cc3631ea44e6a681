"""Why the estimator refuses a combination of techniques, as keys (code reads the key, people read the text).

A refused recipe raises `Refused`, a ValueError that carries one `Refusal`. Each refusal is one of two kinds:

- `Kind.INCOMPATIBLE`: the techniques cannot run together as the engines (or labkit) define them, e.g.
  stepping in backward needs each gradient once, and accumulation makes it several times. No estimate is
  missing: the message names what stands in the way and what to give instead.
- `Kind.NOT_ESTIMATED`: the combination runs, but labkit has not measured and derived it yet (a gap). The
  message says what is measured nearby. bench/cross_product.py counts the combinations each gap refuses on the
  tiny presets, and tests/unit/test_cross_product.py fails when a gap is met that this table does not list,
  or when a listed gap is met no longer (then delete it here).
"""

import enum


class Kind(enum.Enum):
    INCOMPATIBLE = "incompatible"  # the techniques do not run together
    NOT_ESTIMATED = "not estimated yet"  # they run together; labkit does not predict it (a gap)


I, N = Kind.INCOMPATIBLE, Kind.NOT_ESTIMATED


class Refusal(enum.Enum):
    """Every combination the estimator refuses: (kind, a short name for tables)."""

    # ---- one device, or any layout
    STEP_WITH_ACCUMULATION = (I, "step in backward x gradient accumulation")
    STEP_WITH_OFFLOAD = (I, "step in backward x optimizer offload")
    TWO_STATE_SHRINKERS = (I, "LoRA or LISA x GaLore (two ways to shrink the state)")
    PAGED_WITH_OFFLOAD = (I, "paged states x optimizer offload")
    LISA_STEP_IN_BACKWARD = (N, "LISA x step in backward")
    GPT_LOSS_CHUNK_STEP = (N, "labkit GPT's loss_chunk x step in backward")
    # ---- data parallel (labkit's Zero, FSDP2)
    GALORE_SHARDED = (I, "GaLore x ZeRO (a shard is not a matrix)")
    OPTIMIZER_SHARDED = (N, "8-bit or Lion states x FSDP2")
    FACTORED_SHARDED = (I, "Adafactor x ZeRO (a shard is not a matrix)")
    OPTIMIZER_OFFLOAD_ZERO = (I, "OffloadAdamW x ZeRO (use zero_offload)")
    STEP_IN_BACKWARD_ZERO = (N, "step in backward x ZeRO")
    ZERO_OFFLOAD_OPTIMIZER = (I, "zero_offload x an optimizer but AdamW")
    LISA_SHARDED = (I, "LISA x ZeRO (units fixed at wrapping)")
    FSDP2_MICRO_BATCHES = (N, "FSDP2 x gradient accumulation")
    ZERO3_SEGMENTS = (I, "ZeRO-3 x segments of several blocks")
    QUANT_FSDP2 = (N, "quantized base x ZeRO-3 / FSDP2")
    BASE_DTYPE_FSDP2 = (I, "16-bit base beside fp32 adapters x FSDP2 (one dtype per unit)")
    PAGED_SHARDED = (N, "paged states x FSDP2, or ZeRO-1 over tp/pp ranks")
    # ---- tensor and pipeline parallel
    ZERO_SHARDED_GRADIENTS_PP = (I, "ZeRO-2/3 x pipeline stages (gradients accumulate)")
    ZERO_SHARDED_GRADIENTS_TP = (N, "ZeRO-2/3 x tensor parallel")
    ZERO_OFFLOAD_LAYOUT = (N, "zero_offload x tensor or pipeline parallel")
    ZERO1_LAYOUT_OPTIMIZER = (N, "ZeRO-1 over tp/pp ranks x an optimizer but AdamW")
    OPTIMIZER_OFFLOAD_ZERO1_LAYOUT = (I, "OffloadAdamW x ZeRO-1 over tp/pp ranks")
    ACTIVATION_OFFLOAD_LAYOUT = (N, "activation offload x tp, or x checkpointing or LoRA on stages")
    ACTIVATION_OFFLOAD_DROPOUT_PP = (N, "activation offload x dropout on pipeline stages")
    GALORE_TP = (I, "GaLore x tensor parallel (a rank's shard is not the matrix)")
    LAYOUT_TECHNIQUE = (N, "LISA or step in backward x GPT tp ranks or stages")
    LORA_LAYOUT = (N, "LoRA x GPT tp ranks; a quantized base x tp; ZeRO x tp/pp")
    CHECKPOINT_LAYOUT = (N, "checkpointing x GPT tp ranks, or segments x stages")
    TP_FAMILY = (N, "tp x HF GPT-2; sequence parallel or stages x Llama")

    @property
    def kind(self) -> Kind:
        return self.value[0]

    @property
    def title(self) -> str:
        return self.value[1]


GAPS = frozenset(r for r in Refusal if r.kind is Kind.NOT_ESTIMATED)


class Refused(ValueError):
    """The estimator does not predict this recipe: `refusal` says why (a key), the message says it in words."""

    def __init__(self, refusal: Refusal, message: str):
        super().__init__(message)
        self.refusal = refusal

    @property
    def kind(self) -> Kind:
        return self.refusal.kind
