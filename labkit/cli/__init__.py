"""Command line: `python -m labkit estimate` prints one step's predicted memory, `wall` which models fit which GPUs
(for full fine-tuning, LoRA and QLoRA), `plan` which configuration to train with (labkit.plan)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys

from labkit.estimate.predict import DTYPES, OPTIMIZERS
from labkit.estimate.recipe import PROJ_DTYPES
from labkit.estimate.peft_terms import QUANTS
from labkit.estimate.moments import POLICIES
from labkit.memory.report import CATEGORIES, PHASES
from labkit.memory.units import fmt_bytes

UNITS_NOTE = "GiB = 2**30 bytes, MiB = 2**20, KiB = 2**10"


class UsageError(Exception):
    """Bad input from the command line: reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line on stderr (no usage block), exit status 2."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: error: {message}")


# ----------------------------------------------------------------------------- bounds
# Sizes are computed from shapes, never allocated, but a model is still read by building it layer by layer
# on the meta device and walking its forward once per layer (milliseconds per layer). Inputs are refused by
# rule where an answer would be meaningless or slow, never by a clock:
MAX_LAYERS = 256  # 2x the deepest published dense LLM (Llama 3.1 405B: 126 layers; PaLM 118; GPT-3 96)
MAX_SIZE = 2**24  # widths, heads, vocabulary, positions: 16,777,216, far above any published model
#                   (hidden 16,384 to 25,600, vocabularies up to 256,000, 10M positions), and small enough
#                   that every weight is a tensor PyTorch can describe (its byte count fits in int64)
MAX_WALL_LAYERS = 2 * MAX_LAYERS  # layers of all the models of one `wall` together (the default presets: 288)
INT_LIMIT = 2**63  # an integer option must fit in int64, as PyTorch's sizes do
ADDRESS_SPACE = 2**64  # bytes a 64-bit machine can address: a larger predicted peak has no meaning
_INTEGER = re.compile(r"[+-]?[0-9]+")  # ASCII digits only: no '1_000', no other scripts' digits
_NUMBER = re.compile(r"([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")  # no nan, inf or hex


def integer(text: str) -> int:
    """argparse type: a decimal integer written in ASCII digits (its range is checked by `_positive`)."""
    if not _INTEGER.fullmatch(text.strip()):
        raise ValueError(text)
    return int(text)


def _positive(parser: argparse.ArgumentParser, name: str, value) -> None:
    if value is None:
        return
    if value <= 0:
        parser.error(f"{name} must be a positive integer, got {value}")
    if value >= INT_LIMIT:
        parser.error(f"{name} must be below 2**63 (int64, as PyTorch's sizes), got {value}")


def _items(parser, name: str, text: str) -> list[str]:
    """A comma-separated option: every item present and given once. In --models a gpt: spec keeps its
    KEY=VAL items (gpt2,gpt:n_layer=2,n_embd=64 is two models)."""
    items = []
    for s in (s.strip() for s in text.split(",")):
        if name == "--models" and items and items[-1].startswith("gpt:") and "=" in s and ":" not in s:
            items[-1] += "," + s
        else:
            items.append(s)
    if not any(items):
        parser.error(f"{name} must not be empty, got {text!r}")
    if not all(items):
        parser.error(f"{name} has an empty item in {text!r}: separate items with single commas")
    dup = next((s for i, s in enumerate(items) if s in items[:i]), None)
    if dup is not None:
        parser.error(f"{name} names {dup!r} twice")
    return items


# ----------------------------------------------------------------------------- reading models
def parse_gpt_spec(text: str):
    """'gpt:n_layer=4,n_embd=256' -> GPTConfig(n_layer=4, n_embd=256); each value takes its field's type."""
    from labkit.models.gpt import GPTConfig

    fields = {f.name: f for f in dataclasses.fields(GPTConfig)}
    if text == "gpt":
        return GPTConfig()
    body = text.split(":", 1)[1]
    kwargs = {}
    for item in (s.strip() for s in body.split(",")):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise ValueError(f"malformed gpt spec item {item!r} in {text!r}: write KEY=VAL items, "
                             "e.g. gpt:n_layer=4,n_embd=256 (or gpt for the defaults)")
        if key not in fields:
            raise ValueError(f"GPTConfig has no field {key!r}; fields: {', '.join(fields)}")
        if key in kwargs:
            raise ValueError(f"gpt spec gives {key} twice in {text!r}")
        kwargs[key] = _convert(key, value, type(fields[key].default))
    return GPTConfig(**kwargs)


def _convert(key: str, value: str, kind: type):
    if kind is bool:
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"gpt spec: {key} must be true or false, got {value!r}")
    if kind is int and not _INTEGER.fullmatch(value):
        raise ValueError(f"gpt spec: {key} must be int, got {value!r}")
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"gpt spec: {key} must be {kind.__name__}, got {value!r}") from None


def resolve_model(text: str):
    """A preset name, config path or hub id stays a string (estimate reads it); 'gpt:...' becomes a GPTConfig."""
    if text == "gpt" or text.startswith("gpt:"):
        return parse_gpt_spec(text)
    return text


# what the estimator reads from a transformers config, by the config's own names: the layer count, sizes,
# sizes that may be None, pairs (a, b) where b must divide a, and dropout probabilities
_HF_FIELDS = {
    "gpt2": dict(layers="n_layer", sizes=("n_embd", "n_head", "vocab_size", "n_positions"), optional=("n_inner",),
                 divides=(("n_embd", "n_head"),), dropout=("resid_pdrop", "attn_pdrop", "embd_pdrop")),
    "llama": dict(layers="num_hidden_layers", sizes=("hidden_size", "num_attention_heads", "vocab_size",
                                                     "intermediate_size", "max_position_embeddings"),
                  optional=("num_key_value_heads", "head_dim"),
                  divides=(("hidden_size", "num_attention_heads"), ("num_attention_heads", "num_key_value_heads")),
                  dropout=("attention_dropout",)),
}


def _check_config(text: str, config) -> int:
    """Check a transformers config's sizes; returns its layer count (0 for an architecture not listed above)."""
    f = _HF_FIELDS.get(getattr(config, "model_type", ""))
    if f is None:  # other architectures: spec_from says which ones it knows
        return 0
    sizes = {k: getattr(config, k, None) for k in f["sizes"]}
    sizes.update({k: getattr(config, k) for k in f["optional"] if getattr(config, k, None) is not None})
    _check_sizes(text, (f["layers"], getattr(config, f["layers"], None)), sizes, f["divides"])
    if "head_dim" in sizes and sizes["num_attention_heads"] * sizes["head_dim"] > MAX_SIZE:
        raise ValueError(f"{text}: num_attention_heads x head_dim = {sizes['num_attention_heads'] * sizes['head_dim']} "
                         f"is above {MAX_SIZE:,} (2**24), far beyond any published model")
    for k in f["dropout"]:
        v = getattr(config, k, 0.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
            raise ValueError(f"{text}: {k} must be a dropout probability in [0, 1), got {v!r}")
    return getattr(config, f["layers"])


def _check_sizes(text: str, layers: tuple[str, object], sizes: dict[str, object], divides=()) -> None:
    """Every size a positive integer within the bounds above; pairs that must divide, divide."""
    for name, v in [layers, *sizes.items()]:
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{text}: {name} must be a positive integer, got {v!r}")
    name, n = layers
    if n > MAX_LAYERS:
        raise ValueError(f"{text}: {name}={n} is more than {MAX_LAYERS} layers, twice the deepest published "
                         "dense LLM (the estimator reads a model layer by layer)")
    for name, v in sizes.items():
        if v > MAX_SIZE:
            raise ValueError(f"{text}: {name}={v} is above {MAX_SIZE:,} (2**24), far beyond any published model")
    for a, b in divides:
        if a in sizes and b in sizes and sizes[a] % sizes[b]:
            raise ValueError(f"{text}: {a} ({sizes[a]}) must be divisible by {b} ({sizes[b]})")


def _guarded(text: str, read):
    try:  # transformers validates a config, and torch a model's sizes, with errors of their own types
        return read()
    except (ValueError, TypeError, OSError):
        raise
    except Exception as err:  # one line for whatever else a library refuses in a config
        raise ValueError(f"cannot read model {text!r}: {type(err).__name__}: {err}") from err


def check_model(text: str) -> tuple[object, int]:
    """--model TEXT as estimate takes it (a GPTConfig or the name) and its layer count, its sizes checked
    against the bounds above before anything is built."""
    from labkit.models.gpt import GPTConfig

    model = resolve_model(text)
    if isinstance(model, GPTConfig):
        _check_sizes(text, ("n_layer", model.n_layer),
                     {k: getattr(model, k) for k in ("n_embd", "n_head", "vocab_size", "block_size")})
        return model, model.n_layer

    def layers():
        from labkit.models import hf

        return _check_config(text, hf.get_config(model))

    return model, _guarded(text, layers)


def read_model(model, text: str):
    """The ModelSpec of a checked model (built on the meta device, shapes only)."""
    from labkit.estimate.spec import shapes_only, spec_from

    def read():
        with shapes_only():
            return spec_from(model)

    return _guarded(text, read)


# the estimator's keyword names, as this command line spells them (messages of labkit.estimate)
_OPTION_NAMES = [(rf"(?<![\w-]){k}(?!\w)", v) for k, v in {
    "micro_batch": "--micro-batch", "optimizer_offload": "--optimizer-offload", "checkpoint": "--checkpoint",
    "step_in_backward": "--step-in-backward", "offload_activations": "--offload-activations",
    "lora_rank": "--lora-rank", "lora_targets": "--lora-targets", "lisa_layers": "--lisa-layers",
    "quant_group": "--quant-group"}.items()]
_OPTION_NAMES += [(r"^(batch|seq|rank|segments) ", r"--\1 ")]


def _cli_words(message: str) -> str:
    for pattern, option in _OPTION_NAMES:
        message = re.sub(pattern, option, message)
    return message


def _check_peak(peak: int, what: str) -> None:
    if peak > ADDRESS_SPACE:
        raise ValueError(f"{what}: the predicted peak, {peak:.3g} bytes, is beyond 2**64 bytes, all a 64-bit "
                         "machine can address; lower --batch or --seq or the model's size")


# ----------------------------------------------------------------------------- estimate
def estimate_dict(model_text: str, e, args) -> dict:
    """The --json object: every byte value an int; categories are the breakdown at the peak."""
    peak = e.peak.as_dict()
    return {
        "model": model_text, "n_params": int(e.n_params), "batch": args.batch, "seq": args.seq,
        "dtype": args.dtype, "optimizer": args.optimizer, "device": args.device,
        "options": {k: getattr(args, k) for k in ("checkpoint", "segments", "offload_activations", "micro_batch",
                                                   "accumulate", "rank", "proj_dtype", "optimizer_offload",
                                                   "step_in_backward",
                                                   "lora_rank", "lora_targets", "quant", "quant_group", "lisa_layers")
                    if hasattr(args, k)},
        "peak_phase": e.peak_phase, "peak": int(e.peak.total),
        "categories": {k: v for k, v in peak.items() if k != "total"},
        "phases": {p: e.phases[p].as_dict() for p in PHASES if p in e.phases},
    }


def _table(rows: list[list[str]], right: set[int] = frozenset()) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)


def format_estimate(e, device: str) -> str:
    """The readable report: every term with its formula and source, then each phase's peak by category."""
    lines = [f"{e.label} on {device}: {e.n_params:,} parameters", f"units: {UNITS_NOTE}", "", "terms"]
    rows = [["term", "category", "bytes", "formula", "source"]]
    rows += [[t.name, str(t.category), fmt_bytes(t.bytes), t.formula, t.source] for t in e.terms]
    lines += [_table(rows, right={2}), "", "peak of each phase, by category"]
    rows = [["phase"] + [str(c) for c in CATEGORIES] + ["total"]]
    for p in PHASES:
        b = e.phases[p]
        rows.append([p] + [fmt_bytes(b[c]) for c in CATEGORIES] + [fmt_bytes(b.total)])
    lines += [_table(rows, right=set(range(1, len(rows[0])))), ""]
    lines.append(f"peak: {fmt_bytes(e.peak.total)} ({e.peak.total:,} bytes) in the {e.peak_phase} phase")
    return "\n".join(lines)


def check_estimate_options(args, parser) -> int | None:
    """Refuse what the command line alone shows is wrong: numbers out of range and options that mean
    something only with another. Returns the micro-batch. (What depends on the model, such as --seq beyond
    its positions or --lisa-layers beyond its layers, the estimator checks.)"""
    for name in ("batch", "seq", "segments", "micro_batch", "accumulate", "rank", "lora_rank", "lisa_layers",
                 "quant_group"):
        _positive(parser, "--" + name.replace("_", "-"), getattr(args, name))
    for name in ("micro_batches", "tp", "pp", "dp"):
        _positive(parser, "--" + name.replace("_", "-"), getattr(args, name, None))
    if getattr(args, "sequence_parallel", False) and args.tp == 1:
        parser.error("--sequence-parallel splits what tensor parallelism keeps whole: give --tp > 1 too")
    dp = getattr(args, "dp", 1)
    if getattr(args, "zero", 0) not in (0, 1, 2, 3):
        parser.error(f"--zero must be a ZeRO stage 0, 1, 2 or 3, got {args.zero}")
    if getattr(args, "zero_offload", False) and not args.zero:
        parser.error("--zero-offload offloads ZeRO's optimizer state shards: give --zero 1, 2 or 3 too")
    if args.batch % dp:
        parser.error(f"--batch {args.batch} is the global batch: it must divide evenly over --dp {dp} ranks")
    micro = args.micro_batch
    if getattr(args, "micro_batches", None) is not None:
        if micro is not None or args.accumulate is not None:
            parser.error("give one of --micro-batch, --accumulate and --micro-batches")
        args.accumulate = args.micro_batches
    if args.accumulate is not None:
        if micro is not None:
            parser.error("give --micro-batch or --accumulate, not both")
        rows = args.batch // dp  # micro-batches are counted on each data-parallel rank
        per = f"--batch {args.batch}" + (f" / --dp {dp} = {rows} rows per rank" if dp > 1 else "")
        if rows % args.accumulate:
            parser.error(f"--accumulate {args.accumulate} must divide {per}")
        micro = rows // args.accumulate
    elif micro is not None and (args.batch // dp) % micro:
        parser.error(f"--micro-batch {micro} must divide --batch {args.batch}"
                     + (f" / --dp {dp} = {args.batch // dp} rows per rank" if dp > 1 else ""))
    if args.segments is not None and args.checkpoint != "full":
        parser.error(f"--segments {args.segments} needs --checkpoint full (sqrt picks its own, none and "
                     f"selective have none), got --checkpoint {args.checkpoint}")
    galore = args.optimizer.startswith("galore")
    if args.rank is not None and not galore:
        parser.error(f"--rank {args.rank} is GaLore's rank: give it with --optimizer galore or galore8bit, "
                     f"not {args.optimizer}")
    if galore and args.rank is None:
        parser.error(f"--optimizer {args.optimizer} needs --rank R (e.g. --rank 128)")
    if args.proj_dtype is not None and args.optimizer != "galore8bit":
        parser.error(f"--proj-dtype {args.proj_dtype} is 8-bit GaLore's projector precision: give it with "
                     f"--optimizer galore8bit, not {args.optimizer}")
    if args.lora_rank is None:
        if args.lora_targets is not None:
            parser.error(f"--lora-targets {args.lora_targets!r} selects where LoRA adapters go: give --lora-rank too")
        if args.quant != "none":
            parser.error(f"--quant {args.quant} stores the frozen base under LoRA adapters: give --lora-rank too")
    if args.quant_group is not None and not args.quant.startswith("int4"):
        parser.error(f"--quant-group {args.quant_group} is int4's group size: give it with --quant int4 or int4-awq, "
                     f"not --quant {args.quant}")
    if args.lisa_layers is not None and (args.lora_rank is not None or args.quant != "none"):
        parser.error("--lisa-layers trains whole layers: give it without --lora-rank and --quant")
    if args.lora_targets is None:
        args.lora_targets = "all-linear"
    return micro


def cmd_estimate(args, parser) -> int:
    from labkit.estimate.predict import estimate

    micro = check_estimate_options(args, parser)
    spec = read_model(check_model(args.model)[0], args.model)
    if args.tp > 1 or args.pp > 1:
        return _estimate_layout(args, spec, micro)
    try:
        e = estimate(spec, args.batch, args.seq, args.dtype, args.optimizer, device=args.device,
                     checkpoint=args.checkpoint, segments=args.segments, offload_activations=args.offload_activations,
                     micro_batch=micro, rank=args.rank, proj_dtype=args.proj_dtype,
                     optimizer_offload=args.optimizer_offload,
                     step_in_backward=args.step_in_backward, lora_rank=args.lora_rank,
                     lora_targets=args.lora_targets, quant=args.quant, quant_group=args.quant_group,
                     lisa_layers=args.lisa_layers, dp=args.dp, zero=args.zero, zero_offload=args.zero_offload)
    except ValueError as err:
        raise ValueError(_cli_words(str(err))) from err
    _check_peak(e.peak.total, f"{args.model} with --batch {args.batch} --seq {args.seq}")
    if args.json:
        print(json.dumps(estimate_dict(args.model, e, args)))
    else:
        print(format_estimate(e, args.device))
    return 0


def _estimate_layout(args, spec, micro) -> int:
    """--tp / --pp: every rank's peak (the largest first in the report), then the largest rank's terms, and
    the bytes each layout sends per step by the collectives' definitions."""
    from labkit.estimate.layout_terms import layout_wire_bytes
    from labkit.estimate.predict import estimate_ranks
    from labkit.estimate.recipe import Recipe

    try:
        r = Recipe(spec, args.batch, args.seq, dtype=args.dtype, optimizer=args.optimizer, device=args.device,
                   checkpoint=args.checkpoint, segments=args.segments, offload_activations=args.offload_activations,
                   micro_batch=micro, rank=args.rank, proj_dtype=args.proj_dtype,
                   optimizer_offload=args.optimizer_offload, step_in_backward=args.step_in_backward,
                   lora_rank=args.lora_rank, lora_targets=args.lora_targets, quant=args.quant,
                   lisa_layers=args.lisa_layers, tp=args.tp, pp=args.pp, schedule=args.schedule,
                   sequence_parallel=args.sequence_parallel, quant_group=args.quant_group, dp=args.dp,
                   zero=args.zero, zero_offload=args.zero_offload)
        ranks = estimate_ranks(r)
        wire = layout_wire_bytes(r)
    except ValueError as err:
        raise ValueError(_cli_words(str(err))) from err
    top = max(ranks, key=lambda e: e.peak.total)
    _check_peak(top.peak.total, f"{args.model} with --batch {args.batch} --seq {args.seq}")
    if args.json:
        out = estimate_dict(args.model, top, args)
        out["layout"] = {"tp": args.tp, "pp": args.pp, "schedule": args.schedule,
                         "sequence_parallel": args.sequence_parallel, "micro_batches": r.rank_batch // r.micro}
        out["ranks"] = [{"rank": i, "stage": i // args.tp, "tp_rank": i % args.tp, "label": e.label,
                         "peak": int(e.peak.total), "peak_phase": e.peak_phase,
                         "categories": {k: v for k, v in e.peak.as_dict().items() if k != "total"}}
                        for i, e in enumerate(ranks)]
        out["wire_bytes_per_step"] = {k: float(v) for k, v in wire.items()}
        print(json.dumps(out))
        return 0
    rows = [["rank", "stage", "tp rank", "peak", "phase"] + [str(c) for c in CATEGORIES]]
    for i, e in enumerate(ranks):
        rows.append([str(i), str(i // args.tp), str(i % args.tp), fmt_bytes(e.peak.total), e.peak_phase]
                    + [fmt_bytes(e.peak[c]) for c in CATEGORIES])
    lines = [f"per-rank peaks (tp={args.tp} pp={args.pp}"
             + (f" {args.schedule}" if args.pp > 1 else "") + (" sequence-parallel" if args.sequence_parallel else "")
             + f", {r.rank_batch // r.micro} micro-batches of {r.micro} rows)"
             + (f"; each of the dp={args.dp} replicas (ZeRO-{args.zero}) holds the same" if args.dp > 1 else ""),
             _table(rows, right={3}), ""]
    lines.append("bytes sent per step (by the collectives' definitions)")
    lines += [f"  {k}: {fmt_bytes(int(v))}" for k, v in wire.items()]
    lines += ["", f"the largest rank: {top.label}", format_estimate(top, args.device)]
    print("\n".join(lines))
    return 0


# ----------------------------------------------------------------------------- wall
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


# ----------------------------------------------------------------------------- plan
PLAN_PRECISIONS = ("fp32", "mixed-bf16", "mixed-fp16", "bf16", "fp16")


def _plan_inputs(args, parser) -> dict:
    """plan()'s keywords from the command line, every value checked (one line on error, exit 2)."""
    from labkit.memory.units import parse_bytes
    from labkit.plan.devices import names
    from labkit.plan.search import MAX_DEVICES, OPTIMIZERS

    _positive(parser, "--devices", args.devices)
    if args.devices > MAX_DEVICES:
        parser.error(f"--devices must be at most {MAX_DEVICES}, got {args.devices}")
    _positive(parser, "--top", args.top)
    if args.memory is None and args.device_preset is None:
        parser.error("give --memory (e.g. 24GiB) or --device-preset (one of " + ", ".join(names()) + ")")
    memory = None
    if args.memory is not None:
        try:
            memory = parse_bytes(args.memory)
        except ValueError as err:
            parser.error(f"--memory: {err}")
        if not 1 <= memory <= ADDRESS_SPACE:
            parser.error(f"--memory must be from 1 byte to 2**64 bytes, got {args.memory!r}")
    if args.device_preset is not None and args.device_preset.lower() not in names() + ["a100", "a100-80", "a100-40"]:
        parser.error(f"--device-preset: unknown preset {args.device_preset!r}; choose one of {', '.join(names())}")
    if args.tokens is not None:
        if args.batch is not None or args.seq is not None:
            parser.error("give --tokens B*S or --batch and --seq, not both")
        parts = re.split(r"[*xX]", args.tokens.strip())
        if len(parts) != 2 or not all(_INTEGER.fullmatch(p.strip()) for p in parts):
            parser.error(f"--tokens must be B*S (rows times tokens per row, e.g. 8*1024), got {args.tokens!r}")
        args.batch, args.seq = (int(p) for p in parts)
    _positive(parser, "--batch", args.batch)
    _positive(parser, "--seq", args.seq)
    optimizers = _items(parser, "--optimizers", args.optimizers) if args.optimizers else list(OPTIMIZERS)
    unknown = [o for o in optimizers if o not in OPTIMIZERS]
    if unknown:
        parser.error(f"--optimizers: unknown optimizer {unknown[0]!r}; choose from {', '.join(OPTIMIZERS)}")
    model, _ = check_model(args.model)
    return dict(model=model, devices=args.devices, memory=memory, device_preset=args.device_preset,
                batch=args.batch, seq=args.seq, peft="allow" if args.peft else False,
                min_precision=args.min_precision, top=args.top, optimizers=optimizers)


def format_plans(plans, args, device) -> str:
    p0 = plans[0]
    r = p0.recipe
    lines = [f"{args.model}: {args.devices} device(s), {fmt_bytes(p0.memory)} each, speeds of {device.title}; "
             f"batch {r.batch} x seq {r.seq} per step ({UNITS_NOTE})",
             "ranked by fidelity, then predicted step time (labkit.plan.cost)", ""]
    for i, p in enumerate(plans, 1):
        t = p.time
        parts = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t.parts().items() if v)
        lines += [f"{i}. {p.summary()}",
                  f"   peak {fmt_bytes(p.peak)} per device at {p.peak_phase}: {p.peak_where}; "
                  f"binding term: {p.binding} ({fmt_bytes(p.binding_bytes)})",
                  f"   step {p.seconds * 1e3:.1f} ms predicted, {p.relative:.2f}x the fastest ({parts})",
                  f"   fidelity: {p.fidelity.describe()}"]
        lines += [f"   - {w}" for w in p.why]
        lines.append("")
    return "\n".join(lines).rstrip()


def cmd_plan(args, parser) -> int:
    from labkit.plan import NoPlanError, plan
    from labkit.plan.devices import closest, get_device

    kw = _plan_inputs(args, parser)
    out_dir = args.export
    export_plan = None
    if out_dir is not None:
        try:
            from labkit.plan.export import export_plan
        except ImportError:
            parser.error("export is not available")
    if args.verify:
        from labkit.plan.verify import check_runnable
        from labkit.estimate.recipe import Recipe

        check_runnable(Recipe(kw["model"], 1, 1))  # refuse a model too large to run before searching
    try:
        plans = plan(**kw)
    except NoPlanError as err:
        print(f"labkit plan: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    device = get_device(args.device_preset) if args.device_preset else closest(kw["memory"])
    checked, rc = None, 0
    if args.verify:  # exit status 1 when the best plan could not be run or did not fit
        from labkit.plan.verify import verify

        try:
            checked = verify(plans[0])
            rc = 0 if checked.fits else 1
        except ValueError as err:
            checked, rc = f"verify: not run: {' '.join(str(err).split())}", 1
    exported = None
    if export_plan is not None:
        exported = {k: str(v) for k, v in export_plan(plans[0].recipe, out_dir, devices=args.devices).items()}
    if args.json:
        out = {"model": args.model, "devices": args.devices, "memory": int(plans[0].memory),
               "device": device.name, "batch": plans[0].recipe.batch, "seq": plans[0].recipe.seq,
               "plans": [p.as_dict() for p in plans]}
        if checked is not None:
            out["verify"] = checked if isinstance(checked, str) else checked.as_dict()
        if exported is not None:
            out["export"] = exported
        print(json.dumps(out))
        return rc
    text = format_plans(plans, args, device)
    if checked is not None:
        text += "\n\n" + str(checked)
    if exported is not None:
        text += "\n\nexported plan 1:\n" + "\n".join(f"  {k}: {v}" for k, v in exported.items())
    print(text)
    return rc


# ----------------------------------------------------------------------------- entry point
def build_parser() -> _Parser:
    parser = _Parser(prog="labkit", description="Predict the memory of training a model.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def common(p, device_default, dtype_default):
        p.add_argument("--batch", type=integer, default=1, help="sequences per step (B)")
        p.add_argument("--seq", type=integer, default=1024, help="tokens per sequence (S)")
        p.add_argument("--dtype", choices=DTYPES, default=dtype_default,
                       help="how weights and compute are stored (default mixed-bf16)")
        p.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adamw")
        p.add_argument("--device", choices=("cpu", "cuda"), default=device_default,
                       help="fused attention, dropout masks and Adam's foreach path differ")
        p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")

    e = sub.add_parser("estimate", help="predicted bytes of one training step, by term, category and phase",
                       description=f"Predict one training step's memory. {UNITS_NOTE}.")
    e.add_argument("--model", required=True, metavar="NAME_OR_CONFIG",
                   help="a preset, a local transformers config, a hub id (online), or gpt:KEY=VAL,... "
                        "for labkit's GPT, e.g. gpt:n_layer=4,n_embd=256,block_size=512; at most "
                        f"{MAX_LAYERS} layers, sizes up to 2**24")
    common(e, "cpu", "mixed-bf16")
    e.add_argument("--checkpoint", choices=POLICIES, default="none",
                   help="activation checkpointing of the blocks (labkit GPT, transformers GPT-2 and Llama; "
                        "labkit.recompute)")
    e.add_argument("--segments", type=integer, default=None, help="segments for --checkpoint full (default: every block)")
    e.add_argument("--offload-activations", action="store_true", help="keep saved activations in host memory")
    e.add_argument("--micro-batch", type=integer, default=None, help="rows per micro-batch (gradient accumulation)")
    e.add_argument("--accumulate", type=integer, default=None, help="micro-batches per step (batch / micro-batch)")
    e.add_argument("--micro-batches", type=integer, default=None,
                   help="micro-batches per step on each rank (M; the pipeline's m): --micro-batch = batch / dp / M")
    e.add_argument("--tp", type=integer, default=1, help="tensor-parallel ranks (labkit's GPT; Megatron-LM split)")
    e.add_argument("--pp", type=integer, default=1, help="pipeline stages (consecutive blocks per stage)")
    e.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b", help="pipeline schedule (--pp > 1)")
    e.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp > 1: norms and dropouts split along the sequence (Korthikanti et al. 2022)")
    e.add_argument("--rank", type=integer, default=None, help="GaLore's rank (--optimizer galore or galore8bit)")
    e.add_argument("--proj-dtype", choices=PROJ_DTYPES, default=None,
                   help="8-bit GaLore's projector: param (the weights' dtype, the default), fp32 or int8 "
                        "(--optimizer galore8bit)")
    e.add_argument("--optimizer-offload", choices=("cpu", "disk"), default=None,
                   help="AdamW state and step in host memory or on disk (labkit.optim.OffloadAdamW)")
    e.add_argument("--step-in-backward", action="store_true", help="step each parameter as its gradient is ready")
    e.add_argument("--lora-rank", type=integer, default=None, help="LoRA adapters of this rank; every base weight frozen")
    e.add_argument("--lora-targets", default=None,
                   help="comma-separated Linear module names or endings (e.g. q_proj,v_proj), "
                        "or all-linear (every Linear but lm_head; the default); needs --lora-rank")
    e.add_argument("--quant", choices=QUANTS, default="none",
                   help="store the frozen base under the adapters in int8, NF4 (nf4 = QLoRA), or group-wise int4: "
                        "round-to-nearest (int4) or AWQ (int4-awq, its input scale kept per layer); needs --lora-rank")
    e.add_argument("--quant-group", type=integer, default=None,
                   help="int4's group size along the input features (default 128; must divide every target's "
                        "input features); needs --quant int4 or int4-awq")
    e.add_argument("--lisa-layers", type=integer, default=None,
                   help="LISA: train embeddings, head and this many sampled layers at a time")
    e.add_argument("--dp", type=integer, default=1,
                   help="data-parallel ranks: --batch is the global batch, each rank takes batch / dp rows; per-rank bytes")
    e.add_argument("--zero", type=integer, default=0, help="ZeRO stage over the dp ranks: 0 (plain), 1 (optimizer "
                   "state sharded), 2 (+ gradients), 3 (+ parameters)")
    e.add_argument("--zero-offload", action="store_true", help="ZeRO-Offload: the optimizer state shards in host memory")
    e.set_defaults(run=cmd_estimate, parser=e)
    w = sub.add_parser("wall", help="which presets fit which GPU budgets for full fine-tuning, LoRA and QLoRA",
                       description=f"Which models fit which budgets. {UNITS_NOTE}.")
    w.add_argument("--models", default=None, help="comma-separated, each as --model of estimate, "
                   f"{MAX_WALL_LAYERS} layers in all (default: every non-tiny preset)")
    w.add_argument("--budgets", default="16,24,48,80", help="comma-separated GiB")
    w.add_argument("--methods", default="full,lora,qlora",
                   help="comma-separated: full (fine-tuning), lora, qlora (LoRA on an NF4 base)")
    w.add_argument("--lora-rank", type=integer, default=None,
                   help="LoRA rank for the lora and qlora methods (default 16)")
    common(w, "cuda", None)
    w.set_defaults(run=cmd_wall, parser=w)
    p = sub.add_parser("plan", help="which training configuration fits a model on some devices, ranked",
                       description=f"Search configurations that fit, ranked by fidelity then predicted time. {UNITS_NOTE}.")
    p.add_argument("--model", required=True, metavar="NAME_OR_CONFIG", help="as --model of estimate")
    p.add_argument("--devices", type=integer, default=1, help="devices (GPUs) to use (default 1)")
    p.add_argument("--memory", default=None, help="memory per device, e.g. 24GiB (default: the preset's)")
    p.add_argument("--device-preset", default=None,
                   help="t4, a10, a100-40gb, a100-80gb, h100, h200 or cpu: the speeds times assume "
                        "(default: the preset closest to --memory)")
    p.add_argument("--tokens", default=None, metavar="B*S", help="rows x tokens per row per step, e.g. 8*1024")
    p.add_argument("--batch", type=integer, default=None, help="rows per step, the global batch (default 1)")
    p.add_argument("--seq", type=integer, default=None, help="tokens per row (default min(1024, the model's))")
    p.add_argument("--peft", action="store_true", help="also consider LISA, LoRA and QLoRA")
    p.add_argument("--min-precision", choices=PLAN_PRECISIONS, default="bf16",
                   help="the least precise dtype allowed (default bf16)")
    p.add_argument("--optimizers", default=None,
                   help="comma-separated: adamw, adamw8bit, adafactor, lion, galore, galore8bit (default all)")
    p.add_argument("--top", type=integer, default=5, help="plans to show (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--verify", action="store_true",
                   help="run the best plan for real under the ledger (small models only) and compare peaks")
    p.add_argument("--export", default=None, metavar="DIR", help="write the best plan's launch files to DIR")
    p.set_defaults(run=cmd_plan, parser=p)
    return parser


def main(argv=None) -> int:
    """Run the command line; returns the exit status (2 with one line on stderr for bad input)."""
    parser = build_parser()
    prog = "labkit"
    try:
        args = parser.parse_args(argv)
        prog = f"labkit {args.command}"
        return args.run(args, args.parser)
    except UsageError as err:
        print(" ".join(str(err).split()), file=sys.stderr)
    except (ValueError, TypeError, OSError) as err:  # the library's word on bad input, as one line
        print(f"{prog}: error: {' '.join(str(err).split())}", file=sys.stderr)
    return 2
