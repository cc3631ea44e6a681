"""Dense all-reduce, DGC (and DGC without each of its four techniques) and PowerSGD on 2 gloo ranks, at equal
steps on the same Shakespeare batches: the loss after N steps and the bytes each rank sent (by definition).

    python bench/communication.py [--quick] [--steps N] [--sparsity S] [--rank R]

--quick: a tiny GPT and 6 steps. The last line is the summary:
`communication: dgc_bytes=X powersgd_bytes=Y dgc_loss=A powersgd_loss=B dense_loss=C` (*_bytes: bytes sent in all
/ the dense all-reduce's; *_loss: the mean over ranks of the last step's loss).
"""

from __future__ import annotations

import argparse

from labkit.distributed import comm_ranks, launch
from labkit.distributed.compression import DGCConfig, PowerSGDConfig
from labkit.distributed.dp_ranks import TrainRun
from labkit.memory import fmt_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny GPT, 6 steps")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--sparsity", type=float, default=0.999)
    ap.add_argument("--rank", type=int, default=2, help="PowerSGD's matrix_approximation_rank")
    a = ap.parse_args()
    cfg = (dict(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32) if a.quick
           else dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128))
    steps = a.steps or (6 if a.quick else 200)
    batch, seq, text = (8, 16, 100_000) if a.quick else (16, 64, 2_000_000)
    dgc = DGCConfig(sparsity=a.sparsity, warmup_steps=max(1, steps // 20))
    run = TrainRun(cfg, steps, batch, seq, text_chars=text)
    runs = launch(comm_ranks.compare, 2, args=(run, comm_ranks.VARIANTS, dgc, PowerSGDConfig(rank=a.rank)),
                  timeout_s=3600, backend="gloo")
    rows = {v: ([sum(r[v]["losses"][i] for r in runs) / 2 for i in range(steps)], sum(runs[0][v]["wire"]))
            for v in comm_ranks.VARIANTS}
    dense_bytes = rows["dense"][1]
    print(f"{'variant':28s} {'loss after ' + str(steps):>16s} {'bytes sent':>12s} {'vs dense':>9s}")
    for v, (losses, sent) in rows.items():
        print(f"{v:28s} {losses[-1]:16.4f} {fmt_bytes(sent):>12s} {sent / dense_bytes:9.4f}")
    print(f"communication: dgc_bytes={rows['dgc'][1] / dense_bytes:.4f} "
          f"powersgd_bytes={rows['powersgd'][1] / dense_bytes:.4f} dgc_loss={rows['dgc'][0][-1]:.4f} "
          f"powersgd_loss={rows['powersgd'][0][-1]:.4f} dense_loss={rows['dense'][0][-1]:.4f}")


if __name__ == "__main__":
    main()
