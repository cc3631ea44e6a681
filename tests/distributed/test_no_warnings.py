"""Lessons 10 and 11 run their ranks' code (labkit/distributed/*) without a warning: anything a spawned rank
writes to stderr shows as red text under the lesson's cell. Each test runs that lesson's rank functions at tiny
sizes with warnings as errors in every rank (PYTHONWARNINGS, read when a spawned child starts; the categories
that Python hides by default stay hidden) and checks that the ranks wrote nothing to stderr (a warning in a
background thread, or one printed by C++, does not raise)."""

import pytest

from labkit.distributed import launch
from labkit.distributed import comm_ranks, mesh
from labkit.distributed import layout_ranks as lr
from labkit.distributed import param_server as PS
from labkit.distributed.compression import DGCConfig, PowerSGDConfig
from labkit.distributed.dp_ranks import TrainRun
from labkit.estimate import Recipe
from labkit.models.gpt import GPTConfig

# every warning an error, except the categories Python's default filters ignore (they never reach the screen)
AS_ERRORS = ",".join(["error"] + [f"ignore::{c}" for c in ("DeprecationWarning", "PendingDeprecationWarning",
                                                           "ImportWarning", "ResourceWarning")])


@pytest.fixture
def strict(monkeypatch, capfd):
    monkeypatch.setenv("PYTHONWARNINGS", AS_ERRORS)
    capfd.readouterr()  # start clean: what follows is the ranks' output
    yield
    err = capfd.readouterr().err
    assert err == "", f"the ranks wrote to stderr (red text under the lesson's cell):\n{err[-3000:]}"


def test_lesson_10_rank_code_warns_nothing(strict):
    cfg = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    b, s, m = 4, 8, 2
    work = lr.Workload(cfg, b, s)
    out = launch(lr.many, 2, args=([("pipeline_parity", (work, m)),
                                    ("tensor_parallel_parity", (lr.Workload(cfg, b // 2, s),)),
                                    ("pipeline_memories", (work, m)),
                                    ("tp_memories", (lr.Workload(dict(cfg, dropout=0.1, attention="manual"), 2, s),
                                                     work, b // 2))],), timeout_s=300)
    assert len(out) == 2 and all(len(r) == 4 for r in out)
    recipes = [Recipe(GPTConfig(**cfg), b, s, dp=2, pp=2, zero=1, micro_batch=1, schedule="1f1b"),
               Recipe(GPTConfig(**cfg), b, s, dp=2, tp=2, sequence_parallel=True)]
    got = launch(mesh.train_many, 4, args=(recipes, 1), timeout_s=300)  # ZeRO-1: reduce-scatter, all-gather
    assert all(len(r) == 2 for r in got)


def test_lesson_11_rank_code_warns_nothing(strict):
    cfg = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    run = TrainRun(cfg, steps=3, batch=8, seq=8)
    suite = launch(comm_ranks.compression_suite, 2, args=(run, DGCConfig(sparsity=0.99, warmup_steps=1),
                   PowerSGDConfig(rank=2), list(comm_ranks.VARIANTS)), timeout_s=300, backend="gloo")
    assert suite[0]["plain"]["losses"] == suite[0]["hook"]["losses"]
    runs = {"sync": PS.PSConfig("sync"), "async s=1": PS.PSConfig("async", 1)}
    dies = PS.PSConfig("async", 1, worker_timeout_s=2)
    ps = launch(comm_ranks.ps_suite, 3, args=(run, runs, True, comm_ranks.WorkerFaults(delays={2: 0.01}), dies),
                timeout_s=300, backend="gloo", may_fail=[2])
    assert ps[0]["dies"]["report"]["dropped"] == [2]
