"""A plan as configuration that existing engines run: Hugging Face TrainingArguments, an accelerate config,
and a torchrun + FSDP2 script.

`export_plan(recipe, out_dir, devices)` writes into `out_dir`:

- training_args.json: keywords for `transformers.TrainingArguments` (names as of transformers 5.x:
  `activation_checkpointing` is the current name of `gradient_checkpointing`; FSDP is `fsdp=True` with its
  settings in `fsdp_config`), and beside them, as separate top-level keys, `peft` (peft.LoraConfig and
  transformers.BitsAndBytesConfig keywords), `model` (what to load and in which dtype) and `notes`.
- accelerate_config.yaml: an `accelerate launch --config_file` config (FSDP2 when ZeRO is on).
- train_fsdp2.py + plan_config.json: a torchrun script (FSDP2's `fully_shard` per block, as lesson 09's
  labkit/distributed/scripts/train_fsdp2.py) that reads the plan from the JSON next to it.
- ds_config.json: a DeepSpeed config (field names of DeepSpeed's config schema, as `deepspeed.runtime.config.DeepSpeedConfig`
  reads them: `zero_optimization.stage`, `zero_optimization.offload_optimizer`, `bf16`/`fp16`,
  `gradient_accumulation_steps`, `train_micro_batch_size_per_gpu`, `optimizer`). No labkit recipe offloads the
  parameters themselves, so `zero_optimization.offload_param` (ZeRO-3 only) is never written.
- plan.json and README.txt: the recipe's fields, the notes and the launch commands.

Every recipe field that no engine option reproduces (labkit's selective or sqrt recompute policies, disk
offload, LISA, ...) becomes a line in `notes`, never silence.

Targets. A launch reads several of these files, so each target is the set a launch uses: "training_args"
(training_args.json: transformers.Trainer), "accelerate" (accelerate_config.yaml + training_args.json),
"torchrun" (train_fsdp2.py + plan_config.json) and "deepspeed" (ds_config.json + training_args.json, as
TrainingArguments(deepspeed=...) reads them). `export_gaps(recipe, devices)` lists, per target, every
memory-changing field (MEMORY_FIELDS) whose value that target cannot express: a target with a gap is refused
(plan.json's "refused", the first notes, and `python -m labkit plan --export` prints them as warnings), since
the run it launches would not have the plan's memory. `read_export(folder, target)` reads a target's files
back into a Recipe: the round trip that tests/unit/test_plan_export_roundtrip.py checks for every field and
target. The readers of single files (`from_training_args`, `from_accelerate`, `from_deepspeed`,
`from_plan_config`) return the Recipe fields a file states, so configs written by hand read the same way.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from labkit.estimate.recipe import Recipe

TARGETS = ("training_args", "accelerate", "torchrun", "deepspeed")
FILE_NAMES = {"training_args": "training_args.json", "accelerate_config": "accelerate_config.yaml",
              "train_fsdp2": "train_fsdp2.py", "plan_config": "plan_config.json", "deepspeed": "ds_config.json"}
TARGET_FILES = {"training_args": ("training_args",), "accelerate": ("accelerate_config", "training_args"),
                "torchrun": ("train_fsdp2", "plan_config"), "deepspeed": ("deepspeed", "training_args")}
# the Recipe fields that change a step's memory (labkit.estimate reads each); model and overrides are the model
MEMORY_FIELDS = ("batch", "seq", "dtype", "optimizer", "device", "foreach", "checkpoint", "segments",
                 "selective_policy", "offload_activations", "micro_batch", "rank", "proj_dtype",
                 "optimizer_offload", "step_in_backward", "lora_rank", "lora_targets", "quant", "quant_group",
                 "quant_set", "lisa_layers", "dp", "zero", "zero_offload", "tp", "pp", "schedule",
                 "sequence_parallel", "paged_states")
# bitsandbytes' paged optimizers by their transformers OptimizerNames value (Recipe.paged_states)
HF_PAGED = {"adamw": "paged_adamw_32bit", "adamw8bit": "paged_adamw_8bit",
            "lion": "paged_lion_32bit"}

# labkit optimizer -> transformers OptimizerNames value (transformers.training_args.OptimizerNames)
HF_OPTIM = {"adamw": "adamw_torch", "adam": "adamw_torch", "sgd": "sgd", "sgd-momentum": "sgd",
            "adamw8bit": "adamw_bnb_8bit", "adam8bit": "adamw_bnb_8bit", "adafactor": "adafactor",
            "lion": "lion_32bit", "galore": "galore_adamw", "galore8bit": "galore_adamw_8bit"}
GALORE_TARGETS = ["attn", "mlp"]  # module-name substrings, as labkit.optim.galore_param_groups chooses
TORCH_SCRIPT_OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum")  # the script's own; others come from labkit.optim
FILES = ("training_args", "accelerate_config", "train_fsdp2", "plan_config", "plan", "readme", "deepspeed")
DS_OPTIMIZER = {"adamw": "AdamW", "adam": "Adam"}  # DeepSpeed optimizer types (CPU Adam when the state is offloaded)
NVME_PATH = "/local_nvme"  # a placeholder: the folder on a fast local disk that holds the offloaded state


def _model_entry(recipe: Recipe) -> dict:
    """What the script builds: {"kind": "labkit-gpt", "config": GPTConfig fields} or {"kind": "hf", "name": ...,
    "config": a transformers config dict (None when only the name is known)}."""
    from labkit.models.gpt import GPT, GPTConfig

    m, over = recipe.model, recipe.config
    if isinstance(m, GPT):
        m = m.config
    if isinstance(m, GPTConfig):
        return {"kind": "labkit-gpt", "name": "labkit GPT", "config": dict(dataclasses.asdict(m), **over)}
    try:
        from transformers import PretrainedConfig, PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a labkit dependency
        PretrainedConfig = PreTrainedModel = ()
    if isinstance(m, PreTrainedModel):
        m = m.config
    if isinstance(m, PretrainedConfig):
        cfg = m.to_dict()
        cfg.update(over)
        return {"kind": "hf", "name": getattr(m, "name_or_path", "") or m.model_type, "config": cfg}
    if isinstance(m, str):
        try:
            from labkit.models.hf import get_config

            cfg = get_config(m, **over).to_dict()
        except (ValueError, OSError):  # a hub id not cached here: the engine loads it by name
            cfg = None
        return {"kind": "hf", "name": m, "config": cfg}
    raise TypeError(f"cannot export a recipe whose model is a {type(m).__name__}: give a preset name, hub id, "
                    "GPTConfig, GPT or transformers config")


def _describe(recipe: Recipe) -> dict:
    """The recipe's fields as JSON values (the model by name)."""
    out = {"model": _model_entry(recipe)["name"], "batch": recipe.batch, "seq": recipe.seq}
    for k, v in recipe.options().items():
        out[k] = list(v) if isinstance(v, tuple) else v
    out["overrides"] = {k: v for k, v in recipe.overrides}
    return out


@dataclasses.dataclass(frozen=True)
class Gap:
    """A memory-changing recipe field (`field`, one of MEMORY_FIELDS) that a target cannot express, and why."""

    field: str
    why: str

    def __str__(self) -> str:
        return f"{self.field}: {self.why}"


def _trainer_gaps(r: Recipe) -> list[Gap]:
    """What transformers.Trainer (training_args.json, with accelerate or DeepSpeed beside it) cannot express."""
    g = []
    if r.foreach is not None:
        g.append(Gap("foreach", f"foreach={r.foreach}: TrainingArguments has no option for Adam's foreach path "
                                "(torch's default: on CUDA only)"))
    if r.checkpoint in ("sqrt", "selective"):
        g.append(Gap("checkpoint", f"checkpoint {r.checkpoint!r} (labkit.recompute) has no engine option: the "
                                   "files checkpoint every block (less memory, more recompute than the plan)"))
    if r.selective_policy != "matmuls":
        g.append(Gap("selective_policy", f"selective_policy {r.selective_policy!r} has no engine option"))
    if r.segments is not None:
        g.append(Gap("segments", f"segments={r.segments}: engines checkpoint each block, not segments of several"))
    if r.offload_activations:
        g.append(Gap("offload_activations", "offload_activations (saved tensors in host memory) has no "
                                            "TrainingArguments option: the activations stay on the device"))
    if r.step_in_backward and not r.optimizer.startswith("galore"):
        g.append(Gap("step_in_backward", f"step_in_backward with {r.optimizer}: transformers steps after backward "
                                         "(only GaLore has a *_layerwise variant), so every gradient is held at "
                                         "once: use the torchrun target"))
    if r.proj_dtype not in (None, "param"):
        g.append(Gap("proj_dtype", f"proj_dtype {r.proj_dtype!r}: galore-torch keeps its projector in the "
                                   "parameters' dtype"))
    if r.optimizer_offload is not None:
        g.append(Gap("optimizer_offload", f"optimizer_offload {r.optimizer_offload!r} has no TrainingArguments "
                                          "option (FSDP's cpu_offload also moves the parameters): use the "
                                          "deepspeed target"))
    if r.paged_states and r.optimizer not in HF_PAGED:
        names = ", ".join(HF_PAGED.values())
        g.append(Gap("paged_states", f"paged_states with {r.optimizer}: transformers names no "
                                     f"paged {r.optimizer} (its paged optimizers: {names})"))
    if r.quant in ("int4", "int4-awq"):
        g.append(Gap("quant", f"quant {r.quant!r} (labkit's group-wise int4) has no BitsAndBytesConfig equivalent"))
    if r.quant_group is not None:
        g.append(Gap("quant_group", "quant_group (int4's group size) has no BitsAndBytesConfig equivalent"))
    if r.lisa_layers:
        g.append(Gap("lisa_layers", "LISA has no TrainingArguments option (LMFlow's Trainer callback): the files "
                                    "train every layer"))
    g += _layout_gaps(r)
    return g


def _layout_gaps(r: Recipe) -> list[Gap]:
    g = []
    for name, v in (("tp", r.tp), ("pp", r.pp)):
        if v > 1:
            g.append(Gap(name, f"{name}={v}: tensor and pipeline parallelism are not exported (data parallel only: "
                               "each device holds a whole model or its FSDP shard)"))
    if r.pp > 1 and r.schedule != "1f1b":
        g.append(Gap("schedule", f"schedule {r.schedule!r}: pipeline parallelism is not exported"))
    if r.sequence_parallel:
        g.append(Gap("sequence_parallel", "sequence_parallel is not exported (it needs tensor parallelism)"))
    return g


def _fsdp_gaps(r: Recipe) -> list[Gap]:
    """FSDP2 (fully_shard) against labkit's ZeRO stages."""
    g = []
    if r.zero == 1:
        g.append(Gap("zero", "zero=1: FSDP2 has no stage-1 mode; the files shard the gradients too (ZeRO-2's "
                             "reshard_after_forward=False: less memory than the plan)"))
    if r.zero_offload:
        g.append(Gap("zero_offload", "zero_offload: FSDP2's CPU offload moves the parameters and gradients too "
                                     "(ZeRO-Offload keeps the weights on the device)"))
    return g


def export_gaps(recipe: Recipe, devices: int = 1) -> dict[str, tuple[Gap, ...]]:
    """{target: the memory-changing fields it cannot express} for every target in TARGETS (empty: carried)."""
    r = recipe
    trainer = _trainer_gaps(r)
    hf = trainer + _fsdp_gaps(r)
    ds = [x for x in trainer if x.field != "optimizer_offload"]
    if r.paged_states and r.optimizer in DS_OPTIMIZER:
        ds.append(Gap("paged_states", "paged_states: DeepSpeed's optimizer section has no paged "
                                      "optimizer (bitsandbytes' are transformers' optim names)"))
    if r.step_in_backward and r.optimizer.startswith("galore"):
        ds.append(Gap("step_in_backward", "step_in_backward: transformers' GaLore *_layerwise does not run under "
                                          "DeepSpeed, whose engine steps after backward"))
    if r.dtype in ("bf16", "fp16"):
        ds.append(Gap("dtype", f"dtype {r.dtype}: DeepSpeed's {r.dtype} mode keeps fp32 master weights in its "
                               f"optimizer (4 more bytes per trained parameter than pure {r.dtype} weights)"))
    if r.optimizer_offload and r.zero >= 1:
        ds.append(Gap("optimizer_offload", f"optimizer_offload with zero={r.zero}: DeepSpeed has one "
                                           "offload_optimizer, ZeRO's"))
    elif r.optimizer_offload and devices > 1:
        stage = 3 if r.optimizer_offload == "disk" else 1
        ds.append(Gap("zero", f"zero=0: DeepSpeed offloads the optimizer state under ZeRO stage {stage} only, "
                              f"which shards over the {devices} devices (less memory than the plan)"))
    if r.zero_offload and r.zero == 1 and devices == 1:
        ds.append(Gap("zero_offload", "zero_offload at stage 1 on one device is DeepSpeed's form of labkit's "
                                      "optimizer_offload='cpu' (the same bytes; it reads back as that)"))
    script = list(_layout_gaps(r))
    if r.paged_states:
        script.append(Gap("paged_states", "paged_states: train_fsdp2.py builds torch and labkit "
                                          "optimizers, not bitsandbytes' paged ones"))
    for name in ("lora_rank", "lora_targets", "quant", "quant_group", "quant_set", "lisa_layers"):
        if getattr(r, name) != Recipe.__dataclass_fields__[name].default:
            g = "train_fsdp2.py trains every parameter: adapters and LISA are training_args.json's (peft)"
            script.append(Gap(name, f"{name}={getattr(r, name)!r}: {g}"))
    script += _fsdp_gaps(r)
    if r.zero >= 1:
        for name, on in (("checkpoint", r.checkpoint in ("sqrt", "selective")), ("segments", r.segments),
                         ("selective_policy", r.selective_policy != "matmuls")):
            if on:
                script.append(Gap(name, f"{name}: under FSDP2 the script checkpoints each block (labkit.recompute's "
                                        "segments and selective policies run unsharded, zero=0)"))
        if r.optimizer_offload:
            script.append(Gap("optimizer_offload", "optimizer_offload: labkit.optim.OffloadAdamW does not take "
                                                   "FSDP2's sharded parameters"))
    if r.step_in_backward and (devices > 1 or r.dtype == "mixed-fp16"):
        why = ("the gradients must be reduced over the devices before any step" if devices > 1 else
               "the loss scaler unscales every gradient at once")
        script.append(Gap("step_in_backward", f"step_in_backward: {why}"))
    return {"training_args": tuple(hf), "accelerate": tuple(hf), "torchrun": tuple(script), "deepspeed": tuple(ds)}


def _torch_dtype(dtype: str) -> str:
    return {"bf16": "bfloat16", "fp16": "float16", "mixed-bf16": "bfloat16", "mixed-fp16": "float16"}.get(dtype,
                                                                                                        "float32")


def _per_device(recipe: Recipe, devices: int, notes: list) -> tuple[int, int]:
    """(per-device micro-batch, gradient accumulation steps) for `devices` data-parallel processes."""
    accum = recipe.rank_batch // recipe.micro
    if recipe.world_size == 1 and devices > 1:
        notes.append(f"the recipe is for one device and devices={devices}: each process keeps the recipe's "
                     f"{recipe.rank_batch} rows per step (global batch {recipe.rank_batch * devices}, not "
                     f"{recipe.batch}), so each device needs the memory the plan was made for")
    return recipe.micro, accum


def training_arguments(recipe: Recipe, devices: int = 1) -> dict:
    """{"kwargs": TrainingArguments keywords, "peft": ..., "model": ..., "notes": [...]} for the recipe."""
    notes: list[str] = []
    kw: dict = {}
    micro, accum = _per_device(recipe, devices, notes)
    kw["per_device_train_batch_size"] = micro
    kw["gradient_accumulation_steps"] = accum
    if recipe.device == "cpu":
        kw["use_cpu"] = True
    # precision
    if recipe.dtype in ("mixed-bf16", "bf16"):
        kw["bf16"] = True
    elif recipe.dtype in ("mixed-fp16", "fp16"):
        kw["fp16"] = True
    if recipe.dtype in ("bf16", "fp16"):
        notes.append(f"dtype {recipe.dtype}: the weights themselves are 16-bit; TrainingArguments' "
                     f"{recipe.dtype}=True is autocast mixed precision, so load the model with "
                     f"dtype={_torch_dtype(recipe.dtype)} (the 'model' section)"
                     + ("; fp16 weights cannot be trained with fp16=True (its gradient scaler refuses fp16 "
                        "gradients): prefer mixed-fp16 or bf16" if recipe.dtype == "fp16" else ""))
    # recompute
    fsdp = recipe.zero >= 1
    ckpt = recipe.checkpoint != "none"
    if ckpt and not fsdp:
        kw["activation_checkpointing"] = True
        kw["activation_checkpointing_kwargs"] = {"use_reentrant": False}
    if recipe.checkpoint == "sqrt":
        notes.append("checkpoint 'sqrt' (labkit.recompute: sqrt(n) segments of blocks) has no engine option: "
                     "exported as checkpointing every block (more recompute, less memory than sqrt)")
    elif recipe.checkpoint == "selective":
        notes.append("checkpoint 'selective' (labkit's policy: keep matmul outputs, recompute the cheap ops) has "
                     "no engine option: exported as checkpointing every block (less memory, more recompute)")
    elif recipe.checkpoint == "full" and recipe.segments is not None:
        notes.append(f"checkpoint 'full' with segments={recipe.segments}: engines checkpoint each block, "
                     "not segments of several")
    if recipe.offload_activations:
        if ckpt:
            if fsdp:
                notes.append("offload_activations: FSDP's activation_checkpointing has no host-offload option; "
                             "saved activations stay on the device")
            else:
                notes.append("offload_activations: TrainingArguments' checkpointing has no host-offload option; "
                             "saved activations stay on the device")
        else:
            notes.append("offload_activations without checkpointing (every saved tensor in host memory, "
                         "labkit.recompute.offload_activations) has no TrainingArguments option: wrap the forward "
                         "in torch.autograd.graph.save_on_cpu(pin_memory=True) in your own loop")
    # optimizer
    opt = recipe.optimizer
    optim = HF_PAGED[opt] if recipe.paged_states and opt in HF_PAGED else HF_OPTIM[opt]
    if recipe.step_in_backward:
        if opt.startswith("galore"):
            optim += "_layerwise"
            notes.append("step_in_backward: GaLore's layer-wise variant steps each layer in backward "
                         "(transformers requires gradient_accumulation_steps 1 and one device for it)")
        else:
            notes.append(f"step_in_backward with {opt}: transformers has no fused step-in-backward for this "
                         "optimizer (only GaLore's *_layerwise, and LOMO, a different optimizer): the step runs "
                         "after backward, so the gradients of all parameters are held at once")
    kw["optim"] = optim
    args = []
    if opt in ("adamw", "adamw8bit"):
        kw["weight_decay"] = 0.01  # AdamW's decoupled decay (TrainingArguments' default 0.0 would be Adam)
    if opt in ("adam", "adam8bit"):
        kw["weight_decay"] = 0.0
        notes.append(f"{opt}: transformers only has the AdamW form; weight_decay=0.0 makes it Adam")
    if opt == "sgd":
        kw["weight_decay"] = 0.0
    if opt == "sgd-momentum":
        args.append("momentum=0.9")
    if opt.startswith("galore"):
        kw["optim_target_modules"] = list(GALORE_TARGETS)
        args += [f"rank={recipe.rank}", "update_proj_gap=200", "scale=0.25", "proj_type=std"]
        if recipe.proj_dtype not in (None, "param"):
            notes.append(f"proj_dtype {recipe.proj_dtype!r}: galore-torch keeps its projector in the "
                         "parameters' dtype; no option for it")
    if args:
        kw["optim_args"] = ",".join(args)
    if opt == "adafactor":
        notes.append("adafactor: transformers' default is a relative step size (no lr), as labkit.optim.Adafactor")
    if recipe.optimizer_offload == "cpu":
        notes.append("optimizer_offload 'cpu' (the AdamW state and step on the host, weights on the device) is "
                     "DeepSpeed ZeRO-Offload's stage-0/1 setting; TrainingArguments' nearest option is FSDP's "
                     "cpu_offload, which also moves the parameters: not set here; ds_config.json has it "
                     "(zero_optimization.offload_optimizer.device='cpu')")
    elif recipe.optimizer_offload == "disk":
        notes.append("optimizer_offload 'disk' (labkit.optim.OffloadAdamW's state in files) has no "
                     "TrainingArguments option; DeepSpeed ZeRO-Infinity (offload_optimizer.device='nvme') is "
                     "the engine analogue: ds_config.json has it")
    # layout
    if fsdp:
        kw["fsdp"] = True
        kw["fsdp_config"] = {"version": 2, "reshard_after_forward": recipe.zero == 3,
                             "cpu_offload": recipe.zero_offload, "activation_checkpointing": ckpt}
        if recipe.zero == 1:
            notes.append("zero=1 (optimizer state sharded only): FSDP2 has no stage-1 mode; exported as "
                         "reshard_after_forward=False (the ZeRO-2 analogue: gradients sharded too, less memory)")
        if recipe.zero_offload:
            notes.append("zero_offload: FSDP2's cpu_offload keeps parameters, gradients and optimizer state on the "
                         "host (more than ZeRO-Offload, which keeps the weights on the device)")
    if recipe.tp > 1 or recipe.pp > 1:
        notes.append(f"tensor/pipeline parallelism (tp={recipe.tp}, pp={recipe.pp}) is not exported: the "
                     "configs run data parallel only, so each device holds a whole model (or its FSDP shard)")
    if recipe.sequence_parallel:
        notes.append("sequence_parallel is not exported (it needs tensor parallelism)")
    # PEFT
    peft = None
    if recipe.lora_rank:
        targets = recipe.lora_targets
        targets = targets if targets == "all-linear" else [t.strip() for t in
                                                           (targets.split(",") if isinstance(targets, str)
                                                            else targets)]
        peft = {"lora": {"r": recipe.lora_rank, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": targets,
                         "bias": "none", "task_type": "CAUSAL_LM"}}
        compute = _torch_dtype(recipe.dtype)
        if recipe.quant == "nf4":
            peft["quantization"] = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                    "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": compute}
        elif recipe.quant == "int8":
            peft["quantization"] = {"load_in_8bit": True}
        if "quantization" in peft and recipe.quant_set == "targets":
            # bitsandbytes quantizes every Linear but the head by default (quant_set "all-linear");
            # torchtune's set, the targets only, is the default less the other Linears, skipped
            peft["quantization"]["llm_int8_skip_modules"] = ["lm_head", *_unadapted_linears(recipe)]
            notes.append("quant int8: bitsandbytes' LLM.int8() keeps outlier columns in 16 bits; labkit's int8 "
                         "base is plain per-row absmax, so memory and results differ slightly")
        elif recipe.quant in ("int4", "int4-awq"):
            notes.append(f"quant {recipe.quant} (labkit's group-wise int4{' with AWQ scales' if 'awq' in recipe.quant else ''}) "
                         "has no BitsAndBytesConfig equivalent: quantize the base with an AWQ/GPTQ tool and load "
                         "that checkpoint; the peft section has the LoRA part only")
    if recipe.lisa_layers:
        notes.append(f"LISA ({recipe.lisa_layers} layers trained at a time) has no TrainingArguments option "
                     "(LMFlow implements it as a Trainer callback): exported as full fine-tuning")
    model = _model_entry(recipe)
    # load in the frozen base's dtype: a 16-bit base under fp32 adapters (Recipe.base_dtype) is loaded in 16 bits
    model_section = {"name": model["name"], "dtype": _torch_dtype(recipe.frozen_dtype), "seq": recipe.seq}
    return {"kwargs": kw, "peft": peft, "model": model_section, "notes": notes}


def _unadapted_linears(recipe: Recipe) -> list[str]:
    """The Linears but the head that get no LoRA adapter, by full module name (transformers
    matches a BitsAndBytesConfig skip entry against a module's full name)."""
    from labkit.estimate import peft_terms
    from labkit.estimate.spec import spec_from

    spec = spec_from(recipe.model, **recipe.config)
    adapted = {lin[0] for lin in peft_terms.resolve_targets(spec, recipe.lora_targets)}
    every = peft_terms.resolve_targets(spec, "all-linear")
    return [name for name, *_ in every if name not in adapted]


def accelerate_config(recipe: Recipe, devices: int = 1) -> dict:
    """An accelerate config (what `accelerate config` writes) for `devices` processes on one machine."""
    mp = {"mixed-bf16": "bf16", "bf16": "bf16", "mixed-fp16": "fp16", "fp16": "fp16"}.get(recipe.dtype, "no")
    cfg = {"compute_environment": "LOCAL_MACHINE", "debug": False, "machine_rank": 0, "num_machines": 1,
           "num_processes": devices, "main_training_function": "main", "mixed_precision": mp,
           "rdzv_backend": "static", "use_cpu": recipe.device == "cpu"}
    if recipe.zero >= 1:
        cfg["distributed_type"] = "FSDP"
        cfg["fsdp_config"] = {"fsdp_version": 2, "fsdp_reshard_after_forward": recipe.zero == 3,
                              "fsdp_offload_params": recipe.zero_offload,
                              "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                              "fsdp_state_dict_type": "SHARDED_STATE_DICT",
                              "fsdp_cpu_ram_efficient_loading": False,
                              "fsdp_activation_checkpointing": recipe.checkpoint != "none"}
    elif devices > 1:
        cfg["distributed_type"] = "MULTI_CPU" if recipe.device == "cpu" else "MULTI_GPU"
    else:
        cfg["distributed_type"] = "NO"
    return cfg


def wants_deepspeed(recipe: Recipe) -> bool:
    """Whether the plan uses ZeRO-1/2/3 or offloads the optimizer state, what DeepSpeed is for (every plan gets
    a ds_config.json: stage 0 otherwise)."""
    return recipe.zero >= 1 or recipe.zero_offload or recipe.optimizer_offload is not None


def deepspeed_config(recipe: Recipe, devices: int = 1) -> dict:
    """{"config": a DeepSpeed config dict, "notes": [...]} for the recipe on `devices` data-parallel processes.

    train_batch_size is left out: DeepSpeed derives it as micro-batch x accumulation x world size (giving it
    too makes DeepSpeed check that product against the world size it runs with)."""
    notes: list[str] = []
    micro, accum = _per_device(recipe, devices, notes)
    stage = recipe.zero
    zero: dict = {}
    if recipe.optimizer_offload == "disk":
        # DeepSpeed swaps optimizer state to NVMe only under stage 3 (stage 1/2 treat 'nvme' as host memory)
        stage = 3
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": NVME_PATH, "pin_memory": True}
        notes.append(f"ds_config.json: optimizer_offload 'disk' is ZeRO-Infinity's offload_optimizer "
                     f"device 'nvme' (stage 3; DeepSpeed swaps to NVMe only there); set nvme_path "
                     f"(now {NVME_PATH!r}) to a folder on a fast local disk")
    elif recipe.optimizer_offload == "cpu" or recipe.zero_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if stage == 0:  # offload_optimizer is valid with stage 1, 2 and 3 only
            stage = 1
            notes.append("ds_config.json: optimizer_offload 'cpu' is ZeRO-Offload, which DeepSpeed runs under a "
                         "ZeRO stage: exported as stage 1 (on one device it shards nothing)")
    zero = {"stage": stage, **zero}
    cfg: dict = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
                 "zero_optimization": zero}
    if recipe.dtype.endswith("bf16"):
        cfg["bf16"] = {"enabled": True}
    elif recipe.dtype.endswith("fp16"):
        cfg["fp16"] = {"enabled": True, "loss_scale": 0}  # 0: dynamic loss scaling
    if recipe.dtype in ("bf16", "fp16"):
        notes.append(f"ds_config.json: DeepSpeed's {recipe.dtype[-4:]} mode keeps fp32 master weights in its "
                     f"optimizer (4 more bytes per trained parameter than the plan's pure {recipe.dtype} weights)")
    if recipe.optimizer in DS_OPTIMIZER:
        cfg["optimizer"] = {"type": DS_OPTIMIZER[recipe.optimizer],
                            "params": {"lr": 1e-3, "weight_decay": 0.01 if recipe.optimizer == "adamw" else 0.0}}
    else:
        notes.append(f"ds_config.json has no optimizer section: DeepSpeed has no built-in {recipe.optimizer}; "
                     "pass labkit.optim's to deepspeed.initialize(optimizer=...)"
                     + ("; an offloaded state needs DeepSpeed's CPU Adam (or zero_force_ds_cpu_optimizer=false)"
                        if "offload_optimizer" in zero else ""))
    if recipe.checkpoint != "none":
        notes.append("ds_config.json: activation checkpointing is the model's own (e.g. transformers' "
                     "gradient_checkpointing_enable()), not a DeepSpeed config section")
    return {"config": cfg, "notes": notes}


def script_config(recipe: Recipe, devices: int = 1, steps: int = 10) -> dict:
    """What train_fsdp2.py reads (plan_config.json): model, sizes, precision, optimizer, recompute, sharding."""
    model = _model_entry(recipe)
    r = recipe
    if r.zero >= 1 and r.checkpoint != "none":  # under FSDP2 the script checkpoints each block (export_gaps)
        r = r.replace(checkpoint="full", segments=None, selective_policy="matmuls")
    return {"model": model, "batch": r.rank_batch * devices, "micro_batch": r.micro, "seq": r.seq,
            "dtype": r.dtype, "device": r.device, "optimizer": r.optimizer, "rank": r.rank, "proj_dtype": r.proj_dtype,
            "foreach": r.foreach, "optimizer_offload": r.optimizer_offload, "step_in_backward": r.step_in_backward,
            "lr": 1e-3, "checkpoint": r.checkpoint, "segments": r.segments, "selective_policy": r.selective_policy,
            "offload_activations": r.offload_activations, "zero": r.zero, "cpu_offload": r.zero_offload,
            "steps": steps, "seed": 0, "devices": devices, "peft": bool(r.lora_rank or r.lisa_layers),
            "not_carried": [str(g) for g in export_gaps(recipe, devices)["torchrun"]]}


_SCRIPT = r'''"""Train a plan's model with torchrun + FSDP2 (written by labkit.plan.export from lesson 09's script).

    torchrun --standalone --nproc-per-node {devices} train_fsdp2.py [--steps N] [--plan plan_config.json]

It reads plan_config.json next to it: the model (labkit's GPT, or a transformers config built with random
weights), the global batch, the micro-batch per rank, the sequence length, the dtype, the optimizer (its
foreach path, GaLore's rank and projector, host or disk offload through labkit.optim), the optimizer step in
backward (one optimizer per parameter, stepped by register_post_accumulate_grad_hook as its gradient is
ready), checkpointing (each block, or labkit.recompute's segments / sqrt / selective policies), activation
offload (torch.autograd.graph.save_on_cpu), and the ZeRO stage: 3 -> fully_shard(reshard_after_forward=True),
1-2 -> False (the ZeRO-2 analogue), 0 -> DistributedDataParallel. The batches are random tokens from a fixed seed (the
same global batch on every rank, each rank takes its rows): replace `batches()` with your data. Rank 0
prints one JSON line: the loss of each step per rank.
"""

import argparse
import contextlib
import functools
import json
import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

TORCH_OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum")
LOW = {{"bf16": torch.bfloat16, "fp16": torch.float16, "mixed-bf16": torch.bfloat16, "mixed-fp16": torch.float16}}


def build(entry, device):
    if entry["kind"] == "labkit-gpt":
        from labkit.models.gpt import GPT, GPTConfig

        model = GPT(GPTConfig(**entry["config"]))
        return model.to(device), list(model.blocks), model.config.vocab_size
    from transformers import AutoConfig, AutoModelForCausalLM

    if entry["config"] is None:
        cfg = AutoConfig.from_pretrained(entry["name"])
    else:
        d = dict(entry["config"])
        cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    cfg.use_cache = False
    model = AutoModelForCausalLM.from_config(cfg).to(device)
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    return model, blocks, cfg.vocab_size


def torch_optimizer(name, params, lr, foreach):
    if name in ("adamw", "adam"):
        return (torch.optim.AdamW if name == "adamw" else torch.optim.Adam)(params, lr=lr, foreach=foreach)
    return torch.optim.SGD(params, lr=lr, momentum=0.9 if name == "sgd-momentum" else 0.0, foreach=foreach)


class StepInBackward:
    """One optimizer per parameter, stepped (and its gradient freed) as soon as that gradient is accumulated
    (torch's optimizer-in-backward: Tensor.register_post_accumulate_grad_hook); step() and zero_grad() are
    no-ops, so the loop below runs unchanged and no two full gradients are ever held at once."""

    def __init__(self, make, params):
        self.optimizers = {{}}
        for p in params:
            if p.requires_grad:
                self.optimizers[p] = make([p])
                p.register_post_accumulate_grad_hook(self._step)

    def _step(self, p):
        self.optimizers[p].step()
        self.optimizers[p].zero_grad(set_to_none=True)

    def step(self):
        pass

    def zero_grad(self, set_to_none=True):
        pass


def make_optimizer(plan, model, folder):
    name, lr = plan["optimizer"], plan["lr"]
    if name in TORCH_OPTIMIZERS and not plan["optimizer_offload"]:
        make = functools.partial(torch_optimizer, name, lr=lr, foreach=plan["foreach"])
        return StepInBackward(make, model.parameters()) if plan["step_in_backward"] else make(model.parameters())
    from labkit.estimate import Recipe
    from labkit.run.step import make_optimizer as labkit_optimizer  # labkit.optim's own implementations

    r = Recipe(model, 1, 1, optimizer=name, rank=plan["rank"], proj_dtype=plan["proj_dtype"],
               foreach=plan["foreach"], optimizer_offload=plan["optimizer_offload"],
               step_in_backward=plan["step_in_backward"])
    return labkit_optimizer(model, r, lr, offload_folder=folder)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plan", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "plan_config.json"))
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: the plan's)")
    args = ap.parse_args(argv)
    with open(args.plan) as f:
        plan = json.load(f)
    if plan["peft"]:
        raise SystemExit("this plan trains adapters (LoRA/QLoRA/LISA): use training_args.json's peft section "
                         "with transformers.Trainer and peft; the FSDP2 script trains every parameter")
    steps = plan["steps"] if args.steps is None else args.steps
    for gap in plan["not_carried"]:  # what labkit's plan has and this script cannot do (so more memory)
        print(f"warning: train_fsdp2.py does not carry {{gap}}", file=sys.stderr)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    cuda = plan["device"] == "cuda" and torch.cuda.is_available()
    if plan["device"] == "cuda" and not cuda:
        print("warning: the plan is for CUDA and no GPU is visible: running on the CPU", file=sys.stderr)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    batch, micro, seq, dtype = plan["batch"], plan["micro_batch"], plan["seq"], plan["dtype"]
    if batch % world or (batch // world) % micro:
        raise SystemExit(f"the global batch {{batch}} must split into {{world}} ranks of whole micro-batches of {{micro}}")
    rows = batch // world
    torch.manual_seed(plan["seed"])
    model, blocks, vocab = build(plan["model"], device)
    if dtype in ("bf16", "fp16"):
        model = model.to(LOW[dtype])
    if plan["checkpoint"] == "full" and plan["segments"] is None:  # each block's forward recomputed in backward
        for block in blocks:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    elif plan["checkpoint"] != "none":  # labkit's segments, sqrt and selective policies (unsharded)
        from labkit.recompute import checkpoint_blocks

        checkpoint_blocks(model, plan["checkpoint"], plan["segments"], selective=plan["selective_policy"])
    if plan["zero"] >= 1:
        mesh = init_device_mesh(device.type, (world,))  # always explicit (pytorch #132471)
        kw = dict(mesh=mesh, reshard_after_forward=plan["zero"] == 3)
        if dtype.startswith("mixed"):
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=LOW[dtype], reduce_dtype=torch.float32)
        if plan["cpu_offload"] and cuda:
            kw["offload_policy"] = CPUOffloadPolicy()
        for block in blocks:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        ddp = None
    elif world > 1:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
    else:
        ddp = None
    net = ddp or model
    folder = tempfile.TemporaryDirectory(prefix="offload-") if plan["optimizer_offload"] == "disk" else None
    opt = make_optimizer(plan, model, folder and folder.name)
    autocast = dtype.startswith("mixed") and plan["zero"] == 0  # FSDP2 casts by its mp_policy instead
    scaler = torch.amp.GradScaler(device.type) if dtype == "mixed-fp16" and plan["zero"] == 0 else None
    gen = torch.Generator().manual_seed(plan["seed"])

    def batches():
        for _ in range(steps):
            t = torch.randint(0, vocab, (batch, seq + 1), generator=gen)[rank * rows:(rank + 1) * rows]
            yield t[:, :-1].to(device), t[:, 1:].to(device)

    losses = []
    for x, y in batches():
        total = 0.0
        n = rows // micro
        for i in range(n):
            xb, yb = x[i * micro:(i + 1) * micro], y[i * micro:(i + 1) * micro]
            if plan["zero"] >= 1:
                model.set_requires_gradient_sync(i == n - 1)  # reduce-scatter once, after the last micro-batch
            offload = (torch.autograd.graph.save_on_cpu(pin_memory=cuda) if plan["offload_activations"]
                       else contextlib.nullcontext())
            with offload, torch.autocast(device.type, dtype=LOW.get(dtype, torch.float32), enabled=autocast):
                if plan["model"]["kind"] == "labkit-gpt":
                    loss = net(xb, yb)
                else:
                    loss = torch.nn.functional.cross_entropy(net(input_ids=xb).logits.float().flatten(0, 1),
                                                             yb.flatten())
            loss = loss / n
            (scaler.scale(loss) if scaler else loss).backward()
            total += loss.item()
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    every = [None] * world
    dist.all_gather_object(every, losses)
    if rank == 0:
        print(json.dumps({{"world": world, "steps": steps, "losses": every}}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if hasattr(opt, "close"):
        opt.close()
    if folder is not None:
        folder.cleanup()


if __name__ == "__main__":
    main()
    # torch 2.13 on gloo: a rank sometimes aborts at interpreter exit after the work is done ("terminate called
    # without an active exception"); the results are printed, so leave without the C++ teardown.
    sys.stdout.flush()
    os._exit(0)
'''


def refusal_line(target: str, gaps) -> str:
    """One line naming what a refused target cannot express (gaps: Gap objects or their dicts)."""
    items = [g if isinstance(g, dict) else dataclasses.asdict(g) for g in gaps]
    files = " + ".join(FILE_NAMES[f] for f in TARGET_FILES[target])
    return (f"not carried by the {target} target ({files}): " + "; ".join(f"{g['field']} ({g['why']})" for g in items))


def _check(recipe, out_dir, devices) -> pathlib.Path:
    if not isinstance(recipe, Recipe):
        raise TypeError(f"export_plan needs a labkit.estimate.Recipe, got {type(recipe).__name__}")
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be a positive integer, got {devices!r}")
    if recipe.world_size > 1 and devices != recipe.world_size:
        raise ValueError(f"the recipe lays out over dp x tp x pp = {recipe.world_size} devices, but devices={devices}")
    out = pathlib.Path(out_dir)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"out_dir {str(out)!r} is a file, not a folder")
    return out


def export_plan(recipe, out_dir, devices: int = 1) -> dict[str, pathlib.Path]:
    """Write the recipe as training_args.json, accelerate_config.yaml, train_fsdp2.py (+ plan_config.json),
    ds_config.json, plan.json and README.txt in `out_dir` (made if missing) for `devices` processes; returns
    {"training_args", "accelerate_config", "train_fsdp2", "plan_config", "plan", "readme", "deepspeed"} -> path.
    A target that cannot express a memory-changing field (export_gaps) is refused: plan.json's "refused" and
    the first notes name the field."""
    import yaml

    out = _check(recipe, out_dir, devices)
    out.mkdir(parents=True, exist_ok=True)
    ta = training_arguments(recipe, devices)
    acc = accelerate_config(recipe, devices)
    sc = script_config(recipe, devices)
    paths = {k: out / n for k, n in zip(FILES, ("training_args.json", "accelerate_config.yaml", "train_fsdp2.py",
                                                 "plan_config.json", "plan.json", "README.txt", "ds_config.json"))}
    refused = {t: [dataclasses.asdict(g) for g in gs] for t, gs in export_gaps(recipe, devices).items() if gs}
    notes = [refusal_line(t, gs) for t, gs in refused.items()] + list(ta["notes"])
    ds = deepspeed_config(recipe, devices)
    notes += ds["notes"]
    if sc["peft"]:
        notes.append("train_fsdp2.py trains every parameter: for this adapter plan it stops with a message; use "
                     "training_args.json (transformers.Trainer + peft)")
    elif recipe.optimizer not in TORCH_SCRIPT_OPTIMIZERS:
        notes.append(f"train_fsdp2.py takes {recipe.optimizer} from labkit.optim (labkit must be importable)")
    if sc["model"]["kind"] == "labkit-gpt":
        notes.append("the model is labkit's GPT: train_fsdp2.py imports labkit.models.gpt; transformers' Trainer "
                     "needs a transformers model")
    notes = list(dict.fromkeys(notes))
    ta_doc = {**ta["kwargs"], "peft": ta["peft"], "model": ta["model"], "notes": notes}
    paths["training_args"].write_text(json.dumps(ta_doc, indent=2) + "\n")
    paths["accelerate_config"].write_text(yaml.safe_dump(acc, sort_keys=True))
    paths["plan_config"].write_text(json.dumps(sc, indent=2) + "\n")
    paths["train_fsdp2"].write_text(_SCRIPT.format(devices=devices))
    paths["deepspeed"].write_text(json.dumps(ds["config"], indent=2) + "\n")
    commands = {"torchrun": f"torchrun --standalone --nproc-per-node {devices} train_fsdp2.py",
                "accelerate": "accelerate launch --config_file accelerate_config.yaml your_trainer_script.py "
                              "(build transformers.TrainingArguments(**kwargs from training_args.json, output_dir=...))"}
    commands["deepspeed"] = (f"deepspeed --num_gpus {devices} your_trainer_script.py (transformers."
                             "TrainingArguments(deepspeed='ds_config.json', **training_args.json without its "
                             "fsdp keys), or deepspeed.initialize(model=..., config='ds_config.json'))")
    plan = {"recipe": _describe(recipe), "devices": devices, "per_device_train_batch_size": ta["kwargs"][
        "per_device_train_batch_size"], "gradient_accumulation_steps": ta["kwargs"]["gradient_accumulation_steps"],
        "refused": refused, "notes": notes, "commands": commands, "files": {k: p.name for k, p in paths.items()}}
    paths["plan"].write_text(json.dumps(plan, indent=2) + "\n")
    lines = ["labkit plan export", ""]
    if refused:
        lines += ["REFUSED targets (each launch would not have the plan's memory):"]
        lines += [f"  - {refusal_line(t, gs)}" for t, gs in refused.items()] + [""]
    lines += ["Recipe:"]
    lines += [f"  {k}: {v}" for k, v in plan["recipe"].items()]
    lines += ["", f"Devices: {devices}", "", "Launch:", *[f"  {c}" for c in commands.values()],
              "", "Files:"]
    lines += [f"  {p.name}" for p in paths.values()]
    lines += ["", "Using training_args.json (its peft, model and notes keys are not TrainingArguments' own):",
              "  doc = json.load(open('training_args.json'))",
              "  extra = {k: doc.pop(k) for k in ('peft', 'model', 'notes')}",
              "  args = transformers.TrainingArguments(output_dir='out', **doc)",
              "  # LoRA: peft.LoraConfig(**extra['peft']['lora']); QLoRA: load the model with",
              "  # quantization_config=transformers.BitsAndBytesConfig(**extra['peft']['quantization'])"]
    lines += ["", "Notes (recipe fields no engine option reproduces):"] + [f"  - {n}" for n in notes or ["none"]]
    paths["readme"].write_text("\n".join(lines) + "\n")
    return paths


# ----------------------------------------------------------------------------- reading configs back
# Each `from_*` reads one file's dict and returns the Recipe fields it states (nothing it does not), so a
# config written by hand reads the same way; `read_export` joins a target's files into a Recipe.
_HF_OPTIM_BACK = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_bnb_8bit": "adamw8bit",
                  "sgd": "sgd", "adafactor": "adafactor", "lion_32bit": "lion", "galore_adamw": "galore",
                  "galore_adamw_8bit": "galore8bit", "paged_adamw_32bit": "adamw",
                  "paged_adamw_8bit": "adamw8bit", "paged_lion_32bit": "lion"}
_DECAY_FREE = {"adamw": "adam", "adamw8bit": "adam8bit"}  # the AdamW forms with weight_decay 0.0 are Adam


def _dtype_of(flag16: str | None, weights: str) -> str:
    """A labkit dtype from a 16-bit mixed-precision flag ("bf16", "fp16" or None) and the weights' dtype."""
    if flag16 is None:
        return {"bfloat16": "bf16", "float16": "fp16"}.get(weights, "fp32")
    return flag16 if _torch_dtype(flag16) == weights else f"mixed-{flag16}"


def from_training_args(doc: dict) -> dict:
    """Recipe fields stated by a TrainingArguments dict (training_args.json: its own keys, and labkit's
    `peft` and `model` sections when present). Batch sizes are per device: `micro` and `accumulation`."""
    out: dict = {"micro": doc.get("per_device_train_batch_size", 8),
                 "accumulation": doc.get("gradient_accumulation_steps", 1),
                 "device": "cpu" if doc.get("use_cpu") else "cuda"}
    weights = (doc.get("model") or {}).get("dtype", "float32")
    flag = "bf16" if doc.get("bf16") else "fp16" if doc.get("fp16") else None
    out["dtype"] = _dtype_of(flag, weights)
    if (doc.get("model") or {}).get("seq") is not None:
        out["seq"] = doc["model"]["seq"]
    optim = str(doc.get("optim", "adamw_torch"))
    layerwise = optim.endswith("_layerwise")
    optim = optim.removesuffix("_layerwise")
    if optim not in _HF_OPTIM_BACK:
        raise ValueError(f"optim {optim!r} has no labkit optimizer; labkit reads {', '.join(_HF_OPTIM_BACK)}")
    name = _HF_OPTIM_BACK[optim]
    args = dict(a.split("=", 1) for a in str(doc.get("optim_args") or "").split(",") if "=" in a)
    if name in _DECAY_FREE and not doc.get("weight_decay", 0.0):
        name = _DECAY_FREE[name]
    if name == "sgd" and float(args.get("momentum", 0)):
        name = "sgd-momentum"
    out["optimizer"] = name
    if name.startswith("galore"):
        out["rank"] = int(args["rank"])
    out["step_in_backward"] = layerwise
    if optim.startswith("paged_"):
        out["paged_states"] = True
    fsdp = doc.get("fsdp_config") or {}
    if doc.get("fsdp"):
        out["zero"] = 3 if fsdp.get("reshard_after_forward", True) else 2
        out["zero_offload"] = bool(fsdp.get("cpu_offload", False))
    ckpt = doc.get("activation_checkpointing", doc.get("gradient_checkpointing", False))
    out["checkpoint"] = "full" if ckpt or fsdp.get("activation_checkpointing") else "none"
    lora = (doc.get("peft") or {}).get("lora")
    if lora:
        targets = lora.get("target_modules", "all-linear")
        out["lora_rank"] = lora["r"]
        out["lora_targets"] = targets if isinstance(targets, str) else tuple(targets)
        q = (doc.get("peft") or {}).get("quantization") or {}
        out["quant"] = ("nf4" if q.get("load_in_4bit") and q.get("bnb_4bit_quant_type") == "nf4" else
                        "int8" if q.get("load_in_8bit") else "none")
        if q.get("load_in_4bit") and q.get("bnb_4bit_quant_type") != "nf4":
            raise ValueError(f"4-bit {q.get('bnb_4bit_quant_type')!r} base: labkit reads nf4")
        if out["quant"] != "none":  # bitsandbytes: every Linear but the skipped ones and the head
            skip = [m for m in q.get("llm_int8_skip_modules") or () if m != "lm_head"]
            out["quant_set"] = "targets" if skip else "all-linear"
    return out


def from_accelerate(cfg: dict) -> dict:
    """Recipe fields stated by an accelerate config (accelerate_config.yaml): processes, precision, FSDP."""
    out: dict = {"devices": cfg.get("num_processes", 1), "device": "cpu" if cfg.get("use_cpu") else "cuda"}
    mp = cfg.get("mixed_precision", "no")
    out["mixed_precision"] = None if mp == "no" else mp
    if cfg.get("distributed_type") == "FSDP":
        fs = cfg.get("fsdp_config") or {}
        out["zero"] = 3 if fs.get("fsdp_reshard_after_forward", True) else 2
        out["zero_offload"] = bool(fs.get("fsdp_offload_params", False))
        out["checkpoint"] = "full" if fs.get("fsdp_activation_checkpointing") else "none"
    else:
        out["zero"], out["zero_offload"] = 0, False
    return out


def from_deepspeed(cfg: dict, devices: int = 1) -> dict:
    """Recipe fields stated by a DeepSpeed config (ds_config.json) run on `devices` processes."""
    out: dict = {"micro": cfg.get("train_micro_batch_size_per_gpu", 1),
                 "accumulation": cfg.get("gradient_accumulation_steps", 1)}
    flag = ("bf16" if (cfg.get("bf16") or {}).get("enabled") else
            "fp16" if (cfg.get("fp16") or {}).get("enabled") else None)
    out["dtype"] = f"mixed-{flag}" if flag else "fp32"  # DeepSpeed keeps fp32 master weights
    zero = cfg.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    off = (zero.get("offload_optimizer") or {}).get("device", "none")
    if off == "nvme":
        out["optimizer_offload"], out["zero"], out["zero_offload"] = "disk", 0 if devices == 1 else stage, False
    elif off == "cpu" and stage == 1 and devices == 1:  # ZeRO-Offload of one device: labkit's host offload
        out["optimizer_offload"], out["zero"], out["zero_offload"] = "cpu", 0, False
    else:
        out["optimizer_offload"], out["zero"], out["zero_offload"] = None, stage, off == "cpu"
    opt = (cfg.get("optimizer") or {}).get("type")
    if opt is not None:
        name = {"adamw": "adamw", "adam": "adam"}.get(str(opt).lower())
        if name is None:
            raise ValueError(f"DeepSpeed optimizer {opt!r}: labkit reads AdamW and Adam")
        out["optimizer"] = name
    return out


def from_plan_config(cfg: dict) -> dict:
    """Recipe fields stated by train_fsdp2.py's plan_config.json."""
    keys = ("seq", "dtype", "device", "optimizer", "rank", "proj_dtype", "foreach", "optimizer_offload",
            "step_in_backward", "checkpoint", "segments", "selective_policy", "offload_activations", "zero")
    out = {k: cfg[k] for k in keys}
    devices = cfg["devices"]
    out.update(devices=devices, micro=cfg["micro_batch"], accumulation=cfg["batch"] // devices // cfg["micro_batch"],
               zero_offload=cfg["cpu_offload"])
    return out


def _model_of(entry: dict):
    if entry["kind"] == "labkit-gpt":
        from labkit.models.gpt import GPTConfig

        return GPTConfig(**entry["config"])
    return entry["name"]


def _recipe_from(model, fields: dict) -> Recipe:
    """A Recipe from `from_*` fields: micro and accumulation per device, over `devices` data-parallel ranks."""
    f = dict(fields)
    devices = f.pop("devices", 1)
    micro, accum = f.pop("micro"), f.pop("accumulation")
    f.pop("mixed_precision", None)
    batch = micro * accum * devices
    f["micro_batch"] = micro if accum > 1 else None
    if devices > 1:
        f["dp"] = devices
    seq = f.pop("seq")
    return Recipe(model, batch, seq, **f)


def read_export(folder, target: str) -> Recipe:
    """The Recipe that `target`'s files in `folder` (written by export_plan) launch. The launch context that no
    config of the target states (the model, the device count, the sequence length for DeepSpeed) comes from
    plan_config.json and plan.json in the same folder; every memory-changing field comes from the target's own
    files."""
    import yaml

    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; choose one of {', '.join(TARGETS)}")
    d = pathlib.Path(folder)
    context = json.loads((d / "plan_config.json").read_text())
    devices = json.loads((d / "plan.json").read_text())["devices"]
    model = _model_of(context["model"])
    if target == "torchrun":
        return _recipe_from(model, from_plan_config(context))
    ta = json.loads((d / "training_args.json").read_text())
    fields = dict(from_training_args(ta), devices=devices)
    if target == "accelerate":
        acc = from_accelerate(yaml.safe_load((d / "accelerate_config.yaml").read_text()))
        mp = acc.pop("mixed_precision")
        fields["dtype"] = _dtype_of(mp, (ta.get("model") or {}).get("dtype", "float32"))
        if acc["zero"] == 0:  # the Trainer's own checkpointing (training_args.json) applies
            acc.pop("checkpoint", None)
        fields.update(acc)
    elif target == "deepspeed":
        fields.pop("zero", None), fields.pop("zero_offload", None)  # DeepSpeed's ZeRO replaces FSDP
        # the config's optimizer section, where present, wins: DeepSpeed builds it instead of the Trainer
        fields.update(from_deepspeed(json.loads((d / "ds_config.json").read_text()), devices))
        fields["step_in_backward"] = False  # DeepSpeed's engine steps after backward
    fields.setdefault("seq", context["seq"])
    return _recipe_from(model, fields)


def memory_fields(recipe: Recipe) -> dict:
    """The recipe's MEMORY_FIELDS in one canonical form, to compare two recipes: micro_batch as rows per
    micro-batch, proj_dtype "param" as None (both: the parameters' dtype), lora_targets as a tuple."""
    out = {k: getattr(recipe, k) for k in MEMORY_FIELDS}
    out["micro_batch"] = recipe.micro
    out["proj_dtype"] = None if recipe.proj_dtype == "param" else recipe.proj_dtype
    t = recipe.lora_targets
    out["lora_targets"] = t if t == "all-linear" else tuple(s.strip() for s in (t.split(",") if isinstance(t, str)
                                                                                 else t))
    return out
