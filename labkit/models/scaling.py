"""Lesson 12's two budgets in one call: the RAM a streaming loader needs per rank (flat in the dataset's
size) and the memory a compound-scaled CNN needs per phi (the largest phi that fits)."""

from __future__ import annotations

from dataclasses import dataclass

from labkit.data.loading import LoaderConfig, loader_ram
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


def plan(corpus_tokens: int, repeat: int, loader: LoaderConfig, phi: float, cnn_batch: int, budget: int,
         config: CNNConfig | None = None, phis=None) -> Plan:
    """Both predictions for the lesson's panel (and for the lesson's explore cells): the RAM of `loader` on
    corpus_tokens x repeat tokens, and the CNN's resident bytes per phi (with `phi`) at cnn_batch under `budget`."""
    config = config or CNNConfig()
    phis = list(phis) if phis is not None else [i / 2 for i in range(13)]
    if phi not in phis:
        phis = sorted(set(phis) | {phi})
    L = loader
    terms = loader_ram(L.workers, L.prefetch, L.batch, L.seq, L.shuffle_buffer, L.shard_rows)
    return Plan(corpus_tokens * repeat * 2, sum(terms.values()), terms, phis,
                [predict(config.at(p), cnn_batch).resident for p in phis], largest_phi(config, cnn_batch, budget, phis))


def measure_within(config: CNNConfig, batch: int, budget: int):
    """(True, Measurement) if one SGD step fits `budget` under the ledger, else (False, the error)."""
    try:
        return True, measure(config, batch, budget=budget)
    except SimulatedOutOfMemoryError as e:
        return False, e
