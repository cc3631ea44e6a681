"""Per-rank estimates against measurement on layouts drawn at random (seeded; the seed and the layout are in every
failure message), not hand-picked: any layer count, head count, width, vocabulary and world size.

- one process, a fake process group (every tensor with the shape and lifetime it has on rank 0 of N): labkit's
  ZeRO-1/2/3 against the ledger, FSDP2 (reshard_after_forward True and False) against FSDPMemTracker, world
  sizes 2-64;
- real gloo ranks (2-4 processes, one thread each, timeouts on the process groups, free ports from the OS):
  pipelines of 2-4 stages (uneven splits, middle stages) and tensor parallelism run, match one process, and
  their per-rank estimates match each rank's ledger.

The issue's reported cases are kept as fixed draws beside the random ones: FSDP2 on 3 layers, width 96, 3 heads,
vocabulary 512 at 64 ranks, and 3- and 4-stage pipelines of a 6-layer width-48 model.
"""

import random

import pytest

from labkit.distributed import launch
from labkit.distributed import layout_ranks as lr
from labkit.distributed.simulate import fsdp2_rank_memory, zero_rank_memory
from labkit.estimate import Recipe, estimate, estimate_ranks
from labkit.estimate.zero_terms import fsdp2_estimate
from labkit.models.gpt import GPTConfig

TOL = 0.03  # the bound on every per-rank peak
# fp32 gradients of a loss of order 1, summed in another order over micro-batches, stages or tp ranks: ~8 ulps
GRAD_TOL = 1e-6


def draw_model(rng: random.Random, heads_multiple: int = 1, min_layers: int = 1) -> dict:
    """A labkit GPTConfig (as a dict): 1-6 layers (at least min_layers), heads a multiple of heads_multiple,
    head size 4-16, vocabulary 32-1500 (any, odd ones too)."""
    heads = heads_multiple * rng.randint(1, max(1, 6 // heads_multiple))
    return dict(vocab_size=rng.randint(32, 1500), block_size=32, n_layer=rng.randint(min_layers, min_layers + 4),
                n_head=heads, n_embd=heads * rng.randint(4, 16))


def _why(seed, **layout) -> str:
    return f"seed {seed}: " + ", ".join(f"{k}={v}" for k, v in layout.items())


# ---- fake process group: ZeRO-1/2/3 and FSDP2 at world sizes 2-64 ------------------------------------------------
SEEDS_FAKE = [11, 12, 13]


@pytest.mark.parametrize("seed", SEEDS_FAKE)
def test_zero_stages_on_a_drawn_layout(seed):
    rng = random.Random(seed)
    cfg, world, rows, seq = draw_model(rng), rng.randint(2, 64), rng.randint(1, 2), rng.choice([8, 16, 32])
    for zero in (1, 2, 3):
        r = Recipe(GPTConfig(**cfg), batch=rows * world, seq=seq, dp=world, zero=zero)
        m, e = zero_rank_memory(r), estimate(r)
        err = e.peak.total / m.peak.total - 1
        why = _why(seed, cfg=cfg, world=world, rows=rows, seq=seq, zero=zero)
        print(f"{why}: measured {m.peak.total:,} predicted {e.peak.total:,} ({err:+.2%})")
        assert abs(err) <= TOL, f"{why}: {err:+.2%} at {e.peak_moment.where}"


@pytest.mark.parametrize("seed", [12, 14])
def test_zero_stages_with_checkpointing_on_a_drawn_layout(seed):
    """labkit's Zero (ZeRO-1/2/3) over every block checkpointed (labkit.recompute.checkpoint_blocks)."""
    rng = random.Random(seed)
    cfg, world, rows, seq = draw_model(rng), rng.randint(2, 64), rng.randint(1, 2), rng.choice([8, 16, 32])
    for zero in (1, 2, 3):
        r = Recipe(GPTConfig(**cfg), batch=rows * world, seq=seq, dp=world, zero=zero, checkpoint="full")
        m, e = zero_rank_memory(r), estimate(r)
        err = e.peak.total / m.peak.total - 1
        why = _why(seed, cfg=cfg, world=world, rows=rows, seq=seq, zero=zero, checkpoint="full")
        print(f"{why}: measured {m.peak.total:,} predicted {e.peak.total:,} ({err:+.2%})")
        assert abs(err) <= TOL, f"{why}: {err:+.2%} at {e.peak_moment.where}"


FSDP2_CASES = [("reported", dict(vocab_size=512, block_size=32, n_layer=3, n_head=3, n_embd=96), 64, 2, 32)]
# 504: a draw from a wider sweep that found the block-0 reduce-scatter input still held at the embedding's backward
# (2 ranks, a large vocabulary: the peak is there), kept
for _s in [111, 112, 113, 504]:
    _r = random.Random(_s)
    FSDP2_CASES.append((f"seed {_s}", draw_model(_r), _r.randint(2, 64), _r.randint(1, 2), _r.choice([8, 16, 32])))


@pytest.mark.parametrize("name, cfg, world, rows, seq", FSDP2_CASES, ids=[c[0] for c in FSDP2_CASES])
def test_fsdp2_both_reshard_modes(name, cfg, world, rows, seq):
    for reshard in (True, False):
        m = fsdp2_rank_memory(cfg, world, rows, seq, reshard_after_forward=reshard)
        e = fsdp2_estimate(Recipe(GPTConfig(**cfg), batch=rows * world, seq=seq, dp=world), reshard)
        err = e.peak.total / m["peak"] - 1
        why = f"{name}: cfg={cfg}, world={world}, rows={rows}, seq={seq}, reshard_after_forward={reshard}"
        print(f"{why}: measured {m['peak']:,} predicted {e.peak.total:,} ({err:+.2%}) {m['by_category']}")
        assert abs(err) <= TOL, f"{why}: {err:+.2%} at {e.peak_moment.where}"
        # the all-gather buffer FSDPMemTracker holds at the peak is one block's per-parameter chunks x N
        if reshard and m["by_category"]["all_gather"]:
            buf = next(t.bytes for t in e.peak_moment.terms if t.name.startswith("all-gather output"))
            assert m["by_category"]["all_gather"] == buf, why


def test_fsdp2_estimate_errors():
    with pytest.raises(ValueError, match="dp >= 2"):
        fsdp2_estimate(Recipe(GPTConfig(n_layer=1, n_head=1, n_embd=8, vocab_size=16, block_size=8), 2, 8))


# ---- real gloo ranks: pipelines of 2-4 stages, tensor parallel of 2-4 ranks -------------------------------------
REPORTED_PP = dict(vocab_size=64, block_size=16, n_layer=6, n_head=3, n_embd=48)


def _pp_layout(rng, p):
    cfg = draw_model(rng, min_layers=p)
    m = rng.randint(p, p + 2)  # torch.distributed.pipelining's 1F1B needs m >= p
    return cfg, m * rng.randint(1, 2), rng.choice([8, 16]), m


def _tp_layout(rng, t):
    cfg = draw_model(rng, heads_multiple=t)
    cfg["n_layer"] = min(cfg["n_layer"], 3)
    seq = t * rng.randint(2, 6)  # sequence parallel: seq divides over t
    return cfg, rng.randint(1, 3) * 2, seq


@pytest.mark.parametrize("world, seed", [(2, 21), (3, 22), (4, 23)])
def test_pipeline_and_tensor_parallel_on_drawn_layouts(world, seed):
    rng = random.Random(seed)
    pp_cfg, pp_batch, pp_seq, m = _pp_layout(rng, world)
    tp_cfg, tp_batch, tp_seq = _tp_layout(rng, world)
    pp, tp_ = lr.Workload(pp_cfg, pp_batch, pp_seq), lr.Workload(tp_cfg, tp_batch, tp_seq)
    calls = [("pipeline_parity", (pp, m, ("gpipe", "1f1b"), world > 2)),
             ("pipeline_memories", (pp, m)),
             ("tensor_parallel_parity", (tp_, False)),
             ("tp_step_memory", (tp_, tp_batch // 2, False)),
             ("tp_step_memory", (tp_, tp_batch // 2, True))]
    if world > 2:  # the report: a 6-layer width-48 model at 3 and 4 stages failed on rank 1
        calls.append(("pipeline_memories", (lr.Workload(REPORTED_PP, 2 * world, 16), world)))
    out = launch(lr.many, world, args=(calls,), timeout_s=300)
    why = _why(seed, world=world, pp_cfg=pp_cfg, pp_batch=pp_batch, pp_seq=pp_seq, m=m)
    for s, res in enumerate(o[0] for o in out):  # every stage's gradients: one process's
        for name in ("gpipe", "1f1b"):
            for k in ("grads",) + (("torch",) if world > 2 else ()):
                diff = max((res[name][k][n] - res["reference"][n]).abs().max().item() for n in res["reference"])
                assert diff < GRAD_TOL, f"{why}: stage {s} {name} {k} off by {diff}"
    for cfg, batch, seq, mm, idx in [(pp_cfg, pp_batch, pp_seq, m, 1)] + ([(REPORTED_PP, 2 * world, 16, world, 5)]
                                                                          if world > 2 else []):
        for name in ("gpipe", "1f1b"):
            est = estimate_ranks(Recipe(GPTConfig(**cfg), batch, seq, pp=world, micro_batch=batch // mm,
                                        schedule=name))
            for s, (e, o) in enumerate(zip(est, out)):
                meas = o[idx][name]["peak"]["total"]
                err = e.peak.total / meas - 1
                print(f"{why} [{cfg}] {name} stage {s} {o[idx][name]['layers']}: measured {meas:,} predicted "
                      f"{e.peak.total:,} ({err:+.2%})")
                assert abs(err) <= TOL, f"{why}: {cfg} {name} stage {s} {err:+.2%} at {e.peak_moment.where}"
    twhy = _why(seed, world=world, tp_cfg=tp_cfg, tp_batch=tp_batch, tp_seq=tp_seq)
    for rank, o in enumerate(out):
        par = o[2]
        for k in ("tp", "sp"):
            assert abs(par[k]["loss"] - par["loss"]) < GRAD_TOL, f"{twhy}: rank {rank} {k} loss"
            diff = max((par[k]["grads"][n] - par["reference"][n]).abs().max().item() for n in par["reference"])
            assert diff < GRAD_TOL, f"{twhy}: rank {rank} {k} gradients off by {diff}"
        for sp, meas in ((False, o[3]), (True, o[4])):
            e = estimate_ranks(Recipe(GPTConfig(**tp_cfg), tp_batch, tp_seq, tp=world, micro_batch=tp_batch // 2,
                                      sequence_parallel=sp))[rank]
            assert meas["n_params"] == e.n_params, twhy
            err = e.peak.total / meas["peak"]["total"] - 1
            print(f"{twhy} sp={sp} rank {rank}: measured {meas['peak']['total']:,} predicted {e.peak.total:,} "
                  f"({err:+.2%})")
            assert abs(err) <= TOL, f"{twhy}: sp={sp} rank {rank} {err:+.2%} at {e.peak_moment.where}"


def test_a_middle_stage_without_a_batch_shape_is_one_clear_error():
    import torch

    from labkit.distributed import pipeline as pl
    from labkit.models.gpt import GPT

    torch.manual_seed(0)
    stage = pl.build_stage(GPT(GPTConfig(**REPORTED_PP)), 1, 3)
    with pytest.raises(ValueError, match="middle stage .* batch_shape"):
        pl.run_step(stage, pl.schedule("1f1b", 2, 3, 1), None, None, 2)
