"""Reference solutions for lesson 05's exercises (tests/unit/test_exercises_05_06.py checks each one)."""

import math


# ---- exercise 1: the state of 8-bit Adam, as a function --------------------------------------------------
def adam8bit_state_bytes(n: int, blocksize: int = 256, min_8bit_size: int = 4096) -> int:
    """m and v: one uint8 code per value each + one fp32 absmax per block each; small tensors stay fp32."""
    if n < min_8bit_size:
        return 8 * n  # fp32 m and v
    return 2 * n + 2 * 4 * math.ceil(n / blocksize)


# adam8bit_state_bytes(1000 * 1000) = 2,000,000 + 8 x 3,907 = 2,031,256; adam8bit_state_bytes(1000) = 8,000


# ---- exercise 2: Adafactor's factored second moment, as a function -------------------------------------------
def adafactor_state_bytes(m: int, n: int, beta1=None) -> int:
    """fp32 row averages (m) and column averages (n); a full first moment only when beta1 is set."""
    return 4 * (m + n) + (4 * m * n if beta1 is not None else 0)


# adafactor_state_bytes(4096, 11008) = 60,416 bytes for a Llama-7B MLP matrix


# ---- exercise 3: gradient bytes at the backward peak with step-in-backward ------------------------------------
def step_in_backward_grad_bytes(model, bytes_per_value: int = 4) -> int:
    """The largest parameter tensor's gradient (4 bytes a value in fp32): each gradient is freed right after its
    own step."""
    return bytes_per_value * max(p.numel() for p in model.parameters())


# In the notebook: step_in_backward_grad_bytes(GPT(replace(CONFIG, vocab_size=EX3.vocab_size)), EX3.bytes_per_value),
# e.g. 4 x 1024 x 256 = 1 MiB on the cpu profile with the lesson's own EX3 (vocabulary 256, fp32): the MLP's c_fc;
# with a vocabulary of 8192 the token embedding (8192 x 256) is the largest


# ---- exercise 4: the state bytes of four optimizers, as a function -----------------------------------------
def my_state_bytes(optimizer: str, shape) -> int:
    """fp32 state bytes of one tensor: Adam m and v; 8-bit Adam codes + two absmax per block of 256 (fp32 m and v
    under 4096 values); Lion m; Adafactor (beta1=None) row + column averages of a matrix, a full v for a vector."""
    n = math.prod(shape)
    if optimizer == "adam":
        return 8 * n
    if optimizer == "adam8bit":
        return 8 * n if n < 4096 else 2 * n + 8 * math.ceil(n / 256)
    if optimizer == "lion":
        return 4 * n
    if optimizer == "adafactor":
        return 4 * (shape[0] + shape[1]) if len(shape) == 2 else 4 * n
    raise ValueError(f"unknown optimizer {optimizer!r}")


# ---- exercise 5 --------------------------------------------------------------------------------------------
WHY_SMALL = "b"
