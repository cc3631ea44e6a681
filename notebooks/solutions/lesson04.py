"""Reference solutions for lesson 04's exercises (tests/unit/test_exercises_02_04.py checks each one)."""

from labkit.estimate import estimate


# ---- exercise 1: the weight of a micro-batch's loss ------------------------------------------------
def micro_weight(sizes: list[int], index: int) -> float:
    """A micro-batch's mean loss stands for its rows: weight it by rows in it / rows in the batch."""
    return sizes[index] / sum(sizes)


THIRD_WEIGHT = micro_weight([3, 3, 2], 2)  # 2/8 = 0.25 (not 1/3: the split is uneven): the lesson's own EX1
# In the notebook: micro_weight(**EX1), e.g. micro_weight([5, 3, 2], 1) = 3/10


# ---- exercise 2: the largest micro-batch that fits a budget -------------------------------------------
def largest_micro_batch(config, batch: int, seq: int, budget: int, dtype: str = "fp32", checkpoint: str = "full",
                        device: str = "cpu", budget_scale: float = 1.0) -> int:
    """Try the divisors of the batch from the largest down; 0 if not even 1 fits int(budget x budget_scale)."""
    budget = int(budget * budget_scale)
    for m in sorted((m for m in range(1, batch + 1) if batch % m == 0), reverse=True):
        if estimate(config, batch, seq, dtype, device=device, checkpoint=checkpoint, micro_batch=m).peak.total <= budget:
            return m
    return 0


# In the notebook: largest_micro_batch(CONFIG, B, S, TIGHT or ROOMY, DTYPE, device=KIND, **EX2); the lesson's own EX2
# is checkpoint="full", budget_scale=1.0


# ---- exercise 3 (code): token shares of padded micro-batches -----------------------------------------------
def token_shares(y, sizes, ignore_index=-100):
    """n_i / N: each micro-batch's targets that are not ignore_index, over the whole batch's."""
    import torch

    counts = [int((part != ignore_index).sum()) for part in torch.split(y, list(sizes))]
    total = sum(counts)
    return [n / total for n in counts]


# ---- exercise 4 (why) ---------------------------------------------------------------------------------------
WHY_NO_SYNC = "b"
