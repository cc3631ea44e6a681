"""Rank functions for data parallelism and ZeRO that lessons and tests launch (`labkit.distributed.launch`):
each trains or measures the same small GPT on every rank, from the same seed, on its rows of one global batch.

    run = TrainRun(cfg, steps=3, batch=8, seq=8)                # the model, its steps and global batches
    launch(train, 2, args=("zero3", run))                       # -> per rank: parameters, losses, traffic
    launch(measure, 2, args=(recipe,))                         # -> per rank: the ledger's Measurement
"""

from __future__ import annotations

import contextlib
import re
import warnings
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from . import comms
from .data_parallel import DataParallelBucket, DataParallelNaive
from .zero import Zero

__all__ = ["METHODS", "TrainRun", "global_batch", "batch_of", "shard_rows", "train", "measure",
           "zero_redundancy_elements", "fsdp2_train", "ddp_train"]

METHODS = ("single", "naive", "bucket", "overlap", "zero1", "zero2", "zero3", "zero1-offload", "zero2-offload",
           "zero3-offload")
LR = 1e-2
# torch's CommDebugMode tracks modules with a full backward pre-hook on every module (a global hook); for a
# module none of whose inputs needs a gradient (the GPT and its embeddings take token ids) torch.utils.hooks then
# says the hook fires on the module's outputs only. Harmless here: `train` reads only the mode's counts of
# collectives. Hidden while that mode runs, by its whole text, and nothing else.
COMM_MODE_HOOK_NOTE = ("Full backward hook is firing when gradients are computed with respect to module outputs "
                       "since no inputs require gradients. See https://docs.pytorch.org/docs/main/generated/"
                       "torch.nn.Module.html#torch.nn.Module.register_full_backward_hook for more details.")


@contextlib.contextmanager
def _counting_collectives(mode):
    """`with mode:` (a CommDebugMode), without torch's note on its module tracker's backward hooks."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=re.escape(COMM_MODE_HOOK_NOTE) + r"\Z", category=UserWarning)
        with mode:
            yield


@dataclass(frozen=True)
class TrainRun:
    """A short training run of labkit's GPT that every rank makes alike (lessons 09 and 11): the model, its steps,
    and the global batches each rank takes its rows of."""

    cfg: dict                      # labkit's GPTConfig fields (vocab_size, block_size, n_layer, n_head, n_embd, ...)
    steps: int                     # optimizer steps
    batch: int                     # rows of each step's global batch, the same on every rank (each trains on its share)
    seq: int                       # tokens per row, at most the model's block_size
    seed: int = 0                  # the model's initial weights and the batches
    text_chars: int | None = None  # rows from the first text_chars characters of Shakespeare (byte tokens, so a
                                   # vocab_size of at least 256); None: random token ids

    def __post_init__(self):
        from labkit.models.gpt import GPTConfig
        from labkit.optim.base import check_int

        if not isinstance(self.cfg, dict):
            raise ValueError(f"cfg must be a dict of GPTConfig fields, got {type(self.cfg).__name__}")
        for name in ("steps", "batch", "seq"):
            check_int(name, getattr(self, name))
        check_int("seed", self.seed, low=0)
        try:
            model = GPTConfig(**self.cfg)
        except TypeError as e:  # a field GPTConfig does not have
            raise ValueError(f"cfg: {e}") from None
        if self.seq > model.block_size:
            raise ValueError(f"seq {self.seq} is longer than the model's block_size {model.block_size}")
        if self.text_chars is not None:
            check_int("text_chars", self.text_chars)
            if model.vocab_size < 256:
                raise ValueError(f"text_chars: the corpus is byte tokens (0-255), the model's vocab_size is "
                                 f"{model.vocab_size}: give at least 256 or text_chars=None")

    @property
    def vocab(self) -> int:
        from labkit.models.gpt import GPTConfig

        return GPTConfig(**self.cfg).vocab_size


def global_batch(step: int, batch: int, seq: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's global batch (B, S) of token ids and targets, the same on every rank."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    t = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


_TOKENS: dict[int, torch.Tensor] = {}


def batch_of(run: TrainRun, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s global batch (B, S) of `run`, the same on every rank: random windows of the Shakespeare
    corpus (run.text_chars) or random token ids (`global_batch`)."""
    if run.text_chars is None:
        return global_batch(step, run.batch, run.seq, run.vocab, run.seed)
    from labkit.data import get_batch, load_tokens

    if run.text_chars not in _TOKENS:
        _TOKENS[run.text_chars] = load_tokens(max_chars=run.text_chars)[0]
    return get_batch(_TOKENS[run.text_chars], run.batch, run.seq,
                     generator=torch.Generator().manual_seed(run.seed * 100003 + step))


def shard_rows(run: TrainRun, index: int, parts: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Share `index` of `parts` (a rank's rows) of every step's global batch, as copies: made before any ledger
    starts (the corpus and the global batches are not a rank's training memory)."""
    if run.batch % parts:
        raise ValueError(f"a global batch of {run.batch} rows does not split evenly over {parts} ranks")
    return [tuple(_rows(t, index, parts).clone() for t in batch_of(run, i)) for i in range(run.steps)]


def _rows(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    b = x.shape[0] // world
    return x[rank * b:(rank + 1) * b]


def _model(cfg: dict, seed: int):
    from labkit.models.gpt import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(**cfg))


def _sgd_or_adamw(params, optimizer: str):
    if optimizer not in ("sgd", "adamw"):
        raise ValueError(f"optimizer must be 'sgd' or 'adamw', got {optimizer!r}")
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=LR, foreach=False)
    return torch.optim.AdamW(params, lr=LR, foreach=False)


def train(rank: int, world: int, method: str, run: TrainRun, optimizer: str = "adamw",
          bucket_bytes: int = 4096) -> dict:
    """`run.steps` training steps with `method` (METHODS; "single": this rank alone on the whole batch). Returns
    {"params": {name: tensor}, "losses": [...], "comms": CommLog summary of the last step, "calls": counts of
    the c10d ops torch's CommDebugMode saw in the last step, "grads": ZeRO's averaged gradients of step 1}."""
    from torch.distributed.tensor.debug import CommDebugMode

    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    seed_model = run.seed + (rank if method != "single" else 0)  # ranks start apart: the broadcast must align them
    m = _model(run.cfg, seed_model)
    stage = int(method[4]) if method.startswith("zero") else 0
    if stage:
        if optimizer != "adamw":
            raise ValueError("labkit's Zero steps AdamW")
        z = Zero(m, stage, lr=LR, offload=method.endswith("offload"))
        net, opt = z, None
    elif method == "single":
        torch.manual_seed(run.seed)
        net, opt = m, _sgd_or_adamw(m.parameters(), optimizer)
    else:
        wrap = {"naive": lambda: DataParallelNaive(m),
                "bucket": lambda: DataParallelBucket(m, bucket_bytes, overlap=False),
                "overlap": lambda: DataParallelBucket(m, bucket_bytes, overlap=True)}[method]
        net = wrap()
        opt = _sgd_or_adamw(m.parameters(), optimizer)
    rows = shard_rows(run, 0, 1) if method == "single" else shard_rows(run, rank, world)
    losses, grads = [], None
    log, cdm = comms.CommLog(), CommDebugMode()
    for i, (x, y) in enumerate(rows):
        last = i == run.steps - 1
        counting = _counting_collectives(cdm) if last else contextlib.nullcontext()
        with (log if last else contextlib.nullcontext()), counting:
            loss = net(x, y)
            loss.backward()
            if stage:
                if i == 0:
                    grads = z.full_gradients()
                z.step()
            else:
                if method != "single":
                    net.sync_gradients()
                opt.step()
                opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    params = z.full_parameters() if stage else {n: p.detach().clone() for n, p in m.named_parameters()}
    calls = {str(k): v for k, v in cdm.get_comm_counts().items()}
    return {"params": params, "losses": losses, "comms": log.summary(), "calls": calls, "grads": grads}


def ddp_train(rank: int, world: int, run: TrainRun, optimizer: str = "adamw", bucket_mb: float = 25) -> dict:
    """The same steps with torch.nn.parallel.DistributedDataParallel (the production tool)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    m = _model(run.cfg, run.seed + rank)
    group = comms.plain_group()  # DDP's construction segfaults on a DETAIL-wrapped group (torch 2.13, gloo)
    ddp = DDP(m, bucket_cap_mb=bucket_mb, process_group=group)
    opt = _sgd_or_adamw(ddp.parameters(), optimizer)
    losses = []
    for x, y in shard_rows(run, rank, world):
        loss = ddp(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"params": {n: p.detach().clone() for n, p in m.named_parameters()}, "losses": losses}


def fsdp2_train(rank: int, world: int, run: TrainRun) -> dict:
    """The same steps with FSDP2 (`fully_shard` on every block, then the root, on an explicit CPU mesh) and
    AdamW (single-tensor) on its sharded DTensor parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    m = _model(run.cfg, run.seed)  # FSDP2 does not broadcast: every rank builds the same model
    mesh = init_device_mesh("cpu", (world,))
    for b in m.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(m, mesh=mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=LR, foreach=False)
    losses = []
    for i, (x, y) in enumerate(shard_rows(run, rank, world)):
        loss = m(x, y)
        loss.backward()
        if i == 0:
            grads = {n: p.grad.full_tensor() for n, p in m.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    params = {n: p.full_tensor().detach().clone() for n, p in m.named_parameters()}
    return {"params": params, "losses": losses, "grads": grads}


def zero_redundancy_elements(rank: int, world: int, cfg: dict, seed: int = 0) -> dict:
    """Optimizer-state elements on this rank under torch's ZeroRedundancyOptimizer (whole parameters per rank)
    and under labkit's Zero stage 1 (a flat, evenly cut buffer), after one AdamW step."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    m = _model(cfg, seed)
    zro = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.AdamW, lr=LR, foreach=False)
    x, y = global_batch(0, 2 * world, 8, cfg["vocab_size"], seed)
    m(_rows(x, rank, world), _rows(y, rank, world)).backward()
    for p in m.parameters():
        dist.all_reduce(p.grad)
    zro.step()
    theirs = sum(t.numel() for s in zro.optim.state.values() for k, t in s.items()
                 if torch.is_tensor(t) and k != "step")
    z = Zero(_model(cfg, seed), 1, lr=LR)
    z(_rows(x, rank, world), _rows(y, rank, world)).backward()
    z.step()
    ours = sum(t.numel() for s in z.optimizer.state.values() for k, t in s.items() if torch.is_tensor(t) and k != "step")
    return {"zero_redundancy": theirs, "labkit_zero1": ours}


def measure(rank: int, world: int, recipe, steps: int = 2, seed: int = 0, budget: int | None = None,
            prepare=None):
    """The ledger's Measurement of `steps` steps of `recipe` (a labkit.estimate.Recipe with dp = world, a
    GPTConfig model, fp32, adamw) on this rank: its rows of each global batch (in micro-batches of
    `recipe.micro` rows, each loss weighted by its share), ZeRO stage
    `recipe.zero`, its checkpoint policy (labkit.recompute.checkpoint_blocks)
    (0: labkit's naive data parallel, all-reduce in place after backward). budget: bytes per rank; the ledger
    raises SimulatedOutOfMemoryError where a device with that much memory would fail. prepare: a function
    that changes the model in place before ZeRO wraps it (labkit.run.zero_lora: LoRA's adapters)."""
    from labkit.memory.ledger import Ledger
    from labkit.models.gpt import GPTConfig

    if not isinstance(recipe.model, GPTConfig):
        raise ValueError(f"per-rank measurement builds labkit's GPT: give a GPTConfig, not {type(recipe.model).__name__}")
    if recipe.dp != world:
        raise ValueError(f"the recipe is for dp={recipe.dp} ranks but {world} were launched")
    from .zero import SHARD_OPTIMIZERS

    if recipe.dtype != "fp32" or recipe.optimizer not in (SHARD_OPTIMIZERS if recipe.zero else ("adamw",)):
        raise ValueError("per-rank measurement runs fp32 AdamW (under ZeRO also "
                         f"{', '.join(SHARD_OPTIMIZERS[1:])} on the shards)")
    run = TrainRun({**recipe.model.__dict__, **recipe.config}, steps, recipe.batch, recipe.seq, seed)
    m = _model(run.cfg, seed).train()
    if prepare is not None:
        prepare(m)
    if recipe.zero:
        net = Zero(m, recipe.zero, lr=1e-3, offload=recipe.zero_offload, optimizer=recipe.optimizer)
        opt = net.optimizer
    elif recipe.step_in_backward:  # each gradient averaged, then stepped, in its own hooks (in that order)
        from labkit.optim import StepInBackward

        from .data_parallel import average_in_backward

        net = DataParallelNaive(m)
        average_in_backward(m)
        opt = StepInBackward([p for p in m.parameters() if p.requires_grad], torch.optim.AdamW, lr=1e-3,
                             foreach=recipe.foreach)
    else:
        net = DataParallelNaive(m)
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3, foreach=recipe.foreach)
    rows = shard_rows(run, rank, world)  # each step copies its rows inside the ledger, as a data loader hands them
    from labkit.recompute import checkpoint_blocks

    ckpt = checkpoint_blocks(m, recipe.checkpoint, recipe.segments, selective=recipe.selective_policy)
    label = f"rank {rank} of {world}, ZeRO-{recipe.zero}"
    with ckpt, Ledger(m, opt, budget=budget, label=label) as led:
        for i in range(steps):
            x, y = (t.clone() for t in rows[i])
            parts = list(zip(x.split(recipe.micro), y.split(recipe.micro)))  # micro-batches of `micro` rows
            for xb, yb in parts:  # each loss weighted by its share of the rows
                loss = net(xb, yb)
                if len(parts) > 1:
                    loss = loss * (xb.shape[0] / x.shape[0])
                loss.backward()
                del loss
            if recipe.zero:
                net.step()
            else:
                if not recipe.step_in_backward:
                    net.sync_gradients()
                opt.step()
                opt.zero_grad(set_to_none=True)
            del x, y
    # paged states (plain data parallelism): the state's bytes leave the device timeline as CUDA unified memory,
    # as on one device (labkit.run.step.measure_step)
    return led.measurement().as_unified() if recipe.paged_states else led.measurement()


def measure_many(rank: int, world: int, recipes: list, steps: int = 2, seed: int = 0,
                 budget: int | None = None) -> list:
    """`measure` for each recipe in turn on the same ranks (one launch): the Measurements of the last step."""
    return [measure(rank, world, r, steps, seed, budget).of_step(steps) for r in recipes]


def measure_ranks(recipe, world: int = 2, steps: int = 2, timeout_s: float = 240, budget: int | None = None) -> list:
    """Launch `world` ranks (labkit.distributed.launch) that each measure `recipe` with dp = world: one
    Measurement of the last step per rank, in rank order. budget: bytes per rank (a rank over it fails with
    the ledger's SimulatedOutOfMemoryError, raised here as RankFailed)."""
    from .launch import launch

    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0):
        raise ValueError(f"budget must be a positive number of bytes per rank, got {budget!r}")
    r = recipe.replace(dp=world, batch=recipe.rank_batch * world)
    return [ms[0] for ms in launch(measure_many, world, args=([r], steps, 0, budget), timeout_s=timeout_s)]


def compare(rank: int, world: int, run: TrainRun, methods=(), references=()) -> dict:
    """Each of labkit's `methods` (`train`; a "-sgd" suffix trains with SGD), then the production `references`
    ("ddp", "ddp-sgd", "fsdp2", "zero-redundancy"), one after the other on the same ranks (one launch)."""
    out = {m: train(rank, world, m.removesuffix("-sgd"), run, optimizer="sgd" if m.endswith("-sgd") else "adamw")
           for m in methods}
    runs = {"ddp": partial(ddp_train, rank, world, run), "ddp-sgd": partial(ddp_train, rank, world, run, "sgd"),
            "fsdp2": partial(fsdp2_train, rank, world, run),
            "zero-redundancy": partial(zero_redundancy_elements, rank, world, run.cfg, run.seed)}
    for ref in references:
        if ref not in runs:
            raise ValueError(f"unknown reference {ref!r}: ddp, ddp-sgd, fsdp2 or zero-redundancy")
        out[ref] = runs[ref]()
    return out
