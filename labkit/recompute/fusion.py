"""Fusion with torch.compile: a compiled pointwise chain saves its input only and recomputes the rest.

Eager PyTorch saves what each op's backward needs: a chain of k pointwise ops keeps up to k tensors of
the input's size. torch.compile's partitioner (min-cut rematerialisation, used by inductor and by the
"aot_eager_decomp_partition" debug backend) sees the whole chain and saves only what is cheapest to
keep, usually the chain's input, recomputing the rest inside the backward kernel: what
`labkit.recompute.activations` does by hand, for any chain.

`try_compile` is opt-in on CPU (inductor compiles C++ and takes tens of seconds per graph there):
it compiles when asked to, or on CUDA, and otherwise, or on any failure, returns the module as it
was with a one-line reason.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from labkit.memory import Ledger

from .activations import gelu_tanh_naive


def _reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:200]


def compile_unavailable() -> str | None:
    """Why torch.compile cannot run here (one line), or None when it can be tried."""
    try:
        import torch._dynamo  # noqa: F401
    except Exception as e:  # e.g. a Python version dynamo does not support yet
        return f"torch._dynamo is unavailable ({_reason(e)})"
    return None


def try_compile(module, *, enable: bool | None = None, backend: str = "inductor", example: tuple | None = None,
                verbose: bool = True):
    """torch.compile(module, backend=backend) where it works, else module (with a printed reason).

    enable: None = compile on CUDA, or when LABKIT_COMPILE=1; True/False to decide.
    example: arguments for one trial call (forward and, if the output requires grad, backward), so a
        compilation failure shows here and not in the middle of training (compilation is lazy).
    """
    def fallback(why: str):
        if verbose:
            print(f"try_compile: running eagerly: {why}")
        return module

    if enable is None:
        on_cuda = any(p.is_cuda for p in getattr(module, "parameters", lambda: [])())
        enable = on_cuda or os.environ.get("LABKIT_COMPILE") == "1"
        if not enable:
            return fallback("compilation is opt-in on CPU (slow here): pass enable=True or set LABKIT_COMPILE=1")
    if not enable:
        return fallback("enable=False")
    why = compile_unavailable()
    if why:
        return fallback(why)
    try:
        compiled = torch.compile(module, backend=backend)
        if example is not None:
            out = compiled(*example)
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.sum().backward()
    except Exception as e:  # compilation is best effort: the eager module is always correct
        return fallback(f"torch.compile failed ({_reason(e)})")
    return compiled


# ---- measuring what a compiled chain saves --------------------------------------------------------
class CompileFriendlyLedger(Ledger):
    """A Ledger that lets torch.compile run under it (it only observes ops, so compiled code may run
    with it active; a plain TorchDispatchMode makes dynamo fall back to eager). It counts what the
    compiled graphs run through the dispatcher: everything with the aot_eager* backends; inductor's
    own kernels allocate their buffers outside it, hence `graph_saved_bytes` as well."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


def pointwise_chain(x: torch.Tensor) -> torch.Tensor:
    """NewGELU times a sigmoid gate, plus one: eight pointwise ops, all saving something in eager."""
    return gelu_tanh_naive(x) * torch.sigmoid(x) + 1.0


def graph_saved_bytes(root) -> int:
    """Bytes of distinct storages the autograd graph under `root` (a grad_fn) holds for backward."""
    seen, storages, stack = set(), {}, [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            if not (name.startswith("_saved_") or name == "saved_tensors"):
                continue
            try:
                value = getattr(node, name)
            except RuntimeError:  # already freed
                continue
            for t in value if isinstance(value, (tuple, list)) else [value]:
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    storages[id(st)] = st.nbytes()
        stack.extend(f for f, _ in node.next_functions)
    return sum(storages.values())


@dataclass
class FusionFigures:
    backend: str
    eager: int  # Ledger ACT saved by the eager chain, beyond its input
    compiled: int  # the same for the compiled chain (inductor: only what passes the dispatcher)
    eager_graph: int  # bytes the autograd graph holds (input included), eager
    compiled_graph: int  # the same, compiled
    input_bytes: int  # the chain's input


def compare_compiled(fn=pointwise_chain, shape=(64, 256), backend: str = "aot_eager_decomp_partition",
                     compiled=None) -> FusionFigures:
    """Saved bytes of fn eager vs torch.compile(fn, backend=backend), measured by the Ledger and by
    walking the autograd graph. Raises RuntimeError with the reason if compilation fails."""
    why = compile_unavailable()
    if why:
        raise RuntimeError(why)
    compiled = compiled or torch.compile(fn, backend=backend)
    x = torch.randn(shape, requires_grad=True)
    compiled(x.clone()).sum().backward()  # compile outside the Ledger (a warm-up)
    n = x.numel() * x.element_size()

    def measure(f):
        with CompileFriendlyLedger() as led:
            h = x.clone()  # (shape): the chain's input, made by a previous op
            loss = f(h).sum()
            graph = graph_saved_bytes(loss.grad_fn)
            del h
            loss.backward()
        return led.measurement().saved - n - 2 * loss.element_size(), graph  # loss and its seed gradient

    (e, eg), (c, cg) = measure(fn), measure(compiled)
    return FusionFigures(backend, e, c, eg, cg, n)
