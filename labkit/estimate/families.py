"""Model families as shape-only forward walks: labkit's GPT, transformers' GPT-2 and Llama.

Each function mirrors its model's forward code line by line with `Walk` primitives, so the
activation estimate follows the implementation a learner actually runs. Attention is either fused
(scaled_dot_product_attention's flash/efficient kernels: no (s, s) matrix is kept) or materialised
(the s^2 terms of Korthikanti et al. 2022, arXiv 2205.05198).
"""

from __future__ import annotations

from dataclasses import dataclass

from .walk import T, TPShare, Walk


@dataclass(frozen=True)
class AttnCall:
    """One attention call's sizes and settings, shared by every attention path below."""

    batch: int  # B: rows of the micro-batch
    heads: int  # query heads
    seq: int  # S: tokens per row
    numel: int  # elements of q and of the output: B x S x heads x head_dim
    p: float = 0.0  # attention dropout probability
    kv_heads: int | None = None  # key/value heads (grouped-query attention; None: heads)
    # transformers' eager attention takes softmax in fp32 (Llama's form: softmax and its cast in one
    # statement, so the scores live until the cast returns; GPT-2 rebinds them as softmax returns)
    fp32_softmax: bool = False
    block: int | None = None  # tiled attention's tile size (labkit.recompute.tiled_attention)

    def __post_init__(self) -> None:
        for name in ("batch", "heads", "seq", "numel", "kv_heads", "block"):
            v = getattr(self, name)
            if v is None and name in ("kv_heads", "block"):  # optional
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"AttnCall.{name} must be a positive integer, got {v!r}")
        if self.numel % (self.batch * self.heads * self.seq):
            raise ValueError(f"AttnCall.numel ({self.numel}) must be batch x heads x seq x head_dim")
        if self.heads % (self.kv_heads or 1):
            raise ValueError(f"AttnCall.kv_heads ({self.kv_heads}) must divide heads ({self.heads})")
        if isinstance(self.p, bool) or not isinstance(self.p, (int, float)) or not 0 <= self.p < 1:
            raise ValueError(f"AttnCall.p must be a dropout probability from 0 to below 1, got {self.p!r}")

    @property
    def head_dim(self) -> int:
        return self.numel // (self.batch * self.heads * self.seq)

    @property
    def kv_repeat(self) -> int:
        """How many query heads share one key/value head."""
        return 1 if self.kv_heads is None else self.heads // self.kv_heads

    @property
    def scores(self) -> int:
        """Elements of one (B, heads, S, S) matrix."""
        return self.batch * self.heads * self.seq * self.seq


def fused_attention_used(device: str, attention: str, attn_dropout: float) -> bool:
    """SDPA runs a fused kernel on CUDA, and on CPU only without dropout (else its math fallback)."""
    return attention == "sdpa" and (device == "cuda" or attn_dropout == 0)


def _views(w: Walk, base: T, parts: int, n: int, names: str) -> list[T]:
    """Views of `base` (no storage): q, k, v split off one projection's output. When base requires grad
    the split's backward concatenates their gradients into one of base's size."""
    views = [T(n, base.itemsize, f"{nm}", base=base, rg=base.rg, heads_moved=True) for nm in names.split(",")[:parts]]
    if base.rg:
        w.node("split", views, (), [("grad", base)])
    return views


def _heads_view(w: Walk, base: T, name: str) -> T:
    """base.view(B, S, heads, d).transpose(1, 2): a view; its gradient comes back transposed, so reshaping
    it to base's shape copies it."""
    v = T(base.numel, base.itemsize, name, base=base, rg=base.rg, heads_moved=True)
    if base.rg:
        w.node(f"{name} view", [v], (), [("grad", base)])
    return v


def _copy(w: Walk, x: T, name: str) -> T:
    """x.contiguous() / matmul's reshape of a strided input: a copy; its gradient passes through."""
    y = w.made(T(x.numel, x.itemsize, name, rg=x.rg, scores=x.scores))
    if x.rg:
        w.node(f"{name} (copy)", [y], (), [("pass", x)])
    return y


def _operand(w: Walk, t: T, name: str, B: int, heads: int, autocast: bool = True) -> tuple[T, list[T]]:
    """A (B, heads, S, d) matmul operand as the bmm reads it, and the copies made for it: under autocast a
    16-bit copy of an fp32 tensor (same strides); then, laid out (B, S, heads, d), matmul's reshape to
    (B * heads, S, d) copies it unless B or heads is 1 (then the reshape is a view). autocast=False: inside
    an op autocast already wrapped (SDPA's math fallback)."""
    made = []
    if autocast and w.autocast and t.itemsize != w.low_bytes:
        t = w.cast(t, w.low_bytes, f"{name} (16-bit copy)")
        made.append(t)
    if (t.heads_moved or t.expanded) and B > 1 and heads > 1:
        t = _copy(w, t, name)
        made.append(t)
    return t, made


def _bmm(w: Walk, a: T, b: T, numel: int, name: str, keep: bool = True) -> T:
    """A batched matmul: saves both operands (each is needed for the other's gradient)."""
    rg = a.rg or b.rg
    y = w.made(T(numel, max(a.itemsize, b.itemsize), name, rg=rg))
    if keep:
        w.keep(y, "attention")
    if rg:
        w.node(name, [y], [t for t, other in ((a, b), (b, a)) if other.rg],
               [("grad", t) for t in (b, a) if t.rg])
    return y


def _pointwise(w: Walk, x: T, name: str, itemsize: int | None = None, saved=()) -> T:
    """A pointwise op making a new tensor (scale, mask add, masked_fill, cast): its backward makes one
    gradient of x's size."""
    y = w.made(T(x.numel, itemsize or x.itemsize, name, rg=x.rg, heads_moved=x.heads_moved))
    if x.rg:
        w.node(name, [y], saved, [("grad", x)])
    return y


def sdpa_fused(w: Walk, q: T, k: T, v: T, c: AttnCall) -> T:
    """Flash/efficient attention saves q, k, v, its output and a logsumexp (fp32) per query row.
    With dropout it is a random op, which selective checkpointing never keeps.
    Tape: under autocast an fp32 q/k/v is copied to 16-bit first; the logsumexp goes when the call returns;
    backward makes dq, dk, dv."""
    rg = q.rg or k.rg or v.rg
    out = w.new(c.numel, w.mm_bytes, "attention out", rg)
    lse = w.new(c.batch * c.heads * c.seq, 4, "logsumexp")
    # under autocast an fp32 q/k/v (a quantized base's output) is saved as its 16-bit copy
    copies = {id(t): w.as_matmul_input(t) for t in (q, k, v)}
    ins = []
    for t in (q, k, v):
        x = copies[id(t)]
        if x is not t:
            x.rg = t.rg
            w.made(x)
            if t.rg:
                w.node("autocast input cast", [x], (), [("grad", t)])
        ins.append(x)
    w.made(out), w.made(lse)
    if c.p == 0:
        w.keep(out, "attention"), w.keep(lse, "attention")
    if rg:
        w.node("scaled_dot_product_attention", [out], [*ins, out, lse], [("grad", t) for t in ins if t.rg])
    w.drop(lse, *[x for x, t in zip(ins, (q, k, v)) if x is not t])
    return out


def sdpa_math(w: Walk, q: T, k: T, v: T, c: AttnCall) -> T:
    """SDPA's math fallback (CPU with dropout): scaled q and k, contiguous v, probabilities,
    dropout mask and dropped probabilities are kept; on CPU it upcasts 16-bit inputs to fp32.
    Tape (aten's _scaled_dot_product_attention_math): upcast copies, the causal bias (ones, tril, where),
    q * sqrt(scale) (held to the end), k^T * sqrt(scale), contiguous copies of both for the bmm, + bias,
    _safe_softmax, dropout (the probabilities rebound to the dropped ones), v's copy, bmm, and the output
    (and the returned weights) cast back to the inputs' dtype."""
    B, heads, S, n, p = c.batch, c.heads, c.seq, c.numel, c.p
    rg = q.rg or k.rg or v.rg
    b = 4 if w.device == "cpu" else w.mm_bytes
    ins = [w.cast(t, w.low_bytes, f"{t.name} (16-bit copy)") if w.autocast else t for t in (q, k, v)]
    up = [w.cast(t, b, f"{t.name} (upcast)") for t in ins]
    q32, k32, v32 = up
    qs = _pointwise(w, q32, "q * sqrt(scale)")
    ones = w.made(T(S * S, 1, "ones"))
    tril = w.made(T(S * S, 1, "tril"))
    w.drop(ones)
    bias = w.made(T(S * S, b, "causal bias"))
    w.drop(tril)
    reps = [_repeat(w, t, n // t.numel, f"{t.name} repeated") for t in (k32, v32)] if k32.numel < n else []
    kr, vr = reps or (k32, v32)
    kts = _pointwise(w, kr, "k^T * sqrt(scale)")
    (qc, qm), (kc, km) = (_operand(w, qs, "q contiguous", B, heads, False),
                          _operand(w, kts, "k^T contiguous", B, heads, False))
    scores = _bmm(w, qc, kc, c.scores, "q @ k^T")
    w.drop(*qm, *km, kts)
    biased = w.made(T(scores.numel, b, "scores + bias", rg=scores.rg))
    if scores.rg:
        w.node("+ bias", [biased], (), [("pass", scores)])
    w.drop(scores)
    probs = w.made(T(scores.numel, b, "attention probs", rg=rg, scores=True))
    if rg:
        w.node("softmax", [probs], [probs], [("grad", biased)])
    w.drop(biased)
    dropped = _dropout_tape(w, probs, p, "attention dropout")
    if dropped is not probs:
        w.drop(probs)
    weights = w.cast(dropped, ins[0].itemsize, "attention weights (returned)") if ins[0].itemsize != b else None
    vc, vm = _operand(w, vr, "v contiguous", B, heads, False)
    o = _bmm(w, dropped, vc, n, "probs @ v")
    w.drop(*vm, *reps)
    out_t = w.cast(o, ins[0].itemsize, "attention out") if ins[0].itemsize != b else o
    if out_t is not o:
        w.drop(o)
    w.drop(qs, bias, dropped, *(t for t, s in zip(up, ins) if t is not s), *(t for t, s in zip(ins, (q, k, v)) if t is not s))
    if weights is not None:
        w.drop(weights)
    y = _contiguous_out(w, out_t, "attention out (contiguous)", heads, S)
    y.rg = rg
    assert y.itemsize == w.mm_bytes, (y.name, y.itemsize)
    return y


def _kv_view(c: AttnCall) -> bool:
    """Grouped-query attention with one key/value head: repeat_kv's reshape of the expanded (B, 1, rep, S, d)
    merges a size-1 dimension, so it is a view (stride 0 over the heads), not a copy."""
    return c.kv_repeat > 1 and c.kv_heads == 1


def _repeated(w: Walk, t: T, c: AttnCall, name: str) -> T:
    """What the eager attention's matmul saves of a repeated k or v: a (B, heads, S, d) copy in the matmul's
    dtype (repeat_kv's copy; of `_kv_view`'s view, autocast's cast of an fp32 one or matmul's reshape when
    B > 1 keeps (B, heads) from folding into one batch dimension), else the view itself (t's storage)."""
    n = c.numel
    if _kv_view(c) and not (w.autocast and t.itemsize != w.low_bytes) and c.batch == 1:
        return T(n, t.itemsize, name, base=t, rg=t.rg, expanded=True)
    return w.new(n, w.mm_bytes, name)


def _repeat(w: Walk, t: T, rep: int, name: str, view: bool = False) -> T:
    """Grouped-query attention's k/v repeated to every head (repeat_kv, repeat_interleave: expand + reshape =
    a contiguous copy; view: `_kv_view`'s); backward sums the copies into a gradient of t's size."""
    if view:
        y = T(t.numel * rep, t.itemsize, name, base=t, rg=t.rg, expanded=True)
        if t.rg:
            w.node(name, [y], (), [("grad", t)])
        return y
    y = w.made(T(t.numel * rep, t.itemsize, name, rg=t.rg))
    if t.rg:
        w.node(name, [y], (), [("grad", t)])
    return y


def _dropout_tape(w: Walk, x: T, p: float, name: str) -> T:
    """Dropout on the tape only (the walk's own `dropout` saves): mask and output, the mask saved."""
    if p <= 0:
        return x
    mask = w.made(T(x.numel, 1 if w.device == "cuda" else x.itemsize, f"{name} mask", scores=x.scores))
    y = w.made(T(x.numel, x.itemsize, name, rg=x.rg, scores=x.scores))
    if x.rg:
        w.node(name, [y], [mask], [("grad", x)])
    w.drop(mask)
    return y


def _contiguous_out(w: Walk, o: T, name: str, heads: int, S: int) -> T:
    """attention_output.transpose(1, 2).contiguous(): a copy (unless heads or S is 1: then already in that
    order); its backward copies the gradient back into the bmm's layout."""
    if heads == 1 or S == 1:
        return o
    y = w.made(T(o.numel, o.itemsize, name, rg=o.rg))
    if o.rg:
        w.node(name, [y], (), [("grad", o)])
    w.drop(o)
    return y


def attention_manual(w: Walk, qkv: T, c: AttnCall) -> T:
    """labkit GPT's textbook attention: q, k^T, v are made contiguous for the matmuls; the scores'
    softmax, the causal mask and, with dropout, mask and dropped copy stay. Autocast runs softmax
    in fp32 on CUDA (then probs @ v takes a 16-bit copy) but in 16-bit on CPU.
    Tape: q, k, v are views of qkv (their gradients concatenated back); the mask (tril) lives to the end."""
    q, k, v = _views(w, qkv, 3, c.numel, "q,k,v")
    sm = 4 if w.autocast and w.device == "cuda" and qkv.rg else w.mm_bytes
    return _manual_tape(w, (q, k, v), c, sm, qkv.rg)


def _manual_tape(w: Walk, qkv: tuple[T, T, T], c: AttnCall, sm: int, rg: bool) -> T:
    """labkit GPT's manual attention on the tape."""
    (q, k, v), B, heads, S, n, p = qkv, c.batch, c.heads, c.seq, c.numel, c.p
    (qc, qm), (kc, km) = _operand(w, q, "q contiguous", B, heads), _operand(w, k, "k^T contiguous", B, heads)
    scores = _bmm(w, qc, kc, c.scores, "q @ k^T")
    w.drop(*qm, *km)
    scaled = _pointwise(w, scores, "scaled scores")
    w.drop(scores)
    ones = w.made(T(S * S, 1, "ones"))
    tril = w.made(T(S * S, 1, "causal mask", tp=TPShare.LAYER))
    w.drop(ones)
    notm = w.made(T(S * S, 1, "~mask", tp=TPShare.LAYER))
    masked = _pointwise(w, scaled, "masked scores", saved=[notm])
    w.drop(notm, scaled)
    probs = w.made(T(masked.numel, sm, "attention probs", rg=rg, scores=True))
    if rg:
        w.node("softmax", [probs], [probs], [("grad", masked)])
    dropped = _dropout_tape(w, probs, p, "attention dropout")
    if dropped is not probs:
        w.drop(probs)
    w.drop(masked)
    att = w.cast(dropped, w.mm_bytes, "attention probs (16-bit copy)") if dropped.itemsize != w.mm_bytes else dropped
    vc, vm = _operand(w, v, "v contiguous", B, heads)
    o = _bmm(w, att, vc, n, "probs @ v")
    w.drop(*vm)
    if att is not dropped:
        w.drop(att)
    y = _contiguous_out(w, o, "attention out (contiguous)", heads, S)
    w.drop(dropped, tril)
    y.rg = rg
    assert y.itemsize == w.mm_bytes, (y.name, y.itemsize)
    return y


def attention_eager(w: Walk, q: T, k: T, v: T, c: AttnCall) -> T:
    """transformers' eager attention (GPT-2, Llama): matmul(q, k^T) * scale + the model's float mask, softmax
    (Llama: in fp32, then `.to(query.dtype)`; GPT-2: `.type(value.dtype)`), dropout, matmul with v. The
    matmuls save q and k (with grouped query attention, k and v repeated to every head: repeat_kv copies
    them), softmax its output, the second matmul the (dropped) probabilities and v. Under autocast an fp32
    model's Llama query is fp32 (RoPE), so dropout runs in fp32 and the second matmul copies the
    probabilities to 16-bit.
    Tape: matmul copies a strided operand (GPT-2's q, k^T and v are views of c_attn's output) before its
    bmm; under autocast an fp32 operand is copied to 16-bit."""
    rg, mm = q.rg or k.rg or v.rg, w.mm_bytes
    sm = 4 if c.fp32_softmax else max(mm, w.x_bytes)  # 16-bit scores + the model's fp32 mask promote to fp32
    to = q.itemsize if c.fp32_softmax else v.itemsize  # what softmax's output is cast to (query's, value's)
    # the (B, 1, S, S) mask, for the whole forward
    w.forward_extra = max(w.forward_extra, c.batch * c.seq * c.seq * w.x_bytes)
    return _eager_tape(w, (q, k, v), c, (sm, to), rg)


def _eager_tape(w: Walk, qkv: tuple[T, T, T], c: AttnCall, widths: tuple[int, int], rg: bool) -> T:
    """transformers' eager attention on the tape. widths: bytes of softmax's output and of its cast."""
    mm, (q, k, v), B, heads, S, n, p, rep = w.mm_bytes, qkv, c.batch, c.heads, c.seq, c.numel, c.p, c.kv_repeat
    sm, to = widths
    view = _kv_view(c)
    kr, vr = ((_repeat(w, k, rep, "k repeated", view), _repeat(w, v, rep, "v repeated", view)) if rep > 1
              else (k, v))
    (qc, qm), (kc, km) = _operand(w, q, "q contiguous", B, heads), _operand(w, kr, "k^T contiguous", B, heads)
    scores = _bmm(w, qc, kc, c.scores, "q @ k^T")
    w.drop(*qm, *km)
    scaled = _pointwise(w, scores, "scaled scores")
    w.drop(scores)
    masked = _pointwise(w, scaled, "scores + mask", itemsize=max(scaled.itemsize, w.x_bytes))  # the float mask
    w.drop(scaled)
    # softmax(dtype=float32) of 16-bit scores (Llama in fp16/bf16): aten's softmax casts its input first
    # (_to_copy, then _softmax); in backward _softmax_backward_data returns fp32, the cast's node makes it 16-bit
    soft_in = w.cast(masked, sm, "scores (fp32 for softmax)") if sm != masked.itemsize else masked
    probs = w.made(T(masked.numel, sm, "attention probs", rg=rg, scores=True))
    if rg:
        w.node("softmax", [probs], [probs], [("grad", soft_in)])
    if soft_in is not masked:
        w.drop(soft_in)
    # GPT-2 rebinds attn_weights to softmax's output in its own statement: the masked scores go
    # as softmax returns. Llama's
    # `attn_weights = softmax(attn_weights, dtype=float32).to(query.dtype)` is one statement:
    # they stay bound to attn_weights until the cast returns.
    if not c.fp32_softmax:
        w.drop(masked)
    att = probs
    if sm != to:  # GPT-2: `.type(value.dtype)`; Llama: `.to(query.dtype)`
        att = w.cast(probs, to, "attention probs (cast)")
        w.drop(probs)
    if c.fp32_softmax:
        w.drop(masked)
    dropped = _dropout_tape(w, att, p, "attention dropout")
    if dropped is not att:
        w.drop(att)
    dc, dm = _operand(w, dropped, "attention probs", B, heads)  # autocast's 16-bit copy of fp32 probabilities
    vc, vm = _operand(w, vr, "v contiguous", B, heads)
    o = _bmm(w, dc, vc, n, "probs @ v")
    w.drop(*dm, *vm)
    # eager returns (output, weights): the block's `hidden_states, _ = self.attn(...)` holds the weights
    # in `_` until it returns
    w.block_end.append(dropped)
    # the output's transpose(1, 2).contiguous() runs inside eager_attention_forward, whose locals hold the
    # repeated k and v until it returns
    y = _contiguous_out(w, o, "attention out (contiguous)", heads, S)
    if kr is not k and not kr.expanded:
        w.drop(kr)
    if vr is not v and not vr.expanded:
        w.drop(vr)
    y.rg = rg
    assert y.itemsize == mm, (y.name, y.itemsize)
    return y


def attention_tiled(w: Walk, q: T, k: T, v: T, c: AttnCall) -> T:
    """labkit.recompute.tiled_attention (FlashAttention's algorithm in PyTorch): saves q, k, v (views of
    c_attn's output), its output (in q's dtype, laid out so the model's transpose and contiguous() are
    views) and one fp32 logsumexp per row: nothing (S, S). One custom op to a dispatch mode, like SDPA:
    selective checkpointing keeps its output and logsumexp ("matmuls"), never its tiles' scores.
    Tape: the output and the logsumexp, then one tile's scratch (tiled_attention.scratch_bytes) made and
    freed; backward: fp32 accumulators for dq, dk, dv (for fp32 q, k, v they are the gradients; for 16-bit
    ones cast at the end, the accumulators freed when the node returns) beside one tile's scratch."""
    from labkit.recompute.tiled_attention import scratch_bytes

    rg = q.rg or k.rg or v.rg
    # the model's q, k, v are views of c_attn's (B, S, 3h) output: (B, heads) of a tile merge without a copy
    # only when one of them is 1 (an fp32 matmul copies the tile otherwise)
    B, heads, n = c.batch, c.heads, c.numel
    fwd, bwd = scratch_bytes(B, heads, c.seq, c.head_dim, c.block, q.itemsize, packed=B > 1 and heads > 1)
    out = w.made(w.new(n, q.itemsize, "attention out", rg))
    lse = w.made(w.new(B * heads * c.seq, 4, "logsumexp"))
    w.keep(out, "attention"), w.keep(lse, "attention")
    scratch = w.made(T(fwd, 1, "tiled attention: one tile's scratch"))
    w.drop(scratch)
    if rg:
        grads = [("grad", t) for t in (q, k, v) if t.rg]
        tiles = [("tmp", "one tile's scratch", bwd), ("free", "one tile's scratch")]
        if q.itemsize == 4:
            steps = grads + tiles
        else:
            steps = [("tmp", "fp32 dq, dk, dv accumulators", 3 * n * 4), *tiles, *grads,
                     ("free", "fp32 dq, dk, dv accumulators")]
        w.node("tiled attention", [out], [q, k, v, out, lse], steps)
    w.drop(lse)
    return out


def chunked_loss(w: Walk, final: T, spec, r: int) -> tuple[int, int]:
    """labkit.recompute.chunked_ce on the final norm's output: saves it (the hidden states), one fp32
    logsumexp per row and the count of counted rows (int64); the head's weight is a parameter. Returns its
    (forward, backward) scratch (chunked_ce.scratch_bytes): the chunks' logits, never all (r, V) of them."""
    from labkit.recompute.chunked_ce import scratch_bytes

    m = w.low_bytes if w.autocast else final.itemsize
    w.save(final, w.new(r, 4, "logsumexp (chunked loss)"), w.new(1, 8, "counted rows (chunked loss)"))
    return scratch_bytes(r, spec.hidden, spec.vocab, spec.loss_chunk, final.itemsize, w.x_bytes, m)


def chunk_rows(B: int, S: int, chunks: int) -> tuple[int, ...]:
    """Rows of each chunk of torch.chunk(chunks) along a sequence of S tokens, B rows each: ceil(S /
    chunks) tokens per chunk, the last one what is left (so fewer chunks than asked when chunks does
    not divide S)."""
    size = -(-S // chunks)
    return tuple(B * min(size, S - k) for k in range(0, S, size))


def output_chunks_loss(w: Walk, final: T, spec, B: int, S: int, head: str) -> None:
    """labkit.recompute.chunked_output (torchtune's CEWithChunkedOutputLoss) on the final norm's
    output. Forward: the head runs on each chunk (a view along the sequence) and saves that chunk's
    input: under autocast its 16-bit copy, else, for B > 1 and several chunks, the contiguous copy
    matmul's reshape makes of the strided view (else the view itself): r h bytes in all, as the
    whole head saves. A frozen weight's autocast copy is not cached: each chunk's matmul makes and
    saves its own (one per chunk). Then each chunk's fp32 log-softmax is saved by its cross-entropy
    (r V 4 in all), and, for B > 1 and several chunks, its labels' contiguous copy (reshape(-1) of a
    strided view) by nll_loss (r x 8 in all); the division by the count of counted targets saves
    that count (int64). The logits, their fp32 copies and the gradients are the moments'
    (predict.step_bytes reads w.output_chunks)."""
    r, V = B * S, spec.vocab
    rows = chunk_rows(B, S, w.loss_chunks)
    before = w.saved_total
    logits = w.linear(final, r, V, "logits (every chunk's)", head)
    # bytes: what the chunks' matmuls save as inputs (none for a frozen head: dx needs W only)
    w.output_chunk_inputs = (w.saved_total - before, w.autocast or (B > 1 and len(rows) > 1))
    if head in w.copy_frozen:  # a frozen weight's copy per chunk, saved by its chunk's matmul (dx)
        more = (len(rows) - 1) * w.copy_frozen[head]
        w.copy_frozen[head] += more
        w.copy_bytes += more
    w.cross_entropy(logits, r, V, upcast=True)  # each chunk's .float(): fp32 log-softmax
    if B > 1 and len(rows) > 1:
        w.save(w.new(r, 8, "the chunks' labels, reshaped copies"))
    w.save(w.new(1, 8, "count of counted targets"))
    w.output_chunks = rows


def _embeddings(w: Walk, spec, S: int, n: int, tokens: str, positions: str) -> T:
    """Token + learned position embeddings, then dropout; the position ids are saved for the
    position table's gradient only when it trains."""
    if w.trains(positions):
        w.save(w.new(S, 8, "position ids"))
    tok = w.made(w.new(n, w.x_bytes, "token embeddings", w.trains(tokens)))
    pos = w.made(w.new(S * spec.hidden, w.x_bytes, "position embeddings", w.trains(positions)))
    x = w.add(tok, pos, "embeddings")
    y = w.dropout(x, spec.dropout, "embedding dropout")
    return y


def _attention(w: Walk, spec, q: T, k: T, v: T, c: AttnCall) -> T:
    """The model's attention path on q, k, v: fused SDPA, SDPA's math fallback, labkit's manual or eager."""
    if fused_attention_used(w.device, spec.attention, c.p):
        return sdpa_fused(w, q, k, v, c)
    if spec.attention == "sdpa":
        return sdpa_math(w, q, k, v, c)
    return attention_eager(w, q, k, v, c)


def walk_labkit_gpt(w: Walk, spec, B: int, S: int, layer_marks: list[int]) -> None:
    """labkit.models.gpt.GPT: learned positions, pre-LN blocks, exact GELU, tied head.
    Python lifetimes (the tape): a block's input is held by the loop until the block returns; ln_1's output
    until attention returns; c_attn's output (q, k, v) and attention's output until attention returns; the
    loss runs inside GPT.forward, so pos, the last block's output (and the chunked loss's input) are held
    through it (Walk.loss_locals)."""
    r, h = B * S, spec.hidden
    n = r * h
    x = _embeddings(w, spec, S, n, "wte", "wpe")
    call = AttnCall(B, spec.n_head, S, n, spec.attn_dropout, block=spec.attn_block or None)
    # pos = torch.arange(T) is held until the forward returns (and saved when the position table trains)
    w.forward_locals, w.locals_saved = (0, S * 8) if w.trains("wpe") else (S * 8, 0)
    for i in range(spec.n_layer):
        layer_marks.append(w.mark())
        w.tape.block(i, x)
        m = f"blocks.{i}."
        a = w.layer_norm(x, r, f"ln_1.{i}", m + "ln_1")
        qkv = w.linear(a, r, 3 * h, f"qkv.{i}", m + "attn.c_attn")
        with w.per_head(qkv):  # c_attn is column-parallel, c_proj row-parallel
            if spec.attention == "manual":
                y = attention_manual(w, qkv, call)
            elif spec.attention == "tiled":
                q, k, v = _views(w, qkv, 3, n, "q,k,v")
                y = attention_tiled(w, q, k, v, call)
            else:
                q, k, v = _views(w, qkv, 3, n, "q,k,v")
                y = _attention(w, spec, q, k, v, call)
        o = w.linear(y, r, h, f"attn proj.{i}", m + "attn.c_proj")
        od = w.dropout(o, spec.dropout, f"resid dropout.{i}")
        if od is not o:
            w.drop(o)
        w.drop(qkv, y, a)
        x2 = w.add(x, od, f"residual.{i}")
        w.drop(od)
        b = w.layer_norm(x2, r, f"ln_2.{i}", m + "ln_2")
        f = w.linear(b, r, spec.ffn, f"fc.{i}", m + "mlp.c_fc")
        with w.per_head(f):  # c_fc is column-parallel, c_proj row-parallel
            g = w.gelu(f, f"gelu.{i}")
        w.drop(f)
        o = w.linear(g, r, h, f"mlp proj.{i}", m + "mlp.c_proj")
        w.drop(g)
        od = w.dropout(o, spec.dropout, f"resid dropout.{i}")
        if od is not o:
            w.drop(o)
        w.drop(b)
        x3 = w.add(x2, od, f"residual.{i}")
        w.drop(od, x2, x, *w.block_end)
        w.block_end.clear()
        x = x3
    layer_marks.append(w.mark())
    w.tape.end(x)
    final = w.layer_norm(x, r, "ln_f", "ln_f")
    w.tape.head(final)
    if w.loss_chunks:  # GPT.forward(idx, output_chunks=N) returns the chunks: its locals are gone
        output_chunks_loss(w, final, spec, B, S, "lm_head")
        return
    if spec.loss_chunk is not None:  # the head and the loss in one chunked Function: no (r, V) logits
        w.loss_scratch = chunked_loss(w, final, spec, r)
    # GPT.forward's locals while its loss runs: pos (S int64), x (the last block's output, ln_f's input) and,
    # for the chunked loss, h (ln_f's output): under offload each is still held though its saved copy left
    held = [x, final] if spec.loss_chunk is not None else [x]
    w.loss_locals = (S * 8 + sum(t.nbytes for t in held),
                     w.forward_locals + sum(t.nbytes for t in held if id(t.root()) not in w.saved))
    if spec.loss_chunk is not None:
        return
    logits = w.linear(final, r, spec.vocab, "logits", "lm_head")
    w.cross_entropy(logits, r, spec.vocab, upcast=False)


def walk_hf_gpt2(w: Walk, spec, B: int, S: int, layer_marks: list[int]) -> None:
    """transformers' GPT2LMHeadModel: Conv1D projections, NewGELU in Python ops, fp32 loss.
    Python lifetimes (the tape): GPT2Block keeps its input (the caller's), the attention's output and the
    residual in locals until it returns; ln_1's output goes when `hidden_states` is rebound after attention,
    ln_2's after the MLP."""
    r, h = B * S, spec.hidden
    n = r * h
    if not w.loss_chunks:  # transformers' loss: the labels shifted, a copy its nll_loss saves
        w.save(w.new(r, 8, "shifted labels"))
    x = _embeddings(w, spec, S, n, "transformer.wte", "transformer.wpe")
    call = AttnCall(B, spec.n_head, S, n, spec.attn_dropout)
    # GPT2Model.forward keeps inputs_embeds, position_embeds and the position ids until it returns
    w.forward_locals = n * w.x_bytes + S * h * w.x_bytes + (0 if w.trains("transformer.wpe") else S * 8)
    w.locals_saved = S * 8 if w.trains("transformer.wpe") else 0
    for i in range(spec.n_layer):
        layer_marks.append(w.mark())
        w.tape.block(i, x)
        m = f"transformer.h.{i}."
        a = w.layer_norm(x, r, f"ln_1.{i}", m + "ln_1")
        qkv = w.linear(a, r, 3 * h, f"c_attn.{i}", m + "attn.c_attn")
        q, k, v = _views(w, qkv, 3, n, f"q.{i},k.{i},v.{i}")  # views of c_attn's output
        y = _attention(w, spec, q, k, v, call)
        o = w.linear(y, r, h, f"c_proj.{i}", m + "attn.c_proj")
        w.drop(y)
        od = w.dropout(o, spec.dropout, f"resid dropout.{i}")
        if od is not o:
            w.drop(o)
        w.drop(qkv)
        x2 = w.add(x, od, f"residual.{i}")
        w.drop(a)
        b = w.layer_norm(x2, r, f"ln_2.{i}", m + "ln_2")
        f = w.linear(b, r, spec.ffn, f"c_fc.{i}", m + "mlp.c_fc")
        g = w.gelu_tanh_python(f, f"gelu_new.{i}")
        w.drop(f)
        o2 = w.linear(g, r, h, f"mlp c_proj.{i}", m + "mlp.c_proj")
        w.drop(g)
        ff = w.dropout(o2, spec.dropout, f"resid dropout.{i}")
        if ff is not o2:
            w.drop(o2)
        x3 = w.add(x2, ff, f"residual.{i}")
        w.drop(b, x2, od, ff, x, *w.block_end)
        w.block_end.clear()
        x = x3
    layer_marks.append(w.mark())
    w.tape.end(x)
    # GPT2Block gets the position ids (saved when the position table trains) and, eager, the 4-D mask
    w.block_kwargs = (S * 8 + w.forward_extra, S * 8 if w.trains("transformer.wpe") else 0)
    final = w.layer_norm(x, r, "ln_f", "transformer.ln_f")
    w.tape.head(final)
    if w.loss_chunks:
        output_chunks_loss(w, final, spec, B, S, "lm_head")
        return
    logits = w.linear(final, r, spec.vocab, "logits", "lm_head")
    w.hold_final(final)
    w.cross_entropy(logits, r, spec.vocab, upcast=True)


def _rotary(w: Walk, q: T, rope: tuple[T, T], name: str) -> T:
    """q * cos + rotate_half(q) * sin (transformers' apply_rotary_pos_emb); cos and sin are the model's (one
    pair for every block: `unsqueeze` views of them), saved by the two products. rotate_half: -x2 (half),
    cat(-x2, x1); the slices' backward makes full-size gradients."""
    half = T(q.numel // 2, q.itemsize, f"{name} second half", base=q, rg=q.rg)
    first = T(q.numel // 2, q.itemsize, f"{name} first half", base=q, rg=q.rg)
    cos, sin = rope
    wide = max(q.itemsize, w.x_bytes)  # cos and sin are in the model's dtype: a 16-bit q times them is fp32
    hm = q.heads_moved  # pointwise ops keep q's layout; cat makes a fresh (B, heads, S, d) tensor
    qc = w.made(T(q.numel, wide, f"{name} * cos", rg=q.rg, heads_moved=hm))
    neg = w.made(T(q.numel // 2, q.itemsize, f"-{name} second half", rg=q.rg, heads_moved=hm))
    rot = w.made(T(q.numel, q.itemsize, f"rotate_half({name})", rg=q.rg))
    w.drop(neg)
    qs = w.made(T(q.numel, wide, f"rotate_half({name}) * sin", rg=q.rg))
    w.drop(rot)
    y = w.made(T(q.numel, wide, f"{name} rotated", rg=q.rg, heads_moved=hm))
    w.drop(qc, qs)
    if q.rg:
        w.node(f"{name} * cos", [qc], [cos], [("grad", q)])  # in the order the code makes them:
        w.node(f"{name} first half (slice)", [first], (), [("grad", q)])  # x1, x2 = slices (views)
        w.node(f"{name} second half (slice)", [half], (), [("grad", q)])
        w.node(f"-{name} half", [neg], (), [("grad", half)])
        w.node("cat", [rot], (), [("pass", neg), ("pass", first)])
        w.node(f"rotate_half({name}) * sin", [qs], [sin], [("grad", rot)])
        w.node(f"{name} rotated", [y], (), [("pass", qc), ("pass", qs)])
    return y


def walk_hf_llama(w: Walk, spec, B: int, S: int, layer_marks: list[int]) -> None:
    """transformers' LlamaForCausalLM: RMSNorm in Python ops, rotary q/k, SwiGLU MLP, GQA.
    Python lifetimes (the tape): the q and k projections go once rotated; the attention's locals (rotated
    q, k, v and the output) when it returns, and ln's output then too (`hidden_states` is rebound); the
    MLP's gate goes after silu, silu's output and up after the product."""
    r, h = B * S, spec.hidden
    hd = spec.head_dim or h // spec.n_head
    qd, kv = spec.n_head * hd, spec.n_kv_head * hd  # q and attention output widths (hidden unless head_dim says)
    if not w.loss_chunks:  # transformers' loss: the labels shifted, a copy its nll_loss saves
        w.save(w.new(r, 8, "shifted labels"))
    rope = (w.new(S * hd, w.x_bytes, "rotary cos", rg=False), w.new(S * hd, w.x_bytes, "rotary sin", rg=False))
    w.save(*rope)
    x = w.made(w.new(r * h, w.x_bytes, "token embeddings", w.trains("model.embed_tokens")))
    # LlamaModel.forward keeps inputs_embeds (block 0's input), the position ids and cos, sin (saved by the
    # rotary products) until it returns; block 0's RMSNorm saves the embeddings themselves when they are fp32
    emb_saved = x.rg and x.itemsize == 4
    w.forward_locals = S * 8 + (0 if emb_saved else r * h * w.x_bytes)
    w.locals_saved = 2 * S * hd * w.x_bytes + (r * h * w.x_bytes if emb_saved else 0)
    w.block0_local = 0 if emb_saved else r * h * w.x_bytes
    call = AttnCall(B, spec.n_head, S, r * qd, spec.attn_dropout, spec.n_kv_head, fp32_softmax=True)
    for i in range(spec.n_layer):
        layer_marks.append(w.mark())
        w.tape.block(i, x)
        m = f"model.layers.{i}."
        a = w.rms_norm_python(x, r, f"input_layernorm.{i}", m + "input_layernorm")
        q = w.linear(a, r, qd, f"q_proj.{i}", m + "self_attn.q_proj")
        k = w.linear(a, r, kv, f"k_proj.{i}", m + "self_attn.k_proj")
        v = w.linear(a, r, kv, f"v_proj.{i}", m + "self_attn.v_proj")
        with w.per_head(q, k, v):  # q, k, v column-parallel (GQA's key/value heads too), o_proj row-parallel
            qv, kvw, vv = (_heads_view(w, t, f"{t.name} heads") for t in (q, k, v))
            qr = _rotary(w, qv, rope, f"q.{i}")
            kr = _rotary(w, kvw, rope, f"k.{i}")
            w.drop(q, k)
            y = _attention(w, spec, qr, kr, vv, call)
        o = w.linear(y, r, h, f"o_proj.{i}", m + "self_attn.o_proj")
        w.drop(y, qr, kr, v, a)
        x2 = w.add(x, o, f"residual.{i}")
        w.drop(o)
        b = w.rms_norm_python(x2, r, f"post_attention_layernorm.{i}", m + "post_attention_layernorm")
        gate = w.linear(b, r, spec.ffn, f"gate_proj.{i}", m + "mlp.gate_proj")
        with w.per_head(gate):  # gate_proj and up_proj column-parallel, down_proj row-parallel
            s = w.silu(gate, f"swiglu.{i}")
            w.drop(gate)
        up = w.linear(b, r, spec.ffn, f"up_proj.{i}", m + "mlp.up_proj")
        with w.per_head(up):
            y2 = w.glu_mul(s, up, f"swiglu.{i}")
            w.drop(s, up)
        d = w.linear(y2, r, h, f"down_proj.{i}", m + "mlp.down_proj")
        w.drop(y2, b)
        x3 = w.add(x2, d, f"residual.{i}")
        w.drop(d, x2, x, *w.block_end)
        w.block_end.clear()
        x = x3
    layer_marks.append(w.mark())
    w.tape.end(x)
    # LlamaDecoderLayer gets the position ids, cos and sin (saved) and, eager, the 4-D mask
    w.block_kwargs = (S * 8 + 2 * S * hd * w.x_bytes + w.forward_extra, 2 * S * hd * w.x_bytes)
    final = w.rms_norm_python(x, r, "norm", "model.norm")
    w.tape.head(final)
    if w.loss_chunks:
        output_chunks_loss(w, final, spec, B, S, "lm_head")
        return
    logits = w.linear(final, r, spec.vocab, "logits", "lm_head")
    w.hold_final(final)
    w.cross_entropy(logits, r, spec.vocab, upcast=True)


WALKS = {"labkit-gpt": walk_labkit_gpt, "gpt2": walk_hf_gpt2, "llama": walk_hf_llama}
