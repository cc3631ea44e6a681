"""Hugging Face transformers models from offline presets: real configs, built on the meta device or for training."""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import torch
import torch.nn as nn
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, LlamaConfig, PretrainedConfig


# ----------------------------------------------------------------------------- presets
# Each preset returns a fresh config with the published hyperparameters, so nothing is downloaded.
# Parameter counts (all parameters, a tied embedding counted once) are checked in tests/unit/test_hf.py.


def _gpt2(n_layer: int, n_head: int, n_embd: int, **kw: Any) -> GPT2Config:
    """GPT-2 (Radford et al., 2019): learned positions, LayerNorm, GELU MLP of 4h, tied embedding."""
    kw = {"vocab_size": 50257, "n_positions": 1024, **kw}
    return GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=n_embd, tie_word_embeddings=True, **kw)


def _llama(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, **kw: Any) -> LlamaConfig:
    """Llama: RoPE, RMSNorm, SwiGLU MLP (three h x ffn matrices), grouped-query attention when kv_heads < heads."""
    kw = {"vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, **kw}
    return LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=ffn,
        **kw,
    )


# Llama 3.2 stretches RoPE from 8k to 128k positions with the "llama3" frequency scaling.
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

PRESETS: dict[str, Callable[[], PretrainedConfig]] = {
    # tiny models for CPU measurement and tests; vocab 256 matches labkit's byte tokenizer
    # (bytes have no special tokens, so GPT-2's 50256 end-of-text id is dropped)
    "gpt2-tiny": lambda: _gpt2(
        2, 2, 64, vocab_size=256, n_positions=128, bos_token_id=None, eos_token_id=None
    ),  # 124,672
    "llama-tiny": lambda: _llama(
        2, 64, 4, 2, 172, vocab_size=256, max_position_embeddings=128
    ),  # 123,712; untied like Llama 2, GQA like Llama 3
    # GPT-2 family (openai-community/gpt2*)
    "gpt2": lambda: _gpt2(12, 12, 768),  # 124,439,808
    "gpt2-medium": lambda: _gpt2(24, 16, 1024),  # 354,823,168
    "gpt2-large": lambda: _gpt2(36, 20, 1280),  # 774,030,080
    "gpt2-xl": lambda: _gpt2(48, 25, 1600),  # 1,557,611,200
    # Llama family (meta-llama/*)
    "llama3.2-1b": lambda: _llama(
        16, 2048, 32, 8, 8192,
        vocab_size=128256, max_position_embeddings=131072, tie_word_embeddings=True,
        rope_parameters=dict(_LLAMA3_ROPE), bos_token_id=128000, eos_token_id=128001,
    ),  # 1,235,814,400
    "llama2-7b": lambda: _llama(32, 4096, 32, 32, 11008),  # 6,738,415,616
    "llama2-13b": lambda: _llama(40, 5120, 40, 40, 13824),  # 13,015,864,320
    "llama2-70b": lambda: _llama(80, 8192, 64, 8, 28672),  # 68,976,648,192
    # LLaMA 1 (Touvron et al. 2023, arXiv 2302.13971): no GQA, 2048 positions; the 65B model QLoRA fine-tunes
    # on one 48 GB GPU (Dettmers et al. 2023, arXiv 2305.14314)
    "llama-65b": lambda: _llama(80, 8192, 64, 64, 22016, max_position_embeddings=2048),  # 65,285,660,672
}


# Models that the training configs people run name (torchtune's builders, axolotl's base_model), by
# the published hyperparameters of their model cards: available offline to `get_config` by name, but
# kept off the memory wall and the panels' menus (PRESETS above). Llama 3 (Grattafiori et al. 2024,
# arXiv 2407.21783, Table 3); Code Llama (Roziere et al. 2023, arXiv 2308.12950); Mistral 7B (Jiang
# et al. 2023, arXiv 2310.06825). Mistral 7B is Llama's architecture (RMSNorm, SwiGLU, RoPE, GQA);
# its sliding window (4096) changes nothing at or below 4096 positions.
_LLAMA31_ROPE = {**_LLAMA3_ROPE, "factor": 8.0}
CONFIG_PRESETS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama3-8b": lambda: _llama(32, 4096, 32, 8, 14336, vocab_size=128256, max_position_embeddings=8192,
                                rope_theta=500000.0),  # 8,030,261,248
    "llama3.1-8b": lambda: _llama(32, 4096, 32, 8, 14336, vocab_size=128256,
                                  max_position_embeddings=131072,
                                  rope_parameters=dict(_LLAMA31_ROPE)),  # 8,030,261,248
    "llama3.2-3b": lambda: _llama(28, 3072, 24, 8, 8192, vocab_size=128256, max_position_embeddings=131072,
                                  tie_word_embeddings=True,
                                  rope_parameters=dict(_LLAMA3_ROPE)),  # 3,212,749,824
    "llama3-70b": lambda: _llama(80, 8192, 64, 8, 28672, vocab_size=128256, max_position_embeddings=8192,
                                 rope_theta=500000.0),  # 70,553,706,496
    "llama3.1-70b": lambda: _llama(80, 8192, 64, 8, 28672, vocab_size=128256,
                                   max_position_embeddings=131072,
                                   rope_parameters=dict(_LLAMA31_ROPE)),  # 70,553,706,496
    "llama3.1-405b": lambda: _llama(126, 16384, 128, 8, 53248, vocab_size=128256,
                                    max_position_embeddings=131072,
                                    rope_parameters=dict(_LLAMA31_ROPE)),  # 405,853,388,800
    "code-llama2-7b": lambda: _llama(32, 4096, 32, 32, 11008, vocab_size=32016,
                                     max_position_embeddings=16384, rope_theta=1e6),  # 6,738,546,688
    "code-llama2-13b": lambda: _llama(40, 5120, 40, 40, 13824, vocab_size=32016,
                                      max_position_embeddings=16384, rope_theta=1e6),  # 13,016,028,160
    "code-llama2-70b": lambda: _llama(80, 8192, 64, 8, 28672, vocab_size=32016,
                                      max_position_embeddings=16384, rope_theta=1e6),  # 68,976,910,336
    "mistral-7b": lambda: _llama(32, 4096, 32, 8, 14336, vocab_size=32000,
                                 max_position_embeddings=32768, rope_theta=10000.0),  # 7,241,732,096
}
CONFIG_PRESETS["llama3.3-70b"] = CONFIG_PRESETS["llama3.1-70b"]  # the same architecture as 3.1 70B


def _preset_list() -> str:
    return ", ".join(PRESETS)


# ----------------------------------------------------------------------------- configs


def get_config(name_or_path: str, **overrides: Any) -> PretrainedConfig:
    """A config from a preset name, a local config (a folder with config.json, or a .json file), or a hub id.

    Overrides set config attributes, e.g. ``n_layer=2`` or ``attn_implementation="eager"``.
    """
    name = str(name_or_path)
    if name in PRESETS:
        config = PRESETS[name]()
    elif name in CONFIG_PRESETS:
        config = CONFIG_PRESETS[name]()
    elif os.path.isdir(name) or (name.endswith(".json") and os.path.isfile(name)):
        config = AutoConfig.from_pretrained(name)
    else:
        config = _hub_config(name)
    for key, value in overrides.items():
        if key == "attn_implementation":  # kept privately by transformers
            config._attn_implementation = value
        elif not hasattr(config, key):
            raise ValueError(f"{type(config).__name__} has no attribute {key!r} to override")
        else:
            setattr(config, key, value)
    return config


def _hub_config(name: str) -> PretrainedConfig:
    """Hub id: the local cache first (works offline), then the network for "org/name" ids only, so a
    mistyped preset fails at once instead of after the hub client's retries."""
    online = "/" in name and os.environ.get("HF_HUB_OFFLINE", "0") in ("", "0")
    for local_only in (True, False) if online else (True,):
        try:
            return AutoConfig.from_pretrained(name, local_files_only=local_only)
        except (OSError, ValueError):
            continue
    raise ValueError(
        f"unknown model {name!r}: not a preset ({_preset_list()}) nor a local config path; "
        "hub names need to be online (or already cached)"
    )


# ----------------------------------------------------------------------------- models


def build(
    name_or_path: str,
    device: str | torch.device = "meta",
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    **overrides: Any,
) -> nn.Module:
    """A causal LM in training mode: random weights on a real device, or shapes only on "meta" (no memory).

    Built directly on `device` in `dtype`, so a 70B model on meta costs nothing and a GPU model is
    never first materialised on the CPU. The KV cache is switched off: training does not use it.
    """
    config = get_config(name_or_path, **overrides)
    config.use_cache = False
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    if getattr(model, "loss_type", None) is None:
        model.loss_type = "ForCausalLM"  # what transformers falls back to, minus its warning
    return model.train()


@functools.lru_cache(maxsize=None)
def _count_preset(name: str) -> int:
    return count_params_of(build(name))


def count_params_of(model: nn.Module) -> int:
    """Parameters of a model, a tied (shared) tensor counted once; `parameters()` already dedups."""
    return sum(p.numel() for p in model.parameters())


def count_params(name_or_path: str, **overrides: Any) -> int:
    """Parameter count by building the model on the meta device (exact, no memory)."""
    if name_or_path in PRESETS and not overrides:
        return _count_preset(name_or_path)
    return count_params_of(build(name_or_path, **overrides))


def describe(name_or_path: str, **overrides: Any) -> dict[str, Any]:
    """The architecture facts a memory estimator needs, read from the config, with the exact parameter count."""
    c = get_config(name_or_path, **overrides)
    if c.model_type == "gpt2":
        sizes = ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions")
        n_kv = c.n_head  # multi-head attention: one K and V per head
        intermediate = c.n_inner or 4 * c.n_embd  # GPT-2's MLP is 4h unless n_inner says otherwise
        dropout = {k: getattr(c, k) for k in ("embd_pdrop", "attn_pdrop", "resid_pdrop")}
    elif c.model_type == "llama":
        sizes = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size", "max_position_embeddings")
        n_kv, intermediate = c.num_key_value_heads or c.num_attention_heads, c.intermediate_size
        dropout = {"attention_dropout": float(c.attention_dropout)}
    else:
        raise ValueError(f"describe() knows the gpt2 and llama families, not {c.model_type!r}")
    n_layer, hidden, n_head, vocab, positions = (getattr(c, k) for k in sizes)
    return {"family": c.model_type, "n_layer": n_layer, "hidden": hidden, "n_head": n_head, "n_kv_head": n_kv,
            "intermediate": intermediate, "vocab": vocab, "max_positions": positions,
            "tied": bool(c.tie_word_embeddings), **dropout, "n_params": count_params(name_or_path, **overrides)}
