"""Recipe: one step's setup checked once, taken alike by the estimator and the runner."""

import dataclasses

import pytest
import torch

from labkit.estimate import Recipe, estimate
from labkit.models.gpt import GPTConfig
from labkit.run import measure_step

G = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32)

BAD = [
    (dict(dp=0), "dp must be a positive integer"),
    (dict(tp=1.5), "tp must be a positive integer"),
    (dict(pp=-2), "pp must be a positive integer"),
    (dict(batch=3, dp=2), r"global batch: it must divide evenly over dp=2"),
    (dict(batch=4, dp=2, micro_batch=4), r"dividing each rank's batch \(2 = 4 / dp 2\)"),
    (dict(dp=2, batch=4, zero=4), "zero must be a ZeRO stage 0, 1, 2 or 3"),
    (dict(zero=True), "zero must be a ZeRO stage"),
    (dict(zero_offload=True), "give zero=1, 2 or 3 too"),
    (dict(zero=3), "dp=1 has one"),  # ZeRO over one rank shards nothing (it lowered the peak: issue 43)
    (dict(schedule="gpipe"), "needs pp > 1"),  # was ignored without a pipeline
    (dict(pp=2, schedule="interleaved"), "schedule must be one of gpipe, 1f1b"),
    (dict(sequence_parallel=True), "give tp > 1 too"),
    (dict(tp=2, sequence_parallel="yes"), "sequence_parallel must be True or False"),
    (dict(batch=0), "batch must be a positive integer"),
    (dict(batch=True), "batch must be a positive integer"),
    (dict(seq=2.0), "seq must be a positive integer"),
    (dict(dtype="fp8"), "unknown dtype"),
    (dict(optimizer="adagrad"), "unknown optimizer"),
    (dict(device="tpu"), "device must be"),
    (dict(checkpoint="some"), "checkpoint must be one of"),
    (dict(segments=2), "give checkpoint='full' too"),
    (dict(checkpoint="full", segments=0), "segments must be a positive integer"),
    (dict(batch=4, micro_batch=3), "micro_batch must be a positive integer dividing batch"),
    (dict(optimizer="galore"), "rank"),
    (dict(optimizer="galore", rank=-1), "rank"),
    (dict(rank=4), "GaLore's projection rank"),
    (dict(proj_dtype="int8"), "8-bit GaLore's projector precision"),
    (dict(optimizer="galore", rank=4, proj_dtype="fp32"), "give optimizer='galore8bit'"),
    (dict(optimizer="galore8bit", rank=4, proj_dtype="int4"), "proj_dtype must be one of param, fp32, int8"),
    (dict(optimizer_offload="nvme"), "optimizer_offload must be"),
    (dict(optimizer="lion", optimizer_offload="cpu"), "works with adamw"),
    (dict(batch=4, micro_batch=2, step_in_backward=True), "cannot accumulate"),
    (dict(optimizer_offload="cpu", step_in_backward=True), "choose one"),
    (dict(quant="int3"), "quant must be one of"),
    (dict(offload_activations=1), "must be True or False"),
    (dict(dropout=float("nan")), "must be finite"),
]


@pytest.mark.parametrize("change,message", BAD, ids=[m for _, m in BAD])
def test_bad_recipes_are_refused_with_one_clear_line(change, message):
    kw = dict(batch=2, seq=16)
    kw.update(change)
    with pytest.raises(ValueError, match=message) as e:
        Recipe.of(G, **kw)
    assert "\n" not in str(e.value)


def test_a_recipe_is_frozen_and_replace_checks_again():
    r = Recipe.of("gpt2-tiny", 2, 16, dtype="bf16", n_layer=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.batch = 3
    assert r.config == {"n_layer": 1} and r.micro == 2
    with pytest.raises(ValueError, match="micro_batch"):
        r.replace(micro_batch=3)


def test_estimate_takes_a_recipe_or_the_same_keywords_and_measure_step_a_recipe():
    r = Recipe.of(G, 2, 16, dtype="fp32", optimizer="adamw", checkpoint="full", segments=1)
    kw = dict(dtype="fp32", optimizer="adamw", checkpoint="full", segments=1)
    assert estimate(r).phases == estimate(G, 2, 16, **kw).phases
    with pytest.raises(TypeError, match="Recipe alone"):
        estimate(r, 2, 16)
    with pytest.raises(TypeError, match="takes a labkit.estimate.Recipe, got GPTConfig"):
        measure_step(G)
    with pytest.raises(TypeError):
        measure_step(r, checkpoint="none")  # the recipe's fields are the Recipe's, not measure_step's keywords
    with pytest.raises(ValueError, match="^steps must be a positive integer"):
        measure_step(r, steps=0)


def test_measure_step_runs_the_recipe_as_the_keyword_form_did():
    """The seeded run of a Recipe: the same phases, byte for byte, as the same run by hand (build, optimizer,
    two train_steps on the same batches under the Ledger)."""
    from labkit.memory import Ledger
    from labkit.recompute import checkpoint_blocks
    from labkit.run import build_model, make_optimizer, train_step

    r = Recipe.of(G, 2, 16, dtype="fp32", optimizer="adamw", checkpoint="full", segments=1)
    torch.manual_seed(1)
    m = build_model(G, "fp32")
    opt = make_optimizer(m, r)
    gen = torch.Generator().manual_seed(1)
    with checkpoint_blocks(m, "full", 1), Ledger(m, opt, label="by hand") as led:
        for _ in range(2):
            t = torch.randint(0, m.config.vocab_size, (2, 17), generator=gen)
            x, y = t[:, :-1].contiguous(), t[:, 1:].contiguous()
            del t
            train_step(m, opt, x, y)
            del x, y
    assert measure_step(r, seed=1).phases == led.measurement().phases


def test_a_layout_over_several_devices():
    r = Recipe.of(G, 8, 16, dp=2, tp=2, pp=2, micro_batch=2)
    assert (r.world_size, r.rank_batch, r.micro, r.distributed) == (8, 4, 2, True)
    assert not Recipe.of(G, 8, 16).distributed and Recipe.of(G, 8, 16, dp=4).micro == 2
