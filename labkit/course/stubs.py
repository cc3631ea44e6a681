"""The student build's exercise modules: every answer function is replaced by a stub that raises
NotImplementedError with a hint, and the checks that reach one compare with its recorded values.

Rule. An answer function is a public function of labkit/exercises/lessonNN.py that is not a check; every one is
stubbed. A check that reaches an answer (directly or through the module's helpers) must be called by the lessons
only with inputs that can be recorded when the build runs: literals, the learner's answers (a number, or for a
code exercise the reference solution from notebooks/solutions/), a fixed seed (`STUDENT_SEED`: in the
student build a code exercise is checked on the cases that seed draws; the grader's hidden checks draw
afresh), and a numeric exercise's `**inputs` (labkit.exercises.Inputs: recorded for every combination a student
may draw). A check that gets the lesson's own objects (its model, its tensors: profile-dependent, so no recording
covers every learner's device) computes its expected value through a path that is not the answer: the
estimator's whole step rather than the one term asked for, the answer's defining property tested on the
objects, or a measurement. Should such a check still reach an answer, `plan()` keeps that answer and names it in
`kept` (release/STUBS.md); tests/unit/test_course_release.py fails on any.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import io
from dataclasses import dataclass, field
from pathlib import Path

from labkit.exercises import recorded

from .lessons import reachable

from .exercises import answer_names, check_calls

STUDENT_SEED = 2026  # the code exercises' cases in the student build


@dataclass
class ModulePlan:
    module: str  # "lesson09"
    stubbed: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)  # answer -> why it stays
    table: dict[str, object] = field(default_factory=dict)  # fingerprint -> recorded value
    sealed: int = 0  # multiple-choice checks whose right letter the student build ships sealed


def _defs(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}


def _reach(defs: dict[str, ast.FunctionDef]) -> dict[str, set[str]]:
    """{function: every function of the module it calls, directly or through others}."""
    direct = {name: {n.id for n in ast.walk(d) if isinstance(n, ast.Name) and n.id in defs} - {name}
              for name, d in defs.items()}
    return {name: reachable(direct, name) for name in defs}


def _literal(node: ast.expr):
    return ast.literal_eval(node)  # ValueError for anything but a literal


def _call_inputs(call, answers: set[str], solutions, check_fn):
    """The check's arguments as the recording passes them, a list of (args, kwargs): literals as written, the
    learner's answers as a dummy number (a numeric exercise) or the reference solution (a code exercise), and
    for `**inputs` every combination of the exercise's choices; ValueError otherwise."""
    params = list(check_fn.__code__.co_varnames[:check_fn.__code__.co_argcount])
    code_exercise = params[:1] == ["fn"]

    def value(node):
        if isinstance(node, ast.Name) and node.id in answers:
            if code_exercise:
                ref = getattr(solutions, node.id, None)
                if not callable(ref):
                    raise ValueError(f"no reference solution named {node.id}")
                return ref
            return 0
        return _literal(node)

    args = [value(a) for a in call.args]
    kwargs = {k.arg: value(k.value) for k in call.keywords if k.arg is not None}
    if "seed" in params and "seed" not in kwargs and len(args) <= params.index("seed"):
        kwargs["seed"] = STUDENT_SEED
    if not any(k.arg is None for k in call.keywords):
        return [(args, kwargs)]
    table = importlib.import_module(check_fn.__module__).inputs  # `**EX`: every input a student may draw
    return [(args, {**kwargs, **drawn}) for drawn in table.every(check_fn.__name__.removeprefix("check_"))]


def _load_solutions(path: Path):
    spec = importlib.util.spec_from_file_location(f"_solutions_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def plan(module: str, notebooks, solutions: Path) -> ModulePlan:
    """Record the answer functions of labkit.exercises.<module> on the calls the lessons' checks make, and
    decide which ones the student build can stub (the rule in this module's docstring)."""
    mod = importlib.import_module(f"labkit.exercises.{module}")
    defs = _defs(ast.parse(Path(mod.__file__).read_text()))
    reach = _reach(defs)
    answers = [n for n in defs if not n.startswith(("_", "check_"))]
    out = ModulePlan(module)
    originals = {n: getattr(mod, n) for n in answers}

    def recorder(name, fn):
        def wrapper(*args, **kwargs):
            result = fn(*args, **kwargs)
            with contextlib.suppress(recorded.Unrecordable):
                out.table[recorded.fingerprint(f"labkit.exercises.{module}.{name}", args, kwargs)] = result
            return result
        return wrapper

    sols = _load_solutions(solutions) if solutions.is_file() else None
    fully_recorded: dict[str, bool] = {}
    try:
        for n, fn in originals.items():
            setattr(mod, n, recorder(n, fn))
        for nb in notebooks:
            names = answer_names(nb)
            for call in check_calls(nb):
                if call.module != module:
                    continue
                ok = False
                with contextlib.suppress(Exception), contextlib.redirect_stdout(io.StringIO()):
                    for args, kwargs in _call_inputs(call.node.value, names, sols, getattr(mod, call.check)):
                        getattr(mod, call.check)(*args, **kwargs)
                    ok = True
                fully_recorded[call.check] = fully_recorded.get(call.check, True) and ok
    finally:
        for n, fn in originals.items():
            setattr(mod, n, fn)

    stubbed = set(answers)
    changed = True
    while changed:  # an answer stays if a kept answer or a check that cannot be recorded reaches it
        changed = False
        for f in sorted(stubbed):
            users = [c for c in defs if f in reach[c] and (c.startswith("check_") or c in answers)]
            checks = [c for c in users if c.startswith("check_")]
            why = None  # no check reaches it, or only checks the lessons call with recordable inputs: stubbed
            if not all(fully_recorded.get(c, True) for c in checks):
                why = "a check the lessons call with their own objects (profile-dependent) reaches it"
            elif any(g not in stubbed for g in users if g in answers):
                why = "a kept answer uses it"
            if why:
                stubbed.discard(f)
                out.kept[f] = why
                changed = True
    out.stubbed = sorted(stubbed)
    return out


def _hint(fn: ast.FunctionDef) -> str:
    doc = ast.get_docstring(fn) or "see the lesson's section this exercise follows"
    first = doc.split("\n\n")[0].replace("\n", " ")
    return first.removeprefix("Reference: ").strip()


def seal_choices(source: str, salt=None) -> tuple[str, int]:
    """The module's source with each multiple-choice check's right letter (`checked_choice(..., right="b")`) and
    its hints' letter keys replaced by salted SHA-256 digests (labkit.exercises.Sealed), so that no right letter
    stands in the student build: neither as `right=` nor as the one letter the hints leave out. Returns the source
    and the number of checks sealed. `salt(check)` gives each check's salt (default: random per build)."""
    import secrets

    from labkit.exercises import Sealed

    salt = salt or (lambda check: secrets.token_hex(8))
    tree = ast.parse(source)
    data = source.encode()
    starts = [0]
    for line in data.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))

    def span(node):  # byte offsets (ast's columns are UTF-8 byte offsets)
        return starts[node.lineno - 1] + node.col_offset, starts[node.end_lineno - 1] + node.end_col_offset

    edits, sealed = [], 0
    for fn in tree.body:
        if not isinstance(fn, ast.FunctionDef) or not fn.name.startswith("check_"):
            continue
        for call in ast.walk(fn):
            if not (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "checked_choice"):
                continue
            kw = {k.arg: k.value for k in call.keywords}
            right = kw.get("right")
            if not (isinstance(right, ast.Constant) and isinstance(right.value, str)):
                raise ValueError(f"{fn.name}: right= must be a letter written in the call to be sealed")
            s = salt(fn.name)
            edits.append((*span(right), f"_Sealed({s!r}, {Sealed.digest_of(right.value, s)!r})"))
            hints = kw.get("hints")
            if hints is not None:
                if not isinstance(hints, ast.Dict) or not all(isinstance(k, ast.Constant) for k in hints.keys):
                    raise ValueError(f"{fn.name}: hints= must be a dict literal keyed by letters to be sealed")
                for key in hints.keys:
                    edits.append((*span(key), repr(Sealed.digest_of(key.value, s))))
            sealed += 1
    if not sealed:
        return source, 0
    first = next(n for n in tree.body if isinstance(n, ast.ImportFrom) and n.level == 1)  # `from . import ...`
    end = starts[first.end_lineno]
    edits.append((end, end, "from labkit.exercises import Sealed as _Sealed  # the right letters, sealed\n"))
    for a, b, text in sorted(edits, reverse=True):
        data = data[:a] + text.encode() + data[b:]
    return data.decode(), sealed


def stub_source(source: str, module: str, stubbed: list[str]) -> str:
    """The module's source with each stubbed answer's body replaced by a lookup of its recorded values (for
    the module's own checks) that raises NotImplementedError with a hint for anyone else, and the code
    exercises' `seed` defaulting to STUDENT_SEED."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    edits = []  # (first line, last line, replacement), 1-based, applied bottom-up
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in stubbed:
            indent = " " * (node.col_offset + 4)
            doc = ast.get_docstring(node)
            body = [f'{indent}"""{doc}"""\n' if doc else "",
                    f"{indent}import sys\n\n",
                    f"{indent}from labkit.exercises.recorded import lookup\n\n",
                    f"{indent}caller = sys._getframe(1)\n",
                    f"{indent}if caller.f_locals.get('fn') is {node.name}:  # the stub offered as the answer\n",
                    f"{indent}    raise NotImplementedError({node.name!r} + ' is the answer to write, not shipped "
                    f"in this build')\n",
                    f"{indent}return lookup(__name__ + {'.' + node.name!r}, {_hint(node)!r}, "
                    f"caller.f_code.co_filename, args, kwargs)\n"]
            head = f"{' ' * node.col_offset}def {node.name}(*args, **kwargs):  # the answer is not shipped here\n"
            first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            edits.append((first, node.end_lineno, head + "".join(body)))
        elif isinstance(node, ast.FunctionDef) and node.name.startswith("check_"):
            a = node.args
            for arg, default in zip(a.args[len(a.args) - len(a.defaults):], a.defaults):
                if arg.arg == "seed" and isinstance(default, ast.Constant) and default.value is None:
                    line = lines[default.lineno - 1]
                    start, end = default.col_offset, default.end_col_offset
                    lines[default.lineno - 1] = line[:start] + str(STUDENT_SEED) + line[end:]
    for first, last, text in sorted(edits, reverse=True):
        lines[first - 1:last] = [text]
    header = (f"# Student build of labkit/exercises/{module}.py (labkit.course.stubs): the answers marked "
              f"'not shipped here' are stubs.\n")
    return header + "".join(lines)
