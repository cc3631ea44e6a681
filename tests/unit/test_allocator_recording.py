"""labkit.memory.allocator on CPU: the 512-byte block arithmetic, the rounding term of a ledger trace, the churn
workload's ops, and reading and rendering a recording. The recording used here is a TEST FIXTURE built from the
format's SPEC by `fixture_recording` (its numbers are chosen by this file, not measured on any GPU)."""

from __future__ import annotations

import json

import pytest

from labkit.memory import allocator as al


def test_block_bytes_rounds_up_to_512():
    assert [al.block_bytes(n) for n in (0, 1, 511, 512, 513, 1024, 1025)] == [512, 512, 512, 512, 1024, 1024, 1536]
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="non-negative"):
            al.block_bytes(bad)


def test_rounded_peak_of_a_trace():
    # storage 0: 100 B; storage 1: 1000 B, then grown by 24 B in place; storage 0 freed; storage 2: 600 B
    events = [(0, 100), (1, 1000), (1, 24), (0, -100), (2, 600)]
    logical, blocks = al.rounded_peak(events)
    assert logical == max(100, 1100, 1124, 1024, 1624) == 1624
    assert blocks == max(512, 512 + 1024, 512 + 1024, 1024, 1024 + 1024) == 2048


def test_churn_ops_free_only_what_is_live():
    ops = al.churn_sizes(200, seed=1)
    assert ops == al.churn_sizes(200, seed=1)
    live, n = set(), 0
    for op, arg in ops:
        if op == "alloc":
            assert 64 * 1024 <= arg <= 48 * 2**20
            live.add(n)
            n += 1
        else:
            assert arg in live
            live.remove(arg)
        assert len(live) <= 9
    assert n == 200
    with pytest.raises(ValueError):
        al.churn_sizes(0)


def fixture_recording() -> dict:
    """A TEST FIXTURE with every SPEC key (values chosen here, not measured)."""
    rec = {
        "format": al.FORMAT,
        "device": {"name": "TEST FIXTURE GPU (not a measurement)", "total_bytes": 16 * 2**30, "capability": [7, 5]},
        "versions": {"torch": "0.0-fixture", "cuda": "0.0-fixture"},
        "recorded": {"date": "2000-01-01", "commit": "fixture"},
        "context_bytes": 300 * 2**20,
        "rounding": [{"request": 1, "block": 512}, {"request": 513, "block": 1024},
                     {"request": 2**20 + 1, "block": 2 * 2**20}],
        "workspaces": {"cublas_fp32": 8 * 2**20},
        "churn": {"default": {"allocated": [0, 100, 50], "reserved": [2 * 2**20, 2 * 2**20, 4 * 2**20], "conf": ""},
                  "expandable_segments": {"allocated": [0, 100, 50], "reserved": [100, 200, 200],
                                          "conf": "expandable_segments:True"}},
    }
    assert set(rec) == set(al.SPEC)
    return rec


def test_a_recording_is_checked_and_read(tmp_path):
    rec = fixture_recording()
    assert al.check_recording(rec) is rec
    assert al.load_recording(tmp_path) == (None, tmp_path / al.RECORDING_FILE)
    (tmp_path / "gpu_check").mkdir()
    (tmp_path / "gpu_check" / al.RECORDING_FILE).write_text(json.dumps(rec))
    got, path = al.load_recording(tmp_path)
    assert got == rec and path == tmp_path / "gpu_check" / al.RECORDING_FILE
    (tmp_path / al.RECORDING_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        al.load_recording(tmp_path)


@pytest.mark.parametrize("change, message", [
    (lambda r: r.pop("churn"), "lacks churn"),
    (lambda r: r.update(format="other/9"), "format"),
    (lambda r: r.update(context_bytes=-1), "context_bytes"),
    (lambda r: r["rounding"].append({"request": 1}), "rounding row"),
    (lambda r: r["churn"]["default"].update(reserved=[1]), "same, non-zero length"),
])
def test_a_malformed_recording_is_refused(change, message):
    rec = fixture_recording()
    change(rec)
    with pytest.raises(ValueError, match=message):
        al.check_recording(rec)


def test_rendering_says_it_is_a_recording_and_from_which_device():
    rec = fixture_recording()
    lines = al.describe_recording(rec, live=False)
    assert lines[0].startswith("a RECORDING, not this machine") and "TEST FIXTURE GPU" in lines[0]
    assert "2000-01-01" in lines[0] and "0.0-fixture" in lines[0]
    text = "\n".join(lines)
    assert "300.00 MiB" in text  # the context, formatted from the recording
    gap = al.rounding_gap(rec)
    assert [g["gap"] for g in gap] == [0, 0, 2 * 2**20 - (2**20 + 512)]
    assert "block left unsplit" in text
    s = al.churn_summary(rec["churn"]["default"])
    assert s == {"peak_allocated": 100, "peak_reserved": 4 * 2**20, "unused_share": 1 - 100 / (4 * 2**20)}
    assert f"{s['unused_share']:.1%}" in text
    assert al.describe_recording(rec, live=True)[0].startswith("measured on this machine's TEST FIXTURE GPU")
