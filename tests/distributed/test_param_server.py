"""The parameter server on 3 gloo ranks (a server and 2 workers): synchronous equals the mirrored all-reduce bit
for bit with SGD; asynchronous respects its staleness bound (s = 0 is synchronous up to rounding); memory and
bytes against the formulas; a worker that dies is dropped (async) or ends the run with one clear error (sync),
and no process is left behind."""

import pytest
import torch

from labkit.distributed import RankFailed, launch
from labkit.distributed import comm_ranks
from labkit.distributed.dp_ranks import TrainRun
from labkit.distributed.param_server import PSConfig, ps_wire_bytes, server_state_bytes
from test_launch import _children_of_me

CFG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
STEPS, BATCH, SEQ, WORLD = 3, 8, 8, 3
EPS = torch.finfo(torch.float32).eps
RUNS = {"sync": PSConfig("sync"), "async0": PSConfig("async", 0), "async1": PSConfig("async", 1),
        "momentum": PSConfig("sync", optimizer="sgd-momentum")}


@pytest.fixture(scope="module")
def suite():
    out = launch(comm_ranks.ps_suite, WORLD, args=(TrainRun(CFG, STEPS, BATCH, SEQ), RUNS, True), timeout_s=300,
                 backend="gloo")
    assert _children_of_me() == []
    return out


def _maxdiff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parity
def test_synchronous_server_equals_the_mirrored_all_reduce_bit_for_bit(suite):
    # The server sums the 2 workers' gradients (g1 + g2 == g2 + g1 exactly) and halves them (exact), as the
    # all-reduce does; SGD then takes the same step.
    mirrored = suite[1]["mirrored"]
    assert _maxdiff(suite[0]["sync"]["params"], mirrored["params"]) == 0.0
    assert suite[1]["sync"]["losses"] == mirrored["losses"]
    assert suite[2]["sync"]["losses"] == suite[2]["mirrored"]["losses"]
    assert suite[0]["sync"]["report"]["version"] == STEPS


def test_async_with_staleness_0_is_synchronous_up_to_rounding(suite):
    # Both workers compute on the same version; the server applies g1/2 then g2/2 instead of (g1 + g2)/2: a
    # rounding apart per step, which the next gradients carry on. Bound: 4 ulps x steps of the largest parameter.
    sync, a0 = suite[0]["sync"], suite[0]["async0"]
    scale = max(p.abs().max().item() for p in sync["params"].values())
    assert _maxdiff(sync["params"], a0["params"]) <= 4 * STEPS * EPS * scale
    assert a0["report"]["max_lead"] == 0 and a0["report"]["version"] == 2 * STEPS


def test_staleness_bound_holds(suite):
    for name, s in (("async0", 0), ("async1", 1)):
        rep = suite[0][name]["report"]
        assert rep["max_lead"] <= s
        assert len(rep["staleness"]) == 2 * STEPS and rep["dropped"] == []
        assert all(0 <= k <= s for k in rep["staleness"]), rep["staleness"]


def test_staleness_is_counted_in_steps_the_same_way_in_both_modes(suite):
    # sync and async s=0: every gradient of step i is computed on parameters with steps 0..i-1 complete
    assert suite[0]["sync"]["report"]["staleness"] == [0] * (2 * STEPS)
    assert suite[0]["async0"]["report"]["staleness"] == [0] * (2 * STEPS)


def test_memory_server_holds_the_optimizer_workers_none(suite):
    n = suite[0]["sync"]["n_params"]
    server = suite[0]["momentum"]
    assert server["final"]["opt"] == server_state_bytes(n, "sgd-momentum") == 4 * n
    assert server["final"]["param"] == 4 * n and server["final"]["grad"] == 0
    for w in (1, 2):
        worker = suite[w]["momentum"]
        assert worker["peak"]["opt"] == 0 and worker["final"]["opt"] == 0
        assert worker["peak"]["grad"] == 4 * n and worker["peak"]["param"] == 4 * n


def test_bytes_by_definition(suite):
    n = suite[0]["sync"]["n_params"]
    want = ps_wire_bytes(n, 2, STEPS)
    for name in RUNS:
        assert suite[0][name]["wire"] == want["server"]
        assert suite[1][name]["wire"] == suite[2][name]["wire"] == want["worker"]


def test_async_server_drops_a_dead_worker_and_goes_on():
    ps = PSConfig("async", staleness=1, worker_timeout_s=2)
    out = launch(comm_ranks.ps_dies, WORLD, args=(TrainRun(CFG, 4, BATCH, SEQ), ps, 1), timeout_s=120, backend="gloo",
                 may_fail=[2])
    server, w1, w2 = out
    assert isinstance(w2, RankFailed) and "SIGKILL" in str(w2)
    assert server["report"]["dropped"] == [2]
    assert any("worker 2 died at step 1" in line and "dropped" in line for line in server["report"]["log"])
    assert len(w1["losses"]) == 4  # the live worker finished every step
    assert _children_of_me() == []


def test_sync_server_stops_with_one_clear_error_when_a_worker_dies():
    ps = PSConfig("sync", worker_timeout_s=2)
    with pytest.raises(RankFailed, match=r"rank 0 failed: RuntimeError: parameter server \(sync\): worker 2 died "
                                         r"at step 1 \(nothing received for 2 s\)"):
        launch(comm_ranks.ps_dies, WORLD, args=(TrainRun(CFG, 4, BATCH, SEQ), ps, 1), timeout_s=120, backend="gloo",
               may_fail=[2])
    assert _children_of_me() == []
