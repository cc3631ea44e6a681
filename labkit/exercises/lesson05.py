"""Checks for lesson 05 (optimizer states): the bytes of 8-bit Adam's state and of Adafactor's factored
second moment (each a function, checked on sizes drawn afresh), and the gradient bytes that step-in-backward
keeps at the backward peak.

Expected values come from the library: each optimizer module's own `state_bytes_for` formula
(labkit.optim.adam8bit, labkit.optim.adafactor) and the model's shapes (labkit.memory.spec_from).
"""

from __future__ import annotations

import math
import numbers
import random

from labkit.memory import fmt_bytes
from labkit.estimate import spec_from
from labkit.optim import adafactor, adam8bit

from . import Inputs, checked_choice, close, failed, not_answered, number, passed, unanswered

inputs = Inputs(__name__, {  # each exercise's inputs: the lesson's own first, then what a course may draw
    # CONFIG's vocabulary (every profile's: the byte tokenizer's 256) or a BPE-sized one; fp32 or 16-bit gradients
    "step_in_backward_grad": {"vocab_size": (256, 8192, 32000), "bytes_per_value": (4, 2)},
})


# ---- exercise 1: the state of 8-bit Adam, as a function checked on fresh sizes ----------------------------
def adam8bit_state_bytes(n: int, blocksize: int = 256, min_8bit_size: int = 4096) -> int:
    """Reference: bitsandbytes' rule, as labkit.optim.adam8bit counts it: 2 bytes per value + 8 per block of
    `blocksize`, or fp32 m and v (8 per value) under `min_8bit_size` values."""
    return adam8bit.state_bytes_for((n,), blocksize=blocksize, min_8bit_size=min_8bit_size)


def _adam8bit_cases(seed: int) -> list[tuple[int, int, int]]:
    """Fresh (n, blocksize, min_8bit_size): a big tensor whose size is not a multiple of the block, one under
    min_8bit_size, another block size (bitsandbytes <= 0.43 used 2048), and a drawn threshold on both sides."""
    rng = random.Random(seed)

    def off_block(lo: int, hi: int, block: int) -> int:
        n = rng.randint(lo, hi)
        return n + 1 if n % block == 0 else n

    block = rng.choice((64, 128, 2048))
    floor = rng.randint(500, 20_000)
    return [(off_block(5_000, 3_000_000, 256), 256, 4096), (rng.randint(1, 4095), 256, 4096),
            (off_block(20 * block, 900 * block, block), block, 4096), (floor - 1, 256, floor), (floor, 256, floor)]


def _adam8bit_slip(value, n: int, blocksize: int, min_8bit_size: int) -> str:
    """What a wrong value for n values most likely counted (the hint the check prints)."""
    blocks = math.ceil(n / blocksize)
    if n < min_8bit_size:
        if close(value, 2 * n + 8 * blocks, rel=1e-9) or close(value, 2 * n, rel=1e-9):
            return (f"only {n:,} values, fewer than min_8bit_size = {min_8bit_size:,}: such tensors keep fp32 m and "
                    "v (8 bytes per value); quantizing them would save almost nothing.")
        return "a tensor under min_8bit_size keeps fp32 m and v: 4 + 4 bytes per value."
    if close(value, 8 * n, rel=1e-9):
        return "8 bytes per value is fp32 Adam; 8-bit Adam stores m and v as 1-byte codes."
    if close(value, 2 * n, rel=1e-9):
        return (f"the codes alone: each block of {blocksize} values also keeps an fp32 absmax, one for m and one "
                "for v.")
    if close(value, 2 * n + 4 * blocks, rel=1e-9):
        return "m and v each have their own absmax per block: 2 x 4 bytes per block."
    if close(value, n + 4 * blocks, rel=1e-9):
        return "that is one state; Adam keeps two (m and v), each as codes + absmax."
    if blocksize != 2048 and close(value, 2 * n + 8 * math.ceil(n / 2048), rel=1e-9):
        return f"blocks of 2048 are the paper's (and bitsandbytes <= 0.43); use the blocksize given ({blocksize})."
    if close(value, 2 * n + 8 * n / blocksize, rel=1e-12):
        return (f"round the number of blocks up: the last, shorter block ({n % blocksize} values) has its own "
                "absmax.")
    return ("count 1 byte per value for m's code and 1 for v's, plus two fp32 absmax values per block of "
            "`blocksize` (ceil(n / blocksize) blocks); under min_8bit_size values, fp32 m and v.")


def check_adam8bit_state_bytes(fn, seed: int | None = None) -> bool:
    what = "adam8bit_state_bytes(n, blocksize, min_8bit_size)"
    if unanswered(fn):
        return not_answered(what)
    if not callable(fn):
        return failed(f"{what}: expected a function, got {type(fn).__name__}")
    cases = _adam8bit_cases(random.randrange(1 << 30) if seed is None else seed)
    for n, block, floor in cases:
        try:
            got = fn(n, block, floor)
        except Exception as e:  # the learner's code: say what failed, do not stop the notebook
            return failed(f"{what} raised {type(e).__name__}: {e} for n = {n:,}, blocksize {block}, "
                          f"min_8bit_size {floor:,}")
        if isinstance(got, bool) or not isinstance(got, numbers.Real):
            return failed(f"{what}: expected a number of bytes, got {type(got).__name__}")
        if got != adam8bit_state_bytes(n, block, floor):
            return failed(f"{what}: wrong for n = {n:,} values, blocksize {block}, min_8bit_size {floor:,}: "
                          + _adam8bit_slip(got, n, block, floor))
    big = adam8bit_state_bytes(1000 * 1000)
    drawn = ", ".join(f"n={n:,}/{block}/{floor:,}" for n, block, floor in cases)
    return passed(f"{what}: right on {len(cases)} fresh cases (n/blocksize/min_8bit_size: {drawn}). A 1000 x 1000 "
                  f"weight: {big:,} B, {big / 1e6:.3f} B per parameter instead of 8; under min_8bit_size the state "
                  "stays fp32, as bitsandbytes' Optimizer2State decides.")


# ---- exercise 2: Adafactor's factored second moment, as a function checked on fresh shapes ------------------
def adafactor_state_bytes(m: int, n: int, beta1: float | None = None) -> int:
    """Reference: fp32 row and column averages of the second moment of an m x n matrix (+ a full first moment
    when beta1 is set), as labkit.optim.adafactor counts them."""
    return adafactor.state_bytes_for((m, n), beta1=beta1)


def _adafactor_cases(seed: int) -> list[tuple[int, int, float | None]]:
    rng = random.Random(seed)
    return [(rng.randint(64, 8192), rng.randint(64, 16384), None), (rng.randint(2, 500), rng.randint(2, 500), None),
            (rng.randint(64, 4096), rng.randint(64, 4096), 0.9)]


def _adafactor_slip(value, m: int, n: int, beta1) -> str:
    first = 4 * m * n if beta1 is not None else 0
    if close(value, 8 * m * n, rel=1e-9):
        return ("8mn is Adam's m and v. Adafactor keeps no first moment by default (beta1=None) and stores the "
                "second moment as row and column averages.")
    if close(value, 4 * m * n + first, rel=1e-9):
        return ("that is a full second moment, one value per weight; Adafactor keeps only its row averages "
                "(m values) and column averages (n values) and rebuilds the rest as a rank-1 product.")
    if not first and close(value, 4 * (m + n) + 4 * m * n, rel=1e-9):
        return "with beta1=None there is no first moment: only the row and column averages."
    if first and close(value, 4 * (m + n), rel=1e-9):
        return "beta1 is set, so a full fp32 first moment (m x n values) comes on top."
    if close(value, (m + n) + first / 4, rel=1e-9):
        return "that counts values; each is an fp32 number, 4 bytes."
    if close(value, 8 * (m + n) + first, rel=1e-9):
        return "one average per row and one per column, each stored once: m + n values, not twice that."
    return ("a row average per row (m values) and a column average per column (n values), fp32"
            + (", plus an m x n fp32 first moment." if first else "."))


def check_adafactor_state_bytes(fn, seed: int | None = None) -> bool:
    what = "adafactor_state_bytes(m, n, beta1)"
    if unanswered(fn):
        return not_answered(what)
    if not callable(fn):
        return failed(f"{what}: expected a function, got {type(fn).__name__}")
    cases = _adafactor_cases(random.randrange(1 << 30) if seed is None else seed)
    for m, n, beta1 in cases:
        try:
            got = fn(m, n, beta1)
        except Exception as e:  # the learner's code: say what failed, do not stop the notebook
            return failed(f"{what} raised {type(e).__name__}: {e} for a {m} x {n} matrix, beta1={beta1}")
        if isinstance(got, bool) or not isinstance(got, numbers.Real):
            return failed(f"{what}: expected a number of bytes, got {type(got).__name__}")
        if got != adafactor_state_bytes(m, n, beta1):
            return failed(f"{what}: wrong for a {m} x {n} matrix, beta1={beta1}: " + _adafactor_slip(got, m, n, beta1))
    llama = adafactor_state_bytes(4096, 11008)
    return passed(f"{what}: right on {len(cases)} fresh matrices ({', '.join(f'{m}x{n}' for m, n, _ in cases)}). "
                  f"A Llama-7B MLP matrix, 4096 x 11008: {llama:,} B = 4 x (4096 + 11008), one fp32 average per row "
                  f"and per column; Adam would keep 8 x 4096 x 11008 = {8 * 4096 * 11008:,} B.")


# ---- exercise 3: gradient bytes at the backward peak with step-in-backward ------------------------------
def _largest_gradient(config, bytes_per_value: int) -> int:
    """The check's path (not step_in_backward_grad_bytes, which the student build stubs): the model's parameter
    tensors (a GPTConfig's built on the meta device: no memory), the largest one's numel x bytes; a preset
    name has no module here, so its spec's largest parameter."""
    import torch

    from labkit.models.gpt import GPT, GPTConfig

    model = config
    if isinstance(config, GPTConfig):
        with torch.device("meta"):
            model = GPT(config)
    if not isinstance(model, torch.nn.Module):
        return spec_from(config).largest_param * bytes_per_value
    return max(p.numel() for p in model.parameters()) * bytes_per_value


def step_in_backward_grad_bytes(config, bytes_per_value: int = 4) -> int:
    """The largest parameter's gradient: each gradient is stepped and freed as soon as it is complete."""
    spec = spec_from(config)
    return spec.largest_param * bytes_per_value


def check_step_in_backward_grad(answer, config, bytes_per_value: int = 4, vocab_size: int | None = None) -> bool:
    """`vocab_size`: the GPTConfig with that vocabulary (dataclasses.replace); None keeps config's."""
    if vocab_size is not None:
        from dataclasses import replace

        from labkit.models.gpt import GPTConfig

        if not isinstance(config, GPTConfig):
            raise ValueError(f"vocab_size= needs a GPTConfig, got {type(config).__name__}")
        config = replace(config, vocab_size=vocab_size)
    spec = spec_from(config)
    name = "gradient bytes at the backward peak with step-in-backward"
    value = number(answer, name)
    if value is None:
        return False
    expected = _largest_gradient(config, bytes_per_value)
    everything = spec.n_params * bytes_per_value
    if close(value, expected, rel=0.05):
        return passed(f"{name}: about {fmt_bytes(expected)}, the largest parameter's gradient "
                      f"({spec.largest_param:,} values x {bytes_per_value} B), instead of all of them "
                      f"({fmt_bytes(everything)}): each gradient is stepped and freed as soon as autograd completes it.")
    if close(value, everything, rel=0.05):
        return failed(f"{name}: {fmt_bytes(everything)} is every gradient at once, the ordinary loop. With the step "
                      "inside backward each one is freed right after its own step.")
    if value == 0:
        return failed(f"{name}: not zero: a gradient exists from the moment autograd writes it until its hook has "
                      "stepped the parameter; the largest one sets the floor.")
    if close(value, spec.largest_param, rel=0.05):
        return failed(f"{name}: that counts values; each gradient value is {bytes_per_value} bytes here.")
    if close(value, spec.layer_params * bytes_per_value, rel=0.05):
        return failed(f"{name}: not a whole block's gradients: the hook fires per parameter tensor, so one tensor's "
                      "gradient is alive at a time (give or take a bias).")
    return failed(f"{name}: which single parameter tensor is the largest? Its gradient is what must exist at once "
                  "(spec_from(CONFIG).largest_param values).")


# ---- exercise 4: a function for the state bytes of four optimizers, checked on fresh shapes ----------------


OPTIMIZERS = ("adam", "adam8bit", "lion", "adafactor")


def state_bytes(optimizer: str, shape) -> int:
    """Reference: fp32 state bytes of one tensor under `optimizer`, from each module's own formula (Adam: m and v,
    the per-tensor step counter not counted; Adafactor with transformers' default beta1=None)."""
    from labkit.estimate.optim_terms import TORCH_STATES
    from labkit.optim import lion

    shape = tuple(shape)
    if optimizer == "adam":
        return TORCH_STATES["adam"] * 4 * math.prod(shape)
    if optimizer == "adam8bit":
        return adam8bit.state_bytes_for(shape)
    if optimizer == "lion":
        return lion.state_bytes_for(shape)
    if optimizer == "adafactor":
        return adafactor.state_bytes_for(shape)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")


def _shapes(seed: int) -> list[tuple]:
    """Fresh shapes: a big matrix whose size is not a multiple of 256, a matrix under min_8bit_size, a bias."""
    rng = random.Random(seed)
    big = (rng.randint(65, 3000), rng.randint(65, 3000))
    while math.prod(big) % adam8bit.BLOCKSIZE == 0:
        big = (big[0], big[1] + 1)
    small = (rng.randint(2, 40), rng.randint(2, 90))
    return [big, small, (rng.randint(100, 4000),)]


_HINTS = {
    "adam": "Adam keeps two fp32 tensors of the parameter's shape, m and v (the step counter aside)",
    "adam8bit": "look at the two rules of 8-bit Adam: the block count (and its last, shorter block), and what "
                "min_8bit_size decides for small tensors",
    "lion": "how many states does Lion keep, and at which precision?",
    "adafactor": "for a matrix, v is kept as row and column averages; what does a vector keep? (beta1=None)",
}


def check_state_bytes(fn, seed: int | None = None) -> bool:
    what = "my_state_bytes(optimizer, shape)"
    if unanswered(fn):
        return not_answered(what)
    if not callable(fn):
        return failed(f"{what}: expected a function, got {type(fn).__name__}")
    shapes = _shapes(random.randrange(1 << 30) if seed is None else seed)
    for optimizer in OPTIMIZERS:
        for shape in shapes:
            try:
                got = fn(optimizer, shape)
            except Exception as e:  # the learner's code: say what failed, do not stop the notebook
                return failed(f"{what} raised {type(e).__name__}: {e} for {optimizer!r}, shape {shape}")
            want = state_bytes(optimizer, shape)
            if isinstance(got, bool) or not isinstance(got, numbers.Real) or got != want:
                return failed(f"{what}: wrong for {optimizer!r} on a tensor of shape {shape} ({_HINTS[optimizer]}).")
    return passed(f"{what}: right for {', '.join(OPTIMIZERS)} on {len(shapes)} fresh shapes "
                  f"({', '.join(map(str, shapes))}), as labkit.optim's state_bytes_for formulas count them.")


# ---- exercise 5: why small tensors keep fp32 state in 8-bit Adam ----------------------------------------------
WHY_SMALL = {
    "a": "the dynamic map has 256 codes for each of 16 decades, so it needs at least 4096 values to be built",
    "b": "tensors that small (biases, norm gains) hold a tiny share of a model's parameters: 8-bit codes would "
         "save almost nothing, so bitsandbytes keeps their state exact",
    "c": "a block of 256 values cannot be quantized unless the tensor has at least 16 full blocks",
}


def check_why_small(answer) -> bool:
    what = "why 8-bit Adam keeps tensors under min_8bit_size (4096 values) in fp32"
    return checked_choice(
        answer, what, WHY_SMALL, right="b",
        praise=f"{what}: right: the saving is 6 bytes per value, and a model's small tensors are a fraction of "
                 f"a percent of its values; exact state for them costs almost nothing.",
        hints={"a": f"{what}: look at section 2.1: how many codes does the dynamic map have, and does building it "
                 f"depend on the tensor at all?"},
        otherwise=f"{what}: section 2.2's toy quantizes a tensor of any size (the last block is padded); the reason "
                 f"is the bytes at stake: compare a bias's share of the model's values.")
