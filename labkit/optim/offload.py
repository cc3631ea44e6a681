"""Optimizer offload: AdamW with fp32 master weights and moments in host RAM (ZeRO-Offload) or on disk (ZeRO-Infinity).

The device keeps only the (low-precision) weights it computes with. Each step the gradients go
device -> host, AdamW updates the fp32 master weights there, and the new weights go host -> device
(ZeRO-Offload: Ren et al. 2021, arXiv 2101.06840; ZeRO-Infinity: Rajbhandari et al. 2021, arXiv
2104.07857; DeepSpeed's `offload_optimizer` setting). Device bytes per parameter: 2 (bf16 weight)
+ 2 (bf16 gradient, until zero_grad) instead of 16 for mixed-precision AdamW; the host holds 12
(fp32 master, m, v), plus, on CUDA, 2 for a pinned staging copy in the weight's dtype.

- offload="cpu": host arrays in RAM. On CUDA they are pinned, the copies are non_blocking on a side
  stream, and each weight's host-to-device copy overlaps the CPU update of the next parameter.
- offload="disk": master, m and v are numpy memmaps in a fresh folder under `folder` (the lessons
  pass `labkit.paths.data_dir()`, the repository's data/); the OS pages them in as the step walks
  the parameters, so RAM holds about one parameter's worth. `close()` (or leaving a `with` block,
  or garbage collection) deletes the folder.

On a CPU-only machine the "device" and the host are the same memory. The host arrays are then made
by numpy, outside torch's dispatch, and every host operation writes in place into them or into two
scratch arrays (`out=` and `op_` forms), so the Ledger, which counts storages that torch ops create,
sees what a GPU would hold: no optimizer state and no step temporaries on the device. The host state
is therefore kept in `self.host`, not in `self.state` (which stays empty).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from .base import check_betas, check_number

OFFLOAD_TARGETS = ("cpu", "disk")
_STATES = ("master", "exp_avg", "exp_avg_sq")  # fp32 host arrays, one value per parameter element


# ---- the teaching version: copies made fresh every step --------------------------------------------------
@torch.no_grad()
def offload_adamw_step_naive(params, host: dict, step: int, lr: float = 1e-3, betas=(0.9, 0.999),
                             eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
    """One AdamW step with fp32 master weights and moments in `host` ({p: (master, m, v)}, CPU tensors).

    Gradients go to the host as new fp32 tensors, weights come back as new tensors: simple, and each
    copy is a fresh allocation (the real one reuses host buffers and overlaps the copies).
    """
    b1, b2 = betas
    for p in params:
        if p.grad is None:
            continue
        if p not in host:  # bytes on the host: 3 x 4 per element
            host[p] = (p.detach().to("cpu", torch.float32, copy=True), torch.zeros(p.shape), torch.zeros(p.shape))
        master, m, v = host[p]
        g = p.grad.to("cpu", torch.float32)  # device -> host
        master.mul_(1 - lr * weight_decay)
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = (v.sqrt() / (1 - b2**step) ** 0.5).add_(eps)
        master.addcdiv_(m, denom, value=-lr / (1 - b1**step))
        p.copy_(master.to(p.device, p.dtype))  # host -> device, rounded to the device dtype


# ---- the real one ------------------------------------------------------------------------------------------
@dataclass
class _Host:
    """One parameter's host side: fp32 master, m and v (flat), its step count, and a staging copy."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int = 0
    stage: torch.Tensor | None = None  # CUDA only: pinned, the weight's dtype, for both directions


class OffloadAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update (same arithmetic, same result for fp32 weights) on host-held state.

    offload: "cpu" (host RAM) or "disk" (memmaps under `folder`, an existing directory).
    Weights may be bf16/fp16 on the device: the fp32 master copy is made from them at construction,
    and each step writes back its rounding. State lives in `self.host` ({param: _Host}).
    Host scratch: two fp32 arrays the size of the largest parameter (its gradient and the denominator).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, offload: str = "cpu", folder: str | os.PathLike | None = None):
        if offload not in OFFLOAD_TARGETS:
            raise ValueError(f"offload must be one of {', '.join(map(repr, OFFLOAD_TARGETS))}, got {offload!r}")
        if offload == "disk" and (folder is None or not os.path.isdir(folder)):
            raise ValueError(f"folder must be an existing directory for offload='disk', got {folder!r}")
        if offload == "cpu" and folder is not None:
            raise ValueError(f"folder is only used with offload='disk', got folder={folder!r} with offload='cpu'")
        defaults = dict(lr=check_number("lr", lr), betas=check_betas(betas), eps=check_number("eps", eps),
                        weight_decay=check_number("weight_decay", weight_decay))
        super().__init__(params, defaults)
        self.offload, self.closed = offload, False
        plist = [p for g in self.param_groups for p in g["params"]]
        self._cuda = any(p.device.type == "cuda" for p in plist)
        total, biggest = sum(p.numel() for p in plist), max((p.numel() for p in plist), default=0)
        self.folder = tempfile.mkdtemp(prefix="labkit-offload-", dir=folder) if offload == "disk" else None
        self._finalizer = weakref.finalize(self, _remove, self.folder)
        flat = {k: self._host_array(k, total) for k in _STATES}
        self._grad32, self._denom = self._host_array(None, biggest), self._host_array(None, biggest)
        self.host: dict[torch.Tensor, _Host] = {}
        offset = 0
        with torch.no_grad():
            for p in plist:
                n = p.numel()
                h = _Host(*(flat[k][offset:offset + n] for k in _STATES))
                h.master.view(p.shape).copy_(p)  # device -> host, upcast to fp32 (m and v start at 0)
                if self._cuda:
                    h.stage = torch.empty(n, dtype=p.dtype, pin_memory=True)
                self.host[p] = h
                offset += n
        self._stream = torch.cuda.Stream() if self._cuda else None

    def _host_array(self, name: str | None, n: int) -> torch.Tensor:
        """n fp32 values outside the device: a memmap file (disk), pinned CPU memory (CUDA) or numpy memory."""
        if name is not None and self.offload == "disk":
            mm = np.memmap(os.path.join(self.folder, f"{name}.f32"), dtype=np.float32, mode="w+", shape=(max(n, 1),))
            return torch.from_numpy(mm)[:n]
        if self._cuda:
            return torch.empty(n, dtype=torch.float32, pin_memory=True)
        return torch.from_numpy(np.zeros(n, dtype=np.float32))

    # ---- the step ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        if self.closed:
            raise RuntimeError("OffloadAdamW: step() after close()")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        items = [(p, self.host[p], g) for g in self.param_groups for p in g["params"] if p.grad is not None]
        if self._cuda:  # every gradient device -> host at once, on the side stream
            side = self._stream
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for p, h, _ in items:
                    h.stage.view(p.shape).copy_(p.grad, non_blocking=True)
            side.synchronize()
        for p, h, group in items:
            n = p.numel()
            g32 = self._grad32[:n]
            g32.view(p.shape).copy_(h.stage.view(p.shape) if self._cuda else p.grad)  # upcast on the host
            h.step += 1
            self._adamw(h, g32, self._denom[:n], group)
            if self._cuda:  # host -> device, overlapping the next parameter's update
                h.stage.copy_(h.master)
                with torch.cuda.stream(self._stream):
                    p.copy_(h.stage.view(p.shape), non_blocking=True)
            else:
                p.copy_(h.master.view(p.shape))  # rounded to the device dtype, in place
        if self._cuda:
            torch.cuda.current_stream().wait_stream(self._stream)  # the next forward sees the new weights
        return loss

    @staticmethod
    def _adamw(h: _Host, g: torch.Tensor, denom: torch.Tensor, group: dict) -> None:
        """torch.optim.AdamW's single-tensor update, with every result written into an existing host array."""
        (b1, b2), lr, t = group["betas"], group["lr"], h.step
        h.master.mul_(1 - lr * group["weight_decay"])
        h.exp_avg.lerp_(g, 1 - b1)
        h.exp_avg_sq.mul_(b2).addcmul_(g, g, value=1 - b2)
        torch.sqrt(h.exp_avg_sq, out=denom)
        denom.div_((1 - b2**t) ** 0.5).add_(group["eps"])
        h.master.addcdiv_(h.exp_avg, denom, value=-lr / (1 - b1**t))

    # ---- saving, resuming, closing ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """{"state": {index: {"step", "master", "exp_avg", "exp_avg_sq"}}, "param_groups": [...]}: tensors and
        numbers only, so `torch.load(weights_only=True)` reads it. The arrays are copied into RAM."""
        state, groups, i = {}, [], 0
        for g in self.param_groups:
            ids = []
            for p in g["params"]:
                h = self.host[p]
                if h.step:
                    state[i] = {"step": h.step, **{k: getattr(h, k).view(p.shape).clone() for k in _STATES}}
                ids.append(i)
                i += 1
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ids})
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Copy saved state into the host arrays and the saved master weights (rounded) onto the device."""
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("state_dict: its param_groups do not match this optimizer's")
        index = 0
        for saved, group in zip(groups, self.param_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
            for p in group["params"]:
                h, s = self.host[p], state_dict["state"].get(index)
                if s is None:
                    h.step = 0
                    h.exp_avg.zero_()
                    h.exp_avg_sq.zero_()
                    h.master.view(p.shape).copy_(p)
                else:
                    h.step = int(s["step"])
                    for k in _STATES:
                        getattr(h, k).view(p.shape).copy_(s[k])
                    p.copy_(h.master.view(p.shape))
                index += 1

    def close(self) -> None:
        """Drop the host arrays and, for offload='disk', delete the folder with the memmaps."""
        self.host.clear()
        self._grad32 = self._denom = None
        self.closed = True
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _remove(folder: str | None) -> None:
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
