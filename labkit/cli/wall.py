"""`python -m labkit wall`: which models fit which GPU budgets, for full fine-tuning, LoRA and QLoRA."""

from __future__ import annotations

import json
import math
import re

from labkit.memory.units import fmt_bytes

from .common import (MAX_WALL_LAYERS, UNITS_NOTE, _check_peak, _cli_words, _items, _positive, _table, check_model,
                     read_model)

_NUMBER = re.compile(r"([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")  # no nan, inf or hex


def _count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _budgets(parser, text: str) -> list:
    """--budgets: GiB, each at least one byte and at most 2**64 bytes (2**34 GiB)."""
    out = []
    for item in _items(parser, "--budgets", text):
        b = float(item) if _NUMBER.fullmatch(item) else math.nan
        if not (2**-30 <= b <= 2**34):
            parser.error(f"--budgets must be numbers of GiB from 2**-30 (one byte) to 2**34 (2**64 bytes), "
                         f"got {item!r}")
        out.append(int(b) if b.is_integer() else b)
    if len(set(out)) < len(out):
        parser.error(f"--budgets gives one budget twice in {text!r}")
    return out


def format_wall(rows: list[dict], args) -> str:
    budgets = list(rows[0]["fits"]) if rows else []
    methods = getattr(args, "methods", "full")
    head = [f"B={args.batch} S={args.seq} {args.optimizer} on {args.device}; full fine-tuning in {args.dtype}"
            + (f"; LoRA/QLoRA: rank {args.lora_rank} on all linear layers but the head, frozen base in bf16 "
               "(QLoRA: NF4 with double quantization)" if methods != "full" else "")
            + f": predicted peak vs budget ({UNITS_NOTE})", ""]
    table = [["model", "method", "params", "peak", "peak phase"] + [f"{b:g} GiB" for b in budgets]]
    for r in rows:
        table.append([r["model"], r["method"], _count(r["n_params"]), fmt_bytes(r["peak"]), r["peak_phase"]]
                     + ["fits" if r["fits"][b] else "no" for b in budgets])
    return "\n".join(head) + _table(table, right={2, 3})


def cmd_wall(args, parser) -> int:
    from labkit.estimate.wall import METHODS, default_models, fit_table

    _positive(parser, "--batch", args.batch)
    _positive(parser, "--seq", args.seq)
    _positive(parser, "--lora-rank", args.lora_rank)
    models = _items(parser, "--models", args.models) if args.models is not None else None
    budgets = _budgets(parser, args.budgets)
    methods = _items(parser, "--methods", args.methods)
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"--methods: unknown method {unknown[0]!r}; choose from {', '.join(METHODS)}")
    if args.lora_rank is not None and methods == ["full"]:
        parser.error(f"--lora-rank {args.lora_rank} is for the lora and qlora methods, not --methods full alone")
    if args.dtype is not None and "full" not in methods:
        parser.error(f"--dtype {args.dtype} is full fine-tuning's precision (LoRA and QLoRA keep a bf16 base): "
                     "add full to --methods")
    if args.optimizer.startswith("galore"):
        parser.error(f"--optimizer {args.optimizer} needs a rank, which wall does not take: use "
                     "`labkit estimate --optimizer galore --rank R`")
    args.lora_rank = 16 if args.lora_rank is None else args.lora_rank
    args.dtype = "mixed-bf16" if args.dtype is None else args.dtype
    models = models or default_models()
    checked = [check_model(text) for text in models]
    if sum(n for _, n in checked) > MAX_WALL_LAYERS:
        parser.error(f"--models have {sum(n for _, n in checked)} layers in all, more than {MAX_WALL_LAYERS} "
                     "(twice the most one model may have): compare fewer or shallower models")
    rows = []
    for text, (model, _) in zip(models, checked):  # each model read once for all its methods
        spec = read_model(model, text)
        try:
            new = fit_table([spec], budgets, args.batch, args.seq, args.dtype, args.optimizer, args.device,
                            methods=methods, lora_rank=args.lora_rank)
        except ValueError as err:  # fit_table names the model by its spec: name it as typed
            raise ValueError(f"{text}: {_cli_words(str(err.__cause__ or err))}") from err
        for r in new:
            _check_peak(r["peak"], f"{text} ({r['method']}) with --batch {args.batch} --seq {args.seq}")
            r["model"] = text
        rows += new
    if args.json:
        print(json.dumps({"batch": args.batch, "seq": args.seq, "dtype": args.dtype, "optimizer": args.optimizer,
                          "device": args.device, "budgets_gib": budgets, "methods": methods,
                          "lora_rank": args.lora_rank, "rows": rows}))
    else:
        print(format_wall(rows, args))
    return 0
