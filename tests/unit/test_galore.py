"""labkit.optim GaLore (fp32 and 8-bit) against galore-torch, and its state bytes against the Ledger."""

import copy
import io

import pytest
import torch

from labkit.memory import Category, Ledger
from labkit.run import train_step
from labkit.models.gpt import GPT, GPTConfig
from labkit.optim import galore as gl
from labkit.optim import galore8bit as gl8
from labkit.optim.base import state_bytes
from labkit.optim.galore import GaLoreAdamW, GaLoreHP, galore_adam_naive, galore_param_groups
from labkit.optim.galore8bit import GaLoreAdamW8bit
from labkit.quant.dynamic import dequantize_blockwise, dynamic_map, quantize_blockwise

import galore_torch

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # galore-torch's AdamW deprecation notice

CFG = GPTConfig(n_layer=2, n_embd=64, n_head=2, vocab_size=64, block_size=32)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def no_cuda_sync(monkeypatch):
    """galore-torch's GaLoreAdamW8bit calls torch.cuda.synchronize() unconditionally, which raises on a
    CPU-only torch; everything else in it (bitsandbytes >= 0.50 kernels) runs on CPU."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)


EPS = torch.finfo(torch.float32).eps


def _parity_atol(params, steps: int, rank: int) -> float:
    """What two correct fp32 GaLore-Adam implementations may differ by after `steps` steps.

    They do the same arithmetic except the order of accumulation in the back-projection: labkit adds
    scale*P@N into p inside one addmm_, the reference rounds P@N (a sum of `rank` products), scales it,
    then adds it. So per step each value may take up to rank + 1 different roundings, each at most
    eps of the largest value involved (<= max|p|: the updates are far smaller); over `steps` steps,
    steps * (rank + 1) * eps * max|p|. A sign flipped or a bias correction missing moves values by
    about lr*scale (1e-3 here), hundreds of times more."""
    return steps * (rank + 1) * EPS * max(p.detach().abs().max().item() for p in params)


def _vector_dim(P: torch.Tensor, side: str) -> int:
    """The dim along which each singular vector of projector P runs: down the columns of U[:, :r]
    (left, P is (m, r)), along the rows of Vh[:r] (right, P is (r, n))."""
    return 0 if side == "left" else 1


@pytest.fixture
def svd_sign_convention(monkeypatch):
    """torch.linalg.svd, as both galore-torch and labkit call it, with one sign convention: each singular
    triplet (U[:, i], Vh[i]) is flipped, both together, so that the largest-|.| entry of U[:, i] is
    positive. An SVD fixes each singular vector only up to its sign, and MKL's gesdd picks it in a way
    that a 1e-8 change of the input (one ulp of a gradient, from another GEMM order or another CPU's
    kernels) can flip. GaLore does not reproject its moments when P changes, so a vector flipped in one
    optimizer and not the other at a refresh adds the new projected gradient to the old moment in one
    and subtracts it in the other: a real 1e-3 divergence of two correct implementations. With this
    convention both get the same signs from nearly equal gradients. Returns the list of inputs seen."""
    svd, seen = torch.linalg.svd, []

    def signed_svd(A, full_matrices=True, **kw):
        U, S, Vh = svd(A, full_matrices=full_matrices, **kw)
        sign = torch.sign(U.gather(-2, U.abs().argmax(dim=-2, keepdim=True)))  # (..., 1, k)
        seen.append(tuple(A.shape))
        return torch.return_types.linalg_svd((U * sign, S, Vh * sign.transpose(-2, -1)))

    monkeypatch.setattr(torch.linalg, "svd", signed_svd)
    return seen


def _groups(ps, rank=8, gap=3, proj_type="std"):
    return [{"params": ps[:-1], "rank": rank, "update_proj_gap": gap, "scale": 0.25, "proj_type": proj_type},
            {"params": ps[-1:]}]


def _twins(shapes, seed=0):
    torch.manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(s) * 0.1) for s in shapes]
    return ps, [torch.nn.Parameter(p.detach().clone()) for p in ps]


def _feed(ps, qs):
    for p, q in zip(ps, qs):
        g = torch.randn_like(p)
        p.grad, q.grad = g.clone(), g.clone()


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab_size, (2, 17), generator=g) for _ in range(n)]


# ---- fp32 GaLore -------------------------------------------------------------------------------------------
@pytest.mark.parity
def test_naive_matches_optimizer():
    torch.manual_seed(0)
    w1 = torch.randn(24, 40)
    w2 = torch.nn.Parameter(w1.clone())
    opt = GaLoreAdamW([{"params": [w2], "rank": 4, "update_proj_gap": 2, "scale": 0.5}], lr=1e-2)
    state, hp = {}, GaLoreHP(rank=4, lr=1e-2, scale=0.5, update_proj_gap=2)
    for _ in range(5):
        g = torch.randn(24, 40)
        galore_adam_naive(w1, g, state, hp)
        w2.grad = g
        opt.step()
    assert state["P"].shape == (24, 4) and state["m"].shape == (4, 40)
    torch.testing.assert_close(w1, w2.detach(), rtol=0, atol=1e-6)


def test_galore_hp_names_a_bad_field():
    for bad, msg in ((dict(rank=0), "^rank must be an integer >= 1"), (dict(rank=4, lr=-1.0), "^lr must be"),
                     (dict(rank=4, betas=(0.9,)), "^betas must be a tuple of 2"), (dict(rank=4, scale=0), "^scale"),
                     (dict(rank=4, update_proj_gap=0), "^update_proj_gap must be an integer >= 1")):
        with pytest.raises(ValueError, match=msg):
            GaLoreHP(**bad)


@pytest.mark.parity
@pytest.mark.parametrize("proj_type", ["std", "reverse_std", "left", "right"])
def test_parity_with_galore_torch(proj_type):
    """Identical gradients, projector refreshed 4 times: the same gradient goes into the same SVD, so
    the projectors agree (up to each vector's sign) and the parameters differ only by the rounding of
    the back-projection (see _parity_atol; measured 3e-8)."""
    ps, qs = _twins([(32, 96), (96, 32), (48, 48), (64,)])
    ref = galore_torch.GaLoreAdamW(_groups(ps, proj_type=proj_type), lr=1e-2, weight_decay=0.1)
    ours = GaLoreAdamW(_groups(qs, proj_type=proj_type), lr=1e-2, weight_decay=0.1)
    for _ in range(10):
        _feed(ps, qs)
        ref.step()
        ours.step()
    atol = _parity_atol(ps, steps=10, rank=8)
    for p, q in zip(ps, qs):
        torch.testing.assert_close(q.detach(), p.detach(), rtol=0, atol=atol)
    for p, q in zip(ps[:3], qs[:3]):
        Pr, Po = ref.state[p]["projector"].ortho_matrix, ours.state[q]["projector"]
        assert Po.shape == Pr.shape
        dim = _vector_dim(Po, gl.projection_side(p.shape, proj_type))
        sign = torch.sign((Po * Pr).sum(dim=dim, keepdim=True))  # one sign per singular vector
        assert sign.numel() == 8
        torch.testing.assert_close(Po, Pr * sign, rtol=0, atol=8 * EPS)  # unit vectors: a few ulps of 1
    assert (qs[0].detach() - ps[0].detach()).abs().max() < atol < qs[0].detach().abs().max()


@pytest.mark.parity
def test_parity_on_gpt_training(svd_sign_convention):
    """Real gradients from a GPT, projector refreshed every 2 steps (3 times): parameters within
    _parity_atol after 6 steps (measured 2.6e-7 of 6.8e-6). The two models' gradients drift apart by
    an ulp after the first step, so each SVD sees slightly different inputs in the two optimizers:
    without one sign convention for both (svd_sign_convention) a vector flips now and then (which ones
    depends on the CPU's kernels) and the parameters differ by 2e-3 to 4e-3."""
    torch.manual_seed(0)
    a = GPT(CFG)
    b = copy.deepcopy(a)
    oa = galore_torch.GaLoreAdamW(galore_param_groups(a, rank=8, update_proj_gap=2), lr=1e-2)
    ob = GaLoreAdamW(galore_param_groups(b, rank=8, update_proj_gap=2), lr=1e-2)
    for x in _batches(6):
        for m, o in ((a, oa), (b, ob)):
            train_step(m, o, x[:, :-1], x[:, 1:])
    assert len(svd_sign_convention) == 2 * 3 * 4 * CFG.n_layer  # both optimizers' SVDs had the convention
    moved = max((p - q).abs().max().item() for p, q in zip(GPT(CFG).parameters(), b.parameters()))
    diff = max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))
    assert diff <= _parity_atol(a.parameters(), steps=6, rank=8) and moved > 1e-2


def test_param_groups_choose_attention_and_mlp_matrices():
    m = GPT(CFG)
    rest, gal = galore_param_groups(m, rank=8)
    names = {id(p): n for n, p in m.named_parameters()}
    chosen = sorted(names[id(p)] for p in gal["params"])
    assert len(chosen) == 4 * CFG.n_layer
    assert all(n.endswith(".weight") and (".attn." in n or ".mlp." in n) for n in chosen)
    assert {names[id(p)] for p in rest["params"]} >= {"wte.weight", "ln_f.weight", "blocks.0.attn.c_attn.bias"}
    assert len(rest["params"]) + len(gal["params"]) == len(list(m.parameters()))
    assert gal["rank"] == 8 and gal["update_proj_gap"] == 200 and gal["scale"] == 0.25


def test_state_bytes_equal_formula_under_ledger():
    """OPT = r*(min(m, n) + 2*max(m, n)) floats per GaLore matrix + 2 floats per other value, exactly."""
    torch.manual_seed(0)
    m = GPT(CFG)
    rest, gal = galore_param_groups(m, rank=8, update_proj_gap=2)
    expected = sum(4 * 8 * (min(p.shape) + 2 * max(p.shape)) for p in gal["params"]) \
        + sum(8 * p.numel() for p in rest["params"])
    assert expected == sum(gl.state_bytes_for(p.shape, 8) for p in gal["params"]) \
        + sum(gl.state_bytes_for(p.shape, None) for p in rest["params"])
    opt = GaLoreAdamW([rest, gal], lr=1e-3)
    with Ledger(m, opt) as led:
        for x in _batches(3):
            train_step(m, opt, x[:, :-1], x[:, 1:])
        live = led.live()
    assert live[Category.OPT] == expected == state_bytes(opt)
    assert live[Category.TEMP] == 0  # nothing of the step outlives it (the reference keeps whole U/Vh)
    c_fc = m.blocks[0].mlp.c_fc.weight  # (256, 64): right side, P is (r, 64), moments (256, r)
    assert opt.state[c_fc]["projector"].shape == (8, 64) and opt.state[c_fc]["exp_avg"].shape == (256, 8)


def test_resume_from_state_dict_is_identical():
    torch.manual_seed(0)
    a = GPT(CFG)
    b = copy.deepcopy(a)
    oa = GaLoreAdamW(galore_param_groups(a, rank=8, update_proj_gap=2), lr=1e-2, weight_decay=0.1)
    batches = _batches(6)
    for x in batches[:3]:
        train_step(a, oa, x[:, :-1], x[:, 1:])
    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "opt": oa.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    b.load_state_dict(saved["model"])
    ob = GaLoreAdamW(galore_param_groups(b, rank=8, update_proj_gap=2), lr=1e-2, weight_decay=0.1)
    ob.load_state_dict(saved["opt"])
    for x in batches[3:]:  # step 4 refreshes the projector
        for m, o in ((a, oa), (b, ob)):
            train_step(m, o, x[:, :-1], x[:, 1:])
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("cls", [GaLoreAdamW, GaLoreAdamW8bit])
@pytest.mark.parametrize("kwargs, group, name", [
    ({"lr": -1.0}, {}, "lr"), ({"lr": float("nan")}, {}, "lr"), ({"betas": (1.0, 0.9)}, {}, "betas[0]"),
    ({"betas": (0.9,)}, {}, "betas"), ({}, {"rank": 0}, "rank"), ({}, {"rank": 33}, "rank"),
    ({}, {"rank": 2.5}, "rank"), ({}, {"update_proj_gap": 0}, "update_proj_gap"), ({}, {"scale": 0.0}, "scale"),
    ({}, {"proj_type": "full"}, "proj_type"), ({"eps": -1e-8}, {}, "eps"),
])
def test_bad_input_raises_one_line(cls, kwargs, group, name):
    w = torch.nn.Parameter(torch.zeros(32, 48))
    with pytest.raises(ValueError, match=rf"^{name.replace('[', '.').replace(']', '.')}") as e:
        cls([{"params": [w], "rank": 4, **group}], **kwargs)
    assert "\n" not in str(e.value)


def test_vectors_and_oversized_rank_are_refused():
    with pytest.raises(ValueError, match="^rank"):
        GaLoreAdamW([{"params": [torch.nn.Parameter(torch.zeros(8))], "rank": 2}])
    with pytest.raises(ValueError, match="^rank"):
        galore_param_groups(GPT(CFG), rank=65)  # n_embd is 64


# ---- 8-bit GaLore ------------------------------------------------------------------------------------------
@pytest.mark.parity
def test_8bit_parity_with_galore_torch(no_cuda_sync):
    """Same gradients; projected states of >= 4096 values are 8-bit in both. bitsandbytes' native CPU
    quantizer picks a neighbouring code now and then (see test_quant_dynamic), so the parameter
    changes agree to a relative 1e-2 (measured 1e-3 to 3.4e-3); the fp32-state vector exactly."""
    ps, qs = _twins([(64, 256), (256, 64), (48, 512), (64, 128), (300,)])
    groups = lambda ps: [{"params": ps[:3], "rank": 16, "update_proj_gap": 3, "scale": 0.25, "proj_type": "std"},
                         {"params": ps[3:]}]
    start = [p.detach().clone() for p in ps]
    ref = galore_torch.GaLoreAdamW8bit(groups(ps), lr=1e-2, weight_decay=0.1)
    ours = GaLoreAdamW8bit(groups(qs), lr=1e-2, weight_decay=0.1)
    for _ in range(6):
        _feed(ps, qs)
        ref.step()
        ours.step()
    for p, q, s in zip(ps, qs, start):
        dr, do = p.detach() - s, q.detach() - s
        assert ((do - dr).norm() / dr.norm()).item() < 1e-2
    assert ours.state[qs[0]]["exp_avg_codes"].dtype == torch.uint8
    assert ours.state[qs[0]]["exp_avg_codes"].shape == ref.state[ps[0]]["state1"].shape == (16, 256)
    assert torch.equal(qs[4].detach(), ps[4].detach())


def test_8bit_state_is_blockwise_dynamic_quantization():
    """After one step m = (1-b1)*R and v = (1-b2)*R*R exactly; the stored codes and absmax are
    labkit.quant's blockwise quantization of them, m with the signed map and v with the unsigned one."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 256))
    opt = GaLoreAdamW8bit([{"params": [w], "rank": 32, "update_proj_gap": 5}], betas=(0.9, 0.99))
    w.grad = torch.randn(64, 256)
    opt.step()
    st = opt.state[w]
    R = st["projector"].t() @ w.grad  # (32, 256): left projection, 8192 values, 8-bit
    for name, x, signed in (("exp_avg", 0.1 * R, True), ("exp_avg_sq", 0.01 * R * R, False)):
        codes, absmax = quantize_blockwise(x, dynamic_map(signed=signed))
        torch.testing.assert_close(st[f"{name}_absmax"], absmax, rtol=1e-6, atol=0)
        assert (st[f"{name}_codes"] == codes).float().mean() > 0.999
        back = dequantize_blockwise(st[f"{name}_codes"], st[f"{name}_absmax"], dynamic_map(signed=signed))
        assert (back - x).abs().max() <= 0.05 * x.abs().max()


def _step_overheads(meas):
    """Per optimizer phase: the most bytes live during it minus the bytes live when it began."""
    total, marks, out = meas.timeline.total, meas.timeline.phase_starts, []
    for i, (ev, phase, _) in enumerate(marks):
        end = marks[i + 1][0] if i + 1 < len(marks) else len(total)
        if phase == "optimizer" and end > ev:
            out.append(max(total[ev:end]) - (total[ev - 1] if ev else 0))
    return out


def _measure_one_matrix(cls, m_=128, n_=512, r=16):
    torch.manual_seed(0)
    lin = torch.nn.Linear(n_, m_, bias=False)  # weight (m, n), m < n: left projection
    opt = cls([{"params": [lin.weight], "rank": r, "update_proj_gap": 2, "scale": 0.25,
                            "proj_type": "std"}], lr=1e-3, weight_decay=0.0)
    ptr = lin.weight.data_ptr()
    with Ledger(lin, opt) as led:
        for _ in range(2):
            lin(torch.randn(4, n_)).sum().backward()
            opt.step()
            opt.zero_grad()
        live = led.live()
    return _step_overheads(led.measurement()), live, lin.weight.data_ptr() == ptr


@pytest.mark.parametrize("cls, ref_cls, per_value", [(GaLoreAdamW, "GaLoreAdamW", 8),
                                                    (GaLoreAdamW8bit, "GaLoreAdamW8bit", 16)])
def test_step_makes_no_weight_sized_temporary(no_cuda_sync, cls, ref_cls, per_value):
    """Step 1 holds the SVD (U, S, Vh) and the new projector; step 2 only R-sized tensors (8 or 16
    bytes per value of R): the back-projection is accumulated into the weight by addmm_. The
    reference makes (m, n) temporaries: two in fp32, and in 8-bit a clone of the weight, which then
    replaces the parameter's storage (the Ledger sees PARAM bytes become a TEMP clone)."""
    m_, n_, r = 128, 512, 16
    k = min(m_, n_)
    ours, live, same_storage = _measure_one_matrix(cls, m_, n_, r)
    ref, ref_live, _ = _measure_one_matrix(getattr(galore_torch, ref_cls), m_, n_, r)
    assert ours[0] == 4 * (m_ * k + k + k * n_) + 4 * r * k
    assert ours[1] == per_value * r * n_ < 4 * m_ * n_ <= ref[1]
    assert same_storage and live[Category.PARAM] == 4 * m_ * n_
    if cls is GaLoreAdamW8bit:
        assert live[Category.OPT] == gl8.state_bytes_for((m_, n_), r) == 4 * r * m_ + 2 * r * n_ + 8 * (r * n_ // 256)
        assert ref_live[Category.PARAM] == 0
    else:
        assert live[Category.OPT] == gl.state_bytes_for((m_, n_), r)
        # its projector (an object in the state: the Ledger walks its attributes) is a view that keeps all of U alive
        assert ref_live[Category.OPT] - live[Category.OPT] == 4 * k * k - 4 * r * k and ref_live[Category.TEMP] == 0


def test_8bit_state_bytes_under_ledger_and_resume():
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=1, n_embd=64, n_head=2, vocab_size=64, block_size=32)
    a = GPT(cfg)
    b = copy.deepcopy(a)
    rest, gal = galore_param_groups(a, rank=16, update_proj_gap=2)
    oa = GaLoreAdamW8bit([rest, gal], lr=1e-2)
    expected = sum(gl8.state_bytes_for(p.shape, 16) for p in gal["params"]) \
        + sum(gl8.state_bytes_for(p.shape, None) for p in rest["params"])
    batches = _batches(5)
    with Ledger(a, oa) as led:
        for x in batches[:3]:
            train_step(a, oa, x[:, :-1], x[:, 1:])
        assert led.live()[Category.OPT] == expected == state_bytes(oa)
    assert any("exp_avg_codes" in s for s in oa.state.values())
    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "opt": oa.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    b.load_state_dict(saved["model"])
    ob = GaLoreAdamW8bit(galore_param_groups(b, rank=16, update_proj_gap=2), lr=1e-2)
    ob.load_state_dict(saved["opt"])
    for x in batches[3:]:
        for m, o in ((a, oa), (b, ob)):
            train_step(m, o, x[:, :-1], x[:, 1:])
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


# ---- 8-bit GaLore's projector precision -------------------------------------------------------------------
PROJ_CASES = [(dt, pd) for dt in (torch.float32, torch.bfloat16) for pd in gl8.PROJ_DTYPES]


@pytest.mark.parametrize("dtype, proj_dtype", PROJ_CASES, ids=[f"{d}-{p}".replace("torch.", "") for d, p in PROJ_CASES])
def test_8bit_state_bytes_equal_the_ledger_for_each_projector_precision(dtype, proj_dtype):
    """OPT under the Ledger, after three steps (a refresh at the third), equals state_bytes_for with proj_dtype,
    byte for byte: GaLore matrices of >= and < 4096 projected values, and the plain 8-bit parameters."""
    torch.manual_seed(0)
    m = GPT(GPTConfig(n_layer=1, n_embd=64, n_head=2, vocab_size=64, block_size=32)).to(dtype)
    rest, gal = galore_param_groups(m, rank=16, update_proj_gap=2)
    opt = GaLoreAdamW8bit([rest, gal], lr=1e-2, proj_dtype=proj_dtype)
    d = torch.finfo(dtype).bits // 8
    expected = sum(gl8.state_bytes_for(p.shape, 16, d, proj_dtype=proj_dtype) for p in gal["params"]) \
        + sum(gl8.state_bytes_for(p.shape, None, d) for p in rest["params"])
    with Ledger(m, opt) as led:
        for x in _batches(3):
            train_step(m, opt, x[:, :-1], x[:, 1:], "bf16" if dtype == torch.bfloat16 else "fp32")
        live = led.live()
    assert live[Category.OPT] == expected == state_bytes(opt)
    st = opt.state[m.blocks[0].mlp.c_fc.weight]  # (256, 64): right side, P is (16, 64)
    if proj_dtype == "int8":
        assert "projector" not in st and st["projector_codes"].dtype == torch.int8
        assert st["projector_codes"].shape == (16, 64) and st["projector_scale"].shape == (16,)
        assert gl8.projector_bytes((256, 64), 16, d, "int8") == 16 * 64 + 4 * 16
    else:
        want = torch.float32 if proj_dtype == "fp32" else dtype
        assert st["projector"].dtype == want and st["projector"].shape == (16, 64)
        assert gl8.projector_bytes((256, 64), 16, d, proj_dtype) == 16 * 64 * want.itemsize


@pytest.mark.parametrize("side_shape", [(64, 256), (256, 64)], ids=["left", "right"])
def test_int8_projector_is_the_top_singular_vectors_within_half_a_step(side_shape):
    """The int8 projector dequantizes to the fp32 projector's values within half a quantization step
    (scale / 2 per singular vector, scale = its largest |value| / 127), plus one rounding of the product."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(side_shape))
    w.grad = torch.randn(side_shape)
    exact = GaLoreAdamW8bit([{"params": [w], "rank": 8}], proj_dtype="fp32")
    exact.step()
    w2 = torch.nn.Parameter(w.detach().clone())
    w2.grad = w.grad.clone()
    q = GaLoreAdamW8bit([{"params": [w2], "rank": 8}], proj_dtype="int8")
    q.step()  # the same gradient: the same SVD
    side = gl.projection_side(side_shape)
    P = exact.state[w]["projector"]  # (m, r) left, (r, n) right
    back = GaLoreAdamW8bit._projector(q.state[w2], torch.float32, side)
    vectors = P if side == "right" else P.t()  # one singular vector per row
    scale = vectors.abs().amax(dim=1, keepdim=True) / 127
    err = (back - P).abs() if side == "right" else (back - P).abs().t()
    assert torch.all(err <= scale / 2 + 2 * EPS * vectors.abs().amax(dim=1, keepdim=True))
    assert err.max() > 0  # it is quantized


def test_int8_projector_state_resumes():
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=1, n_embd=64, n_head=2, vocab_size=64, block_size=32)
    a = GPT(cfg).to(torch.bfloat16)
    b = copy.deepcopy(a)
    oa = GaLoreAdamW8bit(galore_param_groups(a, rank=16, update_proj_gap=2), lr=1e-2, proj_dtype="int8")
    batches = _batches(5)
    for x in batches[:3]:
        train_step(a, oa, x[:, :-1], x[:, 1:], "bf16")
    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "opt": oa.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    b.load_state_dict(saved["model"])
    ob = GaLoreAdamW8bit(galore_param_groups(b, rank=16, update_proj_gap=2), lr=1e-2, proj_dtype="int8")
    ob.load_state_dict(saved["opt"])
    st = ob.state[b.blocks[0].mlp.c_fc.weight]
    assert st["projector_scale"].dtype == torch.float32 and st["projector_codes"].dtype == torch.int8
    for x in batches[3:]:  # step 4 refreshes the projector
        for m, o in ((a, oa), (b, ob)):
            train_step(m, o, x[:, :-1], x[:, 1:], "bf16")
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("bad", ["int4", "bf16", None, 8])
def test_bad_proj_dtype_raises_one_line(bad):
    w = torch.nn.Parameter(torch.zeros(32, 48))
    with pytest.raises(ValueError, match="^proj_dtype must be one of param, fp32, int8") as e:
        GaLoreAdamW8bit([{"params": [w], "rank": 4}], proj_dtype=bad)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="^proj_dtype"):
        GaLoreAdamW8bit([{"params": [w], "rank": 4, "proj_dtype": bad}])
    with pytest.raises(ValueError, match="^proj_dtype"):
        gl8.state_bytes_for((32, 48), 4, proj_dtype=bad)
