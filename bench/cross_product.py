"""Every combination of the techniques, on the tiny presets: estimated, or refused with a key.

    python bench/cross_product.py [--measure N] [--model gpt2-tiny]

The grid is the issue's cross product: layout (one device, data parallel, ZeRO-1/2/3, 2 pipeline stages,
2 tensor-parallel ranks) x checkpoint policy x PEFT (LoRA, QLoRA, LISA) x optimizer (8-bit, GaLore, paged,
offload, step in backward, or micro-batches) x loss (plain, torchtune's 4 chunks), for gpt2-tiny and
llama-tiny at batch 4, sequence 32. Each combination is estimated, or refused: `Refused` carries a
`Refusal` key (labkit.estimate.refusal), INCOMPATIBLE (the techniques do not run together) or NOT_ESTIMATED
(a gap). The table counts each key; the last line sums them: `cross_product: combinations=N estimated=E
incompatible=I gaps=G`.

--measure N: measure N of the estimated single-device combinations (every k-th, with the ledger:
labkit.run.measure_step) and print the largest category error in % of the measured peak.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import sys

MODELS = ("gpt2-tiny", "llama-tiny")
BATCH, SEQ = 4, 32
# every factor: level name -> the Recipe fields it sets
LAYOUTS = {"one device": {}, "dp=2": dict(dp=2), "ZeRO-1": dict(dp=2, zero=1), "ZeRO-2": dict(dp=2, zero=2),
           "ZeRO-3": dict(dp=2, zero=3), "pp=2": dict(pp=2, micro_batch=2), "tp=2": dict(tp=2)}
CHECKPOINTS = {"none": {}, "full": dict(checkpoint="full"), "selective": dict(checkpoint="selective"),
               "sqrt": dict(checkpoint="sqrt")}
PEFTS = {"full": {}, "LoRA": dict(lora_rank=8), "QLoRA": dict(lora_rank=8, quant="nf4"),
         "LISA": dict(lisa_layers=1)}
OPTIMIZERS = {"adamw": {}, "8-bit": dict(optimizer="adamw8bit"), "GaLore": dict(optimizer="galore", rank=8),
              "paged": dict(paged_states=True), "offload": dict(optimizer_offload="cpu"),
              "step in backward": dict(step_in_backward=True), "micro-batches": dict(micro_batch=2)}
LOSSES = {"plain": {}, "4 chunks": dict(loss_chunks=4)}
FACTORS = (LAYOUTS, CHECKPOINTS, PEFTS, OPTIMIZERS, LOSSES)


def combinations(models=MODELS):
    """(model, (level names), Recipe fields) for every cell of the grid (a pipeline's micro-batches are
    its own: the micro-batch optimizer level is left out there)."""
    for model in models:
        for levels in itertools.product(*(f.items() for f in FACTORS)):
            names = tuple(n for n, _ in levels)
            kw = {}
            for _, fields in levels:
                if "micro_batch" in fields and "micro_batch" in kw:
                    break
                kw.update(fields)
            else:
                yield model, names, kw


def classify(model: str, kw: dict):
    """('estimated', Estimate) or ('refused', Refused); any other error propagates (a refusal without a key
    is a defect)."""
    from labkit.estimate import Recipe, estimate
    from labkit.estimate.refusal import Refused

    try:
        return "estimated", estimate(Recipe.of(model, BATCH, SEQ, **kw))
    except Refused as e:
        return "refused", e


def worst_category(e, m) -> tuple[float, str]:
    """The largest |estimate - measurement| over the categories at the peak, in % of the measured peak."""
    from labkit.memory import CATEGORIES

    errs = [(abs(e.peak[c] - m.peak[c]) / m.peak.total * 100, c.name) for c in CATEGORIES]
    return max(errs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measure", type=int, default=0, help="measure N estimated single-device combinations")
    ap.add_argument("--model", choices=MODELS, action="append", help="only this preset (repeatable)")
    args = ap.parse_args(argv)
    from labkit.estimate.refusal import Kind

    counts, estimated = collections.Counter(), []
    grid = list(combinations(tuple(args.model or MODELS)))
    for k, (model, names, kw) in enumerate(grid):
        what, got = classify(model, kw)
        if what == "estimated":
            counts["estimated"] += 1
            estimated.append((model, names, kw))
        else:
            counts[got.refusal] += 1
        if k % 500 == 499:
            print(f"  ... {k + 1} of {len(grid)}", file=sys.stderr)
    print(f"{'combinations':<64} {len(grid):>6}")
    print(f"{'estimated':<64} {counts['estimated']:>6}")
    for kind in Kind:
        rows = sorted(((r, n) for r, n in counts.items() if r != "estimated" and r.kind is kind),
                      key=lambda x: -x[1])
        print(f"refused, {kind.value}:")
        for r, n in rows:
            print(f"  {r.title:<62} {n:>6}")
    gaps = sum(n for r, n in counts.items() if r != "estimated" and r.kind is Kind.NOT_ESTIMATED)
    inc = sum(n for r, n in counts.items() if r != "estimated" and r.kind is Kind.INCOMPATIBLE)
    if args.measure:
        from labkit.estimate import Recipe
        from labkit.run import measure_step

        single = [c for c in estimated if c[1][0] == "one device"]
        step = max(1, len(single) // args.measure)
        print(f"\nmeasured (every {step}th single-device combination; worst category, % of the peak):")
        worst = 0.0
        for model, names, kw in single[::step][:args.measure]:
            r = Recipe.of(model, BATCH, SEQ, **kw)
            from labkit.estimate import estimate

            err, cat = worst_category(estimate(r), measure_step(r))
            worst = max(worst, err)
            print(f"  {model:<11} {' / '.join(names[1:]):<54} {err:5.2f} % {cat}")
        print(f"worst category error: {worst:.2f} %")
    print(f"cross_product: combinations={len(grid)} estimated={counts['estimated']} incompatible={inc} "
          f"gaps={gaps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
