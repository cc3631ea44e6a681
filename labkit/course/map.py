"""The course map: each lesson's prerequisites (labkit/course/lessons.py), the minutes it took to run at each
profile as data/lesson_times.json stored them (bench/lesson_times.py measures; each entry names its machine,
date and load), and two suggested sequences. `python -m labkit.course map --update` rewrites the README's copy;
lesson 00 renders it when it runs. A profile without a measurement says "not measured"; nothing is estimated.
"""

from __future__ import annotations

import json
from pathlib import Path

from labkit.paths import REPO_ROOT

from .lessons import read_lessons, prerequisites

PROFILES = ("smoke", "cpu", "small-gpu", "big-gpu")  # bench/lesson_times.py's
SESSION_MINUTES = 120
# Suggested sequences: (session, lessons). tests/unit/test_course_map.py holds each to the prerequisites.
SIX_WEEKS = (("week 1", ("00", "01")), ("week 2", ("02", "03")), ("week 3", ("04", "05")),
             ("week 4", ("06", "07", "08")), ("week 5", ("09", "10", "11")), ("week 6", ("12", "13")))
WORKSHOP = (("morning", ("00", "01", "02", "03")), ("afternoon", ("05", "08", "13")))
BEGIN, END = "<!-- course-map: begin (python -m labkit.course map --update) -->", "<!-- course-map: end -->"


def load_times(root: Path = REPO_ROOT) -> dict:
    path = root / "data" / "lesson_times.json"
    return json.loads(path.read_text()) if path.is_file() else {"lessons": {}}


def _machine(entry: dict, times: dict) -> str:
    m = entry.get("machine") or times.get("machine")  # older entries: the file's machine
    if not m:
        return "machine not recorded"
    gpu = f", {m['gpu']}" if m.get("gpu") else ""
    return f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores{gpu}"


def cell(entry: dict | None, times: dict) -> str:
    """One table entry: minutes as measured, with its machine, date and load; or "not measured"."""
    if not entry or entry.get("seconds") is None:
        return "not measured"
    minutes = f"{entry['seconds'] / 60:.1f} min"
    if not entry.get("finished", True):
        minutes = f"≥ {minutes} (stopped)"
    if entry.get("passed") is False:
        minutes += " (failed)"
    load = entry.get("load_average_at_start")
    where = f"{_machine(entry, times)}, {entry.get('date', 'undated')}" + (f", load {load:g}" if load is not None
                                                                            else ", load not recorded")
    return f"{minutes} ({where})"


def _session_line(name: str, numbers, times: dict, titles: dict) -> str:
    entries = [times["lessons"].get(n, {}).get("cpu") for n in numbers]
    names = ", ".join(f"{n} {titles[n].split(':')[0]}" for n in numbers)
    if any(not e or e.get("seconds") is None or not e.get("finished", True) for e in entries):
        run = "running the cells at the cpu profile: not measured for every lesson"
    else:
        total = sum(e["seconds"] for e in entries) / 60
        run = f"running the cells at the cpu profile: {total:.1f} min as measured"  # .0f showed 26 s as "0 min"
        if total > SESSION_MINUTES:
            run += f", more than the {SESSION_MINUTES} min session: run them at the smoke profile in class"
    return f"- **{name}**: {names} ({run})"


def markdown(root: Path = REPO_ROOT) -> str:
    lessons = read_lessons(root)
    needs = prerequisites(lessons)
    times = load_times(root)
    titles = {l.number: l.title for l in lessons}
    rows = ["| lesson | prerequisites | " + " | ".join(PROFILES) + " |", "|---|---|" + "---|" * len(PROFILES)]
    for l in lessons:
        entry = times["lessons"].get(l.number, {})
        rows.append(f"| {l.number} {l.title} | {', '.join(needs[l.number]) or '-'} | "
                    + " | ".join(cell(entry.get(p), times) for p in PROFILES) + " |")
    text = ["Prerequisites: a lesson needs the lesson that first imports a labkit package it imports "
            "(labkit/course/lessons.py; direct ones only). Minutes: the wall time to run every cell "
            "(`bench/lesson_times.py`, stored in data/lesson_times.json), on the machine, date and load "
            "average named; reading and exercises come on top. A high load means the machine was shared.", "",
            *rows, "", f"A 6-week course lab, one {SESSION_MINUTES // 60}-hour session a week:", "",
            *(_session_line(n, s, times, titles) for n, s in SIX_WEEKS), "",
            "A one-day workshop (single device, ending on the planner):", "",
            *(_session_line(n, s, times, titles) for n, s in WORKSHOP)]
    return "\n".join(text)


def update_readme(root: Path = REPO_ROOT) -> bool:
    """Rewrite the README's course map between its markers; True when it changed."""
    path = root / "README.md"
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{path}: no course-map markers ({BEGIN} ... {END})")
    head, rest = text.split(BEGIN, 1)
    new = head + BEGIN + "\n" + markdown(root) + "\n" + END + rest.split(END, 1)[1]
    path.write_text(new)
    return new != text


def readme_block(root: Path = REPO_ROOT) -> str:
    text = (root / "README.md").read_text()
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")


def show() -> None:
    """Lesson 00's cell: the course map as rendered markdown (plain text outside a notebook)."""
    if not (REPO_ROOT / "notebooks").is_dir():
        print("The course map needs the repository's notebooks/ (labkit runs from an install without them).")
        return
    try:
        from IPython.display import Markdown, display

        display(Markdown(markdown()))
    except ImportError:
        print(markdown())


def main(update: bool = False) -> int:
    print(markdown())
    if update:
        print("README.md " + ("updated" if update_readme() else "already up to date"))
    return 0
