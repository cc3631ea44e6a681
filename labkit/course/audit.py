"""The leak audit (issue 41): play the student who reads the code instead of doing the exercise.

For every exercise of every lesson (each `lessonNN.check_*(...)` call after "## Exercises"), with the
lesson's own inputs rebuilt from its cells (only the statements that define them: `lesson_inputs`),
it tries

- every public function of the exercise modules (`labkit.exercises.lessonNN`, all of them) called
  with the check's inputs: in the student build each one is a stub that raises NotImplementedError;
- every labkit function the lesson itself calls or imports (`named_calls`), called with the check's
  inputs, every number its result holds (a dataclass's fields, a list's items, a property such as
  `.peak.total`) offered as the answer; for a code exercise the function itself is offered;
- for a multiple-choice check, a letter read from the check's source (`right="b"`, or the one letter
  its hints leave out).

An answer counts as obtained when the check prints a ✅ it did not print for an empty answer.
`audit()` returns what it obtained, each with how (`Leak.call`); run it against the student build
(release/student on PYTHONPATH, `python -m labkit.course.audit`) and compare with release/LEAKS.md.
Sizes: the smoke profile (LABKIT_SMOKE=1), so the lessons' objects are small.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import inspect
import io
import json
import numbers
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .exercises import answer_names, check_calls, exercise_start, parse

CHOICE = re.compile(r"""right\s*=\s*["']([a-z])["']""")
SYNONYMS = {"model": ("config", "cfg", "spec"), "config": ("model", "cfg", "spec"), "cfg": ("config", "model"),
            "n": ("n_params",), "n_params": ("n",), "world": ("ranks", "world_size"), "ranks": ("world",)}
MAX_NUMBERS = 300  # numbers taken from one result


@dataclass(frozen=True)
class Leak:
    lesson: str  # "05"
    exercise: str  # "adam8bit_state_bytes", "adam8bit_state_bytes_2" (grade ids); "#1", "#2": a check's answers
    call: str  # how the answer was obtained, e.g. "labkit.optim.adam8bit.state_bytes_for(shape=(1000, 1000))"

    def key(self) -> str:
        return f"{self.lesson} {self.exercise}"


# What the student build still gives away: (lesson, exercise) -> the call that gives it and why it
# stays. The release writes them to release/LEAKS.md for the instructor;
# tests/unit/test_course_audit.py fails on any leak the audit finds that is not here, and on an
# entry here that the audit no longer finds.
_OPTIM = ("the estimator's optimizer terms call it (labkit.estimate), so the student build cannot stub it; "
          "open: ask for the derivation as a function checked on fresh shapes (issue 41, item 3)")
LEAKS: dict[tuple[str, str], tuple[str, str]] = {
    ("05", "adam8bit_state_bytes"): ("labkit.optim.adam8bit.state_bytes_for((1000, 1000))", _OPTIM),
    ("05", "adam8bit_state_bytes_2"): ("labkit.optim.adam8bit.state_bytes_for((1000,))", _OPTIM),
    ("05", "adafactor_state_bytes"): ("labkit.optim.adafactor.state_bytes_for((4096, 11008))", _OPTIM),
    ("11", "dgc_bytes"): ("labkit.distributed.compression.dgc_wire_bytes, offered as the function",
                          "the library function the exercise asks to rewrite; open: stub it in the student build "
                          "if lesson 11's later cells can do without it (issue 41, item 3)"),
}


def leaks_markdown() -> str:
    lines = ["# What the student build still gives away (labkit/course/audit.py: LEAKS)", "",
             "Each exercise below can be answered from the student build without doing it, by the call named; "
             "the leak audit (tests/unit/test_course_audit.py) finds no other.", ""]
    for (lesson, exercise), (call, why) in sorted(LEAKS.items()):
        lines.append(f"- lesson {lesson}, `{exercise}`: `{call}`. {why}")
    return "\n".join(lines + ([] if LEAKS else ["(none)"])) + "\n"


# ---- the lesson's own inputs
# --------------------------------------------------------------------------------
def _bound(stmt: ast.stmt) -> set[str]:
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in stmt.names}
    if isinstance(stmt, (ast.FunctionDef, ast.ClassDef)):
        return {stmt.name}
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(
        stmt, ast.AnnAssign) else []
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}


def _used(stmt: ast.stmt) -> set[str]:
    return {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _parse(cell) -> ast.Module | None:
    """A code cell's statements, its IPython lines (`!pip ...`, `%matplotlib ...`) read as `pass`."""
    if cell.cell_type != "code":
        return None
    lines = [re.sub(r"^(\s*)[!%].*$", r"\1pass", line) for line in cell.source.splitlines()]
    return parse("\n".join(lines))


def lesson_inputs(nb, names: set[str], upto: int) -> dict:
    """The namespace in which `names` hold what the lesson's cells before cell `upto` assign them: only the
    top-level imports, definitions and assignments they depend on are run (a slice, not the lesson)."""
    stmts = []
    for cell in nb.cells[:upto]:
        tree = _parse(cell)
        for stmt in tree.body if tree else []:
            if isinstance(stmt, (ast.Import, ast.ImportFrom, ast.Assign, ast.AnnAssign, ast.FunctionDef,
                                 ast.ClassDef)):
                stmts.append(stmt)
    need, keep = set(names), []
    for stmt in reversed(stmts):
        if _bound(stmt) & need:
            keep.append(stmt)
            need = (need - _bound(stmt)) | _used(stmt)
    ns: dict = {}
    with contextlib.redirect_stdout(io.StringIO()):
        for stmt in reversed(keep):
            exec(compile(ast.Module([stmt], []), "<lesson>", "exec"), ns)
    return ns


def named_calls(nb, ns: dict) -> dict[str, object]:
    """{dotted name: labkit function} for every labkit function the lesson calls or imports by name."""
    found: dict[str, object] = {}
    ns = dict(ns)
    for cell in nb.cells:  # the lesson's imports, so that `adam8bit.state_bytes_for` resolves
        tree = _parse(cell)
        for stmt in tree.body if tree else []:
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                with contextlib.suppress(Exception):
                    exec(compile(ast.Module([stmt], []), "<lesson>", "exec"), ns)
    for cell in nb.cells:
        tree = _parse(cell)
        for node in ast.walk(tree) if tree else []:
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("labkit"):
                with contextlib.suppress(Exception):
                    mod = importlib.import_module(node.module)
                    for a in node.names:
                        found[f"{node.module}.{a.name}"] = getattr(mod, a.name)
            elif isinstance(node, ast.Call):
                with contextlib.suppress(Exception):
                    text = ast.unparse(node.func)
                    if re.fullmatch(r"[A-Za-z_][\w.]*", text):
                        found[text] = eval(text, dict(ns))  # noqa: S307 - a dotted name of the lesson's
    for cell in nb.cells:  # dotted names the prose or the code spells out: labkit.optim.adam8bit.state_bytes_for
        for dotted in re.findall(r"\blabkit(?:\.\w+)+", cell.source):
            parts = dotted.split(".")
            for cut in range(len(parts) - 1, 0, -1):
                with contextlib.suppress(Exception):
                    obj = importlib.import_module(".".join(parts[:cut]))
                    for attr in parts[cut:]:
                        obj = getattr(obj, attr)
                    found[dotted] = obj
                    break
    out = {}
    for name, obj in found.items():
        mod = getattr(obj, "__module__", "") or ""
        if (callable(obj) and not inspect.isclass(obj) and mod.startswith("labkit.")
                and not mod.startswith(("labkit.exercises", "labkit.course", "labkit.viz"))):
            out[f"{mod}.{getattr(obj, '__qualname__', name)}"] = obj
    return out


# ---- trying a function
# --------------------------------------------------------------------------------------
def _calls(fn, inputs: dict, positional: list):
    """Ways to call `fn` with the check's inputs: by parameter name (with synonyms), and positionally."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return
    kwargs, missing = {}, False
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        names = (p.name, *SYNONYMS.get(p.name, ()))
        hit = next((n for n in names if n in inputs), None)
        if hit is not None:
            kwargs[p.name] = inputs[hit]
        elif p.default is p.empty:
            missing = True
    if not missing:
        yield kwargs, f"{', '.join(f'{k}={_short(v)}' for k, v in kwargs.items())}", (), kwargs
    if positional:
        yield None, ", ".join(_short(v) for v in positional), tuple(positional), {}


def _short(v) -> str:
    text = repr(v) if isinstance(v, (numbers.Number, str, tuple, list)) else type(v).__name__
    return text if len(text) < 40 else text[:37] + "..."


def numbers_in(obj, depth: int = 3, out: list | None = None) -> list[float]:
    """Every number a result holds, a few levels down (fields, items, properties)."""
    out = [] if out is None else out
    if len(out) >= MAX_NUMBERS:
        return out
    if isinstance(obj, bool):
        return out
    if isinstance(obj, numbers.Real):
        out.append(obj)
        return out
    if depth == 0 or obj is None or isinstance(obj, (str, bytes)) or inspect.isroutine(obj):
        return out
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.numel() == 1:
            out.append(obj.item())
        return out
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = list(obj)
    else:
        items = []
        if dataclasses.is_dataclass(obj):
            items += [getattr(obj, f.name, None) for f in dataclasses.fields(obj)]
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("labkit"):
            items += list(vars(obj).values())
        if type(obj).__module__.startswith("labkit"):
            for name, attr in inspect.getmembers(type(obj), lambda a: isinstance(a, property)):
                with contextlib.suppress(Exception):
                    items.append(getattr(obj, name))
    for item in items[:MAX_NUMBERS]:
        numbers_in(item, depth - 1, out)
    return out


# ---- one exercise
# -------------------------------------------------------------------------------------------
def _ticks(check, args, kwargs) -> int:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            check(*args, **kwargs)
    except Exception:  # noqa: BLE001 - a candidate that breaks the check is no answer
        return 0
    return out.getvalue().count("✅")


def audit_exercise(lesson: str, exercise: str, nb, call, functions: dict[str, object], named: dict[str, object],
                   ns: dict) -> list[Leak]:
    """What the student who reads the code obtains for one check call (`exercise`: its name in the grader
    build, check_x's "x", a repeated check "x_2")."""
    module = importlib.import_module(f"labkit.exercises.{call.module}")
    check = getattr(module, call.check)
    node = call.node.value
    answers = answer_names(nb)
    sig = inspect.signature(check)
    slots = [i for i, a in enumerate(node.args) if isinstance(a, ast.Name) and a.id in answers]
    args = [None if i in slots else eval(compile(ast.Expression(a), "<check>", "eval"), ns)  # noqa: S307
            for i, a in enumerate(node.args)]
    kwargs = {k.arg: eval(compile(ast.Expression(k.value), "<check>", "eval"), ns)  # noqa: S307
              for k in node.keywords}
    bound = sig.bind_partial(*args, **kwargs)
    bound.apply_defaults()
    params = list(sig.parameters)
    inputs = {k: v for k, v in bound.arguments.items() if params.index(k) not in slots and k != "seed"}
    positional = [v for i, v in enumerate(args) if i not in slots]
    code = params[:1] == ["fn"]
    base = _ticks(check, args, kwargs)
    leaks: list[Leak] = []
    source = inspect.getsource(check)

    def offer(value, how: str) -> None:
        for n, slot in enumerate(slots):
            name = exercise + (f"#{n + 1}" if len(slots) > 1 else "")
            if sum(x.exercise == name for x in leaks) >= 3:  # three ways are enough to show it
                continue
            tried = list(args)
            tried[slot] = value
            if _ticks(check, tried, kwargs) > base:
                leaks.append(Leak(lesson, name, how))

    if not slots:
        return leaks
    if code:  # a code exercise: the functions themselves are the candidates
        for name, fn in {**functions, **named}.items():
            offer(fn, name)
        return leaks
    letters = CHOICE.findall(source)
    hinted = re.search(r"hints\s*=\s*\{([^}]*)", source)
    options = [k for k, v in vars(module).items() if k.startswith("WHY") and isinstance(v, dict)]
    if hinted and options:
        keys = set(re.findall(r"""["']([a-z])["']\s*:""", hinted.group(1)))
        rest = [c for c in getattr(module, options[0]) if c not in keys]
        letters += rest if len(rest) == 1 else []
    for letter in letters:
        offer(letter, f"the letter {letter!r} read from {call.check}'s source")
    if options and "checked_choice" in source:  # a lettered question: no function returns a letter
        return leaks
    candidates: dict[float, str] = {}  # each number once, with the first call that gave it
    for name, fn in {**functions, **named}.items():
        for _, how, a, k in _calls(fn, inputs, positional):
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    result = fn(*a, **k)
            except Exception:  # noqa: BLE001 - NotImplementedError from a stub, or inputs it does not take
                continue
            for value in numbers_in(result):
                candidates.setdefault(value, f"{name}({how})")
    for value, how in candidates.items():
        offer(value, how)
    return leaks


def exercise_functions() -> dict[str, object]:
    """Every public function the exercise modules define (checks excluded)."""
    import labkit.exercises as pkg

    out = {}
    for path in sorted(Path(pkg.__file__).parent.glob("lesson[0-9][0-9].py")):
        mod = importlib.import_module(f"labkit.exercises.{path.stem}")
        for name, fn in vars(mod).items():
            if (inspect.isfunction(fn) and fn.__module__ == mod.__name__ and not name.startswith(("_", "check_"))):
                out[f"labkit.exercises.{path.stem}.{name}"] = fn
    return out


def _memo(fn):
    """The estimator's answer for the same inputs, computed once: a check is called once per candidate."""
    cache: dict[str, object] = {}

    def wrapper(*args, **kwargs):
        key = repr((args, sorted(kwargs.items())))
        if key not in cache:
            cache[key] = fn(*args, **kwargs)
        return cache[key]

    return wrapper


def _memoize_estimator() -> None:
    import labkit.estimate as est

    for path in sorted(Path(__file__).parents[1].joinpath("exercises").glob("lesson[0-9][0-9].py")):
        mod = importlib.import_module(f"labkit.exercises.{path.stem}")
        for name in ("estimate", "estimate_ranks"):
            if getattr(mod, name, None) is getattr(est, name):
                setattr(mod, name, _memo(getattr(est, name)))


def audit(notebooks: list[Path]) -> tuple[list[Leak], int]:
    """(what was obtained, how many exercises were audited) over the lessons' notebooks."""
    import nbformat

    _memoize_estimator()
    functions = exercise_functions()
    leaks, audited = [], 0
    for path in notebooks:
        nb = nbformat.read(path, as_version=4)
        start = exercise_start(nb)
        calls = check_calls(nb)
        if start is None or not calls:
            continue
        seen: dict[str, int] = {}
        for call in calls:
            name = call.check.removeprefix("check_")
            seen[name] = seen.get(name, 0) + 1
            exercise = name if seen[name] == 1 else f"{name}_{seen[name]}"  # as release.grader_notebook names it
            used = {n.id for n in ast.walk(call.node) if isinstance(n, ast.Name)} - answer_names(nb)
            ns = lesson_inputs(nb, used, call.cell)
            named = named_calls(nb, ns)
            t0 = time.perf_counter()
            leaks += audit_exercise(path.name[:2], exercise, nb, call, functions, named, ns)
            audited += 1
            print(f"audit: lesson {path.name[:2]} {exercise} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    return leaks, audited


def main() -> int:
    from labkit.paths import REPO_ROOT

    root = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT
    lessons = sys.argv[2].split(",") if len(sys.argv) > 2 else None
    paths = [p for p in sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb"))
             if lessons is None or p.name[:2] in lessons]
    leaks, audited = audit(paths)
    print(json.dumps({"audited": audited, "leaks": [dataclasses.asdict(x) for x in leaks]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
