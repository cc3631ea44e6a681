"""For a course: the course map, the two release builds and grading (python -m labkit.course --help).

    python -m labkit.course map [--update]             the course map (lessons, prerequisites, minutes, sequences)
    python -m labkit.course release [--out release]    release/student/ and release/grader/ (nbgrader's layout)
    python -m labkit.course grade SUBMISSIONS          one score table (CSV, JSON) per student and exercise
    python -m labkit.course site [--lessons 00,09]     the lessons as an HTML book, in build/site/ (make site)

Modules: exercises (where a lesson's exercises and checks are), stubs (the student build's answer stubs),
release (the builds), grade (nbgrader's autograde and the score table), lessons and map (the course map), site
(the HTML book).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m labkit.course", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("map", help="print the course map as markdown")
    m.add_argument("--update", action="store_true", help="write it into README.md and lesson 00 as well")
    r = sub.add_parser("release", help="write the student and grader builds")
    r.add_argument("--out", type=Path, default=Path("release"))
    r.add_argument("--lessons", help="comma-separated lesson numbers (default: all), e.g. 00,09")
    g = sub.add_parser("grade", help="autograde SUBMISSIONS/<student>/<lesson>.ipynb with nbgrader")
    g.add_argument("submissions", type=Path)
    g.add_argument("--course", type=Path, default=Path("release/grader"), help="the grader build")
    g.add_argument("--out", type=Path, default=Path("scores"), help="folder for scores.csv and scores.json")
    s = sub.add_parser("site", help="build the lessons as an HTML book (Jupyter Book) in build/site/")
    s.add_argument("--lessons", help="comma-separated lesson numbers (default: all), e.g. 00,09")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "release":
            from .release import build

            lessons = args.lessons.split(",") if args.lessons else None
            report = build(args.out.resolve(), lessons=lessons)
            print(f"wrote {args.out}/student and {args.out}/grader; stubbed answers: "
                  f"{sum(len(r['stubbed']) for r in report.values())} ({args.out}/STUBS.md lists them)")
        elif args.command == "grade":
            from .grade import grade

            rows = grade(args.submissions.resolve(), args.course.resolve(), args.out)
            print(f"graded {len({r['student'] for r in rows})} students, {len(rows)} exercise scores: "
                  f"{args.out}/scores.csv, {args.out}/scores.json")
        elif args.command == "site":
            from .site import build as build_site

            print(f"labkit.course site: {build_site(lessons=args.lessons.split(',') if args.lessons else None)}")
        else:
            from .map import main as map_main

            return map_main(update=args.update)
    except (ValueError, RuntimeError) as e:
        print(f"labkit.course {args.command}: {e}", file=sys.stderr)
        return 2
    return 0
