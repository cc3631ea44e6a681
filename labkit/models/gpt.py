"""A from-scratch GPT (nanoGPT-sized and nanoGPT-readable) whose every saved tensor is countable."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 256  # byte-level tokenizer by default
    block_size: int = 256  # longest sequence the position table covers
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # attention heads; n_embd must divide by it
    n_embd: int = 128  # hidden size h
    dropout: float = 0.0  # dropout probability (0 saves no masks)
    bias: bool = True  # biases in Linear layers and LayerNorms
    attention: str = "sdpa"  # "sdpa" (fused, no s*s matrix kept), "manual" (keeps s*s scores) or "tiled"
    attn_block: int = 64  # "tiled": queries and keys per tile (labkit.recompute.tiled_attention)
    loss_chunk: int = 0  # rows per chunk of the loss (labkit.recompute.chunked_ce); 0: F.cross_entropy on all logits

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if self.attention not in ("sdpa", "manual", "tiled"):
            raise ValueError(f"GPTConfig.attention must be 'sdpa', 'manual' or 'tiled', got {self.attention!r}")
        if self.attention == "tiled" and self.dropout:
            raise ValueError("GPTConfig.attention='tiled' has no attention dropout: give dropout=0.0")
        for name, least in (("attn_block", 1), ("loss_chunk", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"GPTConfig.{name} must be an integer >= {least}, got {v!r}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # q, k, v in one matmul
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.n_head, self.dropout, self.attention, self.attn_block = cfg.n_head, cfg.dropout, cfg.attention, cfg.attn_block
        self.resid_drop = nn.Dropout(cfg.dropout)
        self.attn_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        if self.attention == "sdpa":
            p = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        elif self.attention == "tiled":  # FlashAttention's algorithm from scratch: tiles, nothing s*s kept
            from labkit.recompute.tiled_attention import tiled_attention

            y = tiled_attention(q, k, v, self.attn_block)
        else:  # the textbook way: the (B, nh, T, T) scores and probabilities are kept for backward
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))  # (B, nh, T, T)
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf"))
            att = self.attn_drop(F.softmax(att, dim=-1))
            y = att @ v  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))  # (B, T, 4C) inside


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 architecture: learned positions, pre-LayerNorm blocks, tied input/output embedding."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying: one (V, C) matrix, counted once
        if self.wte.weight.is_meta:  # shapes only (how labkit.memory reads a model): no values to initialize
            return
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def num_params(self) -> int:
        """Parameters counted once (the tied embedding is shared)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                output_chunks: int = 0) -> torch.Tensor | list[torch.Tensor]:
        """Return logits (B, T, V) when targets is None, otherwise the mean cross-entropy loss.

        With targets the logits are not returned, so nothing outside holds them during backward.
        output_chunks=N (no targets): the head's output in N chunks along the sequence, a list of
        (B, T_i, V) (labkit.recompute.chunked_output, torchtune's convention; its loss is
        chunked_output_loss).
        """
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        if targets is not None and self.config.loss_chunk:  # no (B*T, V) logits are made
            from labkit.recompute.chunked_ce import chunked_cross_entropy

            h = self.ln_f(x)
            return chunked_cross_entropy(h.view(B * T, -1), self.lm_head.weight, targets.reshape(B * T),
                                         self.config.loss_chunk)
        if output_chunks:
            if targets is not None:
                raise ValueError("output_chunks returns the head's output in chunks: give no "
                                 "targets (the loss is labkit.recompute.chunked_output."
                                 "chunked_output_loss)")
            from labkit.recompute.chunked_output import output_chunks as chunked

            return chunked(self.ln_f(x), self.lm_head, output_chunks)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T))
