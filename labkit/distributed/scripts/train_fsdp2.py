"""Train labkit's GPT with FSDP2 under torchrun: the production path of lesson 09.

One machine, 2 processes (CPU: gloo; one GPU per process: NCCL):

    torchrun --standalone --nproc-per-node 2 -m labkit.distributed.scripts.train_fsdp2 --steps 3

A cluster of 2 nodes x 8 GPUs (run the same line on every node; HOST is node 0's address):

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 --rdzv-id job1 \
        -m labkit.distributed.scripts.train_fsdp2 --steps 1000 --batch 512

Every rank builds the same model from the same seed, wraps each block and then the root with `fully_shard` on
an explicit device mesh, takes its rows of each global batch (labkit.distributed.dp_ranks.global_batch) and
steps AdamW on its shards. Rank 0 prints one JSON line: the losses of each step per rank and the parameters'
checksum, which lesson 09 compares with labkit's own ZeRO-3 on the same data.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="global batch (rows per step over all ranks)")
    ap.add_argument("--seq", type=int, default=8)
    ap.add_argument("--config", default='{"vocab_size": 64, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32}',
                    help="labkit GPTConfig fields as JSON")
    args = ap.parse_args(argv)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from labkit.distributed.dp_ranks import LR, global_batch
    from labkit.models.gpt import GPT, GPTConfig

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must divide evenly over {world} ranks")
    cfg = json.loads(args.config)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**cfg)).to(device)
    mesh = init_device_mesh(device.type, (world,))  # always explicit (pytorch #132471)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    rows = args.batch // world
    losses = []
    for step in range(args.steps):
        x, y = global_batch(step, args.batch, args.seq, cfg["vocab_size"])
        x, y = x[rank * rows:(rank + 1) * rows].to(device), y[rank * rows:(rank + 1) * rows].to(device)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    every = [None] * world
    dist.all_gather_object(every, losses)
    full = {n: p.full_tensor().double().sum().item() for n, p in model.named_parameters()}
    if rank == 0:
        print(json.dumps({"world": world, "losses": every, "checksum": sum(full.values())}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # torch 2.13 on gloo: a rank sometimes aborts at interpreter exit ("terminate called without an active
    # exception": a background thread torn down after the work is done, 1 run in 5 here); the work is finished
    # and printed, so leave without the C++ teardown.
    sys.stdout.flush()
    os._exit(0)
