"""Check a plan by running it: its steps under the Ledger on the device at hand, predicted vs measured peak.

On a CPU the plan's memory per device is a simulated budget (labkit.run.measure_step(budget=...)): the ledger
raises where a GPU with that much memory would have failed. Data-parallel and ZeRO plans run one process per
rank on gloo (labkit.distributed.dp_ranks.measure_ranks, at most 4 ranks). The prediction compared is the
estimate of the same recipe on the device at hand (fused attention and dropout masks differ between CPU and
CUDA, so the plan's own CUDA peak is reported beside it).
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.memory.report import Variant
from labkit.memory.units import fmt_bytes

MAX_PARAMS = 20_000_000  # a model this large runs a few steps in seconds on a laptop CPU; above it, refuse
MAX_RANKS = 4  # processes verify launches for a data-parallel plan


@dataclass(frozen=True)
class Verification:
    """What running the plan showed."""

    summary: str  # the plan's recipe in one line
    device: str  # where it ran ("cpu" or "cuda")
    budget: int  # bytes per device it ran under
    planned_peak: int  # the plan's predicted peak (for the device it plans for)
    predicted: int  # the estimate of the same recipe on this device
    measured: int | None  # the ledger's peak (the largest rank's); None when it ran out of memory
    fits: bool  # it ran within the budget
    message: str = ""  # the out-of-memory error, when it did not fit

    @property
    def error(self) -> float | None:
        """(predicted - measured) / measured."""
        return None if self.measured is None else (self.predicted - self.measured) / self.measured

    def as_dict(self) -> dict:
        return {"summary": self.summary, "device": self.device, "budget": self.budget,
                "planned_peak": self.planned_peak, "predicted": self.predicted, "measured": self.measured,
                "fits": self.fits, "relative_error": self.error, "message": self.message}

    def __str__(self) -> str:
        if self.measured is None:
            return f"verify on {self.device}: did not fit {fmt_bytes(self.budget)}: {self.message}"
        return (f"verify on {self.device}: measured peak {fmt_bytes(self.measured)}, predicted {fmt_bytes(self.predicted)} "
                f"({100 * self.error:+.2f} %), within {fmt_bytes(self.budget)}: {'yes' if self.fits else 'no'}")


def check_runnable(recipe) -> None:
    """Refuse what verify cannot run, with the reason (the parameter count, the layout)."""
    from labkit.estimate.spec import spec_from

    spec = spec_from(recipe.model, **recipe.config)
    if spec.n_params > MAX_PARAMS:
        raise ValueError(f"verify runs the plan for real: {spec.name} has {spec.n_params:,} parameters, more than "
                         f"{MAX_PARAMS:,}; verify a smaller model (e.g. gpt2-tiny or llama-tiny)")
    if recipe.tp > 1 or recipe.pp > 1:
        raise ValueError("verify measures single-device and data-parallel plans; this plan uses "
                         f"tp={recipe.tp} pp={recipe.pp}")
    if recipe.dp > MAX_RANKS:
        raise ValueError(f"verify launches one process per data-parallel rank, at most {MAX_RANKS}; "
                         f"this plan has dp={recipe.dp}")
    if recipe.dp > 1:
        from labkit.models.gpt import GPTConfig

        if not isinstance(recipe.model, GPTConfig) or recipe.dtype != "fp32" or recipe.optimizer != "adamw" \
                or recipe.micro < recipe.rank_batch:
            raise ValueError("per-rank measurement (labkit.distributed.dp_ranks) runs labkit's GPT (a gpt:... model) "
                             "in fp32 with AdamW and no micro-batches; this data-parallel plan is "
                             f"{recipe.dtype} {recipe.optimizer} with micro-batch {recipe.micro} of {recipe.rank_batch}")


def verify(plan, steps: int = 2, device: str | None = None) -> Verification:
    """Run `plan` (a labkit.plan.Plan) for `steps` steps under the Ledger and compare with its prediction.

    device: "cpu" (default: cuda when available, else cpu). On the CPU the budget is simulated; on CUDA it
    is set with torch.cuda.set_per_process_memory_fraction (labkit.memory.budget.cuda_limit)."""
    import torch

    from labkit.estimate import estimate
    from labkit.memory.budget import SimulatedOutOfMemoryError

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ValueError(f"steps must be an integer >= 2 (the first makes the optimizer state), got {steps!r}")
    kind = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    check_runnable(plan.recipe)
    r = plan.recipe.replace(device=kind)
    e = estimate(r)
    galore = r.optimizer.startswith("galore")
    if galore:  # measured steps after the first do not refresh the projector (measure_step's default gap)
        e = e.without(Variant.REFRESH)
    predicted = e.peak.total
    base = dict(summary=plan.summary(), device=kind, budget=plan.memory, planned_peak=plan.peak, predicted=predicted)
    if r.dp > 1:
        return _verify_ranks(r, steps, base)
    from labkit.run.step import measure_step

    try:
        m = measure_step(r, steps=steps, budget=plan.memory)
    except SimulatedOutOfMemoryError as err:
        return Verification(**base, measured=None, fits=False, message=" ".join(str(err).split()))
    except torch.OutOfMemoryError as err:  # the real limit, on CUDA
        return Verification(**base, measured=None, fits=False, message=" ".join(str(err).split())[:300])
    measured = m.of_step(steps).peak.total
    return Verification(**base, measured=measured, fits=measured <= plan.memory)


def _verify_ranks(r, steps: int, base: dict) -> Verification:
    """Data-parallel plans: one gloo process per rank; the largest rank's peak against the budget."""
    from labkit.distributed.dp_ranks import measure_ranks

    if base["device"] != "cpu":
        raise ValueError("verify measures data-parallel plans on the CPU (gloo): give device='cpu'")
    ms = measure_ranks(r, world=r.dp, steps=steps)
    measured = max(m.peak.total for m in ms)
    return Verification(**base, measured=measured, fits=measured <= base["budget"])
