"""The from-scratch loss scaler against torch.amp.GradScaler, step by step on CPU.

Every scenario runs twice, once per scaler, from the same seed: scale trajectory, which optimizer
stepped, step()'s return values and the parameters after each step must be identical (bitwise: the
arithmetic is the same), and misuse must raise the same exception type in the same situation.
"""

import copy
import math
import pickle

import pytest
import torch
from torch import nn

from labkit.precision import DynamicLossScaler


def torch_scaler(**kw):
    return torch.amp.GradScaler("cpu", **kw)


def ours(**kw):
    return DynamicLossScaler(**kw)


def _poison(grad, kind):
    if kind == "inf":
        grad[1] = float("inf")
    elif kind == "-inf":
        grad[-1] = float("-inf")
    elif kind == "nan":
        grad[0] = float("nan")
    else:
        assert kind == "ok"


# ---- a single optimizer: the scripted run of good and bad steps ----------------------------------
def _run(scaler_factory, pattern):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.ones(8))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = scaler_factory()
    scales, stepped, weights = [], [], []
    for bad in pattern:
        opt.zero_grad()
        loss = (w * torch.arange(8.0)).sum()
        scaler.scale(loss).backward()
        _poison(w.grad, bad)
        before = w.detach().clone()
        scaler.step(opt)
        stepped.append(not torch.equal(before, w.detach()))
        scaler.update()
        scales.append(scaler.get_scale())
        weights.append(w.detach().clone())
        assert torch.isfinite(w).all()  # poisoned gradients never reach the weights
    return scales, stepped, weights


PATTERN = ["ok"] * 3 + ["inf"] + ["ok"] * 5 + ["nan", "inf"] + ["ok"] * 7 + ["-inf"] + ["ok"] * 4


@pytest.mark.parametrize("kw", [dict(init_scale=2.0**10, growth_interval=3),
                                dict(init_scale=1.0, growth_interval=2, growth_factor=4.0, backoff_factor=0.25),
                                dict(init_scale=0.1, growth_interval=2, growth_factor=1.5, backoff_factor=0.3)])
@pytest.mark.parity
def test_trajectory_and_skips_equal_gradscaler(kw):
    mine = _run(lambda: ours(**kw), PATTERN)
    ref = _run(lambda: torch_scaler(**kw), PATTERN)
    assert mine[0] == ref[0]
    assert mine[1] == ref[1] == [p == "ok" for p in PATTERN]
    for a, b in zip(mine[2], ref[2]):
        assert torch.equal(a, b)


def test_scale_is_an_fp32_number():
    """init 0.1, x1.5, x0.3 are not fp32 numbers: GradScaler rounds S to fp32 at every change.
    A scaler keeping S in double drifts from it, so the test above can tell the two apart."""
    kw = dict(init_scale=0.1, growth_interval=2, growth_factor=1.5, backoff_factor=0.3)
    ref = _run(lambda: torch_scaler(**kw), PATTERN)[0]
    s, tracker, double = 0.1, 0, []
    for bad in PATTERN:
        if bad != "ok":
            s, tracker = s * 0.3, 0
        else:
            tracker += 1
            if tracker == 2:
                s, tracker = s * 1.5, 0
        double.append(s)
    assert double != ref
    assert all(torch.tensor(x, dtype=torch.float32).item() == x for x in ref)


# ---- several optimizers: an inf/nan skips only its own optimizer; update backs off if any saw one ----
PAIRS = ([("ok", "ok")] * 2 + [("inf", "ok"), ("ok", "ok"), ("ok", "nan"), ("ok", "ok"), ("ok", "ok"),
         ("nan", "inf"), ("ok", "ok"), ("ok", "ok"), ("ok", "ok"), ("ok", "-inf"), ("ok", "ok"), ("ok", "ok")])


def _two_optimizers(make, pairs, unscale_first=False):
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(6)), nn.Parameter(torch.randn(5))
    opt_a = torch.optim.SGD([a], lr=0.1, momentum=0.9)
    opt_b = torch.optim.AdamW([b], lr=1e-2)
    sc = make(init_scale=2.0**8, growth_interval=2)
    log = []
    for i, (bad_a, bad_b) in enumerate(pairs):
        opt_a.zero_grad()
        opt_b.zero_grad()
        x, y = torch.linspace(-1.0, 1.0, 6) * (i + 1), torch.linspace(0.5, 2.0, 5)
        loss = (a * x).square().sum() + (b * y).sin().sum()
        sc.scale(loss).backward()
        _poison(a.grad, bad_a)
        _poison(b.grad, bad_b)
        found = None
        if unscale_first:
            found = (sc.unscale_(opt_a), sc.unscale_(opt_b))
            torch.nn.utils.clip_grad_norm_([a], 1.0)  # NaN/inf norms leave poison in place: the step is skipped
        before_a, before_b = a.detach().clone(), b.detach().clone()
        ret = (sc.step(opt_a), sc.step(opt_b))
        sc.update()
        log.append(dict(scale=sc.get_scale(), ret=ret, found=found,
                        stepped=(not torch.equal(before_a, a.detach()), not torch.equal(before_b, b.detach())),
                        adam_steps=int(opt_b.state[b]["step"]) if b in opt_b.state else 0,
                        a=a.detach().clone(), b=b.detach().clone()))
        assert torch.isfinite(a).all() and torch.isfinite(b).all()
    return log


@pytest.mark.parametrize("unscale_first", [False, True])
def test_two_optimizers_inf_in_one_skips_only_that_one(unscale_first):
    mine = _two_optimizers(ours, PAIRS, unscale_first)
    ref = _two_optimizers(torch_scaler, PAIRS, unscale_first)
    for i, (m, r, (bad_a, bad_b)) in enumerate(zip(mine, ref, PAIRS)):
        assert m["scale"] == r["scale"], i
        assert m["stepped"] == r["stepped"] == (bad_a == "ok", bad_b == "ok"), i
        assert m["ret"] == r["ret"] == (None, None), i  # SGD/AdamW return None; a skipped step too
        assert m["adam_steps"] == r["adam_steps"], i
        assert torch.equal(m["a"], r["a"]) and torch.equal(m["b"], r["b"]), i
        if unscale_first:
            assert m["found"] == (bad_a != "ok", bad_b != "ok"), i  # unscale_ says which optimizer saw one
    scales = [r["scale"] for r in ref]
    assert max(scales) > 2.0**8 and min(scales) < 2.0**8  # grew and backed off along the way


def test_an_unscaled_but_unstepped_optimizer_still_counts_in_update():
    def run(make):
        a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
        opt_a, opt_b = torch.optim.SGD([a], lr=0.1), torch.optim.SGD([b], lr=0.1)
        sc = make(init_scale=4.0, growth_interval=1)
        sc.scale(a.sum() + b.sum()).backward()
        b.grad[0] = float("nan")
        sc.unscale_(opt_b)  # b's optimizer found a nan, and is never stepped
        sc.step(opt_a)
        sc.update()
        return sc.get_scale(), a.detach().clone()
    (sm, am), (sr, ar) = run(ours), run(torch_scaler)
    assert sm == sr == 2.0 and torch.equal(am, ar) and torch.equal(am, torch.full((3,), 0.9))


# ---- the scale near fp32's maximum ------------------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(init_scale=2.0**127, growth_factor=2.0, growth_interval=1),
                                dict(init_scale=3.0e38, growth_factor=1.1, growth_interval=1),
                                dict(init_scale=2.0**126, growth_factor=2.0, growth_interval=2)])
def test_scale_never_grows_past_fp32(kw):
    def run(make):
        w = nn.Parameter(torch.full((4,), 2.0**-99))
        opt = torch.optim.SGD([w], lr=0.5)
        sc = make(**kw)
        out = []
        for i in range(6):
            opt.zero_grad()
            sc.scale((w * 2.0**-100).sum()).backward()  # S x 2^-100: finite for every S below 2^128
            ret = sc.step(opt)
            sc.update()
            out.append((sc.get_scale(), sc.state_dict()["_growth_tracker"], ret, w.detach().clone()))
        return out
    mine, ref = run(ours), run(torch_scaler)
    assert [m[:3] for m in mine] == [r[:3] for r in ref]
    assert all(torch.equal(m[3], r[3]) for m, r in zip(mine, ref))
    assert all(math.isfinite(m[0]) and m[0] <= torch.finfo(torch.float32).max for m in mine)
    assert (mine[-1][3] < 2.0**-99).all()  # it did step


def test_scale_growing_to_fp32_max_and_staying():
    sc = ours(init_scale=2.0**127, growth_interval=1)
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    sc.scale(w.sum() * 2.0**-100).backward()
    sc.step(opt)
    sc.update()
    assert sc.get_scale() == 2.0**127 and sc.growth_tracker == 0  # no growth, and the count restarts


def test_backoff_that_would_underflow_raises():
    """GradScaler backs off to S = 0; 1/S is then inf and turns finite gradients into nan that it no longer
    flags, so the weights become nan. The scaler stops with a clear error instead."""
    w = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    ref = torch_scaler(init_scale=1e-45)
    ref.scale(w.sum())
    w.grad = torch.tensor([float("nan"), 0.0, 0.0])
    ref.step(opt)
    ref.update()
    assert ref.get_scale() == 0.0
    opt.zero_grad()
    ref.scale(w.sum()).backward()
    ref.step(opt)
    assert torch.isnan(w).all()  # what GradScaler does

    w = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    sc = ours(init_scale=2.0**-127)  # the smallest S whose 1/S fits fp32 (2^127)
    sc.scale(w.sum()).backward()
    w.grad[0] = float("nan")
    sc.step(opt)
    with pytest.raises(RuntimeError, match="underflow"):
        sc.update()
    assert sc.get_scale() == 2.0**-127 and torch.equal(w.detach(), torch.ones(3))


# ---- bad input --------------------------------------------------------------------------------------
BAD_SETTINGS = [
    (dict(init_scale=0), ValueError), (dict(init_scale=-1.0), ValueError), (dict(init_scale=float("inf")), ValueError),
    (dict(init_scale=float("nan")), ValueError), (dict(init_scale=1e39), ValueError),
    (dict(init_scale=1e-40), ValueError), (dict(init_scale=True), TypeError), (dict(init_scale="1"), TypeError),
    (dict(init_scale=None), TypeError), (dict(growth_factor=1.0), ValueError), (dict(growth_factor=0.5), ValueError),
    (dict(growth_factor=float("inf")), ValueError), (dict(growth_factor=float("nan")), ValueError),
    (dict(growth_factor=True), TypeError), (dict(growth_factor="2"), TypeError),
    (dict(backoff_factor=0.0), ValueError), (dict(backoff_factor=1.0), ValueError),
    (dict(backoff_factor=1.5), ValueError), (dict(backoff_factor=-0.5), ValueError),
    (dict(backoff_factor=float("nan")), ValueError), (dict(backoff_factor=False), TypeError),
    (dict(growth_interval=0), ValueError), (dict(growth_interval=-3), ValueError),
    (dict(growth_interval=2**31), ValueError), (dict(growth_interval=2.0), TypeError),
    (dict(growth_interval=True), TypeError), (dict(growth_interval="5"), TypeError),
    (dict(enabled=1), TypeError), (dict(enabled="yes"), TypeError),
]


@pytest.mark.parametrize("kw, exc", BAD_SETTINGS)
def test_bad_settings(kw, exc):
    (arg,) = kw
    with pytest.raises(exc, match=arg) as info:
        ours(**kw)
    assert "\n" not in str(info.value)


def test_bad_settings_are_refused_on_every_way_in():
    sc = ours(init_scale=8.0, growth_interval=4)
    for name, value in [("growth_factor", 1.0), ("backoff_factor", 2.0), ("growth_interval", 0)]:
        with pytest.raises(ValueError, match=name):
            setattr(sc, name, value)
    with pytest.raises(TypeError, match="growth_interval"):
        sc.growth_interval = 1.5
    good = sc.state_dict()
    for key, value, exc in [("scale", -1.0, ValueError), ("scale", float("inf"), ValueError),
                            ("growth_factor", 0.9, ValueError), ("growth_interval", "3", TypeError),
                            ("_growth_tracker", 4, ValueError), ("_growth_tracker", -1, ValueError)]:
        with pytest.raises(exc, match=key):
            sc.load_state_dict({**good, key: value})
    assert sc.state_dict() == good  # nothing half-loaded
    for value, exc in [(0.0, ValueError), (float("nan"), ValueError), ("4", TypeError), (True, TypeError),
                       (torch.ones(2), ValueError), (torch.ones((), requires_grad=True), ValueError)]:
        with pytest.raises(exc, match="new_scale"):
            sc.update(new_scale=value)
    assert sc.get_scale() == 8.0
    with pytest.raises(TypeError, match="Optimizer"):
        sc.step(object())


def _setup(make):
    w = nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([w], lr=0.1)
    sc = make(init_scale=8.0)
    sc.scale(w.sum()).backward()
    return sc, opt, w


def _step_twice(sc, opt, w):
    sc.step(opt)
    sc.step(opt)


def _unscale_twice(sc, opt, w):
    sc.unscale_(opt)
    sc.unscale_(opt)


def _unscale_after_step(sc, opt, w):
    sc.step(opt)
    sc.unscale_(opt)


def _closure(sc, opt, w):
    sc.step(opt, closure=lambda: w.sum())


def _load_empty(sc, opt, w):
    sc.load_state_dict({})


def _load_partial(sc, opt, w):
    sc.load_state_dict({"scale": 4.0})


def _fp16_grads(sc, opt, w):
    m = nn.Linear(4, 4).half()
    m(torch.randn(2, 4).half()).sum().backward()
    sc.unscale_(torch.optim.SGD(m.parameters(), lr=0.1))


@pytest.mark.parametrize("misuse, exc", [(_step_twice, RuntimeError), (_unscale_twice, RuntimeError),
                                         (_unscale_after_step, RuntimeError), (_closure, RuntimeError),
                                         (_load_empty, RuntimeError), (_load_partial, KeyError),
                                         (_fp16_grads, ValueError)])
def test_misuse_raises_as_gradscaler(misuse, exc):
    results = []
    for make in (ours, torch_scaler):
        sc, opt, w = _setup(make)
        with pytest.raises(exc) as info:
            misuse(sc, opt, w)
        assert "\n" not in str(info.value)
        results.append((w.detach().clone(), w.grad.clone()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("misuse", ["update_without_step", "step_without_grads", "pickle_mid_iteration"])
def test_misuse_gradscaler_asserts_on_raises_runtime_error(misuse):
    """GradScaler reports these with an AssertionError; the labkit scaler, in the same situation, raises a
    RuntimeError (an assertion is for the library's own bugs, not for the caller's order of calls)."""
    for make, exc in ((torch_scaler, AssertionError), (ours, RuntimeError)):
        sc, opt, w = _setup(make)
        with pytest.raises(exc):
            if misuse == "update_without_step":
                sc.update()
            elif misuse == "step_without_grads":
                sc.step(torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1))
            else:
                sc.step(opt)
                pickle.dumps(sc)


def test_fp16_gradients_are_refused_before_any_gradient_changes():
    a = nn.Parameter(torch.ones(3))
    b = nn.Parameter(torch.ones(3, dtype=torch.float16))
    a.grad, b.grad = torch.full((3,), 8.0), torch.full((3,), 8.0, dtype=torch.float16)
    sc = ours(init_scale=8.0)
    with pytest.raises(ValueError, match="fp16"):
        sc.unscale_(torch.optim.SGD([a, b], lr=0.1))
    assert torch.equal(a.grad, torch.full((3,), 8.0))


def test_after_a_refused_step_the_iteration_goes_on_as_in_gradscaler():
    def run(make):
        sc, opt, w = _setup(make)
        sc.step(opt)
        with pytest.raises(RuntimeError):
            sc.step(opt)
        sc.update()
        opt.zero_grad()
        sc.scale(w.sum()).backward()
        return sc.step(opt), sc.update(), sc.get_scale(), w.detach().clone()
    mine, ref = run(ours), run(torch_scaler)
    assert mine[:3] == ref[:3] and torch.equal(mine[3], ref[3])


# ---- enabled=False: a pass-through ----------------------------------------------------------------
def test_disabled_is_a_pass_through_like_gradscaler():
    out = []
    for make in (ours, torch_scaler):
        w = nn.Parameter(torch.ones(4))
        opt = torch.optim.SGD([w], lr=0.1)
        sc = make(init_scale=8.0, enabled=False)
        loss = w.square().sum()
        assert sc.scale(loss) is loss and not sc.is_enabled()
        loss.backward()
        sc.unscale_(opt)
        assert torch.equal(w.grad, torch.full((4,), 2.0))  # untouched

        def closure():
            return w.sum().detach()
        ret = sc.step(opt, closure)  # closures pass through too
        sc.step(opt)  # no per-optimizer bookkeeping: twice is fine
        sc.update()
        sc.update()
        sc.load_state_dict({})
        sc.load_state_dict({"scale": 1.0})
        out.append((ret, sc.get_scale(), sc.state_dict(), w.detach().clone()))
    assert out[0][:3] == out[1][:3] == (torch.tensor(4.0), 1.0, {})
    assert torch.equal(out[0][3], out[1][3])


# ---- scale(), unscale_() and their arithmetic ---------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("init_scale", [2.0**16, 0.1, 3.0e38])
def test_scale_bitwise(dtype, init_scale):
    torch.manual_seed(0)
    loss = torch.randn(17).to(dtype)
    for outputs in (loss, [loss, (loss[:3], loss[5:])]):
        mine = ours(init_scale=init_scale).scale(outputs)
        ref = torch_scaler(init_scale=init_scale).scale(outputs)
        flat = lambda x: [x] if isinstance(x, torch.Tensor) else [t for o in x for t in flat(o)]  # noqa: E731
        assert type(mine) is type(ref)
        for m, r in zip(flat(mine), flat(ref), strict=True):
            assert m.dtype == r.dtype and torch.equal(m, r)
    assert [torch.equal(m, r) for m, r in zip(ours().scale(iter([loss])), torch_scaler().scale(iter([loss])))] == [True]
    for make in (ours, torch_scaler):
        with pytest.raises(ValueError):
            make().scale(3.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("init_scale", [2.0**12, 0.1, 1000.0])
def test_unscale_bitwise_per_dtype(dtype, init_scale):
    grads = []
    for make in (ours, torch_scaler):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)).to(dtype)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        sc = make(init_scale=init_scale)
        sc.scale(m(torch.randn(5, 8, dtype=dtype)).float().square().sum()).backward()
        sc.unscale_(opt)
        grads.append([p.grad.clone() for p in m.parameters()])
    assert all(a.dtype == dtype and torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_sparse_gradients():
    out = []
    for make in (ours, torch_scaler):
        torch.manual_seed(0)
        emb = nn.Embedding(10, 4, sparse=True)
        opt = torch.optim.SGD(emb.parameters(), lr=0.5)
        sc = make(init_scale=2.0**10, growth_interval=1)
        for i, bad in enumerate(["ok", "inf", "ok"]):
            opt.zero_grad()
            sc.scale(emb(torch.tensor([1, 3, 3, i])).square().sum()).backward()
            if bad == "inf":
                emb.weight.grad._values()[0, 0] = float("inf")
            sc.step(opt)
            sc.update()
            out.append((sc.get_scale(), emb.weight.detach().clone()))
    mine, ref = out[:3], out[3:]
    assert [m[0] for m in mine] == [r[0] for r in ref] == [2.0**11, 2.0**10, 2.0**11]
    assert all(torch.equal(m[1], r[1]) for m, r in zip(mine, ref))


def test_unscale_before_clipping_and_state_dict():
    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([w], lr=1.0)
    s = DynamicLossScaler(init_scale=8.0)
    s.scale(w.sum()).backward()
    assert torch.equal(w.grad, torch.full((4,), 8.0))
    assert s.unscale_(opt) is False
    assert torch.equal(w.grad, torch.ones(4))
    assert s.step(opt) is None  # does not unscale twice; returns what SGD.step returns
    assert torch.equal(w.detach(), torch.zeros(4))
    s.update()
    t = DynamicLossScaler()
    t.load_state_dict(s.state_dict())
    assert t.get_scale() == 8.0 and t.growth_tracker == 1
    t.load_state_dict({"scale": 4.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
                       "growth_tracker": 3})  # the key this class used before
    assert t.get_scale() == 4.0 and t.growth_tracker == 3


# ---- checkpoints: either scaler loads the other's state and goes on identically ----------------------
def _continue(sc, pattern, seed=0):
    torch.manual_seed(seed)
    w = nn.Parameter(torch.randn(5))
    opt = torch.optim.SGD([w], lr=0.1)
    scales = []
    for bad in pattern:
        opt.zero_grad()
        sc.scale((w * torch.arange(5.0)).sum()).backward()
        _poison(w.grad, bad)
        sc.step(opt)
        sc.update()
        scales.append((sc.get_scale(), sc.state_dict()["_growth_tracker"]))
    return scales, w.detach()


@pytest.mark.parametrize("first, second", [(ours, torch_scaler), (torch_scaler, ours)])
def test_state_dict_round_trips_with_gradscaler(first, second):
    kw = dict(init_scale=0.1, growth_factor=1.5, backoff_factor=0.3, growth_interval=3)
    a = first(**kw)
    _continue(a, ["ok", "inf", "ok", "ok"])
    state = a.state_dict()
    assert set(state) == {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
    b = second()
    b.load_state_dict(state)
    rest = ["ok", "ok", "nan", "ok", "ok", "ok", "ok"]
    (sa, wa), (sb, wb) = _continue(a, rest, 1), _continue(b, rest, 1)
    assert sa == sb and torch.equal(wa, wb)


def test_update_with_new_scale_keeps_the_growth_count_as_gradscaler():
    out = []
    for make in (ours, torch_scaler):
        sc = make(init_scale=16.0, growth_interval=3)
        _continue(sc, ["ok", "ok"])
        w = nn.Parameter(torch.ones(2))
        sc.scale(w.sum()).backward()
        sc.step(torch.optim.SGD([w], lr=0.1))
        sc.update(new_scale=4.0)  # this step's check is ignored; the count stays at 2
        out.append([(sc.get_scale(), sc.state_dict()["_growth_tracker"])] + _continue(sc, ["ok", "ok"])[0])
        sc.update(new_scale=torch.tensor(0.1, dtype=torch.float64))
        out[-1].append(sc.get_scale())
    assert out[0] == out[1]
    assert out[0][:3] == [(4.0, 2), (8.0, 0), (8.0, 1)]


def test_pickle_and_deepcopy_between_iterations():
    sc = ours(init_scale=0.1, growth_interval=3)
    _continue(sc, ["ok", "inf", "ok"])
    for clone in (pickle.loads(pickle.dumps(sc)), copy.deepcopy(sc)):
        assert clone.state_dict() == sc.state_dict()
        assert _continue(clone, ["ok"] * 4)[0] == _continue(copy.deepcopy(sc), ["ok"] * 4)[0]


def test_the_check_is_on_the_scaled_gradient():
    """As GradScaler's kernel: inf/nan is looked for in the scaled gradient, before the unscale. With S < 1 a
    finite scaled gradient can overflow when divided by S; like GradScaler, that is not a skip (the true
    gradient itself is beyond fp32, with or without a scaler)."""
    out = []
    for make in (ours, torch_scaler):
        w = nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([w], lr=1.0)
        sc = make(init_scale=0.5, growth_interval=1)
        sc.scale(w.sum()).backward()
        w.grad[0] = 3.0e38  # finite; x 1/S = 6e38 overflows
        found = sc.unscale_(opt)
        sc.step(opt)
        sc.update()
        out.append((found, sc.get_scale(), w.grad.clone(), w.detach().clone()))
    assert out[0][0] is False
    assert out[0][1] == out[1][1] == 1.0  # a clean step: S grew
    assert torch.equal(out[0][2], out[1][2]) and out[0][2][0] == math.inf
    assert torch.equal(out[0][3], out[1][3])


@pytest.mark.parametrize("opt_kw", [dict(fused=True), dict(foreach=True), dict(foreach=False)])
def test_fused_and_foreach_adamw(opt_kw):
    """GradScaler hands a fused optimizer (_step_supports_amp_scaling) S and found_inf and lets its kernel
    unscale and skip; the labkit scaler unscales and skips itself. Same scale, same weights. (A skipped
    first step still creates GradScaler's fused AdamW state, with step 0; here the state starts later.)"""
    logs = []
    for make in (ours, torch_scaler):
        torch.manual_seed(0)
        w = nn.Parameter(torch.randn(7))
        opt = torch.optim.AdamW([w], lr=1e-2, **opt_kw)
        sc = make(init_scale=2.0**8, growth_interval=2)
        log = []
        for i, bad in enumerate(["inf", "ok", "ok", "nan", "ok", "ok", "ok"]):
            opt.zero_grad()
            sc.scale((w * torch.arange(7.0) * (i + 1)).sin().sum()).backward()
            _poison(w.grad, bad)
            sc.step(opt)
            sc.update()
            log.append((sc.get_scale(), int(opt.state[w]["step"]) if w in opt.state else 0, w.detach().clone()))
        logs.append(log)
    for m, r in zip(*logs):
        assert m[:2] == r[:2] and torch.equal(m[2], r[2])
    assert logs[0][-1][1] == 5  # five real steps of seven
