"""What recompute and offload cost and save on one GPT training step, and what mixed precision does to the peak.

    python bench/activations.py [--quick] [--reps N] [--threads N]

On a GPT sized for the device (labkit.device.profile(); --quick: the smoke-sized one), for each of
no checkpointing, full (every block), sqrt(n) segments, selective (keep matmul outputs) and
activation offload, one AdamW step is measured three times: under the Ledger (peak of the step,
activations saved when backward starts, ACT at the backward peak), under FlopCounterMode (FLOPs),
and on the clock (median of --reps steps). Every figure is also given as a ratio to no
checkpointing in the same run. Then the segment sweep (labkit.run.activation_flops_report),
and the peak of fp32 vs mixed fp16 / bf16 (measure_step). The last line is the summary:
`activations: full_act=X sqrt_act=Y selective_act=Z offload_act=W full_flops=A sqrt_flops=B mixed_bf16_peak=C`
(act: activations saved at the start of backward, on the device; ratios to none, or to fp32 for the peak).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

import labkit.device
from labkit.device import pick_device
from labkit.estimate import Recipe
from labkit.memory import Category, Ledger, fmt_bytes
from labkit.run import make_optimizer, measure_step, train_step
from labkit.models.gpt import GPT
from labkit.recompute import checkpoint_blocks, offload_activations, sqrt_segments
from labkit.run.policies import activation_flops_report, format_report
from labkit.run.policies import saved_bytes


@dataclass
class Row:
    label: str
    peak: int  # ledger: the step's peak, all categories
    saved: int  # ledger: ACT when backward starts (what the forward kept on the device)
    act_at_peak: int  # ledger: ACT at the backward pass's peak
    flops: int  # FlopCounterMode over the whole step
    seconds: float  # median wall time of a step
    allocated: int | None = None  # CUDA only: torch.cuda.max_memory_allocated during the ledger's step


def policies(device: torch.device, n_layer: int) -> dict:
    """label -> a function model -> context manager that applies the policy for a step."""
    cuda = device.type == "cuda"
    return {
        "none": lambda m: contextlib.nullcontext(),
        f"full (k={n_layer})": lambda m: checkpoint_blocks(m, "full"),
        f"sqrt (k={sqrt_segments(n_layer)})": lambda m: checkpoint_blocks(m, "sqrt"),
        "selective (matmuls)": lambda m: checkpoint_blocks(m, "selective"),
        # on CUDA: pinned host buffers and a side stream; on a CPU the host pool lives outside torch
        "offload": lambda m: offload_activations(pin_memory=cuda, use_stream=cuda),
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(model: torch.nn.Module, x, y, label: str, setup, reps: int) -> Row:
    """Warm-up step, then a ledger step, a FLOP-counted step and `reps` timed steps, all under `setup`."""
    m = copy.deepcopy(model)
    opt = make_optimizer(m, "adamw")
    device = x.device
    train_step(m, opt, x, y)  # warm-up: Adam's m and v exist from now on
    with setup(m):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with Ledger(m, opt, label=label) as led:
            train_step(m, opt, x, y)
        meas = led.measurement()
        allocated = meas.allocator["max_allocated"] if meas.allocator else None
        with FlopCounterMode(display=False) as fc:
            train_step(m, opt, x, y)
        times = []
        for _ in range(reps):
            sync(device)
            t0 = time.perf_counter()
            train_step(m, opt, x, y)
            sync(device)
            times.append(time.perf_counter() - t0)
    return Row(label, meas.peak.total, saved_bytes(meas), meas.phases["backward"][Category.ACT],
               int(fc.get_total_flops()), statistics.median(times), allocated)


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the smoke-sized GPT: seconds, not minutes")
    ap.add_argument("--reps", type=int, default=None, help="timed steps per policy (default 3, --quick 5)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device()
    if device.type == "mps":
        device = torch.device("cpu")
    prof = labkit.device.profile(device, smoke_mode=args.quick or None)
    cfg = prof.gpt_config()
    B, S = prof.batch, prof.seq
    reps = args.reps or (5 if args.quick else 3)
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (B, S + 1), generator=g)
    x, y = tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)
    print(f"device {device}, profile {prof.name!r}: GPT {cfg.n_layer} layers x {cfg.n_embd}, "
          f"{model.num_params():,} parameters, batch {B} x seq {S}, fp32, AdamW; {reps} timed steps each\n")

    rows = [measure(model, x, y, label, setup, reps) for label, setup in policies(device, cfg.n_layer).items()]
    base = rows[0]
    cuda = device.type == "cuda"
    head = (f"{'policy':20} {'peak':>10} {'ACT saved':>10} {'ACT@bwd pk':>10} {'GFLOPs':>8} {'step ms':>8}"
            + (f" {'cuda max':>10}" if cuda else "") + "   ratios to none: peak / saved / ACT@pk / FLOPs / time")
    print(head)
    for r in rows:
        print(f"{r.label:20} {fmt_bytes(r.peak):>10} {fmt_bytes(r.saved):>10} {fmt_bytes(r.act_at_peak):>10} "
              f"{r.flops / 1e9:8.3f} {r.seconds * 1e3:8.1f}" + (f" {fmt_bytes(r.allocated):>10}" if cuda else "")
              + f"   {ratio(r.peak, base.peak):.3f} / {ratio(r.saved, base.saved):.3f} / "
              f"{ratio(r.act_at_peak, base.act_at_peak):.3f} / {ratio(r.flops, base.flops):.3f} / "
              f"{ratio(r.seconds, base.seconds):.2f}")

    print("\nsegments k: one measured step each (labkit.run.activation_flops_report, SGD)")
    sweep = activation_flops_report(model, x, y)
    print(format_report(sweep))

    print("\nprecision: peak of two AdamW steps (measure_step)")
    peaks = {}
    for dtype in ("fp32", "mixed-fp16", "mixed-bf16"):
        t0 = time.perf_counter()
        meas = measure_step(Recipe(cfg, B, S, dtype, device=device.type), steps=2)
        peaks[dtype] = meas.peak.total
        print(f"{dtype:11} peak {fmt_bytes(meas.peak.total):>10} ({meas.peak_phase}), activations at the peak "
              f"{fmt_bytes(meas.peak[Category.ACT]):>10}  x{ratio(meas.peak.total, peaks['fp32']):.3f} of fp32  "
              f"({time.perf_counter() - t0:.1f} s)")

    by = {r.label.split(" ")[0]: r for r in rows}
    print(f"activations: full_act={ratio(by['full'].saved, base.saved):.3f} "
          f"sqrt_act={ratio(by['sqrt'].saved, base.saved):.3f} "
          f"selective_act={ratio(by['selective'].saved, base.saved):.3f} "
          f"offload_act={ratio(by['offload'].saved, base.saved):.3f} "
          f"full_flops={ratio(by['full'].flops, base.flops):.3f} sqrt_flops={ratio(by['sqrt'].flops, base.flops):.3f} "
          f"mixed_bf16_peak={ratio(peaks['mixed-bf16'], peaks['fp32']):.3f}")


if __name__ == "__main__":
    main()
