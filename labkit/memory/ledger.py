"""The ledger: count every tensor storage an op creates, by category and phase, until it is freed.

It is a `TorchDispatchMode`, so it sees every aten op on any device and counts logical bytes
(`storage.nbytes()`): the same figures on a CPU laptop and on a GPU. Tags are final, not first
guesses: a storage created in the forward pass and still alive when backward starts was saved for
backward (ACT); one that autograd accumulates into `.grad` is a gradient (GRAD) from its birth; one
the optimizer keeps in its state is optimizer state (OPT). Everything else is a temporary (TEMP).

Recompute (lesson 00's one definition, which labkit.estimate follows too): activations are what the forward
pass made and backward still holds, so a checkpointed segment's input (its boundary, kept by the checkpoint
from the forward) and selective checkpointing's cached outputs are ACT until they are freed, also while the
recompute and the segment's backward read them; every tensor a recompute makes during backward is TEMP,
the ones autograd saves for the segment's backward included (they live only while that segment is
recomputed and differentiated, as the backward's other working memory does). This holds for every style
(labkit.recompute's, torch.utils.checkpoint's, transformers' gradient checkpointing) with no knowledge of
the checkpoint: the rule is when a storage was made. (PyTorch's MemTracker counts a recompute's
allocations as activations instead; the total is the same.) A cast of a parameter (autocast's 16-bit
weight copy) is parameter memory wherever it is made, in a recompute too.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.optim.optimizer as _optim_hooks
from torch.utils._python_dispatch import TorchDispatchMode

from .memviz import Allocation, Trace
from .replay import replay
from .state import state_tensors
from .report import Breakdown, Category, Measurement
from .budget import SimulatedOutOfMemoryError, describe_breakdown
from .units import fmt_bytes

_CAST_OPS = {torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout}
_INSIDE: dict = {}  # custom op -> its Python body, run under the ledger so its inner allocations are counted


def count_inside(op, body) -> None:
    """A custom operator (torch.library.custom_op) is one op to a dispatch mode, whose body runs with the mode
    switched off: the ledger would see its outputs but not the scratch it makes and frees inside. Registered
    here, the ledger runs `body(*args, **kwargs)` (the op's implementation) with itself active instead, without
    grad and with the dispatch keys of a call from user code, so that composite ops (matmul) show the copies
    they make (a mode entered before the ledger then sees the body's ops, not the op: enter the ledger first,
    as measure_step does)."""
    _INSIDE[op] = body


@dataclass

class _Rec:
    nbytes: int
    tag: Category
    phase: str  # phase it was created in ("between": after an optimizer step, before the next forward)
    step: int
    op: str  # the aten op that created it ("" for tensors made outside the ledger)
    shape: tuple  # shape and dtype of the first tensor seen on it
    dtype: torch.dtype | None


class Ledger(TorchDispatchMode):
    """Count live bytes by category while the `with` block runs any number of training steps.

    model, optimizer: their parameters, buffers, gradients and state are tagged from the start.
    budget: bytes; a new allocation that would exceed it raises `SimulatedOutOfMemoryError`, unless a callback
        registered with `on_pressure` frees enough first (labkit.optim.paged evicts optimizer state pages).
    device: count storages on this device type only (default: the model's, else every device).
    """

    def __init__(self, model=None, optimizer=None, budget: int | None = None, label: str = "", device=None):
        super().__init__()
        if budget is not None and budget <= 0:
            raise ValueError(f"budget must be a positive number of bytes, got {budget!r}")
        self.model, self.optimizer, self.budget, self.label = model, optimizer, budget, label
        if device is None and model is not None:
            first = next(iter(model.parameters()), None)
            device = first.device if first is not None else None
        self.device_type = torch.device(device).type if device is not None else None
        self._recs: list[_Rec] = []  # sid -> record; tags may change until the end
        self._live: dict[int, int] = {}  # id(storage) -> sid, for live storages only
        self._events: list[tuple[int, int]] = []  # (sid, +bytes or -bytes)
        self._marks: list[tuple[int, str, int]] = []  # (event index, phase, step)
        self._live_bytes = 0
        self._phase, self._step, self._in_optimizer = "forward", 1, False
        self._stepped = False  # an optimizer stepped since the last forward began (inside backward, too)
        self._params: dict[int, torch.nn.Parameter] = {}
        self._handles: list = []
        self._allocator: dict[str, int] | None = None
        self._orig_resize = None
        self._pressure: list = []  # callbacks(bytes needed) that may free memory before an out-of-memory
        self._relieving = False

    def on_pressure(self, callback):
        """Call `callback(needed)` when an allocation would exceed the budget, before raising: it may free
        device storages (a pager evicts pages to the host). If the allocation then fits, it goes ahead.
        needed: bytes over the budget. Returns a handle whose `remove()` unregisters the callback."""
        if not callable(callback):
            raise ValueError(f"on_pressure needs a callable, got {callback!r}")
        self._pressure.append(callback)
        return _Handle(self._pressure, callback)

    # ---- entering and leaving -------------------------------------------------------------
    def __enter__(self):
        self._baseline_sids = set()
        self._track_module(self.model)
        self._track_optimizer(self.optimizer)
        self._baseline_sids = set(self._live.values())
        self._marks.append((len(self._events), "forward", 1))
        self._handles.append(_optim_hooks.register_optimizer_step_pre_hook(self._pre_step))
        self._handles.append(_optim_hooks.register_optimizer_step_post_hook(self._post_step))
        for p in self._params.values():  # frozen ones too: a layer unfrozen later (LISA) must be tagged
            if not p.dtype.is_floating_point and not p.dtype.is_complex:
                continue  # integer parameters (packed codes) never have gradients
            frozen = not p.requires_grad
            if frozen:
                p.requires_grad_(True)  # torch refuses a grad hook on a parameter that does not require grad
            try:
                handle = p.register_post_accumulate_grad_hook(self._on_grad)
                self._handles.append(handle)
                _run_first(p, handle)
            finally:
                if frozen:
                    p.requires_grad_(False)
        if self.model is not None:  # a step's forward starts when the model's forward does
            self._handles.append(self.model.register_forward_pre_hook(lambda *_: self._set_phase("forward")))
            # a transformers model's body, which a chunked output loss calls alone
            base = getattr(self.model, "base_model", None)
            if isinstance(base, torch.nn.Module) and base is not self.model:
                hook = base.register_forward_pre_hook(lambda *_: self._set_phase("forward"))
                self._handles.append(hook)
        if torch.cuda.is_available() and self.device_type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        self._patch_resize()
        out = super().__enter__()
        # the dispatch keys a call from user code sees, for the bodies of count_inside ops (see __torch_dispatch__)
        # less PythonTLSSnapshot, which would bring back the modes stacked above the ledger (a selective checkpoint),
        # and less ADInplaceOrView: the op's outputs keep the version counters a custom op gives them
        keys = torch._C.DispatchKey
        self._user_keys = (torch._C._dispatch_tls_local_include_set().remove(keys.PythonTLSSnapshot)
                           .remove(keys.ADInplaceOrView),
                           torch._C._dispatch_tls_local_exclude_set().add(keys.ADInplaceOrView))
        return out

    def __exit__(self, *exc):
        self._restore_resize()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._params.clear()  # hold no model tensors after the block: they must be free to go
        self.model = self.optimizer = None
        if torch.cuda.is_available() and self.device_type == "cuda":
            self._allocator = {
                "allocated": torch.cuda.memory_allocated(),
                "max_allocated": torch.cuda.max_memory_allocated(),
                "reserved": torch.cuda.memory_reserved(),
                "max_reserved": torch.cuda.max_memory_reserved(),
            }
        return super().__exit__(*exc)

    # ---- registering storages ---------------------------------------------------------------
    def _counts(self, t) -> bool:
        """Whether a tensor or storage is counted: not on meta, and on the ledger's device type if it has one."""
        return (isinstance(t, (torch.Tensor, torch.UntypedStorage)) and t.device.type != "meta"
                and (self.device_type is None or t.device.type == self.device_type))

    def _storage(self, t: torch.Tensor):
        try:
            return t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
            return None

    def _add(self, st, tag: Category, t: torch.Tensor | None = None, op: str = "") -> int:
        sid = len(self._recs)
        n = st.nbytes()
        shape, dtype = (tuple(t.shape), t.dtype) if t is not None else ((), None)
        # made after the optimizer step but before the next forward (the next batch): "between"
        phase = "between" if self._phase == "optimizer" and not self._in_optimizer else self._phase
        self._recs.append(_Rec(n, tag, phase, self._step, op, shape, dtype))
        self._live[id(st)] = sid
        self._events.append((sid, n))
        self._live_bytes += n
        weakref.finalize(st, _freed, weakref.ref(self), id(st), sid)  # no strong ref to the ledger
        return sid

    def _on_free(self, key: int, sid: int) -> None:
        if self._live.get(key) == sid:
            del self._live[key]
        n = self._recs[sid].nbytes
        self._events.append((sid, -n))
        self._live_bytes -= n

    def track(self, tensor: torch.Tensor, tag: Category) -> None:
        """Tag a tensor made outside the ledger (or retag one made inside it)."""
        if not self._counts(tensor):
            return
        st = self._storage(tensor)
        if st is None:
            return
        sid = self._live.get(id(st))
        if sid is None:
            self._add(st, tag, tensor)
        else:
            self._recs[sid].tag = tag

    def _track_module(self, model) -> None:
        if model is None:
            return
        for p in model.parameters():
            self._params[id(p)] = p
            self.track(p, Category.PARAM)
            if p.grad is not None:
                self.track(p.grad, Category.GRAD)
        for b in model.buffers():
            self.track(b, Category.BUFFER)

    def _track_optimizer(self, opt) -> None:
        if opt is None:
            return
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) not in self._params:
                    self._params[id(p)] = p
                    self.track(p, Category.PARAM)
                if p.grad is not None:
                    self.track(p.grad, Category.GRAD)
        for t in state_tensors(opt):
            self.track(t, Category.OPT)

    # ---- hooks ----------------------------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self.track(p.grad, Category.GRAD)

    def _pre_step(self, opt, args, kwargs) -> None:
        self._set_phase("optimizer")
        self._in_optimizer = True
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.track(p.grad, Category.GRAD)

    def _post_step(self, opt, args, kwargs) -> None:
        self._in_optimizer = False
        self._stepped = True
        for t in state_tensors(opt):
            self.track(t, Category.OPT)

    def _set_phase(self, phase: str) -> None:
        if phase == self._phase:
            return
        if phase == "forward" and (self._phase == "optimizer" or self._stepped):
            # a new step: after the optimizer's, or after a backward that stepped parameters (step in backward);
            # micro-batches (forward after a backward that stepped nothing) belong to the same step
            self._step += 1
            self._stepped = False
        elif phase == "forward":
            self._stepped = False
        elif phase == "backward" and self._phase == "forward":
            # Whatever the forward pass made and is still alive now is saved for backward. (A copy of the
            # live set: Python's garbage collector may free a storage, and so edit the set, mid-loop.)
            for sid in list(self._live.values()):
                if _made_by_forward(self._recs[sid]):
                    self._recs[sid].tag = Category.ACT
        self._phase = phase
        self._marks.append((len(self._events), phase, self._step))

    # ---- the dispatch mode ----------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._in_optimizer:
            self._set_phase("optimizer")
        elif torch._C._current_graph_task_id() != -1:
            self._set_phase("backward")
        elif self.model is None:
            self._set_phase("forward")  # no model hook to say when a forward starts
        # else: ops between phases (loss.item(), gradient clipping) keep the current phase
        body = _INSIDE.get(func)
        if body is None:
            out = func(*args, **kwargs)
        else:  # a mode is off while it handles an op: back on (TorchDispatchMode's own push) for the body
            TorchDispatchMode.__enter__(self)
            try:  # and the body's ops dispatched as from user code: below the op's kernel autograd is off, so a
                # composite op (matmul) would reach the ledger whole and hide the copies it makes inside
                with torch.no_grad(), torch._C._ForceDispatchKeyGuard(*self._user_keys):
                    out = body(*args, **kwargs)
            finally:
                TorchDispatchMode.__exit__(self, None, None, None)
        inputs = {}
        for t in _tensors((args, kwargs)):
            st = self._storage(t)
            if st is not None:
                inputs[id(st)] = t
        new = []
        for t in _tensors(out):
            if not self._counts(t):
                continue
            st = self._storage(t)
            if st is None:
                continue
            key = id(st)
            sid = self._live.get(key)
            if sid is not None:
                self._resized(sid, st)
            elif key not in inputs and all(s is not st for s, _ in new):
                new.append((st, t))
        if new:
            self._allocate(func, new, inputs)
        return out

    # ---- storages resized in place ------------------------------------------------------------
    def _patch_resize(self) -> None:
        """`UntypedStorage.resize_` reaches no dispatch mode: FSDP and ZeRO-3 free a parameter's memory with
        resize_(0) and re-grow it with resize_(n). Wrap it while the ledger runs (as PyTorch's MemTracker
        does), so live bytes follow the resize and a budget applies to the growth."""
        orig = torch.UntypedStorage.resize_
        ref = weakref.ref(self)

        def resize_(st, size):
            led = ref()
            if led is not None and led._counts(st):
                led._before_resize(st, int(size))
            out = orig(st, size)
            if led is not None and led._counts(st):
                led._after_resize(st)
            return out

        self._orig_resize = orig
        torch.UntypedStorage.resize_ = resize_

    def _restore_resize(self) -> None:
        if self._orig_resize is not None:
            torch.UntypedStorage.resize_ = self._orig_resize
            self._orig_resize = None

    def _before_resize(self, st, size: int) -> None:
        """A budget check for the growth, before the memory is taken (a device would fail here)."""
        sid = self._live.get(id(st))
        grow = size - (self._recs[sid].nbytes if sid is not None else st.nbytes())
        if self.budget is not None and grow > 0 and self._live_bytes + grow > self.budget:
            self._out_of_memory("UntypedStorage.resize_", grow)

    def _after_resize(self, st) -> None:
        sid = self._live.get(id(st))
        if sid is not None:
            self._resized(sid, st)
        elif st.nbytes():  # a storage made outside the ledger, grown inside it
            self._add(st, Category.TEMP, None, "resize_")

    def _resized(self, sid: int, st) -> None:
        n = st.nbytes()
        rec = self._recs[sid]
        if n != rec.nbytes:
            self._events.append((sid, n - rec.nbytes))
            self._live_bytes += n - rec.nbytes
            rec.nbytes = n

    def _allocate(self, func, new, inputs) -> None:
        requested = sum(st.nbytes() for st, _ in new)
        if self.budget is not None and self._live_bytes + requested > self.budget:
            self._out_of_memory(func, requested)
        # A cast of a parameter (autocast's 16-bit weight copy) counts as parameter memory.
        cast_of_param = func in _CAST_OPS and any(
            self._recs[self._live[k]].tag is Category.PARAM for k in inputs if k in self._live
        )
        name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        for st, t in new:
            self._add(st, Category.PARAM if cast_of_param else Category.TEMP, t, name)

    def _out_of_memory(self, what, requested: int) -> None:
        """Over the budget: let the pressure callbacks free memory; raise if the allocation still does not fit."""
        freed = 0
        if self._pressure and not self._relieving:
            before = self._live_bytes
            self._relieving = True
            try:
                for cb in list(self._pressure):
                    cb(self._live_bytes + requested - self.budget)
                    if self._live_bytes + requested <= self.budget:
                        return
            finally:
                self._relieving = False
            freed = before - self._live_bytes
        live = self.live(as_final=True)
        forward = (f"; activations are what this forward has made and still holds, saved for backward"
                   if self._phase == "forward" and live[Category.ACT] else "")
        raise SimulatedOutOfMemoryError(
            f"out of memory (simulated): {what} tried to allocate {fmt_bytes(requested)} in the "
            f"{self._phase} pass of step {self._step} with {fmt_bytes(live.total)} of the "
            f"{fmt_bytes(self.budget)} budget in use ({describe_breakdown(live)}{forward})"
            + (f"; the pressure callbacks freed {fmt_bytes(freed)}, not enough" if self._pressure else ""),
            requested, self.budget, live,
        )

    # ---- results ----------------------------------------------------------------------------------
    def live(self, as_final: bool = False) -> Breakdown:
        """Live bytes per category right now (tags as known so far). as_final: with the tags the timeline will
        show: during forward, what the forward made and still holds is counted as activations (ACT), the tag
        `_set_phase` gives it when backward starts, not as the temporaries it is tagged as until then."""
        retag = as_final and self._phase == "forward"
        b = Breakdown()
        for sid in list(self._live.values()):  # a copy: a storage freed mid-loop edits the set
            rec = self._recs[sid]
            b.bytes[Category.ACT if retag and _made_by_forward(rec) else rec.tag] += rec.nbytes
        return b

    def live_tensors(self, tag: Category | None = None) -> list[tuple[str, tuple, str, int, str]]:
        """Live storages, largest first: (op, shape, dtype, bytes, category), optionally one category."""
        rows = []
        for sid in list(self._live.values()):  # a copy: a storage freed mid-loop edits the set
            r = self._recs[sid]
            if tag is None or r.tag is Category(tag):
                rows.append((r.op or "(outside)", r.shape, str(r.dtype).replace("torch.", ""), r.nbytes, r.tag.name))
        return sorted(rows, key=lambda row: -row[3])

    @property
    def live_bytes(self) -> int:
        return self._live_bytes

    def measurement(self) -> Measurement:
        """Replay the events with final tags: the timeline, each phase's peak breakdown and what is live at the end."""
        m = replay(self._events, [r.tag for r in self._recs], self._marks, self._baseline_sids, self.label,
                   self._allocator)
        m.trace = Trace(list(self._events), [Allocation(r.tag, r.op, r.shape, str(r.dtype).replace("torch.", ""),
                                                        r.phase, r.step) for r in self._recs])
        return m


def _tensors(x) -> list:
    """The tensors in an op's arguments or outputs: nested tuples (return types too), lists and dicts of
    tensors, numbers, dtypes and None. torch.utils._pytree.tree_flatten gives the same tensors; this is
    called twice per op on the hot path, and pytree's generality was a third of a measured step's time."""
    if isinstance(x, torch.Tensor):
        return [x]
    out = []
    stack = [x]
    while stack:
        y = stack.pop()
        if isinstance(y, torch.Tensor):
            out.append(y)
        elif isinstance(y, (tuple, list)):
            stack.extend(reversed(y))
        elif isinstance(y, dict):
            stack.extend(reversed(list(y.values())))
    return out


def _made_by_forward(rec: _Rec) -> bool:
    """A temporary made in a forward (or before it, by the next batch): saved for backward if alive when it starts.
    Storages made in backward (a checkpoint's recompute among them) are never retagged: they stay TEMP."""
    return rec.tag is Category.TEMP and rec.phase in ("forward", "between")


class _Handle:
    def __init__(self, hooks: list, callback):
        self._hooks, self._callback = hooks, callback

    def remove(self) -> None:
        if self._callback in self._hooks:
            self._hooks.remove(self._callback)


def _freed(ledger_ref, key: int, sid: int) -> None:
    ledger = ledger_ref()
    if ledger is not None:
        ledger._on_free(key, sid)


def _run_first(p: torch.Tensor, handle) -> None:
    """Put the ledger's post-accumulate-grad hook before the hooks registered earlier (autograd runs them in the
    order of their dict): a gradient is GRAD from its birth even when an earlier hook frees it at once
    (labkit.distributed.Zero reduce-scatters a unit from its last gradient's hook and sets .grad to None;
    labkit.optim.StepInBackward steps and frees it), as the module's rule says."""
    hooks = getattr(p, "_post_accumulate_grad_hooks", None)
    if not hooks or next(iter(hooks)) == handle.id:
        return
    items = list(hooks.items())
    hooks.clear()
    hooks[handle.id] = dict(items)[handle.id]
    hooks.update((k, v) for k, v in items if k != handle.id)
