"""Grade a folder of submitted notebooks with nbgrader's autograde, in the grader build, and write one score
table (CSV and JSON): a row per student and exercise.

    python -m labkit.course grade SUBMISSIONS [--course release/grader] [--out scores]

SUBMISSIONS/<student>/<NN_lesson>.ipynb: one folder per student, each lesson's notebook under its own name.
autograde runs every cell (a cell that raises scores 0, the others are still graded) with the graded cells
restored from the source, so a learner cannot edit a check away. Each submission is graded with its folder's
name as the student id ($LABKIT_STUDENT, one autograde per submission of a lesson whose exercises draw inputs):
a numeric exercise's hidden check draws that student's inputs (labkit.exercises.Inputs), so an answer copied
from a classmate, made for other inputs, scores 0.
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import nbformat

from labkit.exercises import STUDENT_ENV

from .release import nbgrader, per_student

FIELDS = ("student", "lesson", "exercise", "score", "max_score")


def collect(submissions: Path, course: Path) -> list[tuple[str, str]]:
    """Copy each submission into nbgrader's submitted/<student>/<assignment>/; the (student, lesson) pairs."""
    known = {p.name for p in (course / "source").iterdir()}
    pairs = []
    for student in sorted(p for p in submissions.iterdir() if p.is_dir()):
        for nb in sorted(student.glob("*.ipynb")):
            if nb.stem not in known:
                raise ValueError(f"{nb}: no lesson {nb.stem!r} in {course / 'source'} (have {sorted(known)})")
            target = course / "submitted" / student.name / nb.stem
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy2(nb, target / nb.name)
            pairs.append((student.name, nb.stem))
    if not pairs:
        raise ValueError(f"{submissions}: no <student>/<lesson>.ipynb files")
    return pairs


def scores(course: Path, pairs: list[tuple[str, str]]) -> list[dict]:
    """Every graded cell's score from nbgrader's gradebook (autograde's results)."""
    from nbgrader.api import Gradebook

    rows = []
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        for student, lesson in pairs:
            submission = gb.find_submission(lesson, student)
            for notebook in submission.notebooks:
                for grade in sorted(notebook.grades, key=lambda g: g.cell.name):
                    rows.append({"student": student, "lesson": lesson, "exercise": grade.cell.name,
                                 "score": float(grade.score), "max_score": float(grade.max_score)})
    return rows


def write(rows: list[dict], out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "scores.csv", "w", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        w.writeheader()
        w.writerows(rows)
    totals: dict[str, dict] = {}
    for r in rows:
        t = totals.setdefault(r["student"], {"score": 0.0, "max_score": 0.0, "exercises": {}})
        t["score"] += r["score"]
        t["max_score"] += r["max_score"]
        t["exercises"][f"{r['lesson']}/{r['exercise']}"] = r["score"]
    (out / "scores.json").write_text(json.dumps({"rows": rows, "students": totals}, indent=1) + "\n")
    return out / "scores.csv", out / "scores.json"


def grade(submissions: Path, course: Path, out: Path) -> list[dict]:
    """Autograde every submission and write scores.csv and scores.json under `out`."""
    if not (course / "nbgrader_config.py").is_file():
        raise ValueError(f"{course}: not a grader build (run `make release` first)")
    pairs = collect(submissions, course)
    for lesson in sorted({lesson for _, lesson in pairs}):
        source = nbformat.read(course / "source" / lesson / f"{lesson}.ipynb", as_version=4)
        if not per_student(source):  # the same inputs for everyone: one autograde for all its students
            nbgrader(["autograde", lesson, "--force"], course)
            continue
        for student in sorted(s for s, l in pairs if l == lesson):  # its kernel draws that student's inputs
            nbgrader(["autograde", lesson, "--student", student, "--force"], course, env={STUDENT_ENV: student})
    rows = scores(course, pairs)
    write(rows, out)
    return rows
