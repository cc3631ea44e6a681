"""Per-rank FSDP2 memory at any world size in one process: a fake process group (collectives that move no data)
and PyTorch's `FSDPMemTracker` (exact byte accounting of one rank, by FSDP's categories).

    fsdp2_rank_memory(cfg, world=64, batch=2, seq=64)  # -> {"peak": bytes, "by_category": {...}, ...}

With the `fake` backend (torch.testing._internal.distributed.fake_pg) every collective returns at once with
its output left as it was, so the numbers that come out of the step are meaningless, but every tensor has the
shape and lifetime it would have on rank 0 of `world` ranks: the bytes are real. Runs in a child process (a
process group is global state; this leaves the caller's alone; labkit.distributed.procs). CPU only.
"""

from __future__ import annotations

from .procs import run_child

__all__ = ["fsdp2_rank_memory", "zero_rank_memory"]  # a whole Recipe under FSDP2: labkit.run.fsdp2


def _measure_all(cfg: dict, worlds: list, batch: int, seq: int, reshard: bool, opts: dict) -> list:
    return [_measure(cfg, w, batch, seq, reshard, **opts) for w in worlds]


def _measure(cfg: dict, world: int, batch: int, seq: int, reshard_after_forward: bool = True,
             param_dtype: str | None = None) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from labkit.models.gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        torch.manual_seed(0)
        m = GPT(GPTConfig(**cfg))
        mesh = init_device_mesh("cpu", (world,))
        low = getattr(torch, DTYPES[param_dtype]) if param_dtype else None
        mp = MixedPrecisionPolicy(param_dtype=low)
        for b in m.blocks:
            fully_shard(b, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
        fully_shard(m, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False)
        x = torch.randint(0, cfg["vocab_size"], (batch, seq))
        tracker = FSDPMemTracker(m, opt)
        with tracker:
            for _ in range(2):  # the second step has the optimizer state from the start
                m(x, x).backward()
                opt.step()
                opt.zero_grad()
                if _ == 0:
                    tracker.reset_mod_stats()
        snap = tracker.get_tracker_snapshot("peak")
        dev = next(iter(snap))
        by = {str(k).split(".")[-1].lower(): int(v) for k, v in snap[dev].items() if str(k) != "Total"}
        return {"world": world, "peak": int(snap[dev]["Total"]), "by_category": by}
    finally:
        dist.destroy_process_group()


DTYPES = {"bf16": "bfloat16", "fp16": "float16"}  # MixedPrecisionPolicy's param_dtype by Recipe name


def fsdp2_rank_memory(cfg: dict, world, batch: int, seq: int, timeout_s: float = 300,
                      reshard_after_forward: bool = True, param_dtype: str | None = None):
    """Rank 0's peak bytes under FSDP2 (every block, then the root, fully_shard-ed; AdamW) for a labkit GPT
    config (a dict of GPTConfig fields), `batch` rows of `seq` tokens per rank, on `world` simulated ranks:
    {"world", "peak", "by_category": FSDPMemTracker's categories at the peak}. A list of world sizes gives a
    list (one child process for all of them). reshard_after_forward: fully_shard's (True: parameters
    gathered again for backward, ZeRO-3; False: each block keeps them from its forward to its
    backward). param_dtype: "bf16" or "fp16" runs FSDP2's mixed precision,
    MixedPrecisionPolicy(param_dtype=...) on every unit (fp32 shards, units gathered and computed in 16
    bits, gradients reduced in 16 bits); None: fp32."""
    if param_dtype is not None and param_dtype not in DTYPES:
        raise ValueError(f"param_dtype must be None, 'bf16' or 'fp16', got {param_dtype!r}")
    worlds = list(world) if isinstance(world, (list, tuple)) else [world]
    for w in worlds:
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ValueError(f"world must be an integer >= 1, got {w!r}")
    opts = {"param_dtype": param_dtype}
    value = run_child(_measure_all, (dict(cfg), worlds, batch, seq, bool(reshard_after_forward), opts),
                      timeout_s, f"fsdp2_rank_memory at world {world}")
    return value if isinstance(world, (list, tuple)) else value[0]


def zero_rank_memory(recipe, steps: int = 2, seed: int = 0, prepare=None):
    """Rank 0's Measurement (the ledger's, last step) of labkit's Zero for `recipe` (dp = the simulated world
    size, a GPTConfig model, fp32 AdamW) under a fake process group, in this process: the per-rank bytes of any
    world size without its ranks. The caller's process group, if any, must be the fake one of that size or none
    (one is made and destroyed here). prepare: changes the model before ZeRO wraps it (dp_ranks.measure)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .dp_ranks import measure

    made = not dist.is_initialized()
    if made:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=recipe.dp)
    elif dist.get_world_size() != recipe.dp or dist.get_backend() != "fake":
        raise ValueError(f"a process group of {dist.get_world_size()} ranks ({dist.get_backend()}) is already "
                         f"there; zero_rank_memory needs none or a fake one of dp={recipe.dp}")
    try:
        threads = torch.get_num_threads()
        return measure(0, recipe.dp, recipe, steps, seed, prepare=prepare).of_step(steps)
    finally:
        torch.set_num_threads(threads)
        if made:
            dist.destroy_process_group()
