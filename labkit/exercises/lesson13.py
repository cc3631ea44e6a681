"""Checks for lesson 13 (the planner): model-state bytes per rank under ZeRO-3, a function that finds the
largest micro-batch that fits (checked on fresh models and budgets), and why plain data parallelism does not
make a model fit.

Expected values come from the library: the ZeRO paper's table (labkit.estimate.zero_terms.paper_bytes) and
labkit.estimate.estimate.
"""

from __future__ import annotations

import random

from . import Inputs, checked_choice, close, failed, integer, not_answered, passed, unanswered

inputs = Inputs(__name__, {  # each exercise's inputs: the lesson's own first, then what a course may draw
    # llama2-7b, llama2-13b, llama2-70b, llama-65b (labkit.models.hf's presets): 16 n_params divides by every ranks
    "zero3_state_bytes": {"n_params": (6_738_415_616, 13_015_864_320, 68_976_648_192, 65_285_660_672),
                          "ranks": (8, 4, 16, 64)},
})


# ---- exercise 1: ZeRO-3 model states per rank ----------------------------------------------------------------
def zero3_state_bytes(n_params: int, ranks: int) -> float:
    from labkit.estimate.zero_terms import paper_bytes

    return paper_bytes(n_params, ranks, 3)


def check_zero3_state_bytes(answer, n_params: int, ranks: int = 8) -> bool:
    what = f"model-state bytes per rank, {n_params:,} parameters, ZeRO-3 over {ranks} ranks (2 + 2 + 12 B each)"
    value = integer(answer, what)
    if value is None:
        return False
    # 16 B per parameter (the ZeRO paper's mixed-precision Adam: 2 + 2 + 12), all sharded by stage 3 (the check's
    # own arithmetic, not zero3_state_bytes, which the student build stubs)
    expected = 16 * n_params / ranks
    if close(value, expected, rel=1e-6):
        return passed(f"{what}: {expected:,.0f} bytes = 16 x {n_params:,} / {ranks}.")
    if close(value, 16 * n_params, rel=1e-6):
        return failed(f"{what}: that is one device holding everything; stage 3 shards all three states.")
    if close(value, 2 * n_params + 14 * n_params / ranks, rel=1e-6):
        return failed(f"{what}: that is stage 2, which keeps the 16-bit parameters whole on every rank.")
    if close(value, 4 * n_params + 12 * n_params / ranks, rel=1e-6):
        return failed(f"{what}: that is stage 1, which shards only the optimizer state.")
    return failed(f"{what}: count 2 B of 16-bit weights, 2 B of 16-bit gradients and 12 B of fp32 Adam state "
                  f"(master weights, m, v) per parameter; then what stage 3 divides.")


# ---- exercise 2: the largest micro-batch that fits ---------------------------------------------------------
def largest_micro_batch(model, batch: int, seq: int, memory: int, **options) -> int | None:
    """Reference: the largest divisor of `batch` whose step (gradient accumulation over batch / micro
    micro-batches) the estimator says fits `memory` bytes; None when even 1 row does not."""
    from labkit.estimate import estimate

    for micro in sorted((d for d in range(1, batch + 1) if batch % d == 0), reverse=True):
        if estimate(model, batch, seq, micro_batch=micro, **options).peak.total <= memory:
            return micro
    return None


def _cases(seed: int) -> list[tuple]:
    """Fresh questions: a tiny preset, a batch, a sequence and a budget between the 1-row and the whole-batch
    peaks, so that the answer is neither end."""
    from labkit.estimate import estimate

    rng = random.Random(seed)
    out = []
    for model in ("gpt2-tiny", "llama-tiny"):
        batch, seq = rng.choice([8, 12, 16]), rng.choice([32, 64])
        lo = estimate(model, batch, seq, micro_batch=1).peak.total
        hi = estimate(model, batch, seq).peak.total
        out.append((model, batch, seq, int(lo + rng.uniform(0.2, 0.8) * (hi - lo))))
    out.append(("gpt2-tiny", 4, 32, 1024))  # nothing fits in a KiB
    return out


def check_largest_micro_batch(fn, seed: int | None = None) -> bool:
    what = "largest_micro_batch(model, batch, seq, memory)"
    if unanswered(fn):
        return not_answered(what)
    if not callable(fn):
        return failed(f"{what}: expected a function, got {type(fn).__name__}")
    cases = _cases(random.randrange(1 << 30) if seed is None else seed)
    for model, batch, seq, memory in cases:
        try:
            got = fn(model, batch, seq, memory)
        except Exception as e:  # the learner's code: say what failed, do not stop the notebook
            return failed(f"{what} raised {type(e).__name__}: {e} for {model}, batch {batch}, seq {seq}")
        want = largest_micro_batch(model, batch, seq, memory)
        if got != want:
            hint = ("return None when not even one row fits" if want is None else
                    "a micro-batch must divide the batch, and the largest that fits is wanted (fewer, larger "
                    "micro-batches run faster)" if isinstance(got, int) and got and batch % got else
                    "compare estimate(model, batch, seq, micro_batch=m).peak.total with the memory for each m")
            return failed(f"{what}: wrong for {model}, batch {batch}, seq {seq}, {memory:,} bytes ({hint}).")
    return passed(f"{what}: right on {len(cases)} fresh cases (two tiny models at budgets between their 1-row "
                  f"and whole-batch peaks, and one budget nothing fits).")


# ---- exercise 3: why plain data parallelism does not help a model fit ---------------------------------------
WHY_DP = {
    "a": "the gradients' all-reduce needs a second copy of the model on every device",
    "b": "every data-parallel rank holds a whole replica of the parameters, gradients and optimizer state; "
         "only the batch is divided",
    "c": "the devices' memories are added together only with NVLink",
}


def check_why_dp(answer) -> bool:
    what = "why a second device running plain data parallelism (ZeRO-0) does not make the 65B model fit"
    return checked_choice(
        answer, what, WHY_DP, right="b",
        praise=f"{what}: right: data parallelism divides the rows, so only activations shrink; ZeRO "
                 f"stages 1-3 (or tensor/pipeline parallelism) divide the model states.",
        hints={"a": f"{what}: labkit's data parallel all-reduces the .grad tensors in place; look at what each "
                 f"rank keeps whatever the communication."},
        otherwise=f"{what}: the interconnect changes the speed of collectives, not what each device must hold.")
