"""DGC and PowerSGD on 2 gloo ranks: the DDP-hook path equals the plain path bit for bit; bytes on the wire per
step equal the formulas (by each collective's definition); the state each rank keeps, measured by the ledger,
equals the formula. One launch (each costs seconds of start-up)."""

import math

import pytest
import torch

from labkit.distributed import launch
from labkit.distributed import comm_ranks
from labkit.distributed.compression import (DGCConfig, PowerSGDConfig, density_at, dense_wire_bytes, dgc_state_bytes,
                                            dgc_wire_bytes, powersgd_state_bytes, powersgd_wire_bytes)
from labkit.distributed.dp_ranks import TrainRun

CFG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
STEPS, BATCH, SEQ, WORLD = 6, 8, 8, 2
DGC = DGCConfig(sparsity=0.99, warmup_steps=1)  # warm-up: 75 %, 93.75 %, 98.4375 %, then 99 %
VARIANTS = list(comm_ranks.VARIANTS)


@pytest.fixture(scope="module")
def runs():
    run = TrainRun(CFG, STEPS, BATCH, SEQ)
    return launch(comm_ranks.compression_suite, WORLD, args=(run, DGC, PowerSGDConfig(rank=2), VARIANTS), timeout_s=300,
                  backend="gloo")


def _numels(run):
    return [p.numel() for p in run["params"].values()]


@pytest.mark.parity
def test_hook_path_equals_plain_path_bit_for_bit(runs):
    for r in range(WORLD):
        plain, hook = runs[r]["plain"], runs[r]["hook"]
        assert plain["losses"] == hook["losses"]
        for n in plain["params"]:
            assert torch.equal(plain["params"][n], hook["params"][n]), n
        assert plain["wire"] == hook["wire"]  # the same bytes, gathered per bucket or all at once
    # every rank holds the same model (the average is the same on each)
    for n in runs[0]["plain"]["params"]:
        assert torch.equal(runs[0]["plain"]["params"][n], runs[1]["plain"]["params"][n])
    assert runs[0]["plain"]["losses"] != runs[1]["plain"]["losses"]  # but they saw different rows


def test_dgc_bytes_per_step_follow_the_warmup_and_beat_the_dense_all_reduce(runs):
    run = runs[0]["plain"]
    numels = _numels(run)
    for step, wire in enumerate(run["wire"]):
        assert wire == dgc_wire_bytes(numels, density_at(step, DGC), WORLD), step
    dense = runs[0]["compare"]["dense"]["wire"]
    assert dense == [dense_wire_bytes(run["n_params"], WORLD)] * STEPS
    assert run["wire"] == sorted(run["wire"], reverse=True)  # sparser every warm-up stage
    ratio = dense[-1] / run["wire"][-1]
    # 1 % of the values, each with a 4-byte index, from each of 2 ranks: about 100 / 2 / 2 = 25x on 2 ranks
    k = sum(math.ceil(n * 0.01) for n in numels)
    assert ratio == run["n_params"] * 4 / (8 * k)


def test_dgc_state_measured_by_the_ledger_equals_the_formula(runs):
    for r in range(WORLD):
        run = runs[r]["plain"]
        assert run["final"]["temp"] == dgc_state_bytes(run["n_params"], DGC) == 2 * 4 * run["n_params"]
        assert run["final"]["opt"] == 0  # momentum is in DGC's u: plain SGD keeps nothing
        assert run["state_bytes"] == run["final"]["temp"]
        no_mc = runs[r]["plain-no-mc"]
        assert no_mc["final"]["temp"] == dgc_state_bytes(run["n_params"], DGC.without("momentum_correction"))
        assert no_mc["final"]["opt"] == 4 * run["n_params"]  # SGD applies the momentum after the exchange


def test_powersgd_bytes_and_error_feedback_memory(runs):
    run = runs[0]["powersgd"]
    buckets = run["buckets"]
    n = run["n_params"]
    assert sum(math.prod(s) for b in buckets for s in b) == n
    compressed = powersgd_wire_bytes(buckets, 2, WORLD)
    assert run["wire"][:2] == [dense_wire_bytes(n, WORLD)] * 2  # vanilla all-reduce before start_powerSGD_iter
    assert run["wire"][2:] == [compressed] * (STEPS - 2)
    assert compressed < dense_wire_bytes(n, WORLD) / 4
    predicted = powersgd_state_bytes(buckets, 2)
    assert run["final"]["temp"] == predicted == run["state_bytes"]
    assert predicted > 4 * n  # the error feedback alone is a gradient's worth


def test_compare_runs_every_variant_at_equal_steps(runs):
    cmp = runs[0]["compare"]
    assert set(cmp) == set(VARIANTS)
    for v, res in cmp.items():
        assert len(res["losses"]) == STEPS and all(math.isfinite(x) for x in res["losses"]), v
        assert len(res["wire"]) == STEPS
    assert cmp["dgc"]["losses"] == runs[0]["plain"]["losses"]  # the same run as the plain path
    assert cmp["dgc-no-warmup"]["wire"][0] < cmp["dgc"]["wire"][0]  # no warm-up: the final sparsity at once
    assert cmp["dense"]["losses"][0] == cmp["dgc"]["losses"][0]  # the same model and batch before any update
