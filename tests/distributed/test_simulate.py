"""FSDP2's per-rank memory at 8 and 64 ranks in one process (fake process group + FSDPMemTracker), beside labkit's
per-rank FSDP2 estimate (zero_terms.fsdp2_estimate: labkit's ZeRO-3 moments on FSDP2's per-parameter shards, with
its all-gather and reduce-scatter buffers). Random layouts: tests/distributed/test_random_layouts.py."""

import pytest

from labkit.distributed.simulate import fsdp2_rank_memory
from labkit.estimate import Recipe
from labkit.estimate import zero_terms
from labkit.estimate.spec import spec_from
from labkit.models.gpt import GPTConfig

CFG = dict(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=64)


def test_fsdp2_at_8_and_64_ranks_against_the_fsdp2_estimate():
    out = fsdp2_rank_memory(CFG, [8, 64], batch=2, seq=32)
    spec = spec_from(GPTConfig(**CFG))
    for r in out:
        w = r["world"]
        e = zero_terms.fsdp2_estimate(Recipe(GPTConfig(**CFG), batch=2 * w, seq=32, dp=w))
        lay = zero_terms.fsdp2_layout(spec, 4, w)
        # FSDP2 all-gathers a block into one buffer of every parameter's dim-0 chunks (ceil(d0 / N) rows each)
        # times N, which it holds until the next all-gather
        print(w, r["peak"], e.peak.total, r["by_category"])
        assert r["by_category"]["all_gather"] == 4 * w * lay.s_block
        assert e.peak.total / r["peak"] - 1 == pytest.approx(0, abs=0.03)
        assert r["by_category"]["opt"] == lay.opt()  # m and v of rank 0's chunks, a 4-byte step per tensor
    assert out[1]["peak"] < out[0]["peak"]
    with pytest.raises(ValueError, match="integer >= 1"):
        fsdp2_rank_memory(CFG, 0, 2, 32)
