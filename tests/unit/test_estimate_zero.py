"""Per-rank estimates for data parallelism and ZeRO: the paper's table, the byte rules, bad input."""

import math

import pytest

from labkit.estimate import Recipe, estimate
from labkit.estimate import zero_terms
from labkit.models.gpt import GPTConfig

CFG = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)


def test_zero_paper_figure_1_per_gpu():
    # 7.5B parameters, 64 GPUs, mixed-precision Adam: 2 B fp16 weights + 2 B fp16 gradients + K = 12 B of fp32
    # master weights, momentum and variance per parameter (Rajbhandari et al. 2020, Figure 1); GB = 1e9 bytes
    got = [zero_terms.paper_bytes(7.5e9, 64, s) / 1e9 for s in (0, 1, 2, 3)]
    assert got[0] == 120.0  # nothing sharded: (2 + 2 + K) Psi
    assert round(got[1], 1) == 31.4  # P_os: the K Psi of optimizer state / N
    assert round(got[2], 1) == 16.6  # P_os+g: the fp16 gradients / N too
    assert round(got[3], 1) == 1.9 and got[3] == 1.875  # P_os+g+p: every state / N


def test_labkit_layout_follows_the_paper_rules_in_fp32():
    # fp32 AdamW: 4 B weights, 4 B gradients, 8 B state (K = 8 over 4 + 4): the same shape, plus padding of at
    # most N - 1 elements per unit and a 4-byte step per unit shard
    from labkit.estimate.spec import spec_from

    spec = spec_from(CFG)
    n, units = spec.n_params, spec.n_layer + 1
    for world in (2, 4, 64):
        for stage in (1, 2, 3):
            lay = zero_terms.rank_layout(spec, 4, stage, world)
            states = lay.params() + (lay.grads_full() if stage == 1 else lay.grads_shard()) + lay.opt()
            rule = {1: 8 * n + 8 * n / world, 2: 4 * n + 12 * n / world, 3: 16 * n / world}[stage]
            assert 0 <= states - rule - 4 * units <= 16 * units * world, (world, stage)


@pytest.mark.parametrize("world", [2, 4])
def test_per_rank_estimate_shrinks_by_the_stage_rules(world):
    from labkit.estimate.spec import spec_from

    e = {z: estimate(Recipe(CFG, batch=4 * world, seq=64, dp=world, zero=z)) for z in (0, 1, 2, 3)}
    single = estimate(CFG, 4, 64)
    assert e[0].peak.total == single.peak.total  # plain DP: one rank is one device on batch / dp rows
    spec = spec_from(CFG)
    n, tensors, units = spec.n_params, len(spec.param_shapes), spec.n_layer + 1
    lay = zero_terms.rank_layout(spec, 4, 1, world)
    opt = [e[z].phases["optimizer"] for z in (0, 1, 2, 3)]
    # m and v: 8 B per element, on 1/N of the (padded) elements; Adam's 4-byte step: per tensor, then per unit shard
    assert opt[0]["optimizer state"] == 8 * n + 4 * tensors
    assert opt[1]["optimizer state"] == opt[3]["optimizer state"] == 8 * lay.shard + 4 * units
    assert opt[1]["gradients"] == opt[2]["gradients"] == 4 * lay.shard  # reduce-scattered before the step
    assert opt[1]["parameters"] == 4 * world * lay.shard and opt[3]["parameters"] == 4 * lay.shard
    assert "per rank" in e[3].label


@pytest.mark.parametrize("kw, msg", [
    (dict(dp=0), "dp must be a positive integer"),
    (dict(dp=2, zero=4), "ZeRO stage"),
    (dict(dp=3), "divide evenly over dp=3"),
    (dict(dp=2, zero=2, optimizer="adafactor"), "optimizer 'adafactor' under ZeRO: Adafactor factors each"),
    (dict(dp=2, zero=3, checkpoint="sqrt"), "ZeRO-3 with checkpointed segments of several blocks: ZeRO-3 gathers"),
    (dict(dp=2, zero=3, checkpoint="full", segments=1), "before the others are gathered"),
    (dict(dp=2, zero=3, lora_rank=4, quant="nf4"), "keeps its codes in buffers, which fully_shard does not"),
    (dict(dp=2, zero=3, lisa_layers=1), "LISA switches which layers train"),
    (dict(dp=2, zero=3, lora_rank=4, micro_batch=1), "micro_batch under FSDP2"),
    (dict(dp=2, zero=3, lora_rank=4, optimizer="adamw8bit"), "not per dim-0 shard"),
    (dict(dp=2, zero=1, optimizer_offload="cpu"), "give zero_offload=True"),
    (dict(dp=2, zero=1, zero_offload=True, optimizer="adam"), "OffloadAdamW"),
])
def test_bad_input_is_one_clear_error(kw, msg):
    with pytest.raises(ValueError, match=msg):
        estimate(Recipe.of(CFG, 4, 64, **kw))


def test_more_ranks_than_elements_to_shard():
    tiny = GPTConfig(vocab_size=8, block_size=4, n_layer=1, n_head=1, n_embd=2)
    with pytest.raises(ValueError, match="fewer than the 4096 ranks"):
        estimate(Recipe(tiny, batch=4096, seq=4, dp=4096, zero=3))
    with pytest.raises(ValueError, match="integer >= 1"):
        zero_terms.paper_bytes(1e9, 0, 1)
    with pytest.raises(ValueError, match="ZeRO stage"):
        zero_terms.paper_bytes(1e9, 8, 4)


@pytest.mark.parametrize("argv, words", [
    (["--dp", "0"], "--dp must be a positive integer"),
    (["--dp", "2", "--zero", "4"], "--zero must be a ZeRO stage"),
    (["--dp", "3", "--batch", "4"], "must divide evenly over --dp 3"),
    (["--zero-offload"], "give --zero 1, 2 or 3"),
    (["--dp", "2", "--zero", "2", "--optimizer", "adafactor"], "optimizer 'adafactor' under ZeRO"),
])
def test_cli_bad_input(capsys, argv, words):
    from labkit.cli import main

    assert main(["estimate", "--model", "gpt2-tiny", "--batch", "4", "--seq", "32", *argv]) == 2
    out = capsys.readouterr()
    assert out.out == "" and words in out.err and len(out.err.strip().splitlines()) == 1


def test_cli_per_rank_json(capsys):
    import json

    from labkit.cli import main

    assert main(["estimate", "--model", "gpt2-tiny", "--batch", "4", "--seq", "32", "--dp", "2", "--zero", "3",
                 "--json"]) == 0
    text = capsys.readouterr().out
    d = json.loads(text)
    e = estimate(Recipe("gpt2-tiny", 4, 32, dtype=d["dtype"], device=d["device"], dp=2, zero=3))
    single = estimate(Recipe("gpt2-tiny", 2, 32, dtype=d["dtype"], device=d["device"]))
    assert str(e.peak.total) in text and str(single.peak.total) not in text


def test_engine_zero3_keeps_zero_offload():
    """ZeRO-3 under the engines' mixed precision runs on FSDP2's units; zero_offload still moves the
    optimizer state and its step to the host (DeepSpeed's offload_optimizer), not dropped."""
    from labkit.memory.report import TermKey

    r = Recipe("gpt2-tiny", 8, 32, dtype="mixed-bf16", dp=2, zero=3)
    on, off = estimate(r.replace(zero_offload=True)), estimate(r)
    state = [t.bytes for m in on.moments for t in m.terms if t.key is TermKey.OPTIMIZER_STATE]
    assert state and not any(state) and "offload" in on.label
    assert on.peak.total < off.peak.total
