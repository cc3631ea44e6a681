"""Where a lesson's exercises are: the cells after its "## Exercises" heading, the answers a learner fills in
(names first assigned None or `...`, or a function the learner defines), and the calls of its checks
(`lessonNN.check_*(...)` statements). The release builds read lessons only through this module."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

HEADING = re.compile(r"^## Exercises\s*$", re.M)
CHECK_MODULE = re.compile(r"^lesson\d\d$")


@dataclass(frozen=True)
class CheckCall:
    cell: int  # index of the code cell in the notebook
    node: ast.Expr  # the statement `lessonNN.check_x(...)`
    module: str  # "lesson09"
    check: str  # "check_zero3_wire_bytes"


def exercise_start(nb) -> int | None:
    """Index of the markdown cell with the "## Exercises" heading (None: the lesson has no exercises)."""
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown" and HEADING.search(cell.source):
            return i
    return None


def parse(source: str) -> ast.Module | None:
    try:
        return ast.parse(source)
    except SyntaxError:  # a cell with IPython magics: never an exercise cell here
        return None


def check_of(stmt: ast.stmt) -> tuple[str, str] | None:
    """("lesson09", "check_x") when the statement is a call of a lesson's check, else None."""
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        f = stmt.value.func
        if (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and CHECK_MODULE.match(f.value.id)
                and f.attr.startswith("check_")):
            return f.value.id, f.attr
    return None


def check_calls(nb) -> list[CheckCall]:
    start = exercise_start(nb)
    out = []
    for i, cell in enumerate(nb.cells):
        if start is None or i <= start or cell.cell_type != "code":
            continue
        tree = parse(cell.source)
        for stmt in tree.body if tree else []:
            found = check_of(stmt)
            if found:
                out.append(CheckCall(i, stmt, *found))
    return out


def _placeholder(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and (node.value is None or node.value is Ellipsis)


def answer_names(nb) -> set[str]:
    """Names the learner fills in: assigned None / `...` in the exercise cells, or functions defined there."""
    start = exercise_start(nb)
    names: set[str] = set()
    for cell in nb.cells[start + 1:] if start is not None else []:
        tree = parse(cell.source) if cell.cell_type == "code" else None
        for stmt in tree.body if tree else []:
            if isinstance(stmt, ast.Assign) and _placeholder(stmt.value):
                names |= {t.id for t in stmt.targets if isinstance(t, ast.Name)}
            elif isinstance(stmt, ast.FunctionDef):
                names.add(stmt.name)
    return names
