"""Tensor parallelism on 2 gloo ranks: labkit's Megatron split (and sequence parallel) against one process and
PyTorch's parallelize_module; activations per layer against Korthikanti et al.'s formula term by term; the
per-rank estimate against the ledger; clear errors."""

import pytest
import torch

from labkit.distributed import launch
from labkit.distributed import layout_ranks as lr
from labkit.distributed import tensor_parallel as tp
from labkit.estimate import Recipe, estimate_ranks
from labkit.estimate.layout_terms import LabkitLayer, korthikanti_layer_bytes, labkit_layer_extras, layout_wire_bytes
from labkit.models.gpt import GPT, GPTConfig

CFG = dict(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=64)
# Korthikanti's setting: dropout on, attention scores materialised, 16-bit activations
ACT_CFG = dict(vocab_size=64, block_size=64, n_layer=2, n_head=4, n_embd=64, dropout=0.1, attention="manual")
# fp32 outputs and gradients of order 1, sums over h = 64 and 4h terms split in two and added back: 1e-6 is
# ~8 ulps at 1 (eps 1.19e-7)
TOL = 1e-6


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_errors():
    with pytest.raises(ValueError, match="4 attention heads do not divide over t=3"):
        tp.check_tp(4, 64, 3)
    with pytest.raises(ValueError, match="seq 30 does not divide over t=4"):
        tp.check_tp(4, 64, 4, seq=30, sequence_parallel=True)
    with pytest.raises(ValueError, match="do not divide over t=3"):
        estimate_ranks(Recipe(GPTConfig(**CFG), 8, 32, tp=3))
    with pytest.raises(ValueError, match="give tp > 1 too"):
        Recipe(GPTConfig(**CFG), 8, 32, sequence_parallel=True)


def test_headwise_attention_is_the_same_function():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    x = torch.randint(0, 64, (2, 16))
    same = tp.to_headwise(__import__("copy").deepcopy(model))
    assert torch.equal(model(x), same(x))  # a permutation of c_attn's rows: the same sums in the same order


def test_korthikanti_formula():
    s, b, h, a = 64, 2, 64, 4
    assert korthikanti_layer_bytes(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)
    assert korthikanti_layer_bytes(s, b, h, a, t=2) == s * b * h * (10 + 12 + 5 * a * s / (2 * h))
    assert korthikanti_layer_bytes(s, b, h, a, t=2, sp=True) == s * b * h * (17 + 5 * a * s / (2 * h))


@pytest.fixture(scope="module")
def runs():
    """Parity and memory in one launch: [(parity, memory, the step with the optimizer offloaded) per rank]."""
    return launch(lr.many, 2, args=([("tensor_parallel_parity", (lr.Workload(CFG, 4, 16),)),
                                     ("tp_memories", (lr.Workload(ACT_CFG, 2, 64), lr.Workload(CFG, 8, 32), 4)),
                                     ("tp_step_memory", (lr.Workload(CFG, 8, 32), 4, False, 2, "cpu"))],),
                  timeout_s=240)


def test_tensor_parallel_parity(runs):
    for res, _, _ in runs:
        assert res["headwise_vs_model"] == 0
        for k in ("tp", "sp", "torch"):
            assert (res[k]["logits"] - res["logits"]).abs().max().item() < TOL
            assert abs(res[k]["loss"] - res["loss"]) < TOL
            assert _max_diff(res[k]["grads"], res["reference"]) < TOL
        assert _max_diff(res["tp"]["grads"], res["torch"]["grads"]) < TOL
        act = 4 * 16 * 64 * 4  # one (B, S, h) fp32 activation
        # one all-reduce per block half in forward (g) and one in backward (f): 4 per block
        assert res["tp"]["comms"] == {"all_reduce": {"calls": 4 * 2, "payload_bytes": 8 * act, "wire_bytes": 8 * act}}
        predicted = layout_wire_bytes(Recipe(GPTConfig(**CFG), 4, 16, tp=2))["tensor parallel: stage 0's layers"]
        assert res["tp"]["comms"]["all_reduce"]["wire_bytes"] == predicted
        sp = res["sp"]["comms"]  # all-gathers and reduce-scatters instead: the same bytes on the wire and the
        # column-parallel matmuls' second all-gather in backward (2 per block), + the split and the final gather
        assert sp["reduce_scatter"]["calls"] == 4 * 2 and sp["all_gather"]["calls"] == 6 * 2 + 2


def test_tensor_parallel_memory_against_formula_and_estimate(runs):
    b, s, h, a, t = 2, 64, 64, 4, 2
    for _, res, _ in runs:
        layer = res["layer"]
        for name, tt, sp in (("t=1", 1, False), ("tp", t, False), ("tp+sp", t, True)):
            extras = labkit_layer_extras(s, b, h, a, tt, sp, LabkitLayer(e=2, device="cpu"))
            assert layer[name] == korthikanti_layer_bytes(s, b, h, a, tt, sp) + sum(x.bytes for x in extras), name
        for sp, meas in res["step"].items():
            est = estimate_ranks(Recipe(GPTConfig(**CFG), 8, 32, tp=2, micro_batch=4, sequence_parallel=sp))
            assert meas["n_params"] == est[0].n_params
            assert abs(est[0].peak.total / meas["peak"]["total"] - 1) < 0.03


def test_tensor_parallel_rank_with_the_optimizer_offloaded(runs):
    """Issue 43 item 3: a tensor-parallel rank's OffloadAdamW keeps its state and its step's work in host memory
    (it was refused). The rank's peak within 3 % of the ledger, as the other tensor-parallel estimates, with no
    optimizer state on the device on either side. Measured: 8 B apart on both ranks, but in one run of three rank
    1 held one more (micro-batch, S, h) fp32 tensor (32 KiB, 2.5 %) at its backward peak, and in another in its
    optimizer step: a tensor whose release depends on timing, not yet named."""
    from labkit.memory import Category

    est = estimate_ranks(Recipe(GPTConfig(**CFG), 8, 32, tp=2, micro_batch=4, optimizer_offload="cpu"))
    for (_, _, meas), e in zip(runs, est):
        assert abs(e.peak.total / meas["peak"]["total"] - 1) < 0.03, (e.peak.total, meas["peak"]["total"])
        assert e.peak[Category.OPT] == meas["peak"]["opt"] == 0
    plain = estimate_ranks(Recipe(GPTConfig(**CFG), 8, 32, tp=2, micro_batch=4))
    assert all(e.peak.total < p.peak.total for e, p in zip(est, plain))


def test_rank_layer_bytes_from_the_walks_shares():
    """Each saved tensor carries how a tensor-parallel rank holds it (walk.TPShare: per head, the stream, the
    mask), set where the walk makes it: one rank's layer, measured by its ledger, is what the walk predicts,
    with and without sequence parallelism. With dropout on the CPU, SDPA runs its math fallback, whose scaled
    q and k the old split by tensor names kept whole on each rank (tp: +5.5 % here)."""
    from labkit.estimate import predict
    from labkit.estimate.layout_terms import tp_layer_bytes
    from labkit.estimate.spec import spec_from

    cases = [("sdpa", "fp32"), ("manual", "bf16")]
    cfgs = [dict(ACT_CFG, attention=attention) for attention, _ in cases]
    res = launch(lr.many, 2, args=([("tp_activation_memory", (lr.Workload(cfg, 2, 64), dtype))
                                    for cfg, (_, dtype) in zip(cfgs, cases)],), timeout_s=200)
    for k, (cfg, (_, dtype)) in enumerate(zip(cfgs, cases)):
        w, marks = predict.walk_activations(spec_from(GPTConfig(**cfg)), predict.Precision.of(dtype), 2, 64, "cpu")
        for rank in res:
            assert rank[k] == {"t=1": marks[-1] - marks[-2], "tp": tp_layer_bytes(w, marks, 2),
                               "tp+sp": tp_layer_bytes(w, marks, 2, True)}, (cfg["attention"], dtype)
