"""comm_ranks.collectives_check, the rank function `make gpu-check` runs over NCCL, on gloo here: every
collective's known answer arrives on every rank (world sizes 1 and 2; NCCL runs the same function on CUDA)."""

import pytest

from labkit.distributed import comm_ranks
from labkit.distributed.launch import launch


@pytest.mark.parametrize("world", [1, 2])
def test_collectives_check_on_gloo(world):
    out = launch(comm_ranks.collectives_check, world_size=world, args=(8,), backend="gloo", timeout_s=60)
    assert [r["world"] for r in out] == [world] * world
    for r in out:
        assert r["backend"] == "gloo" and r["device"] == "cpu"
        assert r["ok"] == {"all_gather": True, "reduce_scatter": True, "broadcast": True, "all_reduce_avg": True}
