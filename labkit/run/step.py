"""Run real training steps under the ledger, and turn an out-of-memory into a result, not a crash."""

from __future__ import annotations

import contextlib
import tempfile
from typing import Sequence

import torch
from tqdm.auto import tqdm

from labkit.estimate.peft_terms import parse_targets, peft_of
from labkit.estimate.predict import OPTIMIZERS, Precision, _check_peft_options
from labkit.estimate.recipe import Recipe
from labkit.estimate.spec import spec_from
from labkit.memory.budget import cuda_limit
from labkit.memory.ledger import Ledger
from labkit.memory.report import Measurement
from labkit.paths import data_dir

_LOW = {"fp16": torch.float16, "bf16": torch.bfloat16, "mixed-fp16": torch.float16, "mixed-bf16": torch.bfloat16}
_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LISA_INTERVAL = 20  # steps between LISA's layer switches (LMFlow's default K)


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


def apply_peft(m: torch.nn.Module, dtype: str = "fp32", lora_rank: int | None = None,
               lora_targets: str | Sequence[str] = "all-linear", quant: str = "none", lisa_layers: int | None = None,
               quant_group: int | None = None, calib=None, quant_set: str = "all-linear"):
    """Make `m` a LoRA / QLoRA / int8- or int4-base LoRA model in place (labkit.peft); returns the resolved
    labkit.estimate.peft_terms.Peft, or None for plain training. LISA needs the optimizer: see measure_step.

    quant "nf4": labkit.peft.apply_qlora (NF4Base, double quantization); "int8": a labkit.quant.Int8Linear
    (per-row absmax) per target; "int4": a labkit.quant.Int4Linear (round-to-nearest, groups of quant_group,
    default 128); "int4-awq": the same after AWQ's scale and clip searches on `calib` (a list of model
    inputs, required), each target keeping its scale (labkit.quant.awq_linear). The compute dtype is the
    model's (16-bit under mixed-*).
    quant_set "all-linear" (transformers + bitsandbytes' load_in_4bit): every other Linear but the
    head is stored the same way too, frozen, without an adapter; "targets" (torchtune's qlora): only
    the adapted ones."""
    peft = peft_of(spec_from(m), lora_rank, lora_targets, quant, lisa_layers, quant_group,
                   quant_set)
    if peft is None or peft.lisa_layers:
        return peft
    from labkit.peft import LoRALinear, apply_lora
    from labkit.peft.lora import find_targets

    targets = parse_targets(lora_targets)
    compute = _LOW.get(dtype, torch.float32)
    adapted = find_targets(m, targets)  # apply_lora wraps them in this order
    others = [] if quant_set == "targets" else [n for n in find_targets(m, "all-linear")
                                                if n not in adapted]
    base = _quantizer(m, quant, peft.group, compute, adapted + others, calib)
    if base is None:
        apply_lora(m, targets, r=lora_rank)
        return peft
    order = iter(adapted)
    apply_lora(m, targets, r=lora_rank, wrap=lambda lin: LoRALinear(
        base(next(order), lin), r=lora_rank, adapter_dtype=lin.weight.dtype))
    _quantize_frozen(m, others, base)
    return peft


def _quantizer(m, quant: str, group: int, compute: torch.dtype, names: list[str], calib):
    """(module name, nn.Linear) -> its frozen quantized replacement (None for quant "none"); AWQ's
    input statistics are collected for `names` first, on the model as it is."""
    if quant == "none":
        return None
    if quant == "nf4":
        from labkit.peft import NF4Config, to_nf4

        return lambda name, lin: to_nf4(lin, NF4Config(compute))
    if quant == "int8":
        from labkit.quant import Int8Linear

        # per-row absmax codes, dequantized on the fly, nothing kept for backward
        return lambda name, lin: Int8Linear.from_linear(lin, "absmax", "channel",
                                                        compute_dtype=compute).requires_grad_(False)
    from labkit.quant import AWQConfig, Int4Linear, awq_linear, collect_inputs

    stats = collect_inputs(m, names, calib) if quant == "int4-awq" else None

    def int4_base(name, lin):  # int4 codes by group, dequantized on the fly, none kept for backward
        if stats is None:
            return Int4Linear.from_linear(lin, group, compute_dtype=compute).requires_grad_(False)
        return awq_linear(lin, stats[name], AWQConfig(group), compute).requires_grad_(False)

    return int4_base


def _quantize_frozen(m, names: list[str], base) -> None:
    """Replace each named Linear (GPT-2's Conv1D as the equal nn.Linear) by its frozen quantized
    base."""
    from labkit.peft.lora import _is_conv1d, _replace, conv1d_as_linear

    for name in names:
        lin = m.get_submodule(name)
        lin = conv1d_as_linear(lin) if _is_conv1d(lin) else lin
        _replace(m, name, base(name, lin).requires_grad_(False))


def adapters_to(m: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Store every LoRA adapter (labkit.peft.LoRALinear's A and B) in `dtype`, e.g. fp32 over a bf16 base, as
    peft's get_peft_model does (autocast_adapter_dtype=True); call it before the optimizer is made."""
    from labkit.peft import LoRALinear

    for mod in m.modules():
        if isinstance(mod, LoRALinear):
            for name in ("lora_A", "lora_B"):
                p = getattr(mod, name)
                if p.dtype != dtype:
                    p.data = p.data.to(dtype)
    return m


def optimizer_class(optimizer: str, lr: float = 1e-3, foreach=None) -> tuple[type, dict]:
    """(class, keywords) of an optimizer name: torch.optim's SGD (momentum 0.9 for "sgd-momentum"), Adam,
    AdamW, or labkit.optim's AdamW8bit, Adam8bit, Lion, Adafactor (relative step sizes, transformers'
    default: no lr), GaLoreAdamW, GaLoreAdamW8bit (their parameters: labkit.optim.galore_param_groups)."""
    from labkit import optim as lo

    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    plain = dict(lr=lr, foreach=foreach)
    return {"sgd": (torch.optim.SGD, plain), "sgd-momentum": (torch.optim.SGD, dict(plain, momentum=0.9)),
            "adam": (torch.optim.Adam, plain), "adamw": (torch.optim.AdamW, plain),
            "adamw8bit": (lo.AdamW8bit, dict(lr=lr)), "adam8bit": (lo.Adam8bit, dict(lr=lr)),
            "lion": (lo.Lion, dict(lr=lr)), "adafactor": (lo.Adafactor, {}),
            "galore": (lo.GaLoreAdamW, dict(lr=lr)), "galore8bit": (lo.GaLoreAdamW8bit, dict(lr=lr))}[optimizer]


def make_optimizer(model: torch.nn.Module, optimizer: str | Recipe = "adamw", lr: float = 1e-3, *,
                   offload_folder: str | None = None, update_proj_gap: int | None = None):
    """The optimizer a recipe names, over `model`'s parameters: a name alone (see `optimizer_class`), or a
    `labkit.estimate.Recipe`, whose optimizer fields apply: foreach; GaLore's rank on attention and MLP
    matrices (a new projector every `update_proj_gap` steps, default labkit.optim.galore.GALORE_DEFAULTS'
    200) and 8-bit GaLore's proj_dtype; optimizer_offload "cpu"/"disk" (OffloadAdamW, its files in
    `offload_folder`); step_in_backward (any of them wrapped in StepInBackward)."""
    from labkit import optim as lo

    r = optimizer if isinstance(optimizer, Recipe) else Recipe(model, 1, 1, optimizer=optimizer)  # checks the name
    cls, kw = optimizer_class(r.optimizer, lr, r.foreach)
    if r.optimizer_offload is not None:
        return lo.OffloadAdamW(model.parameters(), lr=lr, offload=r.optimizer_offload, folder=offload_folder)
    if r.proj_dtype is not None:
        kw = dict(kw, proj_dtype=r.proj_dtype)
    if update_proj_gap is not None and not r.optimizer.startswith("galore"):
        raise ValueError(f"update_proj_gap is GaLore's steps between projector refreshes: give optimizer='galore' "
                         f"or 'galore8bit', not {r.optimizer!r}")
    if r.optimizer.startswith("galore"):
        gap = {} if update_proj_gap is None else {"update_proj_gap": update_proj_gap}
        params = lo.galore_param_groups(model, r.rank, **gap)
    else:
        params = list(model.parameters())
    return lo.StepInBackward(params, cls, **kw) if r.step_in_backward else cls(params, **kw)


def train_step(model, opt, x, y, dtype: str = "fp32", micro_batch: int | None = None,
               offload_activations: bool = False, loss_chunks: int | None = None) -> torch.Tensor:
    """One step: forward (autocast for mixed-*), backward, optimizer step, gradients set to None.

    micro_batch: rows per micro-batch (gradient accumulation: each loss weighted by its share).
    offload_activations: saved activations go to host memory (labkit.recompute.offload_activations).
    The logits are not kept past the loss, so nothing outside autograd holds them in backward.
    loss_chunks: the head and the loss in that many chunks along the sequence, each upcast to fp32
    alone (labkit.recompute.chunked_output, torchtune's CEWithChunkedOutputLoss): the model returns
    its output chunks, the loss walks them, and the chunks are let go before backward (as
    torchtune's recipes do).
    """
    from labkit.accumulate import split_sizes
    from labkit.recompute import offload_activations as offload

    sizes = split_sizes(x.shape[0], micro_batch or x.shape[0])
    total = torch.zeros((), device=x.device)
    for xb, yb in zip(torch.split(x, sizes), torch.split(y, sizes)):
        with offload() if offload_activations else contextlib.nullcontext():
            with torch.autocast(x.device.type, dtype=_LOW.get(dtype, torch.float32), enabled=dtype.startswith("mixed")):
                if loss_chunks:
                    from labkit.recompute.chunked_output import (chunked_output_loss,
                                                                 model_output_chunks)

                    logits = model_output_chunks(model, xb, loss_chunks)
                    loss = chunked_output_loss(logits, yb)
                    del logits
                elif hasattr(model, "config") and hasattr(model.config, "model_type"):  # transformers
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


def measure_step(recipe: Recipe, *, steps: int = 2, budget: int | None = None, data: torch.Tensor | None = None,
                 seed: int = 0, progress: bool | None = None, galore_refresh: bool = False) -> Measurement:
    """Build the recipe's model, apply the recipe, run `steps` training steps under a Ledger on the recipe's
    device and return what it measured (lr 1e-3, make_optimizer's: memory does not depend on it).

    recipe: a `labkit.estimate.Recipe`, the one `labkit.estimate.estimate` predicts.
    steps: training steps to run (the first makes the optimizer state; peaks are over all of them).
    budget: bytes; exceeding it raises SimulatedOutOfMemoryError where a real device would fail.
    data: a 1-D tensor of token ids to sample batches from (default: random tokens).
    seed: seeds the model's initialization and the batches.
    progress: a tqdm bar over the steps (default: when there are 10 or more).
    galore_refresh: GaLore only: the last step refreshes the projector (an SVD per matrix) with every state
    already made, the step the estimate's "projector refresh" moments describe (update_proj_gap is set to
    steps - 1, or 1 for a single step). By default the gap is 200 and only the first step refreshes, while
    its state is still being made: the later steps are the estimate's steady moments (compare
    `measure_step(r).of_step(steps)` with `estimate(r).without("projector refresh")`).
    The recipe's fields: checkpoint, segments, selective_policy: labkit.recompute.checkpoint_blocks;
    offload_activations, micro_batch: as in `train_step`; the optimizer's: as in `make_optimizer` (disk offload:
    a temporary folder in data_dir()); base_dtype: the model is cast to it before `apply_peft` and the adapters
    kept in the trained dtype (fp32 under mixed-*, `adapters_to`); lora_rank, lora_targets, quant, quant_group,
    lisa_layers: see `apply_peft`; loss_chunks: the head and its loss in chunks along the sequence
    (`train_step`)
    (int4-awq calibrates on one batch of the same shape as the step's, drawn with seed + 1; LISA switches layers
    every LISA_INTERVAL steps, its optimizer holds every parameter, as labkit.peft.LISA requires).
    """
    if not isinstance(recipe, Recipe):
        raise TypeError(f"measure_step takes a labkit.estimate.Recipe, got {type(recipe).__name__}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if not isinstance(galore_refresh, bool):
        raise ValueError(f"galore_refresh must be True or False, got {galore_refresh!r}")
    r = recipe
    if galore_refresh and not r.optimizer.startswith("galore"):
        raise ValueError(f"galore_refresh makes GaLore's last step refresh its projector: give optimizer='galore' "
                         f"or 'galore8bit', not {r.optimizer!r}")
    torch.manual_seed(seed)
    device = torch.device(r.device)
    m = build_model(r.model, r.dtype, device, **r.config)
    vocab = m.config.vocab_size
    calib = None
    if r.quant == "int4-awq":  # AWQ's calibration batch: like the step's, from its own generator (seed + 1)
        calib = [_sample(data, vocab, r.batch, r.seq, torch.Generator().manual_seed(seed + 1)).to(device)]
    if r.frozen_dtype != "fp32" and r.frozen_dtype != r.dtype:  # a 16-bit base under fp32 adapters (peft's way)
        m = m.to(_TORCH[r.frozen_dtype])
    peft = apply_peft(m, r.dtype, r.lora_rank, r.lora_targets, r.quant, r.lisa_layers,
                      r.quant_group, calib, r.quant_set)
    if r.base_dtype is not None and r.lora_rank is not None:
        adapters_to(m, torch.float32 if r.dtype.startswith("mixed") else _TORCH[r.dtype])
    if peft is not None:
        _check_peft_options(peft, r.optimizer, r.optimizer_offload, r.step_in_backward)
    disk = r.optimizer_offload == "disk"
    folder = tempfile.TemporaryDirectory(prefix="labkit-measure-", dir=data_dir()) if disk else contextlib.nullcontext()
    with folder as path:
        gap = max(steps - 1, 1) if galore_refresh else None  # steps are counted from 0: step steps-1 refreshes
        opt = make_optimizer(m, r, offload_folder=path, update_proj_gap=gap)
        before = None
        if r.lisa_layers:
            from labkit.peft import LISA

            before = LISA(m, opt, gamma=r.lisa_layers, interval=LISA_INTERVAL, seed=seed).step
        gen = torch.Generator().manual_seed(seed)
        try:
            meas = _measure(m, opt, r, lambda: _sample(data, vocab, r.batch, r.seq + 1, gen), steps,
                            budget, progress, before)
            # paged states: bitsandbytes keeps them in CUDA unified memory, which
            # max_memory_allocated does not count. The same optimizer runs here (a CPU has no
            # unified memory to page); the ledger's optimizer-state bytes leave the device
            # timeline as that memory (Measurement.unified)
            return meas.as_unified() if r.paged_states else meas
        finally:
            if hasattr(opt, "close"):
                opt.close()


def _sample(data: torch.Tensor | None, vocab: int, rows: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """(rows, length) token ids: random, or windows of `data` at random starts."""
    if data is None:
        return torch.randint(0, vocab, (rows, length), generator=gen)
    i = torch.randint(0, len(data) - length, (rows,), generator=gen)
    return torch.stack([data[j: j + length] for j in i.tolist()])


def _measure(m, opt, r: Recipe, sample, steps: int, budget, progress, before_step) -> Measurement:
    """`steps` training steps of `m`, each on a (rows, seq + 1) tensor from `sample()`, under a Ledger."""
    device = torch.device(r.device)
    model = r.model
    label = (f"{getattr(model, 'name', model if isinstance(model, str) else type(m).__name__)} "
             f"B={r.batch} S={r.seq} {r.dtype} {r.optimizer}"
             + (f" loss_chunks={r.loss_chunks}" if r.loss_chunks is not None else ""))
    real = device.type == "cuda" and budget is not None  # on CUDA the allocator enforces the budget
    wrap = contextlib.nullcontext()
    if r.checkpoint != "none":
        from labkit.recompute import checkpoint_blocks

        wrap = checkpoint_blocks(m, r.checkpoint, r.segments, selective=r.selective_policy)
    with wrap, cuda_limit(budget if real else None, device), \
            Ledger(m, opt, budget=None if real else budget, label=label, device=device) as led:
        for _ in tqdm(range(steps), desc=label, disable=not (steps >= 10 if progress is None else progress)):
            t = sample()
            x, y = t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)
            del t
            if before_step is not None:
                before_step()
            train_step(m, opt, x, y, r.dtype, r.micro_batch, r.offload_activations, r.loss_chunks)
            del x, y
    return led.measurement()
