"""Rank functions for the data-parallel and ZeRO tests: several runs per launch (each launch costs seconds)."""

import warnings

from labkit.distributed import dp_ranks


def everything(rank, world_size, run, methods, references, recipes=()):
    """dp_ranks.compare, then (one launch for both) dp_ranks.measure_many of `recipes` under "memory"; under
    "warnings" every warning they emitted that Python's filters show (what a rank prints under a notebook cell;
    the spawned rank runs with the interpreter's default filters), as text."""
    with warnings.catch_warnings(record=True) as seen:  # records what the filters in force let through
        out = dp_ranks.compare(rank, world_size, run, methods, references)
        if recipes:
            out["memory"] = dp_ranks.measure_many(rank, world_size, list(recipes))
    out["warnings"] = [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in seen]
    return out


def mismatched_models(rank, world_size, cfg):
    """Rank 1 builds a wider model: ZeRO's first collective on the flat buffers does not match."""
    from labkit.distributed.zero import Zero
    from labkit.models.gpt import GPT, GPTConfig

    c = dict(cfg, n_embd=cfg["n_embd"] * (2 if rank == 1 else 1))
    z = Zero(GPT(GPTConfig(**c)), 3)
    return z.state_elements()

