"""Automatic checks for the notebooks' exercises: each prints ✅ or ❌ with what to look at, and returns True/False.

A check never raises on a wrong or missing answer, so a notebook with unanswered exercises still runs
to the end. Expected values are always computed from the library (labkit.memory), never typed in.
"""

from __future__ import annotations

import hashlib
import itertools
import numbers
import os
import random
from dataclasses import dataclass

PLACEHOLDERS = (None, Ellipsis)  # what an answer cell holds before the learner fills it in


def unanswered(answer) -> bool:
    """True for the placeholders an answer cell starts with: None or `...`."""
    return any(answer is p for p in PLACEHOLDERS)


def passed(message: str) -> bool:
    print(f"✅ {message}")
    return True


def failed(message: str) -> bool:
    print(f"❌ {message}")
    return False


def not_answered(name: str) -> bool:
    return failed(f"{name}: not answered yet (replace None with your answer and run the cell again)")


def number(answer, name: str) -> float | None:
    """The answer as a float, or None after printing why it is not a usable number."""
    if unanswered(answer):
        not_answered(name)
        return None
    if isinstance(answer, bool) or not isinstance(answer, numbers.Real):
        failed(f"{name}: expected a number, got {type(answer).__name__} {answer!r}")
        return None
    return float(answer)


def integer(answer, name: str) -> int | None:
    """The answer as an int (a float like 12.0 is accepted), or None after printing why not."""
    value = number(answer, name)
    if value is None:
        return None
    if value != int(value):
        failed(f"{name}: expected a whole number, got {answer!r}")
        return None
    return int(value)


def close(answer: float, expected: float, rel: float = 0.0, abs_: float = 0.0) -> bool:
    """|answer - expected| within abs_ or within rel of expected."""
    return abs(answer - expected) <= max(abs_, rel * abs(expected))


def show_guess(what: str, guess, predicted: float, measured: float | None = None, unit: float = 1.0,
               unit_name: str = "") -> bool:
    """Guess, prediction and measurement side by side (the learner commits to a guess before the lesson
    predicts). `guess` is in `unit`s (e.g. GiB with unit=2**30); predicted and measured are in base units
    (bytes). Returns True when a guess was given; never raises, so an unanswered guess does not stop a notebook."""
    def f(v: float) -> str:
        return f"{v / unit:,.3g} {unit_name}".strip()

    line = f"{what}: prediction {f(predicted)}" + (f", measurement {f(measured)}" if measured is not None else "")
    if unanswered(guess):
        print(f"✍️  {line}. (You did not write a guess above: commit to one before reading on, next time.)")
        return False
    value = number(guess, what)
    if value is None:
        return False
    ratio = value * unit / predicted if predicted else float("inf")
    verdict = ("within 20 % of the prediction" if 0.8 <= ratio <= 1.25 else
               f"{ratio:.2g}x the prediction: look for the term you {'over' if ratio > 1 else 'under'}-counted")
    print(f"✍️  {line}; your guess {f(value * unit)}: {verdict}.")
    return True


@dataclass(frozen=True)
class Sealed:
    """A multiple-choice question's right letter as the student build ships it: a salted SHA-256 digest, not the
    letter (labkit.course.stubs writes these; this repository and the grader build keep the letters)."""

    salt: str
    digest: str

    @staticmethod
    def of(letter: str, salt: str) -> "Sealed":
        return Sealed(salt, Sealed.digest_of(letter, salt))

    @staticmethod
    def digest_of(letter: str, salt: str) -> str:
        return hashlib.sha256(f"{salt}:{letter}".encode()).hexdigest()

    def matches(self, choice: str) -> bool:
        return Sealed.digest_of(choice, self.salt) == self.digest


def checked_choice(answer, what: str, options: dict, right: "str | Sealed", praise: str, hints: dict | None = None,
                   otherwise: str = "") -> bool:
    """A "why" question with lettered options: ✅ `praise` for the right letter (a letter, or in the student build
    a `Sealed` digest of it); ❌ the wrong letter's hint from `hints` (else `otherwise`), each pointing at what to
    look at, never at the answer."""
    if unanswered(answer):
        return not_answered(what)
    choice = str(answer).strip().lower().strip("()")
    if choice not in options:
        return failed(f"{what}: answer with one of {', '.join(options)}")
    sealed = isinstance(right, Sealed)  # then the hints' keys are sealed with the same salt
    if right.matches(choice) if sealed else choice == right:
        return passed(praise)
    return failed((hints or {}).get(Sealed.digest_of(choice, right.salt) if sealed else choice, otherwise))


# ---- per-student inputs ------------------------------------------------------------------------------------
STUDENT_ENV = "LABKIT_STUDENT"  # the student id a course sets; the grader sets it to the submission's folder name


def student() -> str | None:
    """The student id the exercises' inputs are drawn from: $LABKIT_STUDENT, or None for a learner on their own."""
    return os.environ.get(STUDENT_ENV) or None


def use_student(student_id: str) -> str | None:
    """Set the id a course build's exercises draw their inputs from (the cell the release adds at the start of
    every lesson's exercises calls it). When grading, the grader has set the id from the submission's folder and
    that one wins: an id written here cannot borrow a classmate's inputs."""
    given = str(student_id or "").strip()
    current = student()
    if current and given and given != current:
        print(f"Your student id is {current!r} here (set by your course, not {given!r}).")
    elif not current and given:
        os.environ[STUDENT_ENV] = current = given
    if current:
        print(f"Exercises' inputs drawn for student {current!r}: answer for yours, shown in each exercise.")
    else:
        print("No student id: the exercises use the lesson's own inputs. In a graded course, write yours above; "
              "the grader draws your inputs from it.")
    return current


class Drawn(dict):
    """One exercise's inputs: a dict (passed to the check as `**inputs`) whose keys also read as attributes."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __repr__(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.items())


class Inputs:
    """A lesson's numeric exercises' inputs, one table per exercise (its key: the check's name without
    `check_`), each input a tuple of choices whose first is the lesson's own.

    On your own (no student id) every exercise takes the lesson's own inputs; in a course each student draws
    each input from its choices by a hash of (student id, lesson, exercise), so an answer copied from a
    classmate answers another question. The grader draws again from the id it grades, whatever the notebook
    says (labkit/course/release.py)."""

    def __init__(self, lesson: str, table: dict[str, dict[str, tuple]]):
        self.lesson = lesson.rsplit(".", 1)[-1]
        self.table = table

    def __call__(self, exercise: str, student_id: str | None = None, quiet: bool = False) -> Drawn:
        if exercise not in self.table:
            raise KeyError(f"{self.lesson} has no exercise inputs named {exercise!r} (have {sorted(self.table)})")
        choices = self.table[exercise]
        sid = student_id if student_id is not None else student()
        if not sid:
            return Drawn({k: c[0] for k, c in choices.items()})
        seed = hashlib.sha256(f"{sid}/{self.lesson}/{exercise}".encode()).digest()
        rng = random.Random(int.from_bytes(seed[:8], "big"))
        drawn = Drawn({k: rng.choice(c) for k, c in choices.items()})
        if not quiet:
            print(f"Your inputs for this exercise (student {sid!r}): {drawn!r}")
        return drawn

    def every(self, exercise: str) -> list[Drawn]:
        """Every combination of the exercise's choices (what the student build records answers for)."""
        keys = list(self.table[exercise])
        return [Drawn(zip(keys, combo)) for combo in itertools.product(*(self.table[exercise][k] for k in keys))]
