"""`python -m labkit plan`: which training configuration to use for a model on some devices, ranked by
fidelity then predicted step time (labkit.plan)."""

from __future__ import annotations

import json
import re
import shlex
import sys

from labkit.memory.units import fmt_bytes
from labkit.memory.table import wrap_line

from .common import UNITS_NOTE, _INTEGER, _items, _positive, check_model, headroom_fraction, size_option

PLAN_PRECISIONS = ("fp32", "mixed-bf16", "mixed-fp16", "bf16", "fp16")


def _plan_inputs(args, parser) -> dict:
    """plan()'s keywords from the command line, every value checked (one line on error, exit 2)."""
    from labkit.plan.devices import names
    from labkit.plan.search import MAX_DEVICES, OPTIMIZERS, SearchOptions

    _positive(parser, "--devices", args.devices)
    if args.devices > MAX_DEVICES:
        parser.error(f"--devices must be at most {MAX_DEVICES}, got {args.devices}")
    _positive(parser, "--top", args.top)
    headroom = headroom_fraction(parser, args.headroom)
    if args.memory is None and args.device_preset is None:
        parser.error("give --memory (e.g. 24GiB) or --device-preset (one of " + ", ".join(names()) + ")")
    memory = None if args.memory is None else size_option(parser, "--memory", args.memory)
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
    options = SearchOptions("allow" if args.peft else False, args.min_precision, args.top, tuple(optimizers),
                            headroom)
    return dict(model=model, devices=args.devices, memory=memory, device_preset=args.device_preset,
                batch=args.batch, seq=args.seq, options=options)


def format_plans(plans, args, device) -> str:
    p0 = plans[0]
    r = p0.recipe
    given = f" (--memory {args.memory})" if args.memory else ""
    speeds = (f"speeds of {device.title}" + ("" if device.memory == p0.memory else
                                             f", the preset closest to that memory (its {fmt_bytes(device.memory)}: "
                                             "a vendor's GB read as GiB)"))
    lines = [wrap_line(f"{args.model}: {args.devices} device(s), {fmt_bytes(p0.memory)} each{given}, {speeds}; "
                       f"batch {r.batch} x seq {r.seq} per step ({UNITS_NOTE})"),
             "ranked by fidelity, then predicted step time (labkit.plan.cost)", ""]
    for i, p in enumerate(plans, 1):
        t = p.time
        parts = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t.parts().items() if v)
        lines += [f"{i}. {p.summary()}",
                  f"   peak {fmt_bytes(p.peak)} per device at {p.peak_phase}: {p.peak_where}; "
                  f"binding term: {p.binding} ({fmt_bytes(p.binding_bytes)})",
                  f"   step {p.seconds * 1e3:.1f} ms predicted, {p.relative:.2f}x the fastest ({parts})",
                  f"   fidelity: {p.fidelity.describe()}"]
        if p.tight:
            lines[-4] += f"  [tight: within {p.headroom:.0%} of the budget]"
        lines += [f"   - {w}" for w in p.why]
        lines.append("")
    # within 120 columns: a long line wraps at its words, its next lines indented under its text
    return "\n".join(wrap_line(line, indent=" " * (len(line) - len(line.lstrip(" -0123456789."))))
                     for line in lines).rstrip()


def export_command(args) -> str:
    """The shell command that writes plan 1's launch files: this search again, with --export."""
    opts = [("--model", args.model), ("--devices", args.devices if args.devices != 1 else None),
            ("--memory", args.memory), ("--device-preset", args.device_preset),
            ("--batch", args.batch), ("--seq", args.seq), ("--min-precision", args.min_precision
                                                          if args.min_precision != "bf16" else None),
            ("--optimizers", args.optimizers), ("--top", args.top if args.top != 5 else None),
            ("--headroom", f"{args.headroom:g}" if args.headroom != 10 else None)]
    words = ["python", "-m", "labkit", "plan"] + [w for k, v in opts if v is not None for w in (k, str(v))]
    words += ["--peft"] if args.peft else []
    return " ".join(shlex.quote(w) for w in words + ["--export", args.export or "plan-1"])


def cmd_plan(args, parser) -> int:
    from labkit.plan import NoPlanError, plan
    from labkit.plan.devices import closest, get_device

    if args.from_path:  # the config's model, rows, sequence and devices; the search tries every knob itself
        from .configs import reading_of

        if args.batch is not None or args.tokens is not None:
            parser.error("--from gives the batch (the config's micro-batch x accumulation x devices): "
                         "drop --batch/--tokens")
        args.dp = None
        reading = reading_of(args, parser)
        r = reading.recipe
        args.model, args.batch, args.seq = r.model, r.batch, r.seq
        args.devices = r.world_size if args.devices == 1 else args.devices
        print(reading.summary())
        print(f"planning its model, batch {r.batch} x seq {r.seq} on {args.devices} device(s); the search "
              "tries every knob itself (the config's own choices: `estimate --from`)\n")
    elif args.model is None:
        parser.error("give --model NAME, or --from PATH (a training config)")
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
    exported, refusals = None, []
    if export_plan is not None:
        from labkit.plan.export import export_gaps, refusal_line

        exported = {k: str(v) for k, v in export_plan(plans[0].recipe, out_dir, devices=args.devices).items()}
        gaps = export_gaps(plans[0].recipe, args.devices)
        refusals = [f"warning: {refusal_line(t, g)}" for t, g in gaps.items() if g]
        carried = [t for t, g in gaps.items() if not g]
        refusals += ([f"the {', '.join(carried)} target(s) carry every memory-changing field of plan 1"] if carried
                     else ["warning: no target carries every memory-changing field of plan 1"]) if refusals else []
    if args.json:
        out = {"model": args.model, "devices": args.devices, "memory": int(plans[0].memory),
               "device": device.name, "batch": plans[0].recipe.batch, "seq": plans[0].recipe.seq,
               "plans": [p.as_dict() for p in plans], "export_command": export_command(args)}
        if checked is not None:
            out["verify"] = checked if isinstance(checked, str) else checked.as_dict()
        if exported is not None:
            out["export"] = exported
            out["export_refused"] = {t: [g.field for g in gs] for t, gs in gaps.items() if gs}
            for line in refusals:
                print(f"labkit plan: {line}", file=sys.stderr)
        print(json.dumps(out))
        return rc
    text = format_plans(plans, args, device)
    if checked is not None:
        text += "\n\n" + str(checked)
    if exported is not None:
        text += "\n\nexported plan 1:\n" + "\n".join(f"  {k}: {v}" for k, v in exported.items())
        text += "".join(f"\n{line}" for line in refusals)
    else:
        text += ("\n\nto export plan 1 (training_args.json, accelerate and torchrun files; ds_config.json for "
                 f"ZeRO/offload plans):\n  {export_command(args)}")
    print(text)
    return rc
