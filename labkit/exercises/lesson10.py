"""Checks for lesson 10 (pipeline and tensor parallelism): the activations stage 0 holds under each schedule,
the pipeline bubble, and one tensor-parallel rank's parameter bytes.

Expected values come from the library: the schedules' actions (labkit.distributed.pipeline) and the per-rank
estimate's terms and parameter shares (labkit.estimate.layout_terms).
"""

from __future__ import annotations

from fractions import Fraction

from labkit.memory import TermKey

from . import Inputs, close, failed, integer, number, passed

inputs = Inputs(__name__, {  # each exercise's inputs: the lesson's own first, then what a course may draw
    "stage0_activations": {"batch": (16, 32), "p": (4, 2, 8), "m": (8, 16)},  # p divides the 8 layers, m the batch
    "bubble": {"p": (4, 2, 8), "m": (12, 8, 16, 24)},
    "tp_param_bytes": {"t": (2, 4), "dtype": ("fp32", "bf16")},  # t divides the lesson's 4 heads
})

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # bytes per parameter of each dtype the estimate takes for pure training


# ---- exercise 1: activations of stage 0 under each schedule --------------------------------------------------
def stage0_activation_bytes(model, batch: int, seq: int, p: int, m: int, schedule: str) -> tuple[int, int, int]:
    """(bytes stage 0 holds at most, one micro-batch's, micro-batches in flight) from labkit's schedule and
    the per-rank estimate."""
    from labkit.distributed.pipeline import max_in_flight, schedule as actions
    from labkit.estimate import estimate_ranks

    est = estimate_ranks(model, batch, seq, pp=p, micro_batch=batch // m, schedule=schedule)[0]
    one = next(t.bytes for t in est.terms if t.key is TermKey.SAVED_ACTIVATIONS)
    k = max_in_flight(actions(schedule, m, p, 0))
    return k * one, one, k


def check_stage0_activations(gpipe, one_f_one_b, model, batch: int, seq: int, p: int = 4, m: int = 8) -> bool:
    ok = True
    for answer, name in ((gpipe, "gpipe"), (one_f_one_b, "1f1b")):
        what = f"activation bytes stage 0 holds at most under {name} (p={p}, m={m})"
        value = integer(answer, what)
        if value is None:
            ok = False
            continue
        expected, one, k = _stage0(model, batch, seq, p, m, name)
        if value == expected:
            passed(f"{what}: {expected:,} = {k} micro-batches in flight x {one:,} bytes each.")
            continue
        ok = False
        if one and value % one == 0:
            n = value // one
            why = ("GPipe runs every forward before any backward: all m are held" if name == "gpipe" else
                   f"1F1B starts backwards after p - s = {p} forwards on stage 0: min(p - s, m) are held")
            failed(f"{what}: {n} micro-batches' worth; {why}.")
        else:
            failed(f"{what}: count micro-batches in flight x one micro-batch's activations on stage 0 "
                   f"(the term 'activations of one micro-batch' of estimate_ranks(...)[0]).")
    return ok


def _stage0(model, batch: int, seq: int, p: int, m: int, schedule: str) -> tuple[int, int, int]:
    """The check's path (not stage0_activation_bytes, which the student build stubs): the per-rank estimate's
    activation category on stage 0 (one micro-batch), times the micro-batches the schedule's own actions hold."""
    from labkit.distributed.pipeline import max_in_flight, schedule as actions
    from labkit.estimate import estimate_ranks
    from labkit.memory.report import Category

    est = estimate_ranks(model, batch, seq, pp=p, micro_batch=batch // m, schedule=schedule)[0]
    one = sum(t.bytes for t in est.terms if t.category is Category.ACT)
    k = max_in_flight(actions(schedule, m, p, 0))
    return k * one, one, k


# ---- exercise 2: the bubble ------------------------------------------------------------------------------------
def bubble(p: int, m: int) -> Fraction:
    from labkit.distributed.pipeline import bubble_fraction

    return bubble_fraction(p, m)


def check_bubble(answer, p: int = 4, m: int = 12) -> bool:
    what = f"idle fraction of a step with p={p} stages and m={m} micro-batches"
    value = number(answer, what)
    if value is None:
        return False
    expected = float(bubble(p, m))
    if close(value, expected, abs_=5e-4):
        return passed(f"{what}: (p - 1)/(m + p - 1) = {p - 1}/{m + p - 1} = {expected:.4f}, the same for GPipe and 1F1B.")
    if close(value, (p - 1) / m, abs_=5e-4):
        return failed(f"{what}: (p - 1)/m is the bubble's time relative to the ideal step; as a share of the "
                      f"whole step divide by m + p - 1.")
    if close(value, 1 - expected, abs_=5e-4):
        return failed(f"{what}: that is the busy share; the question asks for the idle one.")
    return failed(f"{what}: each stage waits p - 1 slots at the start and end of a step of m + p - 1 slots.")


# ---- exercise 3: one tensor-parallel rank's parameters -------------------------------------------------------
def tp_param_bytes(model, t: int, bytes_per: int = 4) -> int:
    """Bytes of parameters one tensor-parallel rank holds (labkit.estimate.layout_terms.rank_params)."""
    from labkit.estimate.layout_terms import rank_params, _numel
    from labkit.estimate.spec import spec_from

    return bytes_per * sum(_numel(s) for _, s in rank_params(spec_from(model), 0, 1, t))


def check_tp_param_bytes(answer, model, t: int = 2, dtype: str = "fp32") -> bool:
    from labkit.estimate.spec import spec_from

    what = f"parameter bytes ({dtype}) of one rank with tensor-parallel degree t={t}"
    value = integer(answer, what)
    if value is None:
        return False
    from labkit.estimate import estimate_ranks
    from labkit.memory.report import Category

    # the estimator's whole step for rank 0 at tp=t, its parameter category (weights in `dtype`; not
    # tp_param_bytes, which the student build stubs)
    expected = sum(x.bytes for x in estimate_ranks(model, 1, 1, tp=t, dtype=dtype)[0].terms
                   if x.category is Category.PARAM)
    full = BYTES[dtype] * spec_from(model).n_params
    if value == expected:
        return passed(f"{what}: {expected:,} of the unsplit {full:,}: the blocks' matrices and the column-parallel "
                      f"biases divided by {t}; embeddings, LayerNorms and row-parallel biases whole on every rank.")
    if value == full // t:
        return failed(f"{what}: not everything is split: the embeddings, the LayerNorms and the row-parallel "
                      f"layers' biases are replicated on every rank.")
    if value == full:
        return failed(f"{what}: that is the unsplit model; each rank keeps 1/t of the attention and MLP matrices.")
    if dtype != "fp32" and value == expected * 4 // BYTES[dtype]:
        return failed(f"{what}: that counts 4 bytes per parameter; in {dtype} each takes {BYTES[dtype]}.")
    return failed(f"{what}: add the rank's share of each parameter: c_attn and c_fc (weight and bias) / t, "
                  f"c_proj weights / t, everything else whole.")
