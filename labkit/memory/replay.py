"""The Ledger's result: its allocation events replayed with final tags, into a timeline and per-phase peaks.

A storage's tag is only known for sure at the end (something made in the forward pass and alive when
backward starts was saved for backward), so the Ledger records events as they happen and this replay
counts them afterwards, each storage under the tag it ended with.
"""

from __future__ import annotations

from .report import CATEGORIES, PHASES, Breakdown, Category, Measurement, Timeline


def replay(events: list[tuple[int, int]], tags: list[Category], marks: list[tuple[int, str, int]],
           baseline_sids: set, label: str = "", allocator: dict | None = None) -> Measurement:
    """events: (storage id, +bytes or -bytes) in order; tags: each storage id's final tag; marks: (event
    index, phase, step) where a phase starts (two may share an index); baseline_sids: storages live when
    tracking started. Returns the timeline, each phase's peak, the baseline and the final live bytes."""
    cur = {c: 0 for c in CATEGORIES}
    series = {c: [] for c in CATEGORIES}
    peaks: dict[str, Breakdown] = {}
    mi, phase = 0, "forward"
    baseline = Breakdown()
    for i, (sid, delta) in enumerate(events):
        while mi < len(marks) and marks[mi][0] <= i:
            phase = marks[mi][1]
            mi += 1
            start = Breakdown(dict(cur))  # a phase's peak may be its first moment
            if phase not in peaks or start.total > peaks[phase].total:
                peaks[phase] = start
        cur[tags[sid]] += delta
        for c in CATEGORIES:
            series[c].append(cur[c])
        if sid in baseline_sids and delta > 0:
            baseline.bytes[tags[sid]] += delta
        total = sum(cur.values())
        best = peaks.get(phase)
        if best is None or total > best.total:
            peaks[phase] = Breakdown(dict(cur))
    phases = {p: peaks[p] for p in PHASES if p in peaks}
    for p in peaks:
        phases.setdefault(p, peaks[p])
    if not phases:
        phases["forward"] = Breakdown(dict(cur))
    return Measurement(label=label, phases=phases, timeline=Timeline(series, [(i, p, s) for i, p, s in marks]),
                       baseline=baseline, allocator=allocator, final=Breakdown(dict(cur)))
