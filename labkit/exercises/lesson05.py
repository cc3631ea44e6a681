"""Checks for lesson 05 (optimizer states): the bytes of 8-bit Adam's state, of Adafactor's factored
second moment, and the gradient bytes that step-in-backward keeps at the backward peak.

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

from . import checked_choice, close, failed, not_answered, number, passed, unanswered


# ---- exercise 1: the state of 8-bit Adam ----------------------------------------------------------
def adam8bit_state_bytes(shape) -> int:
    """bitsandbytes' rule, as labkit.optim.adam8bit counts it: 2 bytes per value + 8 per block of 256, or fp32 m and v."""
    return adam8bit.state_bytes_for(tuple(shape))


def check_adam8bit_state_bytes(answer, shape) -> bool:
    shape = tuple(shape)
    n = math.prod(shape)
    name = f"8-bit Adam state of a {' x '.join(map(str, shape))} " + ("matrix" if len(shape) == 2 else "tensor")
    if len(shape) == 1:
        name = f"8-bit Adam state of a vector of {n:,} values"
    value = number(answer, name)
    if value is None:
        return False
    expected = adam8bit_state_bytes(shape)
    blocks = math.ceil(n / adam8bit.BLOCKSIZE)
    if close(value, expected, rel=1e-9):
        if n < adam8bit.MIN_8BIT_SIZE:
            return passed(f"{name}: {expected:,} B = 8 x {n:,}: under {adam8bit.MIN_8BIT_SIZE} values the state stays "
                          "fp32 (m and v, 4 bytes each), as bitsandbytes' min_8bit_size decides.")
        return passed(f"{name}: {expected:,} B = 2 x {n:,} (one uint8 code for m and one for v) + 8 x {blocks:,} "
                      f"(an fp32 absmax for m and one for v per block of {adam8bit.BLOCKSIZE}): "
                      f"{expected / n:.3f} B per parameter instead of 8.")
    if n < adam8bit.MIN_8BIT_SIZE:
        if close(value, adam8bit.state_bytes_for(shape, min_8bit_size=0), rel=1e-9) or close(value, 2 * n, rel=1e-9):
            return failed(f"{name}: only {n:,} values, fewer than min_8bit_size = {adam8bit.MIN_8BIT_SIZE}: such "
                          "tensors keep fp32 m and v (8 bytes per value); quantizing them would save almost nothing.")
        return failed(f"{name}: a tensor this small keeps fp32 m and v: 4 + 4 bytes per value.")
    if close(value, 8 * n, rel=1e-9):
        return failed(f"{name}: 8 bytes per value is fp32 Adam; 8-bit Adam stores m and v as 1-byte codes.")
    if close(value, 2 * n, rel=1e-9):
        return failed(f"{name}: the codes alone: each block of {adam8bit.BLOCKSIZE} values also keeps an fp32 absmax, "
                      "one for m and one for v.")
    if close(value, 2 * n + 4 * blocks, rel=1e-9):
        return failed(f"{name}: m and v each have their own absmax per block: 2 x 4 bytes per block.")
    if close(value, n + 4 * blocks, rel=1e-9):
        return failed(f"{name}: that is one state; Adam keeps two (m and v), each as codes + absmax.")
    if close(value, adam8bit.state_bytes_for(shape, blocksize=2048), rel=1e-9):
        return failed(f"{name}: blocks of 2048 are the paper's (and bitsandbytes <= 0.43); since 0.44 a block has "
                      f"{adam8bit.BLOCKSIZE} values.")
    if close(value, 2 * n + 8 * n / adam8bit.BLOCKSIZE, rel=1e-12) and n % adam8bit.BLOCKSIZE:
        return failed(f"{name}: round the number of blocks up: the last, shorter block ({n % adam8bit.BLOCKSIZE} "
                      "values) has its own absmax.")
    return failed(f"{name}: count 1 byte per value for m's code and 1 for v's, plus two fp32 absmax values per block "
                  f"of {adam8bit.BLOCKSIZE} (ceil(n / {adam8bit.BLOCKSIZE}) blocks).")


# ---- exercise 2: Adafactor's factored second moment --------------------------------------------------
def adafactor_state_bytes(shape, beta1: float | None = None) -> int:
    """fp32 row and column averages of the second moment (+ a full first moment when beta1 is set)."""
    return adafactor.state_bytes_for(tuple(shape), beta1=beta1)


def check_adafactor_state_bytes(answer, shape, beta1: float | None = None) -> bool:
    shape = tuple(shape)
    if len(shape) != 2:
        raise ValueError(f"shape must be a matrix (m, n), got {shape!r}")
    m, n = shape
    name = f"Adafactor state of a {m} x {n} matrix (beta1={beta1})"
    value = number(answer, name)
    if value is None:
        return False
    expected = adafactor_state_bytes(shape, beta1)
    first = 4 * m * n if beta1 is not None else 0
    if close(value, expected, rel=1e-9):
        extra = f" + {first:,} for the first moment (beta1 is set)" if first else ""
        return passed(f"{name}: {expected - first:,} B = 4 x ({m} + {n}): one fp32 average per row and per column"
                      f"{extra}. Adam would keep 8 x {m} x {n} = {8 * m * n:,} B.")
    if close(value, 8 * m * n, rel=1e-9):
        return failed(f"{name}: 8mn is Adam's m and v. Adafactor keeps no first moment by default (beta1=None) and "
                      "stores the second moment as row and column averages.")
    if close(value, 4 * m * n + first, rel=1e-9):
        return failed(f"{name}: that is a full second moment, one value per weight; Adafactor keeps only its row "
                      "averages (m values) and column averages (n values) and rebuilds the rest as a rank-1 product.")
    if not first and close(value, 4 * (m + n) + 4 * m * n, rel=1e-9):
        return failed(f"{name}: with beta1=None there is no first moment: only the row and column averages.")
    if first and close(value, 4 * (m + n), rel=1e-9):
        return failed(f"{name}: beta1 is set, so a full fp32 first moment (m x n values) comes on top.")
    if close(value, (m + n) + first / 4, rel=1e-9):
        return failed(f"{name}: that counts values; each is an fp32 number, 4 bytes.")
    if close(value, 8 * (m + n) + first, rel=1e-9):
        return failed(f"{name}: one average per row and one per column, each stored once: m + n values, not twice that.")
    return failed(f"{name}: a row average per row (m values) and a column average per column (n values), fp32"
                  + (", plus an m x n fp32 first moment." if first else "."))


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


def check_step_in_backward_grad(answer, config, bytes_per_value: int = 4) -> bool:
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
        return failed(f"{name}: that counts values; each fp32 gradient value is {bytes_per_value} bytes.")
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
