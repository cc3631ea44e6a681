"""The CUDA tier in one command, in under ten minutes: `make gpu-check` (python bench/gpu_check.py).

    python bench/gpu_check.py [--dry-run] [--budget-s 600] [--out DIR] [--configs 20] [--seed 0]

On a CUDA machine it runs, each step in its own process under its own time limit, never stopping at a failure:

1. tests/gpu (pytest -m gpu);
2. every lesson top to bottom at the device's profile (nbval, LABKIT_SMOKE=0), a few at a time, each cut at a
   per-lesson limit so that one slow lesson cannot eat the run;
3. the estimator against torch.cuda.max_memory_allocated on >= 20 random configurations, the prediction made of
   named terms: the logical bytes (labkit.estimate), the rounding of each storage to its 512-byte block (from the
   ledger's storages), and what the allocator held before the step (the cuBLAS workspaces: measured once);
4. real budgets (set_per_process_memory_fraction): a budget below the step's peak is an out-of-memory result,
   memory comes back to its baseline, a budget above it fits;
5. the allocator's own bytes for lesson 01 (labkit.memory.allocator): the CUDA context, the 512-byte rounding,
   the workspaces, fragmentation under a churn workload with and without expandable_segments;
6. NCCL: labkit.distributed.comms' collectives on 1 GPU (world size 1) and on every GPU when there are more;
7. torch._scaled_mm FP8 against its emulation where the device has FP8 GEMMs (compute capability >= 8.9).

It writes report.json and summary.md (the device, versions, each figure, each failure, each skip, each step's
seconds) and allocator_recording.json under $OUT when set, else data/gpu_check/. Copy allocator_recording.json to
data/ and commit it: lesson 01 replays it on machines without CUDA.

Without CUDA (or with --dry-run) it runs the same plan with every CUDA step replaced by a recorded skip, checks
that the plan's per-step limits and estimates fit the budget at both GPU profiles (lesson estimates from
data/lesson_times.json, step estimates from the last report when there is one), writes the same report, and exits
0 when the plan fits, 1 when it does not. A real run exits 0 when nothing failed, else 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BUDGET_S = 600  # the whole run, seconds
MARGIN_S = 30  # start-up, the report, and the slack between steps
REPORT_FORMAT = "labkit-gpu-check/1"
GPU_PROFILES = ("small-gpu", "big-gpu")
WORKERS = {"small-gpu": 2, "big-gpu": 4}  # lessons run at once (a T4's 16 GB holds two small-gpu lessons)
MIN_CONFIGS = 20

# The fixed steps: (name, what, time limit s, allotted estimate s). An allotment is a guess until a run on a GPU
# measures the step; the plan then takes the last report's seconds instead (say so in the report: "basis").
FIXED = (
    ("device", "the device, its profile and the versions", 20, 5),
    ("tests-gpu", "pytest tests/gpu -m gpu", 170, 120),
    ("estimator", f">= {MIN_CONFIGS} random configurations: estimate vs max_memory_allocated", 70, 45),
    ("budgets", "real budgets with set_per_process_memory_fraction, recovery to baseline", 40, 20),
    ("allocator", "context, 512 B rounding, workspaces, churn with/without expandable_segments", 50, 25),
    ("nccl", "labkit.distributed.comms collectives over NCCL (world size 1, then every GPU)", 45, 25),
    ("fp8", "torch._scaled_mm FP8 against its emulation", 25, 10),
)
CUDA_STEPS = {"tests-gpu", "estimator", "budgets", "allocator", "nccl", "fp8"}  # "device" runs anywhere


@dataclasses.dataclass(frozen=True)
class Step:
    name: str  # "tests-gpu", ..., or "lesson 07"
    what: str
    limit_s: float  # the step is stopped here
    estimate_s: float  # what the plan expects it to take
    basis: str  # where the estimate comes from


@dataclasses.dataclass(frozen=True)
class Plan:
    profile: str
    budget_s: float
    workers: int  # lessons at once
    lesson_limit_s: float
    steps: tuple  # of Step: the fixed ones, then one per lesson

    def fixed(self) -> list[Step]:
        return [s for s in self.steps if not s.name.startswith("lesson ")]

    def lessons(self) -> list[Step]:
        return [s for s in self.steps if s.name.startswith("lesson ")]


# ---- the plan and its time budget (pure: unit-tested on CPU) -----------------------------------------------------

def lesson_phase_s(seconds: list[float], workers: int) -> float:
    """Wall time of running jobs of these durations on `workers` at once, longest first onto the least loaded."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    loads = [0.0] * workers
    for s in sorted(seconds, reverse=True):
        loads[loads.index(min(loads))] += s
    return max(loads)


def lesson_estimate(entry: dict, profile: str) -> tuple[float, str]:
    """(seconds, basis) for one lesson of data/lesson_times.json at a GPU profile: its own time at that profile
    when one was measured and finished, else the cpu profile's as a stand-in (no GPU time recorded yet)."""
    own = entry.get(profile)
    if own and own.get("finished"):
        return float(own["seconds"]), f"measured at {profile} ({own.get('machine', {}).get('gpu', '?')})"
    for other in ("cpu", "smoke"):
        if entry.get(other) and entry[other].get("seconds") is not None:
            return float(entry[other]["seconds"]), f"stand-in: the {other} profile's time (no {profile} time yet)"
    return 60.0, "allotment: no time recorded for this lesson"


def step_estimates(last_report: dict | None) -> dict[str, tuple[float, str]]:
    """{step: (seconds, basis)}: the fixed steps' allotments, replaced by the last real run's seconds for every step
    it ran (fixed steps and lessons; a step it cut at its limit gives a lower bound)."""
    out = {name: (float(est), "allotment (not yet measured on a GPU)") for name, _, _, est in FIXED}
    if last_report and not last_report.get("dry_run"):
        dev = last_report.get("device", {}).get("name", "?")
        for r in last_report.get("steps", []):
            if r.get("seconds") is None:
                continue
            if r.get("status") in ("passed", "failed"):
                out[r["name"]] = (float(r["seconds"]), f"measured by gpu_check on {dev}")
            elif r.get("status") == "timeout":
                out[r["name"]] = (float(r["seconds"]), f"lower bound: cut at its limit by gpu_check on {dev}")
    return out


def make_plan(profile: str, lesson_times: dict, last_report: dict | None = None, budget_s: float = BUDGET_S,
              workers: int | None = None) -> Plan:
    """The steps with their limits: the fixed steps' limits, then what remains of the budget (less MARGIN_S) split
    into equal per-lesson limits over rounds of `workers` lessons at once."""
    if profile not in GPU_PROFILES:
        raise ValueError(f"profile must be one of {', '.join(GPU_PROFILES)}, got {profile!r}")
    workers = WORKERS[profile] if workers is None else workers
    est = step_estimates(last_report)
    fixed = [Step(name, what, float(limit), *est[name]) for name, what, limit, _ in FIXED]
    lessons = sorted(lesson_times.get("lessons", {}).items())
    left = budget_s - MARGIN_S - sum(s.limit_s for s in fixed)
    rounds = max(1, math.ceil(len(lessons) / workers))
    limit = math.floor(left / rounds)
    if limit <= 0:
        raise ValueError(f"no time left for the lessons: the fixed steps' limits take {budget_s - left - MARGIN_S:.0f} "
                         f"of {budget_s:.0f} s")
    steps = fixed + [Step(f"lesson {k}", entry.get("notebook", k), float(limit),
                          *est.get(f"lesson {k}", lesson_estimate(entry, profile))) for k, entry in lessons]
    return Plan(profile, float(budget_s), workers, float(limit), tuple(steps))


def check_plan(plan: Plan) -> dict:
    """The plan against its budget: the worst case (every step at its limit) and the expected case (each step at
    its estimate, a lesson at most its limit), the lessons likely to be cut, and whether it fits."""
    fixed, lessons = plan.fixed(), plan.lessons()
    worst = sum(s.limit_s for s in fixed) + lesson_phase_s([s.limit_s for s in lessons], plan.workers) + MARGIN_S
    expected = (sum(min(s.estimate_s, s.limit_s) for s in fixed) + MARGIN_S
                + lesson_phase_s([min(s.estimate_s, s.limit_s) for s in lessons], plan.workers))
    at_risk = [s.name for s in plan.steps if s.estimate_s > s.limit_s]
    return {"profile": plan.profile, "budget_s": plan.budget_s, "worst_case_s": round(worst, 1),
            "expected_s": round(expected, 1), "fits": worst <= plan.budget_s, "lesson_limit_s": plan.lesson_limit_s,
            "workers": plan.workers, "likely_cut": at_risk}


# ---- random configurations for the estimator (pure) --------------------------------------------------------------

def draw_configs(n: int, seed: int = 0, big: bool = True, bf16: bool = True) -> list[dict]:
    """`n` configurations for estimate vs max_memory_allocated, drawn at random from a fixed seed: labkit GPTs
    (layers, width, heads; width 1024 only when `big`), llama-tiny and gpt2; batch, sequence, dtype (fp16 in place
    of bf16 on a GPU without bf16, e.g. a T4), optimizer and recompute policy."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rng = random.Random(seed)
    widths = (128, 256, 384, 512, 768) + ((1024,) if big else ())
    out = []
    for _ in range(n):
        kind = rng.choice(("gpt", "gpt", "gpt", "llama-tiny", "gpt2"))
        seq = rng.choice((64, 128, 256, 512) if kind != "llama-tiny" else (64, 128))  # llama-tiny: 128 positions
        if kind == "gpt":
            width = rng.choice(widths)
            heads = rng.choice([h for h in (2, 4, 8, 16) if width % h == 0 and width // h >= 32])
            model = {"n_layer": rng.randint(2, 8), "n_head": heads, "n_embd": width, "block_size": seq}
        else:
            model = kind
        out.append({"model": model, "batch": rng.choice((1, 2, 4, 8)), "seq": seq,
                    "dtype": rng.choice(("fp32", "mixed-bf16", "bf16") if bf16 else ("fp32", "mixed-fp16", "fp16")),
                    "optimizer": rng.choice(("adamw", "sgd", "adafactor", "lion")),
                    "checkpoint": rng.choice(("none", "none", "full"))})
    return out


def allocator_terms(logical: int, rounding: int, held_before: int) -> dict:
    """The prediction of max_memory_allocated as named terms (bytes) and their sum."""
    terms = {"logical bytes (labkit.estimate)": int(logical), "rounding to 512 B blocks": int(rounding),
             "held before the step (cuBLAS workspaces, ...)": int(held_before)}
    return {"terms": terms, "predicted": sum(terms.values())}


# ---- the report (pure) -------------------------------------------------------------------------------------------

def step_result(step: Step, status: str, seconds: float | None = None, figures: dict | None = None,
                failures: list | None = None, reason: str = "") -> dict:
    """One step's entry: status is "passed", "failed", "skipped" or "timeout"."""
    if status not in ("passed", "failed", "skipped", "timeout"):
        raise ValueError(f"unknown status {status!r}")
    return {"name": step.name, "what": step.what, "status": status, "limit_s": step.limit_s,
            "estimate_s": step.estimate_s, "basis": step.basis,
            "seconds": None if seconds is None else round(seconds, 1), "figures": figures or {},
            "failures": list(failures or []), "reason": reason}


def build_report(device: dict, versions: dict, plans: list[dict], results: list[dict], dry_run: bool) -> dict:
    failed = [r["name"] for r in results if r["status"] in ("failed", "timeout")]
    return {"format": REPORT_FORMAT, "dry_run": dry_run, "date": datetime.datetime.now(datetime.timezone.utc)
            .isoformat(timespec="seconds"), "device": device, "versions": versions, "plans": plans,
            "steps": results, "failed": failed,
            "counts": {s: sum(r["status"] == s for r in results) for s in ("passed", "failed", "skipped", "timeout")}}


def check_report(rep: dict) -> dict:
    """The report when it has the documented shape, else ValueError (what a unit test and a reader rely on)."""
    for k in ("format", "dry_run", "date", "device", "versions", "plans", "steps", "failed", "counts"):
        if k not in rep:
            raise ValueError(f"the report lacks {k!r}")
    if rep["format"] != REPORT_FORMAT:
        raise ValueError(f"report format {rep['format']!r}, expected {REPORT_FORMAT!r}")
    for r in rep["steps"]:
        for k in ("name", "status", "limit_s", "estimate_s", "basis", "seconds", "figures", "failures", "reason"):
            if k not in r:
                raise ValueError(f"step {r.get('name')!r} lacks {k!r}")
        if r["status"] == "skipped" and not r["reason"]:
            raise ValueError(f"step {r['name']!r} is skipped without a reason")
    return rep


def _cell(v) -> str:
    return json.dumps(v) if isinstance(v, (dict, list)) else str(v)


def summary_markdown(rep: dict) -> str:
    """The report as Markdown: device, versions, the plan check per profile, one row per step, then figures and
    failures."""
    title = "gpu-check: dry run (no CUDA: every CUDA step is a recorded skip)" if rep["dry_run"] else "gpu-check"
    lines = [f"# {title}", "", f"- date: {rep['date']}", f"- device: {_cell(rep['device'])}",
             f"- versions: {_cell(rep['versions'])}", f"- counts: {_cell(rep['counts'])}", "", "## Plan", "",
             "| profile | budget s | worst case s | expected s | lesson limit s | lessons at once | fits | likely cut |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in rep["plans"]:
        lines.append(f"| {p['profile']} | {p['budget_s']:.0f} | {p['worst_case_s']} | {p['expected_s']} | "
                     f"{p['lesson_limit_s']:.0f} | {p['workers']} | {p['fits']} | {', '.join(p['likely_cut']) or '-'} |")
    lines += ["", "## Steps", "", "| step | status | seconds | limit s | estimate s (basis) | reason |",
              "| --- | --- | --- | --- | --- | --- |"]
    for r in rep["steps"]:
        lines.append(f"| {r['name']} | {r['status']} | {r['seconds'] if r['seconds'] is not None else '-'} | "
                     f"{r['limit_s']:.0f} | {r['estimate_s']:.0f} ({r['basis']}) | {r['reason'] or '-'} |")
    for r in rep["steps"]:
        if r["figures"] or r["failures"]:
            lines += ["", f"### {r['name']}", ""]
            lines += [f"- {k}: {_cell(v)}" for k, v in r["figures"].items()]
            lines += [f"- FAILURE: {f}" for f in r["failures"]]
    return "\n".join(lines) + "\n"


def write_report(rep: dict, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    j, m = out / "report.json", out / "summary.md"
    j.write_text(json.dumps(check_report(rep), indent=1) + "\n")
    m.write_text(summary_markdown(rep))
    return j, m


# ---- running (processes under a time limit) ----------------------------------------------------------------------

def run_limited(cmd: list[str], limit_s: float, env: dict | None = None) -> tuple[int | None, float, str]:
    """(return code, or None when stopped at the limit; seconds; the output's tail). The command runs in its own
    process group, so a notebook's kernel goes with it when the limit stops it."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=limit_s)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        rc = None
    return rc, time.perf_counter() - start, out or ""


def _env(**extra) -> dict:
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONUNBUFFERED="1", **extra)  # unbuffered: a cut run keeps its lines
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_child_step(step: Step) -> dict:
    """A CUDA step in a fresh process (`--child NAME`): its figures and failures, or a timeout."""
    with tempfile.TemporaryDirectory() as tmp:
        res = Path(tmp) / "result.json"
        rc, secs, tail = run_limited([sys.executable, __file__, "--child", step.name, "--result", str(res)],
                                     step.limit_s, _env())
        if rc is None:
            return step_result(step, "timeout", secs, failures=[f"stopped at its {step.limit_s:.0f} s limit"])
        if not res.is_file():
            return step_result(step, "failed", secs, failures=[f"exited {rc} without a result: {tail[-800:]}"])
        got = json.loads(res.read_text())
    status = "skipped" if got.get("skip") else ("failed" if got["failures"] else "passed")
    return step_result(step, status, secs, got["figures"], got["failures"], got.get("skip", ""))


def parse_pytest_tail(tail: str) -> dict:
    """Counts from pytest's last line ("3 passed, 1 failed, 2 skipped in 4.5s") and the FAILED lines; without a
    last line (stopped at its limit), the counts of the verbose per-test lines ("path::test PASSED") so far."""
    import re

    lines = tail.splitlines()
    last = next((line for line in reversed(lines) if re.search(r"\d+ (passed|failed|skipped|error)", line)), "")
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors|xfailed)", last)}
    failed = [line.strip() for line in lines if line.startswith(("FAILED", "ERROR"))]
    if not counts:
        for line in lines:
            m = re.match(r"\S+::.+? (PASSED|FAILED|SKIPPED|ERROR)\b", line)  # nbval's items: "x.ipynb::Cell 3"
            if m:
                counts[m.group(1).lower()] = counts.get(m.group(1).lower(), 0) + 1
                if m.group(1) in ("FAILED", "ERROR") and line.strip() not in failed:
                    failed.append(line.strip())
    return {"counts": counts, "failed": failed}


SLOW_LAST = ("test_cuda_memory.py",)  # dozens of GPT-2-sized steps: run after the quick files, so a cut loses least


def gpu_test_files() -> list[str]:
    files = sorted((ROOT / "tests" / "gpu").glob("test_*.py"), key=lambda f: (f.name in SLOW_LAST, f.name))
    return [str(f.relative_to(ROOT)) for f in files]


def run_tests_gpu(step: Step) -> dict:
    rc, secs, tail = run_limited([sys.executable, "-m", "pytest", *gpu_test_files(), "-m", "gpu", "-v", "-rfE",
                                  "-p", "no:cacheprovider"], step.limit_s, _env())
    got = parse_pytest_tail(tail)
    if rc is None:  # what finished before the limit is still reported
        return step_result(step, "timeout", secs, {"pytest (until the limit)": got["counts"]},
                           got["failed"] + [f"stopped at its {step.limit_s:.0f} s limit"])
    failures = got["failed"] or ([f"pytest exited {rc}"] if rc not in (0, 5) else [])
    figures = {"pytest": got["counts"]}
    if failures:
        figures["output_tail"] = tail[-3000:]  # the failures' tracebacks (pytest prints them before its summary)
    return step_result(step, "failed" if failures else "passed", secs, figures, failures)


def run_lesson(step: Step) -> dict:
    """One notebook under nbval at the device's profile (-v: the cells reached are known if the limit cuts it)."""
    nb = ROOT / "notebooks" / step.what
    rc, secs, out = run_limited([sys.executable, "-m", "pytest", "--nbval-lax", str(nb), "-v", "-rfE", "-p",
                                 "no:cacheprovider"], step.limit_s, _env(LABKIT_SMOKE="0"))
    got = parse_pytest_tail(out)
    if rc is None:
        return step_result(step, "timeout", secs, {"cells (until the limit)": got["counts"]},
                           got["failed"] + [f"cut at the per-lesson limit of {step.limit_s:.0f} s"])
    failures = got["failed"] or ([f"nbval exited {rc}"] if rc != 0 else [])
    figures = {"cells": got["counts"]}
    if failures:
        figures["output_tail"] = out[-2000:]  # the failing cell's traceback
    return step_result(step, "failed" if failures else "passed", secs, figures, failures)


def device_and_versions_in_child() -> tuple[dict, dict]:
    """device_and_versions() read in a child process: this one never starts CUDA, so its context takes no device
    memory while the steps measure (the allocator step's context figure, the lessons' used memory)."""
    with tempfile.TemporaryDirectory() as tmp:
        res = Path(tmp) / "device.json"
        rc, _, tail = run_limited([sys.executable, __file__, "--child", "device", "--result", str(res)], 120, _env())
        if rc != 0 or not res.is_file():
            raise RuntimeError(f"reading the device failed: {tail[-800:]}")
        got = json.loads(res.read_text())["figures"]
    return got["device"], got["versions"]


def device_and_versions() -> tuple[dict, dict]:
    import platform

    import torch

    versions = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None}
    try:
        versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    except (AttributeError, RuntimeError):
        versions["nccl"] = None
    if not torch.cuda.is_available():
        return {"kind": "cpu", "name": platform.processor() or platform.machine(), "gpus": 0}, versions
    p = torch.cuda.get_device_properties(0)
    from labkit.device import profile

    return ({"kind": "cuda", "name": p.name, "total_bytes": p.total_memory, "capability": [p.major, p.minor],
             "gpus": torch.cuda.device_count(),
             "profile": profile(smoke_mode=False).name}, versions)


def run_step(step: Step) -> dict:
    """The real runner of one CUDA step or lesson."""
    if step.name == "tests-gpu":
        return run_tests_gpu(step)
    if step.name.startswith("lesson "):
        return run_lesson(step)
    return run_child_step(step)


def _guarded(run, step: Step) -> dict:
    try:
        return run(step)
    except Exception as e:  # a runner's own error is that step's failure; the run goes on
        return step_result(step, "failed", failures=[f"{type(e).__name__}: {e}"])


def execute(plan: Plan, skip: str = "", run=run_step) -> list[dict]:
    """Every step of `plan`, never stopping at a failure: `skip` non-empty records each CUDA step as skipped with
    that reason (the dry run); `run(step) -> result` runs one (tests inject a double)."""
    results = []
    for step in plan.fixed():
        if step.name == "device":
            t0 = time.perf_counter()
            dev, _ = device_and_versions_in_child() if not skip else device_and_versions()
            results.append(step_result(step, "passed", time.perf_counter() - t0, {"device": dev}))
        elif skip:
            results.append(step_result(step, "skipped", reason=skip))
        else:
            results.append(_guarded(run, step))
    lessons = plan.lessons()
    if skip:
        return results + [step_result(s, "skipped", reason=skip) for s in lessons]
    order = sorted(lessons, key=lambda s: -s.estimate_s)  # longest first: the rounds end together
    with ThreadPoolExecutor(plan.workers) as pool:
        done = dict(zip([s.name for s in order], pool.map(lambda s: _guarded(run, s), order)))
    return results + [done[s.name] for s in lessons]


# ---- the CUDA steps, each run in a fresh process by run_child_step ---------------------------------------------

def child_estimator(n: int = MIN_CONFIGS, seed: int = 0) -> dict:
    """estimate vs max_memory_allocated on `n` random configurations, the prediction in named terms; a
    configuration off by more than the tests' 5 % is a failure (with its terms)."""
    import gc

    import torch

    from labkit.estimate import Recipe, estimate
    from labkit.memory.allocator import rounded_peak
    from labkit.models.gpt import GPTConfig
    from labkit.run import measure_step

    bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    for dtype in (torch.float32, torch.bfloat16 if bf16 else torch.float16):  # cuBLAS's workspaces, made now
        a = torch.randn(64, 64, device="cuda", dtype=dtype, requires_grad=True)
        (a @ a).sum().backward()
        del a
    gc.collect()
    torch.cuda.synchronize()
    workspace = torch.cuda.memory_allocated()
    big = torch.cuda.get_device_properties(0).total_memory >= 40 * 2**30
    rows, failures = [], []
    for i, c in enumerate(draw_configs(n, seed, big, bf16)):
        model = GPTConfig(**c["model"]) if isinstance(c["model"], dict) else c["model"]
        kw = dict(checkpoint=c["checkpoint"], device="cuda")
        label = f"#{i} {c}"
        try:
            gc.collect()
            torch.cuda.empty_cache()
            held = torch.cuda.memory_allocated()
            r = Recipe(model, c["batch"], c["seq"], c["dtype"], c["optimizer"], **kw)
            e = estimate(r)
            m = measure_step(r)
            logical, blocks = rounded_peak(m.trace.events)
            terms = allocator_terms(e.peak.total, blocks - logical, held)
            measured = m.allocator["max_allocated"]
            err = terms["predicted"] / measured - 1
            rows.append({"config": c, "measured": measured, "ledger_peak": m.peak.total, "error": round(err, 4),
                         **terms})
            if abs(err) > 0.05:
                failures.append(f"{label}: predicted {terms['predicted']} B vs max_memory_allocated {measured} B "
                                f"({err:+.1%}); terms {terms['terms']}")
        except Exception as ex:  # one configuration's error is a failure of that configuration, not of the run
            failures.append(f"{label}: {type(ex).__name__}: {str(ex)[:300]}")
    errs = [abs(r["error"]) for r in rows]
    figures = {"configurations": len(rows), "workspace_bytes_held": workspace, "rows": rows,
               "max_abs_error": max(errs) if errs else None,
               "median_abs_error": sorted(errs)[len(errs) // 2] if errs else None}
    if len(rows) < n:
        failures.append(f"only {len(rows)} of {n} configurations measured")
    return {"figures": figures, "failures": failures}


def child_budgets() -> dict:
    """A real budget below the step's peak fails as a result, memory returns to its baseline, the fraction is
    lifted, and a budget above the peak fits."""
    import gc

    import torch

    from labkit.estimate import Recipe
    from labkit.memory import run_within_budget
    from labkit.run import measure_step

    r = Recipe("gpt2", 8, 512, "fp32", "adamw", device="cuda")
    free_margin = 64 * 2**20
    failures = []
    gc.collect()
    torch.cuda.empty_cache()
    base_alloc, base_free = torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]
    peak = measure_step(r).allocator["max_allocated"]
    gc.collect()
    torch.cuda.empty_cache()
    tight, roomy = peak // 2, 2 * peak
    t = run_within_budget(lambda: measure_step(r, budget=tight), tight)
    gc.collect()
    torch.cuda.empty_cache()
    after_alloc, after_free = torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]
    r = run_within_budget(lambda: measure_step(r, budget=roomy), roomy)
    try:  # the fraction is lifted again: more than either budget above fits
        probe = torch.empty(max(3 * peak, int(0.6 * torch.cuda.mem_get_info()[0])), dtype=torch.uint8, device="cuda")
        del probe
    except torch.OutOfMemoryError as e:
        failures.append(f"the memory fraction was not lifted after the budgets: {str(e).splitlines()[0]}")
    if t.fits:
        failures.append(f"a budget of half the peak ({tight} B) fitted: {t.message}")
    if after_alloc != base_alloc:
        failures.append(f"{after_alloc - base_alloc} B still allocated after the out-of-memory")
    if after_free < base_free - free_margin:
        failures.append(f"device free memory {base_free - after_free} B below its baseline after the out-of-memory")
    if not r.fits:
        failures.append(f"a budget of twice the peak ({roomy} B) did not fit: {r.message}")
    return {"figures": {"step": list(args), "peak_max_allocated": peak, "tight": tight, "tight_result": t.message,
                        "roomy": roomy, "roomy_result": r.message, "allocated_before": base_alloc,
                        "allocated_after_oom": after_alloc, "free_before": base_free, "free_after_oom": after_free},
            "failures": failures}


def child_allocator(out_dir: Path) -> dict:
    """labkit.memory.allocator.record(): the context first (nothing else has touched CUDA in this process), then
    rounding and workspaces, then a churn workload in two fresh processes (expandable_segments off and on).
    Writes allocator_recording.json, the file lesson 01 replays."""
    from labkit.memory import allocator as al

    rec = al.record(_commit())
    failures = [f"a {r['request']} B tensor took {r['block']} B, less than its 512 B block"
                for r in al.rounding_gap(rec) if r["gap"] < 0]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / al.RECORDING_FILE).write_text(json.dumps(rec, indent=1) + "\n")
    summary = {k: rec[k] for k in ("context_bytes", "rounding", "workspaces")}
    summary["churn"] = {k: al.churn_summary(v) for k, v in rec["churn"].items()}
    summary["recording"] = str(out_dir / al.RECORDING_FILE)
    return {"figures": summary, "failures": failures}


def child_nccl() -> dict:
    """labkit.distributed.comms' collectives over NCCL at world size 1, then over every GPU when there are more."""
    import torch

    from labkit.distributed import comm_ranks
    from labkit.distributed.launch import launch

    figures, failures = {}, []
    gpus = torch.cuda.device_count()
    worlds = [1] + ([gpus] if gpus > 1 else [])
    for w in worlds:
        try:
            got = launch(comm_ranks.collectives_check, world_size=w, args=(1024,), backend="nccl", timeout_s=30)
            figures[f"world {w}"] = got[0]
            failures += [f"world {w}, rank {r}: {name} wrong" for r, g in enumerate(got)
                         for name, ok in g["ok"].items() if not ok]
        except Exception as e:
            failures.append(f"world {w}: {type(e).__name__}: {str(e)[:400]}")
    if gpus == 1:
        figures["more than one GPU"] = "skipped: this machine has one GPU (the world-size-1 path ran)"
    return {"figures": figures, "failures": failures}


def child_fp8() -> dict:
    import torch

    from labkit.precision import FP8Recipe, dequantize_fp8, fp8_gemm_available, quantize_fp8, scaled_mm_fp8

    if not fp8_gemm_available("cuda"):
        cap = torch.cuda.get_device_capability()
        return {"skip": f"no FP8 GEMMs on compute capability {cap[0]}.{cap[1]} (needs >= 8.9)", "figures": {},
                "failures": []}
    torch.manual_seed(0)
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(512, 1024, device="cuda") * 0.05).to(torch.bfloat16)
    figures, failures = {}, []
    for recipe in (FP8Recipe("tensor", "tensor"), FP8Recipe("row", "row"), FP8Recipe("block", "block")):
        ab, wb = recipe.blocks()
        x8, sx = quantize_fp8(x, "e4m3", recipe.activation, ab)
        w8, sw = quantize_fp8(w, "e4m3", recipe.weight, wb)
        emu = dequantize_fp8(x8, sx) @ dequantize_fp8(w8, sw).t()
        real = scaled_mm_fp8(x8, sx, w8, sw, recipe, out_dtype=torch.bfloat16).float()
        rel = ((real - emu).norm() / emu.norm()).item()
        figures[f"{recipe.activation}-{recipe.weight} relative error vs emulation"] = rel
        if rel >= 1e-2:  # tests/gpu/test_fp8_gpu.py's tolerance: bf16 output rounding, accumulation order
            failures.append(f"{recipe}: relative error {rel:.3g} >= 1e-2")
    return {"figures": figures, "failures": failures}


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def run_child(name: str, result: Path) -> int:
    """Run one CUDA step in this process and write {"figures", "failures"[, "skip"]} to `result`."""
    out_dir = Path(os.environ.get("OUT") or ROOT / "data" / "gpu_check")
    steps = {"estimator": child_estimator, "budgets": child_budgets, "allocator": lambda: child_allocator(out_dir),
             "nccl": child_nccl, "fp8": child_fp8,
             "device": lambda: dict(zip(("device", "versions"), device_and_versions()))}
    try:
        got = steps[name]()
        if name == "device":
            got = {"figures": got, "failures": []}
    except Exception as e:  # the step's own crash is its failure, reported
        import traceback

        got = {"figures": {}, "failures": [f"{type(e).__name__}: {e}", traceback.format_exc()[-1500:]]}
    result.write_text(json.dumps(got, default=str) + "\n")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="plan and report only, every CUDA step a recorded skip")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S, help="the whole run's budget in seconds")
    ap.add_argument("--out", default=None, help="where the report goes (default: $OUT, else data/gpu_check/)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return run_child(args.child, Path(args.result))
    if args.budget_s <= MARGIN_S:
        ap.error(f"--budget-s must exceed the {MARGIN_S} s margin, got {args.budget_s}")
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # is_available() via NVML: no CUDA start-up here
    import torch

    out = Path(args.out or os.environ.get("OUT") or ROOT / "data" / "gpu_check")
    cuda = torch.cuda.is_available()
    times_path = ROOT / "data" / "lesson_times.json"
    lesson_times = json.loads(times_path.read_text()) if times_path.is_file() else {"lessons": {}}
    last = out / "report.json"
    last_report = json.loads(last.read_text()) if last.is_file() else None
    device, versions = device_and_versions_in_child() if cuda else device_and_versions()
    mine = device.get("profile")
    profiles = [mine] + [p for p in GPU_PROFILES if p != mine] if mine in GPU_PROFILES else list(GPU_PROFILES)
    try:
        plans = [make_plan(p, lesson_times, last_report, args.budget_s) for p in profiles]
    except ValueError as e:
        ap.error(str(e))
    checks = [check_plan(p) for p in plans]
    dry = args.dry_run or not cuda
    skip = ("dry run: no CUDA device" if not cuda else "dry run (--dry-run)") if dry else ""
    results = execute(plans[0], skip)
    rep = build_report(device, versions, checks, results, dry_run=dry)
    j, m = write_report(rep, out)
    for c in checks:
        print(f"plan {c['profile']}: worst case {c['worst_case_s']} s, expected {c['expected_s']} s of "
              f"{c['budget_s']:.0f} s ({'fits' if c['fits'] else 'DOES NOT FIT'}); lesson limit "
              f"{c['lesson_limit_s']:.0f} s x {c['workers']} at once; likely cut: {', '.join(c['likely_cut']) or '-'}")
    print(f"gpu-check: {rep['counts']}; report {j}, summary {m}")
    if rep["dry_run"]:
        return 0 if all(c["fits"] for c in checks) else 1
    return 1 if rep["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
