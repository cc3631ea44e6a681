"""The memory wall: which models fit which GPU budgets for full fine-tuning, LoRA and QLoRA, predicted by `estimate`."""

from __future__ import annotations

from labkit.memory.units import GiB

from .estimator import estimate

DEFAULT_BUDGETS_GIB = (16, 24, 80, 141)  # a T4/V100-16, an RTX 4090/A10, an A100/H100-80, an H200
METHODS = ("full", "lora", "qlora")  # plain training; LoRA on a frozen base; LoRA on an NF4 base (QLoRA)


def default_models() -> list[str]:
    """Every preset except the tiny ones that exist for CPU measurement."""
    from labkit.models.hf import PRESETS

    return [name for name in PRESETS if not name.endswith("-tiny")]


def method_options(method: str, lora_rank: int = 16, lora_targets="all-linear") -> dict:
    """estimate() keyword arguments of a method: "full" none; "lora" and "qlora" adapters of rank
    `lora_rank` on `lora_targets`, "qlora" with the base in NF4."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    if method == "full":
        return {}
    return {"lora_rank": lora_rank, "lora_targets": lora_targets, "quant": "nf4" if method == "qlora" else "none"}


def fit_table(models=None, budgets_gib=DEFAULT_BUDGETS_GIB, batch: int = 1, seq: int = 1024,
              dtype: str = "mixed-bf16", optimizer: str = "adamw", device: str = "cuda", methods=("full",),
              lora_rank: int = 16, lora_targets="all-linear", peft_dtype: str | None = "bf16",
              checkpoint: str = "none", micro_batch: int | None = None) -> list[dict]:
    """One row per model and method: its predicted peak for one training step and whether it fits each budget.

    A row is {"model", "method", "n_params", "peak" (bytes), "peak_phase", "fits": {budget in GiB: bool}};
    a model fits a budget when its predicted peak is at most budget x 2**30 bytes. methods: some of
    METHODS ("full" fine-tuning in `dtype`, "lora", "qlora"). LoRA and QLoRA keep their frozen base
    in `peft_dtype` (bf16, as peft loads models; None: `dtype`) with adapters of rank `lora_rank` on
    `lora_targets`; checkpoint and micro_batch as estimate() takes them, for every row. Nothing is allocated:
    every model is read on the meta device. Errors from `estimate` (say, seq beyond a model's positions) are
    raised, not hidden in the table.
    """
    models = default_models() if models is None else list(models)
    if not models:
        raise ValueError("fit_table needs at least one model")
    budgets = list(budgets_gib)
    if not budgets or any(not isinstance(b, (int, float)) or b <= 0 for b in budgets):
        raise ValueError(f"budgets must be positive numbers of GiB, got {budgets_gib!r}")
    methods = [methods] if isinstance(methods, str) else list(methods)
    if not methods:
        raise ValueError(f"methods must name at least one of {', '.join(METHODS)}")
    options = {m: method_options(m, lora_rank, lora_targets) for m in methods}
    rows = []
    for model in models:
        for method in methods:
            kind = dtype if method == "full" or peft_dtype is None else peft_dtype
            try:
                e = estimate(model, batch, seq, kind, optimizer, device=device, checkpoint=checkpoint,
                             micro_batch=micro_batch, **options[method])
            except ValueError as err:  # name the model that failed
                raise ValueError(f"{model}: {err}") from err
            peak = e.peak.total  # bytes
            rows.append({
                "model": model if isinstance(model, str) else e.label.split(" ")[0],
                "method": method,
                "n_params": e.n_params,
                "peak": peak,
                "peak_phase": e.peak_phase,
                "fits": {b: peak <= b * GiB for b in budgets},
            })
    return rows
