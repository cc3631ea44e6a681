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
- ds_config.json, only for plans that use ZeRO-1/2/3 or offload the optimizer state (to the host or to disk): a
  DeepSpeed config (field names of DeepSpeed's config schema, as `deepspeed.runtime.config.DeepSpeedConfig`
  reads them: `zero_optimization.stage`, `zero_optimization.offload_optimizer`, `bf16`/`fp16`,
  `gradient_accumulation_steps`, `train_micro_batch_size_per_gpu`, `optimizer`). No labkit recipe offloads the
  parameters themselves, so `zero_optimization.offload_param` (ZeRO-3 only) is never written.
- plan.json and README.txt: the recipe's fields, the notes and the launch commands.

Every recipe field that no engine option reproduces (labkit's selective or sqrt recompute policies, disk
offload, LISA, ...) becomes a line in `notes`, never silence.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from labkit.estimate.recipe import Recipe

# labkit optimizer -> transformers OptimizerNames value (transformers.training_args.OptimizerNames)
HF_OPTIM = {"adamw": "adamw_torch", "adam": "adamw_torch", "sgd": "sgd", "sgd-momentum": "sgd",
            "adamw8bit": "adamw_bnb_8bit", "adam8bit": "adamw_bnb_8bit", "adafactor": "adafactor",
            "lion": "lion_32bit", "galore": "galore_adamw", "galore8bit": "galore_adamw_8bit"}
GALORE_TARGETS = ["attn", "mlp"]  # module-name substrings, as labkit.optim.galore_param_groups chooses
TORCH_SCRIPT_OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum")  # the script's own; others come from labkit.optim
FILES = ("training_args", "accelerate_config", "train_fsdp2", "plan_config", "plan", "readme")  # always written
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
                kw["activation_checkpointing_kwargs"]["offload"] = True
        else:
            notes.append("offload_activations without checkpointing (every saved tensor in host memory, "
                         "labkit.recompute.offload_activations) has no TrainingArguments option: wrap the forward "
                         "in torch.autograd.graph.save_on_cpu(pin_memory=True) in your own loop")
    # optimizer
    opt = recipe.optimizer
    optim = HF_OPTIM[opt]
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
    """Whether the plan gets a ds_config.json: it uses ZeRO-1/2/3 or offloads the optimizer state."""
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
    return {"model": model, "batch": recipe.rank_batch * devices, "micro_batch": recipe.micro, "seq": recipe.seq,
            "dtype": recipe.dtype, "optimizer": recipe.optimizer, "rank": recipe.rank, "lr": 1e-3,
            "checkpoint": recipe.checkpoint != "none", "zero": recipe.zero, "cpu_offload": recipe.zero_offload,
            "steps": steps, "seed": 0, "devices": devices,
            "peft": bool(recipe.lora_rank or recipe.lisa_layers)}


_SCRIPT = r'''"""Train a plan's model with torchrun + FSDP2 (written by labkit.plan.export from lesson 09's script).

    torchrun --standalone --nproc-per-node {devices} train_fsdp2.py [--steps N] [--plan plan_config.json]

It reads plan_config.json next to it: the model (labkit's GPT, or a transformers config built with random
weights), the global batch, the micro-batch per rank, the sequence length, the dtype, the optimizer,
checkpointing per block, and the ZeRO stage: 3 -> fully_shard(reshard_after_forward=True), 1-2 -> False
(the ZeRO-2 analogue), 0 -> DistributedDataParallel. The batches are random tokens from a fixed seed (the
same global batch on every rank, each rank takes its rows): replace `batches()` with your data. Rank 0
prints one JSON line: the loss of each step per rank.
"""

import argparse
import functools
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

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


def make_optimizer(name, params, lr, rank, model):
    if name in ("adamw", "adam"):
        return (torch.optim.AdamW if name == "adamw" else torch.optim.Adam)(params, lr=lr, foreach=False)
    if name in ("sgd", "sgd-momentum"):
        return torch.optim.SGD(params, lr=lr, momentum=0.9 if name == "sgd-momentum" else 0.0)
    from labkit.estimate import Recipe
    from labkit.run.step import make_optimizer as labkit_optimizer  # labkit.optim's own implementations

    return labkit_optimizer(model, Recipe(model, 1, 1, optimizer=name, rank=rank), lr)


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
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    cuda = torch.cuda.is_available()
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
    if plan["checkpoint"]:  # each block's forward recomputed in backward
        for block in blocks:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
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
    opt = make_optimizer(plan["optimizer"], model.parameters(), plan["lr"], plan["rank"], model)
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
            with torch.autocast(device.type, dtype=LOW.get(dtype, torch.float32), enabled=autocast):
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


if __name__ == "__main__":
    main()
    # torch 2.13 on gloo: a rank sometimes aborts at interpreter exit after the work is done ("terminate called
    # without an active exception"); the results are printed, so leave without the C++ teardown.
    sys.stdout.flush()
    os._exit(0)
'''


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
    plan.json and README.txt in `out_dir` (made if missing) for `devices` processes, and ds_config.json for a plan
    that uses ZeRO or optimizer offload; returns {"training_args", "accelerate_config", "train_fsdp2",
    "plan_config", "plan", "readme"[, "deepspeed"]} -> path."""
    import yaml

    out = _check(recipe, out_dir, devices)
    out.mkdir(parents=True, exist_ok=True)
    ta = training_arguments(recipe, devices)
    acc = accelerate_config(recipe, devices)
    sc = script_config(recipe, devices)
    paths = {k: out / n for k, n in zip(FILES, ("training_args.json", "accelerate_config.yaml", "train_fsdp2.py",
                                                 "plan_config.json", "plan.json", "README.txt"))}
    notes = list(ta["notes"])
    ds = deepspeed_config(recipe, devices) if wants_deepspeed(recipe) else None
    if ds is not None:
        paths["deepspeed"] = out / "ds_config.json"
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
    if ds is not None:
        paths["deepspeed"].write_text(json.dumps(ds["config"], indent=2) + "\n")
    commands = {"torchrun": f"torchrun --standalone --nproc-per-node {devices} train_fsdp2.py",
                "accelerate": "accelerate launch --config_file accelerate_config.yaml your_trainer_script.py "
                              "(build transformers.TrainingArguments(**kwargs from training_args.json, output_dir=...))"}
    if ds is not None:
        commands["deepspeed"] = (f"deepspeed --num_gpus {devices} your_trainer_script.py (deepspeed.initialize("
                                 "model=..., config='ds_config.json'), or transformers.TrainingArguments("
                                 "deepspeed='ds_config.json'))")
    plan = {"recipe": _describe(recipe), "devices": devices, "per_device_train_batch_size": ta["kwargs"][
        "per_device_train_batch_size"], "gradient_accumulation_steps": ta["kwargs"]["gradient_accumulation_steps"],
        "notes": notes, "commands": commands, "files": {k: p.name for k, p in paths.items()}}
    paths["plan"].write_text(json.dumps(plan, indent=2) + "\n")
    lines = ["labkit plan export", "", "Recipe:"]
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
