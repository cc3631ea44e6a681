"""The architecture facts an estimate needs, read from a labkit GPT, a transformers model or a preset."""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field

import torch


@dataclass
class ModelSpec:
    name: str  # what the learner called it
    family: str  # "labkit-gpt", "gpt2" or "llama" (selects the forward walk)
    n_layer: int
    hidden: int  # h
    n_head: int  # a
    n_kv_head: int  # grouped-query attention: key/value heads (= n_head without GQA)
    ffn: int  # MLP inner size (4h for GPT-2)
    vocab: int  # V
    max_positions: int  # longest sequence the model accepts (0: no limit)
    tied: bool  # input embedding and output head share one matrix
    dropout: float  # embedding and residual dropout probability
    attn_dropout: float  # dropout on attention probabilities
    attention: str  # "sdpa" (fused where possible), "manual" or "eager" (s*s scores kept)
    n_params: int  # all parameters, a tied matrix once
    param_numels: list[int] = field(default_factory=list)  # elements of each parameter tensor
    param_shapes: list[tuple] = field(default_factory=list)  # shape of each parameter tensor
    galore_shapes: list[tuple] = field(default_factory=list)  # attention and MLP matrices (GaLore's choice)
    layer_params: int = 0  # parameters of one transformer block
    matmul_params: int = 0  # parameters that enter a matmul (autocast copies these to 16-bit)
    layer_matmul_params: int = 0  # the same, in one block
    param_names: list[str] = field(default_factory=list)  # name of each parameter tensor (a tied one once)
    linears: list[tuple] = field(default_factory=list)  # (module name, d_in, d_out, bias elements): LoRA targets
    head_dim: int = 0  # per-head width (Llama configs may set it apart from hidden / heads); 0: hidden // n_head
    attn_block: int = 0  # labkit GPT's attention="tiled": queries and keys per tile
    loss_chunk: int | None = None  # labkit GPT's chunked cross-entropy: rows per chunk (None: F.cross_entropy)

    @property
    def attn_width(self) -> int:
        """Width of q and of attention's output: n_head x head_dim (= hidden unless a config sets head_dim)."""
        return self.n_head * (self.head_dim or self.hidden // self.n_head)

    @property
    def largest_param(self) -> int:
        return max(self.param_numels, default=0)


def _from_module(name: str, family: str, cfg: dict, model: torch.nn.Module) -> ModelSpec:
    params = list(model.parameters())  # parameters() yields a tied matrix once
    per_layer: dict[str, int] = {}
    seen = set()
    for pname, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        m = re.search(r"\.(\d+)\.", pname)
        if m:
            per_layer[m.group(1)] = per_layer.get(m.group(1), 0) + p.numel()
    layer_params = max(per_layer.values(), default=0)
    mm_ids, layer_mm, galore, linears = {}, 0, {}, []
    for mname, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) or type(mod).__name__ == "Conv1D":
            d_out, d_in = mod.weight.shape if isinstance(mod, torch.nn.Linear) else mod.weight.shape[::-1]
            linears.append((mname, int(d_in), int(d_out), 0 if mod.bias is None else mod.bias.numel()))
            for p in mod.parameters(recurse=False):
                mm_ids[id(p)] = p.numel()
                if re.search(r"\.0\.", mname + "."):
                    layer_mm += p.numel()
            w = mod.weight
            if w.dim() == 2 and ("attn" in mname or "mlp" in mname):  # labkit.optim.galore_param_groups
                galore[id(w)] = tuple(w.shape)
    return ModelSpec(name=name, family=family, n_params=sum(p.numel() for p in params),
                     param_numels=[p.numel() for p in params], layer_params=layer_params,
                     param_shapes=[tuple(p.shape) for p in params], galore_shapes=list(galore.values()),
                     matmul_params=sum(mm_ids.values()), layer_matmul_params=layer_mm,
                     param_names=[n for n, _ in model.named_parameters()], linears=linears, **cfg)


def _gpt_spec(name: str, gcfg, model=None) -> ModelSpec:
    from labkit.models.gpt import GPT

    if model is None:
        with torch.device("meta"):
            model = GPT(gcfg)
    cfg = dict(n_layer=gcfg.n_layer, hidden=gcfg.n_embd, n_head=gcfg.n_head, n_kv_head=gcfg.n_head,
               ffn=4 * gcfg.n_embd, vocab=gcfg.vocab_size, max_positions=gcfg.block_size, tied=True,
               dropout=gcfg.dropout, attn_dropout=gcfg.dropout, attention=gcfg.attention,
               attn_block=gcfg.attn_block, loss_chunk=gcfg.loss_chunk or None)
    return _from_module(name, "labkit-gpt", cfg, model)


def _hf_spec(name: str, hcfg, model=None) -> ModelSpec:
    mt = getattr(hcfg, "model_type", "")
    attention = getattr(hcfg, "_attn_implementation", None) or "sdpa"
    if mt == "gpt2":
        cfg = dict(n_layer=hcfg.n_layer, hidden=hcfg.n_embd, n_head=hcfg.n_head, n_kv_head=hcfg.n_head,
                   ffn=hcfg.n_inner or 4 * hcfg.n_embd, vocab=hcfg.vocab_size, max_positions=hcfg.n_positions,
                   tied=bool(getattr(hcfg, "tie_word_embeddings", True)), dropout=hcfg.resid_pdrop,
                   attn_dropout=hcfg.attn_pdrop, attention=attention)
        family = "gpt2"
    elif mt == "llama":
        cfg = dict(n_layer=hcfg.num_hidden_layers, hidden=hcfg.hidden_size, n_head=hcfg.num_attention_heads,
                   n_kv_head=hcfg.num_key_value_heads or hcfg.num_attention_heads, ffn=hcfg.intermediate_size,
                   vocab=hcfg.vocab_size, max_positions=hcfg.max_position_embeddings,
                   tied=bool(getattr(hcfg, "tie_word_embeddings", False)), dropout=0.0,
                   attn_dropout=float(getattr(hcfg, "attention_dropout", 0.0)), attention=attention,
                   head_dim=getattr(hcfg, "head_dim", None) or hcfg.hidden_size // hcfg.num_attention_heads)
        family = "llama"
    else:
        raise ValueError(f"the estimator knows GPT-2 and Llama architectures, not {mt!r} ({name})")
    if model is None:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hcfg)
    return _from_module(name, family, cfg, model)


def spec_from(model, **overrides) -> ModelSpec:
    """A ModelSpec from a labkit GPTConfig or GPT, a transformers config or model, or a name/path.

    Names are labkit presets (see `labkit.models.hf.PRESETS`), local config paths, or hub ids when
    online. overrides are passed to the preset's config (for example n_layer=2).
    """
    from labkit.models.gpt import GPT, GPTConfig

    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, GPTConfig):
        return _gpt_spec("gpt", model)
    if isinstance(model, GPT):
        return _gpt_spec("gpt", model.config, model)
    if isinstance(model, torch.nn.Module) and hasattr(model, "config"):
        return _hf_spec(getattr(model.config, "name_or_path", "") or model.config.model_type, model.config, model)
    if hasattr(model, "model_type"):  # a transformers config
        return _hf_spec(model.model_type, model)
    if isinstance(model, str):
        from labkit.models import hf

        return _hf_spec(model, hf.get_config(model, **overrides))
    raise TypeError(f"cannot read a model from {type(model).__name__}: give a preset name, a path, "
                    "a GPTConfig or a model")


@contextlib.contextmanager
def shapes_only():
    """torch.nn.init's in-place fills as no-ops while a model is built on the meta device to read its shapes:
    there are no values to fill, and filling a meta tensor still costs about a millisecond (most of the time of
    reading a deep model). transformers' no_init_weights does the same while it loads weights."""
    init = torch.nn.init
    fills = {n: f for n, f in vars(init).items() if n.endswith("_") and not n.startswith("_") and callable(f)}
    try:
        for n in fills:
            setattr(init, n, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for n, f in fills.items():
            setattr(init, n, f)
