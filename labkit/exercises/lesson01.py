"""Checks for lesson 01 (memory accounting): bytes per parameter, the logits term, the largest batch that fits
(a number, then a function checked on fresh models and budgets), and why the peak is not the sum of the terms.

Every expected value comes from labkit.memory (the estimator and its term functions), so a check
agrees with the lesson's own predictions by construction.
"""

from __future__ import annotations

import random

from labkit.memory import GiB, MiB, TermKey, fmt_bytes
from labkit.memory.report import Category
from labkit.estimate.predict import (
    Precision,
    autocast_copy_bytes,
    grad_bytes,
    optimizer_state_bytes,
    param_bytes,
)
from labkit.estimate import estimate
from labkit.estimate.spec import spec_from

from . import Inputs, checked_choice, close, failed, integer, not_answered, number, passed, unanswered

inputs = Inputs(__name__, {  # each exercise's inputs: the lesson's own first, then what a course may draw
    "bytes_per_param": {"optimizer": ("sgd-momentum", "sgd", "adamw")},
    "logits_bytes": {"batch": (4, 3, 5, 7), "seq": (4096, 2048, 8192)},  # 12 token counts B x S, all different
    "largest_batch": {"seq": (1024, 512, 256), "budget": (16 * GiB, 8 * GiB, 24 * GiB, 40 * GiB)},
})

LOGITS_KEY = TermKey.LOG_SOFTMAX  # the estimator's key of the B x S x V term ("log-softmax of the logits")
STATES = {"sgd": "no state", "sgd-momentum": "one momentum buffer", "adam": "two moments, m and v",
          "adamw": "two moments, m and v"}  # what each optimizer keeps per parameter


# ---- exercise 1: bytes per parameter -----------------------------------------------------------
def model_state_bytes_per_param(model="gpt2", dtype: str = "fp32", optimizer: str = "adamw") -> float:
    """(weights + autocast copies + gradients + optimizer state) / N, from the estimator's term functions."""
    spec, prec = spec_from(model), Precision.of(dtype)
    total = (param_bytes(spec, prec) + autocast_copy_bytes(spec, prec) + grad_bytes(spec, prec)
             + optimizer_state_bytes(spec, prec, optimizer))
    return total / spec.n_params


def check_bytes_per_param(fp32, mixed, model="gpt2", optimizer: str = "adamw", mixed_dtype: str = "mixed-bf16") -> bool:
    """Bytes of model states per parameter: plain fp32 training, and torch.autocast mixed precision."""
    spec = spec_from(model)
    per = lambda b: b / spec.n_params  # noqa: E731
    ok_fp32 = _check_fp32(fp32, _states_per_param(spec, "fp32", optimizer), spec, optimizer, per)
    ok_mixed = _check_mixed(mixed, _states_per_param(spec, mixed_dtype, optimizer), spec, optimizer,
                            mixed_dtype, per)
    return ok_fp32 and ok_mixed


def _states_per_param(spec, dtype: str, optimizer: str) -> float:
    """The check's own path (not model_state_bytes_per_param, which the student build stubs): the estimator's
    whole step at one token, its parameter, gradient and optimizer categories summed, over N."""
    states = (Category.PARAM, Category.GRAD, Category.OPT)
    est = estimate(spec, 1, 1, dtype, optimizer)
    return sum(t.bytes for t in est.terms if t.category in states) / spec.n_params


def _check_fp32(answer, expected, spec, optimizer, per) -> bool:
    name = "fp32 bytes per parameter"
    value = number(answer, name)
    if value is None:
        return False
    if close(value, expected, abs_=0.1):
        return passed(f"{name}: {value:g}. The weight, its gradient and {optimizer}'s {STATES[optimizer]}, "
                      "all in fp32.")
    fp32 = Precision.of("fp32")
    if close(value, expected * spec.n_params, rel=0.01):
        return failed(f"{name}: that is the total for the whole model; divide by the number of parameters.")
    if close(value, expected - per(grad_bytes(spec, fp32)), abs_=0.1):
        return failed(f"{name}: the gradients are missing: backward leaves one gradient per parameter, "
                      "in the parameter's dtype.")
    if close(value, per(param_bytes(spec, fp32) + grad_bytes(spec, fp32)), abs_=0.1):
        return failed(f"{name}: the optimizer state is missing: {optimizer} keeps {STATES[optimizer]} for "
                      "every parameter.")
    return failed(f"{name}: count, per parameter, the fp32 weight + its fp32 gradient + {optimizer}'s "
                  f"{STATES[optimizer]} (fp32, like the weight). An fp32 number takes 4 bytes.")


def _check_mixed(answer, expected, spec, optimizer, mixed_dtype, per) -> bool:
    name = f"{mixed_dtype} bytes per parameter"
    value = number(answer, name)
    if value is None:
        return False
    fp32, half = Precision.of("fp32"), Precision.of("bf16")
    every_weight_copied = expected + per(param_bytes(spec, half) - autocast_copy_bytes(spec, Precision.of(mixed_dtype)))
    if expected - 0.1 <= value <= every_weight_copied + 0.1:  # 18 counts a copy of every weight: accepted
        return passed(f"{name}: {value:g}. Exactly, it is {expected:.2f} for this model: autocast makes a 16-bit "
                      "copy only of the weights that enter a matmul (not of the norms, nor of the embedding lookup).")
    zero = per(param_bytes(spec, half) + grad_bytes(spec, half) + param_bytes(spec, fp32)
               + optimizer_state_bytes(spec, fp32, optimizer))
    with_half_grads = expected + per(grad_bytes(spec, half))
    if close(value, zero, abs_=0.1):
        return failed(f"{name}: that is ZeRO's count (a 16-bit model and 16-bit gradients + fp32 masters and "
                      "optimizer state; the gradients are cast to fp32 on the fly), another scheme. torch.autocast "
                      "keeps no 16-bit model: the fp32 weights are the master copy, and their .grad is fp32 too.")
    if close(value, with_half_grads, abs_=0.1):
        return failed(f"{name}: torch.autocast keeps no 16-bit gradient copy: backward writes the gradients "
                      "straight into the fp32 weights' .grad. (A scheme that keeps 16-bit and fp32 gradients "
                      "both reaches 20 with Adam.)")
    if close(value, expected * spec.n_params, rel=0.01):
        return failed(f"{name}: that is the total for the whole model; divide by the number of parameters.")
    return failed(f"{name}: count, per parameter, the fp32 weight (the master copy is the model itself) + "
                  "autocast's 16-bit copy of it + its gradient (in the weight's dtype, fp32) + "
                  f"{optimizer}'s {STATES[optimizer]} (fp32). fp32 takes 4 bytes, bf16/fp16 take 2.")


# ---- exercise 2: the logits term ---------------------------------------------------------------
def logits_term_bytes(model="gpt2", batch: int = 8, seq: int = 1024, dtype: str = "fp32") -> int:
    """The estimator's bytes for the log-softmax of the logits that the loss saves for backward."""
    est = estimate(model, batch, seq, dtype)
    return next(t.bytes for t in est.terms if t.key is LOGITS_KEY)


def check_logits_bytes(answer, model="gpt2", batch: int = 8, seq: int = 1024, dtype: str = "fp32") -> bool:
    """Bytes of the log-softmax of the logits, saved for backward: B x S x V x 4 when the loss runs in fp32."""
    name = f"log-softmax bytes at batch {batch}, seq {seq}"
    value = number(answer, name)
    if value is None:
        return False
    spec = spec_from(model)
    expected = logits_term_bytes(spec, batch, seq, dtype)
    if close(value, expected, rel=1e-6):
        return passed(f"{name}: {fmt_bytes(expected)}. One fp32 number per token per vocabulary entry: "
                      "with a big vocabulary this one tensor can outweigh a whole transformer block.")
    for unit, size in (("GiB", GiB), ("MiB", MiB)):
        if close(value * size, expected, rel=0.01):
            return failed(f"{name}: that looks like {unit}; give the answer in bytes.")
    tokens = batch * seq
    if close(value, tokens * spec.vocab, rel=1e-6):
        return failed(f"{name}: you counted elements, not bytes: each one is an fp32 number.")
    if close(value, tokens * spec.hidden * 4, rel=1e-6):
        return failed(f"{name}: that is the size of the hidden state (B x S x h); the logits have one entry "
                      f"per token per vocabulary word (V = {spec.vocab:,}).")
    return failed(f"{name}: the loss keeps its log-softmax for backward: batch x seq x vocab elements, "
                  f"4 bytes each (V = {spec.vocab:,} for this model).")


# ---- exercise 3: the largest batch that fits ---------------------------------------------------
def predicted_peak(model, batch: int, seq: int, dtype: str = "fp32", optimizer: str = "adamw",
                   device: str = "cpu") -> int:
    """The estimator's peak bytes of one training step (the largest phase, not the sum of phases)."""
    return estimate(model, batch, seq, dtype, optimizer, device=device).peak.total


def check_largest_batch(answer, model, seq: int, budget: int, dtype: str = "fp32", optimizer: str = "adamw",
                        device: str = "cpu") -> bool:
    """The largest batch whose predicted peak fits `budget` bytes: batch fits and batch + 1 does not."""
    name = f"largest batch in {fmt_bytes(budget)}"
    b = integer(answer, name)
    if b is None:
        return False
    if b < 0:
        return failed(f"{name}: a batch cannot be negative.")
    spec = spec_from(model)

    def peak(n: int) -> int:  # the estimator's step, not predicted_peak (which the student build stubs)
        return estimate(spec, n, seq, dtype, optimizer, device=device).peak.total

    if b > 0 and peak(b) > budget:
        return failed(f"{name}: batch {b} does not fit: its predicted peak is {fmt_bytes(peak(b))}. "
                      "Look for a smaller batch (estimate(...).peak.total must stay <= the budget).")
    nxt = peak(b + 1)
    if nxt <= budget:
        return failed(f"{name}: batch {b + 1} fits too (predicted peak {fmt_bytes(nxt)}): look for a larger one.")
    if b == 0:
        return passed(f"{name}: not even batch 1 fits (predicted peak {fmt_bytes(nxt)}): the model states alone "
                      "are too much. Lessons 02-08 are about exactly this.")
    return passed(f"{name}: batch {b} (peak {fmt_bytes(peak(b))}); batch {b + 1} would need {fmt_bytes(nxt)}.")


# ---- exercise 4 (code): the largest batch that fits, as a function -------------------------------------
def _largest_batch_cases(seed: int) -> list[tuple]:
    """Fresh questions: a tiny preset, a sequence length and a budget between the peaks of two neighbouring
    batches (so exactly one answer is right), and one budget that not even batch 1 fits."""
    rng = random.Random(seed)
    out = []
    for model in ("gpt2-tiny", "llama-tiny"):
        seq, b = rng.choice([32, 64, 128]), rng.randint(1, 12)
        lo, hi = (estimate(model, n, seq, "fp32", "adamw").peak.total for n in (b, b + 1))
        out.append((model, seq, int(lo + rng.uniform(0.1, 0.9) * (hi - lo))))
    out.append(("gpt2-tiny", rng.choice([32, 64]), 1024))  # a KiB: nothing fits
    return out


def largest_batch(model, seq: int, budget: int) -> int:
    """Reference: the largest batch whose predicted peak (fp32, AdamW, cpu) fits `budget`; 0 if none."""
    b = 0
    while predicted_peak(model, b + 1, seq) <= budget:
        b += 1
    return b


def check_largest_batch_fn(fn, seed: int | None = None) -> bool:
    """The learner's largest_batch_fn(model, seq, budget), compared with the reference on fresh cases."""
    what = "largest_batch_fn(model, seq, budget)"
    if unanswered(fn):
        return not_answered(what)
    if not callable(fn):
        return failed(f"{what}: expected a function, got {type(fn).__name__}")
    cases = _largest_batch_cases(random.randrange(1 << 30) if seed is None else seed)
    for model, seq, budget in cases:
        try:
            got = fn(model, seq, budget)
        except Exception as e:  # the learner's code: say what failed, do not stop the notebook
            return failed(f"{what} raised {type(e).__name__}: {e} for {model}, seq {seq}, {budget:,} bytes")
        want = largest_batch(model, seq, budget)
        if got != want:
            hint = ("return 0 when not even batch 1 fits" if want == 0 else
                    "that batch's predicted peak is over the budget" if isinstance(got, int) and got > want else
                    "a larger batch fits too: keep going while estimate(...).peak.total <= budget")
            return failed(f"{what}: wrong for {model}, seq {seq}, {budget:,} bytes ({hint}).")
    return passed(f"{what}: right on {len(cases)} fresh cases (two tiny models at budgets between two "
                  f"neighbouring batches' peaks, and one budget nothing fits).")


# ---- exercise 5 (why): the peak is not the sum of the terms -----------------------------------------------
WHY_PEAK = {
    "a": "the caching allocator compresses tensors it has not touched for a while",
    "b": "not every tensor is alive at the same moment: backward frees the saved activations block by block, "
         "and the optimizer's temporaries appear only after backward is done",
    "c": "the estimator leaves the gradients out of the peak, since they replace the activations in place",
}


def check_why_peak(answer) -> bool:
    what = "why the step's peak is smaller than the sum of all its terms"
    return checked_choice(
        answer, what, WHY_PEAK, right="b",
        praise=f"{what}: right: memory is a timeline; the peak is the largest moment of it, so what matters "
                 f"is which tensors overlap.",
        hints={"a": f"{what}: the allocator rounds and caches blocks but never compresses them; look at when "
                 f"each tensor is created and freed during the step."},
        otherwise=f"{what}: look at the estimator's phases: the gradients are counted, and they are new tensors, "
                 f"not the activations' storage reused.")
