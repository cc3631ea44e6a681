"""What each optimizer keeps and costs on one GPT, beside fp32 AdamW and beside its production reference.

    python bench/optimizers.py [--quick] [--steps N] [--threads N]

On a GPT sized for the device (labkit.device.profile(); --quick: the smoke-sized one), in one run, from
the same start on the same Shakespeare batches: torch AdamW (fp32 state), labkit's AdamW8bit, Lion,
Adafactor, GaLoreAdamW and GaLoreAdamW8bit, and the references bitsandbytes AdamW8bit,
lion_pytorch.Lion, transformers Adafactor, galore_torch.GaLoreAdamW and galore_torch.GaLoreAdamW8bit.
Each trains N steps: step 1 makes the state, step 2 runs under the Ledger (the peak of a steady-state
step), steps 3..N are timed (median; with GaLore's update_proj_gap of 200 the SVD happens in step 1
only). Then: optimizer state bytes per parameter (every storage the optimizer holds, a reference's
projector objects included), the peak, the step time and the validation loss after N steps, each as
a ratio to fp32 AdamW and to the reference. The last line is the summary:
`optimizers: adamw8bit_state=X lion_state=Y adafactor_state=Z galore_state=W galore8bit_state=...
adamw8bit_vs_bnb_mem=V lion_vs_ref_mem=... adafactor_vs_ref_mem=... galore_vs_ref_mem=...
galore8bit_vs_ref_mem=... galore_state_vs_formula=...` (*_state: state bytes / fp32 AdamW's;
*_vs_*_mem: labkit's peak / the reference's).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
import warnings
from dataclasses import dataclass

import torch

import labkit.device
from labkit.data import get_batch, load_tokens
from labkit.device import pick_device
from labkit.memory import Ledger, fmt_bytes
from labkit.run import train_step
from labkit.models.gpt import GPT
from labkit.optim import Adafactor, AdamW8bit, GaLoreAdamW, GaLoreAdamW8bit, Lion, galore_param_groups
from labkit.optim import adam8bit, galore, state_bytes


@dataclass
class Row:
    name: str
    reference: str | None  # the row this one is compared with ("" for the references themselves)
    state: int  # bytes of every storage the optimizer holds in its state
    peak: int  # Ledger: the peak of step 2
    phase: str  # where that peak is
    seconds: float  # median step time, steps 3..N
    loss: float  # validation loss after N steps


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def cuda_sync_works():
    """galore-torch 1.0's 8-bit step calls torch.cuda.synchronize() every step: a no-op without CUDA."""
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.synchronize
    torch.cuda.synchronize = lambda *a, **k: None
    try:
        yield
    finally:
        torch.cuda.synchronize = saved


def recipes(rank: int) -> dict:
    """name -> (reference name or None, make(model) -> optimizer). Same hyperparameters for a pair."""
    import bitsandbytes as bnb
    import galore_torch
    from lion_pytorch import Lion as RefLion
    from transformers.optimization import Adafactor as RefAdafactor

    def gal(cls):
        return lambda m: cls(galore_param_groups(m, rank=rank, update_proj_gap=200, lr=1e-2), lr=1e-3, weight_decay=0.0)

    af = dict(lr=1e-3, relative_step=False, scale_parameter=False)
    return {
        "torch AdamW (fp32)": (None, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01)),
        "AdamW8bit": ("bnb AdamW8bit", lambda m: AdamW8bit(m.parameters(), lr=1e-3, weight_decay=0.01)),
        "bnb AdamW8bit": ("", lambda m: bnb.optim.AdamW8bit(m.parameters(), lr=1e-3, weight_decay=0.01)),
        "Lion": ("lion_pytorch Lion", lambda m: Lion(m.parameters(), lr=3e-4, weight_decay=0.03)),
        "lion_pytorch Lion": ("", lambda m: RefLion(m.parameters(), lr=3e-4, weight_decay=0.03)),
        "Adafactor": ("transformers Adafactor", lambda m: Adafactor(m.parameters(), **af)),
        "transformers Adafactor": ("", lambda m: RefAdafactor(m.parameters(), **af)),
        "GaLoreAdamW": ("galore_torch GaLoreAdamW", gal(GaLoreAdamW)),
        "galore_torch GaLoreAdamW": ("", gal(galore_torch.GaLoreAdamW)),
        "GaLoreAdamW8bit": ("galore_torch GaLoreAdamW8bit", gal(GaLoreAdamW8bit)),
        "galore_torch GaLoreAdamW8bit": ("", gal(galore_torch.GaLoreAdamW8bit)),
    }


@torch.no_grad()
def val_loss(model, val_batches) -> float:
    model.eval()
    out = statistics.mean(model(x, y).item() for x, y in val_batches)
    model.train()
    return out


def run(name, reference, make, model0, train_batches, val_batches, device) -> Row:
    model = copy.deepcopy(model0)
    with warnings.catch_warnings(), cuda_sync_works():
        warnings.simplefilter("ignore", FutureWarning)  # galore-torch's AdamW deprecation notice
        opt = make(model)
        x, y = train_batches[0]
        train_step(model, opt, x, y)  # step 1: the state exists from here on
        with Ledger(model, opt, label=name, device=device) as led:
            train_step(model, opt, *train_batches[1])
        meas = led.measurement()
        times = []
        for x, y in train_batches[2:]:
            sync(device)
            t0 = time.perf_counter()
            train_step(model, opt, x, y)
            sync(device)
            times.append(time.perf_counter() - t0)
    return Row(name, reference, state_bytes(opt), meas.peak.total, meas.peak_phase,
               statistics.median(times) if times else float("nan"), val_loss(model, val_batches))


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the smoke-sized GPT: seconds, not minutes")
    ap.add_argument("--steps", type=int, default=None, help="training steps per optimizer (default 5 --quick, "
                                                             "10 on a CPU, 30 on a GPU; at least 3)")
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
    steps = max(3, args.steps or (5 if args.quick else 30 if device.type == "cuda" else 10))
    rank = max(1, cfg.n_embd // 4)
    train, val, _ = load_tokens()
    gen = torch.Generator().manual_seed(1)
    train_batches = [get_batch(train, B, S, device, generator=gen) for _ in range(steps)]
    val_batches = [get_batch(val, B, S, device, generator=gen) for _ in range(4)]
    torch.manual_seed(0)
    model0 = GPT(cfg).to(device)
    n = model0.num_params()
    print(f"device {device}, profile {prof.name!r}: GPT {cfg.n_layer} layers x {cfg.n_embd}, {n:,} parameters, "
          f"batch {B} x seq {S}, fp32 weights; {steps} steps each; GaLore rank {rank} on attention and MLP matrices\n")

    rows: dict[str, Row] = {}
    for name, (reference, make) in recipes(rank).items():
        t0 = time.perf_counter()
        rows[name] = run(name, reference, make, model0, train_batches, val_batches, device)
        print(f"  {name:29} done in {time.perf_counter() - t0:6.1f} s", flush=True)
    base = rows["torch AdamW (fp32)"]

    print(f"\n{'optimizer':29} {'state':>10} {'B/param':>7} {'peak':>10} {'(phase)':>11} {'step ms':>8} {'val loss':>8}"
          f"   vs fp32 AdamW: state / peak / time / loss   vs reference: state / peak / time / loss")
    for r in rows.values():
        vs_ref = ""
        if r.reference:
            q = rows[r.reference]
            vs_ref = (f"{ratio(r.state, q.state):6.3f} / {ratio(r.peak, q.peak):.3f} / {ratio(r.seconds, q.seconds):.2f} / "
                      f"{ratio(r.loss, q.loss):.3f}  ({r.reference})")
        elif r.reference == "":
            vs_ref = "(a reference)"
        print(f"{r.name:29} {fmt_bytes(r.state):>10} {r.state / n:7.3f} {fmt_bytes(r.peak):>10} {'(' + r.phase + ')':>11} "
              f"{r.seconds * 1e3:8.1f} {r.loss:8.3f}   {ratio(r.state, base.state):6.3f} / {ratio(r.peak, base.peak):.3f} / "
              f"{ratio(r.seconds, base.seconds):.2f} / {ratio(r.loss, base.loss):.3f}      {vs_ref}")

    # ---- targets ------------------------------------------------------------------------------------------
    shapes = [tuple(p.shape) for p in model0.parameters()]
    big = [s for s in shapes if torch.Size(s).numel() >= adam8bit.MIN_8BIT_SIZE]
    big_8bit = sum(adam8bit.state_bytes_for(s) for s in big)
    big_adam = sum(8 * torch.Size(s).numel() for s in big)
    rest, gal = galore_param_groups(model0, rank=rank)
    galore_formula = sum(galore.state_bytes_for(tuple(p.shape), rank) for p in gal["params"]) \
        + 8 * sum(p.numel() for p in rest["params"])
    a8 = rows["AdamW8bit"]
    print("\ntargets:")
    print(f"  8-bit Adam state >= 74 % smaller than fp32 Adam's: whole model {1 - ratio(a8.state, base.state):.1%} "
          f"(tensors under 4096 values keep fp32 state); the tensors that are 8-bit: {1 - big_8bit / big_adam:.1%} "
          f"-> {'yes' if 1 - big_8bit / big_adam >= 0.74 else 'NO'}")
    print(f"  GaLore state = sum of r(min + 2 max) x 4 per matrix + AdamW's 8/param for the rest: measured "
          f"{rows['GaLoreAdamW'].state:,} B, formula {galore_formula:,} B -> "
          f"{'yes' if rows['GaLoreAdamW'].state == galore_formula else 'NO'}")
    for ours in ("AdamW8bit", "Lion", "Adafactor", "GaLoreAdamW", "GaLoreAdamW8bit"):
        r, q = rows[ours], rows[rows[ours].reference]
        print(f"  {ours} peak <= {q.name}'s: {fmt_bytes(r.peak)} vs {fmt_bytes(q.peak)} -> "
              f"{'yes' if r.peak <= q.peak else 'NO'}; state {fmt_bytes(r.state)} vs {fmt_bytes(q.state)}")

    def mem(ours: str) -> float:
        return ratio(rows[ours].peak, rows[rows[ours].reference].peak)

    print(f"optimizers: adamw8bit_state={ratio(a8.state, base.state):.3f} "
          f"lion_state={ratio(rows['Lion'].state, base.state):.3f} "
          f"adafactor_state={ratio(rows['Adafactor'].state, base.state):.3f} "
          f"galore_state={ratio(rows['GaLoreAdamW'].state, base.state):.3f} "
          f"galore8bit_state={ratio(rows['GaLoreAdamW8bit'].state, base.state):.3f} "
          f"adamw8bit_vs_bnb_mem={mem('AdamW8bit'):.3f} lion_vs_ref_mem={mem('Lion'):.3f} "
          f"adafactor_vs_ref_mem={mem('Adafactor'):.3f} galore_vs_ref_mem={mem('GaLoreAdamW'):.3f} "
          f"galore8bit_vs_ref_mem={mem('GaLoreAdamW8bit'):.3f} "
          f"galore_state_vs_formula={ratio(rows['GaLoreAdamW'].state, galore_formula):.3f}")


if __name__ == "__main__":
    main()
