"""Rank functions for lesson 11 (communication) that lessons and tests launch (`labkit.distributed.launch`):
dense data parallel, DGC (plain path or DDP hook), PowerSGD (PyTorch's DDP hook) and the parameter server, each
training labkit's GPT on this rank's rows of the same global batches (a `dp_ranks.TrainRun`), counting bytes per
step by definition (`comms.CommLog`) and, on request, the state it keeps with the per-rank ledger.

    run = TrainRun(cfg, steps, batch, seq)
    launch(compare, 2, args=(run, ["dense", "dgc", "powersgd"]))
    launch(ps_train, 3, args=(run,))          # rank 0 the server, ranks 1.. the workers
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist

from . import comms
from .compression import DGC, DGCConfig, PowerSGDConfig
from .dp_ranks import TrainRun, _model, shard_rows
from .param_server import PSConfig

__all__ = ["VARIANTS", "LR", "WorkerFaults", "dense_train", "dgc_train", "powersgd_train", "compare", "ps_train",
           "mirrored_train", "ps_suite", "ps_dies", "compression_suite", "plan_bytes", "explore", "collectives_check"]

LR = 0.05
MOMENTUM = 0.9
# the variants `compare` knows: dense all-reduce, DGC, DGC without each technique, PowerSGD
VARIANTS = ("dense", "dgc", "dgc-no-momentum-correction", "dgc-no-clipping", "dgc-no-masking", "dgc-no-warmup",
            "powersgd")
_WITHOUT = {"dgc-no-momentum-correction": "momentum_correction", "dgc-no-clipping": "clipping",
            "dgc-no-masking": "masking", "dgc-no-warmup": "warmup"}


def _loop(rank, world, m, opt, run: TrainRun, forward, sync, ledger_from=None):
    """The shared training loop: per step, this rank's rows, forward + backward, `sync()` (the communication),
    the optimizer step; the wire bytes per step from a CommLog. `ledger_from`: enter a Ledger at that step and
    return its measurement (the state that outlives the steps is what it still holds at the end)."""
    from labkit.memory import Ledger

    losses, wire = [], []
    stack = contextlib.ExitStack()
    led = None
    rows = shard_rows(run, rank, world)  # each step copies its rows inside, as a data loader would hand them over
    with stack:
        for i in range(run.steps):
            if ledger_from is not None and i == ledger_from:
                led = stack.enter_context(Ledger(m, opt, label=f"rank {rank} of {world}"))
            x, y = (t.clone() for t in rows[i])
            with comms.CommLog() as log:
                loss = forward(x, y)
                loss.backward()
                sync()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            wire.append(log.wire())
            del loss, x, y
    return losses, wire, (led.measurement() if led is not None else None)


def _result(m, losses, wire, measurement=None, **extra) -> dict:
    out = {"params": {n: p.detach().clone() for n, p in m.named_parameters()}, "losses": losses, "wire": wire,
           "n_params": sum(p.numel() for p in m.parameters())}
    if measurement is not None:
        out["final"] = measurement.final.as_dict()
        out["baseline"] = measurement.baseline.as_dict()
    out.update(extra)
    return out


def dense_train(rank: int, world: int, run: TrainRun) -> dict:
    """Data parallel with a dense all-reduce (mean) of every gradient, SGD with momentum."""
    m = _model(run.cfg, run.seed)
    opt = torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM, foreach=False)

    def sync():
        for n, p in m.named_parameters():
            comms.all_reduce(p.grad, op="avg", tag=f"grad {n}")

    losses, wire, _ = _loop(rank, world, m, opt, run, m, sync)
    return _result(m, losses, wire)


def dgc_train(rank: int, world: int, run: TrainRun, dgc: DGCConfig = DGCConfig(), path: str = "plain",
              measure: bool = False) -> dict:
    """DGC, through `DGC.sync_gradients` (path "plain") or as a DDP comm hook (path "hook"); SGD with the
    momentum the config leaves to the optimizer. measure: the ledger from step 0 (plain path); the result's
    "final" is what it holds at the end, by category (DGC's buffers are temporaries made in backward)."""
    if path not in ("plain", "hook"):
        raise ValueError(f"path must be 'plain' or 'hook', got {path!r}")
    m = _model(run.cfg, run.seed)
    if path == "hook":
        from torch.nn.parallel import DistributedDataParallel as DDP

        group = comms.plain_group()
        state = DGC(m.named_parameters(), dgc, group=group)
        net = DDP(m, process_group=group)
        net.register_comm_hook(state, DGC.hook)
    else:
        state = DGC(m.named_parameters(), dgc)
        net = m

    def sync():  # the exchange (the hook's ran in backward), then DGC's warm-up counts the step
        if path == "plain":
            state.sync_gradients()
        state.next_step()

    opt = torch.optim.SGD(m.parameters(), lr=LR, momentum=dgc.sgd_momentum, foreach=False)
    losses, wire, meas = _loop(rank, world, m, opt, run, net, sync, ledger_from=0 if measure else None)
    return _result(m, losses, wire, meas, state_bytes=state.state_bytes(), sent=state.sent)


def powersgd_train(rank: int, world: int, run: TrainRun, psgd: PowerSGDConfig = PowerSGDConfig(),
                   measure: bool = False) -> dict:
    """PyTorch's PowerSGD DDP hook (the reference), SGD with momentum. Every all-reduce the hook issues is
    counted by definition (its payload's size) and completed before the hook goes on (no overlap: the numbers
    are the same); the shapes of each bucket's gradients are recorded (for the formula). measure: the ledger
    from step `psgd.start_iter` (after DDP rebuilt its buckets): what the hook keeps."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as pgh
    from torch.nn.parallel import DistributedDataParallel as DDP

    m = _model(run.cfg, run.seed)
    group = comms.plain_group()
    net = DDP(m, process_group=group, bucket_cap_mb=psgd.bucket_mb)
    state = pgh.PowerSGDState(process_group=group, matrix_approximation_rank=psgd.rank,
                              start_powerSGD_iter=psgd.start_iter, use_error_feedback=psgd.error_feedback,
                              warm_start=psgd.warm_start, random_seed=run.seed)
    buckets: dict[int, list[tuple]] = {}

    def hook(s, bucket):
        buckets[bucket.index()] = [tuple(g.shape) for g in bucket.gradients()]
        return pgh.powerSGD_hook(s, bucket)

    net.register_comm_hook(state, hook)
    opt = torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM, foreach=False)
    original = dist.all_reduce

    def counted_all_reduce(tensor, *args, **kwargs):  # the hook's collectives, counted by their definition
        comms._record("all_reduce", tensor.numel() * tensor.element_size(), kwargs.get("group"), "powerSGD")
        work = original(tensor, *args, **kwargs)
        if work is not None:
            # complete it here, so the callbacks the hook chains on its future run now, on this thread, where the
            # ledger (a dispatch mode, per thread) sees what they allocate; otherwise gloo's thread may run them
            work.wait()
        return work

    dist.all_reduce = counted_all_reduce
    try:
        losses, wire, meas = _loop(rank, world, m, opt, run, net, lambda: None,
                                   ledger_from=psgd.start_iter if measure else None)
    finally:
        dist.all_reduce = original
    kept = sum(t.numel() * t.element_size() for d in (state.error_dict, state.p_memory_dict, state.q_memory_dict)
               for t in d.values())
    return _result(m, losses, wire, meas, buckets=[buckets[i] for i in sorted(buckets)], state_bytes=kept)


def compare(rank: int, world: int, run: TrainRun, variants=VARIANTS, dgc: DGCConfig = DGCConfig(),
            psgd: PowerSGDConfig = PowerSGDConfig()) -> dict:
    """Each variant in turn on the same ranks and batches: {variant: {"losses", "wire", ...}}. DGC variants
    "dgc-no-X" switch technique X off."""
    runs = {"dense": partial(dense_train, rank, world, run), "dgc": partial(dgc_train, rank, world, run, dgc),
            "powersgd": partial(powersgd_train, rank, world, run, psgd),
            **{v: partial(dgc_train, rank, world, run, dgc.without(off)) for v, off in _WITHOUT.items()}}
    out = {}
    for v in variants:
        if v not in runs:
            raise ValueError(f"unknown variant {v!r}: one of {', '.join(VARIANTS)}")
        out[v] = runs[v]()
        out[v].pop("params")  # the curves and bytes travel back, not every variant's model
    return out


def compression_suite(rank: int, world: int, run: TrainRun, dgc: DGCConfig, psgd: PowerSGDConfig,
                      variants=()) -> dict:
    """What the tests and the lesson check in one launch: DGC on both paths (the plain one measured by the
    ledger), DGC without momentum correction (measured), PowerSGD (measured from its first compressed step),
    then `compare` over `variants`."""
    return {"plain": dgc_train(rank, world, run, dgc, "plain", measure=True),
            "hook": dgc_train(rank, world, run, dgc, "hook"),
            "plain-no-mc": dgc_train(rank, world, run, dgc.without("momentum_correction"), "plain", measure=True),
            "powersgd": powersgd_train(rank, world, run, psgd, measure=True),
            "compare": compare(rank, world, run, variants, dgc, psgd) if variants else {}}


# ---- the parameter server ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkerFaults:
    """Parameter-server workers that misbehave on purpose, to watch the server cope."""

    delays: dict = field(default_factory=dict)  # {rank: seconds} a worker sleeps before each step (a slow machine)
    die: dict = field(default_factory=dict)     # {rank: step} a worker kills itself (SIGKILL) at that step

    def __post_init__(self):
        for what, faults in (("delays", self.delays), ("die", self.die)):
            if not isinstance(faults, dict) or any(isinstance(r, bool) or not isinstance(r, int) or r < 1
                                                   for r in faults):
                raise ValueError(f"{what} must be a dict keyed by worker rank (>= 1: rank 0 serves), got {faults!r}")
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 for v in self.delays.values()):
            raise ValueError(f"delays must be seconds >= 0, got {self.delays!r}")
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in self.die.values()):
            raise ValueError(f"die must map a worker to a step >= 0, got {self.die!r}")


def _server_optimizer(params, optimizer: str):
    if optimizer == "adamw":
        return torch.optim.AdamW(params, lr=LR, foreach=False)
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM if optimizer == "sgd-momentum" else 0.0, foreach=False)


def ps_train(rank: int, world: int, run: TrainRun, ps: PSConfig = PSConfig(), faults: WorkerFaults = WorkerFaults(),
             measure: bool = False, tag: str = "0") -> dict:
    """Rank 0 serves (labkit.distributed.param_server.serve) with `ps.optimizer`, ranks 1..world-1 work on their
    rows of each global batch. measure: each rank's ledger (the server's holds the parameters and optimizer
    state; a worker's no optimizer). tag: a name unique to this run among those on the same ranks."""
    import time

    from labkit.memory import Ledger

    from .param_server import serve, work

    group = comms.plain_group()
    workers = list(range(1, world))
    m = _model(run.cfg, run.seed)
    if rank == 0:
        opt = _server_optimizer(m.parameters(), ps.optimizer)
        with comms.CommLog() as log, (Ledger(m, opt, label="server") if measure else contextlib.nullcontext()) as led:
            rep = serve(m, opt, workers, ps, group=group, run=tag)
        out = {"role": "server", "params": {n: p.detach().clone() for n, p in m.named_parameters()},
               "report": rep.__dict__, "wire": log.wire(), "n_params": sum(p.numel() for p in m.parameters())}
    else:
        rows = shard_rows(run, rank - 1, len(workers))  # made before the ledger starts, as in `_loop`

        def batches(step):
            if rank in faults.delays:
                time.sleep(faults.delays[rank])
            return tuple(t.clone() for t in rows[step])

        ledger = Ledger(m, label=f"worker {rank}") if measure else contextlib.nullcontext()
        with comms.CommLog() as log, ledger as led:
            losses = work(m, run.steps, batches, die_at=faults.die.get(rank), group=group, run=tag)
        out = {"role": "worker", "losses": losses, "wire": log.wire()}
    if measure:
        meas = led.measurement()
        out["peak"], out["final"] = meas.peak.as_dict(), meas.final.as_dict()
    return out


def mirrored_train(rank: int, world: int, run: TrainRun, group_ranks: list[int]) -> dict | None:
    """Synchronous data parallel ("mirrored") on the ranks of `group_ranks` with plain SGD: an all-reduce (mean)
    of each gradient. Every rank of the world must call it (it makes the group); the others return None."""
    group = comms.new_group(group_ranks)  # with the run's timeout
    if rank not in group_ranks:
        return None
    m = _model(run.cfg, run.seed)
    opt = torch.optim.SGD(m.parameters(), lr=LR, foreach=False)
    losses = []
    for x, y in shard_rows(run, group_ranks.index(rank), len(group_ranks)):
        loss = m(x, y)
        loss.backward()
        for n, p in m.named_parameters():
            comms.all_reduce(p.grad, op="avg", group=group, tag=f"grad {n}")
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"params": {n: p.detach().clone() for n, p in m.named_parameters()}, "losses": losses}


def ps_suite(rank: int, world: int, run: TrainRun, servers: dict, measure: bool = False,
             faults: WorkerFaults = WorkerFaults(), then_die: PSConfig | None = None) -> dict:
    """Several parameter-server runs {name: PSConfig} one after the other on the same ranks (one launch), then
    the mirrored all-reduce on the workers: {name: ps_train's result, "mirrored": ...}. then_die: a last run
    with this PSConfig in which the last worker kills itself at step 1 (launch with may_fail=[world - 1]; that
    rank's whole result is then its RankFailed), under "dies"."""
    out = {}
    for name, ps in servers.items():
        out[name] = ps_train(rank, world, run, ps, faults, measure, tag=name)
        dist.barrier()
    out["mirrored"] = mirrored_train(rank, world, run, list(range(1, world)))
    if then_die is not None:
        out["dies"] = ps_dies(rank, world, run, then_die, 1)
    return out


def ps_dies(rank: int, world: int, run: TrainRun, ps: PSConfig, at_step: int) -> dict:
    """`ps_train` in which the last worker kills itself (SIGKILL) at `at_step`: launch it with may_fail=[world-1]."""
    return ps_train(rank, world, run, ps, WorkerFaults(die={world - 1: at_step}), tag="dies")


# ---- what the lesson's panel asks: bytes per step by formula, loss curves from real ranks --------------------
def plan_bytes(run: TrainRun, dgc: DGCConfig = DGCConfig(), psgd: PowerSGDConfig = PowerSGDConfig(), world: int = 2,
               ps_workers: int = 2) -> dict[str, list[float]]:
    """Bytes the busiest rank sends at each of the run's steps, by each collective's definition, for its GPT:
    dense all-reduce, DGC (with its warm-up), PowerSGD (vanilla all-reduce before `psgd.start_iter`) and the
    parameter server (its server sends the parameters to every worker). No process is started."""
    from .compression import density_at, dense_wire_bytes, dgc_wire_bytes, powersgd_wire_bytes
    from .param_server import HEADER

    m = _shapes_model(run.cfg)
    shapes = [tuple(p.shape) for p in m.parameters()]
    numels = [p.numel() for p in m.parameters()]
    n = sum(numels)
    dense = dense_wire_bytes(n, world)
    compressed = powersgd_wire_bytes([shapes], psgd.rank, world)  # linear in size: bucketing does not change it
    steps = range(run.steps)
    return {"dense": [dense] * run.steps,
            "dgc": [dgc_wire_bytes(numels, density_at(s, dgc), world) for s in steps],
            "powersgd": [dense if s < psgd.start_iter else compressed for s in steps],
            "parameter server": [float(ps_workers * (n + 1) * 4)] * run.steps,
            "worker push": [float((n + HEADER) * 4)] * run.steps}


def _shapes_model(cfg: dict):
    """The GPT on the meta device: shapes without memory."""
    from labkit.models.gpt import GPT, GPTConfig

    with torch.device("meta"):
        return GPT(GPTConfig(**cfg))


def explore(run: TrainRun, dgc: DGCConfig = DGCConfig(), psgd: PowerSGDConfig = PowerSGDConfig(),
            ps: PSConfig = PSConfig("async"), slow_worker_s: float = 0.0, timeout_s: float = 300) -> dict[str, list]:
    """Loss curves (the mean over ranks of each step's loss) of dense, DGC and PowerSGD on 2 ranks, and of the
    parameter server `ps` on a server and 2 workers (worker 2 slower by `slow_worker_s` a step). Two launches."""
    from .launch import launch

    faults = WorkerFaults(delays={2: slow_worker_s} if slow_worker_s else {})
    runs = launch(compare, 2, args=(run, ("dense", "dgc", "powersgd"), dgc, psgd), timeout_s=timeout_s,
                  backend="gloo")
    steps = range(run.steps)
    out = {v: [sum(r[v]["losses"][i] for r in runs) / 2 for i in steps] for v in ("dense", "dgc", "powersgd")}
    served = launch(ps_train, 3, args=(run, ps, faults, False, "explore"), timeout_s=timeout_s,
                    backend="gloo")  # CPU tensors: gloo even where there are GPUs
    out[f"parameter server (s={ps.staleness})"] = [(served[1]["losses"][i] + served[2]["losses"][i]) / 2 for i in steps]
    return out


def collectives_check(rank: int, world: int, n: int) -> dict:
    """labkit.distributed.comms' collectives on known values, on this rank's device (its CUDA device under NCCL,
    the CPU under gloo): {"device", "backend", "ok": {collective: equal to the expected values}}."""
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    f32 = dict(dtype=torch.float32, device=device)
    ok = {}
    shard = torch.arange(n, **f32) + 100 * rank
    full = torch.empty(n * world, **f32)
    comms.all_gather(full, shard)
    ok["all_gather"] = torch.equal(full.cpu(), torch.cat([torch.arange(n) + 100.0 * r for r in range(world)]))
    out = torch.empty(n, **f32)
    comms.reduce_scatter(out, torch.arange(n * world, **f32) * (rank + 1))
    scale = world * (world + 1) / 2  # sum over ranks of (rank + 1)
    ok["reduce_scatter"] = torch.equal(out.cpu(), torch.arange(rank * n, (rank + 1) * n, dtype=torch.float32) * scale)
    b = torch.full((3,), float(rank), **f32)
    comms.broadcast(b, src=world - 1)
    ok["broadcast"] = torch.equal(b.cpu(), torch.full((3,), float(world - 1)))
    m = torch.tensor([float(rank)], **f32)
    comms.all_reduce(m, op="avg")
    ok["all_reduce_avg"] = abs(m.item() - (world - 1) / 2) < 1e-6
    return {"device": str(device), "backend": backend, "world": world, "ok": ok}
