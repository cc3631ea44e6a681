"""Child processes that start in a tenth of a second: the `forkserver` start method with torch preloaded.

Every rank of `launch` and every simulated-rank child (`simulate`, `labkit.run.fsdp2`) is a fresh Python
process. Under `spawn` each one imports torch anew: about 2 s on a laptop CPU, more on a busy one, and a
lesson or a test suite starts hundreds of them. Under `forkserver` one server process imports torch once
(the first child pays that); each child is then a fork of it, ready in ~0.1 s.

What the child sees is what `spawn` would give it:
- the parent's current `sys.path`, working directory and `__main__`: multiprocessing sends them with each
  child under both methods; the function to run is imported by module and name;
- the parent's current environment: the server's is from when it started, so the parent sends its own
  (`child_env`) with the work pickled as bytes (`pack`), and the child sets it (`apply_env`) before it
  unpickles, that is before it imports the caller's modules (which may read the environment);
- what is read when an interpreter or torch starts (PYTHONWARNINGS, ATEN_CPU_CAPABILITY, OMP_*, ...) and
  where stdout and stderr go are the server's: when either differs from what the server started with
  (a test that sets PYTHONWARNINGS or captures stderr by file descriptor), that child is spawned instead.

`LABKIT_START_METHOD=spawn` asks for spawn always; where `forkserver` does not exist (Windows), spawn.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
from typing import Any, Callable

__all__ = ["context", "child_env", "apply_env", "pack", "unpack", "run_child"]

# what the server imports once, for every child: torch, and the memory tracker and fake process group the
# simulated ranks use (1.3 s of imports of their own: torch.distributed._tools pulls in inductor)
PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed._tools.fsdp2_mem_tracker",
           "torch.testing._internal.distributed.fake_pg"]
# environment variables read when Python or torch starts: a child forked from a server that started with
# other values would not behave as a spawned one
STARTUP_VARS = ("PYTHON", "ATEN_", "OMP_", "MKL_", "KMP_", "TORCH_", "PYTORCH_", "LD_")
_server_started_with = None  # _startup() when this process first used the forkserver


def _fd_identity(fd: int):
    try:
        st = os.fstat(fd)
        return st.st_dev, st.st_ino
    except OSError:
        return None


def _startup() -> tuple:
    """What a forked child inherits from the server that a spawned one takes from the parent now."""
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(STARTUP_VARS)))
    return env, _fd_identity(1), _fd_identity(2)


def context():
    """The multiprocessing context for the next child: forkserver (torch preloaded), or spawn where the
    forkserver's start-up state is not this process's now, where it does not exist, or when asked."""
    global _server_started_with
    method = os.environ.get("LABKIT_START_METHOD", "forkserver")
    if method not in mp.get_all_start_methods():
        method = "spawn"
    if method == "forkserver":
        now = _startup()
        if _server_started_with is None:
            _server_started_with = now
            mp.get_context("forkserver").set_forkserver_preload(PRELOAD)  # read when the server starts
        elif now != _server_started_with:
            method = "spawn"
    return mp.get_context(method)


def child_env() -> dict:
    """The parent's environment now, for `apply_env` in the child (the forkserver's is from its start)."""
    return dict(os.environ)


def apply_env(env: dict) -> None:
    """Make the child's environment the parent's `env` (variables the parent removed are removed too)."""
    for k in [k for k in os.environ if k not in env]:
        del os.environ[k]
    os.environ.update(env)


def pack(obj) -> bytes:
    """`obj` pickled by the parent, unpickled by the child once `apply_env` has run (`unpack`)."""
    return pickle.dumps(obj)


def unpack(env: dict, payload: bytes):
    apply_env(env)
    return pickle.loads(payload)


def _child(env: dict, payload: bytes, out) -> None:
    try:
        target, args = unpack(env, payload)
        out.put(("ok", target(*args)))
    except BaseException as e:  # report it: the parent raises it
        out.put(("error", f"{type(e).__name__}: {e}"))


def run_child(target: Callable, args: tuple, timeout_s: float, what: str) -> Any:
    """`target(*args)` in one child process (a module-level function; its result must pickle); its result,
    or a RuntimeError naming `what` with the child's error, its exit, or the timeout. No process outlives it."""
    ctx = context()
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(child_env(), pack((target, tuple(args))), q), daemon=True)
    p.start()
    try:
        kind, value = _result(q, p, timeout_s)
    finally:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()
    if kind != "ok":
        raise RuntimeError(f"{what}: {value}")
    return value


def _result(q, p, timeout_s: float):
    """The child's ("ok" | "error", value), or an error at once if it died without one (an import of the
    caller's __main__ failing, a crash) instead of waiting out the whole timeout."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            return q.get(timeout=1)
        except queue.Empty:
            if not p.is_alive():
                try:
                    return q.get(timeout=1)
                except queue.Empty:
                    return "error", f"the child process exited (code {p.exitcode}) without a result"
    return "error", f"no result within {timeout_s} s"
