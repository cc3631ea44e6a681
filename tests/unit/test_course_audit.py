"""The leak audit (labkit/course/audit.py, issue 41): the student who reads the code instead of doing the work.

Against this repository's exercise modules (answers and letters in plain text; lessons 09 and 11)
the audit
obtains answers, so it can fail; against the student build it obtains none but those
labkit.course.audit.LEAKS lists (release/LEAKS.md),
and each of those it still obtains. Lessons 05, 09 and 13 (numbers, code exercises, a why-question,
library
shortcuts; their inputs are cheap to rebuild): the whole course's audit takes far longer than a
unit test.
"""

import json
import os
import subprocess
import sys

import nbformat
import pytest

from labkit.course import audit, release
from labkit.paths import REPO_ROOT

LESSONS = "05,09,13"


def _audit(labkit_root, lessons: str = LESSONS) -> dict:
    done = subprocess.run([sys.executable, "-m", "labkit.course.audit", str(REPO_ROOT), lessons],
                          capture_output=True, text=True, cwd=labkit_root, timeout=900,
                          env=dict(os.environ, PYTHONPATH=str(labkit_root), LABKIT_SMOKE="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    dest = tmp_path_factory.mktemp("student")
    release._copy_common(dest, REPO_ROOT)
    notebooks = [nbformat.read(p, as_version=4) for p in release.lesson_notebooks(lessons=LESSONS.split(","))]
    release.student_exercises(dest, notebooks)
    return dest


def test_the_audit_finds_answers_left_in_plain_text():
    found = _audit(REPO_ROOT, "09,11")  # lessons whose inputs no answer function takes minutes over
    calls = {(x["lesson"], x["exercise"]): x["call"] for x in found["leaks"]}
    assert found["audited"] == 4
    assert calls[("09", "zero3_wire_bytes")].startswith("labkit.exercises.lesson09.zero3_wire_bytes(")
    assert calls[("11", "why_memory")] == "the letter 'b' read from check_why_memory's source"
    assert calls[("11", "dgc_bytes")] == "labkit.distributed.compression.dgc_wire_bytes"  # a code exercise


def test_the_student_build_leaks_only_what_leaks_md_lists(student):
    found = _audit(student)
    assert found["audited"] == 11
    got = {(x["lesson"], x["exercise"]) for x in found["leaks"]}
    assert not [x for x in found["leaks"] if x["call"].startswith("labkit.exercises") or "letter" in x["call"]]
    listed = {k for k in audit.LEAKS if k[0] in LESSONS.split(",")}
    assert got == listed, found["leaks"]
    text = audit.leaks_markdown()
    assert all(f"lesson {lesson}, `{exercise}`" in text for lesson, exercise in audit.LEAKS)
