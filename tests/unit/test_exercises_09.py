"""Lesson 09's checks: the reference solutions pass, typical mistakes get a pointed message, blanks fail."""

import importlib.util
import pathlib

from labkit.exercises import lesson09

_spec = importlib.util.spec_from_file_location(
    "sol09", pathlib.Path(__file__).parents[2] / "notebooks" / "solutions" / "lesson09.py")
sol = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sol)


def test_stage_bytes(capsys):
    for stage in range(4):
        assert lesson09.check_stage_bytes(sol.stage_gb(stage=stage), stage=stage) is True
    assert lesson09.check_stage_bytes(round(sol.stage_gb(stage=2), 1)) is True  # 16.6 GB
    assert lesson09.check_stage_bytes(sol.stage_gb(stage=1), stage=2) is False
    assert "ZeRO-1's figure" in capsys.readouterr().out
    assert lesson09.check_stage_bytes(sol.stage_gb(stage=2) * 1e9 / 2**30, stage=2) is False
    assert "GiB" in capsys.readouterr().out
    assert lesson09.check_stage_bytes(None) is False and lesson09.check_stage_bytes("16") is False


def test_zero3_wire_bytes(capsys):
    assert lesson09.check_zero3_wire_bytes(sol.zero3_wire_bytes()) is True
    assert lesson09.check_zero3_wire_bytes(sol.zero3_wire_bytes(2e9, 64, 4), 2e9, 64, 4) is True
    assert lesson09.check_zero3_wire_bytes(2 * 7 / 8 * 2e9) is False
    assert "all-reduce" in capsys.readouterr().out
    assert lesson09.check_zero3_wire_bytes(3 * 2e9) is False
    assert lesson09.check_zero3_wire_bytes(...) is False
