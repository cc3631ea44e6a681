"""Rank functions for the launcher's tests: spawned children import them from here by name."""

import os
import signal
import time

import torch
import torch.distributed as dist

from labkit.distributed import comms


def sum_of_ranks(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    with comms.CommLog() as log:
        comms.all_reduce(t)
    return {"rank": rank, "sum": t.item(), "threads": torch.get_num_threads(),
            "debug": os.environ.get("TORCH_DISTRIBUTED_DEBUG"), "calls": log.summary()}


def collectives(rank, world_size, n):
    """all-gather, reduce-scatter and broadcast on known values; returns what arrived and the log."""
    shard = torch.arange(n, dtype=torch.float32) + 100 * rank
    full = torch.empty(n * world_size)
    with comms.CommLog() as log:
        comms.all_gather(full, shard)
        out = torch.empty(n)
        comms.reduce_scatter(out, torch.arange(n * world_size, dtype=torch.float32) * (rank + 1))
        b = torch.full((3,), float(rank))
        comms.broadcast(b, src=world_size - 1)
        m = torch.tensor([float(rank)])
        comms.all_reduce(m, op="avg")
    return full, out, b, m, log.summary()


def raises_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("rank one is unhappy")
    t = torch.ones(4)
    dist.all_reduce(t)  # rank 0 waits here for a peer that never comes
    return t


def dies_on_rank_1(rank, world_size):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(4)
    dist.all_reduce(t)
    return t


def mismatched_all_reduce(rank, world_size):
    t = torch.ones(4 + rank)  # rank 0 sends 4 elements, rank 1 sends 5
    dist.all_reduce(t)
    return t


def sleeps_on_rank_0(rank, world_size, seconds):
    if rank == 0:
        time.sleep(seconds)
    return rank


def pid(rank, world_size):
    return os.getpid()

