"""Activation offload: move what autograd saves for backward to host memory, and bring it back in backward.

Both versions are saved-tensor hooks (`torch.autograd.graph.saved_tensors_hooks`): pack runs when
autograd saves a tensor, unpack when backward needs it.

- `offload_naive` (teaching): pack copies each saved tensor to the host, unpack copies it back.
  Three views of one storage make three copies, and parameters are copied too.
- `offload_activations` (real): one host copy per storage (views are rebuilt on the way back, and a
  storage still alive on the device is not copied back at all), parameters and their views are left
  alone, tensors under `min_bytes` stay, and on CUDA the copies can use pinned memory and a side
  stream so they overlap with compute.

The host pool: on CUDA, (pinned) CPU tensors. On a CPU-only machine the device *is* the host, so the
pool keeps each copy outside torch as a numpy array: the Ledger, which counts torch storages, sees the
device memory drop exactly as a GPU would, and the copy back appears as a temporary in backward.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.autograd.graph import saved_tensors_hooks


# ---- the teaching version ---------------------------------------------------------------------------
def offload_naive(host: str = "cpu") -> saved_tensors_hooks:
    """Copy every saved tensor to `host` and back (no pinning, no streams, no deduplication).

    On a CPU-only machine the copy is another CPU tensor, so nothing is saved there (and the Ledger
    says so): `offload_activations` keeps its host copies outside torch instead.
    """
    def pack(t):
        return t.device, t.to(host, copy=True)  # bytes: all of t, again, on the host

    def unpack(packed):
        device, h = packed
        return h.to(device)

    return saved_tensors_hooks(pack, unpack)


# ---- the real one -----------------------------------------------------------------------------------
@dataclass
class _HostCopy:
    """One device storage's bytes in the host pool, and the way back."""

    nbytes: int
    data: object  # numpy array (CPU-only machines) or CPU tensor of uint8, pinned or not
    device: torch.device
    original: weakref.ref  # the device storage it came from, while it lives
    ready: object = None  # CUDA event recorded after the device-to-host copy (side stream)
    back: weakref.ref | None = None  # the storage it was copied back to, while it lives


@dataclass
class _Packed:
    """What autograd keeps instead of a saved tensor: its host copy and how to view it."""

    copy: _HostCopy
    dtype: torch.dtype
    shape: tuple
    stride: tuple
    offset: int


@dataclass
class OffloadStats:
    offloaded: int = 0  # bytes copied to the host (each storage once)
    kept: int = 0  # bytes of saved tensors left on the device (under min_bytes), counted per save
    parameters: int = 0  # saves of parameters (or their views) that were left alone
    copies_back: int = 0  # bytes copied back to the device in backward


class offload_activations(saved_tensors_hooks):
    """`with offload_activations(): loss = model(x, y)` then `loss.backward()` outside or inside.

    min_bytes: saved tensors whose storage is smaller stay on the device.
    pin_memory: page-locked host buffers (CUDA only): faster copies that can be asynchronous.
    use_stream: copy to the host on a side CUDA stream (CUDA only; needs pin_memory to overlap).
    """

    def __init__(self, min_bytes: int = 0, pin_memory: bool = False, use_stream: bool = False):
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"min_bytes must be a non-negative integer, got {min_bytes!r}")
        for name, on in (("pin_memory", pin_memory), ("use_stream", use_stream)):
            if on and not torch.cuda.is_available():
                raise ValueError(f"{name}=True needs CUDA (pinned host memory and streams are CUDA features); "
                                 f"this machine has none: use {name}=False")
        self.min_bytes, self.pin_memory = min_bytes, pin_memory
        self.stream = torch.cuda.Stream() if use_stream else None
        self.stats = OffloadStats()
        self._pool = weakref.WeakValueDictionary()  # id(device storage) -> _HostCopy, while autograd holds it
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        base = t._base if t._base is not None else t
        if isinstance(base, torch.nn.Parameter) or isinstance(t, torch.nn.Parameter):
            self.stats.parameters += 1
            return t  # a weight: it stays on the device anyway, copying it would only cost
        if t.layout != torch.strided or t.device.type == "meta":
            return t  # sparse or shapeless tensors: left where they are
        st = t.untyped_storage()
        if st.nbytes() < self.min_bytes:
            self.stats.kept += st.nbytes()
            return t
        host = self._pool.get(id(st))
        if host is None or host.original() is not st:  # first save of this storage
            host = self._to_host(t, st)
            self._pool[id(st)] = host
            self.stats.offloaded += host.nbytes
        return _Packed(host, t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())

    def _to_host(self, t: torch.Tensor, st) -> _HostCopy:
        raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st)  # (nbytes,) view of the storage
        if t.device.type != "cuda":  # CPU-only: the host pool lives outside torch
            return _HostCopy(st.nbytes(), raw.numpy().copy(), t.device, weakref.ref(st))
        host = torch.empty(st.nbytes(), dtype=torch.uint8, pin_memory=self.pin_memory)
        if self.stream is None:
            host.copy_(raw, non_blocking=self.pin_memory)
            return _HostCopy(st.nbytes(), host, t.device, weakref.ref(st))
        self.stream.wait_stream(torch.cuda.current_stream(t.device))  # t is computed before we copy it
        with torch.cuda.stream(self.stream):
            host.copy_(raw, non_blocking=self.pin_memory)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        raw.record_stream(self.stream)  # the allocator must not reuse t's memory before the copy ends
        return _HostCopy(st.nbytes(), host, t.device, weakref.ref(st), ready)

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        storage = self._on_device(packed.copy)
        out = torch.empty(0, dtype=packed.dtype, device=packed.copy.device)
        return out.set_(storage, packed.offset, packed.shape, packed.stride)

    def _on_device(self, host: _HostCopy):
        """The storage on the device: the original if still alive, a copy made earlier, or a new copy."""
        for ref in (host.original, host.back):
            st = ref() if ref is not None else None
            if st is not None:
                return st
        if host.device.type != "cuda":
            dev = torch.from_numpy(host.data).clone()  # bytes: the storage again, a temporary of backward
        else:
            if host.ready is not None:
                torch.cuda.current_stream(host.device).wait_event(host.ready)
            dev = torch.empty(host.nbytes, dtype=torch.uint8, device=host.device)
            dev.copy_(host.data, non_blocking=self.pin_memory)
        self.stats.copies_back += host.nbytes
        st = dev.untyped_storage()
        host.back = weakref.ref(st)
        return st
