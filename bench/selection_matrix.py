"""The technique selection matrix, measured: memory saved, time cost and loss effect of each technique.

    python bench/selection_matrix.py [--smoke] [--steps N] [--threads N (default 1)] [--out PATH]
                                     [--device cpu|cuda] [--gpu-preset a10]

On labkit's GPT (4 layers x 128, batch 8 x seq 64; --smoke: 2 x 32, 4 x 16), from the same start on the same
Shakespeare batches: fp32 AdamW, then each technique of labkit.plan.matrix.TECHNIQUES (one Recipe change each).
Per technique: the Ledger peak of two steps (labkit.run.measure_step), the median step time, the validation
loss after N steps, the categories it cuts, and the regime where it wins (labkit.plan.matrix.regime). Writes
the matrix as JSON (default data/selection_matrix.json, which is committed from a run at the default size; a
--smoke run writes to data/selection_matrix_smoke.json unless --out says otherwise) and prints the table.
Times are wall clock on this machine (--device: where it trains and times, cpu by default): read them as ratios.
The table names that device; --gpu-preset adds labkit.plan.cost's predicted step on that GPU preset, marked
predicted, with what each cost is made of.
"""

from __future__ import annotations

import argparse
import time

import torch

from labkit.paths import data_dir
from labkit.plan.matrix import MATRIX_FILE, format_table, run_matrix, save_matrix


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="the tiny size (seconds), for tests")
    ap.add_argument("--steps", type=int, default=None, help="training steps per technique (default: the size's)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: steadier times on a shared "
                                                             "machine; 0: torch's own)")
    ap.add_argument("--out", default=None, help="where to write the JSON")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to train and time (default cpu)")
    ap.add_argument("--gpu-preset", default="a10", help="labkit.plan.devices preset of the predicted columns "
                                                        "(default a10; none: leave them out)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    size = "smoke" if args.smoke else "default"
    out = args.out or (data_dir() / "selection_matrix_smoke.json" if args.smoke else MATRIX_FILE)
    t0 = time.perf_counter()
    m = run_matrix(size, steps=args.steps, progress=lambda line: print(line, flush=True), device=args.device)
    path = save_matrix(m, out)
    reg = m["regime"]
    print(f"\nregime at B={reg['batch']} S={reg['seq']} (estimate): {reg['regime']} "
          f"(activations {reg['activation_bytes'] / 2**20:.2f} MiB vs model states {reg['state_bytes'] / 2**20:.2f} MiB)")
    print(format_table(m, gpu=None if args.gpu_preset == "none" else args.gpu_preset))
    print(f"\nwrote {path} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
