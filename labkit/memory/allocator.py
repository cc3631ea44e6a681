"""The CUDA caching allocator's own bytes (block rounding, workspaces, the CUDA context, fragmentation), measured
on a GPU and kept as a recording that a machine without one can replay.

What the ledger counts are logical bytes: each tensor's storage. `torch.cuda.max_memory_allocated` counts the
allocator's blocks, and the GPU's used memory adds what the allocator never sees:

- rounding: every block is a multiple of 512 bytes (a 1-byte tensor takes 512), `block_bytes(n)`;
- workspaces: cuBLAS keeps a workspace per handle and stream after the first matmul, cuDNN asks for a
  transient one inside a convolution; both come from the allocator, not from any tensor;
- the CUDA context (kernels, the driver's state): in the device's used memory, outside the allocator;
- fragmentation: freed blocks stay cached (reserved >= allocated); when sizes keep changing, cached blocks of
  the old sizes may not fit the new requests. `expandable_segments:True` grows a segment in place instead.

`record()` measures them all in a fresh process (`python -m labkit.memory.allocator record FILE`: the context is
only what CUDA's start-up takes there, and PYTORCH_CUDA_ALLOC_CONF is read at start, so each churn run is a
process of its own). `make gpu-check` (bench/gpu_check.py) writes the recording (RECORDING_FILE, format FORMAT,
checked by `check_recording`); lesson 01 measures it live on CUDA, and elsewhere reads it with `load_recording`
and shows it with `describe_recording`, saying it is a recording and from which device, or, when none exists,
how to make one.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import subprocess
import sys
from pathlib import Path

BLOCK = 512  # bytes: the caching allocator's smallest block and its rounding unit (c10 kMinBlockSize)
FORMAT = "labkit-allocator-recording/1"
RECORDING_FILE = "allocator_recording.json"
REQUESTS = (1, 511, 512, 513, 4000, 2**20 - 1, 2**20 + 1, 3 * 2**20 + 7)  # bytes asked for by `measure_rounding`
HOW_TO_RECORD = ("run `make gpu-check` on a machine with a CUDA GPU (it writes allocator_recording.json under $OUT, "
                 "else data/gpu_check/), then copy that file to data/ and commit it")

# The recording's keys and what each holds (check_recording enforces it; tests build fixtures from it).
SPEC = {
    "format": "FORMAT",
    "device": "{'name': str, 'total_bytes': int, 'capability': [major, minor]}",
    "versions": "{'torch': str, 'cuda': str}",
    "recorded": "{'date': 'YYYY-MM-DD', 'commit': str or None}",
    "context_bytes": "int: device used memory right after CUDA initialised, with nothing allocated",
    "rounding": "[{'request': int, 'block': int}]: memory_allocated growth for one uint8 tensor of `request` bytes",
    "workspaces": "{name: int}: allocator bytes no tensor owns (cublas_fp32, cublas_bf16 or _fp16, cudnn_conv)",
    "churn": "{'default' | 'expandable_segments': {'allocated': [int], 'reserved': [int], 'conf': str}}",
}
CHURN_SETTINGS = ("default", "expandable_segments")


def block_bytes(n: int) -> int:
    """Bytes of the block the caching allocator hands out for a request of `n` bytes: n rounded up to 512
    (at least 512). Large requests may get more: a block left unsplit keeps its tail (`rounding_gap` shows it)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"a request is a non-negative number of bytes, got {n!r}")
    return max(BLOCK, -(-n // BLOCK) * BLOCK)


def rounded_peak(events: list[tuple[int, int]]) -> tuple[int, int]:
    """(logical peak, peak with every storage rounded to its 512-byte block) of a ledger trace's events
    (storage id, +bytes or -bytes): the rounding term of a measured step, from its storages' sizes."""
    size: dict[int, int] = {}
    live = live_blocks = peak = peak_blocks = 0
    for sid, delta in events:
        old = size.get(sid, 0)
        new = old + delta
        live += delta
        live_blocks += (block_bytes(new) if new else 0) - (block_bytes(old) if old else 0)
        size[sid] = new
        peak, peak_blocks = max(peak, live), max(peak_blocks, live_blocks)
    return peak, peak_blocks


def check_recording(rec: dict) -> dict:
    """The recording itself when it has SPEC's keys and types; else ValueError naming what is wrong."""
    if not isinstance(rec, dict):
        raise ValueError(f"an allocator recording is a JSON object, got {type(rec).__name__}")
    missing = [k for k in SPEC if k not in rec]
    if missing:
        raise ValueError(f"the allocator recording lacks {', '.join(missing)}")
    if rec["format"] != FORMAT:
        raise ValueError(f"the allocator recording's format is {rec['format']!r}, this labkit reads {FORMAT!r}")
    if not isinstance(rec["device"].get("name"), str) or not isinstance(rec["device"].get("total_bytes"), int):
        raise ValueError("the allocator recording's device needs a name and total_bytes")
    if not isinstance(rec["context_bytes"], int) or rec["context_bytes"] < 0:
        raise ValueError("context_bytes must be a non-negative integer")
    for row in rec["rounding"]:
        if not (isinstance(row.get("request"), int) and isinstance(row.get("block"), int)):
            raise ValueError(f"each rounding row needs integer request and block, got {row!r}")
    if not all(isinstance(v, int) for v in rec["workspaces"].values()):
        raise ValueError("workspaces must map names to integers of bytes")
    for name in CHURN_SETTINGS:
        run = rec["churn"].get(name)
        if run is None or len(run.get("allocated", [])) != len(run.get("reserved", [])) or not run["allocated"]:
            raise ValueError(f"churn[{name!r}] needs allocated and reserved series of the same, non-zero length")
    return rec


def load_recording(folder) -> tuple[dict | None, Path]:
    """(the recording, its path) from `folder`/RECORDING_FILE, else `folder`/gpu_check/RECORDING_FILE;
    (None, the first path) when neither exists. A file that exists but is malformed raises ValueError."""
    folder = Path(folder)
    paths = [folder / RECORDING_FILE, folder / "gpu_check" / RECORDING_FILE]
    for p in paths:
        if p.is_file():
            try:
                rec = json.loads(p.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{p} is not JSON: {e}") from None
            return check_recording(rec), p
    return None, paths[0]


def rounding_gap(rec: dict) -> list[dict]:
    """Each rounding row with the 512-byte prediction beside the measured block and their difference."""
    return [dict(row, predicted=block_bytes(row["request"]), gap=row["block"] - block_bytes(row["request"]))
            for row in rec["rounding"]]


def churn_summary(run: dict) -> dict:
    """Peak allocated, peak reserved, and the share of the reserved peak that held no tensor, of one churn run."""
    peak_alloc, peak_res = max(run["allocated"]), max(run["reserved"])
    return {"peak_allocated": peak_alloc, "peak_reserved": peak_res,
            "unused_share": 1 - peak_alloc / peak_res if peak_res else 0.0}


def describe_recording(rec: dict, live: bool) -> list[str]:
    """Lines for the lesson: the device, what was measured, and, when not `live`, that it is a recording."""
    from .units import fmt_bytes

    d = rec["device"]
    head = (f"measured on this machine's {d['name']}" if live else
            f"a RECORDING, not this machine: measured by `make gpu-check` on {d['name']} "
            f"({fmt_bytes(d['total_bytes'])}), torch {rec['versions']['torch']}, CUDA {rec['versions']['cuda']}, "
            f"on {rec['recorded']['date']} (commit {rec['recorded']['commit']})")
    lines = [head, f"CUDA context (device memory used with nothing allocated): {fmt_bytes(rec['context_bytes'])}"]
    for row in rounding_gap(rec):
        lines.append(f"  a {row['request']:>9,} B tensor takes a {row['block']:>9,} B block "
                     f"(512-byte rounding predicts {row['predicted']:,} B" +
                     (")" if row["gap"] == 0 else f"; {row['gap']:,} B more: a block left unsplit)"))
    for name, b in rec["workspaces"].items():
        lines.append(f"workspace {name}: {fmt_bytes(b)} held by the allocator, owned by no tensor")
    for name in CHURN_SETTINGS:
        s = churn_summary(rec["churn"][name])
        lines.append(f"churn, {name}: peak allocated {fmt_bytes(s['peak_allocated'])}, peak reserved "
                     f"{fmt_bytes(s['peak_reserved'])}: {s['unused_share']:.1%} of the reserved peak held no tensor")
    return lines


# ---- measuring on CUDA (each in a fresh process: PYTORCH_CUDA_ALLOC_CONF and the context are read at start) -----

def churn_sizes(steps: int, seed: int = 0, small: int = 64 * 1024, large: int = 48 * 2**20) -> list[tuple[str, int]]:
    """A churn workload, device-free: ("alloc", bytes) or ("free", index of an earlier alloc) in order. Sizes
    are drawn log-uniformly between `small` and `large`, about eight tensors live at a time, the sizes growing
    over the run (as a progressive-resizing loop does), so cached blocks of old sizes rarely fit new requests."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    rng = random.Random(seed)
    ops: list[tuple[str, int]] = []
    live: list[int] = []
    n_alloc = 0
    for i in range(steps):
        grow = 1 + 2 * i / steps
        if len(live) >= 8 or (live and rng.random() < 0.3):
            ops.append(("free", live.pop(rng.randrange(len(live)))))
        hi = min(large, int(small * grow * 64))
        ops.append(("alloc", int(small * (hi / small) ** rng.random())))
        live.append(n_alloc)
        n_alloc += 1
    return ops


def run_churn(ops: list[tuple[str, int]]) -> dict:
    """Replay churn ops on CUDA; allocated and reserved bytes after each op (this process's allocator setting)."""
    import os

    import torch

    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    tensors: dict[int, torch.Tensor] = {}
    allocated, reserved = [], []
    n = 0
    for op, arg in ops:
        if op == "alloc":
            tensors[n] = torch.empty(arg, dtype=torch.uint8, device="cuda")
            n += 1
        else:
            del tensors[arg]
        allocated.append(torch.cuda.memory_allocated() - base)
        reserved.append(torch.cuda.memory_reserved())
    tensors.clear()
    return {"allocated": allocated, "reserved": reserved, "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}


def measure_context() -> int:
    """Device memory in use right after CUDA initialises in this process, nothing allocated (the context, plus
    any other process on the GPU)."""
    import torch

    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()
    return int(total - free - torch.cuda.memory_reserved())


def measure_rounding(requests=REQUESTS) -> list[dict]:
    """memory_allocated growth for one uint8 tensor of each size (freed before the next)."""
    import torch

    rows = []
    for n in requests:
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        t = torch.empty(n, dtype=torch.uint8, device="cuda")
        rows.append({"request": n, "block": int(torch.cuda.memory_allocated() - before)})
        del t
    return rows


def measure_workspaces() -> dict:
    """Allocator bytes no tensor owns: left held after the first fp32 and bf16 (else fp16) matmuls (cuBLAS),
    and the transient of a convolution above its tensors' blocks (cuDNN)."""
    import torch

    out = {}
    half = ("cublas_bf16", torch.bfloat16) if torch.cuda.is_bf16_supported(including_emulation=False) else (
        "cublas_fp16", torch.float16)  # a T4 has no bf16 tensor cores
    for name, dtype in (("cublas_fp32", torch.float32), half):
        a = torch.randn(256, 256, device="cuda", dtype=dtype)
        before = torch.cuda.memory_allocated()
        c = a @ a
        torch.cuda.synchronize()
        out[name] = int(torch.cuda.memory_allocated() - before - block_bytes(c.untyped_storage().nbytes()))
        del a, c
    x = torch.randn(8, 64, 56, 56, device="cuda")
    w = torch.randn(64, 64, 3, 3, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y = torch.nn.functional.conv2d(x, w, padding=1)
    torch.cuda.synchronize()
    out["cudnn_conv"] = int(torch.cuda.max_memory_allocated() - base - block_bytes(y.untyped_storage().nbytes()))
    return out


def _churn_in_fresh_process(conf: str, steps: int, timeout: float) -> dict:
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf)
    out = subprocess.run([sys.executable, "-m", "labkit.memory.allocator", "churn", str(steps)], env=env,
                         capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"the churn run ({conf}) failed: "
                           f"{out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def record(commit: str | None = None, churn_steps: int = 400, timeout: float = 60) -> dict:
    """The recording, measured in this process (call it first thing after start: the context is measured here)
    and, for the churn workload, in one fresh process per allocator setting."""
    context = measure_context()
    import torch

    rounding, workspaces = measure_rounding(), measure_workspaces()
    churn = {name: _churn_in_fresh_process(conf, churn_steps, timeout)
             for name, conf in zip(CHURN_SETTINGS, ("expandable_segments:False", "expandable_segments:True"))}
    p = torch.cuda.get_device_properties(0)
    rec = {"format": FORMAT, "device": {"name": p.name, "total_bytes": p.total_memory, "capability": [p.major, p.minor]},
           "versions": {"torch": torch.__version__, "cuda": torch.version.cuda},
           "recorded": {"date": datetime.date.today().isoformat(), "commit": commit},
           "context_bytes": context, "rounding": rounding, "workspaces": workspaces, "churn": churn}
    return check_recording(rec)


def record_in_fresh_process(timeout: float = 180) -> dict:
    """`record()` in a new Python process (what a notebook calls: its own kernel's context is already in use)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / RECORDING_FILE
        out = subprocess.run([sys.executable, "-m", "labkit.memory.allocator", "record", str(path)],
                             capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0 or not path.is_file():
            raise RuntimeError(f"the allocator recording failed: {out.stderr.strip()[-500:] or out.returncode}")
        return check_recording(json.loads(path.read_text()))


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("record", "churn"):
        sys.exit("usage: python -m labkit.memory.allocator record FILE | churn [STEPS]")
    import torch

    if not torch.cuda.is_available():
        sys.exit("labkit.memory.allocator measures the CUDA allocator: it needs CUDA")
    if sys.argv[1] == "churn":
        print(json.dumps(run_churn(churn_sizes(int(sys.argv[2]) if len(sys.argv) > 2 else 400))))
    else:
        Path(sys.argv[2]).write_text(json.dumps(record(os.environ.get("LABKIT_COMMIT")), indent=1) + "\n")
