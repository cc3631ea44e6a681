"""DGC's pieces in one process: top-k, the warm-up schedule, momentum correction and masking, clipping, the
byte and state formulas; PowerSGD's formulas; bad input is one clear ValueError."""

import math

import pytest
import torch

from labkit.distributed.compression import (DGC, DGCConfig, check_rank, density_at, dgc_state_bytes,
                                            dgc_wire_bytes, k_of, powersgd_payload, topk_sparsify, warmup_density)
from labkit.distributed.param_server import PSConfig, check_staleness, ps_wire_bytes, server_state_bytes


def test_topk_picks_the_largest_magnitudes():
    t = torch.tensor([[0.1, -5.0, 2.0], [3.0, -0.2, 0.0]])
    values, idx = topk_sparsify(t, 2)
    assert idx.dtype == torch.int32
    assert sorted(idx.tolist()) == [1, 3] and sorted(values.tolist()) == [-5.0, 3.0]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g)
    v, i = topk_sparsify(x, 10)
    assert torch.equal(v.abs().sort().values, x.abs().sort().values[-10:])
    assert torch.equal(x[i.long()], v)


@pytest.mark.parametrize("k", [0, -1, 1.5, True])
def test_bad_k(k):
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        topk_sparsify(torch.ones(4), k)


def test_k_larger_than_the_tensor():
    with pytest.raises(ValueError, match="more than the tensor's 4 entries"):
        topk_sparsify(torch.ones(4), 5)


def test_warmup_follows_the_papers_sparsities():
    # Lin et al. 2018, section 3.3: 75 %, 93.75 %, 98.4375 %, 99.6 %, 99.9 %
    sparsity = [1 - warmup_density(e, 0.999) for e in range(6)]
    assert sparsity[:4] == [0.75, 0.9375, 0.984375, 0.99609375]
    assert sparsity[4] == sparsity[5] == pytest.approx(0.999, abs=1e-12)
    cfg = DGCConfig(sparsity=0.999, warmup_steps=3)
    assert [density_at(s, cfg) for s in (0, 2, 3, 6)] == [0.25, 0.25, 0.0625, 0.015625]
    assert density_at(0, cfg.without("warmup")) == pytest.approx(0.001)


@pytest.mark.parametrize("bad", [0, 1, 1.0, -0.1, 1.5, "0.9", True])
def test_bad_sparsity(bad):
    with pytest.raises(ValueError, match=r"sparsity must be a number in \(0, 1\)"):
        DGCConfig(sparsity=bad)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_bad_powersgd_rank(bad):
    with pytest.raises(ValueError, match="PowerSGD rank must be an integer >= 1"):
        check_rank(bad)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_bad_staleness(bad):
    with pytest.raises(ValueError, match="staleness must be an integer >= 0"):
        PSConfig("async", staleness=bad)
    with pytest.raises(ValueError, match="staleness must be an integer >= 0"):
        check_staleness(bad)


def test_bad_config_values_are_one_line():
    for make, words in ((lambda: DGCConfig(momentum=1.0), "momentum"), (lambda: DGCConfig(clip_norm=0), "clip_norm"),
                        (lambda: DGCConfig(warmup_steps=-1), "warmup_steps"), (lambda: PSConfig("both"), "mode"),
                        (lambda: DGCConfig().without("dropout"), "technique"),
                        (lambda: server_state_bytes(10, "adam"), "optimizer")):
        with pytest.raises(ValueError, match=words) as e:
            make()
        assert "\n" not in str(e.value)


def _one_tensor_dgc(cfg, g, steps=1):
    p = torch.nn.Parameter(torch.zeros_like(g))
    d = DGC([("w", p)], cfg)
    out = []
    for _ in range(steps):
        out.append(d._compress("w", g.clone(), world=1))
        d.next_step()
    return d, out


def test_momentum_correction_and_masking():
    g = torch.tensor([4.0, 1.0, 0.5, 0.25])
    cfg = DGCConfig(sparsity=0.75, momentum=0.5, clip_norm=None, warmup_steps=0)  # k = 1 of 4
    d, ((v1, i1), (v2, i2)) = _one_tensor_dgc(cfg, g, steps=2)
    assert i1.tolist() == [0] and v1.tolist() == [4.0]
    # step 2: u = 0.5 u + g, with u[0] masked to 0 after step 1: u = [4, 1.5, 0.75, 0.375]; v = v + u
    assert d.u["w"].tolist() == [0.0, 1.5, 0.75, 0.375]  # entry 0 was sent again: masked again
    assert d.v["w"].tolist() == [0.0, 2.5, 1.25, 0.625]  # the residual keeps what was not sent
    assert i2.tolist() == [0] and v2.tolist() == [4.0]
    no_mask = DGCConfig(sparsity=0.75, momentum=0.5, clip_norm=None, warmup_steps=0, momentum_masking=False)
    d2, (_, (v2b, _)) = _one_tensor_dgc(no_mask, g, steps=2)
    assert v2b.tolist() == [6.0]  # u[0] = 0.5 * 4 + 4: stale momentum pushes the sent entry again
    plain = DGCConfig(sparsity=0.75, clip_norm=None, warmup_steps=0, momentum_correction=False)
    d3, _ = _one_tensor_dgc(plain, g, steps=2)
    assert d3.u == {} and d3.v["w"].tolist() == [0.0, 2.0, 1.0, 0.5]  # accumulates g only


def test_local_clipping_scales_by_one_over_sqrt_n():
    cfg = DGCConfig(sparsity=0.5, clip_norm=1.0, warmup_steps=0, momentum_correction=False)
    d = DGC([("w", torch.nn.Parameter(torch.zeros(2)))], cfg)
    d._compress("w", torch.tensor([3.0, 4.0]), world=4)  # norm 5 -> 1 / sqrt(4) = 0.5
    assert torch.allclose(d.v["w"], torch.tensor([0.0, 0.0]) + torch.tensor([0.3, 0.0]))


def test_state_and_wire_formulas():
    cfg = DGCConfig()
    assert dgc_state_bytes(1000, cfg) == 8000 and dgc_state_bytes(1000, cfg.without("momentum_correction")) == 4000
    assert k_of(1000, 0.001) == 1 and k_of(1001, 0.001) == 2 and k_of(3, 1e-6) == 1
    # 4 ranks, 2 tensors: (N-1)/N x N x 8 bytes x sum(k)
    assert dgc_wire_bytes([1000, 10], 0.01, 4) == 3 * 8 * (10 + 1)
    pay = powersgd_payload([(64, 32), (32,), (4, 4)], rank=2)
    assert pay == {"uncompressed": 32 + 16, "P": 64 * 2, "Q": 32 * 2}
    assert server_state_bytes(10, "adamw") == 80 and server_state_bytes(10, "sgd") == 0
    w = ps_wire_bytes(100, 2, steps=3)
    assert w["server"] == 4 * 2 * 101 * 4 and w["worker"] == 4 * 103 * 4
    assert math.isclose(w["total"], w["server"] + 2 * w["worker"])
