"""Optimizers that spend less memory on state: 8-bit Adam, Lion, Adafactor, GaLore, step-in-backward, offload, paging."""

from . import adafactor, adam8bit, galore, galore8bit, lion, offload, paged, step_in_backward
from .adafactor import Adafactor, AdafactorHP, factored_second_moment, inverse_sqrt_second_moment
from .adam8bit import Adam8bit, Adam8bitHP, AdamW8bit, adam8bit_update_naive
from .base import state_bytes
from .galore import GaLoreAdamW, GaLoreHP, galore_adam_naive, galore_param_groups
from .galore8bit import GaLoreAdamW8bit
from .lion import Lion, lion_update_naive
from .offload import OFFLOAD_TARGETS, OffloadAdamW, offload_adamw_step_naive
from .paged import PagedAdamW, PagedLion, predict_paging
from .step_in_backward import StepInBackward, step_in_backward_naive

__all__ = [
    "Adafactor", "AdafactorHP", "Adam8bit", "Adam8bitHP", "AdamW8bit", "GaLoreAdamW", "GaLoreAdamW8bit", "GaLoreHP", "Lion",
    "OFFLOAD_TARGETS", "OffloadAdamW",
    "PagedAdamW", "PagedLion", "StepInBackward", "adafactor", "adam8bit", "adam8bit_update_naive",
    "factored_second_moment", "galore", "galore8bit", "galore_adam_naive", "galore_param_groups",
    "inverse_sqrt_second_moment", "lion", "lion_update_naive", "offload", "offload_adamw_step_naive", "paged",
    "predict_paging", "state_bytes", "step_in_backward", "step_in_backward_naive",
]
