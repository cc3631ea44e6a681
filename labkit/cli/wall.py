"""`python -m labkit wall`: which models fit which GPU budgets, for full fine-tuning, LoRA and QLoRA, by default
under the QLoRA paper's recipe (every row the same batch, sequence, checkpointing and adapters)."""

from __future__ import annotations

import json
import re

from labkit.memory.table import wrap_line
from labkit.memory.units import GiB, fit_verdict, fmt_bytes

from .common import (MAX_WALL_LAYERS, UNITS_NOTE, _check_peak, _cli_words, _items, _positive, _table, check_model,
                     headroom_fraction, read_model, size_option)

# Dettmers et al. 2023 (QLoRA, arXiv 2305.14314): LLaMA-65B fine-tuned on one 48 GB GPU, with artidoro/qlora's
# scripts/finetune_guanaco_65b.sh: --per_device_train_batch_size 4 --gradient_accumulation_steps 4
# --target_max_len 512 --lora_r 64 --lora_modules all --bits 4 --quant_type nf4 --double_quant --bf16
# --gradient_checkpointing, and qlora.py's paged 32-bit AdamW (fp32 states: adamw here). LoRA is the paper's
# 16-bit baseline under the same recipe; full fine-tuning the same batch in mixed bf16.
WALL_RECIPE = {"batch": 16, "micro_batch": 4, "seq": 512, "lora_rank": 64, "checkpoint": "full", "optimizer": "adamw"}
WALL_SOURCE = "Dettmers et al. 2023, LLaMA-65B on one 48 GB GPU; artidoro/qlora scripts/finetune_guanaco_65b.sh"


def _count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _budgets(parser, text: str) -> list[tuple[str, int]]:
    """--budgets: (label, bytes) each, a size with its unit (24GB = 24 x 10**9 bytes, 24GiB = 24 x 2**30; a bare
    number is refused, as plan's --memory), each at least one byte and at most 2**64 bytes (2**34 GiB)."""
    out = []
    for item in _items(parser, "--budgets", text):
        if not re.fullmatch(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)? ?[A-Za-z]+", item):
            size_option(parser, "--budgets", item)  # says what is wrong: a bare number, a sign, ...
            parser.error(f"--budgets: give sizes such as 24GB (10**9 bytes) or 24GiB, got {item!r}")
        b = size_option(parser, "--budgets", item)
        out.append((re.sub(r"(?<=[0-9.])(?=[A-Za-z])", " ", item), b))
    if len({b for _, b in out}) < len(out):
        parser.error(f"--budgets gives one budget twice in {text!r}")
    return out


def _recipe_words(args) -> str:
    """The recipe every row uses, and whether it is the QLoRA paper's (WALL_RECIPE)."""
    mine = {"batch": args.batch, "micro_batch": args.micro_batch, "seq": args.seq, "lora_rank": args.lora_rank,
            "checkpoint": args.checkpoint, "optimizer": args.optimizer}
    rows = f"batch {args.batch}" + (f" = {args.batch // args.micro_batch} micro-batches of {args.micro_batch}"
                                    if args.micro_batch < args.batch else "")
    whose = (f"the QLoRA paper's ({WALL_SOURCE})" if mine == WALL_RECIPE else
             "given; the QLoRA paper's is --batch 16 --micro-batch 4 --seq 512 --lora-rank 64 --checkpoint full")
    kernels = (f"{args.device} kernels" + (" (wall's default; estimate's is cpu: --device cpu for CPU kernels)"
                                           if args.device == "cuda" else ""))
    chunks = f", loss in {args.loss_chunks} chunks" if getattr(args, "loss_chunks", None) else ""
    return (f"{kernels}; recipe, {whose}: {rows}, seq {args.seq}, checkpoint {args.checkpoint}, "
            f"{args.optimizer}" + chunks)


def _peft_dtype(parser, args) -> str | None:
    """fit_table's peft_dtype for the LoRA/QLoRA rows: without --dtype, bf16 (the QLoRA paper's
    base and adapters); with it, --dtype itself (None: every row in it), or under --adapters fp32
    its 16-bit half (fp32 adapters under autocast over a bf16/fp16 base: a mixed --dtype)."""
    if not args.dtype_given:
        return "bf16"
    if getattr(args, "adapters", "base") == "base":
        return None
    if not args.dtype.startswith("mixed-"):
        parser.error(f"--adapters fp32 keeps fp32 adapters under autocast over a 16-bit base: "
                     f"give --dtype mixed-bf16 or mixed-fp16, not {args.dtype}")
    return args.dtype.removeprefix("mixed-")


def format_wall(rows: list[dict], args) -> str:
    budgets = list(rows[0]["fits"]) if rows else []
    methods = getattr(args, "methods", "full")
    head = [_recipe_words(args),
            "; ".join(([f"full fine-tuning in {args.dtype}"] if "full" in methods else [])
                      + ([_peft_words(rows, args)] if methods != ["full"] else []))
            + f": predicted peak vs budget ({UNITS_NOTE}); tight: fits within {args.headroom_fraction:.0%} of "
              "the budget, as plan flags it (verify on the device)", ""]
    table = [["model", "method", "dtype", "params", "peak", "peak phase"] + budgets]
    for r in rows:
        rank = r.get("lora_rank", args.lora_rank)
        method = r["method"] + (f" r={rank}" if rank != args.lora_rank else "")
        table.append([r["model"], method, r["dtype"], _count(r["n_params"]), fmt_bytes(r["peak"]),
                      r["peak_phase"]]
                     + [{"does not fit": "no"}.get(r["verdicts"][b], r["verdicts"][b]) for b in budgets])
    return "\n".join(wrap_line(h) for h in head) + _table(table, right={3, 4})


def _peft_words(rows: list[dict], args) -> str:
    """The LoRA/QLoRA rows' setup, from the rows: rank, step dtype, the frozen base's storage."""
    peft = next((r for r in rows if r["method"] != "full"), None)
    dtype, base = (peft["dtype"], peft["base_dtype"]) if peft else ("bf16", "bf16")
    if getattr(args, "adapters", "base") == "fp32":
        how = "under fp32 adapters and autocast, as peft runs it"
    else:
        paper = "" if args.dtype_given else ", as the QLoRA paper's scripts run it"
        how = f"and {dtype} adapters{paper}"
    return (f"LoRA/QLoRA in {dtype}: rank {args.lora_rank} on {_targets_words(args)}, "
            f"frozen base in {base} {how} (QLoRA: NF4 with double quantization, {_qset_words(args)})")


def _targets_words(args) -> str:
    t = getattr(args, "lora_targets", None) or "all-linear"
    return "all linear layers but the head" if t == "all-linear" else t


def _qset_words(args) -> str:
    from labkit.estimate.peft_terms import QUANT_SET_NAMES

    return QUANT_SET_NAMES[getattr(args, "quant_set", None) or "all-linear"]


def _rank_for(spec, rank: int, targets="all-linear") -> int:
    """The default rank, or a model's smallest LoRA target side where that is smaller (a tiny model)."""
    from labkit.estimate.peft_terms import peft_of

    sides = [min(d_in, d_out) for _, d_in, d_out, _ in peft_of(spec, 1, targets).targets]
    return min([rank] + sides)


def _from_config(args, parser) -> None:
    """wall --from PATH: the config's model, rows, sequence, micro-batch, checkpointing, optimizer, precision
    and LoRA rank become the wall's recipe (its methods then vary full / LoRA / QLoRA over it)."""
    from .configs import reading_of

    if args.models is not None:
        parser.error("--from gives the model: drop --models")
    args.dp, args.model = None, None
    reading = reading_of(args, parser)
    r = reading.recipe
    if not isinstance(r.model, str):
        parser.error("wall --from needs a config that names a model by name")
    if r.distributed:
        parser.error(f"wall predicts one device; {args.from_path} uses {r.world_size}: use estimate --from")
    args.models, args.batch, args.seq, args.micro_batch = r.model, r.batch, r.seq, r.micro
    args.checkpoint = r.checkpoint
    if "full" in args.methods:  # full fine-tuning's precision; LoRA and QLoRA rows keep their bf16 base
        args.dtype = r.dtype
    if not r.optimizer.startswith("galore"):
        args.optimizer = r.optimizer
    if r.lora_rank:
        args.lora_rank = r.lora_rank
    if r.loss_chunks and args.loss_chunks is None:
        args.loss_chunks = r.loss_chunks
    print(reading.summary() + "\n")


def cmd_wall(args, parser) -> int:
    from labkit.estimate import Recipe
    from labkit.estimate.wall import METHODS, default_models, fit_table

    if args.from_path:
        _from_config(args, parser)

    _positive(parser, "--batch", args.batch)
    _positive(parser, "--seq", args.seq)
    _positive(parser, "--lora-rank", args.lora_rank)
    _positive(parser, "--loss-chunks", args.loss_chunks)
    models = _items(parser, "--models", args.models) if args.models is not None else None
    budgets = _budgets(parser, args.budgets)
    args.headroom_fraction = headroom_fraction(parser, args.headroom)
    methods = _items(parser, "--methods", args.methods)
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"--methods: unknown method {unknown[0]!r}; choose from {', '.join(METHODS)}")
    if getattr(args, "quant_set", None) is not None and "qlora" not in methods:
        parser.error(f"--quant-set {args.quant_set} chooses what the qlora method quantizes: "
                     "add qlora to --methods")
    if getattr(args, "lora_targets", None) is not None and methods == ["full"]:
        parser.error("--lora-targets is for the lora and qlora methods, not --methods full alone")
    if args.lora_rank is not None and methods == ["full"]:
        parser.error(f"--lora-rank {args.lora_rank} is for the lora and qlora methods, not --methods full alone")
    if args.optimizer.startswith("galore"):
        parser.error(f"--optimizer {args.optimizer} needs a rank, which wall does not take: use "
                     "`labkit estimate --optimizer galore --rank R`")
    default_rank = args.lora_rank is None and methods != ["full"]
    args.lora_rank = WALL_RECIPE["lora_rank"] if args.lora_rank is None else args.lora_rank
    _positive(parser, "--micro-batch", args.micro_batch)
    if args.micro_batch is None:
        args.micro_batch = WALL_RECIPE["micro_batch"] if args.batch % WALL_RECIPE["micro_batch"] == 0 else args.batch
    elif args.batch % args.micro_batch:
        parser.error(f"--micro-batch {args.micro_batch} must divide --batch {args.batch}")
    args.dtype_given = args.dtype is not None
    args.dtype = "mixed-bf16" if args.dtype is None else args.dtype
    peft_dtype = _peft_dtype(parser, args)
    models = models or default_models()
    checked = [check_model(text) for text in models]
    if sum(n for _, n in checked) > MAX_WALL_LAYERS:
        parser.error(f"--models have {sum(n for _, n in checked)} layers in all, more than {MAX_WALL_LAYERS} "
                     "(twice the most one model may have): compare fewer or shallower models")
    rows = []
    for text, (model, _) in zip(models, checked):  # each model read once for all its methods
        spec = read_model(model, text)
        targets = getattr(args, "lora_targets", None) or "all-linear"
        rank = _rank_for(spec, args.lora_rank, targets) if default_rank else args.lora_rank
        try:
            recipe = Recipe(None, args.batch, args.seq, args.dtype, args.optimizer, device=args.device,
                            checkpoint=args.checkpoint, micro_batch=args.micro_batch,
                            lora_rank=rank, loss_chunks=args.loss_chunks, lora_targets=targets)
            new = fit_table([spec], [b / GiB for _, b in budgets], recipe, methods,
                            peft_dtype=peft_dtype, adapters=getattr(args, "adapters", "base"),
                            quant_set=getattr(args, "quant_set", None) or "all-linear")
        except ValueError as err:  # fit_table names the model by its spec: name it as typed
            raise ValueError(f"{text}: {_cli_words(str(err.__cause__ or err))}") from err
        for r in new:
            _check_peak(r["peak"], f"{text} ({r['method']}) with --batch {args.batch} --seq {args.seq}")
            r["model"] = text
            if r["method"] != "full":
                r["lora_rank"] = rank
            r["fits"] = {label: ok for (label, _), ok in zip(budgets, r["fits"].values())}
            r["verdicts"] = {label: fit_verdict(r["peak"], b, args.headroom_fraction) for label, b in budgets}
        rows += new
    if args.json:
        print(json.dumps({"batch": args.batch, "micro_batch": args.micro_batch, "seq": args.seq,
                          "checkpoint": args.checkpoint, "dtype": args.dtype, "optimizer": args.optimizer,
                          "device": args.device, "budgets": [label for label, _ in budgets],
                          "budgets_gib": [b / GiB for _, b in budgets],
                          "budgets_bytes": [int(b) for _, b in budgets], "methods": methods,
                          "lora_rank": args.lora_rank, "loss_chunks": args.loss_chunks,
                          "headroom": args.headroom_fraction,
                          "recipe": _recipe_words(args), "rows": rows}))
    else:
        print(format_wall(rows, args))
    return 0
