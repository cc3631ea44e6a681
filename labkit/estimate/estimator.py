"""The front door: one training step's Estimate on any layout, from the single-device estimate (predict), data
parallelism and ZeRO (zero_terms) and tensor and pipeline parallelism (layout_terms), which sit below it."""

from __future__ import annotations

from labkit.memory.report import Estimate

from . import keyed, layout_terms, zero_terms
from .predict import single_estimate
from .recipe import Recipe, as_recipe


def estimate(model, batch: int | None = None, seq: int | None = None, dtype: str = "fp32", optimizer: str = "adamw",
             **options) -> Estimate:
    """Predict one steady-state training step (gradients set to None between steps) as moments made of terms.

    Give a `labkit.estimate.Recipe`, or a model with batch, seq and the Recipe's other fields as keywords
    (any other keyword overrides the preset's config, e.g. n_layer=2):
    model: preset name, config path, hub id, GPTConfig, GPT or transformers model/config.
    device: "cpu" or "cuda" (fused attention and dropout masks differ); foreach: Adam's foreach
    path (default: on CUDA only, as torch.optim does).
    checkpoint: "none", "full" (k = `segments` segments, default every block), "sqrt" or
    "selective" (keep the outputs of `selective_policy`'s ops: "matmuls", the default, or "attention-core"),
    as labkit.recompute.checkpoint_blocks applies them.
    offload_activations: saved activations live in host memory (labkit.recompute.offload_activations).
    micro_batch: rows per micro-batch, dividing `batch` (gradient accumulation).
    rank: GaLore's rank (optimizer "galore" or "galore8bit"). GaLore's optimizer moments come twice: a
    projector-refresh step (an SVD per matrix, every update_proj_gap steps) and a steady step, each named
    in its `where` ("projector refresh" / "no projector refresh"); the peak is the larger.
    proj_dtype: 8-bit GaLore's projector precision ("param", the default, "fp32" or "int8").
    optimizer_offload: "cpu" or "disk": AdamW's state lives off the device (labkit.optim.OffloadAdamW).
    paged_states: the optimizer's states in CUDA unified memory (bitsandbytes' PagedAdamW and
    PagedAdamW8bit; adamw, adamw8bit, adam, adam8bit or lion): left out of every moment and the
    peak (what max_memory_allocated reports), their bytes in `Estimate.unified`; `paging(e, budget)`
    says what the driver pages out under a budget.
    step_in_backward: each parameter steps as soon as its gradient is ready (labkit.optim.StepInBackward,
    any optimizer; not with optimizer_offload or micro_batch).
    lora_rank: LoRA adapters of rank r on `lora_targets` ("all-linear": every Linear but lm_head, or
    module names / endings such as "q_proj,v_proj"), every base parameter frozen (labkit.peft.apply_lora).
    quant: the frozen base of the adapted Linears: "none", "int8" (per-row absmax codes), "nf4"
    (QLoRA: NF4 with double quantization, labkit.peft.apply_qlora), "int4" (group-wise round-to-nearest) or
    "int4-awq" (AWQ, its per-input-channel scale kept in each layer); needs lora_rank.
    quant_group: int4's group size along the input features (default 128); it must divide every
    quantized d_in.
    quant_set: which Linears `quant` stores: "all-linear" (every Linear but the head, whatever
    lora_targets: transformers + bitsandbytes' load_in_4bit, the default) or "targets" (the adapted
    ones: torchtune's qlora builders).
    lisa_layers: LISA with gamma = lisa_layers active layers (labkit.peft.LISA); not with lora_rank.
    base_dtype: the frozen base's precision under LoRA/QLoRA: "bf16"/"fp16" with dtype "mixed-bf16"/"mixed-fp16"
    is peft's setup (16-bit base, fp32 adapters under autocast); None: the trained weights' dtype.
    """
    if isinstance(model, Recipe):
        if batch is not None or seq is not None or options or (dtype, optimizer) != ("fp32", "adamw"):
            raise TypeError("give a Recipe alone, or a model with batch, seq and options, not both")
        recipe = model
    else:
        recipe = Recipe.of(model, batch, seq, dtype=dtype, optimizer=optimizer, **options)
    if recipe.tp > 1 or recipe.pp > 1:
        est = max(layout_terms.estimate_ranks(recipe), key=lambda e: e.peak.total)  # the rank that needs the most
    elif recipe.dp > 1 or recipe.zero:
        est = zero_terms.data_parallel_estimate(recipe)
    else:
        est = single_estimate(recipe)
    if not est.textbook:  # estimate_ranks gives each rank its stage's textbook layer
        keyed.attach(est, recipe)
    return est


def paging(e: Estimate, budget: int):
    """What a budget of `budget` device bytes makes the driver do to paged states
    (Recipe.paged_states): labkit.optim.paged.predict_paging of the step whose peak with the states
    resident is e.peak.total + e.unified. Its `evicted` bytes go to host RAM at the peak (0: they
    stay on the device); `fits` is False when the device peak alone is over the budget (paging every
    state out would not make room). The driver moves whole pages (labkit.optim.paged.PAGE_SIZE, its
    large page), so the states leave in whole pages."""
    import dataclasses
    import math

    from labkit.optim.paged import PAGE_SIZE, predict_paging

    if not e.unified:
        raise ValueError("this estimate keeps no states in unified memory: give paged_states=True")
    pages = math.ceil(e.unified / PAGE_SIZE) * PAGE_SIZE
    p = predict_paging(e.peak.total + e.unified, budget, state_bytes=pages)
    return dataclasses.replace(p, fits=p.fits and e.peak.total <= budget)  # the rest must fit


def estimate_ranks(model, batch: int | None = None, seq: int | None = None, **options) -> list[Estimate]:
    """One Estimate per rank of a tensor- and pipeline-parallel layout (Recipe tp, pp, schedule,
    sequence_parallel, micro_batch), in the order stage 0's tp ranks, stage 1's, ...; `estimate` of the same
    recipe is the largest of them (labkit.estimate.layout_terms)."""
    return layout_terms.estimate_ranks(as_recipe(model, batch, seq, **options))
