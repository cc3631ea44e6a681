"""Rank functions for the data-parallel and ZeRO tests: several runs per launch (each launch costs seconds)."""

from labkit.distributed import dp_ranks


def everything(rank, world_size, cfg, steps, batch, seq, methods, references):
    """Each of labkit's `methods` (dp_ranks.train), then the production `references` ("ddp", "ddp-sgd",
    "fsdp2", "zero-redundancy"), one after the other on the same ranks."""
    out = {m: dp_ranks.train(rank, world_size, m.removesuffix("-sgd"), cfg, steps, batch, seq,
                             optimizer="sgd" if m.endswith("-sgd") else "adamw") for m in methods}
    if "ddp" in references:
        out["ddp"] = dp_ranks.ddp_train(rank, world_size, cfg, steps, batch, seq)
    if "ddp-sgd" in references:
        out["ddp-sgd"] = dp_ranks.ddp_train(rank, world_size, cfg, steps, batch, seq, optimizer="sgd")
    if "fsdp2" in references:
        out["fsdp2"] = dp_ranks.fsdp2_train(rank, world_size, cfg, steps, batch, seq)
    if "zero-redundancy" in references:
        out["zero-redundancy"] = dp_ranks.zero_redundancy_elements(rank, world_size, cfg)
    return out


def mismatched_models(rank, world_size, cfg):
    """Rank 1 builds a wider model: ZeRO's first collective on the flat buffers does not match."""
    from labkit.distributed.zero import Zero
    from labkit.models.gpt import GPT, GPTConfig

    c = dict(cfg, n_embd=cfg["n_embd"] * (2 if rank == 1 else 1))
    z = Zero(GPT(GPTConfig(**c)), 3)
    return z.state_elements()


def zero_redundancy_only(rank, world_size, cfg):
    return dp_ranks.zero_redundancy_elements(rank, world_size, cfg)
