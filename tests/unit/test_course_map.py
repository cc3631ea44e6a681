"""The course map: prerequisites derived from the lessons' imports (one structure), sequences that respect
them, table entries that name their machine or say "not measured", and the README's copy up to date."""

from labkit.course import map as course_map
from labkit.course.lessons import Lesson, prerequisites, reachable, read_lessons


def test_prerequisite_rule_keeps_direct_needs_only():
    lessons = [Lesson("00", "a", "00.ipynb", frozenset({"memory"})),
               Lesson("01", "b", "01.ipynb", frozenset({"memory", "recompute"})),
               Lesson("02", "c", "02.ipynb", frozenset({"memory", "recompute", "optim"})),
               Lesson("03", "d", "03.ipynb", frozenset({"optim"}))]
    assert prerequisites(lessons) == {"00": (), "01": ("00",), "02": ("01",), "03": ("02",)}


def test_the_lessons_prerequisites():
    lessons = read_lessons()
    needs = prerequisites(lessons)
    assert [l.number for l in lessons] == [f"{i:02d}" for i in range(14)]
    assert needs["00"] == ()
    assert all(a < b for b, before in needs.items() for a in before)  # only earlier lessons
    assert all(needs[n] for n in needs if n != "00")  # every lesson builds on something
    assert "09" in needs["10"]  # pipeline/tensor parallel: labkit.distributed, first imported in 09
    assert "02" in needs["03"] and "05" in needs["08"]


def _all_needs(needs, n):
    return reachable(needs, n)


def test_sequences_respect_prerequisites():
    needs = prerequisites(read_lessons())
    six = [n for _, s in course_map.SIX_WEEKS for n in s]
    assert len(course_map.SIX_WEEKS) == 6 and sorted(six) == sorted(needs)  # every lesson once
    for sequence in (course_map.SIX_WEEKS, course_map.WORKSHOP):
        done = set()
        for _, session in sequence:
            for n in session:
                assert set(needs[n]) <= done | set(session[:session.index(n)]), (n, needs[n])
                done.add(n)
    workshop = {n for _, s in course_map.WORKSHOP for n in s}
    assert all(_all_needs(needs, n) <= workshop for n in workshop)


def test_entries_name_their_machine_or_say_not_measured():
    times = {"machine": {"cpu": "CPU X", "cores": 4}}
    assert course_map.cell(None, times) == "not measured"
    entry = {"seconds": 90.0, "date": "2026-01-02", "finished": True, "passed": True, "load_average_at_start": 1.5}
    assert course_map.cell(entry, times) == "1.5 min (CPU X, 4 cores, 2026-01-02, load 1.5)"
    stopped = dict(entry, finished=False, machine={"cpu": "CPU Y", "cores": 8, "gpu": "GPU Z"})
    assert course_map.cell(stopped, times).startswith("≥ 1.5 min (stopped) (CPU Y, 8 cores, GPU Z")
    text = course_map.markdown()
    stored_all = course_map.load_times()["lessons"]
    missing = any(p not in stored_all.get(n, {}) for n in stored_all for p in course_map.PROFILES)
    assert ("not measured" in text) == missing  # a profile nobody ran is shown as such, never estimated
    stored = course_map.load_times()["lessons"]["13"]["cpu"]
    assert course_map.cell(stored, course_map.load_times()) in text


def test_readme_course_map_is_the_generated_one():
    assert course_map.readme_block() == course_map.markdown(), "run: python -m labkit.course map --update"


def test_a_session_line_shows_minutes_under_one_as_measured():
    """26 s of cells is 0.4 min, not "0 min" (the format rounded a short session's time away)."""
    from labkit.course import map as cmap

    times = {"lessons": {"00": {"cpu": {"seconds": 8.3}}, "01": {"cpu": {"seconds": 17.6}}}}
    line = cmap._session_line("week 1", ["00", "01"], times, {"00": "Start here", "01": "Memory accounting: x"})
    assert "0.4 min as measured" in line, line
