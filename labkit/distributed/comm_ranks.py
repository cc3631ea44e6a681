"""Rank functions for lesson 11 (communication) that lessons and tests launch (`labkit.distributed.launch`):
dense data parallel, DGC (plain path or DDP hook), PowerSGD (PyTorch's DDP hook) and the parameter server, each
training labkit's GPT on this rank's rows of the same global batches, counting bytes per step by definition
(`comms.CommLog`) and, on request, the state it keeps with the per-rank ledger.

    launch(compare, 2, args=(cfg, steps, batch, seq, ["dense", "dgc", "powersgd"]))
    launch(ps_train, 3, args=(cfg, steps, batch, seq))          # rank 0 the server, ranks 1.. the workers
"""

from __future__ import annotations

import contextlib
import torch
import torch.distributed as dist

from . import comms
from .compression import DGC, DGCConfig

__all__ = ["VARIANTS", "LR", "batch_of", "dense_train", "dgc_train", "powersgd_train", "compare", "ps_train",
           "mirrored_train", "ps_suite", "ps_dies", "compression_suite",
           "plan_bytes", "explore", "collectives_check"]

LR = 0.05
MOMENTUM = 0.9
# the variants `compare` knows: dense all-reduce, DGC, DGC without each technique, PowerSGD
VARIANTS = ("dense", "dgc", "dgc-no-momentum-correction", "dgc-no-clipping", "dgc-no-masking", "dgc-no-warmup",
            "powersgd")
_WITHOUT = {"dgc-no-momentum-correction": "momentum_correction", "dgc-no-clipping": "clipping",
            "dgc-no-masking": "masking", "dgc-no-warmup": "warmup"}


def _model(cfg: dict, seed: int):
    from labkit.models.gpt import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(**cfg))


_TOKENS: dict[int, torch.Tensor] = {}


def batch_of(step: int, batch: int, seq: int, vocab: int, seed: int = 0, text_chars: int | None = None):
    """The step's global batch (B, S), the same on every rank: random windows of the Shakespeare corpus (its
    first `text_chars` characters, byte tokens) or, with text_chars None, random token ids."""
    if text_chars is None:
        from .dp_ranks import global_batch

        return global_batch(step, batch, seq, vocab, seed)
    from labkit.data import get_batch, load_tokens

    if text_chars not in _TOKENS:
        _TOKENS[text_chars] = load_tokens(max_chars=text_chars)[0]
    return get_batch(_TOKENS[text_chars], batch, seq, generator=torch.Generator().manual_seed(seed * 100003 + step))


def _rows(x: torch.Tensor, index: int, parts: int) -> torch.Tensor:
    b = x.shape[0] // parts
    return x[index * b:(index + 1) * b]


def _loop(rank, world, m, opt, steps, batch, seq, seed, text_chars, forward, sync, after=None, ledger_from=None):
    """The shared training loop: per step, this rank's rows, forward + backward, `sync()` (the communication),
    the optimizer step; the wire bytes per step from a CommLog. `ledger_from`: enter a Ledger at that step and
    return its measurement (the state that outlives the steps is what it still holds at the end)."""
    from labkit.memory import Ledger

    losses, wire = [], []
    stack = contextlib.ExitStack()
    led = None
    # this rank's rows of every step, made before any ledger starts (the corpus and the global batches are not
    # this rank's training memory); each step copies its rows inside, as a data loader would hand them over
    rows = [tuple(_rows(t, rank, world).clone() for t in batch_of(i, batch, seq, m.config.vocab_size, seed, text_chars))
            for i in range(steps)]
    with stack:
        for i in range(steps):
            if ledger_from is not None and i == ledger_from:
                led = stack.enter_context(Ledger(m, opt, label=f"rank {rank} of {world}"))
            x, y = (t.clone() for t in rows[i])
            with comms.CommLog() as log:
                loss = forward(x, y)
                loss.backward()
                sync()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if after is not None:
                after()
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


def dense_train(rank: int, world: int, cfg: dict, steps: int, batch: int, seq: int, seed: int = 0,
                text_chars: int | None = None, lr: float = LR) -> dict:
    """Data parallel with a dense all-reduce (mean) of every gradient, SGD with momentum."""
    m = _model(cfg, seed)
    opt = torch.optim.SGD(m.parameters(), lr=lr, momentum=MOMENTUM, foreach=False)

    def sync():
        for n, p in m.named_parameters():
            comms.all_reduce(p.grad, op="avg", tag=f"grad {n}")

    losses, wire, _ = _loop(rank, world, m, opt, steps, batch, seq, seed, text_chars, m, sync)
    return _result(m, losses, wire)


def dgc_train(rank: int, world: int, cfg: dict, steps: int, batch: int, seq: int, dgc: DGCConfig = DGCConfig(),
              path: str = "plain", seed: int = 0, text_chars: int | None = None, lr: float = LR,
              measure: bool = False) -> dict:
    """DGC, through `DGC.sync_gradients` (path "plain") or as a DDP comm hook (path "hook"); SGD with the
    momentum the config leaves to the optimizer. measure: the ledger from step 0 (plain path); the result's
    "final" is what it holds at the end, by category (DGC's buffers are temporaries made in backward)."""
    if path not in ("plain", "hook"):
        raise ValueError(f"path must be 'plain' or 'hook', got {path!r}")
    m = _model(cfg, seed)
    if path == "hook":
        from torch.nn.parallel import DistributedDataParallel as DDP

        group = comms.plain_group()
        state = DGC(m.named_parameters(), dgc, group=group)
        run = DDP(m, process_group=group)
        run.register_comm_hook(state, DGC.hook)

        def sync():
            pass
    else:
        state = DGC(m.named_parameters(), dgc)
        run, sync = m, state.sync_gradients
    opt = torch.optim.SGD(m.parameters(), lr=lr, momentum=dgc.sgd_momentum, foreach=False)
    losses, wire, meas = _loop(rank, world, m, opt, steps, batch, seq, seed, text_chars, run, sync,
                               after=state.next_step, ledger_from=0 if measure else None)
    return _result(m, losses, wire, meas, state_bytes=state.state_bytes(), sent=state.sent)


def powersgd_train(rank: int, world: int, cfg: dict, steps: int, batch: int, seq: int, matrix_rank: int = 1,
                   start_iter: int = 2, use_error_feedback: bool = True, warm_start: bool = True, seed: int = 0,
                   text_chars: int | None = None, lr: float = LR, bucket_mb: float = 25, measure: bool = False) -> dict:
    """PyTorch's PowerSGD DDP hook (the reference), SGD with momentum. Every all-reduce the hook issues is
    counted by definition (its payload's size) and completed before the hook goes on (no overlap: the numbers
    are the same); the shapes of each bucket's gradients are recorded (for the formula). measure: the ledger
    from step `start_iter` (after DDP rebuilt its buckets): what the hook keeps."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    m = _model(cfg, seed)
    group = comms.plain_group()
    run = DDP(m, process_group=group, bucket_cap_mb=bucket_mb)
    state = psgd.PowerSGDState(process_group=group, matrix_approximation_rank=matrix_rank,
                               start_powerSGD_iter=start_iter, use_error_feedback=use_error_feedback,
                               warm_start=warm_start, random_seed=seed)
    buckets: dict[int, list[tuple]] = {}

    def hook(s, bucket):
        buckets[bucket.index()] = [tuple(g.shape) for g in bucket.gradients()]
        return psgd.powerSGD_hook(s, bucket)

    run.register_comm_hook(state, hook)
    opt = torch.optim.SGD(m.parameters(), lr=lr, momentum=MOMENTUM, foreach=False)
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
        losses, wire, meas = _loop(rank, world, m, opt, steps, batch, seq, seed, text_chars, run, lambda: None,
                                   ledger_from=start_iter if measure else None)
    finally:
        dist.all_reduce = original
    kept = sum(t.numel() * t.element_size() for d in (state.error_dict, state.p_memory_dict, state.q_memory_dict)
               for t in d.values())
    return _result(m, losses, wire, meas, buckets=[buckets[i] for i in sorted(buckets)], state_bytes=kept)


def compare(rank: int, world: int, cfg: dict, steps: int, batch: int, seq: int, variants=VARIANTS,
            dgc: DGCConfig = DGCConfig(), powersgd_rank: int = 1, text_chars: int | None = None,
            lr: float = LR) -> dict:
    """Each variant in turn on the same ranks and batches: {variant: {"losses", "wire", ...}}. DGC variants
    "dgc-no-X" switch technique X off; PowerSGD starts compressing at step 2."""
    out = {}
    for v in variants:
        if v == "dense":
            out[v] = dense_train(rank, world, cfg, steps, batch, seq, text_chars=text_chars, lr=lr)
        elif v == "dgc":
            out[v] = dgc_train(rank, world, cfg, steps, batch, seq, dgc, text_chars=text_chars, lr=lr)
        elif v in _WITHOUT:
            out[v] = dgc_train(rank, world, cfg, steps, batch, seq, dgc.without(_WITHOUT[v]), text_chars=text_chars,
                               lr=lr)
        elif v == "powersgd":
            out[v] = powersgd_train(rank, world, cfg, steps, batch, seq, powersgd_rank, text_chars=text_chars, lr=lr)
        else:
            raise ValueError(f"unknown variant {v!r}: one of {', '.join(VARIANTS)}")
        out[v].pop("params")  # the curves and bytes travel back, not every variant's model
    return out


def compression_suite(rank: int, world: int, cfg: dict, steps: int, batch: int, seq: int, dgc: DGCConfig,
                      powersgd_rank: int = 2, variants=(), text_chars: int | None = None) -> dict:
    """What the tests and the lesson check in one launch: DGC on both paths (the plain one measured by the
    ledger), DGC without momentum correction (measured), PowerSGD (measured from its first compressed step),
    then `compare` over `variants`."""
    kw = dict(text_chars=text_chars)
    return {"plain": dgc_train(rank, world, cfg, steps, batch, seq, dgc, "plain", measure=True, **kw),
            "hook": dgc_train(rank, world, cfg, steps, batch, seq, dgc, "hook", **kw),
            "plain-no-mc": dgc_train(rank, world, cfg, steps, batch, seq, dgc.without("momentum_correction"),
                                     "plain", measure=True, **kw),
            "powersgd": powersgd_train(rank, world, cfg, steps, batch, seq, powersgd_rank, measure=True, **kw),
            "compare": (compare(rank, world, cfg, steps, batch, seq, variants, dgc, powersgd_rank, **kw)
                        if variants else {})}


# ---- the parameter server ----------------------------------------------------------------------------------
def ps_train(rank: int, world: int, cfg: dict, steps: int, batch: int, seq: int, ps=None, optimizer: str = "sgd",
             seed: int = 0, text_chars: int | None = None, lr: float = LR, delays=None, die=None,
             measure: bool = False, run: str = "0") -> dict:
    """Rank 0 serves (labkit.distributed.param_server.serve), ranks 1..world-1 work on their rows of each global
    batch. optimizer "sgd", "sgd-momentum" or "adamw" (on the server only). delays: {rank: seconds} a worker
    sleeps per step (a slow machine); die: {rank: step} a worker kills itself then. measure: each rank's ledger
    (the server's holds the parameters and optimizer state; a worker's no optimizer)."""
    import time

    from labkit.memory import Ledger

    from .param_server import PSConfig, serve, work

    ps = ps or PSConfig()
    group = comms.plain_group()
    workers = list(range(1, world))
    m = _model(cfg, seed)
    delays, die = delays or {}, die or {}
    if rank == 0:
        if optimizer == "adamw":
            opt = torch.optim.AdamW(m.parameters(), lr=lr, foreach=False)
        elif optimizer in ("sgd", "sgd-momentum"):
            opt = torch.optim.SGD(m.parameters(), lr=lr, momentum=MOMENTUM if optimizer == "sgd-momentum" else 0.0,
                                  foreach=False)
        else:
            raise ValueError(f"optimizer must be 'sgd', 'sgd-momentum' or 'adamw', got {optimizer!r}")
        with comms.CommLog() as log, (Ledger(m, opt, label="server") if measure else contextlib.nullcontext()) as led:
            rep = serve(m, opt, workers, ps, group=group, run=run)
        out = {"role": "server", "params": {n: p.detach().clone() for n, p in m.named_parameters()},
               "report": rep.__dict__, "wire": log.wire(), "n_params": sum(p.numel() for p in m.parameters())}
    else:
        i, W = rank - 1, len(workers)

        rows = [tuple(_rows(t, i, W).clone() for t in batch_of(s, batch, seq, m.config.vocab_size, seed, text_chars))
                for s in range(steps)]  # made before the ledger starts, as in `_loop`

        def batches(step):
            if rank in delays:
                time.sleep(delays[rank])
            return tuple(t.clone() for t in rows[step])

        ledger = Ledger(m, label=f"worker {rank}") if measure else contextlib.nullcontext()
        with comms.CommLog() as log, ledger as led:
            losses = work(m, steps, batches, die_at=die.get(rank), group=group, run=run)
        out = {"role": "worker", "losses": losses, "wire": log.wire()}
    if measure:
        meas = led.measurement()
        out["peak"], out["final"] = meas.peak.as_dict(), meas.final.as_dict()
    return out


def mirrored_train(rank: int, world: int, cfg: dict, steps: int, batch: int, seq: int, group_ranks: list[int],
                   seed: int = 0, text_chars: int | None = None, lr: float = LR) -> dict | None:
    """Synchronous data parallel ("mirrored") on the ranks of `group_ranks` with plain SGD: an all-reduce (mean)
    of each gradient. Every rank of the world must call it (it makes the group); the others return None."""
    group = comms.new_group(group_ranks)  # with the run's timeout
    if rank not in group_ranks:
        return None
    i, W = group_ranks.index(rank), len(group_ranks)
    m = _model(cfg, seed)
    opt = torch.optim.SGD(m.parameters(), lr=lr, foreach=False)
    losses = []
    for step in range(steps):
        x, y = batch_of(step, batch, seq, m.config.vocab_size, seed, text_chars)
        loss = m(_rows(x, i, W).clone(), _rows(y, i, W).clone())
        loss.backward()
        for n, p in m.named_parameters():
            comms.all_reduce(p.grad, op="avg", group=group, tag=f"grad {n}")
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"params": {n: p.detach().clone() for n, p in m.named_parameters()}, "losses": losses}


def ps_suite(rank: int, world: int, cfg: dict, steps: int, batch: int, seq: int, runs: dict, mirrored: bool = True,
             measure: bool = False, text_chars: int | None = None, delays=None, then_die=None) -> dict:
    """Several parameter-server runs {name: PSConfig or (PSConfig, optimizer)} one after the other on the same
    ranks (one launch), then the mirrored all-reduce on the workers: {name: ps_train's result, "mirrored": ...}.
    then_die: a last run with this PSConfig in which the last worker kills itself at step 1 (launch with
    may_fail=[world - 1]; that rank's whole result is then its RankFailed), under "dies"."""
    out = {}
    for name, ps in runs.items():
        ps, optimizer = ps if isinstance(ps, tuple) else (ps, "sgd")
        out[name] = ps_train(rank, world, cfg, steps, batch, seq, ps, optimizer, measure=measure,
                             text_chars=text_chars, delays=delays, run=name)
        dist.barrier()
    if mirrored:
        out["mirrored"] = mirrored_train(rank, world, cfg, steps, batch, seq, list(range(1, world)),
                                         text_chars=text_chars)
    if then_die is not None:
        out["dies"] = ps_dies(rank, world, cfg, steps, batch, seq, then_die, 1)
    return out


def ps_dies(rank: int, world: int, cfg: dict, steps: int, batch: int, seq: int, ps, at_step: int) -> dict:
    """`ps_train` in which the last worker kills itself (SIGKILL) at `at_step`: launch it with may_fail=[world-1]."""
    return ps_train(rank, world, cfg, steps, batch, seq, ps, die={world - 1: at_step}, run="dies")


# ---- what the lesson's panel asks: bytes per step by formula, loss curves from real ranks --------------------
def plan_bytes(cfg: dict, steps: int, world: int = 2, sparsity: float = 0.999, warmup_steps: int = 4,
               powersgd_rank: int = 1, start_powersgd: int = 2, ps_workers: int = 2) -> dict[str, list[float]]:
    """Bytes the busiest rank sends at each step, by each collective's definition, for labkit's GPT of `cfg`:
    dense all-reduce, DGC (with its warm-up), PowerSGD (vanilla all-reduce before `start_powersgd`) and the
    parameter server (its server sends the parameters to every worker). No process is started."""
    from .compression import check_rank, density_at, dense_wire_bytes, dgc_wire_bytes, powersgd_wire_bytes
    from .param_server import HEADER

    check_rank(powersgd_rank)
    m = _shapes_model(cfg)
    shapes = [tuple(p.shape) for p in m.parameters()]
    numels = [p.numel() for p in m.parameters()]
    n = sum(numels)
    dgc = DGCConfig(sparsity=sparsity, warmup_steps=warmup_steps)
    dense = dense_wire_bytes(n, world)
    psgd = powersgd_wire_bytes([shapes], powersgd_rank, world)  # linear in size: bucketing does not change it
    return {"dense": [dense] * steps,
            "dgc": [dgc_wire_bytes(numels, density_at(s, dgc), world) for s in range(steps)],
            "powersgd": [dense if s < start_powersgd else psgd for s in range(steps)],
            "parameter server": [float(ps_workers * (n + 1) * 4)] * steps,
            "worker push": [float((n + HEADER) * 4)] * steps}


def _shapes_model(cfg: dict):
    """The GPT on the meta device: shapes without memory."""
    from labkit.models.gpt import GPT, GPTConfig

    with torch.device("meta"):
        return GPT(GPTConfig(**cfg))


def explore(cfg: dict, steps: int, batch: int, seq: int, sparsity: float = 0.999, warmup_steps: int = 4,
            powersgd_rank: int = 1, staleness: int = 0, text_chars: int | None = None, slow_worker_s: float = 0.0,
            timeout_s: float = 300) -> dict[str, list[float]]:
    """Loss curves (the mean over ranks of each step's loss) of dense, DGC and PowerSGD on 2 ranks, and of the
    asynchronous parameter server with this staleness on a server and 2 workers (worker 2 slower by
    `slow_worker_s` a step). Two launches."""
    from .compression import check_rank, check_sparsity
    from .launch import launch
    from .param_server import check_staleness

    check_sparsity(sparsity)
    check_rank(powersgd_rank)
    check_staleness(staleness)
    dgc = DGCConfig(sparsity=sparsity, warmup_steps=warmup_steps)
    runs = launch(compare, 2, args=(cfg, steps, batch, seq, ("dense", "dgc", "powersgd"), dgc, powersgd_rank,
                                    text_chars), timeout_s=timeout_s, backend="gloo")
    out = {v: [sum(r[v]["losses"][i] for r in runs) / 2 for i in range(steps)] for v in ("dense", "dgc", "powersgd")}
    ps = launch(_ps_explore, 3, args=(cfg, steps, batch, seq, staleness, text_chars, slow_worker_s),
                timeout_s=timeout_s, backend="gloo")  # CPU tensors: gloo even where there are GPUs
    out[f"parameter server (s={staleness})"] = [(ps[1]["losses"][i] + ps[2]["losses"][i]) / 2 for i in range(steps)]
    return out


def _ps_explore(rank: int, world: int, cfg: dict, steps: int, batch: int, seq: int, staleness: int,
                text_chars: int | None, slow_worker_s: float) -> dict:
    from .param_server import PSConfig

    return ps_train(rank, world, cfg, steps, batch, seq, PSConfig("async", staleness), text_chars=text_chars,
                    delays={2: slow_worker_s} if slow_worker_s else None, run="explore")


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
