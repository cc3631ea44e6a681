"""Reference solutions for lesson 12's exercises (tests/unit/test_exercises_12.py checks each one)."""

from dataclasses import replace

from labkit.models.cnn import predict


# ---- exercise 1: samples read by one unit ------------------------------------------------------------
def unit_samples(num_samples: int, world: int, workers: int, rank: int, worker: int) -> int:
    """Unit u = rank * workers + worker of U = world * workers reads positions [u*N//U, (u+1)*N//U)."""
    units, unit = world * max(workers, 1), rank * max(workers, 1) + worker
    return (unit + 1) * num_samples // units - unit * num_samples // units


# In the notebook: unit_samples(worker=1, **EX1); EX1 on your own is the lesson's 1000 samples, 3 ranks x 2 workers,
# rank 2 (its worker 1 is unit 5 of 6: 1000 - 833 = 167)
UNIT_SAMPLES = unit_samples(1000, 3, 2, 2, 1)


# ---- exercise 2: bytes in flight -----------------------------------------------------------------------
def in_flight_bytes(num_workers: int, prefetch_factor: int, batch: int, seq: int) -> int:
    return num_workers * prefetch_factor * 2 * batch * seq * 8  # x and y, int64


# In the notebook: in_flight_bytes(**EX2); EX2 on your own is the lesson's 4 workers x prefetch 2, batch 16 x seq 256
IN_FLIGHT = in_flight_bytes(4, 2, 16, 256)  # 8 batches of 64 KiB: 512 KiB


# ---- exercise 3: the largest phi in a budget ------------------------------------------------------------
def largest_phi(config, batch: int, budget: int, gamma: float | None = None, budget_scale: float = 1):
    """gamma: the family's resolution coefficient (None: the config's own); the budget is budget_scale x budget."""
    if gamma is not None:
        config = replace(config, gamma=gamma)
    best = None
    for i in range(17):
        phi = i / 2
        if predict(config.at(phi), batch).resident <= budget * budget_scale:
            best = phi
    return best


# In the notebook: largest_phi(CNN, CNN_BATCH, PHI_BUDGET, **EX3); EX3 on your own is the lesson's CNN (gamma 1.15)
# and the whole PHI_BUDGET
