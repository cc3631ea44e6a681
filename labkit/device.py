"""Pick and describe the device at hand, and size every lesson to it with one profile (smoke, cpu, small or big GPU)."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from labkit.models.gpt import GPTConfig

KINDS = ("cuda", "mps", "cpu")  # in order of preference
GiB = 2**30


# ----------------------------------------------------------------------------- picking


def _available() -> list[str]:
    kinds = []
    if torch.cuda.is_available():
        kinds.append("cuda")
    if torch.backends.mps.is_available():
        kinds.append("mps")
    return kinds + ["cpu"]


def pick_device(prefer: str | None = None) -> torch.device:
    """`prefer`, else env var LABKIT_DEVICE, else the best available: cuda > mps > cpu.

    A request may carry an index ("cuda:1"). An unknown or unavailable one raises ValueError.
    """
    request = prefer if prefer is not None else os.environ.get("LABKIT_DEVICE", "").strip()
    available = _available()
    if not request:
        return torch.device(available[0])
    request = str(request).lower()
    kind = request.split(":")[0]
    if kind not in KINDS:
        raise ValueError(
            f"unknown device {request!r}: choose one of {', '.join(KINDS)} (available here: {', '.join(available)})"
        )
    if kind not in available:
        raise ValueError(f"device {request!r} is not available here; available: {', '.join(available)}")
    if kind == "cuda" and ":" in request and int(request.split(":")[1]) >= torch.cuda.device_count():
        raise ValueError(f"device {request!r} does not exist: {torch.cuda.device_count()} CUDA device(s) here")
    return torch.device(request)


def smoke() -> bool:
    """True when env var LABKIT_SMOKE is "1", "true" or "yes" (CI sets it: tiny sizes, few steps)."""
    return os.environ.get("LABKIT_SMOKE", "").strip().lower() in ("1", "true", "yes", "on")


# ----------------------------------------------------------------------------- describing


@dataclass
class DeviceInfo:
    kind: str  # "cuda", "mps" or "cpu"
    name: str  # GPU name, or CPU model
    total_memory: int | None  # bytes: GPU memory on CUDA, system RAM otherwise; None if unknown
    bf16: bool  # bfloat16 matmuls run natively (not emulated)
    fp8: bool  # fp8 tensor cores (CUDA compute capability >= 8.9: Ada, Hopper, Blackwell)
    compute_capability: tuple[int, int] | None  # CUDA (major, minor); None off CUDA
    cores: int | None  # CPU cores, which set the pace of CPU lessons and data loading

    def __str__(self) -> str:
        mem = "unknown memory" if self.total_memory is None else f"{self.total_memory / GiB:.1f} GiB"
        if self.kind == "cpu":
            mem += " RAM"
        extras = [f"cc {self.compute_capability[0]}.{self.compute_capability[1]}"] if self.compute_capability else []
        extras += [x for x, ok in (("bf16", self.bf16), ("fp8", self.fp8)) if ok]
        extras.append(f"{self.cores} CPU cores")
        return f"{self.kind}: {self.name}, {mem}, {', '.join(extras)}"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _system_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _mps_bf16() -> bool:
    try:
        torch.ones(1, dtype=torch.bfloat16, device="mps")  # supported from macOS 14
        return True
    except (RuntimeError, TypeError):
        return False


class MixedPrecision(NamedTuple):
    """The mixed-precision scheme a CUDA GPU gets, and why."""

    dtype: str  # "mixed-bf16" or "mixed-fp16" (fp16 autocast with loss scaling: a GradScaler)
    why: str  # one sentence a lesson prints


def mixed_precision(name: str, capability: tuple[int, int]) -> MixedPrecision:
    """bf16 from compute capability 8.0 on (Ampere and later: bf16 tensor cores), fp16 with loss scaling below.

    A pure function of what the GPU is, not of `torch.cuda.is_bf16_supported()`: torch may answer True
    on a T4 (7.5), which runs bf16 only emulated, many times slower than its fp16 tensor cores. fp16's
    5 exponent bits underflow small gradients, so below 8.0 the step scales the loss (torch.amp.GradScaler,
    or labkit.precision.scaler's) and unscales the gradients before the optimizer.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"mixed_precision: the GPU's name must be a non-empty string, got {name!r}")
    if (not isinstance(capability, tuple) or len(capability) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in capability)):
        raise ValueError(f"mixed_precision: compute capability must be (major, minor) ints, got {capability!r}")
    cc = f"{capability[0]}.{capability[1]}"
    if capability >= (8, 0):
        return MixedPrecision("mixed-bf16", f"{name} (compute capability {cc}) has bf16 tensor cores: mixed bf16.")
    return MixedPrecision(
        "mixed-fp16",
        f"{name} has compute capability {cc} < 8.0: no bf16 in hardware (only emulated, slowly), so mixed "
        "precision here is fp16 with loss scaling (a GradScaler), not bf16.")


def describe(device: str | torch.device | None = None) -> DeviceInfo:
    """What the device is and can do; `device` defaults to pick_device()."""
    device = pick_device() if device is None else torch.device(device)
    cores = os.cpu_count()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        cc = (props.major, props.minor)
        bf16 = mixed_precision(props.name, cc).dtype == "mixed-bf16"  # not torch's answer: a T4 may emulate bf16
        return DeviceInfo("cuda", props.name, props.total_memory, bf16, cc >= (8, 9), cc, cores)
    if device.type == "mps":  # unified memory: the GPU shares system RAM
        return DeviceInfo("mps", f"Apple GPU ({_cpu_name()})", _system_memory(), _mps_bf16(), False, None, cores)
    if device.type == "cpu":
        return DeviceInfo("cpu", _cpu_name(), _system_memory(), True, False, None, cores)
    raise ValueError(f"cannot describe device type {device.type!r}; labkit knows {', '.join(KINDS)}")


# ----------------------------------------------------------------------------- profiles

DTYPES = ("fp32", "fp16", "bf16", "mixed-fp16", "mixed-bf16")


@dataclass
class Profile:
    name: str  # "smoke", "cpu", "small-gpu" or "big-gpu"
    gpt: dict[str, Any] = field(default_factory=dict)  # GPTConfig keyword arguments for the lesson model
    batch: int = 8  # sequences per step
    seq: int = 128  # tokens per sequence (at most gpt["block_size"])
    steps: int = 50  # training steps a lesson runs
    dtype: str = "fp32"  # default precision scheme, one of DTYPES
    hf_preset: str = "gpt2-tiny"  # labkit.models.hf preset that lessons build for measurement
    budget_gib: float = 1.0  # demo memory budget (GiB) the budget sliders start at

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"Profile.dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.seq > self.gpt.get("block_size", GPTConfig.block_size):
            raise ValueError(f"Profile.seq ({self.seq}) exceeds the model's block_size")

    def gpt_config(self, **overrides: Any) -> GPTConfig:
        """The lesson's GPTConfig; keyword overrides replace fields (e.g. attention="manual")."""
        return GPTConfig(**{**self.gpt, **overrides})


def _gpt(n_layer: int, n_head: int, n_embd: int, block_size: int) -> dict[str, Any]:
    # vocab 256: the byte tokenizer; dropout 0: no masks, so measured activations match the estimates
    return dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, vocab_size=256, dropout=0.0)


def _budget(fixed_gib: float, info: DeviceInfo) -> float:
    """A fixed demo budget, but never more than half of what the device has."""
    if info.total_memory is None:
        return fixed_gib
    return min(fixed_gib, round(info.total_memory / GiB / 2, 1))


def profile(device: str | torch.device | DeviceInfo | None = None, smoke_mode: bool | None = None) -> Profile:
    """Sizes for the device at hand; `smoke_mode` None reads LABKIT_SMOKE, a bool decides outright."""
    info = device if isinstance(device, DeviceInfo) else describe(device)
    if smoke() if smoke_mode is None else smoke_mode:
        # ~0.1M params: a training step takes milliseconds on one CPU core, so CI runs every cell
        return Profile("smoke", _gpt(2, 2, 64, 64), batch=4, seq=64, steps=3, dtype="fp32",
                       hf_preset="gpt2-tiny", budget_gib=_budget(0.25, info))
    if info.kind != "cuda":
        # ~3.3M params, seq 256: about 0.4 s a step on an idle 2-core laptop, so 50 steps in well
        # under a minute, and enough capacity for samples to start looking like verse.
        # MPS uses it too: its unified memory is shared with everything else on the machine.
        return Profile("cpu", _gpt(4, 4, 256, 256), batch=8, seq=256, steps=50, dtype="fp32",
                       hf_preset="gpt2-tiny", budget_gib=_budget(2.0, info))
    mixed = "mixed-bf16" if info.bf16 else "mixed-fp16"  # T4 / V100: fp16 with loss scaling (mixed_precision)
    if info.total_memory is None or info.total_memory < 40 * GiB:
        # GPT-2-small shape (86M params with a byte vocab): weights, grads and fp32 Adam take
        # ~1.4 GB and batch 8 x 512 activations ~1.5 GB, so a 16 GiB T4 has room for the lessons
        # to grow it until it does not fit.
        return Profile("small-gpu", _gpt(12, 12, 768, 1024), batch=8, seq=512, steps=200, dtype=mixed,
                       hf_preset="gpt2", budget_gib=_budget(8.0, info))
    # >= 40 GiB (A100-80GB, H100, H200): GPT-2-medium shape (303M params), full 1024 context, batch 16
    return Profile("big-gpu", _gpt(24, 16, 1024, 1024), batch=16, seq=1024, steps=200, dtype=mixed,
                   hf_preset="gpt2-medium", budget_gib=_budget(40.0, info))
