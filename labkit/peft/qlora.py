"""QLoRA from scratch: LoRA adapters trained on top of a base model frozen in 4-bit NF4.

Dettmers et al. 2023: every targeted Linear's weight is stored in NF4 with double quantization
(about 0.52 bytes per weight instead of 2 in bf16 or 4 in fp32), dequantized block by block into
the compute dtype when it is used, and never trained; LoRA's A and B (fp32 here, as peft keeps
them) carry all the learning. artidoro/qlora adds activation checkpointing and a paged 8-bit
optimizer; `qlora_optimizer` and `checkpoint=` give the first two here.

The frozen base is `labkit.quant.NF4Linear` (here also called `NF4Base`), in two versions:

- the real one (default): an autograd Function (`labkit.quant.DequantMatmul`, as bitsandbytes'
  MatMul4Bit) that keeps nothing but references to the packed weight and dequantizes it again in
  backward (dL/dx = g W). One layer's temporary copy exists at a time; the cost is a second
  dequantization per layer.
- `keep_dequantized=True`, the teaching one: F.linear(x, dequantize(W)). Autograd keeps the
  dequantized (d_out, d_in) weight to compute dL/dx, so every targeted layer holds a full-size copy
  in the compute dtype (2 bytes per weight in bf16, 4 in fp32) as an activation until backward.

Bytes per adapted Linear (fp32 adapters, AdamW): 0.5 per base weight (packed codes) + 1/64 per
weight (uint8 absmax) + ~1/4096 (fp32 second-level scales), bias kept as it was, + 16 per
adapter parameter (4 weight + 4 grad + 8 Adam state).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from labkit.quant.nf4 import NF4Linear
from .lora import LoRAConfig, LoRALinear, apply_lora, trainable_parameters

COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


NF4Base = NF4Linear  # the frozen QLoRA base: one implementation, in labkit.quant.nf4


@dataclass(frozen=True)
class NF4Config:
    """How a QLoRA base is quantized (bitsandbytes' BitsAndBytesConfig for 4-bit NF4)."""

    compute_dtype: torch.dtype = torch.bfloat16  # one of COMPUTE_DTYPES: dequantized into and multiplied in
    double_quant: bool = True  # the absmax statistics quantized again (8-bit, blocks of 256)
    blocksize: int = 64  # weights per absmax
    keep_dequantized: bool = False  # the teaching base: autograd keeps each dequantized weight for backward

    def __post_init__(self) -> None:
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of torch.float32, torch.bfloat16, torch.float16, "
                             f"got {self.compute_dtype!r}")
        if isinstance(self.blocksize, bool) or not isinstance(self.blocksize, int) or self.blocksize <= 0:
            raise ValueError(f"blocksize must be a positive integer, got {self.blocksize!r}")


def to_nf4(linear: nn.Linear, quant: NF4Config = NF4Config()) -> NF4Linear:
    """Quantize one Linear into a frozen NF4 layer; keep_dequantized: the teaching version (see the module docstring)."""
    layer = NF4Linear.from_linear(linear, blocksize=quant.blocksize, double_quant=quant.double_quant,
                                  compute_dtype=quant.compute_dtype, keep_dequantized=quant.keep_dequantized)
    return layer.requires_grad_(False)


def apply_qlora(model: nn.Module, lora: LoRAConfig = LoRAConfig(), quant: NF4Config = NF4Config(),
                checkpoint: str | None = None):
    """Quantize the targeted Linears to NF4 (`quant`), wrap each in a LoRALinear (`lora`), freeze the rest; return
    the model.

    checkpoint: None, or a policy of `labkit.recompute.checkpoint_blocks` ("full", "sqrt", ...) for labkit's
        GPT or a transformers GPT-2 / Llama; the handle is left at `model.qlora_checkpoint`.
    Biases, norms and embeddings stay in their dtype (frozen, unless named in lora.train_also).
    """

    def wrap(lin: nn.Linear) -> LoRALinear:
        if not isinstance(lin, nn.Linear):
            raise TypeError(f"QLoRA quantizes nn.Linear modules, got {type(lin).__name__}")
        return LoRALinear(to_nf4(lin, quant), r=lora.r, alpha=lora.alpha, dropout=lora.dropout, rslora=lora.rslora,
                          adapter_dtype=lin.weight.dtype)

    apply_lora(model, lora.targets, r=lora.r, alpha=lora.alpha, train_also=lora.train_also, wrap=wrap)
    if checkpoint is not None:
        from labkit.recompute import checkpoint_blocks

        model.qlora_checkpoint = checkpoint_blocks(model, checkpoint)
    return model


def qlora_optimizer(model: nn.Module, kind: str = "adamw", lr: float = 2e-4, weight_decay: float = 0.0):
    """The optimizer over the trainable parameters: "adamw" (torch, 8 bytes of state per parameter) or
    "adamw8bit" (labkit.optim.AdamW8bit, 2 bytes per parameter in tensors of at least its min_8bit_size).
    """
    params = trainable_parameters(model)
    if not params:
        raise ValueError("the model has no trainable parameters: apply_qlora (or apply_lora) first")
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if kind == "adamw8bit":
        try:
            from labkit.optim import AdamW8bit
        except ImportError as e:
            raise ValueError(f"optimizer 'adamw8bit' needs labkit.optim.AdamW8bit, which failed to import ({e}); use 'adamw'") from None
        return AdamW8bit(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {kind!r}: choose 'adamw' or 'adamw8bit'")


def base_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the frozen NF4 bases (codes + statistics), of the adapters, and of everything else."""
    out = {"nf4": 0, "adapters": 0, "other": 0}
    seen = set()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        key = "adapters" if name.rsplit(".", 1)[-1] in ("lora_A", "lora_B") else \
            "nf4" if ".weight_" in name or name.startswith("weight_") else "other"
        out[key] += t.numel() * t.element_size()
    return out
