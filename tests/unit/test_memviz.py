"""The ledger's export to PyTorch's memory viewer: the format its code reads, the same bytes as the ledger."""

import pickle
import pickletools

import pytest
import torch
import torch.cuda._memory_viz as memory_viz

from labkit.memory import Category, Ledger
from labkit.memory.memviz import VIZ_CATEGORY, live_series
from labkit.models.gpt import GPTConfig
from labkit.estimate import Recipe
from labkit.run import measure_step

# Opcodes that make objects or reference code; a snapshot is plain data, and protocol 5's out-of-band
# buffers are beyond the viewer's JavaScript unpickler (protocols 2-4).
NOT_PLAIN_DATA = {"GLOBAL", "STACK_GLOBAL", "REDUCE", "BUILD", "INST", "OBJ", "NEWOBJ", "NEWOBJ_EX",
                  "BYTEARRAY8", "NEXT_BUFFER", "READONLY_BUFFER", "PERSID", "BINPERSID", "EXT1", "EXT2", "EXT4"}


@pytest.fixture(scope="module")
def step():
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=64)
    return measure_step(Recipe(cfg, 2, 32), steps=2, seed=0)


def test_the_file_is_protocol_4_plain_data(step, tmp_path):
    path = step.to_memory_viz(tmp_path / "step.pickle")
    raw = path.read_bytes()
    assert raw[:2] == b"\x80\x04"
    used = {op.name for op, _, _ in pickletools.genops(raw)}
    assert not used & NOT_PLAIN_DATA, used & NOT_PLAIN_DATA
    snap = pickle.loads(raw)
    assert snap["segments"] == [] and len(snap["device_traces"]) == 1


def test_the_viewer_draws_the_ledgers_timeline(step, tmp_path):
    snap = pickle.loads(step.to_memory_viz(tmp_path / "s.pickle").read_bytes())
    events = snap["device_traces"][0]
    # the viewer's Active Memory Timeline: alloc adds a block, free_completed removes it
    series = live_series(snap)
    assert series[2:] == step.timeline.total  # after the zero-byte "unknown" marker's alloc and free
    assert max(series) == step.peak.total
    cats = {e["category"] for e in events}
    assert "unknown" in cats and {VIZ_CATEGORY[c] for c in (Category.PARAM, Category.ACT, Category.GRAD,
                                                             Category.OPT, Category.TEMP)} <= cats
    # PyTorch's own readers of the format accept it
    text = memory_viz.trace(snap)
    assert text.splitlines()[:2] == ["Device 0 ----------------", f"{len(events)} entries"]
    html = memory_viz.trace_plot(snap)
    assert "Active Memory Timeline" in html and "snapshot.pickle" in html
    # blocks are named by the op that made them and where in the step
    names = {e["frames"][0]["name"].split()[0] for e in events if e["category"] == "activation"}
    assert "mm" in names or "addmm" in names
    assert any(e["frames"][0]["filename"].startswith("backward") for e in events)


def test_a_storage_resized_in_place_is_a_free_then_a_new_block():
    with Ledger(label="resize") as led:
        w = torch.zeros(1000)
        st = w.untyped_storage()
        st.resize_(0)  # freed as FSDP frees an unsharded parameter
        st.resize_(4000 * 4)  # regrown, larger
        y = torch.ones(10)
    m = led.measurement()
    snap = m.trace.snapshot()
    ev = [(e["action"], e["size"]) for e in snap["device_traces"][0] if e["category"] != "unknown"]
    assert ev == [("alloc", 4000), ("free_requested", 4000), ("free_completed", 4000),
                  ("alloc", 16000), ("alloc", 40)]
    blocks = [e["addr"] for e in snap["device_traces"][0] if e["action"] == "alloc" and e["size"]]
    assert len(set(blocks)) == len(blocks)  # no address reused while... ever
    assert live_series(snap)[2:] == m.timeline.total
    del y


def test_a_device_index_and_bad_use(step, tmp_path):
    snap = pickle.loads(step.to_memory_viz(tmp_path / "d.pickle", device=1).read_bytes())
    assert snap["device_traces"][0] == [] and snap["device_traces"][1]
    from labkit.memory import Measurement

    bare = Measurement("no trace", step.phases, step.timeline, step.baseline)
    with pytest.raises(ValueError, match="no event trace"):
        bare.to_memory_viz(tmp_path / "x.pickle")
    assert step.of_step(2).trace is step.trace
