"""labkit.plan.export: each exported file is accepted by the engine that reads it, and every recipe field without
an engine option is a note.

TrainingArguments is constructed on this CPU machine: for a recipe meant for "cuda" transformers refuses bf16
without a GPU unless use_cpu=True, so the test adds use_cpu=True there (the export itself leaves it out: the
plan is for a GPU). The quantization section is checked with transformers.BitsAndBytesConfig, which only
stores its fields (no bitsandbytes kernel runs at construction).
"""

import json

import pytest
import torch
import yaml

from labkit.estimate import Recipe
from labkit.models.gpt import GPTConfig
from labkit.plan.export import FILES, export_plan

transformers = pytest.importorskip("transformers")
from transformers import TrainingArguments  # noqa: E402
from transformers.training_args import OptimizerNames  # noqa: E402

TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)

RECIPES = {
    "full adamw bf16 + checkpointing": Recipe.of("gpt2-tiny", 8, 16, dtype="mixed-bf16", checkpoint="full",
                                                 device="cuda"),
    "adamw8bit": Recipe.of("gpt2-tiny", 8, 16, optimizer="adamw8bit", micro_batch=2, device="cuda"),
    "galore8bit + step_in_backward": Recipe.of("gpt2-tiny", 4, 16, optimizer="galore8bit", rank=8,
                                               step_in_backward=True, device="cuda"),
    "lora": Recipe.of("gpt2-tiny", 4, 16, lora_rank=8, lora_targets="c_attn,c_proj", device="cuda"),
    "qlora": Recipe.of("llama-tiny", 4, 16, dtype="mixed-bf16", lora_rank=16, quant="nf4", device="cuda"),
    "zero3 x8": Recipe.of("gpt2-tiny", 64, 16, dtype="mixed-bf16", dp=8, zero=3, zero_offload=True,
                          checkpoint="full", micro_batch=4, device="cuda"),
    "cpu fp32 lion": Recipe.of("gpt2-tiny", 4, 16, optimizer="lion"),
}


def _export(recipe, tmp_path, devices=None):
    devices = recipe.world_size if devices is None else devices
    paths = export_plan(recipe, tmp_path / "plan", devices)
    assert set(paths) == set(FILES) and all(p.is_file() for p in paths.values())
    return paths, json.loads(paths["training_args"].read_text())


def _training_args(doc, tmp_path):
    kw = {k: v for k, v in doc.items() if k not in ("peft", "model", "notes")}
    if not torch.cuda.is_available():
        kw.setdefault("use_cpu", True)  # transformers refuses bf16 on a machine without a GPU otherwise
    return TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], **kw)


@pytest.mark.parametrize("name", list(RECIPES))
def test_training_arguments_construct(name, tmp_path):
    r = RECIPES[name]
    _, doc = _export(r, tmp_path)
    args = _training_args(doc, tmp_path)
    assert doc["optim"] in {o.value for o in OptimizerNames}
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps * r.dp == r.batch
    assert args.per_device_train_batch_size == r.micro
    assert args.bf16 == r.dtype.endswith("bf16")
    assert isinstance(doc["notes"], list)


def test_optimizer_and_checkpoint_mapping(tmp_path):
    _, doc = _export(RECIPES["full adamw bf16 + checkpointing"], tmp_path)
    assert doc["optim"] == "adamw_torch" and doc["activation_checkpointing"] is True
    assert doc["activation_checkpointing_kwargs"] == {"use_reentrant": False}
    _, doc = _export(RECIPES["adamw8bit"], tmp_path)
    assert doc["optim"] == "adamw_bnb_8bit" and doc["gradient_accumulation_steps"] == 4
    _, doc = _export(RECIPES["galore8bit + step_in_backward"], tmp_path)
    assert doc["optim"] == "galore_adamw_8bit_layerwise" and "rank=8" in doc["optim_args"]
    assert doc["optim_target_modules"]
    _, doc = _export(RECIPES["cpu fp32 lion"], tmp_path)
    assert doc["optim"] == "lion_32bit" and doc["use_cpu"] is True and "bf16" not in doc


def test_peft_sections_construct(tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import BitsAndBytesConfig

    _, doc = _export(RECIPES["lora"], tmp_path)
    cfg = peft.LoraConfig(**doc["peft"]["lora"])
    assert cfg.r == 8 and set(cfg.target_modules) == {"c_attn", "c_proj"} and "quantization" not in doc["peft"]
    _, doc = _export(RECIPES["qlora"], tmp_path)
    q = BitsAndBytesConfig(**doc["peft"]["quantization"])
    assert q.load_in_4bit and q.bnb_4bit_quant_type == "nf4" and q.bnb_4bit_use_double_quant
    assert q.bnb_4bit_compute_dtype == torch.bfloat16
    assert peft.LoraConfig(**doc["peft"]["lora"]).target_modules in ("all-linear", {"all-linear"})


def test_zero3_over_eight_devices(tmp_path):
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import launch_command_parser

    paths, doc = _export(RECIPES["zero3 x8"], tmp_path, devices=8)
    assert doc["fsdp"] is True and doc["fsdp_config"]["reshard_after_forward"] is True
    assert doc["fsdp_config"]["cpu_offload"] is True and doc["fsdp_config"]["activation_checkpointing"] is True
    assert "activation_checkpointing" not in doc  # FSDP's own, not the Trainer's (a redundant all-gather)
    args = _training_args(doc, tmp_path)
    assert args.fsdp_config["version"] == 2
    acc = yaml.safe_load(paths["accelerate_config"].read_text())
    assert acc["distributed_type"] == "FSDP" and acc["num_processes"] == 8 and acc["mixed_precision"] == "bf16"
    fs = acc["fsdp_config"]
    assert fs["fsdp_version"] == 2 and fs["fsdp_reshard_after_forward"] is True and fs["fsdp_offload_params"] is True
    ClusterConfig.from_yaml_file(str(paths["accelerate_config"]))  # rejects unknown top-level keys
    options = {a.dest for a in launch_command_parser()._actions}
    assert set(fs) <= options, set(fs) - options  # every fsdp key is an `accelerate launch` option
    # ZeRO-2: the gradients sharded, the parameters kept gathered between forward and backward
    paths, doc = _export(RECIPES["zero3 x8"].replace(zero=2, zero_offload=False), tmp_path, devices=8)
    assert doc["fsdp_config"]["reshard_after_forward"] is False
    assert yaml.safe_load(paths["accelerate_config"].read_text())["fsdp_config"]["fsdp_reshard_after_forward"] is False


def test_single_device_accelerate_config(tmp_path):
    paths, _ = _export(RECIPES["cpu fp32 lion"], tmp_path)
    acc = yaml.safe_load(paths["accelerate_config"].read_text())
    assert acc["distributed_type"] == "NO" and acc["num_processes"] == 1 and acc["mixed_precision"] == "no"
    paths, _ = _export(RECIPES["cpu fp32 lion"], tmp_path, devices=2)
    acc = yaml.safe_load(paths["accelerate_config"].read_text())
    assert acc["distributed_type"] == "MULTI_CPU" and acc["num_processes"] == 2


@pytest.mark.parametrize("changes, word", [
    (dict(checkpoint="selective"), "selective"),
    (dict(checkpoint="sqrt"), "sqrt"),
    (dict(optimizer_offload="disk"), "disk"),
    (dict(optimizer_offload="cpu"), "offload"),
    (dict(lisa_layers=1), "LISA"),
    (dict(step_in_backward=True), "step_in_backward"),
    (dict(offload_activations=True), "offload_activations"),
    (dict(dtype="bf16"), "16-bit"),
])
def test_fields_without_an_engine_option_are_notes(changes, word, tmp_path):
    paths, doc = _export(Recipe.of("gpt2-tiny", 4, 16, **changes), tmp_path)
    assert any(word in n for n in doc["notes"]), doc["notes"]
    plan = json.loads(paths["plan"].read_text())
    assert plan["notes"] == doc["notes"]
    assert all(n in paths["readme"].read_text() for n in doc["notes"])


def test_plain_recipe_has_no_technique_notes(tmp_path):
    paths, doc = _export(Recipe.of("gpt2-tiny", 4, 16), tmp_path)
    assert doc["notes"] == [] and json.loads(paths["plan"].read_text())["refused"] == {}


def test_plan_and_readme_carry_recipe_and_commands(tmp_path):
    paths, _ = _export(RECIPES["zero3 x8"], tmp_path, devices=8)
    plan = json.loads(paths["plan"].read_text())
    assert plan["recipe"]["zero"] == 3 and plan["recipe"]["dp"] == 8 and plan["devices"] == 8
    text = paths["readme"].read_text()
    assert "torchrun --standalone --nproc-per-node 8 train_fsdp2.py" in text
    assert "accelerate launch --config_file accelerate_config.yaml" in text
    sc = json.loads(paths["plan_config"].read_text())
    assert sc["batch"] == 64 and sc["micro_batch"] == 4 and sc["zero"] == 3 and sc["checkpoint"] == "full"
    compile(paths["train_fsdp2"].read_text(), "train_fsdp2.py", "exec")


def test_bad_input(tmp_path):
    r = Recipe(TINY, 4, 8)
    with pytest.raises(TypeError, match="Recipe"):
        export_plan({"model": "gpt2"}, tmp_path)
    with pytest.raises(ValueError, match="devices"):
        export_plan(r, tmp_path, devices=0)
    with pytest.raises(ValueError, match="devices"):
        export_plan(r, tmp_path, devices=True)
    f = tmp_path / "a_file"
    f.write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        export_plan(r, f)
    with pytest.raises(ValueError, match="8 devices"):
        export_plan(RECIPES["zero3 x8"], tmp_path / "p", devices=4)


# DeepSpeed: ds_config.json for the plans that use ZeRO or optimizer offload, loaded by DeepSpeed's own config class
DS_RECIPES = {
    "zero3 x8 + offload": (RECIPES["zero3 x8"], 8),
    "zero1 x2 fp16": (Recipe.of("gpt2-tiny", 8, 16, dtype="mixed-fp16", dp=2, zero=1, device="cuda"), 2),
    "zero2 x4 lion": (Recipe.of("gpt2-tiny", 16, 16, optimizer="lion", dp=4, zero=2, micro_batch=2, device="cuda"), 4),
    "optimizer offload cpu": (Recipe.of("gpt2-tiny", 4, 16, dtype="mixed-bf16", optimizer_offload="cpu",
                                        device="cuda"), 1),
    "optimizer offload disk": (Recipe.of("gpt2-tiny", 4, 16, optimizer_offload="disk", micro_batch=2,
                                         device="cuda"), 1),
}


def _ds_config(path):
    """DeepSpeed's own parser of the config (pydantic models of its schema; unknown keys are rejected)."""
    deepspeed_config = pytest.importorskip("deepspeed.runtime.config")
    return deepspeed_config.DeepSpeedConfig(str(path))


@pytest.mark.parametrize("name", list(DS_RECIPES))
def test_deepspeed_config_loads_in_deepspeed(name, tmp_path):
    recipe, devices = DS_RECIPES[name]
    paths, doc = _export(recipe, tmp_path, devices)
    raw = json.loads(paths["deepspeed"].read_text())
    c = _ds_config(paths["deepspeed"])
    assert c.train_micro_batch_size_per_gpu == recipe.micro
    assert c.gradient_accumulation_steps == doc["gradient_accumulation_steps"] == recipe.rank_batch // recipe.micro
    # no process group here: DeepSpeed's world size is 1, so its train batch is one rank's rows
    assert c.train_batch_size == recipe.rank_batch
    assert c.bfloat16_config.enabled == recipe.dtype.endswith("bf16")
    assert c.float16_config.enabled == recipe.dtype.endswith("fp16")
    off = c.zero_config.offload_optimizer
    if recipe.optimizer_offload == "disk":
        assert c.zero_config.stage == 3 and off.device == "nvme" and off.nvme_path is not None
    elif recipe.optimizer_offload == "cpu" or recipe.zero_offload:
        assert c.zero_config.stage == max(recipe.zero, 1) and off.device == "cpu"
    else:
        assert c.zero_config.stage == recipe.zero and off is None
    assert c.zero_config.offload_param is None  # no labkit recipe offloads the parameters themselves
    assert ("optimizer" in raw) == (recipe.optimizer in ("adamw", "adam"))
    plan = json.loads(paths["plan"].read_text())
    assert plan["files"]["deepspeed"] == "ds_config.json" and "deepspeed" in plan["commands"]
    assert "ds_config.json" in paths["readme"].read_text()


def test_deepspeed_config_without_zero_is_stage_0(tmp_path):
    """ds_config.json is written for every plan (every target exists); without ZeRO or offload it is stage 0."""
    paths, _ = _export(RECIPES["full adamw bf16 + checkpointing"], tmp_path)
    c = _ds_config(paths["deepspeed"])
    assert c.zero_config.stage == 0 and c.zero_config.offload_optimizer is None and c.bfloat16_config.enabled


def test_deepspeed_notes_name_what_differs(tmp_path):
    _, doc = _export(DS_RECIPES["zero2 x4 lion"][0], tmp_path, 4)
    assert any("no optimizer section" in n and "lion" in n for n in doc["notes"])
    _, doc = _export(DS_RECIPES["optimizer offload cpu"][0], tmp_path, 1)
    assert any("exported as stage 1" in n for n in doc["notes"])
    _, doc = _export(DS_RECIPES["optimizer offload disk"][0], tmp_path, 1)
    assert any("nvme_path" in n for n in doc["notes"])
