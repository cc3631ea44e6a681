"""Checks for lesson 11 (communication): a function that counts DGC's bytes on the wire (checked on fresh inputs
it has not seen), and why DGC costs memory instead of saving it (a checked choice).

Expected values come from the library: labkit.distributed.compression.dgc_wire_bytes and dgc_state_bytes.
"""

from __future__ import annotations

import random

from labkit.distributed.compression import DGCConfig, dgc_state_bytes, dgc_wire_bytes

from . import checked_choice, close, failed, not_answered, passed, unanswered


# ---- exercise 1: write the bytes one DGC step sends -------------------------------------------------------
def _cases(seed: int = 11, n: int = 12) -> list[tuple[list[int], float, int]]:
    """Fresh inputs: tensor sizes, the fraction sent and the number of ranks."""
    rng = random.Random(seed)
    cases = [([1000], 0.01, 2), ([4096, 64, 7], 0.001, 8)]
    for _ in range(n):
        numels = [rng.randint(1, 50_000) for _ in range(rng.randint(1, 5))]
        cases.append((numels, rng.choice([0.25, 0.0625, 0.01, 0.001]), rng.choice([2, 3, 4, 16, 64])))
    return cases


def check_dgc_bytes(fn, seed: int = 11) -> bool:
    name = "dgc_bytes(numels, density, world)"
    if unanswered(fn):
        return not_answered(name)
    if not callable(fn):
        return failed(f"{name}: expected a function, got {type(fn).__name__}")
    wrong = []
    for numels, density, world in _cases(seed):
        expected = dgc_wire_bytes(numels, density, world)
        try:
            got = fn(list(numels), density, world)
        except Exception as e:  # the learner's code: show what it raised
            return failed(f"{name}: raised {type(e).__name__}: {e} for numels={numels}, density={density}, "
                          f"world={world}")
        if unanswered(got):  # the cell's `...` body: nothing written yet
            return not_answered(name)
        try:
            got = float(got)
        except (TypeError, ValueError):
            return failed(f"{name}: returned {got!r}, not a number")
        if not close(got, expected, rel=1e-9):
            wrong.append((numels, density, world, got, expected))
    if wrong:
        # on 2 ranks an all-reduce's 2(N-1)/N equals N/(N-1): diagnose on more ranks when one is wrong there
        numels, density, world, got, expected = next((c for c in wrong if c[2] > 2), wrong[0])
        what = f"for numels={numels}, density={density}, world={world} you get {got:,.0f}, expected {expected:,.0f}"
        if close(got, expected / 2, rel=1e-9):
            return failed(f"{name}: {what}: each sent entry is a 4-byte value AND a 4-byte int32 index.")
        if close(got, 2 * expected, rel=1e-9):
            return failed(f"{name}: {what}: this is an all-reduce's 2(N-1)/N; DGC all-gathers (N-1)/N x N x 8k.")
        if close(got * (world - 1), expected * world, rel=1e-9):
            return failed(f"{name}: {what}: an all-gather sends (N-1)/N of the gathered tensor, not all of it.")
        return failed(f"{name}: {what}: k = ceil(numel x density) (at least 1) per tensor; every rank's k values "
                      f"and indices are all-gathered: (N-1)/N x N x 8 x sum(k).")
    return passed(f"{name}: right on {len(_cases(seed))} fresh inputs. With 1 % sent on 64 ranks it is "
                  f"63 x 8 x k: the all-gather grows with the ranks, unlike an all-reduce (the paper's known limit).")


# ---- exercise 2: why memory grows -------------------------------------------------------------------------
WHY_CHOICES = {
    "a": "top-k sorts a full copy of every gradient, and the copy stays",
    "b": "DGC keeps, between steps, buffers as large as the gradients that dense data parallelism does not keep",
    "c": "the all-gather receives every rank's full gradient",
    "d": "gloo buffers the messages of every step until the end",
}


def check_why_memory(answer, n_params: int = 1_000_000) -> bool:
    name = "why a DGC rank holds more memory than a dense data-parallel rank"
    mc = dgc_state_bytes(n_params, DGCConfig())
    plain = dgc_state_bytes(n_params, DGCConfig(momentum_correction=False))
    return checked_choice(
        answer, name, WHY_CHOICES, right="b",
        praise=f"{name}: right: a residual v per parameter (what was not sent yet) and, with momentum "
               f"correction, a momentum u per parameter. For {n_params:,} parameters: {mc:,} bytes with "
               f"momentum correction, {plain:,} without (then SGD keeps its own momentum, {plain:,} again). "
               "DGC saves communication, not memory.",
        hints={"a": f"{name}: top-k's temporaries are freed after the step; the ledger's final bytes show what "
                    "stays.",
               "c": f"{name}: each rank sends k values and k indices: the gathered tensor is N x 8k bytes, tiny "
                    "at 99.9 % sparsity.",
               "d": f"{name}: nothing the transport does shows in the ledger: it counts tensors that live after "
                    "the steps."})
