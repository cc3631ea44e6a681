"""The passage data of the PEFT lesson: the words spoken in the 35 First Folio plays, in two spellings.

`passages(task)` gives balanced (passage, class, play id) rows for task="spelling" (First Folio 1623
or modern spelling) or task="genre" (comedy / history / tragedy after the Folio's catalogue), with
whole plays held out for testing. `speech_words` strips speaker names, headings and stage directions.
"""

from __future__ import annotations

import functools
import random
import re

FOLIO_GENRES = {  # modern-spelling ids without "_gut"; Troilus and Cressida (uncatalogued) and Pericles (not in the Folio) left out
    "comedy": ("tempest", "two_gentlemen_of_verona", "merry_wives_of_windsor", "measure_for_measure", "comedy_of_errors",
               "much_ado_about_nothing", "loves_labours_lost", "midsummer_nights_dream", "merchant_of_venice",
               "as_you_like_it", "taming_of_the_shrew", "alls_well_that_ends_well", "twelfth_night", "winters_tale"),
    "history": ("john", "richard_ii", "henry_iv_part_1", "henry_iv_part_2", "henry_v", "henry_vi_part_1",
                "henry_vi_part_2", "henry_vi_part_3", "richard_iii", "henry_viii"),
    "tragedy": ("coriolanus", "tragedy_of_titus_andronicus", "romeo_and_juliet", "timon_of_athens", "julius_caesar",
                "macbeth", "hamlet", "lear", "othello", "antony_and_cleopatra", "cymbeline"),
}
FOLIO_IDS = {"comedy_of_errors": "comedy_of_errours", "loves_labours_lost": "loves_labour_lost",  # where names differ
             "midsummer_nights_dream": "midsummer_nights_dreame", "alls_well_that_ends_well": "all_is_well_that_ends_well",
             "twelfth_night": "twelfe-night", "tragedy_of_titus_andronicus": "titus_andronicus",
             "antony_and_cleopatra": "anthonie_and_cleopatra"}
GENRES = tuple(sorted(FOLIO_GENRES))
TASK_CLASSES = {"spelling": ("modern", "folio"), "genre": GENRES}


_FOLIO_SKIP = re.compile(r"\s*(Enter|Exit|Exeunt|Actus|Scena|Scoena|Scaena|Flourish|Alarum|Manet|Sennet)\b", re.I)


def speech_words(text: str, folio: bool = False) -> list[str]:
    """The words spoken in a play, without speaker names, headings and (most) stage directions.

    Modern texts: blocks "SPEAKER.\nlines", [directions], ACT/SCENE headings. Folio texts: "  Spk. line",
    unbracketed "Enter ..."/"Exit" lines, "Actus Primus. Scoena Prima." headings, a title line first.
    """
    words = []
    if folio:
        for line in text.splitlines()[1:]:
            if line.strip() and not _FOLIO_SKIP.match(line):
                words += re.sub(r"^\s*[A-Z][A-Za-z]{0,7}\.\s+(?=\S)", "", line).split()  # a leading "Ham. "
        return words
    m = re.search(r"^ACT\b", text, re.M | re.I)
    for block in re.split(r"\n\s*\n", text[m.start():] if m else text):
        lines = [s.strip() for s in block.splitlines() if s.strip()]
        lines = [s for s in lines if not s.startswith("[") and not re.match(r"(ACT|SCENE)\b", s, re.I)]
        if len(lines) >= 2 and lines[0].endswith(".") and len(lines[0].split()) <= 4:
            lines = lines[1:]  # "HAMLET." or "Ber.": the speaker
        for s in lines:
            words += s.split()
    return words


@functools.lru_cache(maxsize=None)
def _play_words(play_id: str) -> tuple[str, ...]:
    from labkit.data import read_play

    return tuple(speech_words(read_play(play_id), folio=play_id.endswith("_f")))


def passages(task: str = "spelling", words: int = 32, train_per_class: int = 200, test_per_class: int = 60,
             test_every: int = 4):
    """(train, test): lists of (passage, class index, play id), balanced; test passages come from held-out plays.

    The split is deterministic: in each genre's alphabetical play list, plays at index test_every-1,
    2*test_every-1, ... are held out (both spellings); passages are consecutive `words`-word chunks,
    drawn by a seeded shuffle. Classes: TASK_CLASSES[task].
    """
    if task not in TASK_CLASSES:
        raise ValueError(f"unknown task {task!r}: choose 'spelling' (Folio or modern) or 'genre' (comedy/history/tragedy)")
    for name, v in (("words", words), ("train_per_class", train_per_class), ("test_per_class", test_per_class),
                    ("test_every", test_every)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (2 if name == "test_every" else 1):
            raise ValueError(f"{name} must be a positive integer{' of at least 2' if name == 'test_every' else ''}, got {v!r}")
    pools = {c: ([], []) for c in TASK_CLASSES[task]}  # class -> (train plays' passages, held-out plays')
    for genre in GENRES:
        for j, play in enumerate(sorted(FOLIO_GENRES[genre])):
            ids = {"modern": play + "_gut", "folio": FOLIO_IDS.get(play, play) + "_gut_f"}
            for cls, pid in ids.items() if task == "spelling" else [(genre, ids["modern"])]:
                w = _play_words(pid)
                pools[cls][j % test_every == test_every - 1].extend(
                    (" ".join(w[i:i + words]), TASK_CLASSES[task].index(cls), pid) for i in range(0, len(w) - words + 1, words))
    train, test = [], []
    for cls, (tr, te) in pools.items():
        for pool, n, out in ((tr, train_per_class, train), (te, test_per_class, test)):
            random.Random(f"{cls}{words}").shuffle(pool)
            out += pool[:n]
    return train, test
