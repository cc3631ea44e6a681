"""`make release`: two builds from one source, in nbgrader's layout and metadata.

release/grader/ is an nbgrader course folder: source/<lesson>/<lesson>.ipynb (each exercise's check a
locked, 1-point autograder cell whose hidden part asserts it passed and, for a code exercise, checks the
learner's function again on inputs drawn afresh), the answer functions and notebooks/solutions/, and the
released notebooks `nbgrader generate_assignment` writes from source/ (hidden tests removed). Grading is
`python -m labkit.course grade SUBMISSIONS` (labkit/course/grade.py).

release/student/ is what learners get: those released notebooks, labkit with its exercise modules' answer
functions replaced by stubs (labkit/course/stubs.py), no solutions; the checks still print ✅ or ❌.
"""

from __future__ import annotations

import ast
import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat

from labkit.exercises import recorded
from labkit.paths import REPO_ROOT

from . import stubs
from .exercises import check_calls, check_of, exercise_start, parse

COURSE_ID = "labkit"
TOP_FILES = ("pyproject.toml", "environment.yml", "Makefile", "README.md", "CHANGELOG.md")
DATA_FILES = ("README.md", "lesson_times.json", "selection_matrix.json")  # the tracked ones (.gitignore)
HIDDEN = ("### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS")  # nbgrader's default delimiters


def lesson_notebooks(root: Path = REPO_ROOT, lessons=None) -> list[Path]:
    """notebooks/NN_*.ipynb, all or those whose number is in `lessons` ("09", ...)."""
    found = sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    return [p for p in found if lessons is None or p.name[:2] in set(lessons)]


def _grade_meta(grade_id: str) -> dict:
    return {"grade": True, "grade_id": grade_id, "locked": True, "points": 1, "schema_version": 3,
            "solution": False, "task": False}


def _segment(source: str, stmts: list[ast.stmt]) -> str:
    lines = source.splitlines()
    return "\n".join(lines[stmts[0].lineno - 1:stmts[-1].end_lineno])


def _grade_source(source: str, stmts: list[ast.stmt], module, ok: str) -> str:
    """`ok = lessonNN.check_x(...)` then the statements after it, then the hidden tests."""
    call = stmts[0].value
    text = ast.get_source_segment(source, call)
    rest = _segment(source, stmts[1:]) if len(stmts) > 1 else ""
    hidden = [HIDDEN[0], f'assert {ok}, "the check above printed ❌"']
    check = getattr(module, call.func.attr, None)
    if (check is not None and "seed" in check.__code__.co_varnames[:check.__code__.co_argcount]
            and not any(k.arg == "seed" for k in call.keywords)):  # a code exercise: its inputs drawn afresh
        fresh = text[:-1].rstrip() + ", seed=__import__('random').randrange(1 << 30))"
        hidden.append(f'assert {fresh}, "❌ on inputs drawn afresh"  # the grader\'s answer functions')
    if any(k.arg is None for k in call.keywords):  # `**EX`: the exercise's inputs, drawn again for this student
        hidden.append(f'assert {_redrawn(call, module)}, "❌ on the inputs drawn for your student id"')
    hidden.append(HIDDEN[1])
    return "\n".join([f"{ok} = {text}"] + ([rest] if rest else []) + hidden)


def _redrawn(call: ast.Call, module) -> str:
    """The check call with its `**inputs` replaced by the inputs the grader draws from the student id it grades
    ($LABKIT_STUDENT, set per submission by labkit/course/grade.py), not the notebook's variable, which a
    learner may have overwritten with a classmate's."""
    key = call.func.attr.removeprefix("check_")
    table = getattr(module, "inputs", None)
    if table is None or key not in table.table:
        raise ValueError(f"{module.__name__}.{call.func.attr} is called with **inputs but {module.__name__}.inputs "
                         f"has no table {key!r}")
    redrawn = copy.deepcopy(call)
    for k in redrawn.keywords:
        if k.arg is None:
            k.value = ast.parse(f"{call.func.value.id}.inputs({key!r}, quiet=True)", mode="eval").body
    return ast.unparse(redrawn)


STUDENT_CELL = """from labkit.exercises import use_student

use_student("")  # your student id, as your course's roster spells it: each exercise's inputs are drawn from it"""


def per_student(source) -> bool:
    """Whether a grader build's source notebook asks for the student's id (the cell grader_notebook adds where
    a lesson's exercises draw their inputs): autograde then runs once per submission, with that id."""
    return any(c.metadata.get("labkit", {}).get("student_id") for c in source.cells)


def draws_inputs(nb) -> bool:
    """Whether a lesson's checks take an exercise's inputs (`**EXn`): its grading needs each student's id."""
    return any(k.arg is None for c in check_calls(nb) for k in c.node.value.keywords)


def grader_notebook(nb, exercises_only: bool = False):
    """The nbgrader source version of a lesson: every check call its own graded cell (an answer written
    before a check in the same cell is split into a cell of its own, since autograde restores graded cells
    from the source)."""
    import importlib

    nb = copy.deepcopy(nb)
    start = exercise_start(nb)
    if start is None:
        return nb
    cells, seen = [], {}
    for i, cell in enumerate(nb.cells):
        if exercises_only and i < start:
            continue
        tree = parse(cell.source) if cell.cell_type == "code" and i > start else None
        if not tree or not any(check_of(s) for s in tree.body):
            cells.append(cell)
            continue
        groups, current = [], []
        for stmt in tree.body:  # [answer statements], then one group per check call
            if check_of(stmt) and (current or groups):
                groups.append(current)
                current = []
            current.append(stmt)
        groups.append(current)
        for k, group in enumerate(groups):
            found = check_of(group[0])
            new = nbformat.v4.new_code_cell(_segment(cell.source, group))
            new.id = f"{cell.id}-{k}" if cell.get("id") else new.id
            if found:
                name = found[1].removeprefix("check_")
                seen[name] = seen.get(name, 0) + 1
                grade_id = name if seen[name] == 1 else f"{name}_{seen[name]}"
                module = importlib.import_module(f"labkit.exercises.{found[0]}")
                new.source = _grade_source(cell.source, group, module, f"_ok_{grade_id}")
                new.metadata["nbgrader"] = _grade_meta(grade_id)
            cells.append(new)
    if draws_inputs(nb):  # the student's id, first thing in the exercises (autograde sets it from the folder)
        at = next(i for i, c in enumerate(cells) if c.cell_type == "markdown" and c is nb.cells[start]) + 1
        cell = nbformat.v4.new_code_cell(STUDENT_CELL)
        cell.metadata["labkit"] = {"student_id": True}  # grade.py reads it: grade this lesson per student
        cells.insert(at, cell)
    nb.cells = cells
    return nb


def _copy_common(dest: Path, root: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name in TOP_FILES:
        if (root / name).is_file():
            shutil.copy2(root / name, dest / name)
    (dest / "data").mkdir(parents=True, exist_ok=True)
    for name in DATA_FILES:
        if (root / "data" / name).is_file():
            shutil.copy2(root / "data" / name, dest / "data" / name)
    shutil.copytree(root / "labkit", dest / "labkit", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


NBGRADER_CONFIG = '''# nbgrader configuration for the labkit course (made by `make release`; labkit/course/release.py)
c = get_config()  # noqa: F821
c.CourseDirectory.course_id = "{course}"
c.CourseDirectory.root = __file__.rsplit("/", 1)[0]
c.Execute.timeout = {timeout}  # seconds per cell: a lesson's measured steps can take minutes at full size
c.Execute.allow_errors = True  # a cell that raises scores 0; the cells before and after it are still graded
'''


def nbgrader(args: list[str], course: Path, env: dict[str, str] | None = None) -> None:
    """Run nbgrader's own command line in the course folder, with this build's labkit importable (and `env`
    added to the environment its kernels inherit)."""
    env = dict(os.environ, **(env or {}),
               PYTHONPATH=os.pathsep.join([str(course), os.environ.get("PYTHONPATH", "")]),
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))  # alembic
    done = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course, env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise RuntimeError(f"nbgrader {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")


def build_grader(dest: Path, root: Path = REPO_ROOT, lessons=None, exercises_only: bool = False,
                 timeout: int = 1800) -> list[str]:
    """release/grader/: the nbgrader course folder; returns the assignments (one per lesson)."""
    _copy_common(dest, root)
    shutil.copytree(root / "notebooks" / "solutions", dest / "notebooks" / "solutions")
    (dest / "nbgrader_config.py").write_text(NBGRADER_CONFIG.format(course=COURSE_ID, timeout=timeout))
    names = []
    for path in lesson_notebooks(root, lessons):
        nb = nbformat.read(path, as_version=4)
        folder = dest / "source" / path.stem
        folder.mkdir(parents=True, exist_ok=True)
        nbformat.write(grader_notebook(nb, exercises_only), folder / path.name)
        nbgrader(["generate_assignment", path.stem, "--force"], dest)
        names.append(path.stem)
    return names


def build_student(dest: Path, grader: Path, root: Path = REPO_ROOT, lessons=None) -> dict[str, stubs.ModulePlan]:
    """release/student/: nbgrader's released notebooks and labkit with the answer functions stubbed."""
    _copy_common(dest, root)
    (dest / "notebooks").mkdir(exist_ok=True)
    paths = lesson_notebooks(root, lessons)
    for path in paths:
        shutil.copy2(grader / "release" / path.stem / path.name, dest / "notebooks" / path.name)
    return student_exercises(dest, [nbformat.read(p, as_version=4) for p in paths], root)


def student_exercises(dest: Path, notebooks, root: Path = REPO_ROOT) -> dict[str, stubs.ModulePlan]:
    """dest/labkit/exercises as the student build ships it (dest/labkit copied already): every answer function
    stubbed, the multiple-choice letters sealed, the recorded answers beside them."""
    modules = sorted({c.module for nb in notebooks for c in check_calls(nb)})
    plans, table = {}, {}
    for module in modules:
        plan = stubs.plan(module, notebooks, root / "notebooks" / "solutions" / f"{module}.py")
        target = dest / "labkit" / "exercises" / f"{module}.py"
        sealed, plan.sealed = stubs.seal_choices(target.read_text())
        target.write_text(stubs.stub_source(sealed, module, plan.stubbed))
        plans[module] = plan
        table.update(plan.table)
    recorded.dump(table, dest / "labkit" / "exercises" / recorded.TABLE_FILE)
    return plans


def build(out: Path, root: Path = REPO_ROOT, lessons=None, exercises_only: bool = False) -> dict:
    """Both builds under `out` (release/), replacing what was there. Returns what the student build stubbed."""
    for sub in ("grader", "student"):
        shutil.rmtree(out / sub, ignore_errors=True)
        (out / sub).mkdir(parents=True)
    build_grader(out / "grader", root, lessons, exercises_only)
    plans = build_student(out / "student", out / "grader", root, lessons)
    report = {m: {"stubbed": p.stubbed, "kept": p.kept, "sealed": p.sealed} for m, p in plans.items()}
    lines = ["# What the student build stubbed (labkit/course/stubs.py has the rule)", "",
             "Multiple-choice checks sealed (their right letter a salted SHA-256 digest): "
             f"{sum(r['sealed'] for r in report.values())}.", ""]
    for m, r in report.items():
        lines.append(f"- {m}: stubbed {', '.join(r['stubbed']) or 'none'}"
                     + "".join(f"; kept {k} ({why})" for k, why in r["kept"].items()))
    (out / "STUBS.md").write_text("\n".join(lines) + "\n")
    from .audit import leaks_markdown

    (out / "LEAKS.md").write_text(leaks_markdown())
    return report
