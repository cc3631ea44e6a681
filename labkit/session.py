"""A lesson's first cell: `SMOKE, PROFILE, DEVICE, KIND = labkit.setup()`, with known third-party noise hidden.

Some libraries the lessons use print messages that are harmless here but show as red text under a
cell, where a learner takes them for errors. `quiet_known_warnings()` hides exactly those, each
matched by its category or logger, its module and its full message, and nothing else: a new or
changed message still shows. Every entry says why it is harmless.

Standard library only at import: `import labkit` stays cheap; torch loads when `setup()` runs.
"""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

    from labkit.device import Profile


@dataclass(frozen=True)
class KnownWarning:
    """A `warnings.warn` to hide: its category, the module that warns, and its whole message."""

    category: type[Warning]
    module: str  # the warning's module (warnings' `module` filter, matched exactly)
    message: str  # the whole message, matched exactly
    why: str  # why it is harmless in the lessons


@dataclass(frozen=True)
class KnownLog:
    """A `logging` record to hide: its logger, its level, and its whole formatted message."""

    logger: str
    level: int
    message: str  # record.getMessage(), matched exactly
    why: str


KNOWN_WARNINGS = (
    KnownWarning(
        FutureWarning, "transformers.modeling_utils",
        "`is_gradient_checkpointing` is deprecated and will be removed in v6. "
        "Use `is_activation_checkpointing` instead.",
        "peft's PeftModel reads model.is_gradient_checkpointing, which transformers 5 keeps as a deprecated "
        "alias of is_activation_checkpointing: same value (lesson 08, peft's LoRA on MiniLM)."),
    KnownWarning(
        UserWarning, "torchdata.stateful_dataloader.stateful_dataloader",
        "'set_vital' is deprecated, please do not call",
        "torchdata 0.11's StatefulDataLoader calls torch.set_vital (usage telemetry), which torch 2.13 turned "
        "into a no-op that warns: nothing is lost (lesson 12's reference loader)."),
)

KNOWN_LOGS = (
    KnownLog(
        "bitsandbytes.backends.cpu.ops", logging.WARNING,
        "Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'. "
        "Please make sure you already `pip install kernels` and the kernels >= 0.11.1",
        "on CPUs with AVX512-BF16, importing bitsandbytes (0.50) tries an optional faster 4-bit matmul from "
        "the Hugging Face `kernels` package; without it bitsandbytes uses its own CPU kernel, with the same "
        "results (lessons 05, 07, 08 import bitsandbytes for parity checks)."),
    KnownLog(
        "bitsandbytes.backends.cpu.ops", logging.WARNING,
        "Failed to load CPU gemm_4bit_forward from kernels-community: Kernel repository "
        "'kernels-community/quantization-bitsandbytes' could not verify publisher trust status. Set "
        "trust_remote_code=True or add the repository ID to the trust_remote_code allowlist to allow loading "
        "kernels from untrusted sources.. Please make sure you already `pip install kernels` and the kernels >= 0.11.1",
        "the same optional kernel where `kernels` is installed (transformers 5.25 requires kernels 0.19): kernels "
        "refuses code from a Hub repository nobody trusted (labkit never sets trust_remote_code), and "
        "bitsandbytes uses its own CPU kernel, with the same results."),
)


class _HideKnownRecords(logging.Filter):
    """Drops a logger's records whose level and formatted message match one of `known` exactly."""

    def __init__(self, known: tuple[KnownLog, ...]):
        super().__init__()
        self.known = {(k.level, k.message) for k in known}

    def filter(self, record: logging.LogRecord) -> bool:
        return (record.levelno, record.getMessage()) not in self.known


def quiet_known_warnings() -> None:
    """Hide the messages in KNOWN_WARNINGS and KNOWN_LOGS, and only those. Calling it again changes nothing.

    Warnings: one `ignore` filter per entry (category, module and whole message, all exact).
    Logging: one filter on each named logger (the logger object exists before its library is imported).
    """
    for k in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(k.message) + r"\Z", category=k.category,
                                module=re.escape(k.module) + r"\Z")  # re-adding an identical filter only moves it
    for name in sorted({k.logger for k in KNOWN_LOGS}):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _HideKnownRecords) for f in logger.filters):
            logger.addFilter(_HideKnownRecords(tuple(k for k in KNOWN_LOGS if k.logger == name)))


def optional_import(module: str, skipped: str):
    """`module` imported, or None after printing that `skipped` does not run without it.

    For the production tools a lesson compares with but does not need (bitsandbytes: labkit's Colab install
    cell adds it only where a CUDA GPU is present). A module that is installed but fails to import raises.
    """
    import importlib

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module.split(".")[0]:
            raise
        colab = "; the Colab install cell installs it only on a GPU runtime" if module == "bitsandbytes" else ""
        print(f"{module} is not installed here, so {skipped} is skipped (pip install {module} runs it{colab}).")
        return None


class Lesson(NamedTuple):
    """What a lesson's first cell needs; every size and step count follows from it."""

    smoke: bool  # LABKIT_SMOKE=1 (CI sets it): tiny sizes, a few seconds per notebook
    profile: Profile  # sizes for this device: "smoke", "cpu", "small-gpu" or "big-gpu"
    device: torch.device  # cuda > mps > cpu (LABKIT_DEVICE=cpu forces one); MPS measures on the CPU
    kind: str  # "cpu" or "cuda": which kernels estimate(..., device=kind) models


def setup() -> Lesson:
    """Start a lesson: hide the known third-party noise, read LABKIT_SMOKE, pick the profile and the device.

    On a CUDA GPU below compute capability 8.0 (a Colab T4) it prints why the profile's mixed precision
    is fp16 with loss scaling rather than bf16 (labkit.device.mixed_precision).
    On Apple's MPS the lessons measure on the CPU: the estimator models CPU and CUDA kernels, and the
    profile for MPS is the CPU's anyway (its memory is the system's).
    """
    quiet_known_warnings()
    import torch

    from labkit import device as dev

    smoke = dev.smoke()
    profile = dev.profile()
    device = dev.pick_device()
    if device.type == "mps":
        device = torch.device("cpu")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        choice = dev.mixed_precision(props.name, (props.major, props.minor))
        if profile.dtype == choice.dtype == "mixed-fp16":  # a T4, V100: say why mixed precision is not bf16
            print(choice.why)
    return Lesson(smoke, profile, device, device.type)
