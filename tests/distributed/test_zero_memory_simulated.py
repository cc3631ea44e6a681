"""Per-rank estimates against the ledger on rank 0 of a fake process group (every tensor with the shape and
lifetime it has on a real rank), in this process: models whose peak is set by activations, by the blocks'
gradients in flight, and by the root's (a large embedding), at 8 and 64 ranks."""

import pytest

from labkit.distributed.simulate import zero_rank_memory
from labkit.estimate import Recipe, estimate
from labkit.models.gpt import GPTConfig

MODELS = {
    "states": (GPTConfig(vocab_size=1024, block_size=16, n_layer=2, n_head=4, n_embd=256), 1, 8),  # blocks' grads
    "vocab": (GPTConfig(vocab_size=8192, block_size=16, n_layer=2, n_head=2, n_embd=64), 1, 8),  # the root's grads
    "deep": (GPTConfig(vocab_size=256, block_size=64, n_layer=6, n_head=4, n_embd=128), 2, 16),
}
CASES = [("states", 8, 1, False), ("states", 8, 2, False), ("states", 8, 3, False), ("states", 8, 3, True),
         ("vocab", 8, 2, False), ("vocab", 8, 3, False), ("deep", 64, 3, False)]


@pytest.mark.parametrize("name, world, zero, off", CASES)
def test_per_rank_estimate_within_3_percent_on_a_fake_process_group(name, world, zero, off):
    cfg, rows, seq = MODELS[name]
    r = Recipe(cfg, batch=rows * world, seq=seq, dp=world, zero=zero, zero_offload=off)
    m, e = zero_rank_memory(r), estimate(r)
    err = e.peak.total / m.peak.total - 1
    print(f"{name} N={world} ZeRO-{zero}{' offload' if off else ''}: measured {m.peak.total:,} predicted "
          f"{e.peak.total:,} ({err:+.2%}) at {e.peak_moment.where}")
    assert abs(err) <= 0.03, (name, world, zero, off, err)


def test_a_real_process_group_is_refused():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        with pytest.raises(ValueError, match="already"):
            zero_rank_memory(Recipe(MODELS["deep"][0], batch=8, seq=16, dp=8, zero=3))
    finally:
        dist.destroy_process_group()


def test_zero_bad_input_is_one_clear_error():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from labkit.distributed import Zero
    from labkit.models.gpt import GPT

    tiny = GPTConfig(vocab_size=8, block_size=4, n_layer=1, n_head=1, n_embd=2)  # a block of 38 elements
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=64)
    try:
        for stage in (0, 4, True, "3"):
            with pytest.raises(ValueError, match="ZeRO stage 1, 2 or 3"):
                Zero(GPT(tiny), stage)
        with pytest.raises(ValueError, match="fewer than the 64 ranks"):
            Zero(GPT(tiny), 3)
    finally:
        dist.destroy_process_group()


# ---- ZeRO-1 over LoRA (issue 43, item 3): the frozen base whole on every rank, the adapters' states sharded ------
LORA_G = dict(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32)


@pytest.mark.parametrize("checkpoint, world", [("none", 2), ("full", 5)])
def test_zero1_over_lora_per_rank_phase_and_category(checkpoint, world):
    """Zero's units are the adapters (the only parameters with requires_grad): their gradients full until the
    step, their AdamW state in shards; every phase's every category within 0.1 % of the measured peak
    (measured: 0.00-0.01 %)."""
    from labkit.memory import CATEGORIES
    from labkit.run.step import apply_peft

    r = Recipe(GPTConfig(**LORA_G), batch=world, seq=16, dp=world, zero=1, lora_rank=16,
               checkpoint=checkpoint)
    e = estimate(r)
    m = zero_rank_memory(r, prepare=lambda mod: apply_peft(mod, "fp32", 16, "all-linear"))
    for ph in ("forward", "backward", "optimizer"):
        for c in CATEGORIES:
            assert abs(e.phases[ph][c] - m.phases[ph][c]) <= 0.001 * m.peak.total, (ph, c, e.phases[ph][c],
                                                                                   m.phases[ph][c])
    assert e.peak.total < estimate(r.replace(zero=0)).peak.total  # the adapters' state is sharded


@pytest.mark.parametrize("checkpoint, world, quant", [("none", 2, "none"), ("full", 3, "none"),
                                                      ("selective", 2, "nf4")])
def test_zero2_over_lora_reduces_each_block_when_its_last_adapter_gradient_is_made(checkpoint, world, quant):
    """Issue 43 item 3: labkit's Zero reduce-scatters a block's unit (its adapters) from the hook of the unit's
    last gradient, inside the block's backward: the frozen matmuls' input gradients and the block's saved tensors
    still alive (tape: `Worst.last`, MomentKind.GRADIENTS_READY), not at the block's end (which left out 1-2 %
    of the peak). Every phase's every category within 0.1 % of the measured peak. (The ledger tags the unit's
    last gradient a gradient though Zero's hook frees it at once: its own hook runs first, `ledger._run_first`;
    before, it counted that gradient, c_attn's lora_A, as a temporary.)"""
    from labkit.memory import CATEGORIES
    from labkit.memory.report import MomentKind
    from labkit.run.step import apply_peft

    cfg = GPTConfig(**dict(LORA_G, n_embd=64, n_head=4))
    r = Recipe(cfg, batch=world, seq=16, dp=world, zero=2, lora_rank=16, checkpoint=checkpoint, quant=quant)
    e = estimate(r)
    m = zero_rank_memory(r, prepare=lambda mod: apply_peft(mod, "fp32", 16, "all-linear", quant=quant))
    reduces = {x.block for x in e.moments if x.kind is MomentKind.GRADIENT_REDUCE}
    assert reduces >= set(range(cfg.n_layer))  # each block's, inside its backward
    worst = max((x for x in e.moments if x.phase == "backward"), key=lambda x: sum(t.bytes for t in x.terms))
    assert worst.kind is MomentKind.GRADIENT_REDUCE or quant != "none"  # (NF4: dequantizing a weight is more)
    for ph in ("forward", "backward", "optimizer"):
        for c in CATEGORIES:
            assert abs(e.phases[ph][c] - m.phases[ph][c]) <= 0.001 * m.peak.total, (ph, c, e.phases[ph][c],
                                                                                   m.phases[ph][c])
    assert abs(e.peak.total / m.peak.total - 1) <= 0.001


@pytest.mark.parametrize("checkpoint, segments", [("full", 2), ("sqrt", None)])
def test_zero2_with_segments_of_several_blocks(checkpoint, segments):
    """Issue 43 item 3: ZeRO-2 with a checkpointed segment of several blocks reduce-scatters each block's unit
    from its last gradient's hook, while the segment's earlier blocks wait with their recomputed tensors (the
    recompute's replay: `Worst.last`); it was refused, 6 % above the block-end moments. Every phase's every
    category within 0.1 % of the measured peak (measured: 0.01 %; 0.4-0.65 % before the root's reduce lost the
    residual stream's and the dense embedding's gradients, freed by then)."""
    from labkit.memory import CATEGORIES

    cfg = GPTConfig(vocab_size=1024, block_size=32, n_layer=4, n_head=4, n_embd=64)
    r = Recipe(cfg, batch=4, seq=32, dp=4, zero=2, checkpoint=checkpoint, segments=segments)
    e, m = estimate(r), zero_rank_memory(r)
    for ph in ("forward", "backward", "optimizer"):
        for c in CATEGORIES:
            assert abs(e.phases[ph][c] - m.phases[ph][c]) <= 0.001 * m.peak.total, (ph, c, e.phases[ph][c],
                                                                                   m.phases[ph][c])


@pytest.mark.parametrize("zero, checkpoint, lora", [(1, "none", False), (2, "none", False), (2, "full", False),
                                                    (3, "none", False), (3, "full", False), (2, "none", True)])
def test_zero_with_micro_batches(zero, checkpoint, lora):
    """Issue 43 item 3: gradient accumulation under labkit's Zero (it was refused, "not derived"). ZeRO-1 keeps
    the full gradients until the step, as one device's later micro-batches do; ZeRO-2/3 reduce-scatter each
    micro-batch's gradients into the shards and free them, so a later micro-batch makes its gradients afresh
    beside every unit's shard. Each rank measured with its rows in micro-batches (dp_ranks.measure): the total
    within 0.01 %, every phase's every category within 1 % of the peak (measured: 0.62 % at most: at ZeRO-3's
    forward peak of a later micro-batch, one (rows x h) fp32 tensor the estimate counts a temporary and the ledger
    an activation; not yet named, and absent without micro-batches)."""
    from labkit.memory import CATEGORIES
    from labkit.run.step import apply_peft

    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=3, n_head=4, n_embd=64)
    r = Recipe(cfg, batch=8, seq=32, dp=2, zero=zero, micro_batch=2, checkpoint=checkpoint,
               **({"lora_rank": 16} if lora else {}))
    e = estimate(r)
    m = zero_rank_memory(r, prepare=(lambda mod: apply_peft(mod, "fp32", 16, "all-linear")) if lora else None)
    assert {x.micro for x in e.moments} == {1, 2}
    assert abs(e.peak.total / m.peak.total - 1) <= 1e-4, (e.peak.total, m.peak.total)
    for ph in ("forward", "backward", "optimizer"):
        for c in CATEGORIES:
            assert abs(e.phases[ph][c] - m.phases[ph][c]) <= 0.01 * m.peak.total, (ph, c, e.phases[ph][c],
                                                                                  m.phases[ph][c])


@pytest.mark.parametrize("kw", [{}, {"micro_batch": 2}, {"checkpoint": "full"}])
def test_paged_states_on_each_data_parallel_rank(kw):
    """Issue 43 item 6 across devices: with plain data parallelism each rank pages its own optimizer state
    (bitsandbytes' paged optimizers under DDP), so a rank's estimate is one device's of its rows, the state in
    CUDA unified memory (`Estimate.unified`, `Measurement.as_unified`). It was refused ("modelled on one
    device"). The device peak and the unified bytes within 0.01 % of the ledger's (measured: 8 B)."""
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=3, n_head=4, n_embd=64)
    r = Recipe(cfg, batch=8, seq=32, dp=2, paged_states=True, **kw)
    e, m = estimate(r), zero_rank_memory(r)
    assert e.unified == m.unified > 0
    assert abs(e.peak.total / m.peak.total - 1) <= 1e-4
    unpaged = estimate(r.replace(paged_states=False)).peak.total
    assert e.peak.total < unpaged <= e.peak.total + e.unified  # the state left the device's peak

