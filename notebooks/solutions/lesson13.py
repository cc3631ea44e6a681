"""Reference solutions for lesson 13's exercises (tests/unit/test_exercises_13.py checks each one)."""


# ---- exercise 1: ZeRO-3 model states per rank ----------------------------------------------------------------
def zero3_state_bytes(n_params: int, ranks: int = 8) -> int:
    """2 B weights + 2 B gradients + 12 B Adam state per parameter, all three sharded over the ranks."""
    return 16 * n_params // ranks


# In the notebook: zero3_state_bytes(**EX1); EX1 on your own is the lesson's llama2-7b (6,738,415,616 parameters)
# over 8 ranks: 13,476,831,232 bytes


# ---- exercise 2: the largest micro-batch that fits ---------------------------------------------------------
def largest_micro_batch(model, batch, seq, memory):
    from labkit.estimate import estimate

    for micro in range(batch, 0, -1):
        if batch % micro == 0 and estimate(model, batch, seq, micro_batch=micro).peak.total <= memory:
            return micro
    return None


# ---- exercise 3 ---------------------------------------------------------------------------------------------
WHY_DP = "b"
