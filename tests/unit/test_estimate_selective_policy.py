"""Selective checkpointing's "attention-core" policy (Korthikanti et al. 2022): the estimate against the ledger.

The runtime (labkit.recompute.selective) keeps the linear layers' outputs, LayerNorm's (output, mean, rstd) and
the MLP's GELU/SiLU output, and recomputes the attention core; the estimator marks each kept output with the
kind of op that made it and holds the kinds the policy keeps (labkit.estimate.tape.keep_kinds)."""

import pytest

from labkit.estimate import Recipe, estimate
from labkit.estimate.tape import KEEP_KINDS, Tape, keep_kinds
from labkit.models.gpt import GPTConfig
from labkit.run import measure_step

from estimate_checks import TOL, assert_categories_within, assert_phases_within


def _gpt(attention, dropout=0.0):
    return GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=128, vocab_size=64, attention=attention, attn_block=64,
                     dropout=dropout)


CASES = [(_gpt(a), 2, 128, dtype, opt) for a in ("sdpa", "manual", "tiled")
         for dtype, opt in (("fp32", "sgd"), ("mixed-bf16", "adamw"))]
# dropout: random ops are recomputed, never kept (and SDPA with dropout on CPU is its math fallback: bmm's)
CASES += [(_gpt("sdpa", 0.1), 2, 128, "fp32", "sgd")]
CASES += [("gpt2-tiny", 2, 64, "mixed-bf16", "adamw"), ("llama-tiny", 2, 64, "fp32", "sgd"),
          ("gpt2-tiny", 2, 64, "fp32", "sgd"), ("llama-tiny", 2, 64, "mixed-bf16", "adamw")]


def _id(c):
    return f"{getattr(c[0], 'attention', c[0])}-{c[3]}" + (f"-dropout{c[0].dropout}" if getattr(c[0], "dropout", 0) else "")


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_attention_core_within_3_percent_of_the_ledger(case):
    model, B, S, dtype, opt = case
    kw = dict(checkpoint="selective", selective_policy="attention-core")
    e = estimate(model, B, S, dtype, opt, **kw)
    m = measure_step(Recipe.of(model, B, S, dtype=dtype, optimizer=opt, **kw), steps=2)
    assert_phases_within(e, m)
    assert_categories_within(e, m)  # the cached outputs are activations, the recomputed core temporaries
    assert "selective_policy=attention-core" in e.label


def test_the_policy_changes_the_estimate_as_it_changes_the_step():
    """The comparison above can fail: the "matmuls" estimate misses attention-core's measured peak by more than
    the tolerance (SDPA: attention-core keeps the two LayerNorms' outputs and GELU's, 6h per row, instead of
    SDPA's output, h; manual: it no longer keeps the (s, s) scores of q @ k^T)."""
    for attention in ("sdpa", "manual"):
        cfg = _gpt(attention)
        r = Recipe(cfg, 2, 128, "fp32", "sgd", checkpoint="selective", selective_policy="attention-core")
        m = measure_step(r, steps=2)
        wrong = estimate(cfg, 2, 128, "fp32", "sgd", checkpoint="selective")
        assert abs(wrong.peak.total - m.peak.total) > TOL * m.peak.total, (attention, wrong.peak.total, m.peak.total)


def test_matmuls_is_the_default_and_unchanged():
    cfg = _gpt("manual")
    for dtype in ("fp32", "mixed-bf16"):
        a = estimate(cfg, 2, 128, dtype, "sgd", checkpoint="selective")
        b = estimate(cfg, 2, 128, dtype, "sgd", checkpoint="selective", selective_policy="matmuls")
        assert [(t.name, t.bytes) for t in a.terms] == [(t.name, t.bytes) for t in b.terms]
        assert a.peak.total == b.peak.total and a.label == b.label
    assert Recipe(cfg, 2, 128).selective_policy == "matmuls"


def test_kinds_follow_the_runtime_policies():
    """Derived from labkit.recompute.selective.POLICIES: the tape's default is what "matmuls" keeps."""
    assert keep_kinds("matmuls") == Tape().kinds == {"linear", "attention"}
    assert keep_kinds("attention-core") == {"linear", "norm", "activation"}
    with pytest.raises(ValueError, match="kind"):
        Tape().keep(object(), "softmax")
    assert set(KEEP_KINDS) == {"linear", "attention", "norm", "activation"}


def test_bad_selective_policy_is_refused():
    with pytest.raises(ValueError, match="selective_policy must be one of matmuls, attention-core"):
        Recipe(_gpt("sdpa"), 2, 128, checkpoint="selective", selective_policy="everything")
    with pytest.raises(ValueError, match="give checkpoint='selective' too"):
        Recipe(_gpt("sdpa"), 2, 128, checkpoint="full", selective_policy="attention-core")
    with pytest.raises(ValueError, match="give checkpoint='selective' too"):
        estimate(_gpt("sdpa"), 2, 128, selective_policy="attention-core")


@pytest.mark.parametrize("attention", ["sdpa", "manual", "tiled"])
@pytest.mark.parametrize("dtype", ["fp32", "mixed-bf16"])
@pytest.mark.parametrize("policy", ["matmuls", "attention-core"])
def test_kept_bytes_are_what_the_runtime_caches(attention, dtype, policy):
    """Exactly: the bytes one block's replay holds for selective checkpointing are the storages labkit's
    KeepOutputs caches running that block (LayerNorm's mean and rstd included: too small for the 3 % above)."""
    import torch

    from labkit.estimate.predict import step_bytes
    from labkit.estimate.spec import spec_from
    from labkit.recompute.selective import selective_contexts
    from labkit.run.step import build_model

    cfg, B, S = _gpt(attention), 2, 128
    b, _ = step_bytes(spec_from(cfg), Recipe(cfg, B, S, dtype, "sgd", foreach=False, checkpoint="selective",
                                             selective_policy=policy))
    model = build_model(cfg, dtype)
    keep, _ = selective_contexts(policy)
    x = torch.randn(B, S, cfg.n_embd, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16, enabled=dtype.startswith("mixed")), keep:
        model.blocks[0](x)
    storages = {t.tensor.untyped_storage().data_ptr(): t.tensor.untyped_storage().nbytes()
                for entries in keep.cache.values() for e in entries
                for t in (e if isinstance(e, (tuple, list)) else (e,))}
    assert b.replays[0].kept_bytes == sum(storages.values()) > 0
