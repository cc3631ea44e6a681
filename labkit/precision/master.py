"""Mixed precision with fp32 master weights: the model computes in fp16/bf16, the optimizer steps fp32 copies.

Why masters: a bf16 weight has 8 significant bits, so an update smaller than 1/256 of the weight
rounds away (w + lr*g == w); and fp16 gradients cannot be unscaled in fp16 (dividing by S flushes the
small ones again), so they are unscaled after the cast to fp32.
The fix (Micikevicius et al. 2018, apex `O2`, Megatron, DeepSpeed) keeps two copies of the weights:

    working copy  2 bytes/param  fp16 or bf16, in the model: forward and backward run on it
    master copy   4 bytes/param  fp32, in the optimizer: it accumulates the small updates

One step: backward gives 16-bit gradients -> cast each into an fp32 master gradient and free it ->
(unscale by the loss scale, skip the step on inf/nan) -> optimizer.step() on the masters ->
copy the masters back into the working copy (cast in place) -> free the master gradients.

Bytes per parameter with Adam(W), each category at its own peak (`bytes_per_param`):

    fp32          4 weights               + 4 grads               + 8 Adam m, v = 16
    autocast      4 weights + 2 16-bit copy (autocast's cache)
                                          + 4 grads (fp32)        + 8          = 18
    master-*16    2 working + 4 master    + 2 16-bit grads + 4 master grads
                                                                  + 8          = 20
The 2 bytes of 16-bit gradients are transient: `naive_master_step` (the teaching version) holds all
of them while it makes the masters' (peak 6N); `MasterWeightsOptimizer` frees each one as soon as it
is cast, so its gradient peak is at most 4N + 2 x (largest tensor) (`streamed_grad_peak`, exactly).
Adam also keeps a 4-byte step counter per tensor. Activations (not counted here) are 16-bit too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from labkit.memory.state import TORCH_STATES

from .scaler import DynamicLossScaler

LOW = {"fp16": torch.float16, "bf16": torch.bfloat16}
SCHEMES = ("fp32", "autocast", "master-fp16", "master-bf16")
STATES = TORCH_STATES  # fp32 state tensors per parameter


@dataclass(frozen=True)
class BytesPerParam:
    """Bytes per parameter element, each category at its peak (as the ledger tags them)."""

    param: int  # weights: fp32, or 16-bit working + fp32 master, (+ autocast's 16-bit copy)
    grad: int  # gradients: fp32, or 16-bit + fp32 master gradients
    opt: int  # optimizer state: 4 bytes per fp32 state tensor (+ step counters, per tensor)

    @property
    def total(self) -> int:
        return self.param + self.grad + self.opt


def bytes_per_param(scheme: str, optimizer: str = "adamw") -> BytesPerParam:
    """The table in this module's docstring: "fp32", "autocast", "master-fp16" or "master-bf16"."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    if optimizer not in STATES:
        raise ValueError(f"optimizer must be one of {', '.join(STATES)}, got {optimizer!r}")
    opt = 4 * STATES[optimizer]  # torch.optim keeps its state in the (fp32) parameters' dtype
    if scheme == "fp32":
        return BytesPerParam(4, 4, opt)
    if scheme == "autocast":  # fp32 parameters; autocast caches a 16-bit copy of each weight
        return BytesPerParam(4 + 2, 4, opt)
    return BytesPerParam(2 + 4, 2 + 4, opt)  # working + master; 16-bit + master gradients


def streamed_grad_peak(numels: list[int], low_bytes: int = 2) -> int:
    """Exact gradient-byte peak of MasterWeightsOptimizer.step, which casts tensor i (n_i elements) and
    then frees its 16-bit gradient: all 16-bit grads (low_bytes x N) are alive at the start, so the
    peak is max_i [4 x (n_1 + .. + n_i) + low_bytes x (n_i + .. + n_last)] <= 4N + low_bytes x max n_i."""
    done, left, peak = 0, sum(numels), low_bytes * sum(numels)
    for n in numels:
        peak = max(peak, 4 * (done + n) + low_bytes * left)  # master grad i made, 16-bit grad i not yet freed
        done, left = done + n, left - n
    return peak


def _low_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, str) and dtype in LOW:
        return LOW[dtype]
    if dtype in (torch.float16, torch.bfloat16):
        return dtype
    raise ValueError(f"dtype must be torch.float16/'fp16' or torch.bfloat16/'bf16', got {dtype!r}")


def make_masters(model: torch.nn.Module, dtype=torch.bfloat16) -> tuple[list, list]:
    """fp32 copies of the trainable parameters, then cast the model to 16 bits in place.

    Returns (working, masters): the model's own (now 16-bit) parameters and their fp32 masters.
    bytes: +4 per parameter for the masters; the model's 4 become 2.
    """
    low = _low_dtype(dtype)
    working = [p for p in model.parameters() if p.requires_grad]
    masters = [torch.nn.Parameter(p.detach().to(torch.float32, copy=True)) for p in working]
    model.to(low)  # parameters keep their identity; their data becomes 16-bit
    return working, masters


# ---- the teaching version: three loops, everything at once ------------------------------------------
def naive_master_step(working: list, masters: list, optimizer: torch.optim.Optimizer,
                      scaler: DynamicLossScaler | None = None) -> bool:
    """One step over (working, masters) pairs; `optimizer` holds the masters. Returns whether it stepped."""
    for p, m in zip(working, masters):  # 1. 16-bit grads -> fp32 master grads (bytes: +4 each)
        m.grad = None if p.grad is None else p.grad.float()
    for p in working:  # 2. only now free the 16-bit grads (bytes: -2 each): the peak was 2 + 4
        p.grad = None
    stepped = True
    if scaler is None:
        optimizer.step()
    else:  # unscale the fp32 grads (fp16 ones cannot be), skip on inf/nan, adjust S
        stepped = not scaler.unscale_(optimizer)  # True unless a gradient was inf/nan
        scaler.step(optimizer)
        scaler.update()
    with torch.no_grad():
        for p, m in zip(working, masters):  # 3. masters -> working copy, rounded to 16 bits
            p.copy_(m)
    for m in masters:
        m.grad = None
    return stepped


# ---- the real one: an optimizer you can hand to any training loop --------------------------------
class MasterWeightsOptimizer(torch.optim.Optimizer):
    """Wrap `optimizer_cls` (any torch.optim class) so it steps fp32 masters of a 16-bit model.

    model: cast to `dtype` in place; its parameters become the working copy.
    scaler: a DynamicLossScaler (needed for fp16, harmless for bf16); use `opt.scale(loss).backward()`.
    optimizer_kwargs: passed to optimizer_cls (lr, weight_decay, ...).
    The wrapped optimizer's param_groups and state are this one's, so a Ledger tags the masters as
    parameters (PARAM), their gradients as GRAD and Adam's moments as optimizer state (OPT).
    """

    def __init__(self, model: torch.nn.Module, optimizer_cls=torch.optim.AdamW, dtype=torch.bfloat16,
                 scaler: DynamicLossScaler | None = None, **optimizer_kwargs):
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise ValueError(f"optimizer_cls must be a torch.optim.Optimizer class, got {optimizer_cls!r}")
        if scaler is not None and not hasattr(scaler, "unscale_"):
            raise ValueError(f"scaler must be a DynamicLossScaler (or None), got {type(scaler).__name__}")
        self.dtype = _low_dtype(dtype)
        self.working, self.masters = make_masters(model, self.dtype)
        self.inner = optimizer_cls(self.masters, **optimizer_kwargs)
        super().__init__(self.masters, self.inner.defaults)  # installs the step hooks a Ledger uses
        self.param_groups, self.state = self.inner.param_groups, self.inner.state  # one set, shared
        self.scaler = scaler
        self.skipped_steps = 0  # steps skipped because a scaled gradient overflowed

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """loss * S when there is a scaler (call .backward() on the result)."""
        return self.scaler.scale(loss) if self.scaler is not None else loss

    @torch.no_grad()
    def step(self, closure=None) -> bool:
        """Cast grads to the masters one tensor at a time, (unscale, skip,) step, copy back. Returns stepped."""
        if closure is not None:
            raise ValueError("closure is not supported: call backward before step()")
        for p, m in zip(self.working, self.masters):
            m.grad = None if p.grad is None else p.grad.to(torch.float32)  # bytes: +4 per element
            p.grad = None  # bytes: -2 per element, at once: at most one tensor holds both
        stepped = True
        if self.scaler is None:
            self.inner.step()
        else:
            stepped = not self.scaler.unscale_(self.inner)  # True unless a gradient was inf/nan
            self.scaler.step(self.inner)
            self.scaler.update()
            self.skipped_steps += not stepped
        if stepped:
            torch._foreach_copy_(self.working, self.masters)  # fp32 -> 16 bits in place: no new bytes
        for m in self.masters:
            m.grad = None  # bytes: -4 per element
        return stepped

    def zero_grad(self, set_to_none: bool = True) -> None:
        for t in (*self.working, *self.masters):
            if t.grad is not None:
                if set_to_none:
                    t.grad = None
                else:
                    t.grad.zero_()

    def state_dict(self) -> dict:
        """The wrapped optimizer's state, the fp32 masters (the true weights) and the scaler's state.
        Like torch.optim's, it holds references: deepcopy it (or torch.save it) to keep a snapshot."""
        return {"optimizer": self.inner.state_dict(), "masters": list(self.masters),
                "scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state["optimizer"])
        self.param_groups, self.state = self.inner.param_groups, self.inner.state
        with torch.no_grad():
            for m, saved in zip(self.masters, state["masters"]):
                m.copy_(saved)
            torch._foreach_copy_(self.working, self.masters)
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
