"""Model families as shape-only forward walks: labkit's GPT, transformers' GPT-2 and Llama.

Each function mirrors its model's forward code line by line with `Walk` primitives, so the
activation estimate follows the implementation a learner actually runs. Attention is either fused
(scaled_dot_product_attention's flash/efficient kernels: no (s, s) matrix is kept) or materialised
(the s^2 terms of Korthikanti et al. 2022, arXiv 2205.05198).
"""

from __future__ import annotations

from .attention import AttnShape, materialised
from .walk import T, Walk


def _shape(w: Walk, B: int, heads: int, S: int, n: int, mm: int, sm: int, kv_repeat: int = 1) -> AttnShape:
    drop = 1 if w.device == "cuda" else sm
    return AttnShape(B, heads, S, n // (B * heads * S), mm, sm, w.x_bytes, drop, kv_repeat)


def fused_attention_used(device: str, attention: str, attn_dropout: float) -> bool:
    """SDPA runs a fused kernel on CUDA, and on CPU only without dropout (else its math fallback)."""
    return attention == "sdpa" and (device == "cuda" or attn_dropout == 0)


def sdpa_fused(w: Walk, q: T, k: T, v: T, B: int, heads: int, S: int, out_numel: int, p: float = 0.0) -> T:
    """Flash/efficient attention saves q, k, v, its output and a logsumexp (fp32) per query row.
    With dropout it is a random op, which selective checkpointing never keeps."""
    rg = q.rg or k.rg or v.rg
    out = w.new(out_numel, w.mm_bytes, "attention out", rg)
    lse = w.new(B * heads * S, 4, "logsumexp")
    if rg:  # under autocast an fp32 q/k/v (a quantized base's output) is saved as its 16-bit copy
        copies = {id(t): w.as_matmul_input(t) for t in (q, k, v)}
        w.save(*copies.values(), out, lse)
    if p == 0:
        w.keep(out), w.keep(lse)
    return out


def sdpa_math(w: Walk, B: int, heads: int, S: int, n: int, p: float, rg: bool = True) -> T:
    """SDPA's math fallback (CPU with dropout): scaled q and k, contiguous v, probabilities,
    dropout mask and dropped probabilities are kept; on CPU it upcasts 16-bit inputs to fp32.
    rg: whether q, k or v requires grad (else nothing is saved)."""
    b = 4 if w.device == "cpu" else w.mm_bytes
    if rg:
        w.point("attention (SDPA math)", materialised("math", _shape(w, B, heads, S, n, b, b), p))
    w.keep(w.new(B * heads * S * S, b, "attention scores"))  # q @ k^T (bmm)
    w.keep(w.new(n, b, "probs @ v"))  # bmm
    if rg:
        for part in ("q scaled", "k^T scaled", "v contiguous"):
            w.save(w.new(n, b, part))
        probs = w.new(B * heads * S * S, b, "attention probs")
        w.save(probs, w.dropout(probs, p, "attention dropout"))
    return w.new(n, w.mm_bytes, "attention out (contiguous)", rg)  # saved by the output projection


def attention_manual(w: Walk, qkv: T, B: int, heads: int, S: int, n: int, p: float) -> T:
    """labkit GPT's textbook attention: q, k^T, v are made contiguous for the matmuls; the scores'
    softmax, the causal mask and, with dropout, mask and dropped copy stay. Autocast runs softmax
    in fp32 on CUDA (then probs @ v takes a 16-bit copy) but in 16-bit on CPU."""
    if not qkv.rg:  # nothing is recorded
        w.keep(w.new(B * heads * S * S, w.mm_bytes, "attention scores")), w.keep(w.new(n, w.mm_bytes, "probs @ v"))
        return w.new(n, w.mm_bytes, "attention out (contiguous)", False)
    sm = 4 if w.autocast and w.device == "cuda" else w.mm_bytes
    for part in ("q contiguous", "k^T contiguous", "v contiguous"):
        w.save(w.new(n, w.mm_bytes, part))
    w.point("attention (manual)", materialised("manual", _shape(w, B, heads, S, n, w.mm_bytes, sm), p))
    w.save(w.new(S * S, 1, "causal mask"))
    w.keep(w.new(B * heads * S * S, w.mm_bytes, "attention scores"))  # q @ k^T (bmm)
    probs = w.new(B * heads * S * S, 4 if w.autocast and w.device == "cuda" else w.mm_bytes, "attention probs")
    w.save(probs)
    dropped = w.dropout(probs, p, "attention dropout")
    w.save(w.as_matmul_input(dropped))  # probs @ v takes a 16-bit copy under autocast
    w.keep(w.new(n, w.mm_bytes, "probs @ v"))  # bmm
    return w.new(n, w.mm_bytes, "attention out (contiguous)")  # transpose(1, 2).contiguous()


def attention_eager(w: Walk, q: T, k: T, v: T, B: int, heads: int, kv_heads: int, S: int, n: int, p: float,
                    fp32_softmax: bool) -> T:
    """transformers' eager attention (GPT-2, Llama): matmul(q, k^T) * scale + the model's float mask, softmax
    (Llama: in fp32, then cast to q's dtype), dropout, matmul with v. The matmuls save q and k (with grouped
    query attention, k and v repeated to every head: repeat_kv copies them), softmax its output, the second
    matmul the (dropped) probabilities and v."""
    rg = q.rg or k.rg or v.rg
    mm, rep = w.mm_bytes, heads // kv_heads
    sm = 4 if fp32_softmax else max(mm, w.x_bytes)  # 16-bit scores + the model's fp32 mask promote to fp32
    w.forward_extra = max(w.forward_extra, B * S * S * w.x_bytes)  # the (B, 1, S, S) mask, for the whole forward
    if not rg:
        w.keep(w.new(B * heads * S * S, mm, "attention scores")), w.keep(w.new(n, mm, "probs @ v"))
        return w.new(n, mm, "attention out (contiguous)", False)
    kr = w.new(n, mm, "k repeated") if rep > 1 else k
    vr = w.new(n, mm, "v repeated") if rep > 1 else v
    w.save(w.as_matmul_input(q), w.as_matmul_input(kr))
    w.point("attention (eager)", materialised("eager", _shape(w, B, heads, S, n, mm, sm, rep), p))
    w.keep(w.new(B * heads * S * S, mm, "attention scores"))  # q @ k^T (bmm)
    probs = w.new(B * heads * S * S, sm, "attention probs")
    w.save(probs)
    if sm != mm:
        probs = w.new(B * heads * S * S, mm, "attention probs (cast)")
    dropped = w.dropout(probs, p, "attention dropout")
    w.save(dropped, w.as_matmul_input(vr))
    w.keep(w.new(n, mm, "probs @ v"))  # bmm
    return w.new(n, mm, "attention out (contiguous)")


def _embeddings(w: Walk, spec, S: int, n: int, tokens: str, positions: str) -> T:
    """Token + learned position embeddings, then dropout; the position ids are saved for the
    position table's gradient only when it trains."""
    if w.trains(positions):
        w.save(w.new(S, 8, "position ids"))
    tok = w.new(n, w.x_bytes, "token embeddings", w.trains(tokens))
    x = w.add(tok, w.new(S * spec.hidden, w.x_bytes, "position embeddings", w.trains(positions)), "embeddings")
    return w.dropout(x, spec.dropout, "embedding dropout")


def walk_labkit_gpt(w: Walk, spec, B: int, S: int, layer_marks: list[int]) -> None:
    """labkit.models.gpt.GPT: learned positions, pre-LN blocks, exact GELU, tied head."""
    r, h = B * S, spec.hidden
    n = r * h
    x = _embeddings(w, spec, S, n, "wte", "wpe")
    fused = fused_attention_used(w.device, spec.attention, spec.attn_dropout)
    for i in range(spec.n_layer):
        layer_marks.append(w.mark())
        m = f"blocks.{i}."
        a = w.layer_norm(x, r, f"ln_1.{i}", m + "ln_1")
        qkv = w.linear(a, r, 3 * h, f"qkv.{i}", m + "attn.c_attn")
        if fused:
            y = sdpa_fused(w, qkv, qkv, qkv, B, spec.n_head, S, n, spec.attn_dropout)
        elif spec.attention == "sdpa":
            y = sdpa_math(w, B, spec.n_head, S, n, spec.attn_dropout, qkv.rg)
        else:
            y = attention_manual(w, qkv, B, spec.n_head, S, n, spec.attn_dropout)
        o = w.dropout(w.linear(y, r, h, f"attn proj.{i}", m + "attn.c_proj"), spec.dropout, f"resid dropout.{i}")
        x = w.add(x, o, f"residual.{i}")
        f = w.linear(w.layer_norm(x, r, f"ln_2.{i}", m + "ln_2"), r, spec.ffn, f"fc.{i}", m + "mlp.c_fc")
        o = w.linear(w.gelu(f, f"gelu.{i}"), r, h, f"mlp proj.{i}", m + "mlp.c_proj")
        x = w.add(x, w.dropout(o, spec.dropout, f"resid dropout.{i}"), f"residual.{i}")
    layer_marks.append(w.mark())
    logits = w.linear(w.layer_norm(x, r, "ln_f", "ln_f"), r, spec.vocab, "logits", "lm_head")
    w.cross_entropy(logits, r, spec.vocab, upcast=False)


def walk_hf_gpt2(w: Walk, spec, B: int, S: int, layer_marks: list[int]) -> None:
    """transformers' GPT2LMHeadModel: Conv1D projections, NewGELU in Python ops, fp32 loss."""
    r, h = B * S, spec.hidden
    n = r * h
    w.save(w.new(r, 8, "shifted labels"))
    x = _embeddings(w, spec, S, n, "transformer.wte", "transformer.wpe")
    w.forward_locals = n * w.x_bytes + S * h * w.x_bytes  # GPT2Model.forward keeps inputs_embeds and position_embeds
    fused = fused_attention_used(w.device, spec.attention, spec.attn_dropout)
    for i in range(spec.n_layer):
        layer_marks.append(w.mark())
        m = f"transformer.h.{i}."
        qkv = w.linear(w.layer_norm(x, r, f"ln_1.{i}", m + "ln_1"), r, 3 * h, f"c_attn.{i}", m + "attn.c_attn")
        if fused:
            y = sdpa_fused(w, qkv, qkv, qkv, B, spec.n_head, S, n, spec.attn_dropout)
        elif spec.attention == "sdpa":
            y = sdpa_math(w, B, spec.n_head, S, n, spec.attn_dropout, qkv.rg)
        else:
            q, k, v = (T(n, qkv.itemsize, f"{part}.{i}", base=qkv, rg=qkv.rg) for part in "qkv")  # views of c_attn's output
            y = attention_eager(w, q, k, v, B, spec.n_head, spec.n_head, S, n, spec.attn_dropout, False)
        o = w.dropout(w.linear(y, r, h, f"c_proj.{i}", m + "attn.c_proj"), spec.dropout, f"resid dropout.{i}")
        x = w.add(x, o, f"residual.{i}")
        f = w.linear(w.layer_norm(x, r, f"ln_2.{i}", m + "ln_2"), r, spec.ffn, f"c_fc.{i}", m + "mlp.c_fc")
        o = w.linear(w.gelu_tanh_python(f, f"gelu_new.{i}"), r, h, f"mlp c_proj.{i}", m + "mlp.c_proj")
        x = w.add(x, w.dropout(o, spec.dropout, f"resid dropout.{i}"), f"residual.{i}")
    layer_marks.append(w.mark())
    logits = w.linear(w.layer_norm(x, r, "ln_f", "transformer.ln_f"), r, spec.vocab, "logits", "lm_head")
    w.cross_entropy(logits, r, spec.vocab, upcast=True)


def walk_hf_llama(w: Walk, spec, B: int, S: int, layer_marks: list[int]) -> None:
    """transformers' LlamaForCausalLM: RMSNorm in Python ops, rotary q/k, SwiGLU MLP, GQA."""
    r, h = B * S, spec.hidden
    hd = spec.head_dim or h // spec.n_head
    qd, kv = spec.n_head * hd, spec.n_kv_head * hd  # q and attention output widths (hidden unless head_dim says)
    w.save(w.new(r, 8, "shifted labels"))
    w.save(w.new(2 * S * hd, w.x_bytes, "rotary cos and sin"))
    x = w.new(r * h, w.x_bytes, "token embeddings", w.trains("model.embed_tokens"))
    w.forward_locals = r * h * w.x_bytes  # LlamaModel.forward keeps inputs_embeds until it returns
    for i in range(spec.n_layer):
        layer_marks.append(w.mark())
        m = f"model.layers.{i}."
        a = w.rms_norm_python(x, r, f"input_layernorm.{i}", m + "input_layernorm")
        q = w.linear(a, r, qd, f"q_proj.{i}", m + "self_attn.q_proj")
        k = w.linear(a, r, kv, f"k_proj.{i}", m + "self_attn.k_proj")
        v = w.linear(a, r, kv, f"v_proj.{i}", m + "self_attn.v_proj")
        q = w.new(q.numel, q.itemsize, f"q rotated.{i}", q.rg)
        k = w.new(r * kv, q.itemsize, f"k rotated.{i}", k.rg)
        if fused_attention_used(w.device, spec.attention, spec.attn_dropout):
            y = sdpa_fused(w, q, k, v, B, spec.n_head, S, r * qd, spec.attn_dropout)
        elif spec.attention == "sdpa":
            y = sdpa_math(w, B, spec.n_head, S, r * qd, spec.attn_dropout, q.rg or k.rg or v.rg)
        else:
            y = attention_eager(w, q, k, v, B, spec.n_head, spec.n_kv_head, S, r * qd, spec.attn_dropout, True)
        x = w.add(x, w.linear(y, r, h, f"o_proj.{i}", m + "self_attn.o_proj"), f"residual.{i}")
        a = w.rms_norm_python(x, r, f"post_attention_layernorm.{i}", m + "post_attention_layernorm")
        gate = w.linear(a, r, spec.ffn, f"gate_proj.{i}", m + "mlp.gate_proj")
        up = w.linear(a, r, spec.ffn, f"up_proj.{i}", m + "mlp.up_proj")
        y = w.silu_glu(gate, up, f"swiglu.{i}")
        x = w.add(x, w.linear(y, r, h, f"down_proj.{i}", m + "mlp.down_proj"), f"residual.{i}")
    layer_marks.append(w.mark())
    logits = w.linear(w.rms_norm_python(x, r, "norm", "model.norm"), r, spec.vocab, "logits", "lm_head")
    w.cross_entropy(logits, r, spec.vocab, upcast=True)


WALKS = {"labkit-gpt": walk_labkit_gpt, "gpt2": walk_hf_gpt2, "llama": walk_hf_llama}
