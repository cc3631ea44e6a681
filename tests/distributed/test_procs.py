"""labkit.distributed.procs: children forked from a server with torch imported see what a spawned child would
see: the parent's environment now (set, changed or removed after the server started, and before the child
imports the caller's modules), and they are spawned instead when what an interpreter reads at start differs."""

import os

from env_at_import import environment_seen  # read again by each child, when it unpickles the function
from labkit.distributed import launch, procs
from labkit.distributed.simulate import fsdp2_rank_memory

NAMES = ["LABKIT_TEST_SET", "LABKIT_TEST_GONE", "LABKIT_TEST_AT_IMPORT"]


def test_children_see_the_parents_environment_of_now(monkeypatch):
    monkeypatch.setenv("LABKIT_TEST_GONE", "here")
    first = launch(environment_seen, 2, args=(NAMES,), timeout_s=60)  # the server may start here
    assert all(r["env"]["LABKIT_TEST_GONE"] == "here" for r in first)
    monkeypatch.setenv("LABKIT_TEST_SET", "after the server started")
    monkeypatch.setenv("LABKIT_TEST_AT_IMPORT", "read at import")
    monkeypatch.delenv("LABKIT_TEST_GONE")
    out = launch(environment_seen, 2, args=(NAMES,), timeout_s=60)
    for r in out:
        assert r["env"] == {"LABKIT_TEST_SET": "after the server started", "LABKIT_TEST_GONE": None,
                            "LABKIT_TEST_AT_IMPORT": "read at import"}
        assert r["at_import"] == "read at import"  # the module was imported after the environment was set
    if "forkserver" in procs.mp.get_all_start_methods() and os.environ.get("LABKIT_START_METHOD") != "spawn":
        assert {r["method"] for r in out} == {"forkserver"}


def test_a_child_is_spawned_when_the_start_up_state_differs(monkeypatch):
    launch(environment_seen, 2, args=(NAMES,), timeout_s=60)  # the server has started by now
    monkeypatch.setenv("PYTHONWARNINGS", "error")  # read when an interpreter starts: the server's is older
    out = launch(environment_seen, 2, args=(NAMES,), timeout_s=60)
    assert {r["method"] for r in out} == {"spawn"}
    assert all(r["warnoptions"] == ["error"] for r in out)  # what a fresh interpreter read from it
    monkeypatch.delenv("PYTHONWARNINGS")
    monkeypatch.setenv("LABKIT_START_METHOD", "spawn")
    assert {r["method"] for r in launch(environment_seen, 2, args=(NAMES,), timeout_s=60)} == {"spawn"}


def test_one_child_reports_its_error():
    import pytest

    with pytest.raises(RuntimeError, match="fsdp2_rank_memory at world 2: .*"):
        fsdp2_rank_memory(dict(vocab_size=16, block_size=8, n_layer=1, n_head=3, n_embd=8), 2, 1, 8)
