"""Reference solutions for lesson 01's exercises (tests/unit/test_exercises.py checks each one)."""

from labkit.estimate import estimate


# ---- exercise 1: bytes of model states per parameter ----------------------------------------------
def bytes_per_param(optimizer_states: int, mixed: bool) -> int:
    """fp32 weight 4 (under autocast it is the master copy) + autocast's 16-bit copy 2 (mixed only)
    + fp32 gradient 4 (gradients take the weights' dtype) + 4 per fp32 optimizer state."""
    return 4 + (2 if mixed else 0) + 4 + 4 * optimizer_states


STATES = {"sgd": 0, "sgd-momentum": 1, "adamw": 2}  # optimizer states per parameter (EX1.optimizer)


def bytes_per_param_for(optimizer: str) -> tuple[int, int]:
    """(fp32, mixed) for the notebook's EX1.optimizer."""
    return bytes_per_param(STATES[optimizer], mixed=False), bytes_per_param(STATES[optimizer], mixed=True)


# The lesson's own EX1 is SGD with momentum: one state (the momentum buffer) per parameter.
BYTES_PER_PARAM_FP32 = bytes_per_param(1, mixed=False)  # 4 + 4 + 4 = 12
BYTES_PER_PARAM_MIXED = bytes_per_param(1, mixed=True)  # 4 + 2 + 4 + 4 = 14
# AdamW (two states, m and v), the lesson's table: 16 and the HF docs' 18. Exactly, a little less
# than 18: embeddings and norms never enter a matmul, so autocast makes no 16-bit copy of them.
ADAMW_BYTES_PER_PARAM_FP32 = bytes_per_param(2, mixed=False)  # 16
ADAMW_BYTES_PER_PARAM_MIXED = bytes_per_param(2, mixed=True)  # 18


# ---- exercise 2: the logits term ------------------------------------------------------------------
def logsoftmax_bytes(batch: int, seq: int, vocab: int) -> int:
    """The loss saves log_softmax(logits) for backward: one fp32 number per token per vocabulary entry."""
    return batch * seq * vocab * 4


# The notebook asks for Llama 3.2 1B (V = 128,256) at EX2's batch and seq: logsoftmax_bytes(EX2.batch, EX2.seq,
# 128256). The lesson's own EX2, batch 4 and seq 4096, gives 7.8 GiB for one tensor
LOGSOFTMAX_BYTES = logsoftmax_bytes(4, 4096, 128256)


# ---- exercise 3: the largest batch that fits --------------------------------------------------------
def largest_batch(model, seq: int, budget: int, dtype: str = "fp32", optimizer: str = "adamw",
                  device: str = "cpu") -> int:
    """The largest batch whose predicted peak fits the budget (0 if not even batch 1 does).

    The peak grows with the batch, so double until it no longer fits, then bisect.
    """
    def fits(b: int) -> bool:
        return estimate(model, b, seq, dtype, optimizer, device=device).peak.total <= budget

    if not fits(1):
        return 0
    hi = 2
    while fits(hi):
        hi *= 2
    lo = hi // 2  # fits(lo) and not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# The notebook asks for MODEL (gpt2 unless changed) at EX3's seq and budget, fp32 AdamW:
#     largest_batch(MODEL, EX3.seq, EX3.budget, device=KIND)
# (the lesson's own EX3: seq 1024 in 16 GiB, largest_batch(MODEL, 1024, 16 * GiB, device=KIND))
# (KIND is "cpu" or "cuda": the kernels differ, for instance in what attention keeps for backward.)


# ---- exercise 4 (code): the largest batch that fits, as a function ------------------------------------
def largest_batch_fn(model, seq, budget):
    """Count up from batch 1 while the predicted peak (fp32, AdamW, cpu) stays within the budget."""
    b = 0
    while estimate(model, b + 1, seq, "fp32", "adamw", device="cpu").peak.total <= budget:
        b += 1
    return b


# ---- exercise 5 (why) ---------------------------------------------------------------------------------
WHY_PEAK = "b"
