"""labkit.optim.paged: optimizer state in pages that a ledger budget evicts to the host, and the Ledger's pressure hook."""

import copy
import io
import warnings

import pytest
import torch

from labkit.memory import Ledger
from labkit.memory.budget import SimulatedOutOfMemoryError
from labkit.models.gpt import GPT, GPTConfig
from labkit.optim import Lion
from labkit.optim.offload import OffloadAdamW
from labkit.optim.paged import PAGE_SIZE, PagedAdamW, PagedLion, paged_state_bytes, predict_paging
from tiny_training import CFG, batches as _batches, train as _train

pytestmark = pytest.mark.usefixtures("one_thread")
EPS = torch.finfo(torch.float32).eps


def _tensors(seed=0):
    """Three parameters whose element counts straddle 4 KiB pages (1024 fp32 values) in different places."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(300, 7, generator=g), torch.randn(50, generator=g), torch.randn(1000, generator=g)]


def _grads(params, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g) for p in params] for _ in range(steps)]


def _run(opt_cls, params, grads, between=None, **kw):
    ps = [p.clone().requires_grad_() for p in params]
    opt = opt_cls(ps, **kw)
    for gs in grads:
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        opt.step()
        if between is not None:
            between(opt)
    return ps, opt


def _close(got, ref, steps, lr):
    """Each step rounds a few times in the weight (|p| ulps) and in the update (lr-sized): 4 ulps of
    (|p| + lr) per step, accumulated over the steps."""
    for a, b in zip(got, ref):
        tol = steps * 4 * EPS * (b.detach().abs() + lr)
        assert ((a.detach() - b.detach()).abs() <= tol).all(), (a - b).abs().max().item()


# ---- parity -----------------------------------------------------------------------------------------------
@pytest.mark.parity
@pytest.mark.parametrize("evict", [False, True], ids=["resident", "evicted-every-step"])
def test_paged_adamw_equals_torch_adamw(evict):
    params, grads = _tensors(), _grads(_tensors(), 5)
    ref, _ = _run(torch.optim.AdamW, params, grads, lr=1e-2, weight_decay=0.1, foreach=False)
    evict_all = (lambda o: o.pager.relieve(o.state_page_bytes())) if evict else None
    got, opt = _run(PagedAdamW, params, grads, between=evict_all, lr=1e-2, weight_decay=0.1, page_size=4096)
    _close(got, ref, 5, 1e-2)
    n_pages = 2 * opt.n_pages  # 3150 values in 1024-value pages: 4 pages per state
    assert opt.n_pages == 4 and opt.stats.allocated == n_pages * 4096
    if evict:  # every page out after each step, and back in at the next: 4 round trips
        assert opt.stats.paged_out == 5 * n_pages * 4096 and opt.stats.faults == 4 * n_pages
        assert opt.stats.paged_in == 4 * n_pages * 4096
    else:
        assert opt.stats.paged_out == opt.stats.paged_in == opt.stats.faults == 0


@pytest.mark.parity
def test_paged_adamw_equals_offload_adamw_on_a_gpt():
    torch.manual_seed(0)
    a = GPT(CFG)
    b = copy.deepcopy(a)
    data = _batches(3)
    with OffloadAdamW(a.parameters(), lr=1e-2, weight_decay=0.1) as oa:
        _train(a, oa, data)
    _train(b, PagedAdamW(b.parameters(), lr=1e-2, weight_decay=0.1, page_size=8192), data)
    _close(list(b.parameters()), list(a.parameters()), 3, 1e-2)


@pytest.mark.parity
def test_paged_adamw_matches_bitsandbytes_paged_adamw_on_cpu():
    """bitsandbytes >= 0.50 runs its optimizers on CPU, but PagedAdamW there falls back to non-paged (it warns
    "Paged optimizers are not supported on CPU"): this checks the arithmetic, not bitsandbytes' paging."""
    bnb = pytest.importorskip("bitsandbytes")
    params, grads = _tensors(), _grads(_tensors(), 5)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
        ref, _ = _run(bnb.optim.PagedAdamW, params, grads, lr=1e-2, weight_decay=0.1)
    got, _ = _run(PagedAdamW, params, grads, lr=1e-2, weight_decay=0.1, page_size=4096,
                  between=lambda o: o.pager.relieve(o.state_page_bytes() // 2))
    _close(got, ref, 5, 1e-2)


@pytest.mark.parity
def test_paged_lion_equals_labkit_lion():
    params, grads = _tensors(), _grads(_tensors(), 4)
    ref, _ = _run(Lion, params, grads, lr=1e-3, weight_decay=0.5)
    got, opt = _run(PagedLion, params, grads, lr=1e-3, weight_decay=0.5, page_size=4096,
                    between=lambda o: o.pager.relieve(1))
    _close(got, ref, 4, 1e-3)
    assert opt.stats.faults == 3 and opt.state_page_bytes() == paged_state_bytes(3150, 1, 4096) == 4 * 4096


def test_resume_from_state_dict_equals_training_on():
    """Two steps (half the pages evicted after each), save through torch.save, load into a new optimizer, two
    more steps: bit-identical to four steps in one go."""
    params, grads = _tensors(), _grads(_tensors(), 4)
    ref, _ = _run(PagedAdamW, params, grads, lr=1e-2, page_size=4096)
    half = lambda o: o.pager.relieve(o.state_page_bytes() // 2)  # noqa: E731
    ps, opt = _run(PagedAdamW, params, grads[:2], between=half, lr=1e-2, page_size=4096)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    assert opt.pager.host_bytes == 4 * 4096  # saving moved no page
    again = PagedAdamW(ps, lr=0.5, page_size=4096)  # the saved lr replaces this one
    again.load_state_dict(saved)
    for gs in grads[2:]:
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        again.step()
    assert all(torch.equal(a, b) for a, b in zip(ps, ref)) and again.param_groups[0]["lr"] == 1e-2


# ---- the pager --------------------------------------------------------------------------------------------
def test_least_recently_used_pages_leave_first():
    params, grads = _tensors(), _grads(_tensors(), 1)
    _, opt = _run(PagedAdamW, params, grads, page_size=4096)
    first = [opt.pages[s][0] for s in opt.state_names]  # touched first by the step: least recent
    assert opt.pager.relieve(4097) == 2 * 4096  # whole pages: two to free 4097 bytes
    assert all(p.data is None for p in first) and opt.pages["exp_avg"][1].data is not None
    assert opt.pager.resident_bytes == 6 * 4096 and opt.pager.host_bytes == 2 * 4096


def test_ledger_budget_evicts_state_and_step_brings_it_back():
    params, grads = _tensors(), _grads(_tensors(), 2)
    ps = [p.clone().requires_grad_() for p in params]
    opt = PagedAdamW(ps, page_size=4096)
    for p, g in zip(ps, grads[0]):
        p.grad = g.clone()
    opt.step()  # 8 pages of state on the device
    base = 2 * 4 * 3150 + 8 * 4096  # fp32 parameters and gradients, and the 8 pages
    led = Ledger(optimizer=opt, budget=base + 4096)
    opt.attach(led)
    with led:
        assert led.live_bytes == base
        big = torch.empty(4 * 4096 - 8, dtype=torch.uint8)  # 3 pages less 8 bytes over the budget
        assert opt.stats.paged_out == 3 * 4096 and led.live_bytes <= led.budget
        del big
        for p, g in zip(ps, grads[1]):
            p.grad.copy_(g)
        opt.step()
    assert opt.stats.faults == 3 and opt.stats.paged_in == 3 * 4096 and opt.pager.host_bytes == 0


# ---- the Ledger's pressure hook ---------------------------------------------------------------------------
def test_pressure_callback_frees_memory_and_the_allocation_goes_ahead():
    held = {"t": None}
    asked = []

    def free(needed):
        asked.append(needed)
        held["t"] = None

    led = Ledger(budget=4000)
    handle = led.on_pressure(free)
    with led:
        held["t"] = torch.empty(3000, dtype=torch.uint8)
        x = torch.empty(2000, dtype=torch.uint8)  # 1000 bytes over: the callback frees 3000
        assert asked == [1000] and led.live_bytes == 2000
        handle.remove()
        with pytest.raises(SimulatedOutOfMemoryError) as e:
            torch.empty(2001, dtype=torch.uint8)
        assert "pressure" not in str(e.value)
    del x


def test_budget_too_small_even_with_all_state_evicted_is_the_usual_oom():
    params, grads = _tensors(), _grads(_tensors(), 1)
    _, opt = _run(PagedAdamW, params, grads, page_size=4096)
    led = Ledger(optimizer=opt, budget=10 * 4096)
    opt.attach(led)
    with led, pytest.raises(SimulatedOutOfMemoryError) as e:
        torch.empty(10 * 4096, dtype=torch.uint8)
    msg = str(e.value)
    assert "\n" not in msg and "the pressure callbacks freed 32.00 KiB, not enough" in msg
    assert opt.pager.host_bytes == 8 * 4096  # everything it could evict, it did


@pytest.mark.parametrize("bad", [0, 6, -4, 2.0, True, "2MiB"])
def test_bad_page_size(bad):
    with pytest.raises(ValueError, match="page_size must be an integer >= 4 and a multiple of 4"):
        PagedAdamW([torch.zeros(3, requires_grad=True)], page_size=bad)


def test_bad_input_is_one_line():
    cases = [
        (lambda: PagedAdamW([torch.zeros(4, 3).t().requires_grad_()]), "is not contiguous"),
        (lambda: Ledger().on_pressure(42), "on_pressure needs a callable"),
        (lambda: PagedAdamW([torch.zeros(3, requires_grad=True)]).add_param_group({"params": [torch.zeros(2)]}),
         "parameter groups are fixed at construction"),
        (lambda: PagedAdamW([torch.zeros(3, requires_grad=True)]).load_state_dict(
            {"state": {0: {"step": 1, "exp_avg": torch.zeros(4)}}, "param_groups": [{"params": [0]}]}),
         "needs exp_avg, exp_avg_sq of shape (3,)"),
        (lambda: predict_paging(0, 10), "unpaged_peak must be"),
    ]
    for make, text in cases:
        with pytest.raises((ValueError, NotImplementedError)) as e:
            make()
        assert text in str(e.value) and "\n" not in str(e.value)


# ---- a spike under a budget: prediction against measurement ---------------------------------------------
SPIKE_CFG = GPTConfig(n_layer=2, n_embd=64, n_head=2, vocab_size=64, block_size=64)
PAGE = 8192


def _spike(optimizer, budget, seed=0):
    """One short batch (its step makes the state), then one long batch (the spike): the measurement, the
    optimizer and the model."""
    torch.manual_seed(seed)
    model = GPT(SPIKE_CFG)
    opt = (PagedAdamW(model.parameters(), lr=1e-2, page_size=PAGE) if optimizer == "paged"
           else torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False))
    led = Ledger(model, opt, budget=budget)
    if optimizer == "paged":
        opt.attach(led)
    g = torch.Generator().manual_seed(1)
    with led:
        for b, t in ((1, 8), (8, 64)):
            x = torch.randint(0, SPIKE_CFG.vocab_size, (b, t + 1), generator=g)
            model(x[:, :-1], x[:, 1:]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return led.measurement(), opt, model


def test_paging_keeps_a_spike_under_the_budget_as_predicted():
    free, opt0, m0 = _spike("paged", None)  # no budget: nothing is paged, the unpaged timeline
    steady, spike = free.of_step(1).peak.total, free.peak.total
    state = opt0.state_page_bytes()
    budget = max(steady, spike - state // 2) + 1000  # not a whole number of pages below the spike
    assert steady < budget < spike
    with pytest.raises(SimulatedOutOfMemoryError):
        _spike("torch", budget)  # torch.optim.AdamW's state (smaller than the padded pages) does not fit
    meas, opt, model = _spike("paged", budget)
    pred = predict_paging(spike, budget, PAGE, state)
    assert pred.fits and opt0.stats.paged_out == 0
    assert opt.stats.paged_out == pred.evicted > 0  # exact: whole pages, just enough
    assert opt.stats.paged_in == pred.evicted  # all of it back in the step (it fits after the activations go)
    assert pred.peak_low <= meas.peak.total <= pred.peak_high == budget
    assert pred.peak_high - pred.peak_low < PAGE  # the prediction is tight to within one page
    for p, q in zip(model.parameters(), m0.parameters()):  # paging changed no number
        assert torch.equal(p, q)


def test_predict_paging_arithmetic():
    p = predict_paging(10 * PAGE_SIZE + 5, 8 * PAGE_SIZE, PAGE_SIZE, 4 * PAGE_SIZE)
    assert p.evicted == 3 * PAGE_SIZE and p.peak_high == 8 * PAGE_SIZE and p.peak_low == 7 * PAGE_SIZE + 5 and p.fits
    assert not predict_paging(10 * PAGE_SIZE, 5 * PAGE_SIZE, PAGE_SIZE, 4 * PAGE_SIZE).fits
    assert predict_paging(100, 1000, PAGE_SIZE).evicted == 0
