"""Reference solutions for lesson 12's exercises (tests/unit/test_exercises_12.py checks each one)."""

from labkit.models.cnn import predict


# ---- exercise 1: samples read by one unit ------------------------------------------------------------
def unit_samples(num_samples: int, world: int, workers: int, rank: int, worker: int) -> int:
    """Unit u = rank * workers + worker of U = world * workers reads positions [u*N//U, (u+1)*N//U)."""
    units, unit = world * max(workers, 1), rank * max(workers, 1) + worker
    return (unit + 1) * num_samples // units - unit * num_samples // units


UNIT_SAMPLES = unit_samples(1000, 3, 2, 2, 1)  # unit 5 of 6: 1000 - 833 = 167


# ---- exercise 2: bytes in flight -----------------------------------------------------------------------
def in_flight_bytes(num_workers: int, prefetch_factor: int, batch: int, seq: int) -> int:
    return num_workers * prefetch_factor * 2 * batch * seq * 8  # x and y, int64


IN_FLIGHT = in_flight_bytes(4, 2, 16, 256)  # 8 batches of 64 KiB: 512 KiB


# ---- exercise 3: the largest phi in a budget ------------------------------------------------------------
def largest_phi(config, batch: int, budget: int):
    best = None
    for i in range(17):
        phi = i / 2
        if predict(config.at(phi), batch).resident <= budget:
            best = phi
    return best


# In the notebook: largest_phi(CNN, CNN_BATCH, PHI_BUDGET)
