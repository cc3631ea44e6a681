"""Transients the replayed ops model, each where it sets the peak, against the ledger.

Each case's missing allocation is one named tensor (or a few of one size); the tolerance is a tenth of it,
so a model without that transient fails, while what no moment models (0-dim scalars such as the loss and its
seed gradient) stays far below it.
"""

from labkit.estimate import Recipe, estimate
from labkit.run import measure_step
from labkit.models.gpt import GPTConfig


def _check(model, B, S, dtype, opt, kw, transient, where):
    e = estimate(model, B, S, dtype, opt, **kw)
    m = measure_step(Recipe.of(model, B, S, dtype=dtype, optimizer=opt, **kw), steps=2)
    top = e.peak_moment
    assert where in top.where, (top.where, e.explain())
    assert sum(t.bytes for t in top.terms) == top.total == e.peak.total
    assert abs(e.peak.total - m.peak.total) <= transient // 10, (e.peak.total, m.peak.total, e.explain())
    # without the moments that hold the transient, the estimate would miss the measured peak by more than that
    rest = max(x.total for x in e.moments if where not in x.where)
    assert m.peak.total - rest > transient // 10, (rest, m.peak.total)
    return e


def test_lora_adapter_input_cast_under_autocast():
    """LoRALinear casts its input to the adapter dtype (fp32 under mixed precision): x.to(lora_A.dtype) is a
    (B S, d_in) fp32 copy alive while the adapter path runs, beside the base output and autocast's 16-bit copy
    of it. Here the MLP's down projection (d_in = 4h) sets the forward peak inside the block."""
    B, S, h = 4, 153, 128
    e = _check(GPTConfig(n_layer=1, n_head=2, n_embd=h, block_size=160), B, S, "mixed-fp16", "adamw",
               dict(lora_rank=8), B * S * 4 * h * 4, "inside block 0's forward")
    assert "lora" in e.peak_moment.where


def test_llama_fp32_softmax_of_16bit_scores():
    """transformers' Llama eager attention: softmax(scores, dtype=float32) of bf16 scores. Backward: the saved
    fp32 probabilities, the fp32 gradient from the .to(bf16) cast's node and _softmax_backward_data's fp32
    result are alive together (the cast back to bf16 comes after, in the input cast's node)."""
    B, S, heads = 2, 256, 4
    kw = dict(num_hidden_layers=1, hidden_size=64, num_attention_heads=heads, num_key_value_heads=heads,
              intermediate_size=128, vocab_size=256, max_position_embeddings=512, attn_implementation="eager")
    _check("llama-tiny", B, S, "bf16", "sgd", kw, B * heads * S * S * 4, "softmax")


def test_final_rms_norm_backward():
    """Between the head's backward and the last block's: Llama's final RMSNorm in Python ops, in fp16. pow's
    backward makes x^1 and 2x (fp32) beside the mean's gradient and the x * rsqrt part waiting to be summed:
    five (B S, h) fp32 tensors, with every block's activations still held (a second micro-batch: all
    gradients exist)."""
    B, S, h = 4, 64, 256
    kw = dict(num_hidden_layers=1, hidden_size=h, num_attention_heads=4, num_key_value_heads=4, intermediate_size=h,
              vocab_size=256, micro_batch=2)
    _check("llama-tiny", B, S, "fp16", "sgd", kw, (B // 2) * S * h * 4, "the final norm's backward")


def test_later_micro_batch_new_weight_gradient():
    """From the second micro-batch on, a weight's new gradient exists until AccumulateGrad sums it into .grad:
    under autocast the 16-bit dW and its fp32 cast (the MLP output projection's, h x 4h x 4 bytes) sit beside
    the block's saved tensors."""
    B, S, h = 5, 3, 64
    g, kw, transient = GPTConfig(n_layer=1, n_head=8, n_embd=h, block_size=64, dropout=0.1), dict(micro_batch=1), h * 4 * h * 4
    e = estimate(g, B, S, "mixed-bf16", "sgd", **kw)
    m = measure_step(Recipe.of(g, B, S, dtype="mixed-bf16", optimizer="sgd", **kw), steps=2)
    at = next(x for x in e.moments if "c_proj weight (16-bit copy): cast back" in x.where and "micro-batch 2" in x.where)
    new = [t for t in at.terms if "before it is summed into .grad" in t.name]
    assert [t.bytes for t in new] == [transient]
    assert sum(t.bytes for t in at.terms) == at.total
    # the measured backward peak is this moment (the tied head's backward, its 16-bit and fp32 dW, comes close)
    assert abs(at.total - m.phases["backward"].total) <= transient // 10, (at.total, m.phases["backward"].total)


def test_later_micro_batch_new_head_gradient():
    """The head's backward in a later micro-batch: the output matrix's new gradient (V x h, bf16) before it is
    summed into .grad, beside dlogits and dX."""
    B, S, h, V = 3, 3, 32, 256
    kw = dict(num_hidden_layers=2, hidden_size=h, num_attention_heads=1, num_key_value_heads=1,
              intermediate_size=128, vocab_size=V, micro_batch=1)
    _check("llama-tiny", B, S, "bf16", "sgd", kw, V * h * 2, "the head's backward (micro-batch 2 on)")


def test_head_weight_gradient_cast_after_its_matmul():
    """Under autocast the head's matmul makes a 16-bit dW; its fp32 gradient comes from the weight copy's own
    node, after the matmul's node has returned and freed the 16-bit weight copy it saved. In a later
    micro-batch (LISA: the tied head trains) that cast is the step's peak, without the copy (V x h x 2)."""
    V, h = 256, 32
    g, kw, copy = GPTConfig(n_layer=2, n_head=1, n_embd=h, block_size=512, vocab_size=V), dict(micro_batch=1, lisa_layers=1), V * h * 2
    e = estimate(g, 3, 2, "mixed-fp16", "adafactor", **kw)
    m = measure_step(Recipe.of(g, 3, 2, dtype="mixed-fp16", optimizer="adafactor", **kw), steps=2)
    top = e.peak_moment
    assert "the head's weight gradient cast to fp32" in top.where, (top.where, e.explain())
    freed = [t for t in top.terms if t.name.startswith("freed: the head's 16-bit weight copy")]
    assert [t.bytes for t in freed] == [-copy] and sum(t.bytes for t in top.terms) == top.total
    assert abs(e.peak.total - m.peak.total) <= copy // 10, (e.peak.total, m.peak.total, e.explain())
    assert e.peak.total + copy - m.peak.total > copy // 10  # with the copy still counted it would be over
