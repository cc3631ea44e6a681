"""Materialised attention, op by op: what each path allocates, saves and frees, in forward and in backward.

When attention keeps its (s, s) matrices (textbook attention, transformers' "eager" attention, SDPA's math
fallback), those matrices dominate a long-sequence step, and its worst moments are inside attention:
in forward while the scaled scores and the masked scores both exist, in backward while the gradient of
the probabilities and softmax's backward output both exist beside the saved probabilities. This module
replays each path's aten ops on byte counts (`Ops`) and reports those moments as points for the walk.

P below is one (B, a, S, S) matrix in the dtype of that op's output. The op sequences were read from the
code of each path and checked against the Ledger's per-op timeline (tests/unit/test_estimate_attention.py):

- labkit GPT "manual": bmm q k^T -> mul (scale) -> ones/tril (S^2 bool) -> bitwise_not (saved) ->
  masked_fill -> softmax (saved) -> [dropout: mask and output, saved] -> bmm with v (saves probs, v).
  Backward: bmm -> [dropout: mul by mask] -> _softmax_backward_data -> masked_fill -> mul -> bmm.
- transformers eager (GPT-2, Llama): bmm -> mul -> add the model's (B, 1, S, S) float mask -> softmax
  (Llama: in fp32, then `.to(query.dtype)`; GPT-2: `.type(value.dtype)`) -> [dropout] -> bmm. Llama with
  grouped-query attention first repeats k and v to every head (repeat_kv: an expand and a copy of each).
  Under autocast an fp32 model's Llama query is fp32 (RoPE multiplies the 16-bit projection by fp32 cos and
  sin), so the cast is a no-op, dropout runs in fp32 and the bmm with v makes autocast's 16-bit copy of
  the probabilities (saved); the fp32 ones stay, returned as the attention weights, until the block returns.
- SDPA math (CPU with dropout): a (S, S) float bias from ones/tril/where -> bmm -> add the bias -> softmax
  (saved) -> dropout (mask and output saved) -> bmm.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Ops:
    """Live bytes of one region's tensors as its ops run. `saved` tensors stay for backward; the others are
    temporaries. `peaks` keeps the worst moment: (what, saved bytes then, temporary bytes then)."""

    live: dict[str, tuple[int, bool]] = field(default_factory=dict)  # name -> (bytes, saved)
    worst: tuple[str, int, int] = ("", 0, 0)

    def alloc(self, name: str, nbytes: int, saved: bool = False) -> None:
        self.live[name] = (int(nbytes), saved)
        saved_b = sum(b for b, s in self.live.values() if s)
        temp_b = sum(b for b, s in self.live.values() if not s)
        if saved_b + temp_b > sum(self.worst[1:]):
            self.worst = (name, saved_b, temp_b)

    def free(self, *names: str) -> None:
        for n in names:
            self.live.pop(n, None)

    def save(self, name: str) -> None:
        """Mark a live temporary as saved for backward."""
        b, _ = self.live[name]
        self.live[name] = (b, True)


@dataclass
class AttnShape:
    """Sizes of one attention call. Bytes per element: mm (matmul outputs), sm (softmax output), x (the
    model's dtype, for the float mask), drop_mask (1 on CUDA, else the dtype dropout gets), to (the dtype
    softmax's output is cast to, `.to(query.dtype)`; 0: mm)."""

    B: int
    heads: int
    S: int
    head_dim: int
    mm: int
    sm: int
    x: int
    drop_mask: int
    kv_repeat: int = 1  # grouped-query attention: heads / kv heads (repeat_kv copies k and v when > 1)
    to: int = 0  # bytes per element after softmax's cast (0: mm); wider than mm: the bmm with v copies it
    # softmax and its cast in one statement (Llama's `softmax(x, dtype=float32).to(query.dtype)`):
    # the masked scores stay bound until the cast returns; GPT-2 rebinds them to softmax's output
    # in its own statement
    one_statement: bool = False

    def sq(self, nbytes: int) -> int:  # one (B, a, S, S) matrix
        return self.B * self.heads * self.S * self.S * nbytes

    def vec(self, nbytes: int) -> int:  # one (B, a, S, head_dim) tensor
        return self.B * self.heads * self.S * self.head_dim * nbytes


@dataclass
class AttnPoints:
    """The two worst moments of one attention call, relative to what was saved before it:
    forward: (saved by attention so far, temporaries); backward: (attention's saved tensors still alive,
    temporaries), each with the op where it happens. `saved` is what attention keeps for backward."""

    forward: tuple[str, int, int]
    backward: tuple[str, int, int]
    saved: int
    kept: int = 0  # matmul outputs before the forward's worst moment (q @ k^T) that selective checkpointing keeps


def materialised(kind: str, a: AttnShape, p: float) -> AttnPoints:
    """Replay one materialised attention call. kind: "manual" (labkit GPT), "eager" (transformers) or
    "math" (SDPA's math fallback). p: dropout probability on the probabilities."""
    if kind not in ("manual", "eager", "math"):
        raise ValueError(f"unknown attention kind {kind!r}")
    f = Ops()  # what was saved before the call (q, k, a repeated k) is the walk's, not counted here
    if kind == "math":  # the causal bias, made per call: ones (bool) -> tril -> where (float)
        f.alloc("ones", a.S * a.S)
        f.alloc("tril", a.S * a.S)
        f.free("ones")
        f.alloc("bias", a.S * a.S * a.mm)
        f.free("tril")
    f.alloc("scores", a.sq(a.mm))  # bmm q @ k^T
    if kind == "math":
        f.alloc("biased", a.sq(a.mm))  # add the bias (q was scaled before the bmm)
        f.free("scores")
        last = "biased"
    else:
        f.alloc("scaled", a.sq(a.mm))  # mul by 1/sqrt(d)
        f.free("scores")
        last = "scaled"
        if kind == "manual":  # mask = ones(S, S).tril(); masked_fill(~mask, -inf) saves ~mask
            f.alloc("ones", a.S * a.S)
            f.alloc("tril", a.S * a.S)
            f.free("ones")
            f.alloc("~mask", a.S * a.S, saved=True)
            f.alloc("masked", a.sq(a.mm))
        else:  # add the model's float mask (made once per forward, outside this region): type promotion
            f.alloc("masked", a.sq(max(a.mm, a.x)))  # makes 16-bit scores + an fp32 mask fp32
        f.free(last)
        last = "masked"
    wide = kind == "eager" and a.sm > max(a.mm, a.x)  # softmax(dtype=float32) of 16-bit scores
    if wide:  # aten's softmax casts its input first (_to_copy, then _softmax)
        f.alloc("scores (fp32 for softmax)", a.sq(a.sm))
    f.alloc("probs", a.sq(a.sm), saved=True)  # softmax
    f.free("scores (fp32 for softmax)")
    if kind != "manual" and not a.one_statement:
        f.free(last)
    attn, to = "probs", a.to or a.mm
    if a.sm != to:  # Llama: softmax in fp32, then .to(q.dtype): the copy is what the matmul reads
        f.alloc("probs cast", a.sq(to), saved=p == 0 and to == a.mm)
        attn = "probs cast"
    if a.one_statement:
        f.free(last)
    if p > 0:
        f.alloc("dropout mask", a.sq(a.drop_mask), saved=True)
        f.alloc("dropped", a.sq(to), saved=to == a.mm)
        if attn == "probs cast":
            f.free("probs cast")
        attn = "dropped"
    if to != a.mm:  # autocast's 16-bit copy for the bmm with v; `attn` stays, returned as the weights
        f.alloc("probs (16-bit copy)", a.sq(a.mm), saved=True)
    f.free(last)  # labkit's `att = attn_drop(softmax(att))` drops the masked scores only when it rebinds att
    f.alloc("v repeated" if a.kv_repeat > 1 else "out", a.vec(a.mm), saved=a.kv_repeat > 1)
    f.free("tril", "bias")
    saved = sum(b for b, s in f.live.values() if s)
    fwd = f.worst

    # backward, from the output back: all of attention's saved tensors are alive at its start
    g = Ops()
    for name, (b, s) in f.live.items():
        if s:
            g.alloc(name, b, saved=True)
    g.alloc("d attn", a.sq(a.mm))  # bmm: dy @ v^T
    g.alloc("dv", a.vec(a.mm))
    g.free("v repeated", "dv")  # the matmul's saved operands go once its backward is done (the probabilities
    if to != a.mm:               # themselves stay: softmax's backward reads them)
        g.free("probs (16-bit copy)")
        g.alloc("d attn (wide)", a.sq(to))  # the autocast copy's backward casts the gradient back
        g.free("d attn")
        grad = "d attn (wide)"
    else:
        if attn != "probs":
            g.free(attn)
        grad = "d attn"
    if p > 0:
        g.alloc("d probs (dropout)", a.sq(to))  # grad * mask * scale
        g.free(grad, "dropout mask")
        grad = "d probs (dropout)"
    if a.sm != to:
        g.alloc("d probs fp32", a.sq(a.sm))  # the cast's backward
        g.free(grad, "probs cast")
        grad = "d probs fp32"
    g.alloc("d scores", a.sq(a.sm))  # _softmax_backward_data
    g.free(grad, "probs")
    grad = "d scores"
    if kind == "manual":
        g.alloc("d masked", a.sq(a.mm))  # masked_fill backward
        g.free(grad, "~mask")
        grad = "d masked"
    if kind != "math":
        g.alloc("d scaled", a.sq(a.mm))  # mul backward
        g.free(grad)
        grad = "d scaled"
    g.alloc("dq", a.vec(a.mm))
    g.alloc("dk", a.vec(a.mm))
    return AttnPoints(fwd, g.worst, saved, a.sq(a.mm))
