"""On CUDA: labkit's PagedAdamW against bitsandbytes' paged optimizers (which really page there: their state is
CUDA unified memory), and the pager keeping a spike under a ledger budget that torch.optim.AdamW exceeds."""

import pytest
import torch

from labkit.memory import Ledger
from labkit.memory.budget import SimulatedOutOfMemoryError
from labkit.models.gpt import GPT, GPTConfig
from labkit.optim.paged import PagedAdamW, predict_paging

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
EPS = torch.finfo(torch.float32).eps
BIG = (400, 300)  # 120000 values: bitsandbytes pages a state only from 1e5 values up


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(BIG, generator=g).cuda(), torch.randn(5000, generator=g).cuda()]


def _run(make, params, steps, seed=1):
    ps = [p.clone().requires_grad_() for p in params]
    opt = make(ps)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g).cuda()
        opt.step()
    torch.cuda.synchronize()
    return ps, opt


@pytest.mark.parity
def test_paged_adamw_matches_bitsandbytes_paged_adamw():
    """Same arithmetic as on CPU: 4 ulps of (|p| + lr) per step (tests/unit/test_paged.py), and bitsandbytes'
    big state really is paged (unified memory, `is_paged`)."""
    bnb = pytest.importorskip("bitsandbytes")
    params = _params()
    ref, ob = _run(lambda ps: bnb.optim.PagedAdamW(ps, lr=1e-2, weight_decay=0.1), params, 5)
    got, opt = _run(lambda ps: PagedAdamW(ps, lr=1e-2, weight_decay=0.1, page_size=64 * 1024), params, 5)
    assert getattr(ob.state[ref[0]]["state1"], "is_paged", False)
    for a, b in zip(got, ref):
        tol = 5 * 4 * EPS * (b.detach().abs() + 1e-2)
        assert ((a.detach() - b.detach()).abs() <= tol).all(), (a - b).abs().max().item()
    assert opt.pager.device.type == "cuda" and opt.stats.paged_out == 0


@pytest.mark.parity
@pytest.mark.parametrize("name", ["AdamW", "AdamW8bit"])
def test_bitsandbytes_paging_changes_no_number(name):
    """bitsandbytes' Paged<name> against <name>: paging only moves bytes, so bit-identical weights."""
    bnb = pytest.importorskip("bitsandbytes")
    params = _params()
    ref, _ = _run(lambda ps: getattr(bnb.optim, name)(ps, lr=1e-2, weight_decay=0.1), params, 4)
    got, opt = _run(lambda ps: getattr(bnb.optim, "Paged" + name)(ps, lr=1e-2, weight_decay=0.1), params, 4)
    assert getattr(opt.state[got[0]]["state1"], "is_paged", False)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


CFG = GPTConfig(n_layer=2, n_embd=128, n_head=2, vocab_size=256, block_size=128)
PAGE = 64 * 1024


def _spike(optimizer, budget):
    """A short batch (its step makes the state), then a long one (the spike), on CUDA under a ledger budget."""
    torch.manual_seed(0)
    model = GPT(CFG).cuda()
    opt = (PagedAdamW(model.parameters(), lr=1e-2, page_size=PAGE) if optimizer == "paged"
           else torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False))
    led = Ledger(model, opt, budget=budget)
    if optimizer == "paged":
        opt.attach(led)
    g = torch.Generator().manual_seed(1)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()  # the ledger resets the allocator's peak when it starts
    with led:
        for b, t in ((1, 16), (8, 128)):
            x = torch.randint(0, CFG.vocab_size, (b, t + 1), generator=g).cuda()
            model(x[:, :-1], x[:, 1:]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    meas = led.measurement()
    meas.allocator["peak_above_start"] = meas.allocator["max_allocated"] - before
    return meas, opt, model


def test_pager_keeps_a_cuda_step_under_a_budget_that_adamw_exceeds():
    _spike("paged", None)  # warm-up: cuBLAS workspaces and the like are made once, outside the runs compared
    free, opt0, m0 = _spike("paged", None)
    steady, spike, state = free.of_step(1).peak.total, free.peak.total, opt0.state_page_bytes()
    budget = max(steady, spike - state // 2) + 1000
    assert steady < budget < spike
    meas, opt, model = _spike("paged", budget)
    pred = predict_paging(spike, budget, PAGE, state)
    assert opt.stats.paged_out == pred.evicted > 0 and opt.stats.paged_in == pred.evicted
    assert pred.peak_low <= meas.peak.total <= pred.peak_high == budget
    # the evicted pages were really freed: the caching allocator's peak above the start is lower than without a budget
    assert meas.allocator["peak_above_start"] < free.allocator["peak_above_start"]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), m0.parameters()))
    with pytest.raises(SimulatedOutOfMemoryError):  # last: the error's frames keep its tensors alive a while
        _spike("torch", budget)
