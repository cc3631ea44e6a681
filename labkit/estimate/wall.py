"""The memory wall: which models fit which GPU budgets for full fine-tuning, LoRA and QLoRA, predicted by `estimate`."""

from __future__ import annotations

from labkit.memory.units import GiB

from .estimator import estimate
from .recipe import Recipe

DEFAULT_BUDGETS_GIB = (16, 24, 80, 141)  # a T4/V100-16, an RTX 4090/A10, an A100/H100-80, an H200
METHODS = ("full", "lora", "qlora")  # plain training; LoRA on a frozen base; LoRA on an NF4 base (QLoRA)
DEFAULT_RECIPE = Recipe(None, 1, 1024, "mixed-bf16", device="cuda")  # fit_table's step: B=1 S=1024, AdamW
LORA_RANK = 16  # the adapters' rank when the recipe gives none


def default_models() -> list[str]:
    """Every preset except the tiny ones that exist for CPU measurement."""
    from labkit.models.hf import PRESETS

    return [name for name in PRESETS if not name.endswith("-tiny")]


ADAPTERS = ("base", "fp32")  # LoRA adapters in the base's dtype (the QLoRA paper's scripts), or fp32 (peft's)


def _row_recipe(recipe: Recipe, model, method: str, peft_dtype: str | None, adapters: str = "base",
                quant_set: str = "all-linear") -> Recipe:
    """One row's step: "full" the recipe without adapters; "lora" and "qlora" adapters of rank recipe.lora_rank
    (None: LORA_RANK) on recipe.lora_targets, "qlora" in NF4, the frozen base in `peft_dtype` (None: recipe.dtype).
    adapters "base": the adapters in that dtype too (artidoro/qlora casts its LoRA layers to bf16 under --bf16);
    "fp32": fp32 adapters and state under autocast over the 16-bit base, as peft's get_peft_model keeps them
    (Recipe.base_dtype)."""
    if method == "full":
        return recipe.replace(model=model, lora_rank=None, quant="none", quant_group=None, base_dtype=None)
    if adapters == "fp32":
        low = peft_dtype or recipe.frozen_dtype
        if low not in ("bf16", "fp16"):
            raise ValueError(f"adapters='fp32' keeps fp32 adapters over a 16-bit base: give peft_dtype 'bf16' or "
                             f"'fp16', not {low!r}")
        base = dict(dtype=f"mixed-{low}", base_dtype=low)
    else:
        base = dict(dtype=peft_dtype or recipe.dtype, base_dtype=None)
    qlora = method == "qlora"  # quant_set: which Linears its NF4 base stores (Recipe.quant_set)
    return recipe.replace(model=model, lora_rank=recipe.lora_rank or LORA_RANK, quant_group=None,
                          quant="nf4" if qlora else "none",
                          quant_set=quant_set if qlora else "all-linear", **base)


def fit_table(models=None, budgets_gib=DEFAULT_BUDGETS_GIB, recipe: Recipe = DEFAULT_RECIPE, methods=("full",),
              peft_dtype: str | None = "bf16", adapters: str = "base", quant_set: str = "all-linear"
              ) -> list[dict]:
    """One row per model and method: its predicted peak for one training step and whether it fits each budget.

    A row is {"model", "method", "dtype" (its step's, Recipe.dtype), "base_dtype" (its frozen
    base's storage, Recipe.frozen_dtype; None for full), "n_params", "peak" (bytes), "peak_phase",
    "fits": {budget in GiB: bool}};
    a model fits a budget when its predicted peak is at most budget x 2**30 bytes. recipe: the step of every
    row (batch, seq, dtype, optimizer, device, checkpoint, micro_batch, ...), its model left None: each row's
    is one of `models`. methods: some of METHODS ("full" fine-tuning in recipe.dtype, "lora", "qlora"). LoRA and
    QLoRA keep their frozen base in `peft_dtype` (bf16, as peft loads models; None: recipe.dtype) with adapters
    in that dtype (adapters="base", the QLoRA paper's scripts) or in fp32 under autocast (adapters="fp32", peft's
    default: Recipe.base_dtype), of rank recipe.lora_rank (None: LORA_RANK) on recipe.lora_targets;
    QLoRA's NF4 base holds quant_set's Linears (Recipe.quant_set). Nothing is allocated: every model
    is read on the meta device. Errors from `estimate` (say, seq beyond a model's positions) are
    raised, not hidden in the table.
    """
    models = default_models() if models is None else list(models)
    if not models:
        raise ValueError("fit_table needs at least one model")
    budgets = list(budgets_gib)
    if not budgets or any(not isinstance(b, (int, float)) or b <= 0 for b in budgets):
        raise ValueError(f"budgets must be positive numbers of GiB, got {budgets_gib!r}")
    if not isinstance(recipe, Recipe) or recipe.model is not None:
        raise ValueError(f"recipe must be a Recipe with model=None (each row's model is one of models), got {recipe!r}")
    methods = [methods] if isinstance(methods, str) else list(methods)
    if not methods:
        raise ValueError(f"methods must name at least one of {', '.join(METHODS)}")
    if adapters not in ADAPTERS:
        raise ValueError(f"adapters must be 'base' or 'fp32', got {adapters!r}")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method {unknown[0]!r}; choose from {', '.join(METHODS)}")
    rows = []
    for model in models:
        for method in methods:
            row = _row_recipe(recipe, model, method, peft_dtype, adapters, quant_set)
            try:
                e = estimate(row)
            except ValueError as err:  # name the model that failed
                raise ValueError(f"{model}: {err}") from err
            peak = e.peak.total  # bytes
            rows.append({
                "model": model if isinstance(model, str) else e.label.split(" ")[0],
                "method": method,
                "dtype": row.dtype,
                "base_dtype": None if method == "full" else row.frozen_dtype,
                "n_params": e.n_params,
                "peak": peak,
                "peak_phase": e.peak_phase,
                "fits": {b: peak <= b * GiB for b in budgets},
            })
    return rows
