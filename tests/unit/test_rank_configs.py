"""The configs the distributed rank functions take (dp_ranks.TrainRun, layout_ranks.Workload, PowerSGDConfig,
PSConfig's optimizer, comm_ranks.WorkerFaults): bad values are one clear ValueError in the caller's process,
before any rank starts, and every config survives the pickling that mp.spawn does."""

import pickle

import pytest

from labkit.distributed.comm_ranks import WorkerFaults
from labkit.distributed.compression import PowerSGDConfig
from labkit.distributed.dp_ranks import TrainRun, batch_of, shard_rows
from labkit.distributed.layout_ranks import Workload
from labkit.distributed.param_server import PSConfig

CFG = dict(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16)


@pytest.mark.parametrize("make, words", [
    (lambda: TrainRun(CFG, 0, 8, 8), "steps must be an integer >= 1"),
    (lambda: TrainRun(CFG, 2, 8, 32), "longer than the model's block_size 16"),
    (lambda: TrainRun(dict(CFG, heads=2), 2, 8, 8), "cfg: .*heads"),
    (lambda: TrainRun(CFG, 2, 8, 8, text_chars=1000), "vocab_size is 64"),
    (lambda: TrainRun(CFG, 2, 8, 8, seed=-1), "seed must be an integer >= 0"),
    (lambda: Workload(CFG, 4, 8, family="mistral"), "unknown model family 'mistral'"),
    (lambda: Workload(CFG, 0, 8), "batch must be an integer >= 1"),
    (lambda: PowerSGDConfig(rank=0), "PowerSGD rank must be an integer >= 1"),
    (lambda: PowerSGDConfig(start_iter=1), "start_iter must be >= 2 with error feedback or warm start"),
    (lambda: PowerSGDConfig(bucket_mb=0), "bucket_mb must be a positive number"),
    (lambda: PSConfig("sync", optimizer="adam"), "optimizer must be one of sgd, sgd-momentum, adamw"),
    (lambda: WorkerFaults(delays={0: 1.0}), "keyed by worker rank"),
    (lambda: WorkerFaults(delays={2: -1}), "delays must be seconds >= 0"),
    (lambda: WorkerFaults(die={1: 0.5}), "a step >= 0"),
])
def test_bad_config_is_one_clear_error(make, words):
    with pytest.raises(ValueError, match=words) as e:
        make()
    assert "\n" not in str(e.value)


def test_configs_pickle_and_compare_equal():
    for c in (TrainRun(CFG, 2, 8, 8), Workload(CFG, 4, 8), PowerSGDConfig(rank=2), PSConfig("async", 1),
              WorkerFaults(delays={2: 0.01}, die={1: 1})):
        assert pickle.loads(pickle.dumps(c)) == c


def test_a_rank_takes_its_share_of_the_same_global_batch():
    run = TrainRun(CFG, steps=2, batch=8, seq=8)
    halves = [shard_rows(run, r, 2) for r in range(2)]
    for step in range(2):
        x, y = batch_of(run, step)
        assert (x[:4] == halves[0][step][0]).all() and (y[4:] == halves[1][step][1]).all()
    with pytest.raises(ValueError, match="8 rows does not split evenly over 3 ranks"):
        shard_rows(run, 0, 3)
