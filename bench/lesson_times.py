"""How long each lesson takes to run, per profile: runs notebooks under nbval and records the wall time.

    python bench/lesson_times.py --profile smoke|cpu|small-gpu|big-gpu [--lessons 00,01,...] [--timeout SECONDS]

Each notebook runs as CI runs it (`pytest --nbval-lax NOTEBOOK`), with LABKIT_SMOKE=1 for the smoke
profile and LABKIT_SMOKE=0 for the others. Outside smoke mode a machine runs the profile
`labkit.device.profile()` gives it (cpu without a GPU, small-gpu or big-gpu by the GPU's memory), so a
GPU profile is measured on a machine with such a GPU, and asking for another profile is an error. Its
wall time, the pytest outcome and the machine (CPU, cores and GPU) are merged into
data/lesson_times.json (other lessons' and profiles' entries are kept), which lesson 00 prints. A run that passes --timeout is recorded as
not finished (its time as a lower bound). Times depend on the machine and on what else runs on it: the
file says which machine, how many cores and the load average when each figure was measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "data" / "lesson_times.json"
PROFILES = ("smoke", "cpu", "small-gpu", "big-gpu")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def commit() -> str | None:
    """The checkout's commit (+ "-dirty" when notebooks/ or labkit/ have uncommitted changes)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "notebooks", "labkit"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty else "")


def machine() -> dict:
    """This machine: CPU model, cores, Python and, when torch sees one, the GPU."""
    out = {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version()}
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            out["gpu"] = f"{props.name}, {props.total_memory / 2**30:.0f} GiB"
    except ImportError:
        pass
    return out


def machine_profile() -> str:
    """The profile this machine's lessons run at outside smoke mode."""
    sys.path.insert(0, str(ROOT))
    from labkit.device import profile

    return profile(smoke_mode=False).name


def run_one(notebook: Path, profile: str, timeout: int) -> dict:
    env = dict(os.environ, LABKIT_SMOKE="1" if profile == "smoke" else "0", MPLBACKEND="Agg")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "--nbval-lax", str(notebook), "-q",
                               "-p", "no:cacheprovider"], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
        seconds, finished, passed = time.perf_counter() - start, True, proc.returncode == 0
    except subprocess.TimeoutExpired:
        seconds, finished, passed = float(timeout), False, False
    return {"seconds": round(seconds, 1), "finished": finished, "passed": passed,
            "load_average_at_start": None if load is None else round(load, 2),
            "date": datetime.date.today().isoformat(), "commit": commit(), "machine": machine()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", choices=PROFILES, required=True)
    ap.add_argument("--lessons", default="", help="comma-separated lesson numbers (default: every notebook)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds before a lesson counts as not finished")
    args = ap.parse_args(argv)
    if args.timeout <= 0:
        ap.error(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if args.profile != "smoke" and machine_profile() != args.profile:
        ap.error(f"this machine runs the lessons at profile {machine_profile()!r}, not {args.profile!r}: measure "
                 f"{args.profile!r} on a machine that gets it")
    notebooks = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    wanted = {s.strip() for s in args.lessons.split(",") if s.strip()}
    unknown = wanted - {nb.name[:2] for nb in notebooks}
    if unknown:
        ap.error(f"no notebook for lesson(s) {', '.join(sorted(unknown))}")
    data = json.loads(OUT.read_text()) if OUT.is_file() else {"lessons": {}}
    for nb in notebooks:
        if wanted and nb.name[:2] not in wanted:
            continue
        entry = run_one(nb, args.profile, args.timeout)
        data["lessons"].setdefault(nb.name[:2], {"notebook": nb.name})[args.profile] = entry
        print(f"{nb.name:32} {args.profile:6} {entry['seconds']:8.1f} s  finished={entry['finished']} "
              f"passed={entry['passed']} load={entry['load_average_at_start']}", flush=True)
        OUT.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
