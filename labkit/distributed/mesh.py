"""Data parallelism beside model parallelism: dp replicas of a model split mp ways (pipeline stages or tensor-
parallel ranks), on dp x mp ranks.

Rank r is replica d = r // mp, model part j = r % mp (Megatron-LM's order: the parts of one replica are
neighbours). Each part has a data-parallel group (the dp ranks holding the same part: its gradients are
averaged there, or its optimizer state sharded there with ZeRO-1), and each replica has a model-parallel
group (its tensor-parallel collectives, or its pipeline's first and last stage for a tied embedding).

    mesh = Mesh.build(dp=2, mp=2)   # every rank, in the same order: it creates every group
    mesh.dp_group, mesh.mp_group, mesh.replica, mesh.part, mesh.stage_ranks

`train_step_memory` (a rank function for labkit.distributed.launch) trains labkit's GPT in such a layout
under the ledger; its per-rank peaks are what `labkit.estimate.estimate_ranks` predicts for the same Recipe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import comms

__all__ = ["Mesh", "train_step_memory"]


@dataclass(frozen=True)
class Mesh:
    dp: int
    mp: int
    rank: int
    dp_group: object
    mp_group: object
    tied_group: object  # first and last stage of this replica's pipeline (None when mp == 1)

    @property
    def replica(self) -> int:
        return self.rank // self.mp

    @property
    def part(self) -> int:
        return self.rank % self.mp

    @property
    def stage_ranks(self) -> list[int]:
        """The global rank of each part of this replica (a pipeline's stages, in order)."""
        return [self.replica * self.mp + j for j in range(self.mp)]

    @classmethod
    def build(cls, dp: int, mp: int) -> "Mesh":
        import torch.distributed as dist

        for name, v in (("dp", dp), ("mp", mp)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"mesh: {name} must be a positive integer, got {v!r}")
        world, rank = dist.get_world_size(), dist.get_rank()
        if dp * mp != world:
            raise ValueError(f"mesh: dp x mp = {dp} x {mp} = {dp * mp} ranks, but {world} were launched")
        dp_groups = [comms.new_group([d * mp + j for d in range(dp)]) for j in range(mp)]
        mp_groups = [comms.new_group([d * mp + j for j in range(mp)]) for d in range(dp)]
        tied = [comms.new_group([d * mp, d * mp + mp - 1]) for d in range(dp)] if mp > 1 else [None] * dp
        d, j = rank // mp, rank % mp
        return cls(dp, mp, rank, dp_groups[j], mp_groups[d], tied[d])


def _average_grads(module: torch.nn.Module, group) -> None:
    """Plain data parallel inside a part's group: each gradient all-reduced (mean) in place."""
    for name, p in module.named_parameters():
        if p.grad is not None:
            comms.all_reduce(p.grad, op="avg", group=group, tag=f"grad {name}")


def train_step_memory(rank: int, world: int, recipe, steps: int = 2, seed: int = 0, parity: bool = False) -> dict:
    """One rank of `recipe` (labkit's GPT as a GPTConfig, fp32 AdamW, dp x (tp or pp), ZeRO 0 or 1) trained
    for `steps` steps under its own ledger: the last step's peak by category, its phase and this rank's
    losses. `parity=True` also returns the part's averaged gradients of the first step (named as in the
    whole model): copies kept alive through the later steps, so that run's peaks are not the recipe's.

    Each replica takes its rows of every global batch (batch / dp); a pipeline runs `recipe.schedule` over
    rank_batch / micro_batch micro-batches."""
    from labkit.distributed import pipeline as pl
    from labkit.distributed import tensor_parallel as tpm
    from labkit.distributed.dp_ranks import TrainRun, _model, shard_rows
    from labkit.memory.ledger import Ledger
    from labkit.models.gpt import GPTConfig

    r = recipe
    if not isinstance(r.model, GPTConfig):
        raise ValueError(f"mesh: give labkit's GPT as a GPTConfig, not {type(r.model).__name__}")
    if r.dtype != "fp32" or r.optimizer != "adamw" or r.zero not in (0, 1) or (r.tp > 1 and r.pp > 1):
        raise ValueError("mesh: runs fp32 AdamW, ZeRO 0 or 1, and one kind of model parallelism (tp or pp)")
    mp = r.tp * r.pp
    mesh = Mesh.build(r.dp, mp)
    data = TrainRun({**r.model.__dict__, **r.config}, steps, r.batch, r.seq, seed)  # the model and its batches
    model = _model(data.cfg, seed).train()
    if r.pp > 1:
        part = pl.build_stage(model, mesh.part, r.pp)
        origin = part.origin
    else:
        part = tpm.parallelize(model, mesh.part, r.tp, r.sequence_parallel, group=mesh.mp_group)
        origin = {n: n for n, _ in part.named_parameters()}
    del model
    if r.zero:
        from .zero import Zero

        run = Zero(part, 1, lr=1e-3, group=mesh.dp_group)
        opt = run.optimizer
    else:
        from .data_parallel import broadcast_parameters

        broadcast_parameters(part, group=mesh.dp_group)
        opt = torch.optim.AdamW(part.parameters(), lr=1e-3, foreach=False)
    rows = r.rank_batch
    m = rows // r.micro
    batches = shard_rows(data, mesh.replica, r.dp)  # this replica's rows of each global batch
    actions = pl.schedule(r.schedule, m, r.pp, mesh.part) if r.pp > 1 else None
    grads, losses = None, []
    comms.barrier()
    with Ledger(part, opt, label=f"rank {rank}: replica {mesh.replica}, part {mesh.part}") as led:
        for i in range(steps):
            x, y = (t.clone() for t in batches[i])
            if r.pp > 1:
                first, last = mesh.part == 0, mesh.part == r.pp - 1
                run_ = pl.run_step(part, actions, x if first else None, y if last else None, m, ledger=led,
                                   ranks=mesh.stage_ranks, batch_shape=tuple(x.shape))
                pl.sync_tied_grads(part, mesh.tied_group)
                losses.append(run_.loss)
            else:
                total = 0.0
                for xs, ys in zip(x.split(r.micro), y.split(r.micro)):
                    loss = part(xs, ys) * (r.micro / rows)
                    loss.backward()
                    total += loss.item()
                    del loss
                tpm.sync_replicated_grads(part, mesh.mp_group)
                losses.append(total)
            del x, y
            if r.zero:
                if i == 0 and parity:
                    grads = {origin[n]: g for n, g in run.full_gradients().items()}
                run.step()
            else:
                _average_grads(part, mesh.dp_group)
                if i == 0 and parity:
                    grads = {origin[n]: p.grad.clone() for n, p in part.named_parameters()}
                opt.step()
                opt.zero_grad(set_to_none=True)
    meas = led.measurement().of_step(steps)
    return {"peak": meas.peak.as_dict(), "peak_phase": meas.peak_phase, "losses": losses, "grads": grads,
            "replica": mesh.replica, "part": mesh.part}


def train_many(rank: int, world: int, recipes: list, steps: int = 2, parity: tuple = ()) -> list[dict]:
    """`train_step_memory` for each recipe in turn on the same ranks (one launch: start-up is the slow part);
    the recipes whose index is in `parity` also return their first step's gradients."""
    return [train_step_memory(rank, world, r, steps, parity=i in parity) for i, r in enumerate(recipes)]
