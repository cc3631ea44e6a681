"""How close labkit.estimate comes to the ledger's measurement, over many small CPU training steps.

    python bench/estimator_accuracy.py [--quick] [--random N --seed S]

For each configuration it predicts one step, measures two real steps on the CPU (measure_step) and
prints predicted vs measured peak, the error as a percentage of the measured peak, both peak phases
and the category with the largest error (also in % of the measured peak). Configurations over the
tolerance, in the total or in any category, are then shown category by category. The last line is the
summary: `estimator: configs=N max_error=X% median_error=Y% max_category_error=Z% median_category_error=W%`
(the total's error and the largest category's, each config's in % of its measured peak), after the textbook
layer's own errors (its figure from the published formulas alone, labkit.estimate.textbook) and the config
with the largest category error on the lines before it.

GaLore's estimate holds two optimizer moments: a projector-refresh step (an SVD per matrix) and a steady
step. A GaLore configuration is measured one of two ways: "refresh" (measure_step's galore_refresh: the
second step refreshes, with all state made) against the whole estimate, or "steady" (the second step of a
default run, Measurement.of_step(2)) against the estimate without its refresh moments.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import statistics
import sys
from dataclasses import dataclass, field

from tqdm import tqdm

from labkit.memory import CATEGORIES, fmt_bytes
from labkit.estimate import Recipe, estimate
from labkit.estimate.moments import REFRESH
from labkit.estimate.recipe import PAGED_OPTIMIZERS
from labkit.run import measure_step
from labkit.models.gpt import GPTConfig

TOLERANCE = 3.0  # % of the measured peak, as the lessons state it


@dataclass
class Config:
    label: str
    model: object  # a GPTConfig or a preset name
    batch: int
    seq: int
    dtype: str
    optimizer: str
    overrides: dict = field(default_factory=dict)  # preset config overrides, e.g. n_layer=3
    refresh: bool | None = None  # GaLore: measure a projector-refresh step (True) or a steady one (False)
    added: tuple = ()  # overrides drawn on their own stream (`_draw_added`): left out if the estimator refuses them


def _gpt(attention: str, dropout: float, **kw) -> GPTConfig:
    return GPTConfig(**{"n_layer": 2, "n_head": 4, "n_embd": 128, "block_size": 128,
                        "attention": attention, "dropout": dropout, **kw})


def configs(quick: bool = False) -> list[Config]:
    """labkit GPT (fused and manual attention, with and without dropout) and the tiny transformers presets,
    in full training and with LoRA, QLoRA (NF4 / int8 base) and LISA."""
    out = []
    # labkit GPT: the four attention/dropout variants, across dtypes and optimizers
    gpt_plan = [  # (attention, dropout, B, S, dtype, optimizer)
        ("sdpa", 0.0, 4, 128, "fp32", "adamw"), ("sdpa", 0.0, 2, 64, "bf16", "sgd"),
        ("sdpa", 0.0, 4, 128, "mixed-bf16", "adam"), ("sdpa", 0.0, 2, 128, "mixed-fp16", "sgd-momentum"),
        ("sdpa", 0.0, 8, 32, "fp16", "adamw"),
        ("sdpa", 0.1, 4, 128, "fp32", "sgd"), ("sdpa", 0.1, 2, 128, "mixed-bf16", "adamw"),
        ("sdpa", 0.1, 4, 64, "bf16", "adam"), ("sdpa", 0.1, 2, 64, "mixed-fp16", "adamw"),
        ("manual", 0.0, 4, 128, "fp32", "adam"), ("manual", 0.0, 2, 128, "mixed-bf16", "sgd"),
        ("manual", 0.0, 4, 64, "fp16", "sgd-momentum"), ("manual", 0.0, 2, 64, "mixed-fp16", "adamw"),
        ("manual", 0.1, 4, 128, "mixed-bf16", "adamw"), ("manual", 0.1, 2, 128, "fp32", "sgd-momentum"),
        ("manual", 0.1, 4, 64, "bf16", "adamw"), ("manual", 0.1, 2, 64, "fp16", "sgd"),
    ]
    for att, p, B, S, dtype, opt in gpt_plan:
        out.append(Config(f"gpt {att} p={p:g}", _gpt(att, p), B, S, dtype, opt))
    out.append(Config("gpt L4 h256 sdpa", _gpt("sdpa", 0.0, n_layer=4, n_embd=256, block_size=256),
                      2, 256, "mixed-bf16", "adamw"))
    out.append(Config("gpt L3 h64 (weights dominate)", _gpt("sdpa", 0.0, n_layer=3, n_head=2, n_embd=64,
                                                             block_size=64), 1, 8, "fp32", "sgd-momentum"))
    # small batches: the end of backward or the optimizer step holds the peak, not the activations
    out.append(Config("gpt L4 h256 (optimizer peak)", _gpt("sdpa", 0.0, n_layer=4, n_embd=256, block_size=64),
                      1, 16, "fp32", "adamw"))
    out.append(Config("gpt L4 h256 (optimizer peak)", _gpt("manual", 0.0, n_layer=4, n_embd=256, block_size=64),
                      1, 8, "mixed-bf16", "adam"))
    # activation policies and micro-batching (labkit.recompute / labkit.accumulate), labkit GPT only
    deep = _gpt("sdpa", 0.0, n_layer=6, n_embd=96, block_size=64)
    for opts, dtype in (({"checkpoint": "full"}, "fp32"), ({"checkpoint": "sqrt"}, "mixed-bf16"),
                        ({"checkpoint": "full", "segments": 2}, "bf16"), ({"checkpoint": "selective"}, "fp32"),
                        ({"offload_activations": True}, "mixed-bf16"), ({"micro_batch": 2}, "fp32"),
                        ({"micro_batch": 2, "checkpoint": "sqrt"}, "mixed-bf16")):
        out.append(Config("gpt L6 h96 " + " ".join(f"{k}={v}" for k, v in opts.items()), deep, 4, 64, dtype,
                          "adamw", dict(opts)))
    out.append(Config("gpt manual p=0.1 offload", _gpt("manual", 0.1, n_layer=4, n_embd=64, block_size=64), 4, 64,
                      "fp32", "sgd", {"offload_activations": True}))
    # optimizer placement (labkit.optim): a step per parameter inside backward, state on the host
    for opt, dtype, opts in (("adamw", "fp32", {"step_in_backward": True}), ("lion", "mixed-bf16", {"step_in_backward": True}),
                             ("adamw8bit", "fp32", {"step_in_backward": True}), ("adamw", "fp32", {"optimizer_offload": "cpu"})):
        out.append(Config("gpt L6 h96 " + " ".join(f"{k}={v}" for k, v in opts.items()), deep, 4, 64, dtype, opt, dict(opts)))
    # transformers presets (sdpa; gpt2-tiny has dropout 0.1, so CPU SDPA takes its math path)
    hf_plan = [  # (preset, overrides, B, S, dtype, optimizer)
        ("gpt2-tiny", {}, 4, 64, "fp32", "adamw"), ("gpt2-tiny", {}, 4, 64, "mixed-bf16", "adam"),
        ("gpt2-tiny", {}, 2, 128, "bf16", "sgd"), ("gpt2-tiny", {}, 2, 128, "mixed-fp16", "adamw"),
        ("gpt2-tiny", {"n_layer": 3}, 4, 128, "fp16", "sgd-momentum"),
        ("gpt2-tiny", {"n_layer": 3}, 8, 32, "mixed-bf16", "adamw"),
        ("llama-tiny", {}, 4, 64, "bf16", "adamw"), ("llama-tiny", {}, 2, 128, "fp32", "sgd"),
        ("llama-tiny", {}, 4, 128, "mixed-bf16", "adamw"), ("llama-tiny", {}, 2, 64, "mixed-fp16", "adam"),
        ("llama-tiny", {"num_hidden_layers": 3}, 4, 64, "fp16", "sgd-momentum"),
        ("llama-tiny", {"num_hidden_layers": 3}, 8, 32, "fp32", "adamw"),
        ("llama-tiny", {"num_hidden_layers": 3}, 2, 128, "mixed-bf16", "sgd"),
        ("llama-tiny", {}, 1, 8, "fp32", "adamw"), ("gpt2-tiny", {}, 1, 8, "bf16", "adam"),
    ]
    for name, ov, B, S, dtype, opt in hf_plan:
        label = name + "".join(f" {k}={v}" for k, v in ov.items())
        out.append(Config(label, name, B, S, dtype, opt, ov))
    # LoRA / QLoRA (NF4 or int8 frozen base) / LISA (labkit.peft), all three families
    first_peft = len(out)
    small, wide = _gpt("sdpa", 0.0, n_embd=64, block_size=64), _gpt("sdpa", 0.0, n_embd=256, block_size=64)
    peft_plan = [  # (label, model, B, S, dtype, options)
        ("gpt", small, 4, 64, "fp32", {"lora_rank": 4}),
        ("gpt", small, 4, 64, "fp32", {"lora_rank": 16, "lora_targets": "c_attn"}),
        ("gpt", small, 4, 64, "fp32", {"lora_rank": 8, "quant": "nf4"}),
        ("gpt", small, 4, 64, "fp32", {"lora_rank": 8, "quant": "int8"}),
        ("gpt", small, 4, 64, "fp32", {"lisa_layers": 1}),
        ("gpt", small, 2, 32, "mixed-bf16", {"lora_rank": 8}),
        ("gpt", small, 2, 32, "mixed-bf16", {"lora_rank": 8, "quant": "nf4"}),
        ("gpt", small, 2, 32, "mixed-bf16", {"lisa_layers": 1}),
        ("gpt h256 (weights dominate)", wide, 1, 16, "fp32", {"lora_rank": 8, "quant": "nf4"}),
        ("gpt h256 (weights dominate)", wide, 1, 16, "fp32", {"lora_rank": 8, "quant": "int8"}),
        ("gpt h256 (weights dominate)", wide, 1, 16, "fp32", {"lora_rank": 8}),
        ("gpt2-tiny", "gpt2-tiny", 4, 64, "fp32", {"lora_rank": 4}),
        ("gpt2-tiny", "gpt2-tiny", 4, 64, "fp32", {"lora_rank": 16, "lora_targets": "c_attn,mlp.c_proj",
                                                   "quant": "nf4"}),
        ("gpt2-tiny", "gpt2-tiny", 4, 64, "fp32", {"lisa_layers": 1}),
        ("gpt2-tiny", "gpt2-tiny", 2, 32, "mixed-bf16", {"lora_rank": 8, "quant": "int8"}),
        ("llama-tiny", "llama-tiny", 4, 64, "fp32", {"lora_rank": 16}),
        ("llama-tiny", "llama-tiny", 4, 64, "fp32", {"lora_rank": 4, "lora_targets": "q_proj,v_proj"}),
        ("llama-tiny", "llama-tiny", 4, 64, "fp32", {"lora_rank": 8, "quant": "nf4"}),
        ("llama-tiny", "llama-tiny", 4, 64, "fp32", {"lora_rank": 8, "quant": "int8"}),
        ("llama-tiny", "llama-tiny", 4, 64, "fp32", {"lisa_layers": 1}),
        ("llama-tiny", "llama-tiny", 2, 32, "bf16", {"lora_rank": 8}),
        ("llama-tiny", "llama-tiny", 2, 32, "bf16", {"lora_rank": 8, "quant": "nf4"}),
        ("llama-tiny", "llama-tiny", 2, 32, "mixed-bf16", {"lora_rank": 8, "quant": "nf4"}),
        ("llama-tiny h256", "llama-tiny", 1, 8, "fp32", {"lora_rank": 4, "quant": "nf4", "hidden_size": 256,
                                                          "intermediate_size": 512}),
        ("gpt h128 S256 (activations dominate)", _gpt("sdpa", 0.0, block_size=256), 4, 256, "fp32", {"lora_rank": 8}),
        ("gpt h128 S256 (activations dominate)", _gpt("sdpa", 0.0, block_size=256), 4, 256, "fp32",
         {"lora_rank": 8, "quant": "nf4"}),
    ]
    for label, model, B, S, dtype, opts in peft_plan:
        shown = " ".join(f"{k}={v}" for k, v in opts.items() if k not in ("hidden_size", "intermediate_size"))
        out.append(Config(f"{label} {shown}", model, B, S, dtype, "adamw", dict(opts)))
    # GaLore and 8-bit GaLore (labkit.optim), the three families: each measured in a step that refreshes the
    # projectors and in a steady one; small batches put the peak in the optimizer step, larger ones in backward
    first_galore = len(out)
    wide = _gpt("sdpa", 0.0, n_embd=256, block_size=64)
    galore_plan = [  # (label, model, B, S, dtype, optimizer, options)
        ("gpt", _gpt("sdpa", 0.0), 1, 16, "bf16", "galore", {"rank": 16}),
        ("gpt", _gpt("sdpa", 0.0), 1, 16, "fp32", "galore8bit", {"rank": 16}),
        ("gpt", _gpt("manual", 0.1), 4, 64, "mixed-bf16", "galore", {"rank": 32}),
        ("gpt h256", wide, 1, 8, "mixed-bf16", "galore8bit", {"rank": 64, "step_in_backward": True}),
        ("gpt h256", wide, 1, 8, "bf16", "galore8bit", {"rank": 64, "proj_dtype": "int8"}),
        ("gpt", _gpt("sdpa", 0.0), 2, 32, "bf16", "galore", {"rank": 8, "step_in_backward": True}),
        ("gpt2-tiny", "gpt2-tiny", 1, 8, "fp32", "galore", {"rank": 16}),
        ("gpt2-tiny", "gpt2-tiny", 1, 8, "bf16", "galore8bit", {"rank": 16, "step_in_backward": True}),
        ("gpt2-tiny", "gpt2-tiny", 4, 64, "mixed-bf16", "galore8bit", {"rank": 8, "proj_dtype": "fp32"}),
        ("llama-tiny", "llama-tiny", 1, 8, "bf16", "galore", {"rank": 16}),
        ("llama-tiny", "llama-tiny", 1, 8, "mixed-bf16", "galore8bit", {"rank": 16, "proj_dtype": "int8"}),
        ("llama-tiny", "llama-tiny", 2, 32, "fp32", "galore", {"rank": 8, "step_in_backward": True}),
        ("llama-tiny", "llama-tiny", 1, 8, "bf16", "galore8bit", {"rank": 32, "step_in_backward": True}),
    ]
    for label, model, B, S, dtype, opt, opts in galore_plan:
        shown = " ".join(f"{k}={v}" for k, v in opts.items())
        for refresh in (True, False):
            out.append(Config(f"{label} {shown} {'refresh' if refresh else 'steady'}", model, B, S, dtype, opt,
                              dict(opts), refresh))
    # activation policies on the transformers presets and with adapters (the blocks' ops replayed)
    hf_policies = [  # (preset, B, S, dtype, options)
        ("gpt2-tiny", 2, 128, "fp32", {"n_layer": 4, "checkpoint": "full"}),
        ("gpt2-tiny", 2, 128, "mixed-bf16", {"n_layer": 4, "checkpoint": "selective"}),
        ("gpt2-tiny", 2, 128, "bf16", {"n_layer": 4, "offload_activations": True, "attn_implementation": "eager"}),
        ("llama-tiny", 2, 128, "mixed-bf16", {"num_hidden_layers": 4, "checkpoint": "sqrt"}),
        ("llama-tiny", 2, 128, "fp32", {"num_hidden_layers": 4, "checkpoint": "full", "segments": 2,
                                        "offload_activations": True}),
        ("llama-tiny", 4, 64, "mixed-bf16", {"num_hidden_layers": 4, "micro_batch": 2, "checkpoint": "full",
                                             "lora_rank": 8, "quant": "nf4"}),
        ("gpt2-tiny", 2, 128, "mixed-bf16", {"n_layer": 4, "offload_activations": True, "lora_rank": 8}),
        ("llama-tiny", 2, 128, "fp32", {"num_hidden_layers": 4, "checkpoint": "selective", "lisa_layers": 2}),
    ]
    for name, B, S, dtype, opts in hf_policies:
        shown = " ".join(f"{k}={v}" for k, v in opts.items() if k not in ("n_layer", "num_hidden_layers"))
        out.append(Config(f"{name} L4 {shown}", name, B, S, dtype, "adamw", dict(opts)))
    if quick:  # one of each kind
        keep = (0, 6, 13, len(gpt_plan) + 2, len(gpt_plan) + 3, len(gpt_plan) + 8, first_peft + 2, first_peft + 19,
                first_galore, first_galore + 1)
        out = [out[i] for i in keep]
    return out


# ---- random configurations: cases nobody chose ------------------------------------------------------
WORK_CAP = 4e9  # multiply-adds of one forward (about B*S*L*(12 h^2 + 2 S h)): keeps a measurement under ~10 s on 2 cores
OPTIONS_P = {"checkpoint": 0.35, "offload_activations": 0.1, "micro_batch": 0.2, "step_in_backward": 0.1,
             "optimizer_offload": 0.1}
PEFT_P = (("none", 0.55), ("lora", 0.15), ("qlora", 0.1), ("lora-int8", 0.05), ("lisa", 0.15))
# the Recipe fields added after the random bench's seeds were first reported (issue 43): drawn on a stream of
# their own, seeded by the configuration drawn so far, so every earlier field of every seed draws as it did
ADDED_P = {"loss_chunks": 0.2, "quant_set": 0.5, "base_dtype": 0.5, "paged_states": 0.3, "lora_targets": 0.5}
# each family's Linears in a block, by the suffixes LoRA targets name (lora_targets draws a subset of them)
BLOCK_LINEARS = {"gpt": ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"),
                 "gpt2": ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"),
                 "llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}


def _loguniform_int(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def _draw(rng: random.Random) -> Config | None:
    """One configuration from wide ranges: layers 1-6, width 32-512 with 1-8 heads, sequence 1-1024, batch 1-8,
    every dtype, optimizer and attention kind, the activation policies, optimizer placement and PEFT methods,
    over the three families. Sizes are log-uniform; a draw over WORK_CAP is redrawn (see `random_configs`)."""
    family = rng.choice(["labkit-gpt", "labkit-gpt", "gpt2", "llama"])
    L, heads = rng.randint(1, 6), rng.choice([1, 2, 4, 8])
    hd = rng.choice([d for d in (8, 16, 32, 64) if 32 <= heads * d <= 512])
    h, S, B = heads * hd, _loguniform_int(rng, 1, 1024), rng.randint(1, 8)
    block = max(S, rng.choice([64, 128, 256, 512, 1024]))
    dropout = rng.choice([0.0, 0.0, 0.1])
    attention = rng.choice(["sdpa", "manual"])
    if family == "labkit-gpt":
        model, ov, name = GPTConfig(n_layer=L, n_head=heads, n_embd=h, block_size=block, dropout=dropout,
                                    attention=attention), {}, f"gpt L{L} h{h}/{heads} {attention} p={dropout:g}"
    elif family == "gpt2":
        model, name = "gpt2-tiny", f"gpt2 L{L} h{h}/{heads} {attention} p={dropout:g}"
        ov = dict(n_layer=L, n_head=heads, n_embd=h, n_positions=block, attn_pdrop=dropout, resid_pdrop=dropout,
                  embd_pdrop=dropout, attn_implementation="sdpa" if attention == "sdpa" else "eager")
    else:
        kv = rng.choice([k for k in (1, 2, 4, 8) if heads % k == 0])
        ffn = rng.choice([2 * h, 8 * h // 3 // 8 * 8 or 8, 4 * h])
        model, name = "llama-tiny", f"llama L{L} h{h}/{heads}/{kv} ffn{ffn} {attention} p={dropout:g}"
        ov = dict(num_hidden_layers=L, num_attention_heads=heads, num_key_value_heads=kv, hidden_size=h,
                  intermediate_size=ffn, max_position_embeddings=block, attention_dropout=dropout,
                  attn_implementation="sdpa" if attention == "sdpa" else "eager")
    ffn = ov.get("intermediate_size", 4 * h)
    if B * S * L * (4 * h * h + 3 * h * ffn + 2 * S * h) > WORK_CAP:
        return None
    dtype = rng.choice(["fp32", "fp16", "bf16", "mixed-fp16", "mixed-bf16"])
    optimizer = rng.choice(["sgd", "sgd-momentum", "adam", "adamw", "adamw8bit", "adam8bit", "lion", "adafactor",
                            "galore", "galore8bit"])
    opts: dict = dict(ov)
    refresh = None
    if optimizer.startswith("galore"):
        opts["rank"] = rng.choice([r for r in (2, 4, 8, 16, 32) if r <= h // 2] or [2])
        refresh = rng.random() < 0.5  # half the GaLore draws measure a projector-refresh step
        if optimizer == "galore8bit" and rng.random() < 0.5:
            opts["proj_dtype"] = rng.choice(["param", "fp32", "int8"])
    if rng.random() < OPTIONS_P["checkpoint"]:
        opts["checkpoint"] = rng.choice(["full", "sqrt", "selective"])
        if opts["checkpoint"] == "full" and L > 1 and rng.random() < 0.5:
            opts["segments"] = rng.randint(1, L)
    if rng.random() < OPTIONS_P["offload_activations"]:
        opts["offload_activations"] = True
    if B > 1 and rng.random() < OPTIONS_P["micro_batch"]:
        opts["micro_batch"] = rng.choice([m for m in range(1, B) if B % m == 0])
    if rng.random() < OPTIONS_P["step_in_backward"]:
        opts["step_in_backward"] = True
    if optimizer == "adamw" and rng.random() < OPTIONS_P["optimizer_offload"]:
        opts["optimizer_offload"] = "cpu"
    u, peft = rng.random(), "none"
    for kind, p in PEFT_P:
        if u < p:
            peft = kind
            break
        u -= p
    if peft in ("lora", "qlora", "lora-int8"):
        opts["lora_rank"] = rng.choice([1, 4, 8, 16])
        opts["quant"] = {"lora": "none", "qlora": "nf4", "lora-int8": "int8"}[peft]
    elif peft == "lisa":
        opts["lisa_layers"] = rng.randint(1, L)
    added = _draw_added(random.Random(f"{name} {sorted(opts.items())} {B} {S} {dtype} {optimizer} {refresh}"),
                        S, dtype, optimizer, peft, BLOCK_LINEARS[name.split()[0]])
    return _config(name, model, B, S, dtype, optimizer, {**opts, **added}, ov, refresh, tuple(added))


def _draw_added(rng: random.Random, S: int, dtype: str, optimizer: str, peft: str, linears: tuple) -> dict:
    """The fields added later (ADDED_P): torchtune's chunked loss, QLoRA's quantized set (torchtune's: the
    adapters' targets only), a 16-bit frozen base under fp32 adapters, bitsandbytes' paged states, and LoRA on
    some of a block's Linears (`linears`; drawn last, so the fields before draw as they did)."""
    out: dict = {}
    if S > 1 and rng.random() < ADDED_P["loss_chunks"]:
        out["loss_chunks"] = rng.choice([c for c in (2, 3, 8) if c <= S])
    if peft == "qlora" and rng.random() < ADDED_P["quant_set"]:
        out["quant_set"] = "targets"
    if peft in ("lora", "qlora") and dtype.startswith("mixed-") and rng.random() < ADDED_P["base_dtype"]:
        out["base_dtype"] = dtype.removeprefix("mixed-")
    if optimizer in PAGED_OPTIMIZERS and rng.random() < ADDED_P["paged_states"]:
        out["paged_states"] = True
    if peft in ("lora", "qlora", "lora-int8") and rng.random() < ADDED_P["lora_targets"]:
        out["lora_targets"] = ",".join(sorted(rng.sample(linears, rng.randint(1, len(linears) - 1))))
    return out


def _config(name, model, B, S, dtype, optimizer, opts, ov, refresh, added=()) -> Config:
    shown = " ".join(f"{k}={v}" for k, v in opts.items() if k not in ov)
    shown += {None: "", True: " refresh", False: " steady"}[refresh]
    return Config(f"{name} {shown}".rstrip(), model, B, S, dtype, optimizer, opts, refresh, added)


def _without_added(c: Config) -> Config:
    opts = {k: v for k, v in c.overrides.items() if k not in c.added}
    name = c.label.split(" ")
    return dataclasses.replace(c, label=" ".join(w for w in name if w.split("=")[0] not in c.added),
                               overrides=opts, added=())


def random_configs(n: int, seed: int) -> list[Config]:
    """n configurations the estimator accepts, drawn with `seed`. A draw the estimator refuses (an option pair
    it does not model, a rank over a matrix side) or over WORK_CAP is drawn again; the refusal rate is printed."""
    rng, out, refused = random.Random(seed), [], 0
    while len(out) < n:
        c = _draw(rng)
        if c is None:
            continue
        for tried in ((c, _without_added(c)) if c.added else (c,)):
            try:
                estimate(tried.model, tried.batch, tried.seq, tried.dtype, tried.optimizer, device="cpu",
                         **tried.overrides)
            except ValueError:
                continue
            out.append(tried)
            break
        else:
            refused += 1
    print(f"random configurations: seed={seed} drawn={n} refused_by_estimator={refused}", file=sys.stderr)
    return out


def run_one(c: Config) -> dict:
    r = Recipe.of(c.model, c.batch, c.seq, dtype=c.dtype, optimizer=c.optimizer, device="cpu", **c.overrides)
    e = estimate(r)
    m = measure_step(r, steps=2, galore_refresh=bool(c.refresh))
    if c.refresh is False:  # a steady step: the second one, against the estimate's steady moments
        e, m = e.without(REFRESH), m.of_step(2)
    meas = m.peak.total
    cat_err = {cat: 100 * (e.peak[cat] - m.peak[cat]) / meas for cat in CATEGORIES}
    worst = max(cat_err, key=lambda cat: abs(cat_err[cat]))
    book = sum(t.bytes for t in e.textbook)  # the textbook layer's figure (labkit.estimate.textbook)
    return {"config": c, "estimate": e, "measurement": m, "pred": e.peak.total, "meas": meas,
            "error": 100 * (e.peak.total - meas) / meas, "worst": worst, "worst_error": cat_err[worst],
            "textbook_error": 100 * (book - meas) / meas}


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def describe(c: Config) -> str:
    return f"{c.label} B={c.batch} S={c.seq} {c.dtype} {c.optimizer}"


def breakdown(r: dict) -> str:
    """Predicted vs measured bytes per category, for every phase of one configuration."""
    e, m = r["estimate"], r["measurement"]
    rows = [["phase", "category", "predicted", "measured", "diff", "% of measured peak"]]
    for phase in e.phases:
        for cat in CATEGORIES:
            p, q = e.phases[phase][cat], m.phases[phase][cat]
            rows.append([phase, str(cat), f"{p:,}", f"{q:,}", f"{p - q:+,}", f"{100 * (p - q) / r['meas']:+.2f}"])
        p, q = e.phases[phase].total, m.phases[phase].total
        rows.append([phase, "total", f"{p:,}", f"{q:,}", f"{p - q:+,}", f"{100 * (p - q) / r['meas']:+.2f}"])
    return _table(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a handful of configurations")
    ap.add_argument("--random", type=int, metavar="N", help="N random configurations instead of the fixed set")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random configurations (default 0)")
    args = ap.parse_args(argv)
    if args.random is not None and args.random <= 0:
        ap.error("--random must be a positive integer")
    chosen = random_configs(args.random, args.seed) if args.random else configs(args.quick)
    results = [run_one(c) for c in tqdm(chosen, desc="estimate vs ledger", file=sys.stderr)]

    rows = [["config", "predicted", "measured", "error %", "textbook error %", "peak phase (pred/meas)",
             "worst category (% of peak)"]]
    for r in results:
        rows.append([describe(r["config"]), fmt_bytes(r["pred"]), fmt_bytes(r["meas"]), f"{r['error']:+.2f}",
                     f"{r['textbook_error']:+.1f}",
                     f"{r['estimate'].peak_phase}/{r['measurement'].peak_phase}",
                     f"{r['worst'].name.lower()} {r['worst_error']:+.2f}"])
    print("predicted vs measured peak of one training step on the CPU (bytes: GiB = 2**30)")
    print(_table(rows))
    over = [r for r in results if max(abs(r["error"]), abs(r["worst_error"])) > TOLERANCE]
    for r in over:
        print(f"\nover {TOLERANCE:g}%: {describe(r['config'])}: error {r['error']:+.2f}%, "
              f"{r['worst'].name.lower()} {r['worst_error']:+.2f}%")
        print(breakdown(r))
    errors = [abs(r["error"]) for r in results]
    book = [abs(r["textbook_error"]) for r in results]
    cats = [abs(r["worst_error"]) for r in results]  # each config's largest category error, % of its peak
    worst = max(results, key=lambda r: abs(r["worst_error"]))
    print(f"textbook layer: max_error={max(book):.1f}% median_error={statistics.median(book):.1f}%")
    print(f"largest category error: {worst['worst'].name.lower()} {worst['worst_error']:+.2f}% of the peak in "
          f"{describe(worst['config'])}")
    print(f"estimator: configs={len(results)} max_error={max(errors):.2f}% "
          f"median_error={statistics.median(errors):.2f}% max_category_error={max(cats):.2f}% "
          f"median_category_error={statistics.median(cats):.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
