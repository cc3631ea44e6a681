"""The memory wall: which models fit which GPU budgets for plain training, predicted by `estimate`."""

from __future__ import annotations

from .estimate import estimate
from .units import GiB

DEFAULT_BUDGETS_GIB = (16, 24, 80, 141)  # a T4/V100-16, an RTX 4090/A10, an A100/H100-80, an H200


def default_models() -> list[str]:
    """Every preset except the tiny ones that exist for CPU measurement."""
    from labkit.models.hf import PRESETS

    return [name for name in PRESETS if not name.endswith("-tiny")]


def fit_table(models=None, budgets_gib=DEFAULT_BUDGETS_GIB, batch: int = 1, seq: int = 1024,
              dtype: str = "mixed-bf16", optimizer: str = "adamw", device: str = "cuda") -> list[dict]:
    """One row per model: its predicted peak for one plain training step and whether it fits each budget.

    A row is {"model", "n_params", "peak" (bytes), "peak_phase", "fits": {budget in GiB: bool}}; a model
    fits a budget when its predicted peak is at most budget x 2**30 bytes. Nothing is allocated: every
    model is read on the meta device. Errors from `estimate` (say, seq beyond a model's positions)
    are raised, not hidden in the table.
    """
    models = default_models() if models is None else list(models)
    if not models:
        raise ValueError("fit_table needs at least one model")
    budgets = list(budgets_gib)
    if not budgets or any(not isinstance(b, (int, float)) or b <= 0 for b in budgets):
        raise ValueError(f"budgets must be positive numbers of GiB, got {budgets_gib!r}")
    rows = []
    for model in models:
        try:
            e = estimate(model, batch, seq, dtype, optimizer, device=device)
        except ValueError as err:  # name the model that failed
            raise ValueError(f"{model}: {err}") from err
        peak = e.peak.total  # bytes
        rows.append({
            "model": model if isinstance(model, str) else e.label.split(" ")[0],
            "n_params": e.n_params,
            "peak": peak,
            "peak_phase": e.peak_phase,
            "fits": {b: peak <= b * GiB for b in budgets},
        })
    return rows
