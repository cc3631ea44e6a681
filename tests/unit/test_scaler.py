"""The from-scratch loss scaler against torch.amp.GradScaler on a scripted run of good and bad steps."""

import pytest
import torch

from labkit.precision import DynamicLossScaler


def _run(scaler_factory, pattern, use_torch):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.ones(8))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = scaler_factory()
    scales, stepped, weights = [], [], []
    for bad in pattern:
        opt.zero_grad()
        loss = (w * torch.arange(8.0)).sum()
        scaler.scale(loss).backward()
        if bad == "inf":
            w.grad[3] = float("inf")
        elif bad == "nan":
            w.grad[0] = float("nan")
        before = w.detach().clone()
        scaler.step(opt)
        stepped.append(not torch.equal(before, w.detach()))
        scaler.update()
        scales.append(scaler.get_scale())
        weights.append(w.detach().clone())
        assert torch.isfinite(w).all()  # poisoned gradients never reach the weights
    return scales, stepped, weights


PATTERN = ["ok"] * 3 + ["inf"] + ["ok"] * 5 + ["nan", "inf"] + ["ok"] * 7 + ["inf"] + ["ok"] * 4


@pytest.mark.parametrize("kw", [dict(init_scale=2.0**10, growth_interval=3), dict(init_scale=1.0, growth_interval=2,
                                                                                     growth_factor=4.0, backoff_factor=0.25)])
@pytest.mark.parity
def test_trajectory_and_skips_equal_gradscaler(kw):
    ours = _run(lambda: DynamicLossScaler(**kw), PATTERN, False)
    ref = _run(lambda: torch.amp.GradScaler("cpu", **kw), PATTERN, True)
    assert ours[0] == ref[0]
    assert ours[1] == ref[1] == [p == "ok" for p in PATTERN]
    for a, b in zip(ours[2], ref[2]):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("kw, arg", [(dict(init_scale=0), "init_scale"), (dict(growth_factor=1.0), "growth_factor"),
                                     (dict(backoff_factor=1.5), "backoff_factor"), (dict(growth_interval=0), "growth_interval")])
def test_bad_settings(kw, arg):
    with pytest.raises(ValueError, match=arg):
        DynamicLossScaler(**kw)


def test_unscale_before_clipping_and_state_dict():
    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([w], lr=1.0)
    s = DynamicLossScaler(init_scale=8.0)
    s.scale(w.sum()).backward()
    assert torch.equal(w.grad, torch.full((4,), 8.0))
    s.unscale_(opt)
    assert torch.equal(w.grad, torch.ones(4))
    s.step(opt)  # does not unscale twice
    assert torch.equal(w.detach(), torch.zeros(4))
    s.update()
    t = DynamicLossScaler()
    t.load_state_dict(s.state_dict())
    assert t.get_scale() == 8.0 and t.growth_tracker == 1
