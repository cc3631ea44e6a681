"""Read the training config a person already has into a Recipe: a torchtune recipe YAML, an axolotl YAML, a
Hugging Face TrainingArguments JSON, an accelerate config YAML, a DeepSpeed JSON, or a folder that labkit's
`plan --export` wrote (the readers of its files are labkit.plan.export's; this module adds the rest).

    >>> reading = read_config("llama3_2/3B_lora_single_device.yaml", seq=2048)   # doctest: +SKIP
    >>> reading.recipe, reading.ignored, reading.approximated                      # doctest: +SKIP

Every field that changes a step's memory becomes a Recipe field. Every other field is named in
`Reading.ignored` with the reason it changes nothing labkit predicts, and a field that labkit models
only approximately is named in `Reading.approximated` with what it models instead: no field is dropped
silently. A config that labkit cannot model raises ConfigRefused, whose `reason` is a Refusal key.

Sources of the field names: torchtune's recipe configs (its package ships them under recipes/configs;
https://pytorch.org/torchtune/stable/deep_dives/configs.html) and axolotl's config reference
(https://docs.axolotl.ai/docs/config-reference.html).
"""

from __future__ import annotations

import enum
import json
import pathlib
import re
import textwrap
from dataclasses import dataclass, field

import yaml

from labkit.estimate.recipe import Recipe


class Refusal(enum.Enum):
    """Why a config cannot become a Recipe (the key code decides on; `ConfigRefused` words it)."""

    NOT_TRAINING = "not a training step"  # generation, evaluation, quantization: no optimizer
    SECOND_MODEL = "a second model"  # distillation's teacher, DPO/PPO's reference and reward models
    ARCHITECTURE = "architecture not modelled"  # the estimator knows GPT-2 and Llama blocks
    TECHNIQUE = "technique not modelled"  # e.g. quantization-aware training, 4-bit optimizer states
    NO_SEQUENCE = "no sequence length"  # neither the config nor the caller gives one
    UNKNOWN_FORMAT = "unknown format"  # neither torchtune's nor axolotl's schema


class ConfigRefused(ValueError):
    """A config labkit cannot turn into a Recipe; `reason` is a Refusal."""

    def __init__(self, reason: Refusal, message: str):
        super().__init__(f"{reason.value}: {message}")
        self.reason = reason


class Format(enum.Enum):
    TORCHTUNE = "torchtune recipe config"
    AXOLOTL = "axolotl config"
    TRAINING_ARGS = "transformers TrainingArguments (JSON)"
    ACCELERATE = "accelerate config"
    DEEPSPEED = "DeepSpeed config"
    LABKIT_EXPORT = "labkit plan --export folder"


@dataclass(frozen=True)
class Reading:
    """A config read into a Recipe, with what was left out and why."""

    recipe: Recipe
    format: Format
    path: str
    mapped: tuple[str, ...]  # config fields that set a Recipe field
    ignored: tuple[tuple[str, str], ...] = ()  # (field, why it changes no predicted byte)
    approximated: tuple[tuple[str, str], ...] = ()  # (field, what labkit models instead)
    assumed: tuple[tuple[str, str], ...] = ()  # (Recipe field, where its value came from)

    def fields_named(self) -> set[str]:
        """Every config field this reading accounts for (mapped, ignored or approximated)."""
        return set(self.mapped) | {k for k, _ in self.ignored} | {k for k, _ in self.approximated}

    def summary(self) -> str:
        """Lines for a terminal: the source, then what was approximated, assumed and ignored."""
        lines = [f"read {self.path} ({self.format.value})"]
        for word, pairs in (("approximated", self.approximated), ("assumed", self.assumed)):
            for k, why in pairs:
                lines += textwrap.wrap(f"{word}: {k}: {why}", 100, initial_indent="  ", subsequent_indent="    ",
                                       break_on_hyphens=False)
        if self.ignored:
            names = ", ".join(f"`{k}`" for k, _ in self.ignored)
            lines += textwrap.wrap("ignored (no memory effect): " + names, 100, initial_indent="  ",
                                   subsequent_indent="    ")
        return "\n".join(lines)


@dataclass
class _Notes:
    """What one reader collects while it maps fields."""

    mapped: list[str] = field(default_factory=list)
    ignored: list[tuple[str, str]] = field(default_factory=list)
    approximated: list[tuple[str, str]] = field(default_factory=list)
    assumed: list[tuple[str, str]] = field(default_factory=list)

    def reading(self, recipe: Recipe, fmt: Format, path: str) -> Reading:
        return Reading(recipe, fmt, path, tuple(self.mapped), tuple(self.ignored), tuple(self.approximated),
                       tuple(self.assumed))


# ----------------------------------------------------------------------------- shared tables

# Fields of either schema that set nothing a training step's memory depends on.
NO_MEMORY = {
    # torchtune
    "output_dir": "where files go", "checkpointer": "where weights are read and written",
    "seed": "randomness", "shuffle": "the order of rows", "epochs": "how many steps",
    "max_steps_per_epoch": "how many steps", "metric_logger": "logging", "log_every_n_steps": "logging",
    "log_peak_memory_stats": "logging", "profiler": "the profiler is off in the shipped configs",
    "lr_scheduler": "the learning rate's schedule", "resume_from_checkpoint": "where weights come from",
    "save_adapter_weights_only": "what is saved", "log_level": "logging",
    "low_cpu_ram": "host memory while the checkpoint loads, not the step",
    "collate_fn": "how rows are padded (the step's shape is batch x seq)",
    "dataloader": "how rows are read", "dataset": "which rows (packing: see sample_packing)",
    "clip_grad_norm": "a norm over gradients that exist anyway (one scalar per tensor)",
    # axolotl
    "datasets": "which rows", "dataset_prepared_path": "a cache folder", "val_set_size": "evaluation rows",
    "num_epochs": "how many steps", "learning_rate": "the learning rate", "lr_scheduler_type": "schedule",
    "warmup_steps": "schedule", "warmup_ratio": "schedule", "weight_decay": "a coefficient",
    "logging_steps": "logging", "eval_steps": "evaluation", "evals_per_epoch": "evaluation",
    "saves_per_epoch": "saving", "save_steps": "saving", "wandb_project": "logging",
    "wandb_entity": "logging", "wandb_watch": "logging", "wandb_name": "logging",
    "wandb_log_model": "logging", "special_tokens": "the tokenizer", "tokenizer_type": "the tokenizer",
    "model_type": "read from base_model", "strict": "config checking", "train_on_inputs": "the loss mask",
    "group_by_length": "the order of rows", "early_stopping_patience": "when to stop",
    "resume_from_checkpoint_path": "where weights come from", "local_rank": "launcher",
    "debug": "logging", "tf32": "matmul precision, not storage", "lora_alpha": "a scale",
    "lora_dropout": "a mask the size of the input each adapter already saves",
    "lora_fan_in_fan_out": "a weight layout", "lora_model_dir": "where adapters come from",
    "hub_model_id": "where weights go", "max_grad_norm": "a norm over gradients that exist anyway",
    "chat_template": "the tokenizer", "eval_sample_packing": "evaluation", "xformers_attention": "attention "
    "kernel (labkit predicts torch's fused SDPA on cuda, which keeps no S x S probabilities either)",
    "flash_attention": "attention kernel (labkit predicts torch's fused SDPA on cuda, which keeps no "
    "S x S probabilities either)", "sdp_attention": "attention kernel (torch's SDPA, as predicted)",
    "pad_to_sequence_len": "every row is counted at sequence_len (the worst case) either way",
    "sample_packing": "packing changes which tokens share a row, not the (micro_batch, sequence_len) shape",
    "is_llama_derived_model": "read from base_model", "trust_remote_code": "loading",
    "base_model_config": "read from base_model", "tokenizer_config": "the tokenizer",
}

# labkit's model names for the architectures configs name (labkit.models.hf PRESETS and CONFIG_PRESETS).
MODELS = {
    "llama2_7b": "llama2-7b", "llama2_13b": "llama2-13b", "llama2_70b": "llama2-70b",
    "llama3_8b": "llama3-8b", "llama3_70b": "llama3-70b", "llama3_1_8b": "llama3.1-8b",
    "llama3_1_70b": "llama3.1-70b", "llama3_1_405b": "llama3.1-405b", "llama3_2_1b": "llama3.2-1b",
    "llama3_2_3b": "llama3.2-3b", "llama3_3_70b": "llama3.3-70b", "code_llama2_7b": "code-llama2-7b",
    "code_llama2_13b": "code-llama2-13b", "code_llama2_70b": "code-llama2-70b", "mistral_7b": "mistral-7b",
    "gpt2": "gpt2", "gpt2_medium": "gpt2-medium", "gpt2_large": "gpt2-large", "gpt2_xl": "gpt2-xl",
}
# Families whose blocks differ from GPT-2's and Llama's in what they store (why, in a sentence).
NOT_MODELLED = {
    "qwen2": "Qwen2's q, k and v projections carry biases and its small models tie a 151,936-row embedding",
    "qwen2_5": "Qwen2.5's q, k and v projections carry biases",
    "gemma": "Gemma's GeGLU MLP, scaled embedding and 256-wide heads",
    "gemma2": "Gemma 2's logit soft-capping and alternating local/global attention",
    "phi3": "Phi-3's fused qkv and gate/up projections",
    "phi4": "Phi-4's fused qkv and gate/up projections",
    "llama3_2_vision": "Llama 3.2 Vision's image encoder and cross-attention layers",
}
# torchtune's LoRA module names -> the Hugging Face Llama module names labkit's Recipe uses
TT_LORA_NAMES = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "output_proj": "o_proj"}
LLAMA_MLP = ("gate_proj", "up_proj", "down_proj")


def _optimizer(component: str, kwargs: dict, key: str, notes: _Notes) -> dict:
    """An optimizer class path (torch, bitsandbytes, torchao, ...) or a transformers optimizer name ->
    Recipe keywords; paged and fused variants are named in notes."""
    name = component.rsplit(".", 1)[-1].lower()
    out: dict = {}
    if "4bit" in name:
        raise ConfigRefused(Refusal.TECHNIQUE, f"{component}: 4-bit optimizer states are not modelled")
    if "galore" in name:
        out["optimizer"] = "galore8bit" if "8bit" in name else "galore"
        out["rank"] = int(kwargs.get("rank", 128))
    elif "lion" in name:
        out["optimizer"] = "lion"
    elif "adafactor" in name:
        out["optimizer"] = "adafactor"
    elif "sgd" in name:
        out["optimizer"] = "sgd-momentum" if float(kwargs.get("momentum", 0) or 0) else "sgd"
    elif "adam" in name:
        eight = "8bit" in name
        out["optimizer"] = ("adam8bit" if eight else "adam") if name.startswith("adam") and "adamw" not in name \
            else ("adamw8bit" if eight else "adamw")
    else:
        raise ConfigRefused(Refusal.TECHNIQUE, f"optimizer {component!r} is not one labkit models")
    if "paged" in name:  # bitsandbytes' paged optimizers: states in CUDA unified memory (_paged)
        out["paged_states"] = component
    if kwargs.get("fused"):
        out["foreach"] = False
        notes.approximated.append((f"{key}.fused", "the fused kernel keeps no list-wide temporaries: "
                                                   "predicted as the per-parameter path (foreach=False)"))
    return out


def _paged(kw: dict, notes: _Notes) -> None:
    """A paged optimizer's states in unified memory (Recipe.paged_states) on one device; over
    several, where labkit does not model them, counted on the device and named as approximated."""
    from labkit.estimate.recipe import PAGED_OPTIMIZERS

    component = kw.pop("paged_states", None)
    if component is None:
        return
    one = kw.get("dp", 1) == 1 and not kw.get("zero") and not kw.get("optimizer_offload")
    if one and kw.get("optimizer") in PAGED_OPTIMIZERS:
        kw["paged_states"] = True
    else:
        notes.approximated.append(("optimizer", f"{component}: paged states counted on the device "
                                                "(labkit models them on one device)"))


def _first_int(text: str, pattern: str) -> int | None:
    m = re.search(pattern, text)
    return int(m.group(1)) if m else None


# ----------------------------------------------------------------------------- torchtune


def _torchtune_model(model: dict, notes: _Notes) -> dict:
    """torchtune's model component and the LoRA builder's keywords -> Recipe keywords."""
    component = model.get("_component_", "")
    builder = component.rsplit(".", 1)[-1]
    family = component.split(".")[2] if component.count(".") >= 3 else ""
    notes.mapped.append("model")
    out: dict = {}
    kind = "full"
    for prefix in ("qlora_", "lora_"):
        if builder.startswith(prefix):
            kind, builder = prefix[:-1], builder[len(prefix):]
            break
    if builder not in MODELS:
        why = NOT_MODELLED.get(family, f"torchtune's {builder}")
        raise ConfigRefused(Refusal.ARCHITECTURE, f"{component}: {why} (the estimator knows GPT-2 and Llama)")
    out["model"] = MODELS[builder]
    if kind == "full":
        return out
    targets = [TT_LORA_NAMES[m] for m in model.get("lora_attn_modules", [])]
    if model.get("apply_lora_to_mlp"):
        targets += LLAMA_MLP
    if model.get("apply_lora_to_output"):
        targets.append("lm_head")
    out.update(lora_rank=int(model.get("lora_rank", 8)), lora_targets=tuple(targets))
    if kind == "qlora":  # torchtune's qlora_* builders: each LoRA-wrapped linear in NF4, only those
        out.update(quant="nf4", quant_set="targets")
    if model.get("use_dora"):
        notes.approximated.append(("model.use_dora", "DoRA's magnitude vectors predicted as LoRA"))
    if model.get("quantize_base") and kind == "lora":
        out.update(quant="nf4", quant_set="targets")
    return out


def _torchtune_devices(header: str, cfg: dict, devices: int | None, notes: _Notes) -> int:
    """A distributed recipe's world size: the caller's, else `--nproc_per_node N` in the config's
    launch comment, else 1 (named as assumed)."""
    if devices:
        notes.assumed.append(("devices", f"{devices}, as given"))
        return devices
    n = _first_int(header, r"--nproc_per_node[ =](\d+)")
    nodes = re.search(r"(\d+) nodes w/ (\d+)", header)
    if nodes:
        n = int(nodes.group(1)) * int(nodes.group(2))
        notes.assumed.append(("devices", f"{n}, from the config's comment ({nodes.group(0)} devices)"))
        return n
    if n:
        notes.assumed.append(("devices", f"{n}, from the config's launch comment (--nproc_per_node)"))
        return n
    if "_distributed" in header or "fsdp_cpu_offload" in cfg:
        notes.assumed.append(("devices", "1: the launch comment names no --nproc_per_node; give devices=N"))
    return 1


def read_torchtune(cfg: dict, path: str, header: str = "", seq: int | None = None,
                   devices: int | None = None) -> Reading:
    """A torchtune recipe config (already parsed) -> Reading. `header` is the file's comment lines (the
    launch command says how many processes); `seq` and `devices` fill what the config leaves open."""
    notes = _Notes()
    for key in ("teacher_model", "kd_loss", "ref_checkpointer", "policy_model", "reward_and_value_model"):
        if key in cfg:
            raise ConfigRefused(Refusal.SECOND_MODEL, f"`{key}`: the step holds a second model")
    loss = (cfg.get("loss") or {}).get("_component_", "")
    if "DPO" in loss or "PPO" in loss:
        raise ConfigRefused(Refusal.SECOND_MODEL, f"{loss}: a frozen reference model beside the policy")
    if "quantizer" in cfg and "optimizer" in cfg:
        raise ConfigRefused(Refusal.TECHNIQUE, "`quantizer`: quantization-aware training (fake-quantized "
                                               "weights and activations) is not modelled")
    if "optimizer" not in cfg or "model" not in cfg:
        raise ConfigRefused(Refusal.NOT_TRAINING, "no optimizer: generation, evaluation or quantization")
    kw = _torchtune_model(cfg["model"], notes)
    kw.update(_optimizer(cfg["optimizer"].get("_component_", ""), cfg["optimizer"], "optimizer", notes))
    notes.mapped.append("optimizer")
    dtype = cfg.get("dtype", "fp32")
    kw["dtype"] = {"bf16": "bf16", "fp32": "fp32", "fp16": "fp16"}[dtype]
    kw["device"] = "cuda" if str(cfg.get("device", "cuda")).startswith("cuda") else "cpu"
    notes.mapped += ["dtype", "device"]
    if cfg.get("enable_activation_checkpointing"):
        kw["checkpoint"] = "full"
    if cfg.get("enable_activation_offloading"):
        kw["offload_activations"] = True
    if cfg.get("optimizer_in_bwd"):
        kw["step_in_backward"] = True
    notes.mapped += [k for k in ("enable_activation_checkpointing", "enable_activation_offloading",
                                 "optimizer_in_bwd") if k in cfg]
    tok = cfg.get("tokenizer") or {}
    if tok.get("max_seq_len"):
        seq_len = int(tok["max_seq_len"])
    elif seq:
        seq_len = seq
        notes.assumed.append(("seq", f"{seq}, as given (tokenizer.max_seq_len is null: rows are padded "
                                     "to the longest in each batch)"))
    else:
        raise ConfigRefused(Refusal.NO_SEQUENCE, "tokenizer.max_seq_len is null (rows are padded to the "
                                                 "longest in each batch): give seq=N (--seq N)")
    notes.mapped.append("tokenizer")
    ga = int(cfg.get("gradient_accumulation_steps", 1))
    micro = int(cfg.get("batch_size", 1))
    notes.mapped += [k for k in ("batch_size", "gradient_accumulation_steps") if k in cfg]
    tp = int(cfg.get("tensor_parallel_dim", 1) or 1)
    world = _torchtune_devices(header, cfg, devices, notes)
    dp = max(world // tp, 1)
    if tp > 1:
        kw["tp"] = tp
    if "tensor_parallel_dim" in cfg:
        notes.mapped.append("tensor_parallel_dim")
    if "tensor_parallel_plan" in cfg:
        notes.approximated.append(("tensor_parallel_plan", "Megatron's split of attention and MLP"))
    if dp > 1:
        kw.update(dp=dp, zero=3)  # FSDP2's fully_shard (reshard after forward): ZeRO-3
        notes.approximated.append(("distributed", "FSDP2 fully_shard per block, predicted as ZeRO-3"))
    if "fsdp_cpu_offload" in cfg and not cfg["fsdp_cpu_offload"]:
        notes.mapped.append("fsdp_cpu_offload")
    if cfg.get("fsdp_cpu_offload"):
        if dp > 1:
            kw["zero_offload"] = True
        notes.approximated.append(("fsdp_cpu_offload", "parameters and gradients on the host too; "
                                                       "predicted as ZeRO-Offload (optimizer state only)"))
    for key in ("custom_sharded_layers", "fsdp", "memory_efficient_fsdp_wrap", "fsdp_reshard_after_forward",
                "ac_mode", "ac_option"):
        if key in cfg:
            notes.approximated.append((key, "FSDP and checkpointing details: predicted as ZeRO-3 per block "
                                            "and full checkpointing"))
    if loss.endswith("CEWithChunkedOutputLoss"):  # its num_output_chunks (torchtune's default 8)
        kw["loss_chunks"] = min(int(cfg["loss"].get("num_output_chunks", 8)), seq_len)
        notes.mapped.append("loss")
    elif "Chunked" in loss:
        notes.approximated.append(("loss", f"{loss}: the head and loss in chunks; predicted with the whole "
                                           "logits in fp32 (an overestimate of the loss's bytes)"))
    elif loss:
        notes.mapped.append("loss")
    if cfg.get("compile"):
        notes.approximated.append(("compile", "compile: not modelled (eager memory predicted)"))
    elif "compile" in cfg:
        notes.mapped.append("compile")
    for key in cfg:
        if key in NO_MEMORY and key not in notes.mapped:
            notes.ignored.append((key, NO_MEMORY[key]))
    if kw.get("step_in_backward") and ga > 1:
        raise ConfigRefused(Refusal.TECHNIQUE, "optimizer_in_bwd with gradient_accumulation_steps > 1: "
                                               "torchtune refuses it too (gradients are freed at once)")
    batch = micro * ga * dp
    _paged(kw, notes)
    recipe = Recipe.of(kw.pop("model"), batch, seq_len, micro_batch=micro if ga > 1 else None, **kw)
    _account_rest(cfg, notes)
    return notes.reading(recipe, Format.TORCHTUNE, path)


# ----------------------------------------------------------------------------- axolotl

# axolotl (transformers.TrainingArguments) optimizer names -> an optimizer class name _optimizer reads
HF_OPTIMIZERS = {
    "adamw_torch": "AdamW", "adamw_torch_fused": "AdamW", "adamw_hf": "AdamW", "adamw_apex_fused": "AdamW",
    "adamw_bnb_8bit": "AdamW8bit", "adamw_8bit": "AdamW8bit", "paged_adamw_8bit": "PagedAdamW8bit",
    "paged_adamw_32bit": "PagedAdamW", "adafactor": "Adafactor", "sgd": "SGD", "lion_32bit": "Lion",
    "paged_lion_32bit": "PagedLion", "galore_adamw": "GaLoreAdamW", "galore_adamw_8bit": "GaLoreAdamW8bit",
    "adamw_torch_4bit": "AdamW4bit",
}


def model_name(hub_id: str) -> str:
    """A hub id (e.g. "NousResearch/Llama-2-7b-hf") -> labkit's name for its architecture, or the id
    itself when no offline model matches (labkit.models.hf then reads it from the cache or the hub)."""
    base = hub_id.rstrip("/").split("/")[-1].lower()
    base = re.sub(r"^meta-", "", base)
    base = re.sub(r"(-instruct|-chat|-hf|-it|-v0\.\d)+$", "", base)
    base = base.replace("-", "_").replace(".", "_")
    base = re.sub(r"^llama_(\d)", r"llama\1", base)
    base = base.replace("codellama", "code_llama2")
    return MODELS.get(base, hub_id)


def read_axolotl(cfg: dict, path: str, devices: int | None = None) -> Reading:
    """An axolotl config (already parsed) -> Reading; a `deepspeed:` JSON it names is read too."""
    notes = _Notes()
    if "base_model" not in cfg:
        raise ConfigRefused(Refusal.UNKNOWN_FORMAT, "an axolotl config names its model in `base_model`")
    name = model_name(str(cfg["base_model"]))
    from labkit.models import hf

    hf.get_config(name)  # the error `estimate --model` gives for a model not available offline
    notes.mapped.append("base_model")
    kw: dict = {"device": "cuda"}
    adapter = cfg.get("adapter")
    if cfg.get("load_in_4bit"):  # transformers + bitsandbytes: every Linear but the head
        kw.update(quant="nf4", quant_set="all-linear")
    elif cfg.get("load_in_8bit"):
        kw.update(quant="int8", quant_set="all-linear")
    if adapter in ("lora", "qlora"):
        kw["lora_rank"] = int(cfg.get("lora_r", 8))
        if cfg.get("lora_target_linear"):
            kw["lora_targets"] = "all-linear"
        else:
            kw["lora_targets"] = tuple(cfg.get("lora_target_modules") or ("q_proj", "v_proj"))
    elif adapter:
        raise ConfigRefused(Refusal.TECHNIQUE, f"adapter {adapter!r} is not modelled (lora and qlora are)")
    elif kw.get("quant"):
        raise ConfigRefused(Refusal.TECHNIQUE, "a quantized base without an adapter cannot be trained")
    notes.mapped += [k for k in ("load_in_4bit", "load_in_8bit", "adapter", "lora_r", "lora_target_linear",
                                 "lora_target_modules") if k in cfg]
    half = "bf16" if cfg.get("bf16") in (True, "auto") else "fp16" if cfg.get("fp16") else None
    if half and adapter:
        kw["dtype"] = f"mixed-{half}"  # peft keeps the adapters in fp32 under the Trainer's autocast
        notes.approximated.append(("bf16" if half == "bf16" else "fp16",
                                   f"the base loads in {half}; predicted in fp32 under autocast"))
    elif half:
        kw["dtype"] = half  # axolotl loads the model in the 16-bit dtype the Trainer then trains
        notes.mapped.append("bf16" if half == "bf16" else "fp16")
    else:
        kw["dtype"] = "fp32"
    for k in ("bf16", "fp16"):
        if k in cfg and k not in notes.mapped and k not in dict(notes.approximated):
            notes.mapped.append(k)
    if "sequence_len" not in cfg:
        raise ConfigRefused(Refusal.NO_SEQUENCE, "axolotl's `sequence_len` is missing")
    seq = int(cfg["sequence_len"])
    micro = int(cfg.get("micro_batch_size", 1))
    ga = int(cfg.get("gradient_accumulation_steps", 1))
    notes.mapped += [k for k in ("sequence_len", "micro_batch_size", "gradient_accumulation_steps") if k in cfg]
    gc = cfg.get("gradient_checkpointing")
    if gc:
        kw["checkpoint"] = "full"
        if gc == "offload":
            kw["offload_activations"] = True
        notes.mapped.append("gradient_checkpointing")
    if "optimizer" in cfg:
        opt = str(cfg["optimizer"])
        if opt not in HF_OPTIMIZERS:
            raise ConfigRefused(Refusal.TECHNIQUE, f"optimizer {opt!r} is not one labkit models")
        kw.update(_optimizer(HF_OPTIMIZERS[opt], cfg.get("optim_args") or {}, "optimizer", notes))
        if opt == "adamw_torch_fused":
            kw["foreach"] = False
        notes.mapped.append("optimizer")
    dp = devices or 1
    if devices:
        notes.assumed.append(("devices", f"{devices}, as given"))
    ds = cfg.get("deepspeed")
    if ds:
        stage, offload = _deepspeed_zero(pathlib.Path(path).parent / ds)
        notes.mapped.append("deepspeed")
        if dp > 1 and stage:
            kw.update(dp=dp, zero=stage, zero_offload=offload)
        else:
            notes.assumed.append(("zero", f"ZeRO-{stage} needs devices=N (the launcher sets it); one device"))
    if cfg.get("fsdp") or cfg.get("fsdp_config"):
        notes.approximated.append(("fsdp", "FSDP predicted as ZeRO-3 per block"))
        if dp > 1:
            kw.update(dp=dp, zero=3)
    for key in cfg:
        if key in NO_MEMORY and key not in notes.mapped:
            notes.ignored.append((key, NO_MEMORY[key]))
    _paged(kw, notes)
    recipe = Recipe.of(name, micro * ga * dp, seq, micro_batch=micro if ga > 1 else None, **kw)
    _account_rest(cfg, notes)
    return notes.reading(recipe, Format.AXOLOTL, path)


def _deepspeed_zero(path: pathlib.Path) -> tuple[int, bool]:
    """A DeepSpeed JSON's ZeRO stage and whether it offloads the optimizer state (0, False if missing)."""
    try:
        ds = json.loads(path.read_text())
    except (OSError, ValueError):
        return 0, False
    zero = ds.get("zero_optimization") or {}
    off = (zero.get("offload_optimizer") or {}).get("device", "none") not in ("none", None)
    return int(zero.get("stage", 0)), off


def _account_rest(cfg: dict, notes: _Notes) -> None:
    """Name every top-level field no rule above named: it is not modelled (never dropped silently)."""
    named = set(notes.mapped) | {k.split(".")[0] for k, _ in notes.approximated} | {k for k, _ in notes.ignored}
    for key in cfg:
        if key not in named:
            notes.ignored.append((key, "not modelled"))


# ----------------------------------------------------------------------------- front door


EXAMPLES = pathlib.Path(__file__).with_name("example_configs")


def example_configs() -> dict[str, pathlib.Path]:
    """The configs labkit ships (written in torchtune's and axolotl's schemas), by file name."""
    return {p.name: p for p in sorted(EXAMPLES.glob("*.y*ml"))}


# TrainingArguments fields that set nothing a step's memory depends on, by prefix
TA_NO_MEMORY = ("output_dir", "overwrite_output_dir", "do_", "eval", "prediction_loss_only",
                "per_device_eval_batch_size", "learning_rate", "weight_decay", "adam_", "max_grad_norm",
                "num_train_epochs", "max_steps", "lr_scheduler", "warmup", "log", "save", "seed", "data_seed",
                "dataloader_", "disable_tqdm", "remove_unused_columns", "label_", "load_best_model_at_end",
                "metric_for_best_model", "greater_is_better", "ignore_data_skip", "resume_from_checkpoint",
                "push_to_hub", "hub_", "report_to", "run_name", "include_", "full_determinism", "tf32",
                "local_rank", "ddp_", "jit_mode_eval", "use_ipex", "restore_callback_states_from_checkpoint",
                "past_index", "length_column_name", "group_by_length", "auto_find_batch_size",
                "batch_eval_metrics", "skip_memory_metrics", "use_legacy_prediction_loop", "split_batches",
                "accelerator_config", "average_tokens_across_devices", "project", "trackio_space_id")


def _model_for(name, model, path: str):
    """The model a config names (labkit's export writes it), else the caller's `model=`."""
    if model is not None:
        return model
    if name:
        return name
    raise ConfigRefused(Refusal.UNKNOWN_FORMAT, f"{path} names no model: give model=NAME (--model NAME)")


def read_training_args(doc: dict, path: str, model=None, seq: int | None = None,
                       devices: int | None = None) -> Reading:
    """A TrainingArguments dict (its JSON; `TrainingArguments(**doc)` takes it) -> Reading. Batch sizes are
    per device; the model and the sequence length come from the caller (a TrainingArguments has neither)."""
    from labkit.plan.export import _recipe_from, from_training_args

    notes = _Notes()
    entry = doc.get("model") or {}
    name = _model_for(entry.get("name") if isinstance(entry, dict) else None, model, path)
    try:
        fields = from_training_args(doc)
    except ValueError as e:
        raise ConfigRefused(Refusal.TECHNIQUE, str(e)) from None
    if "seq" not in fields:
        if not seq:
            raise ConfigRefused(Refusal.NO_SEQUENCE, "a TrainingArguments sets no sequence length: give "
                                                     "seq=N (--seq N)")
        fields["seq"] = seq
        notes.assumed.append(("seq", f"{seq}, as given"))
    if devices:
        fields["devices"] = devices
        notes.assumed.append(("devices", f"{devices}, as given"))
    notes.mapped += [k for k in ("per_device_train_batch_size", "gradient_accumulation_steps", "bf16", "fp16",
                                 "optim", "optim_args", "fsdp", "fsdp_config", "activation_checkpointing",
                                 "gradient_checkpointing", "use_cpu", "model", "peft",
                                 "gradient_checkpointing_kwargs") if k in doc]
    for key in doc:
        if key.startswith(TA_NO_MEMORY) and key not in notes.mapped:
            notes.ignored.append((key, "no memory effect on a training step"))
    if doc.get("torch_compile"):
        notes.approximated.append(("torch_compile", "compile: not modelled (eager memory predicted)"))
    _account_rest(doc, notes)
    return notes.reading(_recipe_from(name, fields), Format.TRAINING_ARGS, path)


def read_deepspeed(doc: dict, path: str, model=None, seq: int | None = None,
                   devices: int | None = None) -> Reading:
    """A DeepSpeed JSON -> Reading (ZeRO stage, optimizer offload, bf16/fp16, micro-batch, accumulation);
    the model, the sequence length and the number of processes come from the caller."""
    from labkit.plan.export import _recipe_from, from_deepspeed

    notes = _Notes()
    name = _model_for(None, model, path)
    if not seq:
        raise ConfigRefused(Refusal.NO_SEQUENCE, "a DeepSpeed config sets no sequence length: give seq=N")
    n = devices or 1
    notes.assumed += [("seq", f"{seq}, as given"), ("devices", f"{n}, " + ("as given" if devices else
                                                                           "the launcher sets it: give devices=N"))]
    try:
        fields = from_deepspeed(doc, n)
    except ValueError as e:
        raise ConfigRefused(Refusal.TECHNIQUE, str(e)) from None
    fields.update(seq=seq, devices=n)
    if fields["zero"] and n == 1 and not fields["zero_offload"]:
        notes.approximated.append(("zero_optimization", f"ZeRO-{fields['zero']} over one process shards "
                                                        "nothing: predicted without ZeRO"))
        fields["zero"] = 0
    notes.mapped += [k for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "bf16", "fp16",
                                 "zero_optimization", "optimizer") if k in doc]
    for key in ("train_batch_size", "steps_per_print", "gradient_clipping", "wall_clock_breakdown", "scheduler"):
        if key in doc:
            notes.ignored.append((key, "no memory effect on a training step"))
    _account_rest(doc, notes)
    return notes.reading(_recipe_from(name, fields), Format.DEEPSPEED, path)


def read_accelerate(doc: dict, path: str, model=None, seq: int | None = None, batch: int | None = None) -> Reading:
    """An accelerate config YAML -> Reading (processes, mixed precision, FSDP's sharding, offload and
    checkpointing); the model, rows per device (batch) and the sequence length come from the caller."""
    from labkit.plan.export import _dtype_of, _recipe_from, from_accelerate

    notes = _Notes()
    name = _model_for(None, model, path)
    if not seq or not batch:
        raise ConfigRefused(Refusal.NO_SEQUENCE, "an accelerate config sets no batch or sequence length: give "
                                                 "batch=N (rows per device) and seq=N")
    fields = from_accelerate(doc)
    fields["dtype"] = _dtype_of(fields.pop("mixed_precision"), "float32")
    if fields["zero"] == 0:
        fields.pop("checkpoint", None)
    if fields["devices"] == 1 and fields["zero"]:
        notes.approximated.append(("fsdp_config", "FSDP over one process shards nothing: predicted without it"))
        fields["zero"], fields["zero_offload"] = 0, False
    fields.update(seq=seq, micro=batch, accumulation=1)
    notes.assumed += [("seq", f"{seq}, as given"), ("batch", f"{batch} rows per device, as given")]
    notes.mapped += [k for k in ("num_processes", "mixed_precision", "distributed_type", "fsdp_config", "use_cpu")
                     if k in doc]
    for key in ("compute_environment", "machine_rank", "main_training_function", "num_machines", "rdzv_backend",
                "same_network", "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "downcast_bf16", "debug",
                "enable_cpu_affinity", "gpu_ids", "main_process_port", "main_process_ip"):
        if key in doc:
            notes.ignored.append((key, "launch details"))
    _account_rest(doc, notes)
    return notes.reading(_recipe_from(name, fields), Format.ACCELERATE, path)


def read_labkit_export(folder: pathlib.Path, target: str | None = None) -> Reading:
    """A folder `plan --export` wrote -> Reading of the Recipe that `target`'s files launch (default: the
    first target that carries every field; labkit.plan.export.read_export)."""
    from labkit.plan.export import TARGETS, read_export

    plan = json.loads((folder / "plan.json").read_text())
    refused = plan.get("refused") or {}
    chosen = target or next((t for t in TARGETS if not refused.get(t)), "torchrun")
    notes = _Notes(mapped=[chosen])
    if refused.get(chosen):
        notes.approximated.append((chosen, f"this target does not carry: {refused[chosen]}"))
    return notes.reading(read_export(folder, chosen), Format.LABKIT_EXPORT, str(folder))


def read_config(path, seq: int | None = None, devices: int | None = None, model=None,
                batch: int | None = None, target: str | None = None) -> Reading:
    """A training config -> Reading (its Recipe, and what was ignored or approximated): a torchtune or
    axolotl YAML, a TrainingArguments JSON, an accelerate config YAML, a DeepSpeed JSON, or a folder that
    `plan --export` wrote.

    seq: the sequence length when the config leaves it open (torchtune's `max_seq_len: null`, and every
    TrainingArguments, accelerate and DeepSpeed config); devices: the world size, which a launcher sets;
    model: the model for configs that name none (TrainingArguments, accelerate, DeepSpeed); batch: rows per
    device for an accelerate config; target: which exported target's files to read in an export folder.
    `path` may also be a transformers.TrainingArguments object (its `to_dict()` is read as its JSON).
    """
    if hasattr(path, "to_dict") and hasattr(path, "per_device_train_batch_size"):
        return read_training_args(path.to_dict(), "TrainingArguments", model, seq, devices)
    p = pathlib.Path(path)
    if p.is_dir():
        if (p / "plan.json").is_file():
            return read_labkit_export(p, target)
        raise ConfigRefused(Refusal.UNKNOWN_FORMAT, f"{path} is a folder without the plan.json of a labkit export")
    try:
        text = p.read_text()
    except OSError as e:
        raise FileNotFoundError(f"cannot read the config {path}: {e.strerror}") from None
    try:
        cfg = yaml.safe_load(text)  # JSON is YAML
    except yaml.YAMLError as e:
        raise ConfigRefused(Refusal.UNKNOWN_FORMAT, f"{path} is not YAML or JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigRefused(Refusal.UNKNOWN_FORMAT, f"{path} holds no mapping of fields")
    header = "\n".join(line for line in text.splitlines() if line.lstrip().startswith("#"))
    model_entry = cfg.get("model")
    if isinstance(model_entry, dict) and str(model_entry.get("_component_", "")).startswith("torchtune."):
        return read_torchtune(cfg, str(path), header, seq, devices)
    if "output_dir" in cfg and "checkpointer" in cfg:  # torchtune without a model: generation, eval
        return read_torchtune(cfg, str(path), header, seq, devices)
    if "base_model" in cfg:
        return read_axolotl(cfg, str(path), devices)
    if "per_device_train_batch_size" in cfg or "optim" in cfg:
        return read_training_args(cfg, str(path), model, seq, devices)
    if "zero_optimization" in cfg or "train_micro_batch_size_per_gpu" in cfg:
        return read_deepspeed(cfg, str(path), model, seq, devices)
    if "distributed_type" in cfg or "compute_environment" in cfg:
        return read_accelerate(cfg, str(path), model, seq, batch)
    raise ConfigRefused(Refusal.UNKNOWN_FORMAT, f"{path}: not a torchtune recipe config (model._component_), an "
                                                "axolotl config (base_model), a TrainingArguments JSON, a "
                                                "DeepSpeed JSON or an accelerate config")


def from_config(path, **given) -> Recipe:
    """The Recipe of a training config (read_config(path, **given).recipe)."""
    return read_config(path, **given).recipe
