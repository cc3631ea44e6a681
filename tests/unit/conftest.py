"""Fixtures the exercise tests (test_exercises*.py) share.

- sol00 ... sol08: the reference solutions, notebooks/solutions/lessonNN.py, loaded as a module
  (once per test module that asks for one).
- blank: each answer a learner leaves unanswered (None, or the notebooks' `...`).
- says(mark, *words): asserts that what the check printed has `mark` and every word; returns it.
- one_thread: torch on one thread for the test; modules opt in with
  `pytestmark = pytest.mark.usefixtures("one_thread")` (not autouse: the other unit tests keep torch's default).
"""

import importlib.util
from pathlib import Path

import pytest
import torch

SOLUTIONS = Path(__file__).resolve().parents[2] / "notebooks" / "solutions"


def load_solutions(lesson: int):
    """notebooks/solutions/lessonNN.py as a fresh module."""
    name = f"lesson{lesson:02d}"
    spec = importlib.util.spec_from_file_location(f"solutions_{name}", SOLUTIONS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _solutions_fixture(lesson: int):
    @pytest.fixture(scope="module", name=f"sol{lesson:02d}")
    def solutions():
        return load_solutions(lesson)

    solutions.__doc__ = f"notebooks/solutions/lesson{lesson:02d}.py as a module."
    return solutions


for _lesson in range(9):
    globals()[f"sol{_lesson:02d}"] = _solutions_fixture(_lesson)


@pytest.fixture(params=[None, ...])
def blank(request):
    """An exercise left unanswered: None, or the `...` the notebooks start with."""
    return request.param


@pytest.fixture
def says(capsys):
    def check(mark: str, *words: str) -> str:
        out = capsys.readouterr().out
        assert mark in out, out
        for word in words:
            assert word in out, out
        return out

    return check


@pytest.fixture
def one_thread():
    """Tiny CPU steps run faster on one thread (and far faster on a loaded 2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
