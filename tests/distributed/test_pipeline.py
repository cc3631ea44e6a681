"""Pipeline parallelism on 2 gloo ranks: GPipe and 1F1B against one process and torch.distributed.pipelining,
activations in flight per stage against the schedule, the bubble against (p - 1) / (m + p - 1), the per-rank
estimate against the ledger, and clear errors."""

from fractions import Fraction

import pytest
import torch

from labkit.distributed import RankFailed, launch
from labkit.distributed import layout_ranks as lr
from labkit.distributed import pipeline as pl
from labkit.estimate import Recipe, estimate_ranks
from labkit.estimate.layout_terms import in_flight
from labkit.memory import CATEGORIES
from labkit.models.gpt import GPTConfig

CFG = dict(vocab_size=64, block_size=32, n_layer=4, n_head=4, n_embd=64)
# fp32 gradients of a loss of order 1: the two sides add the same terms in a different order over
# micro-batches and stages; 1e-6 is ~8 ulps at 1 (eps 1.19e-7), the bound the issue states.
TOL = 1e-6
# dropout off: the two sides would draw different masks
GPT2_NO_DROPOUT = {"n_layer": 2, "embd_pdrop": 0.0, "resid_pdrop": 0.0, "attn_pdrop": 0.0}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_split_and_errors():
    assert pl.split_layers(5, 2) == [(0, 3), (3, 5)]
    assert pl.split_layers(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError, match="5 stages for a model of 4 layers"):
        pl.split_layers(4, 5)
    with pytest.raises(ValueError, match="micro-batches must be an integer >= 1"):
        pl.schedule("gpipe", 0, 2, 0)
    with pytest.raises(ValueError, match="schedule must be one of"):
        pl.schedule("zigzag", 4, 2, 0)
    with pytest.raises(ValueError, match="stages for a model of 4 layers"):
        estimate_ranks(Recipe(GPTConfig(**CFG), 8, 32, pp=8))


@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (3, 2), (4, 8)])
def test_schedules_in_flight_and_bubble(p, m):
    for s in range(p):
        g, f = pl.schedule("gpipe", m, p, s), pl.schedule("1f1b", m, p, s)
        for acts in (g, f):  # every micro-batch forward once and backward once, forward first
            assert sorted(acts) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
            assert all(acts.index(("F", i)) < acts.index(("B", i)) for i in range(m))
        assert pl.max_in_flight(g) == m == in_flight("gpipe", m, p, s)
        assert pl.max_in_flight(f) == min(p - s, m) == in_flight("1f1b", m, p, s)
    for name in ("gpipe", "1f1b"):
        timeline = pl.simulate(name, m, p, t_f=1, t_b=2)  # integer times: the fraction is exact
        assert Fraction(pl.measured_bubble(timeline)).limit_denominator(1000) == pl.bubble_fraction(p, m)


@pytest.fixture(scope="module")
def parity():
    """labkit's GPT and transformers' GPT-2, both schedules, ours and torch's: one launch."""
    out = launch(lr.many, 2, args=([("pipeline_parity", (lr.Workload(CFG, 8, 32), 4)),
                                    ("pipeline_parity", (lr.Workload(GPT2_NO_DROPOUT, 4, 16, "gpt2"), 2)),
                                    ("pipeline_memories", (lr.Workload(GPT2_NO_DROPOUT, 8, 32, "gpt2"), 4))],),
                 timeout_s=240)
    return [r[0] for r in out], [r[1] for r in out], [r[2] for r in out]


def test_pipeline_parity_labkit_gpt(parity):
    for rank, res in enumerate(parity[0]):
        for name in ("gpipe", "1f1b"):
            r = res[name]
            assert _max_diff(r["grads"], res["reference"]) < TOL
            assert _max_diff(r["torch"], res["reference"]) < TOL
            assert _max_diff(r["grads"], r["torch"]) < TOL
            assert r["in_flight"] == in_flight(name, 4, 2, rank)
            if rank == 1:
                assert abs(r["loss"] - res["reference_loss"]) < TOL
                assert abs(r["torch_loss"] - res["reference_loss"]) < TOL
            # each micro-batch's activation (2 x 32 x 64 fp32) crosses the boundary once each way
            assert r["wire"] == 4 * 2 * 32 * 64 * 4


def test_pipeline_parity_transformers_gpt2(parity):
    for res in parity[1]:
        for name in ("gpipe", "1f1b"):
            assert _max_diff(res[name]["grads"], res["reference"]) < TOL
            assert _max_diff(res[name]["torch"], res["reference"]) < TOL


def test_pipeline_estimate_transformers_gpt2(parity):
    for name in ("gpipe", "1f1b"):
        est = estimate_ranks("gpt2-tiny", 8, 32, pp=2, micro_batch=2, schedule=name, **GPT2_NO_DROPOUT)
        for s, (e, res) in enumerate(zip(est, (o[name] for o in parity[2]))):
            assert res["in_flight"] == in_flight(name, 4, 2, s)
            assert abs(e.peak.total / res["peak"]["total"] - 1) < 0.03


def test_pipeline_memory_per_stage_and_estimate():
    m, batch, seq = 4, 8, 32
    out = launch(lr.pipeline_memories, 2, args=(lr.Workload(CFG, batch, seq), m), timeout_s=120)
    for name in ("gpipe", "1f1b"):
        est = estimate_ranks(Recipe(GPTConfig(**CFG), batch, seq, pp=2, micro_batch=batch // m, schedule=name))
        for s, (e, res) in enumerate(zip(est, (o[name] for o in out))):
            k = in_flight(name, m, 2, s)
            assert res["in_flight"] == k
            a_s = next(t.bytes for t in e.terms if t.name.startswith("activations of one micro-batch"))
            ids = batch * seq * 8  # the token ids (stage 0) or the targets (stage 1), int64
            if s == 0:  # exactly k micro-batches' activations and the token ids
                assert res["act_peak"] == k * a_s + ids
            else:  # and a few 0-dim fp32 tensors per micro-batch: its loss (kept for the step's mean) and
                # nll_loss's saved total_weight
                assert 0 <= res["act_peak"] - (k * a_s + ids) <= 3 * 4 * m
            assert abs(e.peak.total / res["peak"]["total"] - 1) < 0.03
    assert out[0]["gpipe"]["act_peak"] > out[0]["1f1b"]["act_peak"]  # 4 micro-batches held vs 2


MANUAL = dict(CFG, block_size=256, n_embd=32, attention="manual")  # (S, S) scores set each stage's peak
CKPT_CFGS = {"sdpa": dict(CFG, block_size=64),
             "manual-dropout": dict(CFG, block_size=128, n_embd=32, attention="manual", dropout=0.1)}
LORA = dict(CFG, block_size=64, dropout=0.1)


@pytest.fixture(scope="module")
def stages():
    """Every stage's measured memory in one launch (start-up is the slow part): manual attention, checkpointed
    blocks on two models, LoRA without and with checkpointing, the optimizer offloaded; 8 rows in 4
    micro-batches, both schedules."""
    import functools

    from labkit.run.step import apply_peft

    lora = functools.partial(apply_peft, dtype="fp32", lora_rank=8)
    both = ("gpipe", "1f1b")
    calls = {"manual": (lr.Workload(MANUAL, 8, 256), 4, both),
             **{f"ckpt {k}": (lr.Workload(c, 8, c["block_size"]), 4, both, True) for k, c in CKPT_CFGS.items()},
             "lora": (lr.Workload(LORA, 8, 64), 4, both, False, lora),
             "lora ckpt": (lr.Workload(LORA, 8, 64), 4, both, True, lora),
             "offload": (lr.Workload(LORA, 8, 64), 4, both, False, None, "cpu"),
             "lora ckpt offload": (lr.Workload(LORA, 8, 64), 4, ("1f1b",), True, lora, "cpu"),
             "act offload": (lr.Workload(dict(LORA, dropout=0.0), 8, 64), 4, both, False, None, None, True)}
    out = launch(lr.many, 2, args=([("pipeline_memories", a) for a in calls.values()],), timeout_s=400)
    return {k: [rank[n] for rank in out] for n, k in enumerate(calls)}


def _each_category_within(est, measured, name: str, tol: float) -> None:
    for e, res in zip(est, (o[name] for o in measured)):
        peak = res["peak"]
        for cat in CATEGORIES:  # each category within tol of the measured peak
            assert abs(e.peak[cat] - peak[cat.name.lower()]) < tol * peak["total"], (name, e.label, cat)


def test_pipeline_estimate_materialised_attention(stages):
    """A stage's blocks take their moments from the replays of their ops, as on one device: with labkit's
    manual attention the (S, S) scores' backward sets each stage's peak. Without the replays (the blocks'
    per-block bytes alone) stage 1 of 1F1B was 29 % under the ledger here; stage 0 was 0.38 % under until the
    gradient it receives was held through its whole backward (the pipeline keeps it in a local until
    torch.autograd.backward returns). Every category within 0.1 % of the measured peak."""
    for name in ("gpipe", "1f1b"):
        est = estimate_ranks(Recipe(GPTConfig(**MANUAL), 8, 256, pp=2, micro_batch=2, schedule=name))
        assert [e.peak_phase for e in est] == [o[name]["peak_phase"] for o in stages["manual"]] == ["backward"] * 2
        _each_category_within(est, stages["manual"], name, 0.001)


@pytest.mark.parametrize("which", list(CKPT_CFGS))
def test_pipeline_estimate_with_checkpointed_blocks(stages, which):
    """Each stage checkpoints its blocks (Stage(checkpoint=True)): a micro-batch in flight holds its blocks'
    inputs only, and each block's backward runs its recompute's replay. Every category of each stage's
    peak within 0.1 % of the ledger's, both schedules (was refused: "per-rank estimates of a tp/pp layout
    take plain training")."""
    cfg = CKPT_CFGS[which]
    seq = cfg["block_size"]
    for name in ("gpipe", "1f1b"):
        est = estimate_ranks(Recipe(GPTConfig(**cfg), 8, seq, pp=2, micro_batch=2, schedule=name, checkpoint="full"))
        plain = estimate_ranks(Recipe(GPTConfig(**cfg), 8, seq, pp=2, micro_batch=2, schedule=name))
        assert all(e.peak.total < p.peak.total for e, p in zip(est, plain))  # the option visibly changes it
        _each_category_within(est, stages[f"ckpt {which}"], name, 0.001)
    with pytest.raises(ValueError, match="each checkpointing its own blocks by the policy"):
        estimate_ranks(Recipe(GPTConfig(**cfg), 8, seq, pp=2, micro_batch=2, checkpoint="full", segments=2))


@pytest.mark.parametrize("ck", [False, True], ids=["none", "full"])
def test_pipeline_estimate_with_lora(stages, ck):
    """LoRA on every block's Linears, the base frozen (the stage cut from the adapted model): each stage holds
    its part of the base, its adapters' gradients and AdamW state; a later stage's first block saves its
    received input, which requires grad. A later stage also holds the earlier micro-batch's input gradient
    while its send is in flight. Every category of each stage's peak within 0.1 % of the ledger's, both
    schedules (LoRA in a pipeline was refused)."""
    for name in ("gpipe", "1f1b"):
        est = estimate_ranks(Recipe(GPTConfig(**LORA), 8, 64, pp=2, micro_batch=2, schedule=name, lora_rank=8,
                                    checkpoint="full" if ck else "none"))
        _each_category_within(est, stages["lora ckpt" if ck else "lora"], name, 0.001)
    with pytest.raises(ValueError, match="without ZeRO"):  # QLoRA on stages: test_layout_combinations.py
        estimate_ranks(Recipe(GPTConfig(**LORA), 8, 64, pp=2, micro_batch=2, lora_rank=8, dp=2, zero=1))


def test_failing_stage_ends_the_run():
    with pytest.raises(RankFailed, match="stage 1 failed on purpose") as info:
        launch(lr.pipeline_memory, 2, args=(lr.Workload(CFG, 8, 32), 4, "1f1b", 1, 1), timeout_s=30)
    assert info.value.rank == 1


@pytest.mark.parametrize("which, kw", [("offload", {}), ("lora ckpt offload", {"lora_rank": 8, "checkpoint": "full"})])
def test_pipeline_estimate_with_the_optimizer_offloaded(stages, which, kw):
    """Issue 43 item 3: each stage's OffloadAdamW keeps its state and its step's work in host memory (it was
    refused: "no activation or optimizer offload"). Every category of each stage within 0.1 % of the ledger
    (measured: 0.001 %), full training and checkpointed LoRA; each later micro-batch's moments keyed apart."""
    for name in stages[which][0]:
        est = estimate_ranks(Recipe(GPTConfig(**LORA), 8, 64, pp=2, micro_batch=2, schedule=name,
                                    optimizer_offload="cpu", **kw))
        assert all(e.peak.total < x.peak.total for e, x in zip(est, estimate_ranks(
            Recipe(GPTConfig(**LORA), 8, 64, pp=2, micro_batch=2, schedule=name, **kw))))
        assert all(e.moment(x.key) is x for e in est for x in e.moments)  # one moment per key
        _each_category_within(est, stages[which], name, 0.001)


def test_pipeline_estimate_with_activations_offloaded(stages):
    """Issue 43 item 3: each stage's saved tensors go to the host (labkit.recompute.offload_activations around the
    stage's step; it was refused). The pipeline still holds each in-flight micro-batch's received input and its
    output on the device (without them the estimate was 1.5-4.4 % under the ledger here); every category of each
    stage within 0.1 % of the ledger (measured: 20 B), both schedules. With dropout it is refused, quoting what
    was measured (5 % off per category, not yet explained)."""
    cfg = dict(LORA, dropout=0.0)
    for name in ("gpipe", "1f1b"):
        est = estimate_ranks(Recipe(GPTConfig(**cfg), 8, 64, pp=2, micro_batch=2, schedule=name,
                                    offload_activations=True))
        plain = estimate_ranks(Recipe(GPTConfig(**cfg), 8, 64, pp=2, micro_batch=2, schedule=name))
        assert all(e.peak.total < x.peak.total for e, x in zip(est, plain))
        _each_category_within(est, stages["act offload"], name, 0.001)
    with pytest.raises(ValueError, match="with dropout: measured 5 % off"):
        estimate_ranks(Recipe(GPTConfig(**LORA), 8, 64, pp=2, micro_batch=2, offload_activations=True))

