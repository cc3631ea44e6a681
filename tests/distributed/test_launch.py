"""labkit.distributed.launch: results come back per rank; a failing rank is one clear error, never a hang."""

import os
import signal

import pytest
import torch

import rank_fns
from labkit.distributed import RankFailed, free_port, launch
from labkit.distributed.comms import wire_bytes


def _children_of_me() -> list[int]:
    """PIDs of live ranks this test process left behind: its children, and the children of its forkserver
    (labkit.distributed.procs: ranks are forked from it, so they are its children, not this process's)."""
    procs = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    procs[int(d)] = (int(fields[1]), fields[0], f.read())
            except OSError:
                continue
    live = {pid: (ppid, cmd) for pid, (ppid, state, cmd) in procs.items() if state != "Z"}
    mine = [pid for pid, (ppid, _) in live.items() if ppid == os.getpid()]
    servers = [pid for pid in mine if b"multiprocessing.forkserver" in live[pid][1]]
    # multiprocessing's shared helpers are not ranks: its resource tracker, the forkserver itself
    kids = [pid for pid in mine if pid not in servers and b"resource_tracker" not in live[pid][1]]
    return kids + [pid for pid, (ppid, _) in live.items() if ppid in servers]


def test_two_ranks_all_reduce_and_environment():
    out = launch(rank_fns.sum_of_ranks, world_size=2, timeout_s=30)
    assert [o["rank"] for o in out] == [0, 1]
    assert all(o["sum"] == 3.0 for o in out)  # 1 + 2
    assert all(o["threads"] == 1 for o in out)
    assert all(o["debug"] == "DETAIL" for o in out)
    # one all-reduce of 4 bytes on 2 ranks: 2 (N-1)/N S = 4 bytes sent by each rank
    assert all(o["calls"] == {"all_reduce": {"calls": 1, "payload_bytes": 4, "wire_bytes": 4.0}} for o in out)
    assert _children_of_me() == []


@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_deliver_their_definition(world_size):
    n = 3
    outs = launch(rank_fns.collectives, world_size=world_size, args=(n,), timeout_s=30)
    N = world_size
    expect_full = torch.cat([torch.arange(n, dtype=torch.float32) + 100 * r for r in range(N)])
    total = sum(r + 1 for r in range(N))
    for r, (full, scattered, b, m, summary) in enumerate(outs):
        assert torch.equal(full, expect_full)
        assert torch.equal(scattered, torch.arange(r * n, (r + 1) * n, dtype=torch.float32) * total)
        assert torch.equal(b, torch.full((3,), float(N - 1)))
        assert m.item() == sum(range(N)) / N
        S = n * N * 4
        assert summary["all_gather"]["wire_bytes"] == (N - 1) / N * S
        assert summary["reduce_scatter"]["wire_bytes"] == (N - 1) / N * S
        assert summary["broadcast"]["wire_bytes"] == (N - 1) / N * 12
        assert summary["all_reduce"]["wire_bytes"] == 2 * (N - 1) / N * 4


def test_a_rank_that_raises_names_the_rank_and_its_message():
    with pytest.raises(RankFailed, match=r"rank 1 failed: ValueError: rank one is unhappy") as e:
        launch(rank_fns.raises_on_rank_1, world_size=2, timeout_s=20)
    assert e.value.rank == 1 and "raises_on_rank_1" in e.value.traceback_text
    assert _children_of_me() == []


def test_a_killed_rank_is_named_with_its_signal():
    with pytest.raises(RankFailed, match=r"rank 1 failed: killed by SIGKILL"):
        launch(rank_fns.dies_on_rank_1, world_size=2, timeout_s=20)
    assert _children_of_me() == []


def test_a_mismatched_collective_is_a_readable_error():
    with pytest.raises(RankFailed, match=r"mismatch between collectives"):
        launch(rank_fns.mismatched_all_reduce, world_size=2, timeout_s=20)
    assert _children_of_me() == []


def test_a_run_past_its_timeout_is_stopped():
    # 8 s, not 1: the limit must outlast gloo's set-up on a loaded machine, or a rank killed while still
    # connecting makes the other one report "connectFullMesh failed" first (seen in fresh-clone CI)
    with pytest.raises(RankFailed, match=r"timed out after 8 s; ranks \[0\] had not finished"):
        launch(rank_fns.sleeps_on_rank_0, world_size=2, args=(600,), timeout_s=8)
    assert _children_of_me() == []


def test_functions_a_child_cannot_import_are_refused_with_where_to_put_them():
    with pytest.raises(ValueError, match="lambda or a nested function.*top level of a .py module"):
        launch(lambda rank, ws: rank, world_size=2)

    def nested(rank, ws):
        return rank

    with pytest.raises(ValueError, match="nested function"):
        launch(nested, world_size=2)


def test_a_notebook_function_is_refused(monkeypatch):
    import sys
    import types

    fake_main = types.ModuleType("__main__")  # what a Jupyter kernel's __main__ looks like: no __file__
    monkeypatch.setitem(sys.modules, "__main__", fake_main)

    def cell_fn(rank, ws):
        return rank

    cell_fn.__module__, cell_fn.__qualname__ = "__main__", "cell_fn"
    with pytest.raises(ValueError, match="defined in this notebook"):
        launch(cell_fn, world_size=2)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_world_size(bad):
    with pytest.raises(ValueError, match="world_size must be an integer >= 1"):
        launch(rank_fns.pid, world_size=bad)


def test_bad_timeout_and_backend():
    with pytest.raises(ValueError, match="timeout_s"):
        launch(rank_fns.pid, world_size=1, timeout_s=0)
    with pytest.raises(ValueError, match="backend"):
        launch(rank_fns.pid, world_size=1, backend="mpi")


def test_one_rank_runs_and_ports_differ():
    assert launch(rank_fns.pid, world_size=1, timeout_s=20)[0] != os.getpid()
    assert free_port() > 0


def test_wire_bytes_definitions_and_bad_input():
    assert wire_bytes("all_reduce", 1000, 4) == 1500
    assert wire_bytes("all_gather", 1000, 4) == 750
    assert wire_bytes("reduce_scatter", 1000, 1) == 0
    assert wire_bytes("send", 10, 2) == 10 and wire_bytes("recv", 10, 2) == 0
    with pytest.raises(ValueError, match="unknown collective"):
        wire_bytes("all_to_all", 1, 2)
    with pytest.raises(ValueError, match="world_size"):
        wire_bytes("all_reduce", 1, 0)
