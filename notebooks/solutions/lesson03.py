"""Reference solutions for lesson 03's exercises (tests/unit/test_exercises_02_04.py checks each one)."""

import torch

from labkit.estimate import estimate
from labkit.models.gpt import GPT
from labkit.recompute import checkpoint_blocks
from labkit.run.policies import measure_training_step


# ---- exercise 1: what full checkpointing keeps per block ------------------------------------------
BYTES_PER_ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2}


def kept_per_block(config, batch: int, seq: int, dtype: str = "fp32") -> int:
    """A checkpointed block keeps only its input, the residual stream (batch, seq, n_embd), in the model's dtype."""
    return batch * seq * config.n_embd * BYTES_PER_ELEMENT[dtype]


# In the notebook: kept_per_block(CONFIG, B, S, **EX1), e.g. 8 x 256 x 256 x 4 = 2 MiB on the cpu profile in fp32
# (the lesson's own EX1), half of it in bf16


# ---- exercise 2: the best number of segments --------------------------------------------------------
def best_segments(config, batch: int, seq: int, dtype: str = "fp32", device: str = "cpu",
                  n_layer: int | None = None) -> int:
    """The k from 1 to n with the lowest predicted peak (the smallest k among ties), for config made n_layer
    blocks deep (None: as it is)."""
    from dataclasses import replace

    if n_layer is not None:
        config = replace(config, n_layer=n_layer)
    peaks = {k: estimate(config, batch, seq, dtype, device=device, checkpoint="full", segments=k).peak.total
             for k in range(1, config.n_layer + 1)}
    return min(peaks, key=lambda k: (peaks[k], k))


# In the notebook: best_segments(CONFIG, B, S, device=KIND, **EX2): k = n for the lesson's shallow CONFIG; a deeper
# one (EX2.n_layer = 12 on the smoke profile) is best a little below n


# ---- exercise 3: the FLOPs recomputation adds ---------------------------------------------------------
# Reasoning: forward 1 + backward 2 = 3 forwards; full checkpointing adds one forward of the blocks: 4/3.
FLOPS_FACTOR_ESTIMATE = 4 / 3


def flops_factor(backward_ratio: float = 2) -> float:
    """A backward of b forwards: a step is 1 + b forwards, and full checkpointing adds one: (2 + b) / (1 + b).
    In the notebook: flops_factor(**EX3)."""
    return (2 + backward_ratio) / (1 + backward_ratio)


def measured_flops_factor(config, batch: int, seq: int) -> float:
    """The truth: FlopCounterMode over one training step, every block checkpointed vs none."""
    torch.manual_seed(0)
    model = GPT(config)
    t = torch.randint(0, config.vocab_size, (batch, seq + 1))
    x, y = t[:, :-1].contiguous(), t[:, 1:].contiguous()
    plain = measure_training_step(model, x, y).flops
    full = measure_training_step(model, x, y, setup=lambda m: checkpoint_blocks(m, "full")).flops
    return full / plain  # a little under 4/3: the head and the loss are not recomputed


# ---- exercise 4: where the s^2 term takes over ---------------------------------------------------------
def scores_crossover(config, batch: int, seq: int, dtype: str = "fp32", device: str = "cpu") -> float:
    """Manual attention at S: the probabilities P grow like S^2; the rest R of what the blocks save grows like S,
    but for the causal mask (S^2 bools per layer, L S^2 bytes, whatever the dtype). Equal where
    (R - L S^2) x/S + L x^2 = P x^2/S^2."""
    from dataclasses import replace

    est = estimate(replace(config, attention="manual"), batch, seq, dtype, device=device)
    terms = {t.name: t.bytes for t in est.terms}
    P, R, L = terms["attention scores (s^2)"], terms["activations saved by the blocks"], config.n_layer
    return ((R - L * seq**2) / seq) / (P / seq**2 - L)


# In the notebook: scores_crossover(CONFIG, B, S, device=KIND, **EX4): the dtype changes P and R's linear part
# (bytes per value), not the 1-byte mask


# ---- exercise 5 (code): the best number of segments from a and A -------------------------------------------
def best_k(n_blocks: int, block_bytes: int, input_bytes: int) -> int:
    """k kept segment inputs + the largest of k even segments (ceil(n/k) whole blocks) recomputed: the lowest k."""
    def peak(k):
        return k * input_bytes + -(-n_blocks // k) * block_bytes

    return min(range(1, n_blocks + 1), key=peak)


# ---- exercise 6 (why) -------------------------------------------------------------------------------------
WHY_PINNED = "b"
