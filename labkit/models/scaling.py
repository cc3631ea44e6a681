"""Lesson 12's two budgets in one call: the RAM a streaming loader needs per rank (flat in the dataset's
size) and the memory a compound-scaled CNN needs per phi (the largest phi that fits)."""

from __future__ import annotations

from dataclasses import dataclass

from labkit.data.loading import loader_ram
from labkit.memory import SimulatedOutOfMemoryError
from labkit.models.cnn import CNNConfig, largest_phi, measure, predict


@dataclass
class Plan:
    dataset_bytes: int  # tokens on disk: corpus x repeat x 2 bytes (uint16)
    loader_bytes: int  # RAM per rank for data: batches in flight + shuffle buffers + open shards (per worker)
    loader_terms: dict[str, int]  # the loader_bytes by term
    phis: list[float]  # the phis drawn
    resident: list[int]  # predicted CNN resident bytes per phi
    best_phi: float | None  # the largest phi whose resident bytes fit the budget


def plan(corpus_tokens: int, repeat: int, workers: int, prefetch: int, batch: int, seq: int, phi: float,
         cnn_batch: int, budget: int, shuffle_buffer: int = 256, shard_rows: int = 1024,
         config: CNNConfig | None = None, phis=None) -> Plan:
    """Both predictions for the lesson's panel (and for the lesson's explore cells)."""
    config = config or CNNConfig()
    phis = list(phis) if phis is not None else [i / 2 for i in range(13)]
    if phi not in phis:
        phis = sorted(set(phis) | {phi})
    terms = loader_ram(workers, prefetch, batch, seq, shuffle_buffer, shard_rows)
    return Plan(corpus_tokens * repeat * 2, sum(terms.values()), terms, phis,
                [predict(config.at(p), cnn_batch).resident for p in phis], largest_phi(config, cnn_batch, budget, phis))


def measure_within(config: CNNConfig, batch: int, budget: int):
    """(True, Measurement) if one SGD step fits `budget` under the ledger, else (False, the error)."""
    try:
        return True, measure(config, batch, budget=budget)
    except SimulatedOutOfMemoryError as e:
        return False, e
