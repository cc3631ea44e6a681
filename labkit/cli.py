"""Command line: `python -m labkit estimate` prints one step's predicted memory, `wall` which models fit which GPUs
(for full fine-tuning, LoRA and QLoRA)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from labkit.memory.estimate import DTYPES, OPTIMIZERS
from labkit.memory.peft_terms import QUANTS
from labkit.memory.moments import POLICIES
from labkit.memory.report import CATEGORIES, PHASES
from labkit.memory.units import fmt_bytes

UNITS_NOTE = "GiB = 2**30 bytes, MiB = 2**20, KiB = 2**10"


class UsageError(Exception):
    """Bad input from the command line: reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line on stderr (no usage block), exit status 2."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: error: {message}")


# ----------------------------------------------------------------------------- reading arguments
def parse_gpt_spec(text: str):
    """'gpt:n_layer=4,n_embd=256' -> GPTConfig(n_layer=4, n_embd=256); each value takes its field's type."""
    from labkit.models.gpt import GPTConfig

    fields = {f.name: f for f in dataclasses.fields(GPTConfig)}
    body = text.split(":", 1)[1] if ":" in text else ""
    kwargs = {}
    for item in filter(None, (s.strip() for s in body.split(","))):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise ValueError(f"malformed gpt spec item {item!r}: write KEY=VAL, e.g. gpt:n_layer=4,n_embd=256")
        if key not in fields:
            raise ValueError(f"GPTConfig has no field {key!r}; fields: {', '.join(fields)}")
        kwargs[key] = _convert(key, value, type(fields[key].default))
    return GPTConfig(**kwargs)


def _convert(key: str, value: str, kind: type):
    if kind is bool:
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"gpt spec: {key} must be true or false, got {value!r}")
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"gpt spec: {key} must be {kind.__name__}, got {value!r}") from None


def resolve_model(text: str):
    """A preset name, config path or hub id stays a string (estimate reads it); 'gpt:...' becomes a GPTConfig."""
    if text == "gpt" or text.startswith("gpt:"):
        return parse_gpt_spec(text)
    return text


def _positive(parser: argparse.ArgumentParser, name: str, value) -> None:
    if value <= 0:
        parser.error(f"{name} must be a positive integer, got {value}")


# ----------------------------------------------------------------------------- estimate
def estimate_dict(model_text: str, e, args) -> dict:
    """The --json object: every byte value an int; categories are the breakdown at the peak."""
    peak = e.peak.as_dict()
    return {
        "model": model_text, "n_params": int(e.n_params), "batch": args.batch, "seq": args.seq,
        "dtype": args.dtype, "optimizer": args.optimizer, "device": args.device,
        "options": {k: getattr(args, k) for k in ("checkpoint", "segments", "offload_activations", "micro_batch",
                                                   "accumulate", "rank", "optimizer_offload", "step_in_backward",
                                                   "lora_rank", "lora_targets", "quant", "lisa_layers")
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


def cmd_estimate(args, parser) -> int:
    from labkit.memory.estimate import estimate

    _positive(parser, "--batch", args.batch)
    _positive(parser, "--seq", args.seq)
    micro = args.micro_batch
    if args.accumulate is not None:
        _positive(parser, "--accumulate", args.accumulate)
        if micro is not None:
            parser.error("give --micro-batch or --accumulate, not both")
        if args.batch % args.accumulate:
            parser.error(f"--accumulate {args.accumulate} must divide --batch {args.batch}")
        micro = args.batch // args.accumulate
    e = estimate(resolve_model(args.model), args.batch, args.seq, args.dtype, args.optimizer, device=args.device,
                 checkpoint=args.checkpoint, segments=args.segments, offload_activations=args.offload_activations,
                 micro_batch=micro, rank=args.rank, optimizer_offload=args.optimizer_offload,
                 step_in_backward=args.step_in_backward, lora_rank=args.lora_rank, lora_targets=args.lora_targets,
                 quant=args.quant, lisa_layers=args.lisa_layers)
    if args.json:
        print(json.dumps(estimate_dict(args.model, e, args)))
    else:
        print(format_estimate(e, args.device))
    return 0


# ----------------------------------------------------------------------------- wall
def _count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _number_list(parser, name: str, text: str, kind):
    try:
        values = [kind(s) for s in text.split(",") if s.strip()]
    except ValueError:
        parser.error(f"{name} must be a comma-separated list, got {text!r}")
    if not values:
        parser.error(f"{name} must not be empty")
    return values


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
    from labkit.memory.wall import fit_table

    _positive(parser, "--batch", args.batch)
    _positive(parser, "--seq", args.seq)
    models = _number_list(parser, "--models", args.models, str) if args.models else None
    budgets = _number_list(parser, "--budgets", args.budgets, float)
    if any(b <= 0 for b in budgets):
        parser.error(f"--budgets must be positive numbers of GiB, got {args.budgets!r}")
    budgets = [int(b) if b.is_integer() else b for b in budgets]
    methods = _number_list(parser, "--methods", args.methods, str)
    _positive(parser, "--lora-rank", args.lora_rank)
    rows = fit_table([resolve_model(m) for m in models] if models else None, budgets, args.batch,
                     args.seq, args.dtype, args.optimizer, args.device, methods=methods, lora_rank=args.lora_rank)
    if models:  # show the names as typed (a gpt: spec included)
        for r, m in zip(rows, [m for m in models for _ in methods]):
            r["model"] = m
    if args.json:
        print(json.dumps({"batch": args.batch, "seq": args.seq, "dtype": args.dtype, "optimizer": args.optimizer,
                          "device": args.device, "budgets_gib": budgets, "methods": methods,
                          "lora_rank": args.lora_rank, "rows": rows}))
    else:
        print(format_wall(rows, args))
    return 0


# ----------------------------------------------------------------------------- entry point
def build_parser() -> _Parser:
    parser = _Parser(prog="labkit", description="Predict the memory of training a model.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def common(p, device_default):
        p.add_argument("--batch", type=int, default=1, help="sequences per step (B)")
        p.add_argument("--seq", type=int, default=1024, help="tokens per sequence (S)")
        p.add_argument("--dtype", choices=DTYPES, default="mixed-bf16", help="how weights and compute are stored")
        p.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adamw")
        p.add_argument("--device", choices=("cpu", "cuda"), default=device_default,
                       help="fused attention, dropout masks and Adam's foreach path differ")
        p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")

    e = sub.add_parser("estimate", help="predicted bytes of one training step, by term, category and phase",
                       description=f"Predict one training step's memory. {UNITS_NOTE}.")
    e.add_argument("--model", required=True, metavar="NAME_OR_CONFIG",
                   help="a preset, a local transformers config, a hub id (online), or gpt:KEY=VAL,... "
                        "for labkit's GPT, e.g. gpt:n_layer=4,n_embd=256,block_size=512")
    common(e, "cpu")
    e.add_argument("--checkpoint", choices=POLICIES, default="none",
                   help="activation checkpointing of labkit's GPT blocks (labkit.recompute)")
    e.add_argument("--segments", type=int, default=None, help="segments for --checkpoint full (default: every block)")
    e.add_argument("--offload-activations", action="store_true", help="keep saved activations in host memory")
    e.add_argument("--micro-batch", type=int, default=None, help="rows per micro-batch (gradient accumulation)")
    e.add_argument("--accumulate", type=int, default=None, help="micro-batches per step (batch / micro-batch)")
    e.add_argument("--rank", type=int, default=None, help="GaLore's rank (--optimizer galore or galore8bit)")
    e.add_argument("--optimizer-offload", choices=("cpu", "disk"), default=None,
                   help="AdamW state and step in host memory or on disk (labkit.optim.OffloadAdamW)")
    e.add_argument("--step-in-backward", action="store_true", help="step each parameter as its gradient is ready")
    e.add_argument("--lora-rank", type=int, default=None, help="LoRA adapters of this rank; every base weight frozen")
    e.add_argument("--lora-targets", default="all-linear",
                   help="comma-separated Linear module names or endings (e.g. q_proj,v_proj), "
                        "or all-linear (every Linear but lm_head)")
    e.add_argument("--quant", choices=QUANTS, default="none",
                   help="store the frozen base under the adapters in int8 or NF4 (nf4 = QLoRA); needs --lora-rank")
    e.add_argument("--lisa-layers", type=int, default=None,
                   help="LISA: train embeddings, head and this many sampled layers at a time")
    e.set_defaults(run=cmd_estimate, parser=e)
    w = sub.add_parser("wall", help="which presets fit which GPU budgets for full fine-tuning, LoRA and QLoRA",
                       description=f"Which models fit which budgets. {UNITS_NOTE}.")
    w.add_argument("--models", default=None, help="comma-separated (default: every non-tiny preset)")
    w.add_argument("--budgets", default="16,24,48,80", help="comma-separated GiB")
    w.add_argument("--methods", default="full,lora,qlora",
                   help="comma-separated: full (fine-tuning), lora, qlora (LoRA on an NF4 base)")
    w.add_argument("--lora-rank", type=int, default=16, help="LoRA rank for the lora and qlora methods")
    common(w, "cuda")
    w.set_defaults(run=cmd_wall, parser=w)
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
