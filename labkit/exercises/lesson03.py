"""Checks for lesson 03 (activation checkpointing): what a checkpointed block keeps, the best number of
segments, and the FLOPs that recomputation adds.

Expected values come from the library: the model's shapes (labkit.memory.spec_from), the estimator's
checkpoint option, and a measured training step under FlopCounterMode (labkit.run.policies).
"""

from __future__ import annotations

import math
import random

import torch

from labkit.memory import MiB, TermKey, fmt_bytes
from labkit.memory.report import Category
from labkit.estimate import estimate
from labkit.estimate.predict import Precision
from labkit.estimate.spec import spec_from

from . import Inputs, checked_choice, close, failed, integer, not_answered, number, passed, unanswered

inputs = Inputs(__name__, {  # each exercise's inputs: the lesson's own first, then what a course may draw
    "kept_per_block": {"dtype": ("fp32", "bf16")},
    "best_segments": {"n_layer": (None, 6, 8, 10)},  # None: CONFIG's own depth
    # a backward of 2 forwards is the lesson's (and the measurement's); 3 and 4 ask the reasoning alone
    "recompute_factor": {"backward_ratio": (2, 3, 4)},
    "scores_crossover": {"dtype": ("fp32", "bf16", "mixed-bf16")},
})


# ---- exercise 1: what full checkpointing keeps per block ----------------------------------------
def kept_per_block(config, batch: int, seq: int, dtype: str = "fp32") -> int:
    """A checkpointed block keeps its input, the residual stream: batch x seq x hidden x bytes per element."""
    spec = spec_from(config)
    return batch * seq * spec.hidden * Precision.of(dtype).weight


def check_kept_per_block(answer, config, batch: int, seq: int, dtype: str = "fp32") -> bool:
    name = f"bytes kept per checkpointed block (batch {batch}, seq {seq}, {dtype})"
    value = number(answer, name)
    if value is None:
        return False
    spec = spec_from(config)
    expected = _checkpoint_input(spec, batch, seq, dtype)
    width = Precision.of(dtype).weight
    if close(value, expected, rel=1e-9):
        return passed(f"{name}: {fmt_bytes(expected)} = {batch} x {seq} x {spec.hidden} x {width}: only the block's input "
                      "(the residual stream); everything inside the block is recomputed in backward.")
    if close(value, expected * spec.n_layer, rel=1e-9):
        return failed(f"{name}: that is all {spec.n_layer} blocks together; the question asks per block.")
    if close(value, expected / width, rel=1e-9):
        return failed(f"{name}: you counted elements, not bytes: each is {width} bytes in {dtype}.")
    if close(value, expected * spec.ffn / spec.hidden, rel=1e-9):
        return failed(f"{name}: that is the MLP's inner width ({spec.ffn}); the block's input is the residual stream, "
                      f"{spec.hidden} wide.")
    layer = estimate(spec, batch, seq, dtype).terms
    blocks = next(t.bytes for t in layer if t.key is TermKey.SAVED_ACTIVATIONS)
    if close(value, blocks / spec.n_layer, rel=0.02):
        return failed(f"{name}: that is what a block saves *without* checkpointing; with it, only its input stays.")
    if close(value, expected / MiB, rel=0.01):
        return failed(f"{name}: that looks like MiB; give the answer in bytes.")
    return failed(f"{name}: a checkpointed block keeps only its input, a (batch, seq, hidden) tensor of the model's "
                  f"dtype: hidden = {spec.hidden}, {width} bytes per element.")


def _checkpoint_input(config, batch: int, seq: int, dtype: str = "fp32", device: str = "cpu") -> int:
    """The check's path (not kept_per_block, which the student build stubs): the estimator's whole step with every
    block checkpointed, one segment per block against one segment for all: the activations held at the step's
    first moment (the loss) differ by n - 1 segment inputs."""
    spec = spec_from(config)
    n = spec.n_layer

    def held(k: int) -> int:
        est = estimate(spec, batch, seq, dtype, device=device, checkpoint="full", segments=k)
        return sum(t.bytes for t in est.moments[0].terms if t.category is Category.ACT)

    if n < 2:  # one block: its input is all one segment keeps; the difference has nothing to compare
        return batch * seq * spec.hidden * Precision.of(dtype).weight
    return (held(n) - held(1)) // (n - 1)


# ---- exercise 2: the best number of segments ----------------------------------------------------
def segment_peaks(config, batch: int, seq: int, dtype: str = "fp32", device: str = "cpu") -> dict[int, int]:
    """{k: predicted peak with full checkpointing in k segments} for k = 1 .. n_layer."""
    n = spec_from(config).n_layer
    return {k: estimate(config, batch, seq, dtype, device=device, checkpoint="full", segments=k).peak.total
            for k in range(1, n + 1)}


def check_best_segments(answer, config, batch: int, seq: int, dtype: str = "fp32", device: str = "cpu",
                        n_layer: int | None = None) -> bool:
    """`n_layer`: the model made that deep (dataclasses.replace(config, n_layer=...)); None keeps config's."""
    if n_layer is not None:
        from dataclasses import replace

        config = replace(config, n_layer=n_layer)
    name = f"segments with the lowest predicted peak ({spec_from(config).n_layer} blocks)"
    k = integer(answer, name)
    if k is None:
        return False
    n = spec_from(config).n_layer  # every k's estimate (not segment_peaks, which the student build stubs)
    peaks = {j: estimate(config, batch, seq, dtype, device=device, checkpoint="full", segments=j).peak.total
             for j in range(1, n + 1)}
    if not 1 <= k <= n:
        return failed(f"{name}: k must be between 1 and the number of blocks ({n}).")
    best = min(peaks.values())
    winners = [j for j, p in peaks.items() if p == best]
    ratio = _block_to_input(config, batch, seq, dtype, device)
    optimum = (n * ratio) ** 0.5
    why = (f"k segments keep k inputs (a each) and recompute one segment of n/k blocks (A each): k a + (n/k) A is "
           f"smallest near k = sqrt(n A / a); here A = {ratio:.1f} a, so sqrt({n} x {ratio:.1f}) = {optimum:.1f}")
    if k in winners:
        tail = (f" >= n: for a model this shallow memory keeps falling up to k = n." if optimum >= n else
                f" < n = {n}: past it, more segment inputs cost more than the shorter recompute saves.")
        return passed(f"{name}: k = {k}, peak {fmt_bytes(best)} (k = 1: {fmt_bytes(peaks[1])}). {why}{tail}")
    root = max(1, round(n**0.5))
    if k == root:
        return failed(f"{name}: sqrt(n) = {root} minimises k + n/k, which assumes a block's activations cost as much as its "
                      f"input (A = a). Here {why}. Compare the estimates for every k (k = {root}: "
                      f"{fmt_bytes(peaks[k])}, the best: {fmt_bytes(best)}).")
    return failed(f"{name}: k = {k} predicts {fmt_bytes(peaks[k])}, but another k predicts {fmt_bytes(best)}: "
                  "compute the estimate for every k from 1 to n.")


def _block_to_input(config, batch: int, seq: int, dtype: str = "fp32", device: str = "cpu") -> float:
    """A / a: what one block saves (the estimator's per-block activations) over what a checkpoint keeps of it (its
    input)."""
    spec = spec_from(config)
    blocks = next(t.bytes for t in estimate(spec, batch, seq, dtype, device=device).terms
                  if t.key is TermKey.SAVED_ACTIVATIONS)
    return blocks / spec.n_layer / _checkpoint_input(spec, batch, seq, dtype, device)


# ---- exercise 3: the FLOPs recomputation adds ----------------------------------------------------
def recompute_factor(config, batch: int, seq: int, seed: int = 0, device="cpu") -> float:
    """Measured FLOPs of a training step with every block checkpointed / without (FlopCounterMode)."""
    plain, full = _measured_flops(config, batch, seq, seed, device)
    return full / plain


def _measured_flops(config, batch: int, seq: int, seed: int = 0, device="cpu") -> tuple[int, int]:
    """(FLOPs of a plain training step, of one with every block checkpointed), measured under FlopCounterMode
    (labkit.run.policies.measure_training_step) on the lesson's GPT: what the check compares with."""
    from labkit.models.gpt import GPT
    from labkit.recompute import checkpoint_blocks
    from labkit.run.policies import measure_training_step

    torch.manual_seed(seed)
    model = GPT(config).to(device)
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=g)
    x, y = t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)
    plain = measure_training_step(model, x, y).flops
    full = measure_training_step(model, x, y, setup=lambda m: checkpoint_blocks(m, "full")).flops
    return plain, full


def check_recompute_factor(answer, config, batch: int, seq: int, device="cpu", backward_ratio: float = 2) -> bool:
    """The factor by which full checkpointing multiplies a step's FLOPs when a backward costs `backward_ratio`
    forwards: (1 + b + 1) / (1 + b). At b = 2 (what a matmul's backward costs: dX and dW) the measured factor
    on `device` is right too."""
    b = backward_ratio
    name = f"FLOPs factor of full checkpointing (a backward = {b:g} forwards)"
    value = number(answer, name)
    if value is None:
        return False
    reasoned = (2 + b) / (1 + b)
    plain, full = _measured_flops(config, batch, seq, device=device)
    measured = full / plain
    if b == 2 and close(value, measured, abs_=0.03):
        return passed(f"{name}: {value:g}; measured x{measured:.3f}. Forward + backward cost about 3 forwards; the "
                      "recompute adds one forward of the blocks (not of the head and the loss).")
    if close(value, reasoned, abs_=0.01):
        return passed(f"{name}: {reasoned:.4g} is the right reasoning (1 extra forward on top of forward + backward = "
                      f"{1 + b:g} forwards). Measured (where a backward is 2 forwards): x{measured:.3f}, a little "
                      "less than 4/3, since the head and the loss are not recomputed.")
    if close(value, 2.0, abs_=0.05):
        return failed(f"{name}: the recompute is one more *forward* of the blocks, not a whole second step: "
                      "backward is not repeated.")
    if close(value, 1.5, abs_=0.03):
        return failed(f"{name}: 1 extra forward on top of 1 forward + 1 backward, but a backward costs {b:g} forwards "
                      "here (a matmul's costs two forwards: a gradient for the input and one for the weights).")
    if close(value, 1.0, abs_=0.01):
        return failed(f"{name}: recomputation is not free: every checkpointed block runs its forward a second time.")
    return failed(f"{name}: count in forwards: the step is forward (1) + backward ({b:g}); full checkpointing adds "
                  f"one forward of the blocks. The measurement (a backward of 2) says x{measured:.3f}.")


# ---- exercise 4: where the s^2 term takes over -------------------------------------------------------
def scores_crossover(config, batch: int, seq: int, dtype: str = "fp32", device: str = "cpu") -> float:
    """The sequence length at which the manual path's attention probabilities (B a S^2 x bytes per layer) equal
    the rest of what the blocks save (a term in S, plus the S^2 bool causal mask): from the estimator at S and
    2S (the model's positions extended to 2S), solved for rest(S*) = scores(S*)."""
    from dataclasses import replace

    cfg = replace(config, attention="manual", dropout=0.0, block_size=max(config.block_size, 2 * seq))

    def terms(s):
        t = {x.key: x.bytes for x in estimate(cfg, batch, s, dtype, device=device).terms}
        return t[TermKey.SAVED_ACTIVATIONS], t[TermKey.ATTENTION_SCORES]

    (r1, p1), (r2, _) = terms(seq), terms(2 * seq)
    quad = (r2 - 2 * r1) / (2 * seq * seq)  # rest = lin S + quad S^2 (the bool mask)
    lin = (r1 - quad * seq * seq) / seq
    return lin / (p1 / seq**2 - quad)


def _gap(config, batch: int, seq: float, dtype: str, device: str) -> float:
    """(P - R) / P at `seq` tokens from the estimator's whole step (manual attention, positions extended): P the
    attention probabilities, R the rest the blocks save; 0 where the two are equal."""
    from dataclasses import replace

    s = max(1, round(seq))
    cfg = replace(config, attention="manual", dropout=0.0, block_size=max(config.block_size, s))
    t = {x.key: x.bytes for x in estimate(cfg, batch, s, dtype, device=device).terms}
    p = t[TermKey.ATTENTION_SCORES]
    return (p - t[TermKey.SAVED_ACTIVATIONS]) / p


def _replace_attention(config, attention: str = "manual"):
    from dataclasses import replace

    return replace(config, attention=attention, dropout=0.0)


def check_scores_crossover(answer, config, batch: int, seq: int, dtype: str = "fp32", device: str = "cpu") -> bool:
    name = "sequence length where the attention probabilities equal the rest of the blocks' activations"
    value = number(answer, name)
    if value is None:
        return False
    # the property at the learner's S (not scores_crossover, which the student build stubs): P and R equal
    if value >= 1 and abs(_gap(config, batch, value, dtype, device)) <= 0.005:
        return passed(f"{name}: about {value:,.0f} tokens. Below it the blocks' other activations (linear in S) "
                      "dominate; above it the manual path's B a S^2 probabilities do, and they grow 4x per doubling: "
                      "that is the term tiled attention (and any fused kernel) removes.")
    if value >= 1 and abs(_gap(config, batch, value ** 0.5, dtype, device)) <= 0.03:
        return failed(f"{name}: that is about the square of the answer: the probabilities grow with S^2 and the rest "
                      "with S, so their ratio grows with S itself, not with S^2.")
    spec = spec_from(_replace_attention(config))
    terms = {x.key: x.bytes for x in estimate(spec, batch, seq, dtype, device=device).terms}
    naive = seq * terms[TermKey.SAVED_ACTIVATIONS] / terms[TermKey.ATTENTION_SCORES]
    if close(value, naive, rel=0.005):
        return failed(f"{name}: almost: S x R / P treats all of R as linear in S, but R also holds the causal mask, "
                      f"S^2 bools per layer ({spec.n_layer} x {seq}^2 bytes here), which grows like the probabilities.")
    if close(value, seq, rel=0.01):
        return failed(f"{name}: that is the S you estimated at. Find where the two terms would be equal: the rest grows "
                      "like S, the probabilities like S^2.")
    return failed(f"{name}: at your S, take the estimate's 'attention scores (s^2)' P and 'activations saved by the "
                  "blocks' R (manual attention). P grows like S^2; R like S, but for its S^2-byte causal mask per layer: "
                  "solve (R - L S^2) S*/S + L S*^2 = P S*^2 / S^2.")


# ---- exercise 5 (code): the best number of segments from a and A ----------------------------------------
def _segments_cost(n: int, k: int, block_bytes: int, input_bytes: int) -> int:
    """k kept segment inputs + the largest segment's recomputed activations (k even segments of whole blocks)."""
    return k * input_bytes + math.ceil(n / k) * block_bytes


def _segments_cases(seed: int) -> list[tuple[int, int, int]]:
    """Fresh (n blocks, A bytes a block saves, a bytes of its input): A/a from 2 to 40, as real blocks span."""
    rng = random.Random(seed)
    out = []
    for _ in range(6):
        a = rng.randint(1, 64) * 4096
        out.append((rng.randint(3, 64), int(a * rng.uniform(2, 40)), a))
    return out


def check_best_k(fn, seed: int | None = None) -> bool:
    """The learner's best_k(n_blocks, block_bytes, input_bytes), compared with labkit.recompute.best_segments."""
    from labkit.recompute import best_segments

    what = "best_k(n_blocks, block_bytes, input_bytes)"
    if unanswered(fn):
        return not_answered(what)
    if not callable(fn):
        return failed(f"{what}: expected a function, got {type(fn).__name__}")
    cases = _segments_cases(random.randrange(1 << 30) if seed is None else seed)
    for n, A, a in cases:
        try:
            got = fn(n, A, a)
        except Exception as e:  # the learner's code: say what failed, do not stop the notebook
            return failed(f"{what} raised {type(e).__name__}: {e} for n={n}, A={A:,}, a={a:,}")
        want = best_segments(n, A, a)
        if isinstance(got, bool) or not isinstance(got, int) or not 1 <= got <= n:
            return failed(f"{what}: for n={n} it returned {got!r}; k is a whole number of segments from 1 to n.")
        if _segments_cost(n, got, A, a) != _segments_cost(n, want, A, a):  # ties: any k of the lowest cost
            root = math.sqrt(n * A / a)
            if got in (math.floor(root), math.ceil(root), round(math.sqrt(n))):
                hint = ("a square root is where the smooth curve is lowest; the peak is lowest at a whole k with "
                        "whole blocks per segment: compare the candidates")
            elif got == min(range(1, n + 1), key=lambda k: k * a + n / k * A):
                hint = "segments hold whole blocks: the one being recomputed can hold more than n/k of them"
            else:
                hint = ("look at what is alive at the peak of backward: the kept segment inputs, and the activations "
                        "of the segment being recomputed (which one is largest?)")
            return failed(f"{what}: wrong for n={n}, A={A:,}, a={a:,} ({hint}).")
    return passed(f"{what}: right on {len(cases)} fresh (n, A, a): it agrees with labkit.recompute.best_segments.")


# ---- exercise 6 (why): offloaded activations go to pinned memory -----------------------------------------
WHY_PINNED = {
    "a": "pinned host memory holds twice as many bytes per page, so the offloaded activations take half the room",
    "b": "only page-locked host memory can be copied to and from the GPU asynchronously; a copy from pageable "
         "memory is staged through a pinned buffer and makes the host wait, so it cannot overlap with compute",
    "c": "pinned memory is allocated on the GPU, so the copies never leave the device",
}


def check_why_pinned(answer) -> bool:
    what = "why offloaded activations are copied to pinned host memory"
    return checked_choice(
        answer, what, WHY_PINNED, right="b",
        praise=f"{what}: right: the GPU's copy engine reads and writes page-locked memory directly, so a "
                 f"non_blocking copy on a side stream runs while the next kernels compute.",
        hints={"a": f"{what}: pinning changes whether the OS may move a page, not how much a page holds; think "
                 f"about what the transfer needs to overlap with compute."},
        otherwise=f"{what}: pinned memory is host RAM; look at what the offload is meant to free and what the copy "
                 f"must not block.")
