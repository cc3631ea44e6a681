"""An out-of-memory during forward names the live forward outputs as activations, as the timeline shows them."""

import re

import pytest
import torch

from labkit.memory import Category, Ledger, SimulatedOutOfMemoryError, run_within_budget
from labkit.models.gpt import GPT, GPTConfig

CFG = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=128)


def _model_and_batch():
    torch.manual_seed(0)
    model = GPT(CFG)
    x = torch.randint(0, CFG.vocab_size, (4, 64))
    return model, x


def _forward_only_measure():
    """Bytes tagged ACT when backward starts, and the parameters' bytes, for one forward + backward."""
    model, x = _model_and_batch()
    with Ledger(model) as led:
        model(x, x).backward()
    tl = led.measurement().timeline
    start = next(i for i, phase, _ in tl.phase_starts if phase == "backward")
    return tl.bytes[Category.ACT][start - 1], tl.bytes[Category.PARAM][start - 1]


def test_forward_oom_names_activations_not_temporaries():
    act, params = _forward_only_measure()
    assert act > 0
    budget = params + act // 2  # the forward runs out half-way through its activations
    model, x = _model_and_batch()
    with pytest.raises(SimulatedOutOfMemoryError) as info:
        with Ledger(model, budget=budget):
            model(x, x)
    e = info.value
    assert "forward pass" in str(e)
    assert e.live[Category.ACT] > 0 and e.live[Category.TEMP] == 0, e.live
    assert "activations" in str(e) and "temporaries" not in str(e), str(e)
    assert e.live.total <= budget < e.live.total + e.requested
    assert e.live[Category.ACT] <= act  # a prefix of what the timeline tags ACT at the start of backward


def test_budget_result_message_names_activations_in_forward():
    model, x = _model_and_batch()
    act, params = _forward_only_measure()

    def run():
        with Ledger(model, budget=params + act // 2) as led:
            model(x, x)
        return led.measurement()

    r = run_within_budget(run, params + act // 2)
    assert not r.fits
    parts = re.search(r"; (.+) in use when", r.message).group(1)
    assert {p.rsplit(" ", 2)[0] for p in parts.split(", ")} <= {"activations", "parameters", "buffers"}, r.message
