"""Combinations on pipeline stages and tensor-parallel ranks that issue 43's cross product found refused, each
rank's estimate against its own ledger (real gloo ranks, one launch):

- paged optimizer states (bitsandbytes' PagedAdamW: the states in CUDA unified memory, which
  max_memory_allocated does not count) on stages and on tensor-parallel ranks: each category of the peak
  without the states, and the states' bytes in `Estimate.unified`;
- GaLore on pipeline stages, checkpointed: each stage projects its own blocks' attention and MLP matrices
  (layout_terms.rank_spec keeps the stage's GaLore matrices; it kept none, and the state was 13-37 % of the
  peak over);
- QLoRA on pipeline stages (each stage's own Linears stored in NF4, its share of the quantized base);
- selective and sqrt checkpointing on pipeline stages (each stage checkpoints its own blocks by the policy;
  only full was estimated);
- tensor parallelism on transformers' Llama (GQA's key/value heads split with the query heads).
"""

import functools

from labkit.distributed import launch
from labkit.distributed import layout_ranks as lr
from labkit.estimate import Recipe, estimate_ranks
from labkit.memory import CATEGORIES, Category
from labkit.memory.report import Variant
from labkit.models.gpt import GPTConfig
from labkit.peft import LISA
from labkit.run.step import apply_peft

TOL = 0.03  # of the measured peak, per category (tests/unit/estimate_checks.py)
CFG = dict(vocab_size=64, block_size=32, n_layer=4, n_head=2, n_embd=32)


def _within(e, got: dict, why: str, phases: bool = True) -> None:
    """Each category at the peak, and each phase's total (phases=False: the peak only), within TOL."""
    peak = got["peak"]
    for c in CATEGORIES:
        assert abs(e.peak[c] - peak[c.name.lower()]) <= TOL * peak["total"], (why, c.name, e.peak[c], peak)
    for phase, meas in got["phases"].items() if phases else ():
        assert abs(e.phases[phase].total - meas["total"]) <= TOL * peak["total"], (why, phase, meas)


def _each_phase_within(e, got: dict, why: str) -> None:
    """Each phase's total and model states (parameters, gradients, optimizer state) within TOL of the
    measured peak. For a rank whose backward moments lie within gloo's jitter of each other (below), the
    activations and temporaries at a phase's peak would compare two different moments."""
    top = got["peak"]["total"]
    for phase, meas in got["phases"].items():
        assert abs(e.phases[phase].total - meas["total"]) <= TOL * top, (why, phase, meas)
        for c in (Category.PARAM, Category.GRAD, Category.OPT):
            assert abs(e.phases[phase][c] - meas[c.name.lower()]) <= TOL * top, (why, phase, c.name, meas)


def test_paged_states_galore_and_checkpoint_policies_on_stages_and_ranks():
    w = lr.Workload(CFG, 4, 32)
    qlora = functools.partial(apply_peft, dtype="fp32", lora_rank=4, quant="nf4")  # NF4 base, LoRA adapters
    out = launch(lr.many, 2, args=([("pipeline_memories", (w, 2, ("1f1b",), False, None, None, False, True)),
                                    ("tp_step_memory", (w, None, True, 2, None, True)),
                                    ("pipeline_memories", (w, 2, ("1f1b",), True, None, None, False, False, 4)),
                                    ("pipeline_memories", (w, 2, ("1f1b",), "selective")),
                                    ("pipeline_memories", (w, 2, ("gpipe",), "sqrt")),
                                    ("pipeline_memories", (w, 2, ("1f1b",), False, qlora))],),
                 timeout_s=300)
    gpt = GPTConfig(**CFG)
    paged = estimate_ranks(Recipe(gpt, 4, 32, pp=2, micro_batch=2, schedule="1f1b", paged_states=True))
    tp = estimate_ranks(Recipe(gpt, 4, 32, tp=2, sequence_parallel=True, paged_states=True))
    galore = estimate_ranks(Recipe(gpt, 4, 32, pp=2, micro_batch=2, schedule="1f1b", optimizer="galore",
                                   rank=4, checkpoint="full"))
    selective = estimate_ranks(Recipe(gpt, 4, 32, pp=2, micro_batch=2, schedule="1f1b", checkpoint="selective"))
    sqrt = estimate_ranks(Recipe(gpt, 4, 32, pp=2, micro_batch=2, schedule="gpipe", checkpoint="sqrt"))
    qlora_st = estimate_ranks(Recipe(gpt, 4, 32, pp=2, micro_batch=2, schedule="1f1b", lora_rank=4, quant="nf4"))
    for k in range(2):
        # a sequence-parallel rank's measured forward phase varies from run to run on a loaded machine (by
        # 24,584 B, 3 % of this peak, in 2 of 6 runs; the cause is not named yet): its peak only
        for e, got, why, phases in ((paged[k], out[k][0]["1f1b"], f"paged stage {k}", True),
                                    (tp[k], out[k][1], f"paged tp {k}", False)):
            _within(e, got, why, phases)
            assert e.unified == got["unified"] > 0, (why, e.unified, got["unified"])
            assert "paged_states" in e.label
        # the measured steps reuse the projectors the first step made: the steady step's moments
        _within(galore[k].without(Variant.REFRESH), out[k][2]["1f1b"], f"GaLore stage {k}")
        assert galore[k].peak[Category.OPT] == out[k][2]["1f1b"]["peak"]["opt"]
        # each stage checkpoints its own blocks by the policy: selective, and sqrt (one segment of 2 blocks)
        _within(selective[k], out[k][3]["1f1b"], f"selective stage {k}")
        _within(sqrt[k], out[k][4]["gpipe"], f"sqrt stage {k}")
        _within(qlora_st[k], out[k][5]["1f1b"], f"QLoRA stage {k}")  # each stage's own NF4 Linears


def test_tensor_parallel_llama_matches_one_process_and_its_estimate():
    """transformers' Llama split 2 ways (tensor_parallel.LlamaTP: q, k, v, gate and up column-parallel, GQA's
    2 key/value heads one per rank; o and down row-parallel): the loss and each rank's gradients as one
    process computes them, and each rank's peak per category against its estimate (the whole batch, 2
    micro-batches, full and selective checkpointing, step in backward, activations or optimizer offloaded,
    LoRA (its adapters split with their Linears, parity with one process), LISA: a rank is estimated as one
    device's narrower Llama, layout_terms.llama_tp_rank)."""
    whole = lr.Workload({}, 2, 32, family="llama")
    lora = functools.partial(apply_peft, dtype="fp32", lora_rank=8)  # adapters split with their Linears
    out = launch(lr.many, 2, args=([("llama_tensor_parallel_parity", (whole,)),
                                    ("tp_step_memory", (whole,)),
                                    ("tp_step_memory", (lr.Workload({}, 4, 32, family="llama"), 2)),
                                    ("tp_step_memory", (lr.Workload({}, 4, 32, family="llama"), 2, False, 2, None,
                                                        False, "full")),
                                    ("tp_step_memory", (lr.Workload({}, 4, 32, family="llama"), 2, False, 2, None,
                                                        False, "selective")),
                                    ("tp_step_memory", (whole, None, False, 2, None, False, "full", True)),
                                    ("tp_step_memory", (whole, None, False, 2, None, False, "none", False, True)),
                                    ("tp_step_memory", (whole, None, False, 2, "cpu")),
                                    ("llama_tensor_parallel_parity", (whole, lora)),
                                    ("tp_step_memory", (whole, None, False, 2, None, False, "full", False, False,
                                                        lora)),
                                    ("tp_step_memory", (lr.Workload({"num_hidden_layers": 4}, 2, 32, family="llama"),
                                                        None, False, 2, None, False, "none", False, False, None,
                                                        functools.partial(LISA, gamma=1, interval=20, seed=0)))],),
                 timeout_s=300)
    plain = estimate_ranks(Recipe.of("llama-tiny", 2, 32, tp=2, dtype="fp32"))
    micro = estimate_ranks(Recipe.of("llama-tiny", 4, 32, tp=2, micro_batch=2, dtype="fp32"))
    full = estimate_ranks(Recipe.of("llama-tiny", 4, 32, tp=2, micro_batch=2, dtype="fp32", checkpoint="full"))
    sel = estimate_ranks(Recipe.of("llama-tiny", 4, 32, tp=2, micro_batch=2, dtype="fp32", checkpoint="selective"))
    sib = estimate_ranks(Recipe.of("llama-tiny", 2, 32, tp=2, dtype="fp32", checkpoint="full", step_in_backward=True))
    act = estimate_ranks(Recipe.of("llama-tiny", 2, 32, tp=2, dtype="fp32", offload_activations=True))
    off = estimate_ranks(Recipe.of("llama-tiny", 2, 32, tp=2, dtype="fp32", optimizer_offload="cpu"))
    lisa = estimate_ranks(Recipe.of("llama-tiny", 2, 32, tp=2, dtype="fp32", lisa_layers=1, num_hidden_layers=4))
    lora_ck = estimate_ranks(Recipe.of("llama-tiny", 2, 32, tp=2, dtype="fp32", lora_rank=8, checkpoint="full"))
    for k in range(2):
        assert out[k][0]["loss"] < 1e-5 and out[k][0]["grad"] < 1e-6, out[k][0]
        _within(plain[k], out[k][1], f"tp rank {k}")
        _within(micro[k], out[k][2], f"tp rank {k}, 2 micro-batches")
        # checkpointed: the backward's temporaries measure 16,384 B more in some runs (2 of 6 in one loaded
        # launch): an (r, h) input gradient that copy_to_tp's backward all-reduced, still alive after the
        # all-reduce returned (most likely gloo's worker thread has not dropped its reference yet); then
        # the backward's peak is sometimes its earlier moment (at the head, 0.6 % lower without it)
        _each_phase_within(full[k], out[k][3], f"tp rank {k}, checkpointed")
        _each_phase_within(sel[k], out[k][4], f"tp rank {k}, selective")
        for e, got, why in ((sib[k], out[k][5], "step in backward, checkpointed"),
                            (act[k], out[k][6], "activations offloaded"), (off[k], out[k][7], "optimizer offloaded")):
            _within(e, got, f"tp rank {k}, {why}")
        assert out[k][8]["loss"] < 1e-5 and out[k][8]["grad"] < 1e-6, out[k][8]  # LoRA: A and B as one process
        _within(lora_ck[k], out[k][9], f"tp rank {k}, LoRA, checkpointed", phases=False)
        _within(lisa[k], out[k][10], f"tp rank {k}, LISA (1 of 4 layers)")
        assert plain[k].n_params == out[k][0]["n_params"]
