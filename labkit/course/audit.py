"""The leak audit (issue 41): play the student who reads the code instead of doing the exercise.

For every exercise of every lesson (each `lessonNN.check_*(...)` call after "## Exercises"), with the
lesson's own inputs rebuilt from its cells (only the statements that define them: `lesson_inputs`),
it tries

- every public function of the exercise modules (`labkit.exercises.lessonNN`, all of them) called
  with the check's inputs: in the student build each one is a stub that raises NotImplementedError;
- every labkit function the lesson itself calls or imports (`named_calls`), called with the check's
  inputs (a call that takes none of them cannot compute the answer for them: a number it returns that
  equals the answer is a coincidence of sizes, e.g. `compare_compiled()`'s 64 x 256 x 4 bytes and lesson
  03's smoke block input, so such calls are made only for a check that has no inputs), every number its
  result holds (a dataclass's fields, a list's items, a property such as `.peak.total`) offered as the
  answer; for a code exercise the function itself is offered;
- for a multiple-choice check, a letter read from the check's source (`right="b"`, or the one letter
  its hints leave out).

An answer counts as obtained when the check prints a ✅ it did not print for an empty answer.

Bounds, so that the whole course is audited in minutes: each library call is given `CALL_BUDGET_S`
seconds of CPU (a training loop on the lesson's model is stopped there) and one that runs past it is
reported as not tried (`NotTried`, the JSON's "not_tried"), never dropped silently; a check called
once per candidate answer reuses what its module's private helpers computed for the same inputs
(a measured step, the estimator's step: `_helpers_memoized`, `_memo`), so a candidate costs the
comparison only, and the lesson's inputs and each library call's numbers are made once per lesson.
`audit()` returns what it obtained, each with how (`Leak.call`); run it against the student build
(release/student on PYTHONPATH, `python -m labkit.course.audit`) and compare with release/LEAKS.md.
Sizes: the smoke profile (LABKIT_SMOKE=1), so the lessons' objects are small.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import importlib
import inspect
import io
import json
import numbers
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .exercises import answer_names, check_calls, exercise_start, parse

CHOICE = re.compile(r"""right\s*=\s*["']([a-z])["']""")
SYNONYMS = {"model": ("config", "cfg", "spec"), "config": ("model", "cfg", "spec"), "cfg": ("config", "model"),
            "n": ("n_params",), "n_params": ("n",), "world": ("ranks", "world_size"), "ranks": ("world",)}
MAX_NUMBERS = 300  # numbers taken from one result
CALL_BUDGET_S = 2.0  # CPU seconds one library call with a check's inputs may take before it is not tried
WALL_PER_CPU = 15  # and the clock's seconds per CPU second (a loaded machine runs slower, a blocked call never ends)


@dataclass(frozen=True)
class Leak:
    lesson: str  # "05"
    exercise: str  # "adam8bit_state_bytes", "adam8bit_state_bytes_2" (grade ids); "#1", "#2": a check's answers
    call: str  # how the answer was obtained, e.g. "labkit.optim.adam8bit.state_bytes_for(shape=(1000, 1000))"

    def key(self) -> str:
        return f"{self.lesson} {self.exercise}"


@dataclass(frozen=True)
class NotTried:
    lesson: str
    exercise: str
    call: str  # the call the audit stopped, e.g. "labkit.run.train.train_loop(model=GPT, ...)"
    why: str  # "ran past 2.0 s of CPU"


GUESSES = [k / 2 for k in range(33)]  # 0, 0.5, ..., 16: what a learner tries before reading any code


@dataclass(frozen=True)
class Guessable:
    """An exercise whose answer is a small number a learner finds by trying 0, 0.5, 1, ... 16 against the check's
    ✅: not a shortcut through the library (no stub prevents it), so not a leak; the grader's hidden checks, not
    the student build, keep it honest. Reported beside the leaks (the JSON's "guessable")."""
    lesson: str
    exercise: str
    value: float


class _OverBudget(BaseException):  # not an Exception: library code that catches those must not swallow it
    pass


class _StartsProcess(BaseException):  # a call that would start a process (DataLoader workers, a launcher)
    pass


@contextlib.contextmanager
def _no_processes():
    """A candidate call gets the check's inputs in whatever parameter they fit (a byte budget can land in
    `num_workers`): no call may fork, spawn or start a process while it is tried; one that would is not tried."""
    import multiprocessing.process
    import os
    import subprocess

    def refuse(*args, **kwargs):
        raise _StartsProcess

    saved = [(os, "fork", os.fork), (subprocess.Popen, "__init__", subprocess.Popen.__init__),
             (multiprocessing.process.BaseProcess, "start", multiprocessing.process.BaseProcess.start)]
    for owner, name, _ in saved:
        setattr(owner, name, refuse)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


@contextlib.contextmanager
def _budget(seconds: float | None):
    """Raise _OverBudget in this (the main) thread once the process has used `seconds` more of CPU, and again
    every 50 ms of CPU after (a raise inside a weakref callback or a __del__ is ignored by Python); or once
    WALL_PER_CPU times as many seconds have passed on the clock (a call blocked on a queue uses no CPU)."""
    if not seconds:
        yield
        return

    def stop(signum, frame):
        raise _OverBudget

    old = signal.signal(signal.SIGPROF, stop), signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_PROF, seconds, 0.05)
    signal.setitimer(signal.ITIMER_REAL, WALL_PER_CPU * seconds, 0.5)  # a call that waits uses no CPU
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGPROF, old[0])
        signal.signal(signal.SIGALRM, old[1])


# What the student build still gives away: (lesson, exercise) -> the call that gives it and why it
# stays. The release writes them to release/LEAKS.md for the instructor;
# tests/unit/test_course_audit.py fails on any leak the audit finds that is not here, and on an
# entry here that the audit no longer finds.
_OPEN = "open: ask for the derivation as a function checked on fresh inputs, as lesson 05 now does (issue 41, item 3)"
LEAKS: dict[tuple[str, str], tuple[str, str]] = {
    ("01", "logits_bytes"): ("labkit.estimate.estimate('llama3.2-1b', 4, 4096, 'fp32'): its log-softmax term",
                             "the estimator is the lesson's instrument from its first cells to its last; " + _OPEN),
    ("06", "galore_state_bytes"): ("labkit.optim.galore.state_bytes_for((4096, 11008), rank=128)",
                                   "the estimator's GaLore terms call it (labkit.estimate.optim_terms); " + _OPEN),
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
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


MUTATORS = {"append", "extend", "update", "add", "insert", "setdefault", "pop", "remove", "clear", "to",
            "train", "eval", "load_state_dict", "requires_grad_", "zero_", "copy_", "fill_", "apply"}
SIMPLE = (ast.Import, ast.ImportFrom, ast.Assign, ast.AnnAssign, ast.FunctionDef, ast.ClassDef)
COMPOUND = (ast.For, ast.If, ast.With, ast.Try, ast.AugAssign, ast.Expr)  # kept only where they change a name


def _base(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Subscript, ast.Attribute)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _touched(stmt: ast.stmt) -> set[str]:
    """Names a statement changes without surely rebinding them: `d[k] = v`, `x.a = v`, `x += 1`, `d.update(...)`,
    and every name a loop, an `if`, a `with` or a `try` assigns (a branch may not run): the statements that made
    them before are still needed."""
    out = set()
    for node in ast.walk(stmt):
        if isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(node.ctx, ast.Store):
            out.add(_base(node))
        elif isinstance(node, ast.AugAssign):
            out.add(_base(node.target))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in MUTATORS):
            out.add(_base(node.func.value))
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and isinstance(stmt, COMPOUND):
            out.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)) and isinstance(stmt, COMPOUND):
            out.add(node.name)
    return out - {None}


def _used(stmt: ast.stmt) -> set[str]:
    """The names a statement reads from outside it: not a function's (or lambda's) own parameters and locals,
    nor a comprehension's variables."""
    local = set()
    for node in ast.walk(stmt):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            local |= {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if x}
            if not isinstance(node, ast.Lambda):
                local |= {n.id for b in node.body for n in ast.walk(b)
                          if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        elif isinstance(node, ast.comprehension):
            local |= {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
    return {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - local


def _parse(cell) -> ast.Module | None:
    """A code cell's statements, its IPython lines (`!pip ...`, `%matplotlib ...`) read as `pass`."""
    if cell.cell_type != "code":
        return None
    lines = [re.sub(r"^(\s*)[!%].*$", r"\1pass", line) for line in cell.source.splitlines()]
    return parse("\n".join(lines))


def _split(stmts: list[ast.stmt]) -> list[ast.stmt]:
    """`a, b = x, y` as `a = x` and `b = y` (where neither side names the other's target), so that a slice can
    keep one: `predicted[k], measured[k] = estimate(r), measure_step(r)` keeps the estimate alone."""
    out = []
    for stmt in stmts:
        if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Tuple)
                and isinstance(stmt.value, ast.Tuple) and len(stmt.targets[0].elts) == len(stmt.value.elts)
                and not any(isinstance(e, ast.Starred) for e in stmt.targets[0].elts + stmt.value.elts)):
            names = {_base(t) for t in stmt.targets[0].elts}
            if not names & {n.id for n in ast.walk(stmt.value) if isinstance(n, ast.Name)}:
                out += [ast.copy_location(ast.Assign([t], v), stmt)
                        for t, v in zip(stmt.targets[0].elts, stmt.value.elts)]
                continue
        out.append(stmt)
    return out


def _slice(stmts: list[ast.stmt], need: set[str]) -> tuple[list[ast.stmt], set[str]]:
    """The statements among `stmts` that make or change a name in `need` (a loop, an `if` or a `with` cut down
    to the statements of its body that do: a loop that measures and predicts keeps only the prediction when
    only the prediction is needed), and the names they need in turn."""
    keep = []
    for stmt in reversed(_split(stmts)):
        touched = _touched(stmt)
        if isinstance(stmt, SIMPLE):
            bound = _bound(stmt)
            if (bound | touched) & need:
                keep.append(stmt)
                need = (need - (bound - touched)) | _used(stmt)
        elif isinstance(stmt, (ast.For, ast.If, ast.With)) and touched & need:
            cut, inner = copy.copy(stmt), set(need)
            for _ in range(2):  # a loop's body feeds its next turn
                cut.body, more = _slice(stmt.body, set(inner))
                inner |= more
            if getattr(stmt, "orelse", None):
                cut.orelse, more = _slice(stmt.orelse, set(need))
                inner |= more
            cut.body = cut.body or [ast.Pass()]
            head = [stmt.iter] if isinstance(stmt, ast.For) else [stmt.test] if isinstance(stmt, ast.If) else [
                i.context_expr for i in stmt.items]
            keep.append(cut)
            target = stmt.target if isinstance(stmt, ast.For) else None
            own = {n.id for n in ast.walk(target) if isinstance(n, ast.Name)} if target else set()
            need = need | (inner - own) | {n.id for h in head for n in ast.walk(h) if isinstance(n, ast.Name)}
        elif touched & need:  # a try, an augmented assignment, a mutating call: as written
            keep.append(stmt)
            need = need | _used(stmt)
    return keep[::-1], need


def lesson_inputs(nb, names: set[str], upto: int, done: dict | None = None) -> dict:
    """The namespace in which `names` hold what the lesson's cells before cell `upto` assign them: only the
    top-level imports, definitions and assignments they depend on, and the statements that change them (a
    loop filling a dict: `_touched`), are run (a slice, not the lesson). `done`
    ({(cell, statement): the names it bound}, one per lesson) keeps what a statement made for the next check:
    the lesson runs each statement once, and so do the lesson's checks here (the same model, the same tensors)."""
    done = {} if done is None else done
    stmts = []
    for c, cell in enumerate(nb.cells[:upto]):
        tree = _parse(cell)
        for i, stmt in enumerate(tree.body if tree else []):
            if isinstance(stmt, SIMPLE + COMPOUND):
                stmts.append(((c, i), stmt))
    need, keep = set(names), []
    for where, stmt in reversed(stmts):
        kept, need = _slice([stmt], need)
        if kept:  # a statement cut to what the names need: its own key (another check may need more of it)
            keep.append(((where, ast.unparse(ast.Module(kept, []))), kept))
    ns = done.setdefault("namespace", {})  # one per lesson, as in the notebook: a function the lesson defines
    with contextlib.redirect_stdout(io.StringIO()):  # reads its globals from the namespace it was defined in
        for where, kept in reversed(keep):
            if where not in done:
                exec(compile(ast.fix_missing_locations(ast.Module(kept, [])), "<lesson>", "exec"), ns)
                done[where] = {n: ns[n] for stmt in kept for n in _bound(stmt) if n in ns}
            ns.update(done[where])  # a name a later statement bound again holds this statement's value here
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
                   ns: dict, not_tried: list[NotTried] | None = None, budget: float | None = CALL_BUDGET_S,
                   results: dict | None = None, guessable: list[Guessable] | None = None) -> list[Leak]:
    """What the student who reads the code obtains for one check call (`exercise`: its name in the grader
    build, check_x's "x", a repeated check "x_2"). A library call that runs past `budget` seconds of CPU is
    appended to `not_tried`. `results` keeps each library call's numbers for the lesson's next checks (the same
    function with the same inputs, the same objects: `lesson_inputs`'s `done`)."""
    not_tried = [] if not_tried is None else not_tried
    results = {} if results is None else results
    guessable = [] if guessable is None else guessable
    module = importlib.import_module(f"labkit.exercises.{call.module}")
    with _helpers_memoized(module):
        return _audit_exercise(lesson, exercise, nb, call, module, functions, named, ns, not_tried, budget, results,
                               guessable)


OVER, PROCESS = object(), object()  # in `results`: a call that ran past the budget, one that would start a process


def _audit_exercise(lesson, exercise, nb, call, module, functions, named, ns, not_tried, budget,
                    results, guessable) -> list[Leak]:
    check = getattr(module, call.check)
    node = call.node.value
    answers = answer_names(nb)
    sig = inspect.signature(check)
    slots = [i for i, a in enumerate(node.args) if isinstance(a, ast.Name) and a.id in answers]
    args = [None if i in slots else eval(compile(ast.Expression(a), "<check>", "eval"), ns)  # noqa: S307
            for i, a in enumerate(node.args)]
    kwargs = {}
    for k in node.keywords:  # `**EX`, an exercise's inputs (labkit.exercises.Inputs), as the keywords it holds
        value = eval(compile(ast.Expression(k.value), "<check>", "eval"), ns)  # noqa: S307
        kwargs.update(value if k.arg is None else {k.arg: value})
    bound = sig.bind_partial(*args, **kwargs)
    bound.apply_defaults()
    params = list(sig.parameters)
    inputs = {k: v for k, v in bound.arguments.items() if params.index(k) not in slots and k != "seed"}
    positional = [v for i, v in enumerate(args) if i not in slots]
    code = params[:1] == ["fn"]
    base = _ticks(check, args, kwargs)
    leaks: list[Leak] = []
    source = inspect.getsource(check)

    def offer(value, how: str, limit: float | None = budget, skip: set[str] = frozenset()) -> None:
        for n, slot in enumerate(slots):
            name = exercise + (f"#{n + 1}" if len(slots) > 1 else "")
            if sum(x.exercise == name for x in leaks) >= 3 or name in skip:  # three ways are enough to show it
                continue
            tried = list(args)
            tried[slot] = value
            try:
                with _budget(limit), _no_processes():
                    got = _ticks(check, tried, kwargs)
            except _OverBudget:
                not_tried.append(NotTried(lesson, name, how, f"the check ran past {limit:g} s of CPU with it"))
                continue
            except _StartsProcess:
                not_tried.append(NotTried(lesson, name, how, "the check would start a process with it"))
                continue
            if got > base:
                leaks.append(Leak(lesson, name, how))

    if not slots:
        return leaks
    if code:  # a code exercise: the functions themselves are the candidates (the check runs each one)
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
    for n, slot in enumerate(slots):  # an answer among a few small numbers: the check's ✅ finds it by trying
        name = exercise + (f"#{n + 1}" if len(slots) > 1 else "")
        for value in GUESSES:
            tried = list(args)
            tried[slot] = value
            with contextlib.suppress(_OverBudget, _StartsProcess), _budget(budget), _no_processes():
                if _ticks(check, tried, kwargs) > base:
                    guessable.append(Guessable(lesson, name, value))
                    break
    guessed = {g.exercise for g in guessable if g.lesson == lesson}
    candidates: dict[float, str] = {}  # each number once, with the first call that gave it
    for name, fn in {**functions, **named}.items():
        for _, how, a, k in _calls(fn, inputs, positional):
            if not (a or k) and (inputs or positional):  # given none of the check's inputs: no shortcut for them
                continue
            key = (name, _key(a), _key(sorted(k.items())))
            if key not in results:  # the lesson's other checks may have made this call already
                try:
                    with _budget(budget), _no_processes(), contextlib.redirect_stdout(io.StringIO()):
                        results[key] = numbers_in(fn(*a, **k))
                except _OverBudget:
                    results[key] = OVER
                except _StartsProcess:
                    results[key] = PROCESS
                except Exception:  # noqa: BLE001 - NotImplementedError from a stub, or inputs it does not take
                    results[key] = []
            if results[key] is OVER or results[key] is PROCESS:
                why = f"ran past {budget:g} s of CPU" if results[key] is OVER else "would start a process"
                not_tried.append(NotTried(lesson, exercise, f"{name}({how})", why))
                continue
            for value in results[key]:
                candidates.setdefault(value, f"{name}({how})")
    for value, how in candidates.items():
        offer(value, how, skip=guessed if value in GUESSES else set())  # no better than trying small numbers
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


def _key(value):
    """A cache key: a plain value as itself (with its type: 1 and 1.0 differ), anything else by identity (the
    lesson's model, tensors and config are the same objects for every candidate of one exercise)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return type(value).__name__, value
    if isinstance(value, (tuple, list)):
        return type(value).__name__, tuple(_key(v) for v in value)
    return "id", id(value)


@contextlib.contextmanager
def _helpers_memoized(module):
    """For one exercise, each private helper of the check's module (`_measured_flops`, `_checkpoint_input`: what
    the check compares with) and each library function it imported (`largest_phi`) computes once per inputs:
    a check called with a hundred candidate answers measures its step once, not a hundred times. The inputs
    are kept alive with the cache, so an identity is not reused."""
    originals = {n: f for n, f in vars(module).items()
                 if inspect.isfunction(f) and not n.startswith("__") and (
                     (n.startswith("_") and f.__module__ == module.__name__)  # its helpers
                     or (f.__module__.startswith("labkit.") and not f.__module__.startswith("labkit.exercises")))}

    def memo(fn):
        cache: dict = {}

        def wrapper(*args, **kwargs):
            key = (_key(args), _key(sorted(kwargs.items())))
            if key not in cache:
                cache[key] = (fn(*args, **kwargs), args, kwargs)
            return cache[key][0]

        return wrapper

    for n, f in originals.items():
        setattr(module, n, memo(f))
    try:
        yield
    finally:
        for n, f in originals.items():
            setattr(module, n, f)


def _memoize_estimator() -> None:
    import labkit.estimate as est

    for path in sorted(Path(__file__).parents[1].joinpath("exercises").glob("lesson[0-9][0-9].py")):
        mod = importlib.import_module(f"labkit.exercises.{path.stem}")
        for name in ("estimate", "estimate_ranks"):
            if getattr(mod, name, None) is getattr(est, name):
                setattr(mod, name, _memo(getattr(est, name)))


@dataclass
class Result:
    leaks: list[Leak]
    audited: int  # check calls audited
    not_tried: list[NotTried]  # library calls stopped at the budget
    seconds: dict[str, float]  # lesson -> wall seconds of its audit (its inputs rebuilt, every check tried)
    guessable: list[Guessable] = dataclasses.field(default_factory=list)  # answers found by trying small numbers


def audit(notebooks: list[Path], budget: float | None = CALL_BUDGET_S) -> Result:
    """What the student who reads the code obtains over the lessons' notebooks."""
    import nbformat

    _memoize_estimator()
    functions = exercise_functions()
    out = Result([], 0, [], {})
    for path in notebooks:
        nb = nbformat.read(path, as_version=4)
        start = exercise_start(nb)
        calls = check_calls(nb)
        if start is None or not calls:
            continue
        lesson, t_lesson = path.name[:2], time.perf_counter()
        seen: dict[str, int] = {}
        done: dict = {}  # the lesson's statements run so far, and what they bound
        results: dict = {}  # the library calls made so far with the lesson's inputs, and their numbers
        for call in calls:
            name = call.check.removeprefix("check_")
            seen[name] = seen.get(name, 0) + 1
            exercise = name if seen[name] == 1 else f"{name}_{seen[name]}"  # as release.grader_notebook names it
            used = {n.id for n in ast.walk(call.node) if isinstance(n, ast.Name)} - answer_names(nb)
            t0 = time.perf_counter()
            ns = lesson_inputs(nb, used, call.cell, done)
            t1 = time.perf_counter()
            named = named_calls(nb, ns)
            t2 = time.perf_counter()
            out.leaks += audit_exercise(lesson, exercise, nb, call, functions, named, ns, out.not_tried, budget,
                                        results, out.guessable)
            out.audited += 1
            print(f"audit: lesson {lesson} {exercise}: inputs {t1 - t0:.1f} s, names {t2 - t1:.1f} s, "
                  f"candidates {time.perf_counter() - t2:.1f} s", file=sys.stderr)
        out.seconds[lesson] = round(time.perf_counter() - t_lesson, 1)
    return out


def unlisted(result: Result, lessons=None) -> tuple[list[Leak], list[tuple[str, str]]]:
    """(leaks LEAKS does not list, LEAKS entries of the audited lessons the audit no longer finds)."""
    audited = set(result.seconds) if lessons is None else set(lessons)
    got = {(x.lesson, x.exercise) for x in result.leaks}
    return ([x for x in result.leaks if (x.lesson, x.exercise) not in LEAKS],
            sorted(k for k in LEAKS if k[0] in audited and k not in got))


def main(argv: list[str] | None = None) -> int:
    """python -m labkit.course.audit [REPO] [LESSONS] [--strict]: the JSON report on stdout, a summary on stderr;
    --strict exits 1 when a leak is not in LEAKS or an entry of LEAKS is no longer found (`make course-audit`)."""
    from labkit.paths import REPO_ROOT

    argv = sys.argv[1:] if argv is None else argv
    strict = "--strict" in argv
    args = [a for a in argv if a != "--strict"]
    root = Path(args[0]) if args else REPO_ROOT
    lessons = args[1].split(",") if len(args) > 1 else None
    paths = [p for p in sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb"))
             if lessons is None or p.name[:2] in lessons]
    t0 = time.perf_counter()
    result = audit(paths)
    print(json.dumps({"audited": result.audited, "leaks": [dataclasses.asdict(x) for x in result.leaks],
                      "not_tried": [dataclasses.asdict(x) for x in result.not_tried], "seconds": result.seconds,
                      "guessable": [dataclasses.asdict(x) for x in result.guessable]},
                     indent=1))
    new, gone = unlisted(result, lessons)
    print(f"audit: {result.audited} checks in {len(result.seconds)} lessons, {time.perf_counter() - t0:.0f} s; "
          f"{len(result.leaks)} answers obtained, {len(new)} not in LEAKS, {len(gone)} LEAKS entries not found; "
          f"{len(result.not_tried)} calls not tried (past {CALL_BUDGET_S:g} s of CPU)", file=sys.stderr)
    for x in new:
        print(f"audit: NOT IN LEAKS: lesson {x.lesson} {x.exercise}: {x.call}", file=sys.stderr)
    for x in result.guessable:
        print(f"audit: guessable: lesson {x.lesson} {x.exercise}: {x.value:g} (trying 0 to 16)", file=sys.stderr)
    for x in result.not_tried:
        print(f"audit: not tried: lesson {x.lesson} {x.exercise}: {x.call} ({x.why})", file=sys.stderr)
    return 1 if strict and (new or gone) else 0


if __name__ == "__main__":
    raise SystemExit(main())
