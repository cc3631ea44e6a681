"""bench/lesson_times.py: a profile is measured only on a machine that runs it, and each entry says which
machine it came from (lesson 00 prints them per profile). No time is asserted on: the bench prints them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("lesson_times", ROOT / "bench" / "lesson_times.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_gpu_profile_is_refused_on_a_machine_without_one(bench, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the cpu profile is the one it may not measure")
    with pytest.raises(SystemExit) as e:
        bench.main(["--profile", "small-gpu", "--lessons", "00"])
    assert e.value.code == 2
    assert "this machine runs the lessons at profile 'cpu', not 'small-gpu'" in capsys.readouterr().err


def test_unknown_lessons_and_bad_timeouts_are_refused(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--profile", "smoke", "--lessons", "99"])
    assert "no notebook for lesson(s) 99" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--profile", "smoke", "--timeout", "0"])
    assert "--timeout must be a positive" in capsys.readouterr().err


def test_machine_names_the_cpu_and_any_gpu(bench):
    m = bench.machine()
    assert m["cores"] == __import__("os").cpu_count() and m["cpu"]
    assert ("gpu" in m) == torch.cuda.is_available()


def test_the_stored_file_covers_real_lessons_at_known_profiles(bench):
    data = json.loads((ROOT / "data" / "lesson_times.json").read_text())
    notebooks = {p.name[:2]: p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")}
    for lesson, entry in data["lessons"].items():
        assert entry["notebook"] == notebooks[lesson]
        assert set(entry) - {"notebook"} <= set(bench.PROFILES), entry.keys()
