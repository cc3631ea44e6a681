"""Every estimator term against hand-counted bytes, the known errata, and the ledger."""

import pytest

from labkit.memory import Category, fmt_bytes
from labkit.memory.table import Table
from labkit.estimate import Recipe, estimate
from labkit.run import measure_step
from labkit.estimate.predict import Precision, autocast_copy_bytes, grad_bytes, optimizer_state_bytes, param_bytes
from labkit.estimate.families import WALKS
from labkit.estimate.spec import spec_from
from labkit.estimate.walk import Walk
from labkit.models.gpt import GPTConfig

GPT2 = 124_439_808


def _per_param(dtype, optimizer="adamw"):
    spec = spec_from("gpt2")
    p = Precision.of(dtype)
    total = param_bytes(spec, p) + autocast_copy_bytes(spec, p) + grad_bytes(spec, p)
    counters = 4 * len(spec.param_numels) if optimizer.startswith("adam") else 0  # Adam's step tensors
    total += optimizer_state_bytes(spec, p, optimizer) - counters
    return total / spec.n_params


def test_bytes_per_parameter_16_18_and_8():
    assert spec_from("gpt2").n_params == GPT2
    assert _per_param("fp32") == 16  # 4 weights + 4 grads + 8 Adam
    # mixed precision: fp32 master weights, a 2-byte autocast copy of the matmul weights, fp32 grads
    mixed = _per_param("mixed-bf16")
    spec = spec_from("gpt2")
    assert mixed == pytest.approx(16 + 2 * spec.matmul_params / spec.n_params)
    assert 17.2 < mixed < 18  # the HF docs' "18": wpe, norms and biases... only the embeddings stay fp32
    assert _per_param("bf16") == 8  # 2 + 2 + 4 (Adam's state in bf16, as torch.optim keeps it)
    assert _per_param("fp32", "sgd") == 8 and _per_param("fp32", "sgd-momentum") == 12


def test_mixed_precision_gradients_are_fp32():
    """Playbook discussion #104 / ml-engineering #23: the 4N of fp32 gradients is not optional."""
    e = estimate("gpt2", 1, 128, "mixed-bf16", "adamw")
    assert e.phases["optimizer"][Category.GRAD] == 4 * GPT2


def test_logits_term_is_BSV_in_fp32():
    for dtype in ("fp32", "mixed-bf16", "bf16"):
        e = estimate("gpt2", 2, 512, dtype)
        lsm = next(t for t in e.terms if t.name == "log-softmax of the logits")
        assert lsm.bytes == 2 * 512 * 50257 * 4  # transformers upcasts logits to fp32 for the loss
    e = estimate(GPTConfig(block_size=64), 2, 64, "bf16")
    assert next(t for t in e.terms if t.name.startswith("log-softmax")).bytes == 2 * 64 * 256 * 2


def test_attention_s2_term_only_without_fused_attention():
    def acts(attention, S, device="cuda"):
        cfg = GPTConfig(n_layer=3, n_head=4, n_embd=64, block_size=1024, attention=attention)
        w = Walk(x_bytes=2, device=device)
        WALKS["labkit-gpt"](w, spec_from(cfg), 2, S, [])
        return w.saved_bytes
    extra = {S: acts("manual", S) - acts("sdpa", S) for S in (128, 256)}
    # materialised scores: probs (2 B) per head plus a shared bool mask per layer, ~S^2 each
    per = lambda S: 3 * (2 * 4 * S * S * 2 + S * S)  # noqa: E731
    lse = lambda S: 3 * 2 * 4 * S * 4  # noqa: E731 - the fused kernel's logsumexp, which manual lacks
    for S, d in extra.items():
        assert d == per(S) - lse(S)  # the q, k, v copies cost what the fused kernel keeps of qkv
    assert extra[256] > 3.5 * extra[128]


def test_korthikanti_34_plus_5as_over_h():
    """One 16-bit layer with dropout and materialised attention saves sbh(34 + 5as/h) bytes, plus the
    LayerNorm statistics and causal mask that the paper leaves out."""
    s, b, h, a = 128, 2, 64, 4
    cfg = GPTConfig(n_layer=2, n_head=a, n_embd=h, block_size=s, attention="manual", dropout=0.1)
    w = Walk(x_bytes=2, device="cuda")
    marks = []
    WALKS["labkit-gpt"](w, spec_from(cfg), b, s, marks)
    per_layer = marks[2] - marks[1]
    extras = 2 * (2 * s * b * 4) + s * s  # two LayerNorms' fp32 mean and rstd; the bool mask
    assert per_layer - extras == s * b * h * 34 + 5 * a * s * s * b


def test_peak_is_the_max_over_phases_not_the_sum():
    e = estimate("gpt2-tiny", 4, 64)
    totals = [b.total for b in e.phases.values()]
    assert e.peak.total == max(totals) < sum(totals)


CONFIGS = [
    (GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=128), 4, 128, "fp32", "adamw"),
    (GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=128), 2, 64, "bf16", "sgd"),
    (GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=128, attention="manual", dropout=0.1), 4, 128, "mixed-bf16", "adamw"),
    (GPTConfig(n_layer=3, n_head=2, n_embd=64, block_size=64), 1, 8, "fp32", "sgd-momentum"),  # weights dominate
    ("gpt2-tiny", 4, 64, "mixed-bf16", "adam"),
    ("llama-tiny", 4, 64, "bf16", "adamw"),
    ("llama-tiny", 2, 128, "fp32", "sgd"),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{getattr(c[0], 'n_embd', c[0])}-{c[1]}x{c[2]}-{c[3]}-{c[4]}")
def test_estimate_within_3_percent_of_the_ledger(cfg):
    model, B, S, dtype, opt = cfg
    e = estimate(model, B, S, dtype, opt)
    m = measure_step(Recipe(model, B, S, dtype, opt), steps=2)
    assert abs(e.peak.total - m.peak.total) <= 0.03 * m.peak.total
    for phase in ("forward", "optimizer"):
        assert abs(e.phases[phase].total - m.phases[phase].total) <= 0.03 * m.phases[phase].total


@pytest.mark.parametrize("kwargs, match", [
    (dict(batch=0), "batch"), (dict(seq=-1), "seq"), (dict(dtype="fp8"), "dtype"),
    (dict(optimizer="adagrad"), "optimizer"), (dict(seq=4096), "positions"), (dict(device="tpu"), "device"),
])
def test_bad_input(kwargs, match):
    args = dict(model="gpt2-tiny", batch=2, seq=32) | kwargs
    with pytest.raises(ValueError, match=match):
        estimate(**args)


def test_big_presets_estimate_without_memory():
    e = estimate("llama2-70b", 1, 4096, "mixed-bf16", "adamw")
    assert e.n_params == 68_976_648_192
    assert e.peak.total > 16 * e.n_params  # weights, gradients and Adam alone: over a TB


# ---- moments made of terms ---------------------------------------------------------------------------
MOMENT_CASES = [
    dict(model="gpt2-tiny", batch=2, seq=32, dtype="mixed-bf16", optimizer="adamw"),
    dict(model="llama-tiny", batch=2, seq=32, dtype="bf16", optimizer="adamw8bit", lora_rank=4, quant="nf4"),
    dict(model=GPTConfig(n_layer=4, n_head=2, n_embd=64, block_size=64), batch=4, seq=64, dtype="fp32",
         optimizer="adamw", checkpoint="sqrt", micro_batch=2),
    dict(model=GPTConfig(n_layer=3, n_head=2, n_embd=64, block_size=64), batch=2, seq=64, dtype="mixed-fp16",
         optimizer="lion", step_in_backward=True),
    dict(model=GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64, dropout=0.1, attention="manual"), batch=2,
         seq=64, dtype="fp32", optimizer="sgd", offload_activations=True),
    dict(model="gpt2-tiny", batch=2, seq=32, dtype="fp32", optimizer="galore", rank=8),
]


@pytest.mark.parametrize("case", range(len(MOMENT_CASES)))
def test_every_moment_is_the_sum_of_its_terms_and_the_peak_is_the_largest(case):
    kw = dict(MOMENT_CASES[case])
    e = estimate(kw.pop("model"), kw.pop("batch"), kw.pop("seq"), **kw)
    assert e.moments and {m.phase for m in e.moments} == set(e.phases)
    for m in e.moments:
        assert m.total == sum(t.bytes for t in m.terms)
        assert m.breakdown().total == m.total
        assert all(t.formula for t in m.terms if t.bytes), [t.name for t in m.terms if not t.formula]
    top = e.peak_moment
    assert top.total == e.peak.total == max(m.total for m in e.moments)
    for phase, b in e.phases.items():
        assert b.total == max(m.total for m in e.moments if m.phase == phase)


def test_explain_names_every_term_of_the_peak_and_its_sum():
    e = estimate("gpt2-tiny", 2, 32, "mixed-bf16", "adamw")
    text = e.explain()
    top = e.peak_moment
    assert top.where in text.splitlines()[0]
    cells = {c for b in text.blocks if isinstance(b, Table) for row in b.rows for c in row}
    for t in top.terms:
        if t.bytes:  # in its own cell, and every word of it in the text (a long cell wraps at its words)
            assert t.name in cells and t.formula in cells
            assert all(w in text for w in (t.name + " " + t.formula).split())
    assert text.splitlines()[-1].strip().startswith(fmt_bytes(e.peak.total))
    assert "optimizer step temporaries" in e.explain("optimizer")
    with pytest.raises(ValueError, match="no moment in phase"):
        e.explain("warm-up")


# A small vocabulary and a wide MLP: the peak is inside a block's backward (its MLP's output projection),
# where both the estimate and the ledger must say which bytes are saved activations, which the tied head's
# gradient in flight and which gradients, not only how many there are.
BLOCK_PEAK = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=32)


@pytest.mark.parametrize("dtype", ["fp32", "mixed-bf16", "bf16"])
def test_each_category_agrees_with_the_ledger_at_a_block_backward_peak(dtype):
    """One definition per category for both: ACT is what the forward made and backward still holds (a block's
    saved tensors during its own backward included), PARAM includes autocast's weight copies, GRAD only what
    becomes a .grad (the tied head's partial gradient is a temporary until the embedding's part is summed with
    it). Before this, a block's saved tensors were temporaries and the tied head's part a gradient in the
    estimate: activations 0.53x, temporaries 3.8x, gradients 1.12x the ledger's."""
    e = estimate(BLOCK_PEAK, 4, 32, dtype, device="cpu")
    m = measure_step(Recipe(BLOCK_PEAK, 4, 32, dtype), steps=2)
    assert e.peak_phase == m.peak_phase == "backward" and e.peak_moment.where.startswith("block 1 backward")
    for phase in e.phases:
        for c in Category:
            # the ledger also sees the loss, its seed gradient and the step counter (0-dim, 4 bytes each)
            assert abs(e.phases[phase][c] - m.phases[phase][c]) <= 3 * 4, (phase, c, e.phases[phase][c],
                                                                           m.phases[phase][c])


def test_zero3_rank_categories_agree_with_its_ledger():
    """The per-rank ZeRO-3 estimate (built from the same moments) agrees with rank 0's ledger per category."""
    from labkit.distributed.simulate import zero_rank_memory

    r = Recipe(GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=64), batch=8, seq=32, dp=2,
               zero=3)
    e, m = estimate(r), zero_rank_memory(r)
    for c in Category:
        assert abs(e.peak[c] - m.peak[c]) <= 3 * 4, (c, e.peak[c], m.peak[c])


def test_a_cached_walk_is_shared_read_only():
    """The estimator keeps its last walks and hands the same one to every estimate of that shape (the
    planner asks for one 80-layer walk dozens of times): a change to it would change every later estimate,
    so a finished walk refuses one, and two estimates of one recipe agree term by term."""
    from labkit.estimate.predict import walk_activations
    from labkit.estimate.spec import spec_from
    from labkit.estimate.textbook import Precision

    spec = spec_from("gpt2-tiny")
    w, marks = walk_activations(spec, Precision.of("fp32"), 2, 32, "cpu")
    again, _ = walk_activations(spec, Precision.of("fp32"), 2, 32, "cpu")
    assert again is w
    with pytest.raises(AttributeError, match="read-only"):
        w.trained = 0
    r = Recipe("gpt2-tiny", 2, 32, "fp32", "adamw")
    first, second = estimate(r), estimate(r)
    assert [(t.key, t.bytes) for m in first.moments for t in m.terms] == \
        [(t.key, t.bytes) for m in second.moments for t in m.terms]


def test_one_rows_ids_and_targets_are_views_of_its_sample():
    """measure_step cuts ids and targets from one (B, S + 1) sample: for B > 1 each window's .contiguous()
    copies it, for one row both are contiguous views of the sample itself, (S + 1) x 8 bytes."""
    from labkit.estimate.predict import input_bytes

    assert input_bytes(1, 898) == 899 * 8 and input_bytes(2, 64) == 2 * 2 * 64 * 8
    for B in (1, 2):  # after backward the ids and targets are what is left of the activations (and the loss)
        r = Recipe("gpt2-tiny", B, 40, "fp32", "sgd", device="cpu")
        left = estimate(r).phases["optimizer"][Category.ACT]
        assert abs(left - measure_step(r, steps=2).phases["optimizer"][Category.ACT]) <= 16, B
