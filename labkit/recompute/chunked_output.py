"""The output head and its cross-entropy in N chunks along the sequence, each upcast to fp32 alone.

This is the convention torchtune's recipes run (`CEWithChunkedOutputLoss`, 8 chunks; its models
return the head's output as a list of chunks:
https://pytorch.org/torchtune/stable/generated/torchtune.modules.loss.CEWithChunkedOutputLoss.html).
Written from those facts, in plain autograd:

- the model's last hidden states (B, S, h) are split along the sequence into N views (`torch.chunk`:
  chunks of ceil(S / N) tokens, so fewer than N when N does not divide S) and the head runs on each:
  N logits tensors (B, S_i, V) in the matmul's dtype (16-bit under autocast);
- the loss walks the chunks: each chunk's logits are copied to fp32 (`.float()`, a no-op when they
  are fp32 already) and F.cross_entropy sums its tokens' losses; the copy is gone when the chunk's
  loss returns. The sum over chunks, divided by the number of targets that are not `ignore_index`,
  is F.cross_entropy's mean.

What it saves, and what it does not: each chunk's log-softmax output (fp32) is saved for its
backward, as the plain loss saves the whole one, so the chunks together keep B x S x V x 4 bytes
until backward; what chunking removes is the fp32 copy of all logits at once in the forward and, in
the backward, the loss's gradients over all logits at once (one chunk's at a time).
labkit.recompute.chunked_ce is the other way, the fused head + loss that keeps no logits at all
(labkit GPT's `GPTConfig.loss_chunk`).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F


def output_chunks(hidden: torch.Tensor, head, chunks: int) -> list[torch.Tensor]:
    """[head(part) for part in hidden.chunk(chunks, dim=1)]: (B, S, h) -> (B, S_i, V) per chunk."""
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be (B, S, h), got shape {tuple(hidden.shape)}")
    _check_chunks(chunks)
    return [head(part) for part in hidden.chunk(chunks, dim=1)]


def chunk_cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                        ignore_index: int = -100) -> torch.Tensor:
    """One chunk's summed loss: its logits (B, S_i, V) upcast to fp32, its labels (B, S_i)."""
    z = logits.reshape(-1, logits.size(-1)).float()  # the chunk's fp32 copy, freed on return
    return F.cross_entropy(z, labels.reshape(-1), ignore_index=ignore_index, reduction="sum")


def chunked_output_loss(logits: Sequence[torch.Tensor], labels: torch.Tensor,
                        ignore_index: int = -100) -> torch.Tensor:
    """The mean cross-entropy over the targets that are not `ignore_index`, from the head's output
    chunks (`output_chunks`) and the labels (B, S), split along the sequence as the logits were."""
    if labels.dim() != 2:
        raise ValueError(f"labels must be (B, S), got shape {tuple(labels.shape)}")
    parts = labels.chunk(len(logits), dim=1)
    if len(parts) != len(logits) or any(p.shape != z.shape[:-1] for p, z in zip(parts, logits)):
        raise ValueError("the logits chunks must split the labels' sequence as "
                         f"labels.chunk(len(logits), 1) does: {[tuple(z.shape) for z in logits]} "
                         f"against labels {tuple(labels.shape)}")
    count = (labels != ignore_index).sum()
    total = None
    for z, t in zip(logits, parts):
        part = chunk_cross_entropy(z, t, ignore_index)
        total = part if total is None else total + part
    return total / count  # 0 / 0 = nan when every target is ignored, as F.cross_entropy's mean


def model_output_chunks(model: torch.nn.Module, idx: torch.Tensor,
                        chunks: int) -> list[torch.Tensor]:
    """The head's output chunks of a labkit GPT (its forward's `output_chunks`) or a transformers
    causal LM (its base model's last hidden states, then its output embedding chunk by chunk)."""
    _check_chunks(chunks)
    if hasattr(model, "config") and hasattr(model.config, "model_type"):  # transformers
        hidden = model.base_model(input_ids=idx, use_cache=False)[0]
        return output_chunks(hidden, model.get_output_embeddings(), chunks)
    return model(idx, output_chunks=chunks)


def _check_chunks(chunks) -> None:
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks <= 0:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
