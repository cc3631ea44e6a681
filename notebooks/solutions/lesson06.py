"""Reference solutions for lesson 06's exercises (tests/unit/test_exercises_05_06.py checks each one)."""

import math


# ---- exercise 1: GaLore's state for one matrix ---------------------------------------------------------
def galore_state_bytes(m: int, n: int, rank: int, bytes_per_value: int = 4) -> int:
    """Projector r x min(m, n) + Adam's m and v of the projected gradient, r x max(m, n) each."""
    return bytes_per_value * rank * (min(m, n) + 2 * max(m, n))


GALORE_STATE = galore_state_bytes(4096, 11008, 128)  # 13,369,344 B, vs 360,710,144 B for AdamW (3.7 %)
# In the notebook: galore_state_bytes(*EX1.shape, EX1.rank); the lesson's own EX1 is GALORE_STATE's (4096, 11008), 128


# ---- exercise 2: the rank where GaLore stops saving memory ---------------------------------------------------
def break_even_rank(m: int, n: int) -> int:
    """Smallest r with r(k + 2K) >= 2mn: GaLore's values against AdamW's (the bytes per value cancel)."""
    k, K = min(m, n), max(m, n)
    return math.ceil(2 * m * n / (k + 2 * K))


BREAK_EVEN_RANK = break_even_rank(4096, 11008)  # 3,454 of 4,096: GaLore saves memory below about 84 % of full rank
# In the notebook: break_even_rank(*EX2.shape); the lesson's own EX2 is BREAK_EVEN_RANK's (4096, 11008)


# ---- exercise 3: GaLore's state for a whole GPT, as a function ------------------------------------------------
def galore_gpt_state(cfg, r: int) -> int:
    """GaLore gets the four Linear weights of every block (attention and MLP; torch stores them (out, in)):
    c_attn (3d, d), attn.c_proj (d, d), c_fc (4d, d), mlp.c_proj (d, 4d). Everything else (token and position
    embeddings, the tied head, LayerNorms, biases) keeps AdamW's m and v: 8 bytes per value."""
    d, L, V, P = cfg.n_embd, cfg.n_layer, cfg.vocab_size, cfg.block_size
    mats = [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)]
    galore = L * sum(galore_state_bytes(a, b, r, 4) for a, b in mats)
    biases = L * (3 * d + d + 4 * d + d) if cfg.bias else 0  # the four Linear layers' biases
    norms = (2 * L + 1) * d * (2 if cfg.bias else 1)  # ln_1, ln_2 per block and ln_f: weight (and bias)
    return galore + 8 * (V * d + P * d + biases + norms)


# ---- exercise 4 --------------------------------------------------------------------------------------------
WHY_RANK = "b"
