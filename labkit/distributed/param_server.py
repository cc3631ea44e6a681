"""A parameter server from scratch: one server rank holds the parameters and the optimizer state; worker ranks
pull parameters, compute gradients on their rows and push them back (Li et al., "Scaling Distributed Machine
Learning with the Parameter Server", OSDI 2014). Workers keep no optimizer state.

Two modes:

- synchronous: the server waits for every worker's gradient of step t, averages them (summed in worker order,
  then divided), steps once and sends the new parameters to all. With SGD this is data parallelism with an
  all-reduce ("mirrored"), bit for bit on 2 workers.
- asynchronous with a staleness bound s (bounded delay, "stale synchronous parallel": Ho et al., NIPS 2013;
  Li et al. 2014): the server applies each gradient as it arrives (scaled by 1/W), and answers a worker's pull
  only while that worker is at most s steps ahead of the slowest live worker. s = 0 is synchronous SGD up to
  rounding: everyone computes on the same parameters.

Staleness is counted in steps, the same way in both modes: a gradient of step i computed on parameters in which
the first c steps are complete (every live worker's gradient of those steps applied) is i - c steps stale. Sync
and async s = 0 give 0 for every gradient; async s gives at most s (the server's pull rule is that bound).

Messages are flat fp32 tensors sent with `comms.send` and received with `comms.recv` (counted by definition);
a worker posts "I am sending" on the process group's key-value store first, so the server only ever receives
what is on its way:
worker -> server  [kind, step, steps complete in the parameters it used, gradient...]   kind 1 gradient, 0 done
server -> worker  [steps complete in these parameters, parameters...]

Failure: a worker that posts nothing for `worker_timeout_s` while the server waits on it is dead.
Asynchronous: the server drops it, logs it and goes on with the others.
Synchronous: a step needs every worker, so the server stops with one clear error. Nothing waits forever.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.memory.state import TORCH_STATES

from . import comms

__all__ = ["PSConfig", "ServerReport", "serve", "work", "flat_params", "load_flat", "check_staleness",
           "server_state_bytes", "ps_wire_bytes"]

GRAD, DONE = 1.0, 0.0
HEADER = 3  # kind, step, steps complete in the parameters used
OPTIMIZERS = {k: TORCH_STATES[k] for k in ("sgd", "sgd-momentum", "adamw")}  # fp32 state buffers per parameter


def check_staleness(s) -> int:
    if isinstance(s, bool) or not isinstance(s, int) or s < 0:
        raise ValueError(f"staleness must be an integer >= 0 (steps a worker may run ahead), got {s!r}")
    return s


@dataclass(frozen=True)
class PSConfig:
    mode: str = "sync"             # "sync": average every worker's gradient each step; "async": apply as they come
    staleness: int = 0             # async: a worker may be at most this many steps ahead of the slowest live one
    worker_timeout_s: float = 10.0  # a worker silent this long while awaited is dead (dropped, or an error in sync)
    optimizer: str = "sgd"         # what the server steps (comm_ranks.ps_train builds it): one of OPTIMIZERS

    def __post_init__(self):
        if self.mode not in ("sync", "async"):
            raise ValueError(f"mode must be 'sync' or 'async', got {self.mode!r}")
        check_staleness(self.staleness)
        if not self.worker_timeout_s > 0:
            raise ValueError(f"worker_timeout_s must be a positive number of seconds, got {self.worker_timeout_s!r}")
        _check_optimizer(self.optimizer)


def _check_optimizer(optimizer) -> str:
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    return optimizer


@dataclass
class ServerReport:
    """What the server saw: each applied gradient's staleness, the largest lead any worker got, the log."""

    version: int = 0                                     # optimizer updates: one per step (sync), per gradient (async)
    staleness: list[int] = field(default_factory=list)  # per gradient, in steps: its step - steps complete in its
                                                         # parameters (0 in sync and async s=0; at most s)
    max_lead: int = 0                                     # largest (worker's step - slowest live worker's step) served
    dropped: list[int] = field(default_factory=list)     # workers dropped as dead (async)
    log: list[str] = field(default_factory=list)


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@torch.no_grad()
def load_flat(model: nn.Module, flat: torch.Tensor) -> None:
    off = 0
    for p in model.parameters():
        p.copy_(flat[off:off + p.numel()].view_as(p))
        off += p.numel()


def server_state_bytes(n_params: int, optimizer: str = "sgd-momentum") -> int:
    """Optimizer state the server keeps: SGD with momentum one fp32 buffer per parameter, AdamW two, SGD none.
    Workers keep none."""
    return OPTIMIZERS[_check_optimizer(optimizer)] * n_params * 4


def ps_wire_bytes(n_params: int, workers: int, steps: int = 1) -> dict[str, float]:
    """Bytes sent by definition (fp32) in a run of `steps`: the server sends the parameters (plus a step count) to
    every worker once at the start and once per step; each worker pushes its gradient (plus a 3-value header)
    per step and one last message of the same size to say it is done. Per step: W x 4P from the server, 4P
    from each worker (plus headers)."""
    push, pull = (n_params + HEADER) * 4, (n_params + 1) * 4
    server, worker = (steps + 1) * workers * pull, (steps + 1) * push
    return {"server": server, "worker": worker, "total": server + workers * worker}


def _store(run: str):
    """The control plane: the process group's key-value store (every rank has it), under this run's prefix.
    A worker sets "push/<w>/<i>" before it sends its i-th message; the server polls these keys without
    blocking, so it never waits inside gloo on a worker that may be dead (a gloo receive that times out
    or fails closes the connection and takes the run down)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return dist.PrefixStore(f"labkit-ps/{run}/", _get_default_store())


def serve(model: nn.Module, optimizer: torch.optim.Optimizer, workers: list[int], cfg: PSConfig = PSConfig(),
          group=None, run: str = "0") -> ServerReport:
    """The server loop: send the parameters to every worker, then take gradients until every live worker is
    done. `group`: the gloo group for the data (see `comms.plain_group`); `run`: a name unique to this run on the
    store (the same on every rank)."""
    rep = ServerReport()
    store = _store(run)
    n = sum(p.numel() for p in model.parameters())
    W = len(workers)
    buf = torch.empty(n + HEADER)
    clock = {w: 0 for w in workers}      # gradients received from each worker
    sent = {w: 0 for w in workers}       # messages received from each worker
    alive, done, waiting = set(workers), set(), set()  # waiting: pushed, wants parameters
    grads: dict[int, torch.Tensor] = {}  # sync: this step's gradients
    last = {}

    def complete() -> int:  # steps whose gradients every live worker has had applied
        return min((clock[v] for v in alive), default=0)

    def message() -> torch.Tensor:
        return torch.cat([torch.tensor([float(complete())]), flat_params(model)])

    def dead(w: int, why: str) -> None:
        text = f"worker {w} died at step {clock[w]} ({why})"
        if cfg.mode == "sync":
            raise RuntimeError(f"parameter server (sync): {text}; a synchronous step needs every worker, stopping")
        alive.discard(w)
        waiting.discard(w)
        rep.dropped.append(w)
        rep.log.append(f"{text}: dropped, going on with {len(alive - done)} workers")

    def reply(w: int) -> None:
        comms.send(message(), dst=w, group=group, tag=f"parameters to worker {w}")
        last[w] = time.monotonic()

    @torch.no_grad()
    def apply(g: torch.Tensor) -> None:
        off = 0
        for p in model.parameters():
            p.grad = g[off:off + p.numel()].view_as(p).clone()
            off += p.numel()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        rep.version += 1

    for w in workers:
        reply(w)
    while alive - done:
        progressed = False
        for w in sorted(alive - done - waiting):
            if not store.check([f"push/{w}/{sent[w]}"]):
                if time.monotonic() - last[w] > cfg.worker_timeout_s:
                    dead(w, f"nothing received for {cfg.worker_timeout_s:g} s")
                continue
            comms.recv(buf, src=w, group=group, tag=f"from worker {w}")
            sent[w] += 1
            progressed = True
            last[w] = time.monotonic()
            if buf[0].item() == DONE:
                done.add(w)
                rep.log.append(f"worker {w} done after {clock[w]} steps")
                continue
            g = buf[HEADER:].clone()
            rep.staleness.append(int(buf[1].item()) - int(buf[2].item()))  # its step - steps complete it saw
            clock[w] += 1
            waiting.add(w)
            if cfg.mode == "sync":
                grads[w] = g
            else:
                apply(g.div_(W))
        if cfg.mode == "sync" and grads and len(grads) == len(alive - done):
            total = None
            for w in sorted(grads):  # worker order: the same sum as an all-reduce's a + b on 2 workers
                total = grads[w].clone() if total is None else total.add_(grads[w])
            apply(total.div_(W))
            grads.clear()
            for w in sorted(waiting):
                reply(w)
            waiting.clear()
        elif cfg.mode == "async":
            live = alive - done
            for w in sorted(waiting):
                slowest = min((clock[v] for v in live), default=clock[w])
                lead = clock[w] - slowest
                if lead <= cfg.staleness:
                    rep.max_lead = max(rep.max_lead, lead)
                    waiting.discard(w)
                    reply(w)
        if not progressed:
            time.sleep(0.002)  # poll without taking a core from the workers
    return rep


def work(model: nn.Module, steps: int, batches, server: int = 0, die_at: int | None = None, group=None,
         run: str = "0") -> list[float]:
    """A worker: pull the parameters, then per step compute the gradient of its rows `batches(step)` -> (x, y),
    push it, pull the new parameters. die_at: the process kills itself (SIGKILL) at that step, before pushing
    (a fault to test the server). Returns the losses."""
    n = sum(p.numel() for p in model.parameters())
    store, me, count = _store(run), dist.get_rank(), 0
    pull = torch.empty(n + 1)
    comms.recv(pull, src=server, group=group, tag="parameters")
    load_flat(model, pull[1:])
    complete = pull[0].item()  # steps complete in these parameters
    losses = []
    for step in range(steps):
        if die_at is not None and step == die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batches(step)
        loss = model(x, y)
        loss.backward()
        grads = [p.grad.reshape(-1) for p in model.parameters()]
        msg = torch.cat([torch.tensor([GRAD, float(step), complete]), *grads])
        model.zero_grad(set_to_none=True)
        store.set(f"push/{me}/{count}", "1")
        count += 1
        comms.send(msg, dst=server, group=group, tag="gradient")
        del msg, grads
        comms.recv(pull, src=server, group=group, tag="parameters")
        load_flat(model, pull[1:])
        complete = pull[0].item()
        losses.append(loss.item())
        del loss, x, y
    done = torch.zeros(n + HEADER)  # the size the server receives: [DONE, steps, steps complete, 0...]
    done[1], done[2] = float(steps), complete
    store.set(f"push/{me}/{count}", "1")
    comms.send(done, dst=server, group=group, tag="done")
    return losses
