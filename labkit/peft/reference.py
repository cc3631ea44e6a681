"""The libraries' versions of LoRA and QLoRA, built on the same model and targets, to measure ours against.

- `peft_lora`: peft's get_peft_model(LoraConfig(target_modules=..., r, lora_alpha, ...)) on the same Linears.
- `bnb_qlora`: those Linears replaced by bitsandbytes' Linear4bit (NF4, double quantization, the same
  compute dtype), then peft's LoRA on top (peft picks its bnb 4-bit LoRA layer by itself).
  prepare_model_for_kbit_training is not called: it would turn on gradient checkpointing (which
  labkit's QLoRA does not use unless asked) and upcast norms that are already fp32 here.
- `same_adapter_init`: re-draws every adapter's A from one seeded generator in module order, so
  labkit's and peft's adapters start from identical values (B is zero in both) and the runs can
  be compared step for step.
- `track_bnb_storage`: bitsandbytes keeps the absmax statistics in a QuantState attribute of the
  weight, neither a parameter nor a buffer; this shows them (and the packed Params4bit codes) to the
  Ledger as frozen weight storage (BUFFER), as labkit's NF4 layers register theirs.

bitsandbytes' CPU 4-bit limits (bitsandbytes 0.50, measured on an AVX512-BF16 CPU, the same under
ATEN_CPU_CAPABILITY=default: these kernels live in bitsandbytes' own library, which reads the CPU
itself). (1) Its CPU dequantize_4bit, which every CPU Linear4bit forward and backward runs, finds a
value's absmax as row * (in_features // blocksize) + column // blocksize: right only when
in_features is a multiple of the block size (64 for NF4); a 32-input layer is dequantized with
block 0's absmax in every row, silently. bitsandbytes 0.50.2 dequantizes it right: `cpu_dequantize_is_right`
asks the installed version (one 32 x 32 weight against labkit's NF4), and `bnb_linear4bit` refuses such a
layer on the CPU only where it is wrong. (2) On a
CPU whose bitsandbytes reports AVX512-BF16 (`bitsandbytes.functional.has_avx512bf16()`), a
Linear4bit in eval mode given an input that does not require grad repacks its weight in place for a
fused kernel that computes in bf16 whatever compute_dtype says (about 3e-3 relative off the fp32
layer), and that repacking also needs out_features % 32 == 0 (else an AssertionError, or "shape
'[32, 0]' is invalid" for 32 inputs). `bnb_linear4bit` turns that shortcut off
(`support_avx512bf16_for_cpu = False` on the layer), so the reference computes what labkit's QLoRA
computes, in the same dtype, on every CPU.

What the Ledger cannot see: bitsandbytes' custom ops (bitsandbytes::gemm_4bit, dequantize_4bit)
reach it as one op each, counted by their outputs; a temporary made inside one (gemm_4bit's CPU
kernel dequantizes the weight before its matmul) is invisible. `hidden_bytes_bound` is the
largest such temporary: one targeted weight in the compute dtype.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from .lora import LoRAConfig, _matches, _replace

NF4_BLOCKSIZE = 64  # bitsandbytes' Params4bit default, and labkit's


def peft_lora(model: nn.Module, lora: LoRAConfig) -> nn.Module:
    """peft's LoRA on the Linears named in lora.targets (full names); modules in lora.train_also are unfrozen whole."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(target_modules=list(lora.targets), r=lora.r, lora_alpha=lora.alpha,
                                                  lora_dropout=lora.dropout, use_rslora=lora.rslora))
    for name, m in model.named_modules():
        if any(_matches(name, t) for t in lora.train_also):
            m.requires_grad_(True)  # as labkit's train_also; peft's modules_to_save would keep a second copy
    return peft_model


@functools.lru_cache(maxsize=1)
def cpu_dequantize_is_right() -> bool:
    """Whether the installed bitsandbytes' CPU dequantize_4bit gives a 32-input weight back as NF4 defines
    it (labkit.quant.nf4 from the same codes and absmax): wrong before 0.50.2 (module docstring)."""
    import bitsandbytes as bnb

    from labkit.quant.nf4 import dequantize_nf4, quantize_nf4

    w = torch.randn(32, 32, generator=torch.Generator().manual_seed(0)) * 0.1
    codes, state = bnb.functional.quantize_4bit(w, blocksize=NF4_BLOCKSIZE, quant_type="nf4",
                                                compress_statistics=False)
    mine, mine_state = quantize_nf4(w, NF4_BLOCKSIZE, double_quant=False)
    return torch.allclose(bnb.functional.dequantize_4bit(codes, state), dequantize_nf4(mine, mine_state))


def bnb_linear4bit(lin: nn.Linear, compute_dtype: torch.dtype) -> nn.Module:
    """bitsandbytes' Linear4bit (NF4, double quantization) holding `lin`'s weight, quantized on its device,
    computing in compute_dtype in eval mode too (bitsandbytes' bf16 CPU inference shortcut off).
    On the CPU with a bitsandbytes older than 0.50.2, in_features must be a multiple of 64 (ValueError
    otherwise; see the module docstring)."""
    import bitsandbytes as bnb

    if lin.weight.device.type == "cpu" and lin.in_features % NF4_BLOCKSIZE and not cpu_dequantize_is_right():
        raise ValueError(f"bitsandbytes' CPU 4-bit kernels need in_features divisible by {NF4_BLOCKSIZE} (the NF4 block "
                         f"size) to dequantize correctly, got a Linear with {lin.in_features} inputs (see labkit.peft.reference)")
    q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None, compute_dtype=compute_dtype,
                          compress_statistics=True, quant_type="nf4", device="meta")
    q.support_avx512bf16_for_cpu = False  # no bf16 inference shortcut on AVX512-BF16 CPUs (module docstring)
    q.weight = bnb.nn.Params4bit(lin.weight.data.clone(), requires_grad=False, quant_type="nf4",
                                 compress_statistics=True, blocksize=NF4_BLOCKSIZE)
    if lin.bias is not None:
        q.bias = nn.Parameter(lin.bias.data.clone(), requires_grad=False)
    return q.to(lin.weight.device)  # Params4bit quantizes on its first .to(device), on CPU too


def bnb_qlora(model: nn.Module, lora: LoRAConfig, compute_dtype: torch.dtype) -> nn.Module:
    """The Linears named in lora.targets (full names) as bitsandbytes Linear4bit, then peft's LoRA on them."""
    for name in lora.targets:
        _replace(model, name, bnb_linear4bit(model.get_submodule(name), compute_dtype))
    model.requires_grad_(False)
    return peft_lora(model, lora)


def same_adapter_init(model: nn.Module, seed: int) -> int:
    """Every LoRA A (labkit's `lora_A` or peft's `lora_A.<adapter>.weight`), in module order, drawn
    U(-1/sqrt(d_in), 1/sqrt(d_in)) (kaiming_uniform with a=sqrt(5), peft's and labkit's init) from
    one generator seeded `seed`; B is left at zero. Returns how many were drawn."""
    g = torch.Generator().manual_seed(seed)
    n = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_A" in "." + name:
                bound = p.shape[1] ** -0.5
                p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=g).to(p))
                n += 1
    return n


def _bnb_4bit_layers(model: nn.Module) -> list[nn.Module]:
    try:
        from bitsandbytes.nn import Linear4bit
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, Linear4bit)]


def track_bnb_storage(ledger, model: nn.Module) -> int:
    """Tag each Linear4bit's packed codes and QuantState statistics (absmax codes, second-level absmax,
    offset) as BUFFER in `ledger`; the shared lookup tables are left out, as labkit's are. Returns bytes."""
    from labkit.memory import Category

    seen, total = set(), 0
    for m in _bnb_4bit_layers(model):
        qs = m.weight.quant_state
        parts = [m.weight, qs.absmax] + ([qs.state2.absmax, qs.offset] if qs.nested else [])
        for t in parts:
            if id(t) not in seen:
                seen.add(id(t))
                ledger.track(t, Category.BUFFER)
                total += t.numel() * t.element_size()
    return total


def hidden_bytes_bound(model: nn.Module) -> int:
    """Bytes of the largest weight a bitsandbytes 4-bit op dequantizes out of the Ledger's sight (0 if none)."""
    return max((m.out_features * m.in_features * torch.finfo(m.compute_dtype or torch.float32).bits // 8
                for m in _bnb_4bit_layers(model)), default=0)
