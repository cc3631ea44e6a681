"""Checks for lesson 12 (data at scale, model scaling): the samples one loader unit reads, the bytes a
DataLoader keeps in flight, and the largest compound-scaling step phi that fits a budget.

Expected values come from the library: labkit.data.shards.unit_range and labkit.models.cnn.
"""

from __future__ import annotations

from dataclasses import replace

from labkit.data.shards import unit_range
from labkit.memory import fmt_bytes
from labkit.models.cnn import CNNConfig, largest_phi, predict

from . import Inputs, close, failed, integer, number, passed, unanswered, not_answered

inputs = Inputs(__name__, {  # each exercise's inputs: the lesson's own first, then what a course may draw
    # world x workers units (6, 9, 14, 21) never divide the samples: some units read one more
    "unit_samples": {"num_samples": (1000, 1003, 1001), "world": (3, 7), "workers": (2, 3), "rank": (2, 1)},
    # 3 and 6 workers keep "per worker" (1/workers) apart from the x-and-y (1/2) and int64 (1/4, 1/8) slips
    "in_flight_bytes": {"num_workers": (4, 3, 6), "prefetch_factor": (2, 4), "batch": (16, 24), "seq": (256, 512)},
    # the notebook's PHI_BUDGET and CNN_BATCH follow the profile; each choice keeps the answer inside 0..8
    "largest_phi": {"gamma": (1.15, 1.1, 1.2, 1.3), "budget_scale": (1, 0.5, 2)},
})


# ---- exercise 1: how many samples one unit (rank x worker) reads ------------------------------------
def check_unit_samples(answer, num_samples: int, world: int, workers: int, rank: int, worker: int) -> bool:
    units = world * max(workers, 1)
    unit = rank * max(workers, 1) + worker
    name = f"samples read by rank {rank}, worker {worker} ({num_samples} samples, {world} ranks x {workers} workers)"
    n = integer(answer, name)
    if n is None:
        return False
    start, end = unit_range(num_samples, unit, units)
    if n == end - start:
        return passed(f"{name}: {end - start}, positions [{start}, {end}) of the epoch: unit {unit} of {units} "
                      f"reads [u*N//U, (u+1)*N//U).")
    if n == num_samples // units and n != end - start:
        return failed(f"{name}: N // U is what every unit reads with equal=True; without it the {num_samples % units} "
                      "leftover samples go to some units: compute (u+1)*N//U - u*N//U.")
    if n == num_samples // world:
        return failed(f"{name}: that is about one rank's share; the rank's {max(workers, 1)} workers split it again.")
    return failed(f"{name}: this unit is number u = rank x workers + worker = {unit} of U = {units}; it reads positions "
                  "[u*N//U, (u+1)*N//U).")


# ---- exercise 2: bytes in flight in a DataLoader --------------------------------------------------------
def in_flight_bytes(num_workers: int, prefetch_factor: int, batch: int, seq: int, pin_memory: bool) -> int:
    """Batches loaded ahead: num_workers x prefetch_factor, each x and y (batch, seq) int64; pinned copies double it."""
    one = 2 * batch * seq * 8
    return num_workers * prefetch_factor * one * (2 if pin_memory else 1)


def check_in_flight_bytes(answer, num_workers: int, prefetch_factor: int, batch: int, seq: int,
                          pin_memory: bool = False) -> bool:
    name = f"bytes in flight ({num_workers} workers x prefetch {prefetch_factor}, batch {batch} x seq {seq})"
    value = number(answer, name)
    if value is None:
        return False
    expected = in_flight_bytes(num_workers, prefetch_factor, batch, seq, pin_memory)
    one = 2 * batch * seq * 8
    if close(value, expected, rel=1e-9):
        return passed(f"{name}: {fmt_bytes(expected)}: {num_workers * prefetch_factor} batches of x and y in int64"
                      + (", each also copied to pinned memory" if pin_memory else "") + ". It does not grow with the dataset.")
    if close(value, prefetch_factor * one, rel=1e-9):
        return failed(f"{name}: prefetch_factor counts batches per worker: multiply by the {num_workers} workers.")
    if close(value, expected / 2, rel=1e-9) and not pin_memory:
        return failed(f"{name}: a batch holds x and y, both (batch, seq).")
    if close(value, expected / 4, rel=1e-9) or close(value, expected / 8, rel=1e-9):
        return failed(f"{name}: the collated tokens are int64 (8 bytes each), not the shards' uint16.")
    return failed(f"{name}: workers x prefetch_factor batches, each x and y of batch x seq int64 tokens.")


# ---- exercise 3: the largest phi that fits ----------------------------------------------------------------
def check_largest_phi(answer, config: CNNConfig, batch: int, budget: int, gamma: float | None = None,
                      budget_scale: float = 1) -> bool:
    """gamma: the family's resolution coefficient (None: the config's own); budget_scale: the budget is
    budget_scale x `budget`."""
    if gamma is not None:
        config = replace(config, gamma=gamma)
    budget = budget * budget_scale
    name = f"largest phi whose predicted resident bytes fit {fmt_bytes(budget)} (batch {batch}, gamma {config.gamma:g})"
    if unanswered(answer):
        return not_answered(name)
    expected = largest_phi(config, batch, budget)
    if expected is None:
        return failed(f"{name}: not even phi = 0 fits this budget: choose a larger one")
    value = number(answer, name)
    if value is None:
        return False
    if close(value, expected, rel=1e-9):
        return passed(f"{name}: phi = {expected:g} ({config.at(expected).describe()}), "
                      f"{fmt_bytes(predict(config.at(expected), batch).resident)}.")
    if value * 2 != int(value * 2):
        return failed(f"{name}: phi goes in steps of 0.5 here.")
    if not 0 <= value <= 8:  # a CNN at phi = 1e6 would take the predictor forever to lay out
        return failed(f"{name}: phi runs from 0 to 8 here, in steps of 0.5.")
    need = predict(config.at(value), batch).resident
    if need > budget:
        return failed(f"{name}: phi = {value:g} needs {fmt_bytes(need)}: over the budget.")
    return failed(f"{name}: a larger phi still fits: compare predict(config.at(phi), batch).resident with the budget.")
