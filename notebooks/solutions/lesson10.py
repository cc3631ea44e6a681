"""Reference solutions for lesson 10's exercises (tests/unit/test_exercises_10.py checks each one)."""


# ---- exercise 1: activations of stage 0 under each schedule --------------------------------------------------
def stage0_activations(one_micro_batch: int, p: int = 4, m: int = 8) -> tuple[int, int]:
    """GPipe holds all m micro-batches on stage 0; 1F1B holds min(p - 0, m)."""
    return m * one_micro_batch, min(p, m) * one_micro_batch


# ---- exercise 2: the bubble ------------------------------------------------------------------------------------
def bubble(p: int = 4, m: int = 12) -> float:
    """p - 1 idle slots of m + p - 1 on every stage."""
    return (p - 1) / (m + p - 1)


# ---- exercise 3: one tensor-parallel rank's parameters -------------------------------------------------------
def tp_param_bytes(cfg, t: int = 2, dtype: str = "fp32") -> int:
    """labkit's GPT (tied head): per block, c_attn (3h x h + 3h) and c_fc (4h x h + 4h) / t, the two c_proj
    weights / t with their biases whole, two LayerNorms whole; embeddings and the final norm whole. 4 bytes each
    in fp32 (the lesson's own), 2 in bf16 or fp16."""
    h, L = cfg.n_embd, cfg.n_layer
    split = (3 * h * h + 3 * h) + (4 * h * h + 4 * h) + h * h + 4 * h * h
    whole = 2 * h + 2 * (2 * h)  # the c_proj biases, ln_1 and ln_2
    outside = cfg.vocab_size * h + cfg.block_size * h + 2 * h
    return {"fp32": 4, "bf16": 2, "fp16": 2}[dtype] * (L * (split // t + whole) + outside)
