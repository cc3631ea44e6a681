"""`--from PATH` for estimate, plan and wall (a training config read into a Recipe, labkit.plan.configs),
estimate's `--waterfall` (what each knob buys, labkit.plan.waterfall), and `python -m labkit compare` (the
published calculators beside labkit, labkit.plan.peers)."""

from __future__ import annotations

import json

from labkit.memory.units import fmt_bytes

from .common import _error_words

# estimate's options that may go with --from: what the config leaves open, and what to print
FROM_ALLOWED = {"from_path", "seq", "dp", "model", "batch", "budget", "headroom", "json", "waterfall", "plot",
                "verify", "device", "target", "run", "parser", "command"}


def given_options(args, parser) -> list[str]:
    """The options given on the command line (those whose value is not the parser's default)."""
    out = []
    for action in parser._actions:
        if action.dest in ("help",) or not action.option_strings:
            continue
        if getattr(args, action.dest, None) != action.default:
            out.append(action.dest)
    return out


def reading_of(args, parser):
    """The config `--from` names, read with what the command line gives for what it leaves open."""
    from labkit.plan.configs import ConfigRefused, read_config

    try:
        dp = getattr(args, "dp", None)
        return read_config(args.from_path, seq=args.seq, devices=dp if dp and dp > 1 else None,
                           model=getattr(args, "model", None), batch=getattr(args, "batch", None),
                           target=getattr(args, "target", None))
    except FileNotFoundError as e:
        parser.error(f"--from: {e}")
    except ConfigRefused as e:
        parser.error(f"--from {args.from_path}: {e}")


def check_from(args, parser) -> None:
    """--from reads every knob from the config: refuse the knob options beside it, naming them."""
    extra = [d for d in given_options(args, parser) if d not in FROM_ALLOWED]
    if extra:
        names = ", ".join("--" + d.replace("_", "-") for d in extra)
        parser.error(f"--from reads every knob from the config; {names} would change it: edit the config, or "
                     "give only --seq, --dp (devices), --model and --batch for what the config leaves open")
    for name in ("waterfall", "plot", "verify"):
        if getattr(args, name, None) and not args.from_path and name != "waterfall":
            parser.error(f"--{name} draws or checks a waterfall: give --waterfall (and --from PATH or --model)")


def cmd_estimate_all(args, parser) -> int:
    """`python -m labkit estimate`: --from PATH and --waterfall here, every other case labkit.cli.estimate's."""
    from .common import check_model
    from .estimate import _recipe, check_estimate_options, cmd_estimate

    args.device_given = args.device is not None
    args.device = args.device or "cpu"
    if args.from_path:
        return cmd_estimate_from(args, parser)
    if args.model is None:
        parser.error("give --model NAME, or --from PATH (a training config)")
    if args.target:
        parser.error("--target chooses the files of an export folder: give --from FOLDER too")
    args.seq = 1024 if args.seq is None else args.seq
    if (args.plot or args.verify) and not args.waterfall:
        parser.error(f"--{'plot' if args.plot else 'verify'} is for the waterfall: give --waterfall too")
    if not args.waterfall:
        return cmd_estimate(args, parser)
    micro = check_estimate_options(args, parser)
    if args.tp > 1 or args.pp > 1:
        parser.error("--waterfall takes one device's or a data-parallel recipe, not --tp/--pp")
    # the model as given (a name or a GPTConfig), so that --verify can build it
    return cmd_estimate_from(args, parser, _recipe(args, check_model(args.model)[0], micro, args.device))


def cmd_estimate_from(args, parser, recipe_of_args=None) -> int:
    """estimate --from PATH [--waterfall [--plot PNG] [--verify]], or --waterfall on the options' recipe."""
    from labkit.estimate import estimate

    from labkit.estimate.host import host_needs

    from .estimate import (MEASURES, _verdict_dict, _verdict_text, budget_of, format_estimate,
                           layout_json, peak_json)

    budget, headroom = budget_of(args, parser)
    if args.from_path:
        check_from(args, parser)
        reading = reading_of(args, parser)
        recipe = reading.recipe
        if args.device_given:
            recipe = recipe.replace(device=args.device)
        head = reading.summary()
    else:
        reading, recipe, head = None, recipe_of_args, ""
    if args.plot and not args.waterfall:
        parser.error("--plot PNG draws the waterfall: give --waterfall too")
    if args.verify and not args.waterfall:
        parser.error("--verify measures the waterfall's bars: give --waterfall too")
    if args.waterfall:
        return _waterfall(args, parser, recipe, head, budget)
    try:
        e, host = estimate(recipe), host_needs(recipe)
    except ValueError as err:
        raise ValueError(_error_words(err)) from err
    if args.json:
        out = {"config": str(args.from_path), "format": reading.format.name, "recipe": _recipe_json(recipe),
               "ignored": dict(reading.ignored), "approximated": dict(reading.approximated),
               "assumed": dict(reading.assumed), "peak": int(e.peak.total), "peak_phase": e.peak_phase,
               "categories": {k: v for k, v in e.peak.as_dict().items() if k != "total"},
               **peak_json(e), "layout": layout_json(recipe), "host": [h.as_dict() for h in host],
               "measures": MEASURES}
        print(json.dumps(out | _verdict_dict(e.peak.total, budget, headroom)))
        return 0
    print(head + "\n\n" + format_estimate(e, recipe.device, args.all_terms, host)
          + _verdict_text(e.peak.total, budget, headroom))
    return 0


def _recipe_json(recipe) -> dict:
    out = {"model": str(recipe.model), "batch": recipe.batch, "seq": recipe.seq, **recipe.options()}
    out["lora_targets"] = list(out["lora_targets"]) if isinstance(out["lora_targets"], tuple) else out["lora_targets"]
    return out


def _waterfall(args, parser, recipe, head: str, budget) -> int:
    from labkit.plan.waterfall import waterfall

    if args.verify:
        from labkit.plan.verify import check_runnable

        try:
            check_runnable(recipe)
        except ValueError as e:
            parser.error(f"--verify: {e}")
        if recipe.distributed:
            parser.error("--verify measures each bar on this device: the recipe uses several devices")
    try:
        w = waterfall(recipe, verify=args.verify)
    except ValueError as err:
        raise ValueError(_error_words(err)) from err
    if args.plot:
        from labkit.viz.style import to_png
        from labkit.viz.waterfall import waterfall_chart

        with open(args.plot, "wb") as f:
            f.write(to_png(waterfall_chart(w, budget=budget)))
    if args.json:
        print(json.dumps({"recipe": _recipe_json(recipe), "steps": [
            {"knob": None if s.knob is None else s.knob.name.lower(), "name": s.name, "peak": int(s.peak),
             "saved": int(s.saved), "cut": s.cut, **({} if s.measured is None else {"measured": int(s.measured)})}
            for s in w.steps], "alone": {k.name.lower(): v for k, v in w.alone},
            "refused": {k.name.lower(): why for k, why in w.refused}}))
        return 0
    lines = ([head, ""] if head else []) + [w.table()]
    if budget is not None:
        verdict = "fits" if w.steps[-1].peak <= budget else "does not fit"
        lines.append(f"budget {fmt_bytes(budget)}: the recipe {verdict}")
    if args.plot:
        lines.append(f"chart: {args.plot}")
    print("\n".join(lines))
    return 0


def cmd_compare(args, parser) -> int:
    """python -m labkit compare --model NAME: the calculators' figures beside labkit's (labkit.plan.peers)."""
    from labkit.estimate.recipe import Recipe
    from labkit.plan.peers import compare

    from .common import _positive, check_model

    for name in ("batch", "seq", "dp"):
        _positive(parser, "--" + name, getattr(args, name))
    check_model(args.model)
    try:
        c = compare(Recipe(args.model, args.batch, args.seq, dtype=args.dtype, device=args.device, dp=args.dp))
    except ValueError as err:
        raise ValueError(_error_words(err)) from err
    if args.json:
        print(json.dumps({"model": args.model, "textbook": c.textbook, "exact": c.exact,
                          "rows": [{"tool": r.tool, "what": r.what, "bytes": r.bytes, "shown": r.shown,
                                    "differences": list(r.differences)} for r in c.rows]}))
    else:
        print(f"{args.model}, batch {args.batch} x seq {args.seq}, {args.dtype}, {args.device} kernels, "
              f"{args.dp} device(s): what each calculator says, and why it differs from labkit's exact peak")
        print(c.table())
    return 0
