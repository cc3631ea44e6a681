"""The lessons as data: number, title, notebook and prerequisites, read from the notebooks themselves.

Prerequisite rule: lesson B needs lesson A (A before B) when B's code imports a labkit package that A is the
first lesson to import (`labkit.recompute`, `labkit.distributed`, ...: the package under labkit, not its
modules; `labkit.exercises` and `labkit.session` are every lesson's own and do not count). Only the direct
prerequisites are kept: A is dropped when another prerequisite of B already needs A.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from pathlib import Path

from labkit.paths import REPO_ROOT

NOT_A_TOPIC = {"exercises", "session", "colab", "paths"}


@dataclass(frozen=True)
class Lesson:
    number: str  # "03"
    title: str  # "Activation checkpointing"
    notebook: str  # "03_activation_checkpointing.ipynb"
    uses: frozenset[str]  # labkit packages its code imports ("recompute", ...)


def _packages(source: str) -> set[str]:
    lines = [("pass" if line.lstrip().startswith(("%", "!")) else line) for line in source.splitlines()]
    try:
        tree = ast.parse("\n".join(lines))  # IPython magics and shell lines read as `pass`
    except SyntaxError:
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module == "labkit" and not node.level:
            names |= {f"labkit.{a.name}" for a in node.names}  # from labkit import distributed
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return {n.split(".")[1] for n in names if n.startswith("labkit.")} - NOT_A_TOPIC


def read_lessons(root: Path = REPO_ROOT) -> list[Lesson]:
    out = []
    for path in sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        heading = "".join(cells[0]["source"]).splitlines()[0]
        title = heading.lstrip("# ").split("·", 1)[-1].strip()
        uses = set().union(*(_packages("".join(c["source"])) for c in cells if c["cell_type"] == "code"))
        out.append(Lesson(path.name[:2], title, path.name, frozenset(uses)))
    return out


def prerequisites(lessons: list[Lesson]) -> dict[str, tuple[str, ...]]:
    """{lesson: its direct prerequisites}, by the rule in this module's docstring."""
    first: dict[str, str] = {}
    for lesson in lessons:
        for package in sorted(lesson.uses):
            first.setdefault(package, lesson.number)
    needs = {l.number: {first[p] for p in l.uses if first[p] != l.number} for l in lessons}

    return {n: tuple(sorted(a for a in direct if not any(a in reachable(needs, b) for b in direct if b != a)))
            for n, direct in needs.items()}


def reachable(graph: dict, start) -> set:
    """Every node reachable from `start` along `graph`'s edges ({node: its successors}), `start` itself excluded
    unless a cycle leads back to it."""
    out, todo = set(), list(graph[start])
    while todo:
        m = todo.pop()
        if m not in out:
            out.add(m)
            todo.extend(graph[m])
    return out
