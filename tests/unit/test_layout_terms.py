"""Per-rank estimates of tensor- and pipeline-parallel layouts (labkit.estimate.layout_terms) and the CLI flags."""

import json

import pytest

from labkit.cli import main
from labkit.estimate import Recipe, estimate, estimate_ranks
from labkit.estimate.layout_terms import in_flight, layout_wire_bytes, rank_params
from labkit.estimate.spec import spec_from
from labkit.memory import Category
from labkit.models.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, block_size=32, n_layer=4, n_head=4, n_embd=64)
GPT_TEXT = "gpt:n_layer=4,n_embd=64,n_head=4,vocab_size=64,block_size=32"


def test_estimate_is_the_largest_rank_and_dp_beside_tp_pp():
    ranks = estimate_ranks(CFG, 8, 32, tp=2, pp=2, micro_batch=2)
    assert len(ranks) == 4 and ranks[0].peak.total == ranks[1].peak.total  # tp ranks of a stage alike
    assert estimate(CFG, 8, 32, tp=2, pp=2, micro_batch=2).peak.total == max(e.peak.total for e in ranks)
    # dp replicas: each rank of a part takes batch / dp rows (the same as dp=1 at that batch, but the label),
    # and ZeRO-1 shards its optimizer state; measured on 4 ranks in tests/distributed/test_mesh.py
    one = estimate_ranks(CFG, 4, 32, tp=2, pp=2, micro_batch=2)
    two = estimate_ranks(CFG, 8, 32, dp=2, tp=2, pp=2, micro_batch=2)
    assert [e.peak.total for e in one] == [e.peak.total for e in two]
    zero = estimate_ranks(CFG, 8, 32, dp=2, tp=2, pp=2, micro_batch=2, zero=1)
    assert all(z.peak.total < t.peak.total for z, t in zip(zero, two))
    with pytest.raises(ValueError, match="ZeRO-2 with pipeline parallelism"):
        estimate(CFG, 8, 32, dp=2, pp=2, zero=2)
    with pytest.raises(ValueError, match="ZeRO-3 beside tensor parallelism is not estimated yet"):
        estimate(CFG, 8, 32, dp=2, tp=2, zero=3)


def test_rank_parameters():
    spec = spec_from(CFG)
    n = spec.n_params
    # pipeline: every parameter on exactly one stage, plus the head's copy of the tied embedding
    stages = [sum(_numel(s) for _, s in rank_params(spec, k, 2)) for k in range(2)]
    assert sum(stages) == n + CFG.vocab_size * CFG.n_embd
    # tensor parallel: the blocks' matrices and column-parallel biases halved, the rest whole
    h, L = CFG.n_embd, CFG.n_layer
    split = L * (3 * h * h + 3 * h + 4 * h * h + 4 * h + h * h + 4 * h * h)
    assert sum(_numel(s) for _, s in rank_params(spec, 0, 1, 2)) == n - split // 2
    assert sum(p.numel() for p in GPT(CFG).parameters()) == n


def _numel(shape):
    out = 1
    for d in shape:
        out *= d
    return out


def test_activations_in_flight_follow_the_schedule():
    for name in ("gpipe", "1f1b"):
        est = estimate_ranks(CFG, 16, 32, pp=2, micro_batch=2, schedule=name)
        k = in_flight(name, 8, 2, 0)
        a_s = next(t.bytes for t in est[0].terms if t.name.startswith("activations of one micro-batch"))
        most = max(m.breakdown()[Category.ACT] for m in est[0].moments)
        assert (k - 1) * a_s < most <= (k + 1) * a_s + 16 * 32 * 8
    g, f = (estimate_ranks(CFG, 16, 32, pp=2, micro_batch=2, schedule=s)[0] for s in ("gpipe", "1f1b"))
    assert g.peak[Category.ACT] > 3 * f.peak[Category.ACT]  # 8 micro-batches held against 2


def test_wire_bytes_by_definition():
    w = layout_wire_bytes(Recipe(CFG, 8, 32, tp=2, pp=2, micro_batch=2))
    act = 2 * 32 * 64 * 4  # one micro-batch's (b, s, h) fp32 activation
    assert w["pipeline: each stage boundary, each way (m activations forward, m gradients back)"] == 4 * act
    assert w["tensor parallel: per layer"] == 4 * 2 * (1 / 2) * act * 4  # 4 all-reduces of 2(t-1)/t x S, m = 4
    sp = layout_wire_bytes(Recipe(CFG, 8, 32, tp=2, micro_batch=8, sequence_parallel=True))
    assert sp["tensor parallel: per layer"] == 10 * (1 / 2) * 8 * 32 * 64 * 4


def test_cli_layout(capsys):
    assert main(["estimate", "--model", GPT_TEXT, "--batch", "8", "--seq", "32", "--dtype", "fp32", "--tp", "2",
                 "--pp", "2", "--micro-batches", "4", "--schedule", "gpipe", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"] == {"dp": 1, "zero": 0, "tp": 2, "pp": 2, "rank_batch": 8, "micro_batch": 2,
                             "schedule": "gpipe", "sequence_parallel": False, "micro_batches": 4}
    assert len(out["ranks"]) == 4 and out["peak"] == max(r["peak"] for r in out["ranks"])
    ranks = estimate_ranks(CFG, 8, 32, tp=2, pp=2, micro_batch=2, schedule="gpipe")
    top = max(ranks, key=lambda e: e.peak.total)  # n_params: the model's, not the largest rank's share
    assert out["n_params"] == spec_from(CFG).n_params > out["rank_params"] == top.n_params
    assert sum(t["bytes"] for t in out["peak_terms"]) == out["peak"]
    assert [r["peak"] for r in out["ranks"]] == [e.peak.total for e in ranks]
    assert main(["estimate", "--model", GPT_TEXT, "--batch", "8", "--seq", "32", "--tp", "2", "--sequence-parallel"]) == 0
    assert "per-rank peaks (tp=2 pp=1 sequence-parallel" in capsys.readouterr().out


@pytest.mark.parametrize("args,words", [
    (["--tp", "3"], "4 attention heads do not divide over t=3"),
    (["--pp", "5"], "5 stages for a model of 4 layers"),
    (["--pp", "2", "--micro-batches", "0"], "--micro-batches must be a positive integer"),
    (["--pp", "2", "--micro-batches", "2", "--micro-batch", "4"], "one of --micro-batch, --accumulate and --micro-batches"),
    (["--sequence-parallel"], "give --tp > 1 too"),
    (["--pp", "2", "--micro-batches", "3"], "must divide --batch 8"),
])
def test_cli_bad_layouts(capsys, args, words):
    assert main(["estimate", "--model", GPT_TEXT, "--batch", "8", "--seq", "32", *args]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1, err


def test_labkit_layer_extras_by_hand():
    """s=8, b=2, h=16, a=4 in 2 bytes on a CPU: LayerNorm statistics 2 x 2 sb e, the (S, S) mask, the attention
    dropout mask's extra byte (e - 1) a s^2 b / t and the residual masks' 2 (e - 1) sbh; on CUDA the masks are
    1 byte, and without materialised attention there is no (S, S) term."""
    from labkit.estimate.layout_terms import LabkitLayer, labkit_layer_extras

    def terms(t=1, sp=False, **kw):
        return [x.bytes for x in labkit_layer_extras(8, 2, 16, 4, t, sp, LabkitLayer(**kw))]

    assert terms() == [128, 64, 512, 512]  # the defaults: e=2, CPU, dropout, manual attention
    assert terms(t=2, sp=True) == [64, 64, 256, 256]
    assert terms(device="cuda") == terms(dropout=False) == [128, 64]
    assert terms(manual=False, e=4) == [256, 3 * 2 * 8 * 2 * 16]


@pytest.mark.parametrize("kwargs, field", [(dict(e=0), "e"), (dict(device="tpu"), "device"),
                                           (dict(dropout=1), "dropout"), (dict(manual="yes"), "manual")])
def test_labkit_layer_rejects_bad_values(kwargs, field):
    from labkit.estimate.layout_terms import LabkitLayer

    with pytest.raises(ValueError, match=f"LabkitLayer.{field} "):
        LabkitLayer(**kwargs)


def test_llama_pipeline_stages_hold_their_autocast_copies_and_send_fp32_boundaries():
    """Issue 43, item 5: a Llama stage under mixed precision keeps autocast's 16-bit copy of its Linears, as a
    GPT-2 stage does (found by the model's own Linears, not GPT-2's names), and a stage boundary carries the
    residual stream in the weights' dtype (fp32 under autocast), as the walk keeps it."""
    from labkit.estimate import Recipe, estimate_ranks
    from labkit.estimate.layout_terms import layout_wire_bytes
    from labkit.estimate.spec import spec_from
    from labkit.memory.report import TermKey

    r = Recipe("llama2-7b", batch=8, seq=512, dtype="mixed-bf16", pp=4, micro_batch=1)
    spec = spec_from("llama2-7b")
    per_layer = sum(d_in * d_out for name, d_in, d_out, _ in spec.linears if ".layers.0." in name)
    for s, e in enumerate(estimate_ranks(r)[:3]):  # 8 layers each, no head
        copies = max(sum(t.bytes for t in mo.terms if t.key is TermKey.COPIES_16BIT) for mo in e.moments)
        print(f"stage {s}: {copies / 2 ** 30:.2f} GiB of autocast copies")
        assert copies == 8 * per_layer * 2  # 3.02 GiB
    wire = layout_wire_bytes(r)
    assert wire["pipeline: each stage boundary, each way (m activations forward, m gradients back)"] == \
        8 * 1 * 512 * 4096 * 4
