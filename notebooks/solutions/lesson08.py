"""Reference solutions for lesson 08's exercises (tests/unit/test_exercises_08.py checks each one)."""

import torch.nn as nn


# ---- exercise 1: parameters LoRA trains --------------------------------------------------------------
def lora_params(model: nn.Module, targets=("query", "value"), r: int = 8) -> int:
    """Each targeted Linear gets A (r x d_in) and B (d_out x r): r x (d_in + d_out) parameters."""
    return sum(r * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in targets)


# ---- exercise 2: bytes of a frozen NF4 base -------------------------------------------------------------
def nf4_base_bytes(rows: int = 4096, cols: int = 4096, blocksize: int = 64, dq_blocksize: int = 256) -> int:
    """Codes (2 per byte) + an 8-bit absmax per block + an fp32 scale per dq_blocksize blocks + one fp32 offset."""
    n = rows * cols
    blocks = n // blocksize
    return n // 2 + blocks + 4 * (blocks // dq_blocksize) + 4


# ---- exercise 3: the most optimizer state LISA holds ----------------------------------------------------
def lisa_opt_bytes(model: nn.Module, gamma: int = 1, layers_attr: str = "blocks") -> int:
    """AdamW: 8 bytes per trained parameter + a 4-byte step per tensor, for everything outside the layer list
    (always trained) and the gamma largest layers."""
    layers = getattr(model, layers_attr)
    in_layers = {id(p) for p in layers.parameters()}
    outside = {id(p): p for p in model.parameters() if id(p) not in in_layers}  # tied weights once
    per_layer = sorted((sum(p.numel() for p in lay.parameters()), len(list(lay.parameters()))) for lay in layers)
    n = sum(p.numel() for p in outside.values()) + sum(k for k, _ in per_layer[-gamma:])
    tensors = len(outside) + sum(t for _, t in per_layer[-gamma:])
    return 8 * n + 4 * tensors


# ---- exercise 4: LoRA's trainable parameters on a whole GPT, as a function --------------------------------------
def gpt_lora_trainable(cfg, r: int, targets) -> int:
    """Each adapted nn.Linear(d_in, d_out) trains A (r x d_in) and B (d_out x r); its weight and bias stay frozen.
    A block's linears: c_attn (d -> 3d), attn.c_proj (d -> d), c_fc (d -> 4d), mlp.c_proj (4d -> d); lm_head
    (d -> vocab) once. apply_lora matches a name by its ending, so "c_proj" adapts both projections."""
    d, V = cfg.n_embd, cfg.vocab_size
    block = {"c_attn": (d, 3 * d), "attn.c_proj": (d, d), "c_fc": (d, 4 * d), "mlp.c_proj": (4 * d, d)}
    chosen = {n for n in block if n in targets or (n.endswith(".c_proj") and "c_proj" in targets)}
    total = cfg.n_layer * sum(r * (block[n][0] + block[n][1]) for n in chosen)
    return total + (r * (d + V) if "lm_head" in targets else 0)


# ---- exercise 5 --------------------------------------------------------------------------------------------
WHY_LISA = "c"
