"""labkit.optim.step_in_backward: the same training trajectory as the ordinary loop, with about one gradient alive."""

import copy
import io

import pytest
import torch

from labkit.memory import Category, Ledger
from labkit.run import train_step
from labkit.models.gpt import GPT, GPTConfig
from labkit.optim.galore import GaLoreAdamW, galore_param_groups
from labkit.optim.step_in_backward import StepInBackward, step_in_backward_naive
from tiny_training import CFG, batches as _batches, same as _same, train as _train

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("kind", ["adamw", "galore"])
def test_trajectory_equals_ordinary_loop(kind):
    """Exact (torch.equal) for AdamW and for GaLoreAdamW: each parameter's update reads only its own
    gradient and state. The tied embedding/lm_head weight is stepped once, after both uses summed."""
    torch.manual_seed(0)
    a = GPT(CFG)
    b = copy.deepcopy(a)
    if kind == "adamw":
        oa = torch.optim.AdamW(a.parameters(), lr=1e-2, weight_decay=0.1)
        ob = StepInBackward(b.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    else:
        oa = GaLoreAdamW(galore_param_groups(a, rank=8, update_proj_gap=2), lr=1e-2)
        ob = StepInBackward(galore_param_groups(b, rank=8, update_proj_gap=2), GaLoreAdamW, lr=1e-2)
    batches = _batches(4)
    _train(a, oa, batches)
    _train(b, ob, batches)
    assert _same(a, b)
    assert not _same(a, GPT(CFG))  # it trained
    assert all(p.grad is None for p in b.parameters())
    assert len(ob.optimizers) == len(list(b.parameters()))


def test_naive_version_matches():
    torch.manual_seed(0)
    a = GPT(CFG)
    b = copy.deepcopy(a)
    opts = step_in_backward_naive(a, lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    assert len(opts) == len(list(a.parameters()))
    batches = _batches(3)
    for x in batches:
        a(x[:, :-1], x[:, 1:]).backward()  # backward alone trains it
    _train(b, torch.optim.AdamW(b.parameters(), lr=1e-2), batches)
    assert _same(a, b)


def test_ledger_sees_one_gradient_at_a_time():
    """GRAD at the backward peak: all gradients in the ordinary loop, about the largest one here."""
    torch.manual_seed(0)
    base = GPT(GPTConfig(n_layer=4, n_embd=64, n_head=2, vocab_size=64, block_size=32))
    sizes = sorted(4 * p.numel() for p in base.parameters())
    grads = {}
    for name in ("loop", "in-backward"):
        m = copy.deepcopy(base)
        opt = torch.optim.AdamW(m.parameters()) if name == "loop" else StepInBackward(m.parameters(), torch.optim.AdamW)
        with Ledger(m, opt) as led:
            _train(m, opt, _batches(2))
        grads[name] = led.measurement().phases["backward"][Category.GRAD]
    assert grads["loop"] >= 0.9 * sum(sizes)  # measured 799744 of 824832 bytes
    assert sizes[-1] <= grads["in-backward"] <= 1.05 * sizes[-1]  # measured 65792: the 64 KiB c_fc + a bias


def test_state_dict_resume_and_controls():
    torch.manual_seed(0)
    a = GPT(CFG)
    b = copy.deepcopy(a)
    oa = StepInBackward(galore_param_groups(a, rank=8, update_proj_gap=2), GaLoreAdamW, lr=1e-2)
    batches = _batches(5)
    _train(a, oa, batches[:3])
    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "opt": oa.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    b.load_state_dict(saved["model"])
    ob = StepInBackward(galore_param_groups(b, rank=8, update_proj_gap=2), GaLoreAdamW, lr=1e-2)
    ob.load_state_dict(saved["opt"])
    _train(a, oa, batches[3:])
    _train(b, ob, batches[3:])
    assert _same(a, b)
    assert {g["lr"] for g in ob.param_groups} == {1e-2} and len(ob.state) == len(ob.optimizers)
    ob.enabled = False  # gradients accumulate, nothing moves
    before = [p.detach().clone() for p in b.parameters()]
    x = batches[0]
    b(x[:, :-1], x[:, 1:]).backward()
    assert all(p.grad is not None for p in b.parameters())
    assert all(torch.equal(p, q) for p, q in zip(before, b.parameters()))
    ob.zero_grad()
    ob.enabled = True
    ob.remove()  # hooks gone: backward no longer steps
    b(x[:, :-1], x[:, 1:]).backward()
    assert all(torch.equal(p, q) for p, q in zip(before, b.parameters()))


def test_bad_input():
    w = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="^params: a parameter appears more than once$"):
        StepInBackward([w, w])
    with pytest.raises(ValueError, match="^params"):
        StepInBackward([])
    with pytest.raises(ValueError, match="^lr"):
        StepInBackward([torch.nn.Parameter(torch.zeros(4, 4))], GaLoreAdamW, lr=-1.0)


@pytest.mark.parametrize("kind", ["galore", "galore8bit"])
def test_estimate_of_a_projector_refresh_step_in_backward(kind):
    """With update_proj_gap=1 every step refreshes GaLore's projectors (an SVD per matrix) inside backward:
    the estimate's "optimizer" phase is the moment the largest matrix steps, SVD included, with the
    activations still alive. Measured 0.3 % over (peak and that phase), bf16."""
    from labkit.estimate import estimate
    from labkit.run import build_model
    from labkit.optim.galore8bit import GaLoreAdamW8bit

    cfg = GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=64)
    torch.manual_seed(0)
    m = build_model(cfg, "bf16")
    cls = GaLoreAdamW if kind == "galore" else GaLoreAdamW8bit
    opt = StepInBackward(galore_param_groups(m, rank=16, update_proj_gap=1), cls, lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with Ledger(m, opt) as led:
        for _ in range(2):
            t = torch.randint(0, cfg.vocab_size, (2, 33), generator=g)
            train_step(m, opt, t[:, :-1], t[:, 1:], "bf16")
    meas = led.measurement()
    e = estimate(cfg, 2, 32, "bf16", kind, rank=16, step_in_backward=True)
    assert e.peak_phase == meas.peak_phase == "optimizer"
    assert abs(e.peak.total - meas.peak.total) <= 0.01 * meas.peak.total
    assert e.phases["optimizer"][Category.GRAD] == meas.phases["optimizer"][Category.GRAD]  # the c_fc gradient


@pytest.mark.parametrize("in_backward", [False, True])
def test_ledger_counts_steps_when_parameters_step_in_backward(in_backward):
    """A step ends when its optimizer stepped: after opt.step(), or after a backward whose hooks stepped the
    parameters. Each step's phase peaks (Measurement.of_step) make up the whole measurement's."""
    torch.manual_seed(0)
    m = GPT(CFG)
    opt = StepInBackward(m.parameters(), torch.optim.AdamW) if in_backward else torch.optim.AdamW(m.parameters())
    with Ledger(m, opt) as led:
        _train(m, opt, _batches(3))
    meas = led.measurement()
    assert {s for _, _, s in meas.timeline.phase_starts} == {1, 2, 3}
    steps = [meas.of_step(s) for s in (1, 2, 3)]
    for phase, peak in meas.phases.items():
        assert peak.total == max(s.phases[phase].total for s in steps if phase in s.phases)
    assert steps[0].phases["forward"][Category.OPT] == 0 < steps[1].phases["forward"][Category.OPT]  # state made in step 1
    with pytest.raises(ValueError, match="^step 4 was not measured"):
        meas.of_step(4)
