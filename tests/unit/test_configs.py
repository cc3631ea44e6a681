"""labkit.plan.configs: the training configs people have (torchtune, axolotl) read into Recipes.

The torchtune configs are the ones its package ships (installed with --no-deps by `make env`); the axolotl
configs are written here from axolotl's documented schema (https://docs.axolotl.ai/docs/config-reference.html).
"""

import collections
import functools
import importlib.metadata
import pathlib

import pytest
import yaml

from labkit.models import hf
from labkit.plan.configs import ConfigRefused, Format, Refusal, model_name, read_config


def _torchtune_configs() -> list[pathlib.Path]:
    try:
        files = importlib.metadata.files("torchtune") or []
    except importlib.metadata.PackageNotFoundError:
        return []  # test_the_shipped_torchtune_configs_are_found fails, with the install command
    return sorted(f.locate() for f in files if "recipes/configs/" in str(f) and str(f).endswith(".yaml"))


TORCHTUNE = _torchtune_configs()
# What torchtune 0.6.1 ships, counted by `ls recipes/configs/**/*.yaml`: a wrong path would read none.
SHIPPED = 156


def test_the_shipped_torchtune_configs_are_found():
    assert len(TORCHTUNE) == SHIPPED, "install torchtune's configs: pip install --no-deps torchtune==0.6.1"


@functools.lru_cache(maxsize=None)
def _read_all():
    """Every shipped config read at seq 2048: ({name: Reading}, {name: ConfigRefused}), once per process."""
    read, refused = {}, {}
    for path in TORCHTUNE:
        name = str(path).split("recipes/configs/")[1]
        try:
            read[name] = read_config(path, seq=2048)
        except ConfigRefused as e:
            refused[name] = e
    return read, refused


def test_every_shipped_torchtune_config_becomes_a_recipe_or_is_refused_with_a_reason():
    """No config fails any other way; the counts are printed (pytest -s shows them)."""
    READ, REFUSED = _read_all()
    assert len(READ) + len(REFUSED) == SHIPPED
    by_reason = collections.Counter(e.reason for e in REFUSED.values())
    print(f"\n{len(READ)} torchtune configs read into Recipes; refused: "
          + ", ".join(f"{n} {r.value}" for r, n in by_reason.most_common()))
    assert all(isinstance(e.reason, Refusal) for e in REFUSED.values())
    # every Llama-family fine-tuning config (full, LoRA, QLoRA) becomes a Recipe
    llama = [n for n in READ if n.split("/")[0] in ("llama2", "llama3", "llama3_1", "llama3_2", "llama3_3",
                                                     "code_llama2", "mistral")]
    assert len(llama) >= 45, sorted(READ)
    assert {e.reason for n, e in REFUSED.items() if n.startswith(("qwen2/7B_full", "phi3/mini_lora"))} \
        == {Refusal.ARCHITECTURE}
    assert REFUSED["llama3_1/8B_lora_dpo.yaml"].reason == Refusal.SECOND_MODEL
    assert REFUSED["llama3_2/evaluation.yaml"].reason == Refusal.NOT_TRAINING
    assert REFUSED["llama3_2/3B_qat_lora.yaml"].reason == Refusal.TECHNIQUE


def test_no_field_of_a_torchtune_config_is_dropped_silently():
    READ, _ = _read_all()
    for name, reading in READ.items():
        cfg = yaml.safe_load(next(p for p in TORCHTUNE if str(p).endswith(name)).read_text())
        assert set(cfg) <= reading.fields_named(), (name, set(cfg) - reading.fields_named())
        assert reading.format is Format.TORCHTUNE


def test_torchtune_3b_lora_single_device_reads_as_its_yaml_says():
    READ, _ = _read_all()
    r = READ["llama3_2/3B_lora_single_device.yaml"].recipe
    # batch_size 4, gradient_accumulation_steps 8; lora_rank 64 on q, v, output_proj and the MLP
    assert (r.model, r.batch, r.micro_batch, r.seq) == ("llama3.2-3b", 32, 4, 2048)
    assert (r.dtype, r.device, r.optimizer, r.checkpoint, r.offload_activations) == \
        ("bf16", "cuda", "adamw", "full", False)
    assert r.lora_rank == 64 and r.quant == "none"
    assert set(r.lora_targets) == {"q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    # torchtune.modules.loss.CEWithChunkedOutputLoss: its 8 output chunks (num_output_chunks' default)
    assert r.loss_chunks == 8
    assert "loss" in READ["llama3_2/3B_lora_single_device.yaml"].mapped


def test_torchtune_qlora_paged_and_distributed_fields():
    READ, _ = _read_all()
    qlora = READ["llama3_2/3B_qlora_single_device.yaml"].recipe
    # torchtune quantizes the LoRA-wrapped linears only
    assert (qlora.quant, qlora.quant_set) == ("nf4", "targets")
    full8 = READ["llama3_1/8B_full_single_device.yaml"]
    assert full8.recipe.optimizer == "adamw8bit"  # bitsandbytes.optim.PagedAdamW8bit
    assert full8.recipe.paged_states  # bitsandbytes' PagedAdamW8bit: its states in unified memory
    big = READ["llama3/70B_full.yaml"].recipe  # tune run --nproc_per_node 8 full_finetune_distributed
    assert (big.dp, big.zero, big.zero_offload, big.batch) == (8, 3, True, 16)
    multinode = READ["llama3_3/70B_full_multinode.yaml"]
    assert multinode.recipe.dp == 16 and "devices" in dict(multinode.assumed)


def test_a_config_without_a_sequence_length_asks_for_one(tmp_path):
    src = next(p for p in TORCHTUNE if str(p).endswith("llama3_2/3B_lora_single_device.yaml"))
    with pytest.raises(ConfigRefused, match="give seq=N") as e:
        read_config(src)
    assert e.value.reason is Refusal.NO_SEQUENCE
    assert read_config(src, seq=512).recipe.seq == 512


def test_the_caller_sets_the_world_size_of_a_distributed_config():
    src = next(p for p in TORCHTUNE if str(p).endswith("llama3_1/70B_lora.yaml"))
    assert read_config(src, seq=1024, devices=4).recipe.dp == 4


# ----------------------------------------------------------------------------- axolotl

# axolotl's QLoRA example for Llama 2 7B (examples/llama-2/qlora.yml), fields as its docs describe them
AXOLOTL_QLORA = """
base_model: NousResearch/Llama-2-7b-hf
model_type: LlamaForCausalLM
tokenizer_type: LlamaTokenizer
load_in_8bit: false
load_in_4bit: true
strict: false
datasets:
  - path: mhenrichsen/alpaca_2k_test
    type: alpaca
dataset_prepared_path:
val_set_size: 0.05
output_dir: ./outputs/qlora-out
adapter: qlora
lora_model_dir:
sequence_len: 4096
sample_packing: true
pad_to_sequence_len: true
lora_r: 32
lora_alpha: 16
lora_dropout: 0.05
lora_target_modules:
lora_target_linear: true
lora_fan_in_fan_out:
gradient_accumulation_steps: 4
micro_batch_size: 2
num_epochs: 4
optimizer: paged_adamw_32bit
lr_scheduler: cosine
learning_rate: 0.0002
train_on_inputs: false
group_by_length: false
bf16: auto
fp16:
tf32: false
gradient_checkpointing: true
flash_attention: true
warmup_steps: 10
evals_per_epoch: 4
saves_per_epoch: 1
weight_decay: 0.0
special_tokens:
"""


def test_axolotl_qlora_example(tmp_path):
    path = tmp_path / "qlora.yml"
    path.write_text(AXOLOTL_QLORA)
    reading = read_config(path)
    r = reading.recipe
    assert reading.format is Format.AXOLOTL
    assert (r.model, r.batch, r.micro_batch, r.seq) == ("llama2-7b", 8, 2, 4096)
    assert (r.quant, r.lora_rank, r.lora_targets, r.checkpoint) == ("nf4", 32, "all-linear", "full")
    assert r.quant_set == "all-linear"  # load_in_4bit: all Linears but the head
    assert r.dtype == "mixed-bf16" and r.optimizer == "adamw"
    assert r.paged_states  # paged_adamw_32bit: bitsandbytes' PagedAdamW, states in unified memory
    assert set(yaml.safe_load(AXOLOTL_QLORA)) <= reading.fields_named()


def test_axolotl_with_a_deepspeed_json_and_devices(tmp_path):
    (tmp_path / "zero3.json").write_text('{"zero_optimization": {"stage": 3, '
                                         '"offload_optimizer": {"device": "cpu"}}, "bf16": {"enabled": "auto"}}')
    (tmp_path / "full.yml").write_text("base_model: meta-llama/Meta-Llama-3-8B\nsequence_len: 2048\n"
                                       "micro_batch_size: 1\ngradient_accumulation_steps: 1\nbf16: true\n"
                                       "optimizer: adamw_torch_fused\ndeepspeed: zero3.json\n")
    r = read_config(tmp_path / "full.yml", devices=4).recipe
    assert (r.model, r.dp, r.zero, r.zero_offload, r.batch, r.dtype) == ("llama3-8b", 4, 3, True, 4, "bf16")
    assert r.foreach is False


def test_a_model_not_available_offline_gets_the_error_estimate_gives(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "c.yml").write_text("base_model: nobody/no-such-model-xyz\nsequence_len: 512\n")
    with pytest.raises(ValueError) as mine:
        read_config(tmp_path / "c.yml")
    with pytest.raises(ValueError) as estimate_s:
        hf.get_config("nobody/no-such-model-xyz")
    assert str(mine.value) == str(estimate_s.value) and "unknown model" in str(mine.value)


@pytest.mark.parametrize("hub_id, name", [
    ("meta-llama/Meta-Llama-3.1-8B-Instruct", "llama3.1-8b"), ("meta-llama/Llama-3.2-3B", "llama3.2-3b"),
    ("NousResearch/Llama-2-7b-hf", "llama2-7b"), ("meta-llama/Llama-2-13b-chat-hf", "llama2-13b"),
    ("mistralai/Mistral-7B-v0.1", "mistral-7b"), ("codellama/CodeLlama-7b-hf", "code-llama2-7b"),
    ("openai-community/gpt2", "gpt2"), ("Qwen/Qwen2-7B", "Qwen/Qwen2-7B"),
])
def test_hub_ids_map_to_offline_models(hub_id, name):
    assert model_name(hub_id) == name


def test_bad_files_are_refused_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="cannot read the config"):
        read_config(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigRefused, match="no mapping"):
        read_config(tmp_path / "list.yaml")
    (tmp_path / "other.yaml").write_text("foo: 1\n")
    with pytest.raises(ConfigRefused) as e:
        read_config(tmp_path / "other.yaml")
    assert e.value.reason is Refusal.UNKNOWN_FORMAT


# ----------------------------------------------------------------------------- transformers, DeepSpeed, accelerate

def test_training_arguments_json_as_transformers_takes_it(tmp_path):
    """A TrainingArguments JSON written from its documented fields, checked by TrainingArguments(**json)."""
    import json

    from transformers import TrainingArguments

    doc = {"output_dir": "out", "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
           "bf16": True, "optim": "adamw_bnb_8bit", "weight_decay": 0.01, "gradient_checkpointing": True,
           "learning_rate": 2e-5, "num_train_epochs": 1, "logging_steps": 10, "report_to": [], "use_cpu": True}
    TrainingArguments(**doc)  # transformers accepts every field (use_cpu: bf16 without a GPU)
    (tmp_path / "args.json").write_text(json.dumps(doc))
    reading = read_config(tmp_path / "args.json", model="llama-tiny", seq=64)
    r = reading.recipe
    assert reading.format is Format.TRAINING_ARGS
    assert (r.model, r.batch, r.micro_batch, r.seq, r.optimizer, r.checkpoint, r.device) == \
        ("llama-tiny", 8, 4, 64, "adamw8bit", "full", "cpu")
    assert r.dtype == "mixed-bf16"  # bf16=True over fp32 weights: the Trainer's autocast
    assert set(doc) <= reading.fields_named()
    with pytest.raises(ConfigRefused, match="names no model"):
        read_config(tmp_path / "args.json", seq=64)
    same = read_config(TrainingArguments(**doc), model="llama-tiny", seq=64).recipe  # the object itself
    assert same == r


def test_deepspeed_json_as_deepspeed_takes_it(tmp_path):
    import json

    doc = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "gradient_clipping": 1.0}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(doc))
    from deepspeed.runtime.config import DeepSpeedConfig  # a test dependency: missing, this fails

    DeepSpeedConfig(str(path))  # DeepSpeed's own parser accepts it
    r = read_config(path, model="gpt2-tiny", seq=64, devices=4).recipe
    assert (r.dp, r.zero, r.zero_offload, r.batch, r.micro_batch, r.dtype, r.optimizer) == \
        (4, 2, True, 32, 2, "mixed-bf16", "adamw")


def test_accelerate_config_with_fsdp(tmp_path):
    (tmp_path / "acc.yaml").write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nmixed_precision: bf16\nnum_machines: 1\n"
        "num_processes: 2\nfsdp_config:\n  fsdp_reshard_after_forward: true\n  fsdp_offload_params: false\n"
        "  fsdp_activation_checkpointing: true\n")
    reading = read_config(tmp_path / "acc.yaml", model="gpt2-tiny", seq=64, batch=2)
    r = reading.recipe
    assert reading.format is Format.ACCELERATE
    assert (r.dp, r.zero, r.checkpoint, r.dtype, r.batch) == (2, 3, "full", "mixed-bf16", 4)


@pytest.mark.parametrize("target", ["training_args", "accelerate", "torchrun", "deepspeed"])
def test_every_export_target_reads_back_through_read_config(target, tmp_path):
    """A recipe every target carries (mixed bf16, checkpointing, micro-batches, AdamW on 2 ranks with ZeRO-3):
    each target's files, read by read_config(folder, target=...), give back its memory fields."""
    from labkit.estimate import Recipe
    from labkit.plan.export import export_gaps, export_plan, memory_fields

    r = Recipe.of("gpt2-tiny", 8, 64, dtype="mixed-bf16", checkpoint="full", micro_batch=2, dp=2, zero=3)
    assert not export_gaps(r, 2)[target]
    export_plan(r, tmp_path, 2)
    assert memory_fields(read_config(tmp_path, target=target).recipe) == memory_fields(r)


@pytest.mark.parametrize("recipe, devices", [
    (dict(dtype="mixed-bf16", checkpoint="full", micro_batch=2, optimizer="adamw8bit"), 1),
    (dict(dtype="bf16", step_in_backward=True, optimizer="adafactor"), 1),
    (dict(dtype="mixed-bf16", dp=2, zero=3, checkpoint="full"), 2),
])
def test_a_labkit_export_reads_back_into_the_same_recipe(recipe, devices, tmp_path):
    from labkit.estimate import Recipe
    from labkit.plan.export import export_plan, memory_fields

    r = Recipe.of("gpt2-tiny", 8, 64, **recipe)
    export_plan(r, tmp_path, devices)
    reading = read_config(tmp_path)
    assert reading.format is Format.LABKIT_EXPORT
    assert memory_fields(reading.recipe) == memory_fields(r)
