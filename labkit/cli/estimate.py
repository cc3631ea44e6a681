"""`python -m labkit estimate`: one training step's predicted memory, every term with its formula and source,
each phase's peak by category (and with --tp / --pp, every rank's)."""

from __future__ import annotations

import json

from labkit.memory.report import CATEGORIES, PHASES
from labkit.memory.table import Table, wrap_line
from labkit.memory.units import fmt_bytes

from .common import (GPU_SIZED, UNITS_NOTE, _check_peak, _error_words, _positive, _table, check_model, headroom_fraction,
                     read_model, size_option, verdict_line)


def estimate_dict(model_text: str, e, args, recipe=None, n_params: int | None = None,
                  host=()) -> dict:
    """The --json object: every byte value an int; categories are the breakdown at the peak,
    peak_terms the terms alive then (they sum to the peak). n_params: the model's parameters
    (default e.n_params; a tp/pp rank's own count is rank_params); layout: the recipe's ranks and
    how the global batch is split over them; host: the offload options' HostNeeds."""
    peak = e.peak.as_dict()
    return {
        "model": model_text, "n_params": int(e.n_params if n_params is None else n_params),
        "rank_params": int(e.n_params), "global_batch": args.batch, "seq": args.seq,
        "dtype": args.dtype, "optimizer": args.optimizer, "device": args.device,
        **({} if recipe is None else {"layout": layout_json(recipe)}),
        "options": {k: getattr(args, k) for k in ("checkpoint", "segments", "offload_activations", "micro_batch",
                                                   "accumulate", "rank", "proj_dtype", "optimizer_offload",
                                                   "step_in_backward",
                                                   "lora_rank", "lora_targets", "quant", "quant_group", "lisa_layers",
                                                   "base_dtype", "loss_chunks")
                    if hasattr(args, k)}
                   # given only: a default run's JSON is unchanged
                   | ({"selective_policy": args.selective_policy}
                      if getattr(args, "selective_policy", None) else {})
                   | ({"quant_set": args.quant_set} if getattr(args, "quant_set", None) else {})
                   | ({"paged_states": True} if getattr(args, "paged", False) else {}),
        "peak_phase": e.peak_phase, "peak": int(e.peak.total),
        "categories": {k: v for k, v in peak.items() if k != "total"},
        **peak_json(e),
        "phases": {p: e.phases[p].as_dict() for p in PHASES if p in e.phases},
        "host": [h.as_dict() for h in host],
        "measures": MEASURES,
    }


def layout_json(r) -> dict:
    """A Recipe's ranks and each one's rows: dp, zero, tp, pp, rank_batch (global batch / dp),
    micro_batch."""
    return {"dp": r.dp, "zero": r.zero, "tp": r.tp, "pp": r.pp, "rank_batch": r.rank_batch,
            "micro_batch": r.micro}


MEASURES = "allocated"  # the CUDA figure the estimate predicts: torch.cuda.max_memory_allocated's


def peak_json(e) -> dict:
    """{"peak_moment": its phase, where, kind and block; "peak_terms": its terms (key, name,
    category, bytes, block)}; empty for an estimate built from phases (no moments)."""
    m = e.peak_moment
    if m is None:
        return {}
    cat = {c: c.name.lower() for c in CATEGORIES}  # the keys of "categories"
    return {"peak_moment": {"phase": m.phase, "where": m.where, "kind": m.kind.name.lower(),
                            "block": m.block},
            "peak_terms": [{"key": t.key.name.lower(), "name": t.name, "category": cat[t.category],
                            "bytes": int(t.bytes), "block": t.block} for t in m.terms if t.bytes]}


TERM_HEADER = ["term", "category", "bytes", "formula", "source"]


def _term_rows(terms) -> list[list[str]]:
    return [[t.name, str(t.category), fmt_bytes(t.bytes), t.formula, t.source] for t in terms]


def peak_terms_table(e) -> Table:
    """The terms alive at the peak moment, one row each (zero ones left out); their sum below."""
    m = e.peak_moment
    rows = _term_rows(t for t in m.terms if t.bytes)
    return Table(TERM_HEADER, rows, right={2}, rule=False,
                 caption=wrap_line(f"the terms alive at the peak ({m.phase}: {m.where}); "
                                   f"--all-terms lists the whole step's"),
                 footer=[f"sum: {fmt_bytes(m.total)} = the peak, from the {len(rows)} terms above"])


def all_terms_table(e) -> Table:
    """Estimate.terms: every term of the step once, at its largest, whenever it is alive (a
    summary of the step, not one moment)."""
    total = sum(t.bytes for t in e.terms)
    return Table(TERM_HEADER, _term_rows(e.terms), right={2}, rule=False,
                 caption=wrap_line("all terms of the step (--all-terms): each at its largest, "
                                   "whenever in the step it lives, as if nothing were "
                                   "checkpointed, offloaded or freed early; they are never alive "
                                   "all at once"),
                 footer=[f"their sum, {fmt_bytes(total)}, is not the peak"])


def format_estimate(e, device: str, all_terms: bool = False, host=()) -> str:
    """The readable report: the terms alive at the peak (with --all-terms also the whole step's),
    each phase's peak by category, the peak, what offload keeps off the device (`host`:
    HostNeeds) and what the figures are on CUDA."""
    lines = [wrap_line(f"{kernels(device)}: {e.label}, {e.n_params:,} parameters"),
             f"units: {UNITS_NOTE}", ""]
    if e.peak_moment is None or all_terms:
        lines += [all_terms_table(e).text(), ""]
    if e.peak_moment is not None:
        lines += [peak_terms_table(e).text(), ""]
    lines.append("peak of each phase, by category")
    rows = [["phase"] + [str(c) for c in CATEGORIES] + ["total"]]
    for p in PHASES:
        b = e.phases[p]
        rows.append([p] + [fmt_bytes(b[c]) for c in CATEGORIES] + [fmt_bytes(b.total)])
    lines += [_table(rows, right=set(range(1, len(rows[0])))), ""]
    lines.append(f"peak: {fmt_bytes(e.peak.total)} ({e.peak.total:,} bytes) in the {e.peak_phase} phase")
    lines += host_lines(host)
    lines.append(wrap_line(ALLOCATED_NOTE))
    return "\n".join(lines)


ALLOCATED_NOTE = ("what these bytes are: on CUDA (--device cuda), allocated bytes, what "
                  "torch.cuda.max_memory_allocated reports; torch.cuda.max_memory_reserved adds "
                  "the caching allocator's rounding (512-byte blocks) and fragmentation (freed "
                  "blocks it keeps cached), and nvidia-smi adds the CUDA context too "
                  "(labkit.memory.allocator measures both)")


def host_lines(host) -> list[str]:
    """One line per HostNeed, then the total per medium: what offload keeps off the device."""
    if not host:
        return []
    out = ["off the device (the offload options):"]
    for h in host:
        out.append(wrap_line(f"  {h.medium}: {'up to ' if h.at_most else ''}{fmt_bytes(h.bytes)}, "
                             f"{h.name} = {h.formula} ({h.source})", indent="      "))
    for medium in sorted({h.medium for h in host}, key=lambda m: m.value):
        total = sum(h.bytes for h in host if h.medium is medium)
        bound = "up to " if any(h.at_most for h in host if h.medium is medium) else ""
        out.append(f"  {medium} needed: {bound}{fmt_bytes(total)} ({total:,} bytes)")
    return out


def kernels(device: str) -> str:
    """Whose kernels the figures model, said in the first line (estimate's default is cpu, wall's cuda)."""
    return (f"{device} kernels" + (" (estimate's default; wall's is cuda: --device cuda for a GPU's)"
                                   if device == "cpu" else ""))


def budget_of(args, parser):
    """(--budget in bytes, headroom as a fraction), or (None, headroom) without --budget."""
    headroom = headroom_fraction(parser, args.headroom)
    return (None if args.budget is None else size_option(parser, "--budget", args.budget)), headroom


def check_estimate_options(args, parser) -> int | None:
    """Refuse what the command line alone shows is wrong: numbers out of range and options that mean
    something only with another. Returns the micro-batch. (What depends on the model, such as --seq beyond
    its positions or --lisa-layers beyond its layers, the estimator checks.)"""
    for name in ("batch", "seq", "segments", "micro_batch", "accumulate", "rank", "lora_rank", "lisa_layers",
                 "quant_group"):
        _positive(parser, "--" + name.replace("_", "-"), getattr(args, name))
    _positive(parser, "--loss-chunks", getattr(args, "loss_chunks", None))
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
    if getattr(args, "selective_policy", None) is not None and args.checkpoint != "selective":
        parser.error(f"--selective-policy {args.selective_policy} chooses what --checkpoint selective keeps: give "
                     f"--checkpoint selective too, not --checkpoint {args.checkpoint}")
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
    if getattr(args, "quant_set", None) is not None and args.quant == "none":
        parser.error(f"--quant-set {args.quant_set} chooses which Linears --quant stores: give "
                     "--quant too (e.g. --quant nf4)")
    if args.lisa_layers is not None and (args.lora_rank is not None or args.quant != "none"):
        parser.error("--lisa-layers trains whole layers: give it without --lora-rank and --quant")
    if args.lora_targets is None:
        args.lora_targets = "all-linear"
    return micro


def _recipe(args, spec, micro, device: str, **layout):
    """The labkit.estimate.Recipe the options describe, on `device`; layout: tp, pp and their options."""
    from labkit.estimate.recipe import Recipe

    return Recipe(spec, args.batch, args.seq, dtype=args.dtype, optimizer=args.optimizer, device=device,
                  checkpoint=args.checkpoint, segments=args.segments, offload_activations=args.offload_activations,
                  selective_policy=args.selective_policy or "matmuls", micro_batch=micro, rank=args.rank,
                  proj_dtype=args.proj_dtype, optimizer_offload=args.optimizer_offload,
                  step_in_backward=args.step_in_backward, lora_rank=args.lora_rank, lora_targets=args.lora_targets,
                  quant=args.quant, quant_group=args.quant_group, lisa_layers=args.lisa_layers, dp=args.dp,
                  quant_set=getattr(args, "quant_set", None) or "all-linear",
                  paged_states=getattr(args, "paged", False),
                  base_dtype=getattr(args, "base_dtype", None),
                  loss_chunks=getattr(args, "loss_chunks", None),
                  zero=args.zero, zero_offload=args.zero_offload, **layout)


def cmd_estimate(args, parser) -> int:
    """One step's estimate from the options (labkit.cli.configs.cmd_estimate_all sends --from and
    --waterfall elsewhere and fills the defaults first)."""
    from labkit.estimate import estimate
    from labkit.estimate.host import host_needs

    micro = check_estimate_options(args, parser)
    budget, headroom = budget_of(args, parser)
    spec = read_model(check_model(args.model)[0], args.model)
    if args.tp > 1 or args.pp > 1:
        return _estimate_layout(args, spec, micro, budget, headroom)
    try:  # the Recipe's and the estimator's refusals, in the command line's words
        recipe = _recipe(args, spec, micro, args.device)
    except ValueError as err:
        raise ValueError(_error_words(err)) from err

    def run(r):
        try:
            return estimate(r), host_needs(r)
        except ValueError as err:
            raise ValueError(_error_words(err)) from err

    e, host = run(recipe)
    _check_peak(e.peak.total, f"{args.model} with --batch {args.batch} --seq {args.seq}")
    gpu_sized = args.device == "cpu" and e.peak.total >= GPU_SIZED
    gpu = run(recipe.replace(device="cuda"))[0] if gpu_sized else None
    if args.json:
        out = estimate_dict(args.model, e, args, recipe, spec.n_params, host)
        if gpu is not None:
            out["cuda_peak"] = int(gpu.peak.total)
        if e.unified:
            out["unified"] = int(e.unified)
            if budget is not None:
                out["paging"] = _paging_dict(e, budget)
        print(json.dumps(out | _verdict_dict(e.peak.total, budget, headroom)))
    else:
        print(format_estimate(e, args.device, getattr(args, "all_terms", False), host)
              + ("" if gpu is None else "\n" + cpu_note(e, gpu))
              + _verdict_text(e.peak.total, budget, headroom) + paged_text(e, budget))
    return 0


def _paging_dict(e, budget: int) -> dict:
    from labkit.estimate import paging

    p = paging(e, budget)
    return {"paged_out": int(p.evicted), "fits": bool(p.fits)}


def paged_text(e, budget: int | None) -> str:
    """--paged: the states' bytes in unified memory, apart from the peak; under --budget, what the
    driver pages out to host RAM (labkit.optim.paged.predict_paging)."""
    if not e.unified:
        return ""
    states = fmt_bytes(e.unified)
    lines = [f"paged optimizer states: {states} in CUDA unified memory (bitsandbytes' paged "
             "optimizers), not in the peak above: max_memory_allocated does not count them"]
    if budget is not None:
        from labkit.estimate import paging

        p = paging(e, budget)
        with_states = fmt_bytes(e.peak.total + e.unified)
        if not p.evicted:
            lines.append(f"paging: none; the peak with the states on the device, {with_states}, "
                         "fits the budget")
        elif p.fits:
            out = fmt_bytes(p.evicted)
            lines.append(f"paging: the peak with the states on the device is {with_states}, over "
                         f"the budget: the driver pages about {out} of them out to host RAM and "
                         "brings them back in the optimizer step (slower, not out of memory)")
        else:
            peak = fmt_bytes(e.peak.total)
            lines.append(f"paging: the device peak without the states, {peak}, is over the "
                         "budget: paging every state out does not make it fit")
    return "".join("\n" + wrap_line(t) for t in lines)


def _verdict_dict(peak: int, budget: int | None, headroom: float) -> dict:
    from labkit.memory.units import fit_verdict

    if budget is None:
        return {}
    return {"budget": budget, "headroom": headroom, "verdict": fit_verdict(peak, budget, headroom)}


def _verdict_text(peak: int, budget: int | None, headroom: float) -> str:
    return "" if budget is None else f"\nbudget: {verdict_line(peak, budget, headroom)}"


def cpu_note(e, gpu) -> str:
    """What --device cpu (the default) modelled, and the peak a GPU's kernels give (--device cuda)."""
    diff = gpu.peak.total / e.peak.total - 1
    return wrap_line(f"note: this modelled CPU kernels (--device cpu, the default on every machine); a GPU's kernels (fused "
            f"attention, dropout masks, Adam's foreach path) give "
            + (f"{fmt_bytes(gpu.peak.total)} ({diff:+.1%})" if diff else "the same peak")
            + f" in the {gpu.peak_phase} phase: add --device cuda for a GPU", indent="      ")


def _estimate_layout(args, spec, micro, budget=None, headroom=0.1) -> int:
    """--tp / --pp: every rank's peak (the largest first in the report), then the largest rank's terms, and
    the bytes each layout sends per step by the collectives' definitions."""
    from labkit.estimate.layout_terms import layout_wire_bytes
    from labkit.estimate import estimate_ranks

    try:
        r = _recipe(args, spec, micro, args.device, tp=args.tp, pp=args.pp, schedule=args.schedule,
                    sequence_parallel=args.sequence_parallel)
        ranks = estimate_ranks(r)
        wire = layout_wire_bytes(r)
    except ValueError as err:
        raise ValueError(_error_words(err)) from err
    top = max(ranks, key=lambda e: e.peak.total)
    _check_peak(top.peak.total, f"{args.model} with --batch {args.batch} --seq {args.seq}")
    if args.json:
        out = estimate_dict(args.model, top, args, r, spec.n_params)
        out["layout"] |= {"schedule": args.schedule, "sequence_parallel": args.sequence_parallel,
                          "micro_batches": r.rank_batch // r.micro}
        out["ranks"] = [{"rank": i, "stage": i // args.tp, "tp_rank": i % args.tp, "label": e.label,
                         "peak": int(e.peak.total), "peak_phase": e.peak_phase,
                         "categories": {k: v for k, v in e.peak.as_dict().items() if k != "total"}}
                        for i, e in enumerate(ranks)]
        out["wire_bytes_per_step"] = {k: float(v) for k, v in wire.items()}
        if top.unified:  # --paged: the largest rank's states in unified memory
            out["unified"] = int(top.unified)
            if budget is not None:
                out["paging"] = _paging_dict(top, budget)
        print(json.dumps(out | _verdict_dict(top.peak.total, budget, headroom)))
        return 0
    rows = [["rank", "stage", "tp rank", "peak", "phase"] + [str(c) for c in CATEGORIES]]
    for i, e in enumerate(ranks):
        rows.append([str(i), str(i // args.tp), str(i % args.tp), fmt_bytes(e.peak.total), e.peak_phase]
                    + [fmt_bytes(e.peak[c]) for c in CATEGORIES])
    lines = [wrap_line(f"per-rank peaks (tp={args.tp} pp={args.pp}"
             + (f" {args.schedule}" if args.pp > 1 else "") + (" sequence-parallel" if args.sequence_parallel else "")
             + f", {r.rank_batch // r.micro} micro-batch{'es' * (r.rank_batch // r.micro > 1)} of {r.micro} rows;"
             + f" {kernels(args.device)})"
             + (f"; each of the dp={args.dp} replicas (ZeRO-{args.zero}) holds the same" if args.dp > 1 else "")),
             _table(rows, right={3}), ""]
    lines.append("bytes sent per step (by the collectives' definitions)")
    lines += [f"  {k}: {fmt_bytes(int(v))}" for k, v in wire.items()]
    lines += ["", f"the largest rank: {top.label}",
              format_estimate(top, args.device, getattr(args, "all_terms", False))]
    if budget is not None:
        lines.append(f"budget (the largest rank): {verdict_line(top.peak.total, budget, headroom)}")
    print("\n".join(lines) + paged_text(top, budget))
    return 0
