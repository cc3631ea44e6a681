"""Issue 43: the techniques compose. Over the grid of bench/cross_product.py (layout x checkpoint policy x PEFT x
optimizer x chunked loss, on gpt2-tiny and llama-tiny) every combination is estimated or refused with a key
(labkit.estimate.refusal.Refused); the estimated ones are measured within 3 % per category.

The whole grid (3,072 combinations, about 50 s) is the bench's; here every pair of levels of any two factors is
met at least once (a greedy pairwise covering of the grid), each refusal key has a recipe that still meets it
(so the table of gaps stays true: a gap that closes fails its example, and is deleted from the table), and a
stride of the estimated single-device combinations, and labkit's Zero over checkpointing, LoRA and
micro-batches per rank, are measured with the ledger (FSDP2 over LoRA and checkpointing:
tests/distributed/test_simulate.py; paged states and GaLore on stages: test_layout_combinations.py).
"""

import importlib.util
import itertools

import pytest

from estimate_checks import assert_categories_within
from labkit.estimate import Recipe, estimate
from labkit.estimate.refusal import GAPS, Kind, Refusal, Refused
from labkit.models.gpt import GPTConfig
from labkit.paths import REPO_ROOT

_spec = importlib.util.spec_from_file_location("cross_product", REPO_ROOT / "bench" / "cross_product.py")
cp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cp)


def _pairwise(grid: list) -> list:
    """A greedy covering of `grid` ((model, level names, fields) rows): rows until every pair of levels of two
    factors (the model counted as a factor) that occurs in the grid occurs in a chosen row."""
    def pairs(row):
        levels = (row[0], *row[1])
        return {(i, a, j, b) for (i, a), (j, b) in itertools.combinations(enumerate(levels), 2)}

    rows = [(r, pairs(r)) for r in grid]
    todo = set().union(*(p for _, p in rows))
    chosen = []
    while todo:
        best, got = max(rows, key=lambda rp: len(rp[1] & todo))
        chosen.append(best)
        todo -= got
    return chosen


COVERING = _pairwise(list(cp.combinations()))  # 60 rows or so, made once (collection needs them too)


@pytest.fixture(scope="module")
def covering():
    return [(row, *cp.classify(row[0], row[2])) for row in COVERING]


def test_every_pair_of_levels_is_estimated_or_refused_with_a_key(covering):
    """classify lets any error but Refused through: a combination refused without a key fails here."""
    refused = [got for _, what, got in covering if what == "refused"]
    estimated = [got for _, what, got in covering if what == "estimated"]
    print(f"{len(covering)} combinations cover every pair of levels: {len(estimated)} estimated, "
          f"{sum(r.kind is Kind.INCOMPATIBLE for r in refused)} incompatible, "
          f"{sum(r.kind is Kind.NOT_ESTIMATED for r in refused)} gaps")
    assert estimated and all(e.peak.total > 0 for e in estimated)
    assert all(isinstance(r.refusal, Refusal) and str(r) for r in refused)


# one recipe per refusal key that meets it today (gpt2-tiny unless named; GPT: labkit's own, 2 layers)
GPT = GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=2, n_embd=32)
EXAMPLES = {
    Refusal.STEP_WITH_ACCUMULATION: dict(step_in_backward=True, micro_batch=2),
    Refusal.STEP_WITH_OFFLOAD: dict(step_in_backward=True, optimizer_offload="cpu"),
    Refusal.TWO_STATE_SHRINKERS: dict(lora_rank=8, optimizer="galore", rank=8),
    Refusal.PAGED_WITH_OFFLOAD: dict(paged_states=True, optimizer_offload="cpu"),
    Refusal.LISA_STEP_IN_BACKWARD: dict(lisa_layers=1, step_in_backward=True),
    Refusal.GPT_LOSS_CHUNK_STEP: dict(model=GPTConfig(**{**GPT.__dict__, "loss_chunk": 8}), step_in_backward=True),
    Refusal.GALORE_SHARDED: dict(dp=2, zero=1, optimizer="galore", rank=8),
    Refusal.OPTIMIZER_SHARDED: dict(dp=2, zero=3, lora_rank=8, optimizer="adamw8bit"),
    Refusal.FACTORED_SHARDED: dict(dp=2, zero=1, optimizer="adafactor"),
    Refusal.OPTIMIZER_OFFLOAD_ZERO: dict(dp=2, zero=1, optimizer_offload="cpu"),
    Refusal.STEP_IN_BACKWARD_ZERO: dict(dp=2, zero=2, step_in_backward=True),
    Refusal.ZERO_OFFLOAD_OPTIMIZER: dict(dp=2, zero=1, zero_offload=True, optimizer="adam"),
    Refusal.LISA_SHARDED: dict(dp=2, zero=2, lisa_layers=1),
    Refusal.FSDP2_MICRO_BATCHES: dict(dp=2, zero=3, lora_rank=8, micro_batch=1),
    Refusal.ZERO3_SEGMENTS: dict(dp=2, zero=3, checkpoint="sqrt"),
    Refusal.QUANT_FSDP2: dict(dp=2, zero=3, lora_rank=8, quant="nf4"),
    Refusal.BASE_DTYPE_FSDP2: dict(dp=2, zero=3, lora_rank=8, dtype="mixed-bf16", base_dtype="bf16"),
    Refusal.PAGED_SHARDED: dict(dp=2, zero=3, lora_rank=8, paged_states=True),
    Refusal.ZERO_SHARDED_GRADIENTS_PP: dict(model=GPT, dp=2, zero=2, pp=2, micro_batch=1),
    Refusal.ZERO_SHARDED_GRADIENTS_TP: dict(model=GPT, dp=2, zero=2, tp=2),
    Refusal.ZERO_OFFLOAD_LAYOUT: dict(model=GPT, dp=2, zero=1, zero_offload=True, pp=2, micro_batch=1),
    Refusal.ZERO1_LAYOUT_OPTIMIZER: dict(model=GPT, dp=2, zero=1, pp=2, micro_batch=1, optimizer="adam"),
    Refusal.OPTIMIZER_OFFLOAD_ZERO1_LAYOUT: dict(model=GPT, dp=2, zero=1, pp=2, micro_batch=1,
                                                 optimizer_offload="cpu"),
    Refusal.ACTIVATION_OFFLOAD_LAYOUT: dict(model=GPT, tp=2, offload_activations=True),
    Refusal.ACTIVATION_OFFLOAD_DROPOUT_PP: dict(pp=2, micro_batch=2, offload_activations=True),
    Refusal.GALORE_TP: dict(model=GPT, tp=2, optimizer="galore", rank=8),
    Refusal.LAYOUT_TECHNIQUE: dict(pp=2, micro_batch=2, lisa_layers=1),
    Refusal.LORA_LAYOUT: dict(model=GPT, tp=2, lora_rank=8),
    Refusal.CHECKPOINT_LAYOUT: dict(model=GPT, tp=2, checkpoint="full"),
    Refusal.TP_FAMILY: dict(tp=2),
}


@pytest.mark.parametrize("refusal", list(Refusal), ids=lambda r: r.name)
def test_each_refusal_key_is_met_by_its_example(refusal):
    """The table of refusals is true: each key still refuses a recipe (a closed gap fails here until its key
    is deleted), and the gaps are the keys of kind NOT_ESTIMATED."""
    kw = dict(EXAMPLES[refusal])
    model = kw.pop("model", "gpt2-tiny")
    with pytest.raises(Refused) as e:
        estimate(Recipe.of(model, 4, 32, **kw))
    assert e.value.refusal is refusal, str(e.value)
    assert (refusal in GAPS) == (refusal.kind is Kind.NOT_ESTIMATED)


def test_the_examples_name_every_key():
    assert set(EXAMPLES) == set(Refusal)


def _single_device_stride(n: int = 8) -> list:
    rows = [r for r in COVERING if r[1][0] == "one device"]
    return rows[:: max(1, len(rows) // n)][:n]


@pytest.mark.parametrize("row", _single_device_stride(), ids=lambda r: f"{r[0]}-{'-'.join(r[1][1:])}")
def test_single_device_combinations_within_3_percent_per_category(row):
    from labkit.run import measure_step

    model, _, kw = row
    try:
        r = Recipe.of(model, cp.BATCH, cp.SEQ, **kw)
        e = estimate(r)
    except Refused as err:
        assert err.kind is Kind.INCOMPATIBLE, f"{row}: {err}"  # a gap is not met on one device
        return
    assert_categories_within(e, measure_step(r))


@pytest.mark.parametrize("kw", [dict(zero=1, checkpoint="selective", lora_rank=4),
                                dict(zero=2, checkpoint="full", micro_batch=1),
                                dict(zero=2, optimizer="adamw8bit", checkpoint="full"),
                                dict(zero=3, optimizer="lion"),
                                dict(zero=1, optimizer="adamw8bit", paged_states=True),
                                dict(zero=0, step_in_backward=True, checkpoint="full")],
                         ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_zero_combinations_per_rank_within_3_percent_per_category(kw):
    """labkit's Zero (ZeRO-1/2/3) on 4 ranks of labkit's GPT under the fake process group, over checkpointing,
    LoRA and micro-batches, and with labkit.optim's 8-bit AdamW or Lion (paged too) stepping the flat
    shards: each category of rank 0's peak against the ledger."""
    from labkit.distributed.simulate import zero_rank_memory
    from labkit.models.gpt import GPTConfig
    from labkit.run import apply_peft

    cfg = dict(vocab_size=96, block_size=32, n_layer=2, n_head=2, n_embd=64)  # a block's shard: 8-bit states
    r = Recipe(GPTConfig(**cfg), batch=8, seq=16, dp=4, **kw)
    lora = r.lora_rank
    m = zero_rank_memory(r, prepare=(lambda mod: apply_peft(mod, "fp32", lora, "all-linear")) if lora else None)
    e = estimate(r)
    assert_categories_within(e, m)
    assert e.unified == m.unified  # paged: the shards' states in unified memory (else 0 both)
