"""Paged optimizers: optimizer state in fixed-size pages that leave the device under memory pressure.

QLoRA's third ingredient (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs",
arXiv 2305.14314, section 3): bitsandbytes' paged optimizers allocate their state in CUDA unified
memory (`cudaMallocManaged`); when the GPU runs short (a long batch's activations), the driver evicts
state pages to CPU RAM, and the optimizer step, which touches them, brings them back (bitsandbytes
prefetches each parameter's state before its update). A spike that would be an out-of-memory error
becomes a slower step instead.

labkit does the same by hand, so every byte can be watched:

- All parameters' state is one virtual array per state tensor name ("exp_avg", "exp_avg_sq"),
  fp32, parameters laid end to end, cut into pages of `page_size` bytes (any multiple of 4; default
  2 MiB, the CUDA driver's large page of unified memory: bitsandbytes makes one managed buffer per
  state tensor and leaves the paging to the driver). A page is allocated whole (the last one is
  padded), so the device holds a whole number of pages and evictions move whole pages.
- Pages are made at the first step (lazily, like torch.optim) and stay on the device while memory
  allows. A `Ledger` with a budget calls the pager's `relieve(needed)` (`attach(ledger)` registers it
  with `Ledger.on_pressure`) when an allocation would exceed the budget: the pager evicts least
  recently used pages to the host until the allocation fits. If every page is gone and it still does
  not fit, the ledger raises its usual out-of-memory error.
- The step walks the parameters; for each page a parameter overlaps it brings that page of every
  state back (a page fault, if it was evicted), evicting others if needed, and updates the
  overlapping elements. Updates are elementwise, so page by page gives the same numbers.
- The host: on CUDA, CPU tensors. On a CPU-only machine the device is the host, so evicted pages are
  numpy arrays outside torch (as labkit.recompute.offload does): the Ledger sees device memory drop
  exactly as a GPU would.

`PagedOptimizer` is the general part: a subclass names its per-element fp32 states and writes the
update of one segment (`PagedAdamW`, `PagedLion` are 20 lines each); `state_dict` and
`load_state_dict` save and resume plain per-parameter tensors wherever the pages are. `predict_paging`
says what the pager will move for a step whose unpaged peak is known.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from .base import check_betas, check_int, check_number, params_with_grads, run_closure

PAGE_SIZE = 2 * 2**20  # bytes: the CUDA driver's large page of unified memory, which bitsandbytes' state lives in
_ITEM = 4  # every paged state is fp32


@dataclass
class PagerStats:
    paged_out: int = 0  # bytes moved device -> host by evictions
    paged_in: int = 0  # bytes moved host -> device when the step touched an evicted page
    faults: int = 0  # touches of an evicted page (each brings one page back)
    evictions: int = 0  # pages evicted
    allocated: int = 0  # bytes of pages made on the device (first touch, zeros)


class Page:
    """One page of one state: `data` is its device tensor while resident, else None (the bytes are on the host)."""

    def __init__(self, name: str, index: int, numel: int):
        self.name, self.index, self.numel = name, index, numel
        self.data: torch.Tensor | None = None

    def __repr__(self) -> str:
        return f"Page({self.name!r}, {self.index}, {'device' if self.data is not None else 'host/new'})"


class Pager:
    """Pages on a device, least recently used first out. `relieve(needed)` is the pressure callback."""

    def __init__(self, device, page_size: int = PAGE_SIZE):
        self.page_size = check_int("page_size", page_size, low=_ITEM, multiple_of=_ITEM)
        self.device = torch.device(device)
        self.stats = PagerStats()
        self._resident: OrderedDict[int, Page] = OrderedDict()  # id(page) -> page, least recent first
        self._host: dict[int, object] = {}  # id(page) -> numpy array (CPU) or CPU tensor (CUDA)
        self._pinned: set[int] = set()

    @property
    def resident_bytes(self) -> int:
        return len(self._resident) * self.page_size

    @property
    def host_bytes(self) -> int:
        return len(self._host) * self.page_size

    def bring_in(self, page: Page) -> torch.Tensor:
        """The page's device tensor: made (zeros) at its first touch, copied back if evicted; now most recent."""
        key = id(page)
        if page.data is None:
            host = self._host.get(key)
            if host is None:
                page.data = torch.zeros(page.numel, dtype=torch.float32, device=self.device)
                self.stats.allocated += self.page_size
            else:
                self.stats.faults += 1
                if isinstance(host, np.ndarray):  # CPU-only: the copy back is a new torch storage
                    page.data = torch.from_numpy(host).clone()
                else:
                    page.data = host.to(self.device, non_blocking=False)
                del self._host[key]
                self.stats.paged_in += self.page_size
        self._resident[key] = page
        self._resident.move_to_end(key)
        return page.data

    def evict(self, page: Page) -> int:
        """Move one resident page to the host; returns the bytes the device got back."""
        key = id(page)
        t = page.data
        if self.device.type == "cpu":
            self._host[key] = t.numpy().copy()  # outside torch: the ledger stops counting it
        else:
            self._host[key] = t.to("cpu")
        page.data = None
        del t
        del self._resident[key]
        self.stats.paged_out += self.page_size
        self.stats.evictions += 1
        return self.page_size

    def relieve(self, needed: int) -> int:
        """Evict least recently used pages (not those the step is using) until `needed` bytes are free."""
        freed = 0
        for key in list(self._resident):
            if freed >= needed:
                break
            if key not in self._pinned:
                freed += self.evict(self._resident[key])
        return freed

    def pin(self, pages) -> list[torch.Tensor]:
        """Bring pages in, one by one, each kept from eviction until `unpin` (so bringing in the next cannot evict it)."""
        out = []
        for page in pages:
            out.append(self.bring_in(page))
            self._pinned.add(id(page))
        return out

    def unpin(self) -> None:
        self._pinned.clear()


class PagedOptimizer(torch.optim.Optimizer):
    """An elementwise optimizer whose fp32 states live in pages (see the module docstring).

    Subclasses set `state_names` and `_update(p, g, states, step, group)`, which updates the 1-D segment p
    (fp32, a view of the parameter or its fp32 copy) from the gradient segment g and the state segments.
    Parameters must be contiguous and on one device. `self.state[p]` holds "step" and the pages p overlaps.
    """

    state_names: tuple[str, ...] = ()

    def __init__(self, params, defaults: dict, page_size: int = PAGE_SIZE):
        page_size = check_int("page_size", page_size, low=_ITEM, multiple_of=_ITEM)
        super().__init__(params, defaults)
        plist = [p for g in self.param_groups for p in g["params"]]
        devices = {p.device for p in plist}
        if len(devices) > 1:
            raise ValueError(f"{type(self).__name__}: parameters must be on one device, got {sorted(map(str, devices))}")
        for p in plist:
            if not p.is_contiguous():
                raise ValueError(f"{type(self).__name__}: parameter of shape {tuple(p.shape)} is not contiguous")
            if not p.dtype.is_floating_point:
                raise ValueError(f"{type(self).__name__}: parameter of dtype {p.dtype} is not floating point")
        self.pager = Pager(devices.pop() if devices else "cpu", page_size)
        self.page_numel = page_size // _ITEM
        self._offset, total = {}, 0
        for p in plist:
            self._offset[p] = total
            total += p.numel()
        self.numel = total
        self.n_pages = math.ceil(total / self.page_numel)
        self.pages = {name: [Page(name, k, self.page_numel) for k in range(self.n_pages)] for name in self.state_names}

    @property
    def stats(self) -> PagerStats:
        return self.pager.stats

    def state_page_bytes(self) -> int:
        """Device bytes of the state once every page exists: states x pages x page_size."""
        return len(self.state_names) * self.n_pages * self.pager.page_size

    def attach(self, ledger):
        """Let `ledger`'s budget page this optimizer's state out (Ledger.on_pressure); returns the hook's handle."""
        return ledger.on_pressure(self.pager.relieve)

    def _update(self, p, g, states: dict, step: int, group: dict) -> None:
        raise NotImplementedError

    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "pages"):
            raise ValueError(f"{type(self).__name__}: parameter groups are fixed at construction (the pages are laid "
                             f"out then); make a new optimizer instead")
        super().add_param_group(param_group)

    def _segments(self, p):
        """(page index, start and end in the page, start and end in p's flat values) for every page p overlaps."""
        E, off, n = self.page_numel, self._offset[p], p.numel()
        for k in range(off // E, (off + n - 1) // E + 1):
            a, b = max(off, k * E), min(off + n, (k + 1) * E)
            yield k, a - k * E, b - k * E, a - off, b - off

    def _init_state(self, p) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["pages"] = [self.pages[s][k] for k, *_ in self._segments(p) for s in self.state_names]
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        for p, group in params_with_grads(self, type(self).__name__):
            state = self._init_state(p)
            state["step"] += 1
            flat = p.view(-1) if p.dtype == torch.float32 else p.detach().view(-1).float()  # bytes: 4n for 16-bit p
            grad = p.grad.reshape(-1)
            for k, a, b, i, j in self._segments(p):
                try:
                    tensors = self.pager.pin([self.pages[s][k] for s in self.state_names])
                    segs = {s: t[a:b] for s, t in zip(self.state_names, tensors)}
                    g = grad[i:j]
                    self._update(flat[i:j], g if g.dtype == torch.float32 else g.float(), segs, state["step"], group)
                    del tensors, segs
                finally:
                    self.pager.unpin()
            if flat.data_ptr() != p.data_ptr():
                p.copy_(flat.view(p.shape))  # rounded to the parameter's dtype
        return loss

    # ---- saving and resuming: plain tensors per parameter, wherever the pages are -------------------------------
    @torch.no_grad()
    def state_dict(self) -> dict:
        """{"state": {index: {"step", <state name>: fp32 tensor of the parameter's shape}}, "param_groups": [...]}:
        tensors and numbers only (torch.load(weights_only=True) reads it). Pages stay where they are."""
        state, groups, index = {}, [], 0
        for g in self.param_groups:
            ids = []
            for p in g["params"]:
                st = self.state.get(p)
                if st:
                    out = {"step": st["step"]}
                    for s in self.state_names:
                        t = torch.empty(p.numel(), dtype=torch.float32)
                        for k, a, b, i, j in self._segments(p):
                            t[i:j] = self._page_values(self.pages[s][k])[a:b]
                        out[s] = t.view(p.shape)
                    state[index] = out
                ids.append(index)
                index += 1
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ids})
        return {"state": state, "param_groups": groups}

    def _page_values(self, page: Page) -> torch.Tensor:
        """The page's values as a CPU tensor, without moving the page."""
        if page.data is not None:
            return page.data.cpu()
        host = self.pager._host.get(id(page))
        if host is None:
            return torch.zeros(page.numel)
        return torch.from_numpy(host) if isinstance(host, np.ndarray) else host

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Write saved state into the pages (bringing them to the device) and take the saved hyperparameters."""
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(f"{type(self).__name__}.load_state_dict: its param_groups do not match this optimizer's")
        index = 0
        for saved, group in zip(groups, self.param_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
            for p in group["params"]:
                s = state_dict["state"].get(index)
                index += 1
                if s is None:
                    continue
                missing = [n for n in self.state_names if n not in s]
                if missing or tuple(s[self.state_names[0]].shape) != tuple(p.shape):
                    raise ValueError(f"{type(self).__name__}.load_state_dict: parameter {index - 1} needs "
                                     f"{', '.join(self.state_names)} of shape {tuple(p.shape)}")
                st = self._init_state(p)
                st["step"] = int(s["step"])
                for k, a, b, i, j in self._segments(p):
                    try:
                        tensors = self.pager.pin([self.pages[n][k] for n in self.state_names])
                        for n, t in zip(self.state_names, tensors):
                            t[a:b] = s[n].reshape(-1)[i:j].to(t.device, torch.float32)
                        del tensors
                    finally:
                        self.pager.unpin()


class PagedAdamW(PagedOptimizer):
    """torch.optim.AdamW's update (single-tensor arithmetic, fp32 state) on paged state: the analogue of
    bitsandbytes' PagedAdamW (32-bit). States "exp_avg" (m) and "exp_avg_sq" (v)."""

    state_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 page_size: int = PAGE_SIZE):
        defaults = dict(lr=check_number("lr", lr), betas=check_betas(betas), eps=check_number("eps", eps),
                        weight_decay=check_number("weight_decay", weight_decay))
        super().__init__(params, defaults, page_size)

    def _update(self, p, g, s, step, group):
        (b1, b2), lr = group["betas"], group["lr"]
        m, v = s["exp_avg"], s["exp_avg_sq"]
        p.mul_(1 - lr * group["weight_decay"])
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = v.sqrt().div_((1 - b2**step) ** 0.5).add_(group["eps"])  # bytes: one temporary of at most a page
        p.addcdiv_(m, denom, value=-lr / (1 - b1**step))


class PagedLion(PagedOptimizer):
    """labkit.optim.Lion's update (lion-pytorch's, decoupled_weight_decay=False) on one paged state "exp_avg"."""

    state_names = ("exp_avg",)

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0,
                 page_size: int = PAGE_SIZE):
        defaults = dict(lr=check_number("lr", lr, low_open=True), betas=check_betas(betas, high_open=False),
                        weight_decay=check_number("weight_decay", weight_decay))
        super().__init__(params, defaults, page_size)

    def _update(self, p, g, s, step, group):
        (b1, b2), lr, m = group["betas"], group["lr"], s["exp_avg"]
        p.mul_(1 - lr * group["weight_decay"])
        u = m.mul(b1).add_(g, alpha=1 - b1).sign_()
        p.add_(u, alpha=-lr)
        m.mul_(b2).add_(g, alpha=1 - b2)


# ---- the prediction ----------------------------------------------------------------------------------------
def paged_state_bytes(numel: int, n_states: int = 2, page_size: int = PAGE_SIZE) -> int:
    """Device bytes of paged fp32 state for `numel` parameters: n_states x ceil(4 numel / page_size) pages.
    Source: this module's layout (one virtual array per state, cut into whole pages)."""
    page_size = check_int("page_size", page_size, low=_ITEM, multiple_of=_ITEM)
    return n_states * math.ceil(_ITEM * numel / page_size) * page_size


@dataclass
class PagingPrediction:
    evicted: int  # bytes paged out: (unpaged peak - budget) rounded up to whole pages
    peak_high: int  # the device peak is at most min(budget, unpaged peak) ...
    peak_low: int  # ... and at least unpaged peak - evicted (the moment of the unpaged peak, with paging)
    fits: bool  # False when more than the whole state would have to leave the device

    @property
    def peak(self) -> int:
        return self.peak_high


def predict_paging(unpaged_peak: int, budget: int, page_size: int = PAGE_SIZE, state_bytes: int | None = None
                   ) -> PagingPrediction:
    """What paging does to a step whose peak without paging (and without a budget) is `unpaged_peak`.

    The ledger evicts at each allocation that would cross the budget, just enough whole pages for it to
    fit, and nothing comes back before the optimizer step; so by the unpaged peak it has evicted
    evicted = ceil((unpaged_peak - budget) / page_size) * page_size, and the device never holds more than
    min(budget, unpaged_peak) (the peak lies within one page of that: in [unpaged_peak - evicted, budget]).
    The state pages are only brought back in the step, so this holds if what is not state fits
    (evicted <= state_bytes, the state's device bytes at the peak) and the step itself fits the budget.
    """
    page_size = check_int("page_size", page_size, low=_ITEM, multiple_of=_ITEM)
    for name, v in (("unpaged_peak", unpaged_peak), ("budget", budget)):
        check_int(name, v, low=1)
    over = max(0, unpaged_peak - budget)
    evicted = math.ceil(over / page_size) * page_size
    fits = state_bytes is None or evicted <= state_bytes
    return PagingPrediction(evicted, min(budget, unpaged_peak), unpaged_peak - evicted, fits)
