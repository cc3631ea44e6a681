"""Run real training steps under the ledger, and turn an out-of-memory into a result, not a crash."""

from __future__ import annotations

import contextlib
import tempfile

import torch
from tqdm.auto import tqdm

from .estimate import DTYPES, OPTIMIZERS, Precision
from .budget import cuda_limit
from .ledger import Ledger
from .report import Measurement

_LOW = {"fp16": torch.float16, "bf16": torch.bfloat16, "mixed-fp16": torch.float16, "mixed-bf16": torch.bfloat16}


def build_model(model, dtype: str = "fp32", device=None, **overrides) -> torch.nn.Module:
    """A trainable model on `device`: a GPTConfig, a preset name or path, or a module as it is."""
    from labkit.models.gpt import GPT, GPTConfig

    prec = Precision.of(dtype)
    if isinstance(model, GPTConfig):
        m = GPT(model)
    elif isinstance(model, str):
        from labkit.models import hf

        m = hf.build(model, device="cpu", **overrides)
    elif isinstance(model, torch.nn.Module):
        m = model
    else:
        raise TypeError(f"cannot build a model from {type(model).__name__}")
    m = m.to(device or "cpu")
    if prec.weight == 2:
        m = m.to(_LOW[dtype])
    return m.train()


def make_optimizer(model: torch.nn.Module, optimizer: str = "adamw", lr: float = 1e-3, foreach=None,
                   rank: int | None = None, optimizer_offload: str | None = None, step_in_backward: bool = False,
                   offload_folder: str | None = None):
    """An optimizer by name: torch.optim's SGD (momentum 0.9 for "sgd-momentum"), Adam, AdamW, or
    labkit.optim's AdamW8bit, Adam8bit, Lion, Adafactor, GaLoreAdamW(8bit) (rank r on attention and MLP
    matrices), OffloadAdamW (optimizer_offload "cpu"/"disk") or StepInBackward around AdamW."""
    from labkit import optim as lo

    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    if optimizer_offload is not None:
        if optimizer != "adamw":
            raise ValueError(f"optimizer_offload works with adamw, not {optimizer!r}")
        return lo.OffloadAdamW(model.parameters(), lr=lr, offload=optimizer_offload, folder=offload_folder)
    params = list(model.parameters())
    if step_in_backward:
        cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD,
               "adamw8bit": lo.AdamW8bit, "lion": lo.Lion}.get(optimizer)
        if cls is None:
            raise ValueError(f"step_in_backward supports adamw, adam, sgd, adamw8bit and lion, not {optimizer!r}")
        return lo.StepInBackward(params, cls, lr=lr)
    if optimizer.startswith("galore"):
        cls = lo.GaLoreAdamW if optimizer == "galore" else lo.GaLoreAdamW8bit
        return cls(lo.galore_param_groups(model, rank), lr=lr)
    simple = {"adamw8bit": lo.AdamW8bit, "adam8bit": lo.Adam8bit, "lion": lo.Lion}
    if optimizer in simple:
        return simple[optimizer](params, lr=lr)
    if optimizer == "adafactor":
        return lo.Adafactor(params)  # relative step sizes, as transformers' default
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, foreach=foreach)
    if optimizer == "sgd-momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=foreach)
    cls = torch.optim.Adam if optimizer == "adam" else torch.optim.AdamW
    return cls(params, lr=lr, foreach=foreach)


def train_step(model, opt, x, y, dtype: str = "fp32", micro_batch: int | None = None,
               offload_activations: bool = False) -> torch.Tensor:
    """One step: forward (autocast for mixed-*), backward, optimizer step, gradients set to None.

    micro_batch: rows per micro-batch (gradient accumulation: each loss weighted by its share).
    offload_activations: saved activations go to host memory (labkit.recompute.offload_activations).
    The logits are not kept past the loss, so nothing outside autograd holds them in backward.
    """
    from labkit.accumulate import split_sizes
    from labkit.recompute import offload_activations as offload

    sizes = split_sizes(x.shape[0], micro_batch or x.shape[0])
    total = torch.zeros((), device=x.device)
    for xb, yb in zip(torch.split(x, sizes), torch.split(y, sizes)):
        with offload() if offload_activations else contextlib.nullcontext():
            with torch.autocast(x.device.type, dtype=_LOW.get(dtype, torch.float32), enabled=dtype.startswith("mixed")):
                if hasattr(model, "config") and hasattr(model.config, "model_type"):  # transformers
                    out = model(input_ids=xb, labels=yb, use_cache=False)
                    loss = out.loss
                    del out
                else:
                    loss = model(xb, yb)
            if len(sizes) > 1:
                loss = loss * (xb.shape[0] / x.shape[0])
            loss.backward()
        total += loss.detach()
        del loss
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


def measure_step(model, batch: int, seq: int, dtype: str = "fp32", optimizer: str = "adamw",
                 steps: int = 2, budget: int | None = None, device=None, lr: float = 1e-3,
                 foreach=None, data: torch.Tensor | None = None, seed: int = 0, progress: bool | None = None,
                 checkpoint: str = "none", segments: int | None = None, offload_activations: bool = False,
                 micro_batch: int | None = None, rank: int | None = None, optimizer_offload: str | None = None,
                 step_in_backward: bool = False, **overrides) -> Measurement:
    """Build the model, then run `steps` training steps under a Ledger and return what it measured.

    data: a 1-D tensor of token ids to sample batches from (default: random tokens).
    budget: bytes; exceeding it raises SimulatedOutOfMemoryError where a real device would fail.
    progress: a tqdm bar over the steps (default: when there are 10 or more).
    checkpoint, segments: labkit.recompute.checkpoint_blocks(model, checkpoint, segments) (labkit's GPT).
    offload_activations, micro_batch: as in `train_step`.
    rank, optimizer_offload, step_in_backward: as in `make_optimizer` (disk offload uses a temp folder).
    """
    for name, v in (("batch", batch), ("seq", seq), ("steps", steps)):
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    torch.manual_seed(seed)
    device = torch.device(device or "cpu")
    m = build_model(model, dtype, device, **overrides)
    folder = tempfile.TemporaryDirectory() if optimizer_offload == "disk" else contextlib.nullcontext()
    with folder as path:
        opt = make_optimizer(m, optimizer, lr, foreach, rank, optimizer_offload, step_in_backward, path)
        try:
            return _measure(m, opt, model, batch, seq, dtype, optimizer, steps, budget, device, data, seed,
                            progress, checkpoint, segments, offload_activations, micro_batch)
        finally:
            if hasattr(opt, "close"):
                opt.close()


def _measure(m, opt, model, batch, seq, dtype, optimizer, steps, budget, device, data, seed, progress,
             checkpoint, segments, offload_activations, micro_batch) -> Measurement:
    vocab = m.config.vocab_size
    gen = torch.Generator().manual_seed(seed)

    def batch_xy():
        if data is None:
            t = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        else:
            i = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
            t = torch.stack([data[j: j + seq + 1] for j in i.tolist()])
        return t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)

    label = f"{getattr(model, 'name', model if isinstance(model, str) else type(m).__name__)} B={batch} S={seq} {dtype} {optimizer}"
    real = device.type == "cuda" and budget is not None  # on CUDA the allocator enforces the budget
    wrap = contextlib.nullcontext()
    if checkpoint != "none":
        from labkit.recompute import checkpoint_blocks

        wrap = checkpoint_blocks(m, checkpoint, segments)
    with wrap, cuda_limit(budget if real else None, device), \
            Ledger(m, opt, budget=None if real else budget, label=label, device=device) as led:
        for _ in tqdm(range(steps), desc=label, disable=not (steps >= 10 if progress is None else progress)):
            x, y = batch_xy()
            train_step(m, opt, x, y, dtype, micro_batch, offload_activations)
            del x, y
    return led.measurement()
