"""Checks for lesson 09 (data parallelism and ZeRO): the bytes a rank keeps at a stage, and the bytes a rank
sends per step. Expected values come from the library: labkit.estimate.zero_terms.paper_bytes (the ZeRO paper's
rules) and labkit.distributed.comms.wire_bytes (each collective's definition)."""

from __future__ import annotations

from labkit.distributed.comms import wire_bytes
from labkit.estimate.zero_terms import paper_bytes

from . import Inputs, failed, number, passed

inputs = Inputs(__name__, {  # each exercise's inputs: the lesson's own first, then what a course may draw
    "stage_bytes": {"n_params": (7.5e9, 1.3e9, 13e9, 70e9), "world": (64, 8, 16, 128), "stage": (2, 1, 3)},
    "zero3_wire_bytes": {"n_params": (1e9, 3e9, 7e9, 13e9), "world": (8, 4, 16, 64), "bytes_per_param": (2, 4)},
})


# ---- exercise 1: model-state bytes per GPU at a ZeRO stage -----------------------------------------------
def check_stage_bytes(answer_gb, n_params: float = 7.5e9, world: int = 64, stage: int = 2, k: int = 12) -> bool:
    """GB (1e9 bytes) of model states per GPU: 2 B fp16 weights + 2 B fp16 gradients + K B optimizer state per
    parameter, the parts the stage shards divided by the number of GPUs. Within 0.05 GB (one decimal)."""
    name = f"GB per GPU at ZeRO-{stage}, {n_params:.3g} parameters, {world} GPUs, K = {k}"
    value = number(answer_gb, name)
    if value is None:
        return False
    expected = paper_bytes(n_params, world, stage, k) / 1e9
    if abs(value - expected) <= 0.05:
        return passed(f"{name}: {expected:.2f} GB = " + {0: "(2 + 2 + K) Psi", 1: "4 Psi + K Psi / N",
                                                         2: "2 Psi + (2 + K) Psi / N", 3: "(2 + 2 + K) Psi / N"}[stage])
    for s in range(4):
        if s != stage and abs(value - paper_bytes(n_params, world, s, k) / 1e9) <= 0.05:
            return failed(f"{name}: that is ZeRO-{s}'s figure; stage {stage} shards "
                          + ["nothing", "the optimizer state", "the optimizer state and the gradients",
                             "the optimizer state, the gradients and the parameters"][stage])
    if abs(value - expected * 1e9 / 2**30) <= 0.05:
        return failed(f"{name}: that is GiB (2**30 bytes); the paper counts GB (1e9 bytes)")
    return failed(f"{name}: per parameter 2 B weights, 2 B gradients, K = {k} B state; divide what is sharded by N")


# ---- exercise 2: bytes a rank sends per step at ZeRO-3 -----------------------------------------------------
def zero3_wire_bytes(n_params: float, world: int, bytes_per_param: int = 2) -> float:
    """Ring algorithms: all-gather the parameters in forward and again in backward, reduce-scatter the gradients."""
    s = n_params * bytes_per_param
    return 2 * wire_bytes("all_gather", s, world) + wire_bytes("reduce_scatter", s, world)


def check_zero3_wire_bytes(answer, n_params: float = 1e9, world: int = 8, bytes_per_param: int = 2) -> bool:
    name = f"bytes each rank sends per ZeRO-3 step ({n_params:.3g} parameters of {bytes_per_param} B, {world} ranks)"
    value = number(answer, name)
    if value is None:
        return False
    expected = zero3_wire_bytes(n_params, world, bytes_per_param)
    s = n_params * bytes_per_param
    if abs(value - expected) <= 1e-6 * expected:
        return passed(f"{name}: {expected:.4g} = 3 x (N-1)/N x {s:.3g} B: 1.5x data parallel's all-reduce "
                      f"({wire_bytes('all_reduce', s, world):.4g})")
    if abs(value - wire_bytes("all_reduce", s, world)) <= 1e-6 * expected:
        return failed(f"{name}: that is one all-reduce (ZeRO-1/2's volume); ZeRO-3 also gathers the parameters "
                      f"again in backward")
    if abs(value - 3 * s) <= 1e-6 * expected:
        return failed(f"{name}: 3 x the payload counts what a rank receives too; a ring sends (N-1)/N of each")
    return failed(f"{name}: a ring all-gather or reduce-scatter of S bytes sends (N-1)/N x S per rank; ZeRO-3 does "
                  f"two all-gathers and one reduce-scatter of the parameters' bytes")
