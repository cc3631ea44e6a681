"""Lion and Adafactor from scratch: parity with lion-pytorch and transformers, state bytes, bad input, resume."""

import dataclasses
import inspect

import lion_pytorch
import pytest
import torch
import transformers.optimization

from labkit.memory import Ledger
from labkit.memory.report import Category
from labkit.optim import Adafactor, AdafactorHP, Lion, adafactor, factored_second_moment, inverse_sqrt_second_moment, lion, lion_update_naive

SHAPES = [(64, 128), (30, 77), (4, 8, 16), (100,), (1,)]  # matrices, a 3-D tensor, vectors


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small tensors: one thread is faster, and immune to a busy machine's oversubscription."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _params(shapes=SHAPES, seed=0):
    torch.manual_seed(seed)
    return [torch.randn(s) * 0.1 for s in shapes]


def _grads(shapes, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]


def _run(make, init, grads):
    ps = [torch.nn.Parameter(x.clone()) for x in init]
    opt = make(ps)
    for gs in grads:
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        opt.step()
    return ps, opt


def _assert_same(ours, ref, atol):
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, rtol=0, atol=atol)


def _opt_bytes(model, opt):
    x = torch.randn(4, model[0].in_features)
    with Ledger(model, opt) as led:
        for _ in range(2):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return led.measurement().phases["optimizer"][Category.OPT]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.ReLU(), torch.nn.Linear(96, 32))


# ---- Lion ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [{"lr": 1e-3}, {"lr": 3e-4, "betas": (0.95, 0.98), "weight_decay": 0.1},
                                {"lr": 1e-3, "weight_decay": 1e-4, "decoupled_weight_decay": True}])
@pytest.mark.parity
def test_lion_matches_lion_pytorch_over_100_steps(kw):
    ref_cls = lion_pytorch.Lion
    init, grads = _params(), _grads(SHAPES, 100)
    ours, _ = _run(lambda ps: Lion(ps, **kw), init, grads)
    ref, _ = _run(lambda ps: ref_cls(ps, **kw), init, grads)
    _assert_same(ours, ref, atol=1e-6)  # measured: bit-identical


def test_lion_teaching_version_agrees():
    init, grads = _params(SHAPES[:1]), _grads(SHAPES[:1], 30)
    ours, _ = _run(lambda ps: Lion(ps, lr=1e-3, weight_decay=0.1), init, grads)
    p, m = init[0].clone(), torch.zeros_like(init[0])
    for (g,) in grads:
        lion_update_naive(p, g, m, lr=1e-3, weight_decay=0.1)
    torch.testing.assert_close(ours[0].detach(), p, rtol=0, atol=1e-6)


def test_lion_state_is_one_tensor_per_parameter():
    model = _model()
    opt = Lion(model.parameters())
    n = sum(p.numel() for p in model.parameters())
    assert _opt_bytes(model, opt) == 4 * n == sum(lion.state_bytes_for(tuple(p.shape)) for p in model.parameters())


# ---- Adafactor -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [
    {},  # transformers' defaults: relative_step, scale_parameter, no first moment
    {"warmup_init": True},
    {"lr": 1e-3, "relative_step": False, "beta1": 0.9, "weight_decay": 0.01},
    {"lr": 1e-2, "relative_step": False, "scale_parameter": False, "clip_threshold": 0.5, "decay_rate": -0.5},
])
@pytest.mark.parity
def test_adafactor_matches_transformers_over_60_steps(kw):
    ref_cls = transformers.optimization.Adafactor
    init, grads = _params(), _grads(SHAPES, 60)
    ours, _ = _run(lambda ps: Adafactor(ps, **kw), init, grads)
    ref, _ = _run(lambda ps: ref_cls(ps, **kw), init, grads)
    for p, q, x in zip(ours, ref, init):
        assert not torch.equal(q, x)  # the reference moved
    _assert_same(ours, ref, atol=1e-7)  # measured: bit-identical


@pytest.mark.parity
def test_adafactor_bf16_parameters_keep_fp32_state():
    ref_cls = transformers.optimization.Adafactor
    init, grads = [x.bfloat16() for x in _params(SHAPES[:2])], [[g.bfloat16() for g in gs] for gs in _grads(SHAPES[:2], 10)]
    ours, opt = _run(lambda ps: Adafactor(ps), init, grads)
    ref, _ = _run(lambda ps: ref_cls(ps), init, grads)
    _assert_same(ours, ref, atol=0)
    assert opt.state[ours[0]]["exp_avg_sq_row"].dtype == torch.float32


def test_factored_second_moment_is_exact_for_rank_one():
    a, b = torch.rand(6) + 0.1, torch.rand(5) + 0.1
    v = torch.outer(a, b)  # a rank-1 second moment is recovered from its row and column means
    row, col = v.mean(dim=1), v.mean(dim=0)
    torch.testing.assert_close(factored_second_moment(row, col), v)
    torch.testing.assert_close(inverse_sqrt_second_moment(row, col), v.rsqrt())


@pytest.mark.parametrize("beta1", [None, 0.9])
def test_adafactor_state_is_rows_plus_columns(beta1):
    model = _model()
    opt = Adafactor(model.parameters(), beta1=beta1)
    first = sum(p.numel() for p in model.parameters()) if beta1 else 0
    want = 4 * (96 + 48) + 4 * 96 + 4 * (32 + 96) + 4 * 32 + 4 * first  # W1, b1, W2, b2 (+ m)
    assert _opt_bytes(model, opt) == want
    assert want == sum(adafactor.state_bytes_for(tuple(p.shape), beta1) for p in model.parameters())
    assert adafactor.state_bytes_for((4, 8, 16)) == 4 * (4 * 8 + 4 * 16)


# ---- bad input -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, name", [
    ({"lr": 0.0}, "lr"), ({"lr": -1e-4}, "lr"), ({"betas": (1.1, 0.99)}, r"betas\[0\]"),
    ({"betas": (0.9, -0.5)}, r"betas\[1\]"), ({"betas": 0.9}, "betas"), ({"weight_decay": -1.0}, "weight_decay"),
])
def test_lion_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name} must") as e:
        Lion([torch.nn.Parameter(torch.zeros(3))], **kwargs)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kwargs, name", [
    ({"lr": 1e-3}, "lr"),  # with relative_step=True
    ({"relative_step": False}, "lr"), ({"lr": -1.0, "relative_step": False}, "lr"),
    ({"lr": 1e-3, "relative_step": False, "warmup_init": True}, "warmup_init"),
    ({"eps": (1e-30,)}, "eps"), ({"eps": (1e-30, -1.0)}, r"eps\[1\]"), ({"clip_threshold": 0.0}, "clip_threshold"),
    ({"decay_rate": 0.5}, "decay_rate"), ({"beta1": 1.0}, "beta1"), ({"weight_decay": -0.1}, "weight_decay"),
])
def test_adafactor_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name} must|^{name}=True needs") as e:
        Adafactor([torch.nn.Parameter(torch.zeros(3))], **kwargs)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=f"^{name} must|^{name}=True needs"):
        AdafactorHP(**kwargs)  # the same check, in one place


def test_adafactor_takes_transformers_keywords_and_names_an_unknown_one():
    """Every keyword of transformers' Adafactor, as it names them, becomes the group's defaults, checked by
    AdafactorHP; a keyword it does not have is one TypeError that names it."""
    kw = dict(eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8, beta1=0.9, weight_decay=0.01,
              scale_parameter=False, relative_step=False, warmup_init=False)
    ref = transformers.optimization.Adafactor([torch.nn.Parameter(torch.zeros(3))], lr=1e-3, **kw)
    ours = Adafactor([torch.nn.Parameter(torch.zeros(3))], lr=1e-3, **kw)
    assert {k: ours.defaults[k] for k in ref.defaults} == ref.defaults
    assert set(inspect.signature(transformers.optimization.Adafactor).parameters) - {"self", "params"} == {
        f.name for f in dataclasses.fields(AdafactorHP)}
    with pytest.raises(TypeError, match="^Adafactor got an unexpected keyword argument 'betas'; its hyperparameters"):
        Adafactor([torch.nn.Parameter(torch.zeros(3))], betas=(0.9, 0.999))


# ---- resuming ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda ps: Lion(ps, lr=1e-3, weight_decay=0.1),
    lambda ps: Adafactor(ps),
    lambda ps: Adafactor(ps, lr=1e-3, relative_step=False, beta1=0.9, weight_decay=0.01),
], ids=["lion", "adafactor-relative", "adafactor-beta1"])
def test_state_dict_resumes_bit_exact(make, tmp_path):
    init, grads = _params(), _grads(SHAPES, 10)
    ps, opt = _run(make, init, grads[:5])
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    copies = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    fresh = make(copies)
    fresh.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    for gs in grads[5:]:
        for group in (ps, copies):
            for p, g in zip(group, gs):
                p.grad = g.clone()
        opt.step()
        fresh.step()
    for p, q in zip(ps, copies):
        assert torch.equal(p, q)
