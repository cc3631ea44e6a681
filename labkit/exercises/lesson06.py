"""Checks for lesson 06 (GaLore): the state bytes of one projected matrix, and the rank at which
GaLore stops saving memory over AdamW.

Expected values come from labkit.optim.galore's own `state_bytes_for` formula (projector
r x min(m, n) plus Adam's m and v in the r x max(m, n) projected space).
"""

from __future__ import annotations

import math
import numbers
import random

from labkit.optim import galore

from . import Inputs, checked_choice, close, failed, integer, not_answered, number, passed, unanswered

MATRICES = ((4096, 11008), (4096, 4096), (5120, 13824), (1600, 6400))  # Llama-7B MLP, attention; 13B MLP; GPT-2 XL
inputs = Inputs(__name__, {  # each exercise's inputs: the lesson's own first, then what a course may draw
    "galore_state_bytes": {"shape": MATRICES, "rank": (128, 64, 256, 512)},
    "break_even_rank": {"shape": MATRICES},
})


def _matrix(shape) -> tuple[int, int]:
    shape = tuple(shape)
    if len(shape) != 2 or min(shape) <= 0:
        raise ValueError(f"shape must be a matrix (m, n), got {shape!r}")
    return int(shape[0]), int(shape[1])


# ---- exercise 1: GaLore's state for one matrix ---------------------------------------------------------
def galore_state_bytes(shape, rank: int, dtype_bytes: int = 4) -> int:
    """Projector (r x min(m, n)) + m and v of the projected gradient (r x max(m, n) each), in the weight's dtype."""
    return galore.state_bytes_for(_matrix(shape), rank, dtype_bytes)


def check_galore_state_bytes(answer, shape, rank: int, dtype_bytes: int = 4) -> bool:
    m, n = _matrix(shape)
    k, K, r, d = min(m, n), max(m, n), rank, dtype_bytes
    name = f"GaLore state of a {m} x {n} matrix at rank {r}"
    value = number(answer, name)
    if value is None:
        return False
    expected = galore_state_bytes((m, n), r, d)
    if close(value, expected, rel=1e-9):
        return passed(f"{name}: {expected:,} B = {d} x {r} x ({k} + 2 x {K}): the projector is {r} x {k} (the smaller "
                      f"side), Adam's m and v are {r} x {K} each. AdamW would keep {d} x 2 x {m} x {n} = {2 * d * m * n:,} B "
                      f"({expected / (2 * d * m * n):.1%} of it).")
    if close(value, 2 * d * m * n, rel=1e-9):
        return failed(f"{name}: 2mn values is AdamW's state; GaLore keeps m and v of the rank-{r} projection only.")
    if k != K and close(value, d * r * (K + 2 * k), rel=1e-9):
        return failed(f"{name}: the sides are swapped. GaLore projects onto the smaller side, so the projector is "
                      f"{r} x {k} and the projected gradient (hence m and v) is {r} x {K}.")
    if close(value, 2 * d * r * K, rel=1e-9):
        return failed(f"{name}: m and v are right, but the projector P ({r} x {k}) is state too: it is kept between "
                      "SVDs, which happen only every update_proj_gap steps.")
    if close(value, d * r * (k + K), rel=1e-9):
        return failed(f"{name}: Adam keeps two moments of the projected gradient (m and v), each {r} x {K}.")
    if close(value, r * (k + 2 * K), rel=1e-9):
        return failed(f"{name}: that counts values; each is {d} bytes.")
    return failed(f"{name}: add the projector (rank x the smaller side) and two moments (rank x the larger side), "
                  f"{d} bytes per value.")


# ---- exercise 2: the rank where GaLore stops saving memory -----------------------------------------------
def break_even_rank(shape) -> int:
    """The smallest rank r whose GaLore state r(k + 2K) is at least AdamW's 2mn (any dtype: it cancels).
    Both come from galore.state_bytes_for (rank None: plain AdamW), which is linear in the rank."""
    shape = _matrix(shape)
    adamw, per_rank = galore.state_bytes_for(shape, None, 1), galore.state_bytes_for(shape, 1, 1)
    return -(-adamw // per_rank)  # ceil, in integers


def check_break_even_rank(answer, shape) -> bool:
    m, n = _matrix(shape)
    k, K = min(m, n), max(m, n)
    name = f"smallest rank at which GaLore's state of a {m} x {n} matrix is no smaller than AdamW's"
    r = integer(answer, name)
    if r is None:
        return False
    expected = break_even_rank((m, n))
    exact = 2 * m * n / (k + 2 * K)
    if r == expected:
        return passed(f"{name}: r = {expected} (r(k + 2K) >= 2mn gives r >= {exact:.1f}, {expected / k:.0%} of the "
                      "smaller side). Below it GaLore saves memory; at the ranks people use (k/4 and less) it saves a lot.")
    if r == k:
        return failed(f"{name}: at full rank ({k}) GaLore keeps {k * (k + 2 * K) / (2 * m * n):.2f} x AdamW's state: "
                      "it stops saving well before that. Solve r(k + 2K) >= 2mn.")
    if r == expected - 1:
        return failed(f"{name}: at r = {r} GaLore is still (just) smaller: {r * (k + 2 * K):,} < {2 * m * n:,} values. "
                      "Round up.")
    if r == math.ceil(m * n / (k + 2 * K)):
        return failed(f"{name}: Adam keeps two values per weight (m and v): compare with 2mn, not mn.")
    if k != K and r == math.ceil(2 * m * n / (K + 2 * k)):
        return failed(f"{name}: the sides are swapped: the projector is r x {k} (the smaller side), m and v are r x {K}.")
    return failed(f"{name}: GaLore keeps r(k + 2K) values, AdamW 2mn, with k = {k}, K = {K}: find the smallest whole r "
                  "for which the first is at least the second.")


# ---- exercise 3: GaLore's state for a whole GPT, as a function, checked on fresh configurations --------------
def galore_gpt_state(cfg, r: int) -> int:
    """Reference: bytes of fp32 state GaLoreAdamW(galore_param_groups(GPT(cfg), rank=r)) keeps, counted by
    labkit.optim.galore.state_bytes_for on every parameter of each group (the model is built on the meta
    device: no memory)."""
    import torch

    from labkit.models.gpt import GPT
    from labkit.optim.galore import galore_param_groups

    with torch.device("meta"):
        model = GPT(cfg)
    return sum(galore.state_bytes_for(tuple(p.shape), g.get("rank"), 4)
               for g in galore_param_groups(model, rank=r) for p in g["params"])


def _configs(seed: int):
    """Fresh questions: two or three small GPTConfigs (with and without biases) and a rank below n_embd."""
    from labkit.models.gpt import GPTConfig

    rng = random.Random(seed)
    out = []
    for i in range(rng.randint(2, 3)):
        heads = rng.choice([1, 2, 4])
        cfg = GPTConfig(vocab_size=rng.randint(50, 600), block_size=rng.choice([32, 64, 128, 256]),
                        n_layer=rng.randint(1, 6), n_head=heads, n_embd=heads * rng.randint(4, 48),
                        bias=bool(i % 2) if i < 2 else rng.random() < 0.5)
        out.append((cfg, rng.randint(1, max(1, cfg.n_embd // 2))))
    return out


def _gpt_slips(cfg, r: int) -> dict[int, str]:
    """What common slips give, and a hint for each that does not say the answer."""
    import torch

    from labkit.models.gpt import GPT

    with torch.device("meta"):
        model = GPT(cfg)
    d, L = cfg.n_embd, cfg.n_layer
    mats = [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)]  # (out, in): c_attn, attn.c_proj, c_fc, mlp.c_proj
    n_all = sum(p.numel() for p in model.parameters())
    n_mat = L * sum(a * b for a, b in mats)
    rest = 8 * (n_all - n_mat)
    right = L * sum(4 * r * (min(a, b) + 2 * max(a, b)) for a, b in mats)
    wrong_side = L * sum(4 * r * (max(a, b) + 2 * min(a, b)) for a, b in mats)
    return {
        8 * n_all: "that is plain AdamW's m and v for every parameter: which matrices does galore_param_groups "
                   "hand to GaLore?",
        right: "that counts the GaLore matrices only: the parameters galore_param_groups leaves out still have "
               "AdamW's two moments",
        wrong_side + rest: "the projector is sized by one side of each matrix and the moments by the other: which is "
                           "which, for a tall (out > in) matrix and for a wide one?",
        right + rest + 8 * cfg.vocab_size * d: "the head shares its weight with the token embedding (tied): one "
                                               "tensor, one state",
    }


def check_galore_gpt_state(fn, seed: int | None = None) -> bool:
    what = "galore_gpt_state(cfg, r)"
    if unanswered(fn):
        return not_answered(what)
    if not callable(fn):
        return failed(f"{what}: expected a function, got {type(fn).__name__}")
    cases = _configs(random.randrange(1 << 30) if seed is None else seed)
    for cfg, r in cases:
        short = (f"GPTConfig(n_layer={cfg.n_layer}, n_embd={cfg.n_embd}, vocab_size={cfg.vocab_size}, "
                 f"block_size={cfg.block_size}, bias={cfg.bias})")
        try:
            got = fn(cfg, r)
        except Exception as e:  # the learner's code: say what failed, do not stop the notebook
            return failed(f"{what} raised {type(e).__name__}: {e} for {short}, r={r}")
        want = galore_gpt_state(cfg, r)
        if isinstance(got, bool) or not isinstance(got, numbers.Real) or got != want:
            hint = _gpt_slips(cfg, r).get(got, "print(GPT(cfg)) shows every layer's shape; galore_param_groups' "
                                               "docstring says which weights GaLore gets; 4 bytes per fp32 value")
            return failed(f"{what}: wrong for {short}, r={r} ({hint}).")
    return passed(f"{what}: right on {len(cases)} fresh GPT configurations, as GaLoreAdamW's groups and "
                  f"labkit.optim.galore.state_bytes_for count them.")


# ---- exercise 4: why GaLore's weights are not confined to rank r --------------------------------------------
WHY_RANK = {
    "a": "Adam's moments m and v are kept at the full m x n size, so the update is full rank",
    "b": "each step's update is rank r, but the projector is recomputed from a new gradient every "
         "update_proj_gap steps: successive updates lie in different subspaces, and their sum is not low rank",
    "c": "the SVD keeps all min(m, n) singular vectors, and only the moments are cut to rank r",
}


def check_why_rank(answer) -> bool:
    what = "why GaLore's weights can change by more than rank r over a run (where LoRA's B·A cannot)"
    return checked_choice(
        answer, what, WHY_RANK, right="b",
        praise=f"{what}: right: a sum of rank-r updates from different subspaces can reach full rank, while "
                 f"LoRA's change B·A is one rank-r product for the whole run.",
        hints={"a": f"{what}: look at exercise 1's count: what shape do GaLore's m and v have?"},
        otherwise=f"{what}: look at the projector's shape in exercise 1's count (rank x the smaller side): what is "
                 f"kept of the SVD?")
