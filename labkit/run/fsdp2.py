"""A Recipe under FSDP2 on simulated ranks: rank 0's per-rank bytes by FSDPMemTracker, with the
recipe's checkpointing, LoRA, optimizer and mixed precision applied as labkit.run.step applies them
(the fake process group of labkit.distributed.simulate: every tensor with the shape and lifetime it
has on rank 0 of N).

    r = Recipe("llama-tiny", 8, 32, dp=4, zero=3, dtype="mixed-bf16", checkpoint="full")
    fsdp2_recipe_memory(r)  # {"world": 4, "peak": bytes, "by_category": {...}}
"""

from __future__ import annotations

from labkit.distributed.procs import run_child
from labkit.distributed.simulate import DTYPES

__all__ = ["fsdp2_recipe_memory"]


def _measure_recipe(r, reshard_after_forward: bool = True) -> dict:
    """Rank 0 of r.dp fake ranks running the recipe under FSDP2, by FSDPMemTracker."""
    import torch
    import torch.distributed as dist
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from labkit.estimate.zero_terms import engine_mixed
    from labkit.recompute import checkpoint_blocks, find_blocks
    from .step import apply_peft, build_model, make_optimizer, train_step

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=r.dp)
    try:
        torch.manual_seed(0)
        engine = engine_mixed(r)
        m = build_model(r.model, r.dtype, "cpu", **r.config)
        apply_peft(m, r.dtype, r.lora_rank, r.lora_targets, r.quant, r.lisa_layers, r.quant_group)
        mesh = init_device_mesh("cpu", (r.dp,))
        low = getattr(torch, DTYPES[r.dtype.removeprefix("mixed-")]) if engine else None
        mp = MixedPrecisionPolicy(param_dtype=low)
        for b in find_blocks(m):
            fully_shard(b, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
        fully_shard(m, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
        opt = make_optimizer(m, r)
        vocab = m.config.vocab_size
        gen = torch.Generator().manual_seed(0)
        step_dtype = "fp32" if engine else r.dtype  # the engines: 16 bits, no autocast
        with checkpoint_blocks(m, r.checkpoint, r.segments, selective=r.selective_policy):
            tracker = FSDPMemTracker(m, opt)
            with tracker:
                for i in range(2):  # the second step has the optimizer state from the start
                    t = torch.randint(0, vocab, (r.rank_batch, r.seq + 1), generator=gen)
                    x, y = t[:, :-1].contiguous(), t[:, 1:].contiguous()
                    train_step(m, opt, x, y, step_dtype, r.micro_batch, r.offload_activations)
                    del x, y
                    del t
                    if i == 0:
                        tracker.reset_mod_stats()
        snap = tracker.get_tracker_snapshot("peak")
        dev = next(iter(snap))
        by = {str(k).split(".")[-1].lower(): int(v) for k, v in snap[dev].items()
              if str(k) != "Total"}
        return {"world": r.dp, "peak": int(snap[dev]["Total"]), "by_category": by}
    finally:
        dist.destroy_process_group()


def fsdp2_recipe_memory(recipe, reshard_after_forward: bool = True, timeout_s: float = 300) -> dict:
    """Rank 0's peak bytes when a Recipe runs under FSDP2 on recipe.dp simulated ranks (fake process
    group, one child process): fully_shard on every block (labkit.recompute.find_blocks), then the
    root; the recipe's checkpoint policy (labkit.recompute.checkpoint_blocks, on the sharded blocks),
    its LoRA/QLoRA (labkit.run.step.apply_peft before sharding: the frozen base is sharded beside the
    adapters) and its optimizer (labkit.run.step.make_optimizer); rank_batch rows per rank, two steps,
    the second measured. Mixed precision as recipe.zero_mixed says: "engine",
    MixedPrecisionPolicy(param_dtype=16 bits), no
    autocast; "autocast", fp32 units under torch.autocast. {"world", "peak", "by_category"}."""
    if recipe.dp < 2:
        raise ValueError(f"fsdp2_recipe_memory needs dp >= 2 ranks, got dp={recipe.dp}")
    return run_child(_measure_recipe, (recipe, bool(reshard_after_forward)), timeout_s,
                     f"fsdp2_recipe_memory at dp={recipe.dp}")
