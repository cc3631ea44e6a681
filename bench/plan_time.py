"""How long the planner searches, on the standard recipes of issue 43 (wall clock on this machine).

    python bench/plan_time.py [--repeat N]

Each row: the command's arguments, the seconds `labkit.plan.plan` took (the best of N runs, each in this
process with the estimator's walk cache emptied first, so every run searches from scratch), the plans found
and the first plan's method and peak. A figure, not a test: these machines are noisy.
"""

from __future__ import annotations

import argparse
import time

from labkit.estimate import predict
from labkit.memory import fmt_bytes
from labkit.plan import SearchOptions, plan

CASES = [  # (label, plan's arguments)
    ("llama2-70b, 8 x 80GB, batch 8 x 2048", dict(model="llama2-70b", devices=8, memory="80GB", batch=8, seq=2048)),
    ("llama2-70b, 8 x 80GB, --peft", dict(model="llama2-70b", devices=8, memory="80GB", batch=8, seq=2048,
                                          options=SearchOptions(peft=True))),
    ("llama2-7b, 1 x 24GB, batch 4 x 512", dict(model="llama2-7b", memory="24GB", batch=4, seq=512)),
]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=1, help="runs per case; the best is printed (default 1)")
    args = ap.parse_args(argv)
    print(f"{'case':40} {'seconds':>8}  plans  first plan")
    for label, kw in CASES:
        best, plans = float("inf"), []
        for _ in range(max(1, args.repeat)):
            predict._WALKS.clear()
            t = time.perf_counter()
            plans = plan(**kw)
            best = min(best, time.perf_counter() - t)
        first = f"{plans[0].method}, {fmt_bytes(plans[0].peak)}" if plans else "no plan fits"
        print(f"{label:40} {best:8.1f}  {len(plans):5d}  {first}", flush=True)


if __name__ == "__main__":
    main()
