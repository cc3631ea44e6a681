"""Parameter-efficient fine-tuning from scratch: LoRA, QLoRA (LoRA on an NF4-frozen base) and LISA."""

from .lora import (LoRAConfig, LoRALinear, LoRALinearNaive, ParamCounts, adapter_numel, apply_lora, count_parameters,
                   find_targets, linear_names, lora_modules, lora_scaling, lora_state_dict, merge_lora,
                   trainable_parameters)
from .qlora import NF4Base, NF4Config, apply_qlora, base_bytes, qlora_optimizer, to_nf4
from .lisa import LISA, LISANaive, find_layers, lisa_bound, lisa_memory_trace
from .tasks import (FOLIO_GENRES, TASK_CLASSES, AdaptTask, Adaptation, ClassifyTask, MeanPoolClassifier, TaskResult,
                    adapt_task, classify_task, format_results, passages)

__all__ = [
    "AdaptTask",
    "Adaptation",
    "ClassifyTask",
    "FOLIO_GENRES",
    "LISA",
    "LISANaive",
    "LoRAConfig",
    "LoRALinear",
    "LoRALinearNaive",
    "MeanPoolClassifier",
    "NF4Base",
    "NF4Config",
    "ParamCounts",
    "TASK_CLASSES",
    "TaskResult",
    "adapt_task",
    "adapter_numel",
    "apply_lora",
    "apply_qlora",
    "base_bytes",
    "classify_task",
    "count_parameters",
    "find_layers",
    "find_targets",
    "format_results",
    "linear_names",
    "lisa_bound",
    "lisa_memory_trace",
    "lora_modules",
    "lora_scaling",
    "lora_state_dict",
    "merge_lora",
    "passages",
    "qlora_optimizer",
    "to_nf4",
    "trainable_parameters",
]
