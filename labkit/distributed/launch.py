"""Run one rank function on N processes that talk through torch.distributed, from a notebook or a test.

    results = launch(my_module.rank_fn, world_size=2, args=(x,), timeout_s=60)
    # rank_fn(rank, world_size, *args) runs in each process after init_process_group; results[r] is
    # what rank r returned (it must pickle).

What it takes care of, and why:
- a free port from the OS (bind to port 0), so two runs never collide on a hard-coded MASTER_PORT;
- one intra-op thread per rank (`torch.set_num_threads(1)`): N ranks x all cores oversubscribe a CPU;
- `TORCH_DISTRIBUTED_DEBUG=DETAIL` in the children, so a mismatched collective raises a readable
  "Detected mismatch between collectives on ranks" instead of an abort with no traceback;
- a timeout on the process group (gloo's default is 30 minutes) and on the whole run;
- failure: the first rank that raises or dies ends the run; the others are terminated (they would
  otherwise wait in a collective for the timeout) and the caller gets one `RankFailed` naming the
  rank and its message. No process outlives `launch`.
- children import the rank function by module and name (as under `spawn`), so it must live in a .py
  module; a function defined in a notebook cell is refused up front with where to put it. They start
  from a forkserver with torch imported once (labkit.distributed.procs): ~0.1 s a rank, not ~2 s.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_mod
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, NoReturn, Sequence

from .procs import child_env, context, pack, unpack

__all__ = ["RankFailed", "launch", "free_port", "default_backend"]


STARTUP_S = 120  # seconds for every child to import torch and join the process group (slow on a busy CPU)


class RankFailed(RuntimeError):
    """A rank raised, died or timed out; `.rank` is the first one that failed and `.detail` its message."""

    def __init__(self, rank: int | None, detail: str, traceback_text: str = ""):
        self.rank, self.detail, self.traceback_text = rank, detail, traceback_text
        self.others: list[RankFailed] = []  # what the other ranks reported (often a consequence)
        who = "a rank" if rank is None else f"rank {rank}"
        super().__init__(f"{who} failed: {detail}")


def free_port() -> int:
    """A TCP port the OS says is free now (bind to port 0 and read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend(world_size: int) -> str:
    """NCCL when every rank can have its own CUDA device, else gloo (CPU)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def _check_importable(fn: Callable) -> None:
    """Spawned children import `fn` by module and qualified name; refuse what they could not find."""
    if not callable(fn):
        raise TypeError(f"launch: fn must be a function, got {type(fn).__name__}")
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", getattr(fn, "__name__", ""))
    where = ("define it at the top level of a .py module (for example write the cell with %%writefile "
             "ranks.py, then `from ranks import fn`) and pass that: spawned processes cannot import "
             "functions defined in a notebook cell or inside another function")
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise ValueError(f"launch: {qualname!r} is a lambda or a nested function; {where}")
    main = sys.modules.get("__main__")
    if module == "__main__" and not getattr(main, "__file__", None):
        raise ValueError(f"launch: {qualname!r} was defined in this notebook or interactive session; {where}")
    try:
        pickle.dumps(fn)
    except Exception as e:  # e.g. a callable object holding a lock
        raise ValueError(f"launch: {qualname!r} cannot be sent to a child process ({e}); {where}") from None


@dataclass(frozen=True)
class _Spec:
    fn: Callable
    args: tuple
    world_size: int
    port: int
    backend: str
    timeout_s: float
    threads: int
    env: dict


def _fail(rank: int, e: BaseException, out: Any) -> NoReturn:
    """Report an error at once (before any teardown that could wait on peers) and leave."""
    out.put(("error", rank, f"{type(e).__name__}: {e}", traceback.format_exc()))
    out.close()
    out.join_thread()
    os._exit(1)


def _child(rank: int, env: dict, payload: bytes, out: Any) -> None:
    """Body of one rank: set the environment, join the group, run fn, report, leave the group."""
    try:
        spec = unpack(env, payload)  # the parent's environment first, then the import of fn's module
    except BaseException as e:
        _fail(rank, e, out)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(spec.port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(spec.world_size),
                       "TORCH_DISTRIBUTED_DEBUG": "DETAIL", "OMP_NUM_THREADS": str(spec.threads),
                       "LABKIT_PG_TIMEOUT_S": str(spec.timeout_s)})  # for the subgroups (comms.new_group)
    os.environ.update(spec.env)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(spec.threads)
        # torch.distributed reads TORCH_DISTRIBUTED_DEBUG when it is imported, which unpickling `fn` may
        # already have done in this child: read it again now that it is set.
        dist.set_debug_level_from_env()
        if spec.backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(spec.backend, rank=rank, world_size=spec.world_size,
                                timeout=timedelta(seconds=spec.timeout_s))
        out.put(("up", rank))
        result = spec.fn(rank, spec.world_size, *spec.args)
        payload = pickle.dumps(result)  # plain pickle: tensors travel by value, not via shared memory
        out.put(("ok", rank, payload))
        dist.destroy_process_group()
    except BaseException as e:  # anything, at once
        _fail(rank, e, out)


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code} without reporting a result"


def launch(fn: Callable, world_size: int = 2, args: Sequence = (), *, timeout_s: float = 60,
           backend: str | None = None, threads: int = 1, env: dict | None = None, may_fail: Sequence[int] = ()) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` processes; return each rank's result, in rank order.

    timeout_s bounds both every collective (the process group's timeout) and the whole run; on the first
    failure the other ranks are terminated and `RankFailed` names the rank. `backend` defaults to NCCL
    with one GPU per rank, else gloo. `env` adds environment variables to the children. `may_fail`: ranks whose
    failure does not end the run (a fault-tolerance test: a worker that dies); their result is the RankFailed."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"launch: world_size must be an integer >= 1, got {world_size!r}")
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"launch: timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if not (isinstance(threads, int) and threads >= 1):
        raise ValueError(f"launch: threads must be an integer >= 1, got {threads!r}")
    backend = backend or default_backend(world_size)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"launch: backend must be 'gloo' or 'nccl', got {backend!r}")
    _check_importable(fn)
    spec = _Spec(fn, tuple(args), world_size, free_port(), backend, float(timeout_s), threads,
                 {str(k): str(v) for k, v in (env or {}).items()})
    ctx = context()
    out = ctx.Queue()
    env, payload = child_env(), pack(spec)
    procs = [ctx.Process(target=_child, args=(r, env, payload, out), name=f"labkit-rank{r}", daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    # Start-up (importing torch, joining the group) is not the user's timeout: the clock starts when every
    # rank is up, within STARTUP_S.
    deadline = time.monotonic() + STARTUP_S + timeout_s
    results: dict[int, Any] = {}
    failures: list[RankFailed] = []
    up: set[int] = set()
    try:
        while len(results) < world_size and not failures:
            was_up = len(up) == world_size
            _collect(out, procs, results, failures, wait=0.1, up=up)
            for f in [f for f in failures if f.rank in may_fail]:
                failures.remove(f)
                results[f.rank] = f
                up.add(f.rank)
            if not was_up and len(up) == world_size:
                deadline = time.monotonic() + timeout_s
            if not failures and time.monotonic() > deadline:
                waiting = [r for r in range(world_size) if r not in results]
                failures.append(RankFailed(waiting[0] if waiting else None,
                                           f"timed out after {timeout_s:g} s; ranks {waiting} had not finished "
                                           f"(a collective that some rank never reached?)"))
        if failures:
            # The first report is often a peer's "connection reset" caused by the rank that really failed:
            # give the others a moment to report or be seen dead, then name the root cause.
            settle = time.monotonic() + 1.0
            while time.monotonic() < settle and len(results) + len(failures) < world_size:
                _collect(out, procs, results, failures, wait=0.1, up=up)
    finally:
        _stop(procs, graceful=not failures)
        out.close()
        out.cancel_join_thread()
    if failures:
        # the first report that is not a peer's symptom, else the first report
        root = next((f for f in failures if not _is_peer_symptom(f)), failures[0])
        root.others = [f for f in failures if f is not root]
        if root.traceback_text:
            print(f"--- traceback of rank {root.rank} ---\n{root.traceback_text}", file=sys.stderr)
        raise root
    return [results[r] for r in range(world_size)]


_PEER_SYMPTOMS = ("Connection reset by peer", "Connection closed by peer", "Timed out waiting",
                  "failed to pass monitoredBarrier", "timed out after")


def _is_peer_symptom(f: RankFailed) -> bool:
    """True for errors a rank sees because another rank vanished or stalled (not a root cause)."""
    return any(s in f.detail for s in _PEER_SYMPTOMS)


def _collect(out, procs: list, results: dict, failures: list, wait: float, up: set) -> None:
    """Take one report from the queue (or wait `wait` s), then notice ranks that exited without reporting."""
    try:
        msg = out.get(timeout=wait)
    except queue_mod.Empty:
        msg = None
    if msg is not None:
        _file(msg, results, failures, up)
        return
    reported = set(results) | {f.rank for f in failures}
    for r, p in enumerate(procs):
        if r not in reported and not p.is_alive():
            try:  # it may have reported just before exiting
                while not _file(out.get(timeout=1.0), results, failures, up):
                    pass
            except queue_mod.Empty:
                failures.append(RankFailed(r, _exit_text(p.exitcode)))
            return


def _file(msg: tuple, results: dict, failures: list, up: set) -> bool:
    """Record one rank's report ("up", "ok" with its result, or "error"): True unless it only said it is up."""
    if msg[0] == "up":
        up.add(msg[1])
        return False
    if msg[0] == "ok":
        results[msg[1]] = pickle.loads(msg[2])
    else:
        failures.append(RankFailed(msg[1], msg[2], msg[3]))
    return True


def _stop(procs: list, graceful: bool) -> None:
    """Let ranks that reported exit (graceful), terminate then kill the rest. Leaves no process behind."""
    if graceful:
        for p in procs:
            p.join(timeout=10)
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=3)
        if p.is_alive():
            p.kill()
            p.join(timeout=3)
