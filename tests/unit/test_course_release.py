"""The course release (labkit/course): nbgrader's own tool accepts the grader build and grades submissions
(wrong answers 0, the reference solutions full marks, a notebook that raises mid-way keeps the score of the
cells before it), and the student build's stubs raise NotImplementedError while its checks still pass or fail.

Small on purpose: lesson 11's exercise cells only (a code exercise checked again on inputs drawn afresh, and a
why-question), and lesson 09's exercise module for the stubs.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from labkit.course import grade, release, stubs
from labkit.course.exercises import answer_names, check_calls
from labkit.exercises import recorded
from labkit.paths import REPO_ROOT

SOLUTIONS = REPO_ROOT / "notebooks" / "solutions"


def _answer(nb, name: str, source: str):
    """The submission: the answer cell that first assigns or defines `name` gets `source`."""
    for cell in nb.cells:
        if cell.cell_type == "code" and name in answer_names(nbformat.v4.new_notebook(cells=[
                nbformat.v4.new_markdown_cell("## Exercises"), cell])):
            cell.source = source
            return
    raise AssertionError(f"no answer cell for {name}")


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    root = tmp_path_factory.mktemp("release") / "grader"
    root.mkdir()
    assert release.build_grader(root, lessons=["11"], exercises_only=True) == ["11_communication"]
    return root


def test_grader_build_is_an_nbgrader_course(course):
    released = nbformat.read(course / "release" / "11_communication" / "11_communication.ipynb", as_version=4)
    source = nbformat.read(course / "source" / "11_communication" / "11_communication.ipynb", as_version=4)
    graded = [c for c in source.cells if c.metadata.get("nbgrader", {}).get("grade")]
    assert [c.metadata["nbgrader"]["grade_id"] for c in graded] == ["dgc_bytes", "why_memory"]
    assert all("BEGIN HIDDEN TESTS" in c.source for c in graded)
    assert "randrange" in graded[0].source  # the code exercise is checked again on fresh inputs
    text = "\n".join(c.source for c in released.cells)
    assert "HIDDEN" not in text and "randrange" not in text and "lesson11.check_dgc_bytes(dgc_bytes)" in text


def test_grading_scores_each_exercise(course, tmp_path):
    released = nbformat.read(course / "release" / "11_communication" / "11_communication.ipynb", as_version=4)
    sol = (SOLUTIONS / "lesson11.py").read_text()
    right_fn = sol.split("# ---- exercise 2")[0]  # the reference solution's imports and dgc_bytes
    cases = {"right": (right_fn, 'why = "b"'),
             "wrong": ("def dgc_bytes(numels, density, world):\n    return 0", 'why = "a"'),
             "raises": (right_fn, 'raise RuntimeError("the learner stopped here")')}
    for student, (fn_src, why_src) in cases.items():
        nb = nbformat.from_dict(released)
        _answer(nb, "dgc_bytes", fn_src)
        _answer(nb, "why", why_src)
        (tmp_path / "in" / student).mkdir(parents=True)
        nbformat.write(nb, tmp_path / "in" / student / "11_communication.ipynb")
    rows = grade.grade(tmp_path / "in", course, tmp_path / "out")
    got = {(r["student"], r["exercise"]): r["score"] for r in rows}
    assert got == {("right", "dgc_bytes"): 1, ("right", "why_memory"): 1,
                   ("wrong", "dgc_bytes"): 0, ("wrong", "why_memory"): 0,
                   ("raises", "dgc_bytes"): 1, ("raises", "why_memory"): 0}
    assert (tmp_path / "out" / "scores.csv").read_text().splitlines()[0] == ",".join(grade.FIELDS)
    totals = json.loads((tmp_path / "out" / "scores.json").read_text())["students"]
    assert {s: (t["score"], t["max_score"]) for s, t in totals.items()} == {
        "right": (2, 2), "wrong": (0, 2), "raises": (1, 2)}


@pytest.fixture(scope="module")
def course09(tmp_path_factory):
    root = tmp_path_factory.mktemp("release09") / "grader"
    root.mkdir()
    assert release.build_grader(root, lessons=["09"], exercises_only=True) == ["09_data_parallel_zero"]
    return root


def test_each_student_is_graded_on_inputs_drawn_from_their_id(course09, tmp_path):
    """Issue 41 item 4: a numeric exercise's hidden check draws the inputs of the student it grades, so the
    right answer for your own inputs scores, and a classmate's answer scores 0, even with the classmate's id
    written in the notebook and the classmate's inputs put in its variable."""
    import importlib.util

    from labkit.exercises import lesson09

    spec = importlib.util.spec_from_file_location("sol09", SOLUTIONS / "lesson09.py")
    sol = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sol)
    source = nbformat.read(course09 / "source" / "09_data_parallel_zero" / "09_data_parallel_zero.ipynb", 4)
    graded = [c.source for c in source.cells if c.metadata.get("nbgrader", {}).get("grade")]
    assert all('inputs(\'' in g and "quiet=True" in g for g in graded), graded  # drawn again when graded
    released = nbformat.read(course09 / "release" / "09_data_parallel_zero" / "09_data_parallel_zero.ipynb", 4)
    assert any("use_student(" in c.source for c in released.cells)
    ada = {e: lesson09.inputs(e, "ada", quiet=True) for e in ("stage_bytes", "zero3_wire_bytes")}
    bo = {e: lesson09.inputs(e, "bo", quiet=True) for e in ada}
    assert all(ada[e] != bo[e] for e in ada), (ada, bo)  # else copying would not show
    answers = {"stage2_gb": ("EX1", "stage_bytes", sol.stage_gb), "zero3_bytes": ("EX2", "zero3_wire_bytes",
                                                                                  sol.zero3_wire_bytes)}
    for student, whose, claimed in (("ada", "ada", ""), ("bo", "ada", "ada")):  # bo copies ada, and her id
        nb = nbformat.from_dict(released)
        for cell in nb.cells:
            if "use_student(" in cell.source:
                cell.source = f'from labkit.exercises import use_student\nuse_student("{claimed}")'
        for name, (var, exercise, solve) in answers.items():
            drawn = lesson09.inputs(exercise, whose, quiet=True)
            _answer(nb, name, f"{var} = lesson09.inputs({exercise!r}, {whose!r})\n{name} = {solve(**drawn)!r}")
        (tmp_path / "in" / student).mkdir(parents=True)
        nbformat.write(nb, tmp_path / "in" / student / "09_data_parallel_zero.ipynb")
    rows = grade.grade(tmp_path / "in", course09, tmp_path / "out")
    got = {(r["student"], r["exercise"]): r["score"] for r in rows}
    assert got == {("ada", "stage_bytes"): 1, ("ada", "zero3_wire_bytes"): 1,
                   ("bo", "stage_bytes"): 0, ("bo", "zero3_wire_bytes"): 0}


def test_inputs_are_the_lessons_own_on_your_own_and_drawn_per_student(monkeypatch, capsys):
    from labkit import exercises
    from labkit.exercises import lesson09

    monkeypatch.delenv(exercises.STUDENT_ENV, raising=False)
    assert lesson09.inputs("stage_bytes") == {"n_params": 7.5e9, "world": 64, "stage": 2}
    assert capsys.readouterr().out == ""  # the self-paced lesson prints nothing new
    drawn = [lesson09.inputs("stage_bytes", f"s{i}", quiet=True) for i in range(40)]
    assert drawn[3] == lesson09.inputs("stage_bytes", "s3", quiet=True)  # the same id, the same inputs
    assert len({tuple(d.values()) for d in drawn}) > 10
    assert all(d in lesson09.inputs.every("stage_bytes") for d in drawn)
    monkeypatch.setenv(exercises.STUDENT_ENV, "s3")
    assert exercises.use_student("s4") == "s3"  # the grader's id wins over one written in the notebook
    assert lesson09.inputs("stage_bytes") == drawn[3] and "s3" in capsys.readouterr().out
    with pytest.raises(KeyError, match="stage_bytes"):
        lesson09.inputs("stage_byte")


FIXED_INPUTS = {}  # check -> why its inputs are the lesson's for every student (none so far)


def test_every_numeric_exercise_draws_its_inputs_per_student():
    """Issue 41 item 4: each numeric exercise of every lesson (not a code exercise, whose function is checked on
    inputs drawn afresh, nor a multiple-choice one) passes its check `**EXn`, the exercise's inputs from its
    module's `inputs` table; each table names a check of its module that a lesson calls that way, and offers
    each student more than one question."""
    import importlib
    import inspect

    drawn, used = [], set()
    for path in release.lesson_notebooks():
        for call in check_calls(nbformat.read(path, as_version=4)):
            module = importlib.import_module(f"labkit.exercises.{call.module}")
            params = list(inspect.signature(getattr(module, call.check)).parameters)
            if params[:1] == ["fn"] or call.check.startswith("check_why"):
                continue
            key = call.check.removeprefix("check_")
            if any(k.arg is None for k in call.node.value.keywords):
                assert key in module.inputs.table, (call.module, key)
                used.add((call.module, key))
                drawn.append(call.check)
            else:
                assert call.check in FIXED_INPUTS, f"{path.name}: {call.check} passes no **inputs"
    tables = {(m, k): t for m in {m for m, _ in used}
              for k, t in importlib.import_module(f"labkit.exercises.{m}").inputs.table.items()}
    assert set(tables) == used  # no table the lessons do not use
    for (m, key), table in tables.items():
        assert len(importlib.import_module(f"labkit.exercises.{m}").inputs.every(key)) > 1, (m, key)
        assert set(table) <= set(inspect.signature(getattr(importlib.import_module(f"labkit.exercises.{m}"),
                                                           f"check_{key}")).parameters), (m, key)
    print(f"{len(drawn)} numeric exercises draw their inputs per student; {len(FIXED_INPUTS)} do not")


STUDENT_SCRIPT = r'''
import importlib.util, sys
from labkit.exercises import lesson00, lesson09
assert lesson09.__file__.startswith(sys.argv[2]), lesson09.__file__  # the student build's labkit
spec = importlib.util.spec_from_file_location("sol", sys.argv[1] + "/lesson00.py"); sol00 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sol00)
for call in (lambda: lesson09.zero3_wire_bytes(1e9, 8, 2), lambda: lesson00.gpt_params(None)):
    try:
        call()
        raise SystemExit("a stub returned an answer")
    except NotImplementedError as e:
        assert "Hint:" in str(e), e
assert lesson09.check_zero3_wire_bytes(3 * 7 / 8 * 2e9, n_params=1e9, world=8, bytes_per_param=2) is True
assert lesson09.check_zero3_wire_bytes(2 * 7 / 8 * 2e9, n_params=1e9, world=8, bytes_per_param=2) is False
assert lesson00.check_gpt_params(sol00.gpt_params) is True
assert lesson00.check_gpt_params(lambda cfg: 7) is False
assert lesson00.check_gpt_params(lesson00.gpt_params) is False  # the stub offered as the answer raises
assert lesson00.check_why_peak("b") is True and lesson00.check_why_peak("(B)") is True
assert lesson00.check_why_peak("a") is False and lesson00.check_why_peak("c") is False
print("student build ok")
'''


def test_student_build_stubs_answers_and_keeps_checks(tmp_path):
    notebooks = [nbformat.read(p, as_version=4) for p in release.lesson_notebooks(lessons=["00", "09"])]
    assert {c.module for nb in notebooks for c in check_calls(nb)} == {"lesson00", "lesson09"}
    student = tmp_path / "student"
    release._copy_common(student, REPO_ROOT)
    table = {}
    for module in ("lesson00", "lesson09"):
        plan = stubs.plan(module, notebooks, SOLUTIONS / f"{module}.py")
        target = student / "labkit" / "exercises" / f"{module}.py"
        sealed, _ = stubs.seal_choices(target.read_text())
        target.write_text(stubs.stub_source(sealed, module, plan.stubbed))
        table.update(plan.table)
        assert plan.kept == {}, plan.kept
    assert "zero3_wire_bytes" in stubs.plan("lesson09", notebooks, SOLUTIONS / "lesson09.py").stubbed
    recorded.dump(table, student / "labkit" / "exercises" / recorded.TABLE_FILE)
    stubbed = (student / "labkit" / "exercises" / "lesson09.py").read_text()
    assert "wire_bytes(\"all_gather\"" not in stubbed and "def check_zero3_wire_bytes" in stubbed
    done = subprocess.run([sys.executable, "-c", STUDENT_SCRIPT, str(SOLUTIONS), str(student)], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(student)), cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "✅" in done.stdout and "❌" in done.stdout and "student build ok" in done.stdout


def test_every_answer_function_is_stubbed():
    """Issue 41: no answer survives in the student build. Every public function of every exercise module that
    is not a check is stubbed, so no check the lessons call with their own objects may reach one."""
    import ast

    notebooks = [nbformat.read(p, as_version=4) for p in release.lesson_notebooks()]
    modules = sorted({c.module for nb in notebooks for c in check_calls(nb)})
    assert len(modules) == 14
    for module in modules:
        plan = stubs.plan(module, notebooks, SOLUTIONS / f"{module}.py")
        tree = ast.parse((REPO_ROOT / "labkit" / "exercises" / f"{module}.py").read_text())
        public = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)
                  and not n.name.startswith(("_", "check_"))}
        assert plan.kept == {}, (module, plan.kept)
        assert set(plan.stubbed) == public, module
        stubbed = stubs.stub_source((REPO_ROOT / "labkit" / "exercises" / f"{module}.py").read_text(), module,
                                    plan.stubbed)
        left = {n.name for n in ast.parse(stubbed).body if isinstance(n, ast.FunctionDef) and n.name in public
                and not any(isinstance(c, ast.Call) and getattr(c.func, "id", "") == "lookup" for c in ast.walk(n))}
        assert left == set(), (module, left)


FAKE_LESSON = """
def answer(config):
    return 2 * config


def check_with_objects(value, config):
    return value == answer(config)


def check_with_literals(value, n):
    return value == answer(n)
"""


def test_a_check_that_gets_the_lessons_objects_may_not_reach_an_answer(tmp_path, monkeypatch):
    """The rule fails loudly: a check the lesson calls with its own object that reaches an answer keeps that
    answer (STUBS.md names it), and the same answer reached only with literals is stubbed."""
    import importlib.util

    path = tmp_path / "lesson99.py"
    path.write_text(FAKE_LESSON)
    spec = importlib.util.spec_from_file_location("labkit.exercises.lesson99", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "labkit.exercises.lesson99", module)

    def lesson(call: str):
        return nbformat.v4.new_notebook(cells=[
            nbformat.v4.new_code_cell("CONFIG = 3"), nbformat.v4.new_markdown_cell("## Exercises"),
            nbformat.v4.new_code_cell("value = None"), nbformat.v4.new_code_cell(call)])

    kept = stubs.plan("lesson99", [lesson("lesson99.check_with_objects(value, CONFIG)")], tmp_path / "none.py")
    assert kept.stubbed == [] and list(kept.kept) == ["answer"]
    plain = stubs.plan("lesson99", [lesson("lesson99.check_with_literals(value, 3)")], tmp_path / "none.py")
    assert plain.stubbed == ["answer"] and plain.kept == {}


def _choice_checks(module):
    return [n for n in dir(module) if n.startswith("check_why")]


def test_sealed_choices_hide_the_letter_and_grade_alike(capsys):
    """Issue 41 item 2: in the student build no multiple-choice check's right letter stands in plain text (not
    as right=, not as the one letter its hints leave out), and each sealed check prints and returns what the
    original does for every letter."""
    import ast
    import importlib
    import importlib.util
    import re

    total = 0
    for path in sorted((REPO_ROOT / "labkit" / "exercises").glob("lesson*.py")):
        original = importlib.import_module(f"labkit.exercises.{path.stem}")
        text, n = stubs.seal_choices(path.read_text())
        total += n
        assert n == len(_choice_checks(original)), path.stem
        if not n:
            continue
        assert not re.search(r"right\s*=\s*['\"]", text), path.stem
        for call in (c for c in ast.walk(ast.parse(text)) if isinstance(c, ast.Call)
                     and getattr(c.func, "id", None) == "checked_choice"):
            hints = next((k.value for k in call.keywords if k.arg == "hints"), None)
            assert hints is None or all(len(k.value) == 64 for k in hints.keys), path.stem  # digests only
        spec = importlib.util.spec_from_loader(f"labkit.exercises._sealed_{path.stem}", loader=None)
        sealed = importlib.util.module_from_spec(spec)
        sealed.__package__ = "labkit.exercises"
        exec(compile(text, str(path), "exec"), sealed.__dict__)
        for check in _choice_checks(original):
            letters = next(v for k, v in vars(original).items() if k.startswith("WHY") and isinstance(v, dict))
            for letter in [*letters, "z", None]:
                want = getattr(original, check)(letter), capsys.readouterr().out
                got = getattr(sealed, check)(letter), capsys.readouterr().out
                assert got == want, (path.stem, check, letter)
    assert total == 11
