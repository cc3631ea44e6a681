"""Checks for lesson 00 (start here): a warm-up on the bytes of a model's weights, the GPT's parameter count
as a function, and why a training step needs several times its weights' bytes."""

from __future__ import annotations

import numbers
import random

from labkit.memory import fmt_bytes
from labkit.estimate.predict import Precision, param_bytes
from labkit.estimate.spec import spec_from

from . import Inputs, checked_choice, close, failed, not_answered, number, passed, unanswered

inputs = Inputs(__name__, {  # each exercise's inputs: the lesson's own first, then what a course may draw
    "weight_bytes": {"dtype": ("fp32", "bf16", "fp64", "fp8")},
})

WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8, "fp8": 1}  # bytes of one number in each dtype


def check_weight_bytes(answer, model, dtype: str = "fp32") -> bool:
    """Bytes of the model's weights stored in `dtype`: parameters x bytes per number (a tied matrix counted once)."""
    name = f"bytes of the {dtype} weights"
    value = number(answer, name)
    if value is None:
        return False
    spec = spec_from(model)
    size = WEIGHT_BYTES[dtype]
    expected = param_bytes(spec, Precision.of(dtype)) if dtype in ("fp32", "bf16", "fp16") else spec.n_params * size
    if close(value, expected, rel=1e-9):
        return passed(f"{name}: {fmt_bytes(expected)} for {spec.n_params:,} parameters.")
    if close(value, spec.n_params, rel=1e-9):
        return failed(f"{name}: that is the number of parameters; each {dtype} number takes {size} bytes.")
    if spec.tied and close(value, expected + size * spec.vocab * spec.hidden, rel=1e-9):
        return failed(f"{name}: the embedding and the output head share one matrix (tied): count it once. "
                      "model.parameters() already does.")
    for other, other_size in WEIGHT_BYTES.items():
        if other_size != size and close(value, spec.n_params * other_size, rel=1e-9):
            return failed(f"{name}: that counts {other_size} bytes per number ({other}); one {dtype} number takes "
                          f"{size}.")
    return failed(f"{name}: add up p.numel() over model.parameters() and multiply by {size} bytes per {dtype} "
                  "number.")


# ---- exercise 1: the GPT's parameter count, as a function, checked on fresh configurations -------------------
def gpt_params(cfg) -> int:
    """Reference: parameters of labkit's GPT(cfg), counted by model.parameters() (a tied matrix once; built on
    the meta device: no memory)."""
    import torch

    from labkit.models.gpt import GPT

    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters())


def _configs(seed: int):
    """Fresh questions: three small GPTConfigs, with and without biases."""
    from labkit.models.gpt import GPTConfig

    rng = random.Random(seed)
    out = []
    for i in range(3):
        heads = rng.choice([1, 2, 4])
        out.append(GPTConfig(vocab_size=rng.randint(50, 600), block_size=rng.choice([32, 64, 128, 256]),
                             n_layer=rng.randint(1, 6), n_head=heads, n_embd=heads * rng.randint(4, 48),
                             bias=(i == 0) if i < 2 else rng.random() < 0.5))
    return out


def _param_slips(cfg) -> dict[int, str]:
    """What common slips give, and a hint for each that does not say the answer."""
    right = gpt_params(cfg)
    d, V = cfg.n_embd, cfg.vocab_size
    slips = {right + V * d: "the output head shares its weight with the token embedding (tied): count that "
                            "matrix once",
             right - cfg.block_size * d: "the positions have a table of their own (wpe)"}
    if cfg.n_layer > 1:
        per_block = (right - V * d - cfg.block_size * d - d * (2 if cfg.bias else 1)) // cfg.n_layer
        slips[right - (cfg.n_layer - 1) * per_block] = "every block has its own weights"
    if cfg.bias:
        slips[right - cfg.n_layer * 9 * d] = "with bias=True each Linear layer has a bias of its output size"
    return slips


def check_gpt_params(fn, seed: int | None = None) -> bool:
    what = "gpt_params(cfg)"
    if unanswered(fn):
        return not_answered(what)
    if not callable(fn):
        return failed(f"{what}: expected a function, got {type(fn).__name__}")
    cases = _configs(random.randrange(1 << 30) if seed is None else seed)
    for cfg in cases:
        short = (f"GPTConfig(n_layer={cfg.n_layer}, n_embd={cfg.n_embd}, vocab_size={cfg.vocab_size}, "
                 f"block_size={cfg.block_size}, bias={cfg.bias})")
        try:
            got = fn(cfg)
        except Exception as e:  # the learner's code: say what failed, do not stop the notebook
            return failed(f"{what} raised {type(e).__name__}: {e} for {short}")
        want = gpt_params(cfg)
        if isinstance(got, bool) or not isinstance(got, numbers.Real) or got != want:
            hint = _param_slips(cfg).get(got, "print(GPT(cfg)) lists every layer with its shape: add them up, "
                                              "weights and (with bias=True) biases")
            return failed(f"{what}: wrong for {short} ({hint}).")
    return passed(f"{what}: right on {len(cases)} fresh configurations, as model.parameters() counts them.")


# ---- exercise 2: why a training step needs several times the weights' bytes ---------------------------------
WHY_PEAK = {
    "a": "PyTorch keeps a second copy of every weight during the forward pass, and the ledger counts both",
    "b": "a training step also keeps a gradient per weight, AdamW's two moments per weight and the activations "
         "the forward pass saves for backward; the weights are one term among several",
    "c": "the measurement counts memory PyTorch's allocator reserves but does not use",
}


def check_why_peak(answer) -> bool:
    what = "why the step's peak is several times the weights' bytes"
    return checked_choice(
        answer, what, WHY_PEAK, right="b",
        praise=f"{what}: right: the predicted phases above list those terms by category; lesson 01 takes them "
               f"apart one by one.",
        hints={"a": f"{what}: look at the categories in the predicted-vs-measured bars: which ones are there "
                    f"besides the parameters?",
               "c": f"{what}: the ledger counts the bytes of live tensors (logical bytes), not the allocator's "
                    f"cache; look at the categories in the bars."})
