"""FSDP2's per-rank memory at 8 and 64 ranks in one process (fake process group + FSDPMemTracker), beside labkit's
per-rank ZeRO-3 estimate."""

import pytest

from labkit.distributed.simulate import fsdp2_rank_memory
from labkit.estimate import Recipe, estimate
from labkit.estimate import zero_terms
from labkit.estimate.spec import spec_from
from labkit.models.gpt import GPTConfig

CFG = dict(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=64)


def test_fsdp2_at_8_and_64_ranks_is_labkit_zero3_plus_one_all_gather_buffer():
    out = fsdp2_rank_memory(CFG, [8, 64], batch=2, seq=32)
    spec = spec_from(GPTConfig(**CFG))
    for r in out:
        w = r["world"]
        e = estimate(Recipe(GPTConfig(**CFG), batch=2 * w, seq=32, dp=w, zero=3))
        lay = zero_terms.rank_layout(spec, 4, 3, w)
        # FSDP2 all-gathers into its own buffer and copies out into the parameters: at its peak that buffer (one
        # block, padded) is alive beside what labkit's Zero holds
        buffer = 4 * w * lay.s_block
        print(w, r["peak"], e.peak.total, buffer, r["by_category"])
        assert r["by_category"]["all_gather"] == pytest.approx(buffer, rel=0.01)
        assert (e.peak.total + buffer) / r["peak"] - 1 == pytest.approx(0, abs=0.03)
        assert r["by_category"]["opt"] == pytest.approx(8 * spec.n_params / w, rel=0.05)
    assert out[1]["peak"] < out[0]["peak"]
    with pytest.raises(ValueError, match="integer >= 1"):
        fsdp2_rank_memory(CFG, 0, 2, 32)
