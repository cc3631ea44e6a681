"""Reference solutions for lesson 09's exercises (tests/unit/test_exercises_09.py checks each one)."""


# ---- exercise 1: model-state bytes per GPU at a ZeRO stage -----------------------------------------------
def stage_gb(n_params: float = 7.5e9, world: int = 64, stage: int = 2, k: int = 12) -> float:
    """2 B fp16 weights, 2 B fp16 gradients, K B fp32 master/momentum/variance per parameter; stage s shards
    the state (s >= 1), the gradients (s >= 2) and the weights (s = 3) over the N GPUs."""
    weights, grads, state = 2 * n_params, 2 * n_params, k * n_params
    if stage >= 1:
        state /= world
    if stage >= 2:
        grads /= world
    if stage >= 3:
        weights /= world
    return (weights + grads + state) / 1e9


# ---- exercise 2: bytes a rank sends per step at ZeRO-3 -----------------------------------------------------
def zero3_wire_bytes(n_params: float = 1e9, world: int = 8, bytes_per_param: int = 2) -> float:
    """Two all-gathers (forward, backward) and one reduce-scatter, each (N-1)/N of the parameters' bytes."""
    return 3 * (world - 1) / world * n_params * bytes_per_param
