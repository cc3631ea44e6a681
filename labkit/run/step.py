"""Run real training steps under the ledger, and turn an out-of-memory into a result, not a crash."""

from __future__ import annotations

import contextlib
import tempfile
from typing import Sequence

import torch
from tqdm.auto import tqdm

from labkit.estimate.peft_terms import parse_targets, peft_of
from labkit.estimate.predict import OPTIMIZERS, STEP_AND_OFFLOAD, Precision, _check_peft_options
from labkit.estimate.recipe import Recipe
from labkit.estimate.spec import spec_from
from labkit.memory.budget import cuda_limit
from labkit.memory.ledger import Ledger
from labkit.memory.report import Measurement
from labkit.paths import data_dir

_LOW = {"fp16": torch.float16, "bf16": torch.bfloat16, "mixed-fp16": torch.float16, "mixed-bf16": torch.bfloat16}
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
               quant_group: int | None = None, calib=None):
    """Make `m` a LoRA / QLoRA / int8- or int4-base LoRA model in place (labkit.peft); returns the resolved
    labkit.estimate.peft_terms.Peft, or None for plain training. LISA needs the optimizer: see measure_step.

    quant "nf4": labkit.peft.apply_qlora (NF4Base, double quantization); "int8": a labkit.quant.Int8Linear
    (per-row absmax) per target; "int4": a labkit.quant.Int4Linear (round-to-nearest, groups of quant_group,
    default 128); "int4-awq": the same after AWQ's scale and clip searches on `calib` (a list of model
    inputs, required), each target keeping its scale (labkit.quant.awq_linear). The compute dtype is the
    model's (16-bit under mixed-*)."""
    peft = peft_of(spec_from(m), lora_rank, lora_targets, quant, lisa_layers, quant_group)
    if peft is None or peft.lisa_layers:
        return peft
    from labkit.peft import LoRAConfig, LoRALinear, NF4Config, apply_lora, apply_qlora

    targets = parse_targets(lora_targets)
    compute = _LOW.get(dtype, torch.float32)
    if quant == "nf4":
        apply_qlora(m, LoRAConfig(targets, r=lora_rank), NF4Config(compute))
    elif quant in ("int4", "int4-awq"):
        from labkit.peft.lora import find_targets
        from labkit.quant import Int4Linear, awq_linear, collect_inputs

        names = find_targets(m, targets)  # apply_lora wraps them in this order
        stats = collect_inputs(m, names, calib) if quant == "int4-awq" else None
        order = iter(names)

        def int4_base(lin):  # group-wise int4 codes, dequantized on the fly, nothing kept for backward
            if stats is None:
                return Int4Linear.from_linear(lin, peft.group, compute_dtype=compute).requires_grad_(False)
            return awq_linear(lin, stats[next(order)], peft.group, compute_dtype=compute).requires_grad_(False)

        apply_lora(m, targets, r=lora_rank, wrap=lambda lin: LoRALinear(
            int4_base(lin), r=lora_rank, adapter_dtype=lin.weight.dtype))
    elif quant == "int8":
        from labkit.quant import Int8Linear

        def int8_base(lin):  # per-row absmax codes, dequantized on the fly, nothing kept for backward
            return Int8Linear.from_linear(lin, "absmax", "channel", compute_dtype=compute).requires_grad_(False)

        apply_lora(m, targets, r=lora_rank, wrap=lambda lin: LoRALinear(
            int8_base(lin), r=lora_rank, adapter_dtype=lin.weight.dtype))
    else:
        apply_lora(m, targets, r=lora_rank)
    return peft


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


def make_optimizer(model: torch.nn.Module, optimizer: str = "adamw", lr: float = 1e-3, foreach=None,
                   rank: int | None = None, optimizer_offload: str | None = None, step_in_backward: bool = False,
                   offload_folder: str | None = None, update_proj_gap: int | None = None,
                   proj_dtype: str | None = None):
    """An optimizer by name (see `optimizer_class`; GaLore with rank r on attention and MLP matrices, a new
    projector every `update_proj_gap` steps, default labkit.optim.galore.GALORE_DEFAULTS' 200; 8-bit GaLore's
    projector in `proj_dtype`, default the parameters' dtype), or OffloadAdamW (optimizer_offload "cpu"/"disk"),
    or any of them wrapped in StepInBackward."""
    from labkit import optim as lo

    cls, kw = optimizer_class(optimizer, lr, foreach)
    if optimizer_offload is not None:
        if optimizer != "adamw":
            raise ValueError(f"optimizer_offload works with adamw, not {optimizer!r}")
        if step_in_backward:
            raise ValueError(STEP_AND_OFFLOAD)
        return lo.OffloadAdamW(model.parameters(), lr=lr, offload=optimizer_offload, folder=offload_folder)
    if proj_dtype is not None:
        if optimizer != "galore8bit":
            raise ValueError(f"proj_dtype is 8-bit GaLore's projector precision: give optimizer='galore8bit', "
                             f"not {optimizer!r}")
        kw = dict(kw, proj_dtype=proj_dtype)
    if update_proj_gap is not None and not optimizer.startswith("galore"):
        raise ValueError(f"update_proj_gap is GaLore's steps between projector refreshes: give optimizer='galore' "
                         f"or 'galore8bit', not {optimizer!r}")
    if optimizer.startswith("galore"):
        gap = {} if update_proj_gap is None else {"update_proj_gap": update_proj_gap}
        params = lo.galore_param_groups(model, rank, **gap)
    else:
        params = list(model.parameters())
    return lo.StepInBackward(params, cls, **kw) if step_in_backward else cls(params, **kw)


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


def measure_step(model, batch: int | None = None, seq: int | None = None, dtype: str = "fp32",
                 optimizer: str = "adamw", *, steps: int = 2, budget: int | None = None, device=None,
                 lr: float = 1e-3, data: torch.Tensor | None = None, seed: int = 0, progress: bool | None = None,
                 galore_refresh: bool = False, **options) -> Measurement:
    """Build the model, apply the recipe, run `steps` training steps under a Ledger and return what it measured.

    Give a `labkit.estimate.Recipe`, or a model with batch, seq and the Recipe's fields as keywords (any other
    keyword overrides the preset's config), exactly as `labkit.estimate.estimate` takes them. Run options:
    steps: training steps to run (the first makes the optimizer state; peaks are over all of them).
    budget: bytes; exceeding it raises SimulatedOutOfMemoryError where a real device would fail.
    device: where to run (default the CPU); a Recipe's device must agree with it.
    data: a 1-D tensor of token ids to sample batches from (default: random tokens).
    progress: a tqdm bar over the steps (default: when there are 10 or more).
    galore_refresh: GaLore only: the last step refreshes the projector (an SVD per matrix) with every state
    already made, the step the estimate's "projector refresh" moments describe (update_proj_gap is set to
    steps - 1, or 1 for a single step). By default the gap is 200 and only the first step refreshes, while
    its state is still being made: the later steps are the estimate's steady moments (compare
    `measure_step(...).of_step(steps)` with `estimate(...).without("projector refresh")`).
    The recipe: checkpoint, segments, selective_policy: labkit.recompute.checkpoint_blocks; offload_activations,
    micro_batch: as in `train_step`; rank, optimizer_offload, step_in_backward: as in `make_optimizer` (disk offload: a
    temporary folder in data_dir()); lora_rank, lora_targets, quant, quant_group, lisa_layers: see `apply_peft`
    (int4-awq calibrates on one batch of the same shape as the step's, drawn with seed + 1; LISA
    switches layers every LISA_INTERVAL steps, its optimizer holds every parameter, as labkit.peft.LISA requires);
    proj_dtype: 8-bit GaLore's projector precision (labkit.optim.GaLoreAdamW8bit).
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if not isinstance(galore_refresh, bool):
        raise ValueError(f"galore_refresh must be True or False, got {galore_refresh!r}")
    kind = torch.device(device or "cpu").type
    if isinstance(model, Recipe):
        if batch is not None or seq is not None or options or (dtype, optimizer) != ("fp32", "adamw"):
            raise TypeError("give a Recipe alone, or a model with batch, seq and options, not both")
        r = model
        if device is None:
            kind = r.device
        elif r.device != kind:
            raise ValueError(f"the recipe is for {r.device!r} but device={device!r}")
    else:
        r = Recipe.of(model, batch, seq, dtype=dtype, optimizer=optimizer, device=kind, **options)
    model, batch, seq, dtype, optimizer = r.model, r.batch, r.seq, r.dtype, r.optimizer
    checkpoint, segments, offload_activations, micro_batch = r.checkpoint, r.segments, r.offload_activations, r.micro_batch
    rank, optimizer_offload, step_in_backward, foreach = r.rank, r.optimizer_offload, r.step_in_backward, r.foreach
    proj_dtype = r.proj_dtype
    lora_rank, lora_targets, quant, lisa_layers = r.lora_rank, r.lora_targets, r.quant, r.lisa_layers
    overrides = r.config
    device = device or kind
    torch.manual_seed(seed)
    device = torch.device(device or "cpu")
    if galore_refresh and not optimizer.startswith("galore"):
        raise ValueError(f"galore_refresh makes GaLore's last step refresh its projector: give optimizer='galore' "
                         f"or 'galore8bit', not {optimizer!r}")
    m = build_model(model, dtype, device, **overrides)
    calib = None
    if quant == "int4-awq":  # AWQ's calibration batch: like the step's, from its own generator (seed + 1)
        gen = torch.Generator().manual_seed(seed + 1)
        vocab = m.config.vocab_size
        if data is None:
            calib = [torch.randint(0, vocab, (batch, seq), generator=gen).to(device)]
        else:
            i = torch.randint(0, len(data) - seq, (batch,), generator=gen)
            calib = [torch.stack([data[j: j + seq] for j in i.tolist()]).to(device)]
    peft = apply_peft(m, dtype, lora_rank, lora_targets, quant, lisa_layers, r.quant_group, calib)
    if peft is not None:
        _check_peft_options(peft, optimizer, optimizer_offload, step_in_backward)
    disk = optimizer_offload == "disk"
    folder = tempfile.TemporaryDirectory(prefix="labkit-measure-", dir=data_dir()) if disk else contextlib.nullcontext()
    with folder as path:
        gap = max(steps - 1, 1) if galore_refresh else None  # steps are counted from 0: step steps-1 refreshes
        opt = make_optimizer(m, optimizer, lr, foreach, rank, optimizer_offload, step_in_backward, path, gap,
                             proj_dtype)
        before = None
        if lisa_layers:
            from labkit.peft import LISA

            before = LISA(m, opt, gamma=lisa_layers, interval=LISA_INTERVAL, seed=seed).step
        try:
            return _measure(m, opt, model, batch, seq, dtype, optimizer, steps, budget, device, data, seed,
                            progress, checkpoint, segments, offload_activations, micro_batch, before,
                            r.selective_policy)
        finally:
            if hasattr(opt, "close"):
                opt.close()


def _measure(m, opt, model, batch, seq, dtype, optimizer, steps, budget, device, data, seed, progress,
             checkpoint, segments, offload_activations, micro_batch, before_step=None,
             selective: str = "matmuls") -> Measurement:
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

        wrap = checkpoint_blocks(m, checkpoint, segments, selective=selective)
    with wrap, cuda_limit(budget if real else None, device), \
            Ledger(m, opt, budget=None if real else budget, label=label, device=device) as led:
        for _ in tqdm(range(steps), desc=label, disable=not (steps >= 10 if progress is None else progress)):
            x, y = batch_xy()
            if before_step is not None:
                before_step()
            train_step(m, opt, x, y, dtype, micro_batch, offload_activations)
            del x, y
    return led.measurement()
