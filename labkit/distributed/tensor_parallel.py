"""Tensor parallelism from scratch (Megatron-LM style): each block's matrices split over t ranks so that one
all-reduce per block half suffices in forward and one in backward; optionally sequence parallel.

    model = to_headwise(GPT(cfg))                   # q, k, v rows stored head by head (as Megatron does)
    tp = parallelize(model, rank, t)                # attention split by heads, the MLP by its inner width
    loss = ...; loss.backward(); sync_replicated_grads(tp)   # only with sequence_parallel=True

Shoeybi et al. 2019 (Megatron-LM, section 3): the MLP's first matrix is split by columns (each rank a
slice of the 4h outputs, GELU works per slice) and the second by rows (each rank a partial sum), so the
block needs one all-reduce (g) after the second matrix in forward, and one (f) on the input's gradient
in backward. Attention is split the same way by heads. f and g are two tiny autograd functions:

    f: forward identity,   backward all-reduce         (enters a tensor-parallel region)
    g: forward all-reduce, backward identity           (leaves it)

Korthikanti et al. 2022 (sequence parallelism): the LayerNorms and dropouts between the regions work on
whole activations that every rank keeps a copy of (the "10 sbh" of their per-layer formula). Splitting
those along the sequence turns g into a reduce-scatter and f into an all-gather (the same bytes on the
wire) and divides what they save by t as well: sbh(10 + 24/t + 5as/(ht)) becomes sbh(34/t + 5as/(ht)).
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.distributed import comms

__all__ = ["copy_to_tp", "reduce_from_tp", "gather_seq", "scatter_seq", "split_seq", "ColumnParallelLinear",
           "RowParallelLinear", "HeadwiseAttention", "to_headwise", "TPBlock", "parallelize", "check_tp",
           "sync_replicated_grads"]


# ---- the f and g operators, and their sequence-parallel forms ---------------------------------------------------
def _all_gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T/t, C) on each rank -> (B, T, C), rank r's rows of the sequence at [r T/t, (r+1) T/t)."""
    t = comms.world(group)
    flat = torch.empty(t * x.numel(), dtype=x.dtype, device=x.device)
    comms.all_gather(flat, x.contiguous().view(-1), group=group, tag="sequence all-gather")
    B, Ts, C = x.shape
    return flat.view(t, B, Ts, C).transpose(0, 1).reshape(B, t * Ts, C)


def _reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T, C) partial sums on each rank -> (B, T/t, C): the sum over ranks of rank r's rows of the sequence."""
    t = comms.world(group)
    B, T, C = x.shape
    chunks = x.view(B, t, T // t, C).transpose(0, 1).contiguous()  # (t, B, T/t, C): chunk r goes to rank r
    out = torch.empty(B * (T // t) * C, dtype=x.dtype, device=x.device)
    comms.reduce_scatter(out, chunks.view(-1), group=group, tag="sequence reduce-scatter")
    return out.view(B, T // t, C)


def _own_rows(x: torch.Tensor, group) -> torch.Tensor:
    """A replicated (B, T, C) -> this rank's (B, T/t, C), no communication."""
    return x.chunk(comms.world(group), dim=1)[comms.rank(group)].contiguous()


def _region_op(forward, backward, doc: str):
    """x, group -> forward(x, group), whose gradient g becomes backward(g, group): one autograd function per
    way a tensor enters or leaves a tensor-parallel region."""

    class Op(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return forward(x, group)

        @staticmethod
        def backward(ctx, g):
            return backward(g, ctx.group), None

    def apply(x, group=None):
        return Op.apply(x, group)

    apply.__doc__ = doc
    return apply


def _identity(x, group):
    return x.view_as(x)


def _tagged_all_reduce(tag: str):
    return lambda x, group: comms.all_reduce(x.contiguous(), group=group, tag=tag)


copy_to_tp = _region_op(_identity, _tagged_all_reduce("f backward"),
                        "f: the input of a tensor-parallel region. Every rank reads the whole x; each contributes a "
                        "partial gradient of it, so backward sums them.")
reduce_from_tp = _region_op(_tagged_all_reduce("g forward"), _identity,
                            "g: the output of a tensor-parallel region. Each rank holds a partial sum; forward adds "
                            "them up.")
# sequence parallel: the same operators along the sequence (dim 1 of (B, T, C))
gather_seq = _region_op(_all_gather_seq, _reduce_scatter_seq,
                        "f with sequence parallelism: all-gather forward, reduce-scatter backward.")
scatter_seq = _region_op(_reduce_scatter_seq, _all_gather_seq,
                         "g with sequence parallelism: reduce-scatter forward, all-gather backward.")
split_seq = _region_op(_own_rows, _all_gather_seq,
                       "A replicated (B, T, C) -> this rank's (B, T/t, C) (no communication); backward gathers the "
                       "pieces.")
# sequence shards -> the whole (B, T, C) for a replicated consumer (the head): its gradient is the same on every
# rank, so backward just keeps this rank's rows
_gather_seq_replicated = _region_op(_all_gather_seq, _own_rows, "Sequence shards -> the whole (B, T, C) for the head.")


class _SeqParallelLinear(torch.autograd.Function):
    """all-gather + column-parallel matmul that saves only this rank's sequence shard of the input and
    gathers it again in backward (Korthikanti et al. 2022, section 4.2.2): the input the matmul needs for
    its weight gradient then costs sbh/t, not sbh, per rank."""

    @staticmethod
    def forward(ctx, x_shard, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x_shard, weight)
        return F.linear(_all_gather_seq(x_shard, group), weight, bias)  # (B, T, out/t)

    @staticmethod
    def backward(ctx, g):
        x_shard, weight = ctx.saved_tensors
        total = _all_gather_seq(x_shard, ctx.group)  # (B, T, in), again
        grad_x = _reduce_scatter_seq(g @ weight, ctx.group)  # (B, T/t, in)
        grad_w = g.reshape(-1, g.shape[-1]).t() @ total.reshape(-1, total.shape[-1])
        grad_b = g.reshape(-1, g.shape[-1]).sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


# ---- column- and row-parallel linear layers ------------------------------------------------------------------------
class ColumnParallelLinear(nn.Module):
    """Y_r = X W_r^T + b_r: this rank's slice of the output features (rows out_features * r / t onward).
    Input: the whole X (f makes its gradient whole), or its sequence shard with sequence_parallel."""

    def __init__(self, full: nn.Linear, rank: int, t: int, sequence_parallel: bool = False, group=None):
        super().__init__()
        n = full.out_features // t  # bytes: 1/t of the weight and bias on each rank
        self.weight = nn.Parameter(full.weight.detach()[rank * n:(rank + 1) * n].clone())
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach()[rank * n:(rank + 1) * n].clone())
        self.sequence_parallel, self.group = sequence_parallel, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return _SeqParallelLinear.apply(x, self.weight, self.bias, self.group)
        return F.linear(copy_to_tp(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Y = sum_r X_r W_r^T + b: this rank's slice of the input features; the partial products are summed by
    g (all-reduce), or reduce-scattered along the sequence with sequence_parallel. The bias, replicated,
    is added once after the sum."""

    def __init__(self, full: nn.Linear, rank: int, t: int, sequence_parallel: bool = False, group=None):
        super().__init__()
        n = full.in_features // t
        self.weight = nn.Parameter(full.weight.detach()[:, rank * n:(rank + 1) * n].clone())
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())
        if self.bias is not None and sequence_parallel:
            self.bias.sequence_parallel = True  # added to a sequence shard: its gradient is partial
        self.sequence_parallel, self.group = sequence_parallel, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)  # (B, T, out): a partial sum
        y = scatter_seq(y, self.group) if self.sequence_parallel else reduce_from_tp(y, self.group)
        return y + self.bias if self.bias is not None else y


# ---- attention with its fused q, k, v stored head by head -----------------------------------------------------------
class HeadwiseAttention(nn.Module):
    """Causal self-attention whose fused projection is laid out (head, q/k/v, head size) along its outputs,
    so that any contiguous slice of them is whole heads: split by columns, each rank computes its own
    heads (Megatron-LM's layout). Heads here = c_attn's outputs / (3 x head size): all of them unsplit,
    n_head / t on a rank. Equal to labkit's CausalSelfAttention (whose c_attn is q, k, v one after another)."""

    def __init__(self, c_attn: nn.Module, c_proj: nn.Module, head_size: int, dropout: float, attention: str):
        super().__init__()
        self.c_attn, self.c_proj, self.head_size, self.dropout, self.attention = c_attn, c_proj, head_size, dropout, attention
        self.attn_drop, self.resid_drop = nn.Dropout(dropout), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.c_attn(x)  # (B, T, 3 C') with C' = this rank's heads x head size
        B, T, _ = qkv.shape
        hs = self.head_size
        nh = qkv.shape[-1] // (3 * hs)
        q, k, v = qkv.view(B, T, nh, 3, hs).permute(3, 0, 2, 1, 4).unbind(0)  # 3 x (B, nh, T, hs)
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                               is_causal=True)
        else:  # scores (B, nh, T, T) kept for backward: 5as^2 b per layer in 16-bit with dropout
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            att = self.attn_drop(F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1))
            y = att @ v
        y = y.transpose(1, 2).reshape(B, T, nh * hs)  # heads side by side, as c_proj's inputs expect
        return self.resid_drop(self.c_proj(y))


def _headwise_rows(n_head: int, hs: int) -> torch.Tensor:
    """Row order taking labkit's [q; k; v] (each head after head) to [head 0: q k v, head 1: q k v, ...]."""
    C = n_head * hs
    return torch.tensor([part * C + h * hs + i for h in range(n_head) for part in range(3) for i in range(hs)])


def to_headwise(model: nn.Module) -> nn.Module:
    """labkit's GPT with each attention rewritten as HeadwiseAttention (c_attn's rows reordered): the same
    function, now splittable by heads with a plain column split (ours or PyTorch's ColwiseParallel)."""
    from labkit.models.gpt import CausalSelfAttention

    cfg = model.config
    hs = cfg.n_embd // cfg.n_head
    rows = _headwise_rows(cfg.n_head, hs)
    for block in model.blocks:
        old = block.attn
        if not isinstance(old, CausalSelfAttention):
            continue
        c_attn = copy.deepcopy(old.c_attn)
        with torch.no_grad():
            c_attn.weight.copy_(old.c_attn.weight[rows])
            if c_attn.bias is not None:
                c_attn.bias.copy_(old.c_attn.bias[rows])
        block.attn = HeadwiseAttention(c_attn, old.c_proj, hs, old.dropout, old.attention)
    return model


# ---- a block and a model split t ways ----------------------------------------------------------------------------
class TPMLP(nn.Module):
    def __init__(self, mlp: nn.Module, rank: int, t: int, sp: bool, group=None):
        super().__init__()
        self.c_fc = ColumnParallelLinear(mlp.c_fc, rank, t, sp, group)  # (B, T, 4h/t)
        self.gelu = nn.GELU()
        self.c_proj = RowParallelLinear(mlp.c_proj, rank, t, sp, group)
        self.dropout = copy.deepcopy(mlp.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class TPBlock(nn.Module):
    """A pre-LayerNorm block with attention split by heads and the MLP by its inner width; LayerNorms and
    residual dropouts replicated (or, with sequence parallelism, on this rank's part of the sequence)."""

    def __init__(self, block: nn.Module, rank: int, t: int, sp: bool = False, group=None):
        super().__init__()
        a = block.attn
        self.ln_1, self.ln_2 = copy.deepcopy(block.ln_1), copy.deepcopy(block.ln_2)
        if sp:
            for p in [*self.ln_1.parameters(), *self.ln_2.parameters()]:
                p.sequence_parallel = True
        self.attn = HeadwiseAttention(ColumnParallelLinear(a.c_attn, rank, t, sp, group),
                                      RowParallelLinear(a.c_proj, rank, t, sp, group), a.head_size, a.dropout,
                                      a.attention)
        self.mlp = TPMLP(block.mlp, rank, t, sp, group)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def check_tp(n_head: int, n_embd: int, t: int, seq: int | None = None, sequence_parallel: bool = False) -> None:
    """Clear errors for a split that cannot be made."""
    if isinstance(t, bool) or not isinstance(t, int) or t < 1:
        raise ValueError(f"tensor parallel: t must be a positive integer, got {t!r}")
    if n_head % t:
        raise ValueError(f"tensor parallel: {n_head} attention heads do not divide over t={t} ranks")
    if (4 * n_embd) % t:
        raise ValueError(f"tensor parallel: the MLP's {4 * n_embd} inner features do not divide over t={t} ranks")
    if sequence_parallel and seq is not None and seq % t:
        raise ValueError(f"sequence parallel: seq {seq} does not divide over t={t} ranks")


class TPGPT(nn.Module):
    """labkit's GPT with every block split t ways; embeddings and head replicated. With sequence_parallel the
    residual stream between blocks is this rank's (B, T/t, C) part of the sequence."""

    def __init__(self, model: nn.Module, rank: int, t: int, sequence_parallel: bool = False, group=None):
        super().__init__()
        cfg = model.config
        check_tp(cfg.n_head, cfg.n_embd, t)
        model = to_headwise(copy.deepcopy(model))
        self.config, self.sp, self.group = cfg, sequence_parallel, group
        self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        self.blocks = nn.ModuleList(TPBlock(b, rank, t, sequence_parallel, group) for b in model.blocks)
        self.ln_f, self.lm_head = model.ln_f, model.lm_head  # tied to wte, as in the model

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        B, T = idx.shape
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(T, device=idx.device)))  # (B, T, C), replicated
        if self.sp:
            x = split_seq(x, self.group)  # (B, T/t, C)
        for block in self.blocks:
            x = block(x)
        if self.sp:
            x = _gather_seq_replicated(x, self.group)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T))


def parallelize(model: nn.Module, rank: int, t: int, sequence_parallel: bool = False, group=None) -> TPGPT:
    """This rank's part of labkit's GPT split t ways (Megatron-LM), optionally sequence parallel."""
    return TPGPT(model, rank, t, sequence_parallel, group)


class LoRAColumnParallel(nn.Module):
    """A LoRA adapter over a column-parallel Linear: the frozen base split by outputs, B (d_out/t, r) split
    with it, A (r, d_in) whole on every rank. y_r = base_r(x) + s B_r A x. A's gradient sum_r B_r^T g_r x^T is
    partial on each rank: `tp_partial_grad` asks sync_replicated_grads to sum it; the adapter's input goes
    through f too, so its input gradient is summed with the base's."""

    def __init__(self, full: nn.Module, rank: int, t: int, group=None):
        super().__init__()
        self.base = ColumnParallelLinear(full.base, rank, t, False, group).requires_grad_(False)  # frozen
        n = full.out_features // t
        self.lora_A = nn.Parameter(full.lora_A.detach().clone())
        self.lora_A.tp_partial_grad = True
        self.lora_B = nn.Parameter(full.lora_B.detach()[rank * n:(rank + 1) * n].clone())
        self.scaling, self.group = full.scaling, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = copy_to_tp(x, self.group)
        return self.base(x) + F.linear(F.linear(h, self.lora_A), self.lora_B) * self.scaling


class LoRARowParallel(nn.Module):
    """A LoRA adapter over a row-parallel Linear: the frozen base split by inputs, A (r, d_in/t) split with it,
    B (d_out, r) whole. The rank's partial A_r x_r is summed over ranks (g) before B, so B's gradient is the
    same on every rank: y = base(x) + s B sum_r A_r x_r."""

    def __init__(self, full: nn.Module, rank: int, t: int, group=None):
        super().__init__()
        self.base = RowParallelLinear(full.base, rank, t, False, group).requires_grad_(False)  # frozen
        n = full.in_features // t
        self.lora_A = nn.Parameter(full.lora_A.detach()[:, rank * n:(rank + 1) * n].clone())
        self.lora_B = nn.Parameter(full.lora_B.detach().clone())
        self.scaling, self.group = full.scaling, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = reduce_from_tp(F.linear(x, self.lora_A), self.group)  # (..., r), summed over ranks
        return self.base(x) + F.linear(z, self.lora_B) * self.scaling


def check_tp_llama(config, t: int) -> None:
    """A Llama split t ways: its query heads, key/value heads (GQA) and MLP features must divide by t."""
    check_tp(config.num_attention_heads, config.hidden_size, t)
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if kv % t:
        raise ValueError(f"tensor parallel: {kv} key/value heads (GQA) do not divide over t={t} ranks")
    if config.intermediate_size % t:
        raise ValueError(f"tensor parallel: the MLP's {config.intermediate_size} features do not divide over "
                         f"t={t} ranks")


class LlamaTP(nn.Module):
    """transformers' LlamaForCausalLM split t ways (Megatron-LM's layout on its own Linears): in every decoder
    layer q_proj, k_proj, v_proj, gate_proj and up_proj column-parallel (this rank's heads: 1/t of the query
    heads and of the key/value heads, GQA's groups whole; 1/t of the MLP features), o_proj and down_proj
    row-parallel (the partial sums all-reduced); embeddings, norms and the head replicated. The attention
    reshapes its projections with -1 heads (transformers 5), so it runs this rank's heads as they are.
    forward(x, y) -> the loss, as transformers computes it (labels shifted inside)."""

    COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
    ROW = ("self_attn.o_proj", "mlp.down_proj")

    def __init__(self, model: nn.Module, rank: int, t: int, group=None):
        super().__init__()
        check_tp_llama(model.config, t)
        self.model, self.config = model, model.config
        for layer in model.model.layers:
            for path, column in [(p, True) for p in self.COLUMN] + [(p, False) for p in self.ROW]:
                parent_path, name = path.rsplit(".", 1)
                parent = layer.get_submodule(parent_path)
                full = getattr(parent, name)
                if hasattr(full, "lora_A"):  # a LoRA adapter over the Linear (labkit.peft.LoRALinear)
                    split = LoRAColumnParallel if column else LoRARowParallel
                    setattr(parent, name, split(full, rank, t, group))
                else:
                    cls = ColumnParallelLinear if column else RowParallelLinear
                    setattr(parent, name, cls(full, rank, t, False, group))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        out = self.model(input_ids=idx, labels=targets, use_cache=False)
        return out.loss if targets is not None else out.logits


def parallelize_llama(model: nn.Module, rank: int, t: int, group=None) -> LlamaTP:
    """This rank's part of a transformers Llama split t ways (LlamaTP)."""
    return LlamaTP(model, rank, t, group)


def sync_replicated_grads(model: nn.Module, group=None) -> None:
    """With sequence parallelism, the LayerNorms (and row-parallel biases) see only this rank's part of the
    sequence, so their gradients are partial sums: add them up over the tensor-parallel ranks."""
    for p in model.parameters():
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            comms.all_reduce(p.grad, group=group, tag="sequence-parallel norm grads")
        elif getattr(p, "tp_partial_grad", False) and p.grad is not None:  # LoRAColumnParallel's A
            comms.all_reduce(p.grad, group=group, tag="LoRA A grads")
