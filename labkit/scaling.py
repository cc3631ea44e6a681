"""Lesson 12's two budgets in one call: the RAM a streaming loader needs per rank (flat in the dataset's
size) and the memory a compound-scaled CNN needs per phi (the largest phi that fits)."""

from __future__ import annotations

from dataclasses import dataclass

from labkit.memory import SimulatedOutOfMemoryError
from labkit.models.cnn import CNNConfig, largest_phi, measure, predict

TOKEN_BYTES = 2  # uint16 on disk
SEQ_COLLATED = 8  # int64 tokens in a collated batch


@dataclass
class Plan:
    dataset_bytes: int  # tokens on disk: corpus x repeat x 2 bytes
    loader_bytes: int  # RAM per rank for data: batches in flight + shuffle buffers + open shards (per worker)
    loader_terms: dict[str, int]  # the loader_bytes by term
    phis: list[float]  # the phis drawn
    resident: list[int]  # predicted CNN resident bytes per phi
    best_phi: float | None  # the largest phi whose resident bytes fit the budget


def loader_ram(workers: int, prefetch: int, batch: int, seq: int, shuffle_buffer: int, shard_rows: int,
               open_shards: int = 2) -> dict[str, int]:
    """RAM a streaming loader holds per rank, by term (none depends on the dataset's size):
    in flight: workers x prefetch batches (x, y int64), or one batch with no workers;
    shuffle buffer: positions only (8 bytes each) per worker; open shards: their mapped pages, at most."""
    units = max(workers, 1)
    in_flight = (workers * prefetch if workers else 1) * 2 * batch * seq * SEQ_COLLATED
    return {"batches in flight": in_flight, "shuffle buffers": units * shuffle_buffer * 8,
            "open shards (mapped pages)": units * open_shards * shard_rows * (seq + 1) * TOKEN_BYTES}


def plan(corpus_tokens: int, repeat: int, workers: int, prefetch: int, batch: int, seq: int, phi: float,
         cnn_batch: int, budget: int, shuffle_buffer: int = 256, shard_rows: int = 1024,
         config: CNNConfig | None = None, phis=None) -> Plan:
    """Both predictions for the lesson's panel (and for the lesson's explore cells)."""
    config = config or CNNConfig()
    phis = list(phis) if phis is not None else [i / 2 for i in range(13)]
    if phi not in phis:
        phis = sorted(set(phis) | {phi})
    terms = loader_ram(workers, prefetch, batch, seq, shuffle_buffer, shard_rows)
    return Plan(corpus_tokens * repeat * TOKEN_BYTES, sum(terms.values()), terms, phis,
                [predict(config.at(p), cnn_batch).resident for p in phis], largest_phi(config, cnn_batch, budget, phis))


def measure_within(config: CNNConfig, batch: int, budget: int):
    """(True, Measurement) if one SGD step fits `budget` under the ledger, else (False, the error)."""
    try:
        return True, measure(config, batch, budget=budget)
    except SimulatedOutOfMemoryError as e:
        return False, e
