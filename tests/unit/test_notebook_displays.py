"""No cell of a lesson shows a stray bool, and none throws away a table it meant to show.

Jupyter displays the value of a cell's last statement when it is an expression not ended by ';'. A check
function that prints its feedback and returns True or False (`show_guess`, the exercises' `check_*`) leaves
a bare `False` under the feedback when it is the last line; a table object (`breakdown_table`) on any other
line is computed and never shown.

Why a static check and not the outputs of a run: running the 14 lessons takes minutes, and their outputs vary
with the device. What decides the display is the cell's code: its last statement, whether a ';' ends it, and
what the called function returns. The test reads each code cell with `ast`, resolves each called name through
the notebook's own imports (`from labkit.exercises import show_guess`, `lesson01.check_x`) to the real
function, and reads its return annotation: `bool` (or a comparison, `and`/`or`/`not`) as the last, displayed
value fails; a call returning an object with `_repr_html_` as an earlier statement fails too (its value is
discarded). A method of an object the notebook made is not resolved, so the test also checks that it does
resolve the calls it must (every `show_guess` and `check_*` call), and that it flags the cases it exists for.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import io
import json
import tokenize
import typing
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


def code_cells(path: Path) -> list[tuple[int, str]]:
    """(index, source) of each code cell, IPython's magics and shell lines blanked (they are not Python)."""
    cells = json.loads(path.read_text())["cells"]
    return [(i, python_of("".join(c["source"]))) for i, c in enumerate(cells) if c["cell_type"] == "code"]


def python_of(src: str) -> str:
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in src.splitlines())


def imports(cells: list[tuple[int, str]]) -> dict[str, str]:
    """name -> dotted path, from every import statement of the notebook."""
    names = {}
    for _, src in cells:
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Import):
                for a in node.names:
                    names[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def dotted(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def resolve(path: str):
    """The object a dotted path names (a module's attribute, or a submodule), or None."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for p in parts[cut:]:
                obj = getattr(obj, p) if hasattr(obj, p) else importlib.import_module(f"{obj.__name__}.{p}")
        except (ImportError, AttributeError):
            return None
        return obj
    return None


def returns(func):
    """The return annotation of a function, evaluated where it can be (else its text); None if it has none."""
    if not callable(func):
        return None
    try:
        return typing.get_type_hints(func).get("return")
    except Exception:  # an annotation that names something only imported for type checking
        try:
            ann = inspect.signature(func).return_annotation
        except (TypeError, ValueError):
            return None
        return None if ann is inspect.Signature.empty else ann


def called(expr, names: dict[str, str]):
    """(the dotted name, the function) of a call whose callee the notebook's imports resolve, else None."""
    if not isinstance(expr, ast.Call):
        return None
    name = dotted(expr.func)
    if name is None or name.split(".")[0] not in names:
        return None
    head, _, rest = name.partition(".")
    func = resolve(names[head] + (f".{rest}" if rest else ""))
    return None if func is None else (name, func)


def ends_with_semicolon(src: str) -> bool:
    toks = [t for t in tokenize.generate_tokens(io.StringIO(src).readline)
            if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.ENDMARKER,
                              tokenize.INDENT, tokenize.DEDENT)]
    return bool(toks) and toks[-1].string == ";"


def is_bool(ann) -> bool:
    return ann is bool or ann == "bool"


def lost_display(call: ast.Call, ann) -> bool:
    """A value Jupyter would show only as the last line: an object with an HTML form. A matplotlib figure drawn
    on `ax=` (a pyplot figure, shown at the cell's end by the inline backend) is not lost."""
    from matplotlib.figure import Figure

    if not (inspect.isclass(ann) and hasattr(ann, "_repr_html_")):
        return False
    return not (issubclass(ann, Figure) and any(k.arg == "ax" for k in call.keywords))


def findings(cells: list[tuple[int, str]], resolved: list | None = None) -> list[str]:
    """What a cell displays by mistake (a bare bool) or computes and never shows (an HTML table)."""
    names, out = imports(cells), []
    for i, src in cells:
        body = ast.parse(src).body
        if not body:
            continue
        last = body[-1]
        hit = isinstance(last, ast.Expr) and called(last.value, names)
        if resolved is not None and hit:
            resolved.append(hit[0])
        if isinstance(last, ast.Expr) and not ends_with_semicolon(src):
            v = last.value
            if (isinstance(v, (ast.Compare, ast.BoolOp)) or (isinstance(v, ast.UnaryOp) and isinstance(v.op, ast.Not))
                    or (isinstance(v, ast.Constant) and isinstance(v.value, bool))):
                out.append(f"cell {i}: its last line is a True/False expression, shown as a bare bool")
            elif hit and is_bool(returns(hit[1])):
                out.append(f"cell {i}: {hit[0]}(...) returns a bool, shown under its feedback: end it with ';'")
        for stmt in body[:-1]:
            hit = isinstance(stmt, ast.Expr) and called(stmt.value, names)
            if resolved is not None and hit:
                resolved.append(hit[0])
            if hit and lost_display(stmt.value, returns(hit[1])):
                out.append(f"cell {i}: {hit[0]}(...) makes a table that is never shown (not the last line): "
                           "display() it")
    return out


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_no_cell_shows_a_bare_bool_or_drops_a_table(path):
    resolved = []
    cells = code_cells(path)
    assert not findings(cells, resolved), f"{path.name}:\n" + "\n".join(findings(cells))
    # the resolver must see the calls it exists for: every show_guess and check_* call on a cell's last line
    wanted = [dotted(ast.parse(src).body[-1].value.func) for _, src in cells
              if ast.parse(src).body and isinstance(ast.parse(src).body[-1], ast.Expr)
              and isinstance(ast.parse(src).body[-1].value, ast.Call)
              and (dotted(ast.parse(src).body[-1].value.func) or "").rpartition(".")[2].startswith(
                  ("check_", "show_guess"))]
    assert set(wanted) <= set(resolved), f"not resolved: {set(wanted) - set(resolved)}"


def test_the_check_catches_what_it_exists_for():
    """The cases of issue 38: a show_guess or a check as a cell's last line, a breakdown_table before it."""
    head = (0, "from labkit.exercises import show_guess, lesson01\nfrom labkit.viz import plots")
    bad = [head, (1, 'show_guess("peak", None, 1.0)'), (2, "lesson01.check_why_peak(None)  # comment"),
           (3, "t = plots.breakdown_table(est)\nplots.breakdown_table(meas)\nshow_guess('x', 1, 1.0);"),
           (4, "x == 1")]
    found = findings([(i, python_of(src)) for i, src in bad])
    assert [f.split(":")[0] for f in found] == ["cell 1", "cell 2", "cell 3", "cell 4"], found
    good = [head, (1, 'show_guess("peak", None, 1.0);'), (2, "lesson01.check_why_peak(None);  # comment"),
            (3, "show_guess('x', 1, 1.0)\nplots.breakdown_table(meas)"), (4, "%time x = 1\nx")]
    assert findings([(i, python_of(src)) for i, src in good]) == []
