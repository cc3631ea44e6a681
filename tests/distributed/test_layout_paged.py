"""Paged optimizer states (bitsandbytes' PagedAdamW: the states in CUDA unified memory, which
max_memory_allocated does not count) on pipeline stages and tensor-parallel ranks (issue 43's cross product):
each rank's peak per category without the states, and the states' bytes in `Estimate.unified`, against
each rank's ledger (real gloo ranks)."""

from labkit.distributed import launch
from labkit.distributed import layout_ranks as lr
from labkit.estimate import Recipe, estimate_ranks
from labkit.memory import CATEGORIES
from labkit.models.gpt import GPTConfig

TOL = 0.03  # of the measured peak, per category (tests/unit/estimate_checks.py)

CFG = dict(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)


def _within(e, got: dict, why: str) -> None:
    peak = got["peak"]
    for c in CATEGORIES:
        assert abs(e.peak[c] - peak[c.name.lower()]) <= TOL * peak["total"], (why, c.name, e.peak[c], peak)
    assert e.unified == got["unified"] > 0, (why, e.unified, got["unified"])


def test_paged_states_on_pipeline_stages_and_tensor_parallel_ranks():
    w = lr.Workload(CFG, 4, 32)
    out = launch(lr.many, 2, args=([("pipeline_memories", (w, 2, ("1f1b",), False, None, None, False, True)),
                                    ("tp_step_memory", (w, None, True, 2, None, True))],), timeout_s=300)
    stages = estimate_ranks(Recipe(GPTConfig(**CFG), 4, 32, pp=2, micro_batch=2, schedule="1f1b",
                                   paged_states=True))
    ranks = estimate_ranks(Recipe(GPTConfig(**CFG), 4, 32, tp=2, sequence_parallel=True, paged_states=True))
    for k in range(2):
        _within(stages[k], out[k][0]["1f1b"], f"stage {k}")
        _within(ranks[k], out[k][1], f"tp rank {k}")
        assert "paged_states" in stages[k].label
