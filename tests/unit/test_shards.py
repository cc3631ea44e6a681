"""Shards on disk and ShardStream: exact coverage across ranks x workers, exact resume, flat memory, bad input."""

import collections

import numpy as np
import pytest
import torch

from labkit.data.loading import in_memory_growth_fresh, make_loader, stream_memory_fresh
from labkit.data.shards import LoaderCursor, ShardError, ShardReads, ShardStream, open_shards, unit_range, write_shards

SEQ = 32


def _tokens(n=6000, seed=0):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    # 6000 tokens -> 181 or 180 windows of 33 per copy; x3 copies = 541 samples in shards of 40: 14 (last short)
    return write_shards(tmp_path_factory.mktemp("shards"), _tokens(), seq=SEQ, rows_per_shard=40, repeat=3)


def test_writer_layout_and_repetition(folder):
    s = open_shards(folder)
    # copy k starts at token (k * 7919) % (SEQ + 1): a shifted copy may hold one window fewer
    assert s.num_samples == sum((6000 - (k * 7919) % (SEQ + 1)) // (SEQ + 1) for k in range(3)) and s.num_shards == -(-s.num_samples // 40)
    assert s.rows[-1] == s.num_samples - 40 * (s.num_shards - 1)
    s.verify()
    rows = np.concatenate([np.array(s.open(i)) for i in range(s.num_shards)])
    assert rows.dtype == np.uint16 and rows.shape == (s.num_samples, SEQ + 1)
    assert len({r.tobytes() for r in rows}) == len(rows)  # copies are shifted: no sample repeats exactly


def _indices(folder, world, workers, **kw):
    seen = []
    for rank in range(world):
        ds = ShardStream(folder, rank=rank, world_size=world, **kw)
        for b in make_loader(ds, 8, num_workers=workers):
            seen += b["index"].tolist()
    return seen


@pytest.mark.parametrize("world, workers", [(1, 0), (2, 2), (3, 1)])  # 14 shards: 4 and 3 units do not divide it
def test_every_sample_once_per_epoch_across_ranks_and_workers(folder, world, workers):
    n = open_shards(folder).num_samples
    seen = _indices(folder, world, workers, shuffle_buffer=16, seed=1)
    assert sorted(seen) == list(range(n))


def test_uneven_split_differs_by_at_most_one_and_equal_drops_the_rest():
    sizes = [e - s for s, e in (unit_range(543, u, 4) for u in range(4))]
    assert sum(sizes) == 543 and max(sizes) - min(sizes) == 1
    eq = [unit_range(543, u, 4, equal=True) for u in range(4)]
    assert all(e - s == 543 // 4 for s, e in eq)


def test_shuffle_changes_order_per_epoch_but_not_the_set(folder):
    ds = ShardStream(folder, shuffle_buffer=16)
    e0 = [b["index"].tolist() for b in make_loader(ds, 8)]
    e1 = [b["index"].tolist() for b in make_loader(ds, 8)]  # the pass ended: the stream moved to epoch 1
    assert e0 != e1 and sorted(sum(e0, [])) == sorted(sum(e1, []))
    ds.set_epoch(0)
    assert [b["index"].tolist() for b in make_loader(ds, 8)] == e0


@pytest.mark.parametrize("workers, cut", [(0, 5), (2, 1), (2, 6), (2, 67)])
def test_resume_mid_epoch_is_exact(folder, workers, cut):
    kw = dict(shuffle_buffer=16, seed=3)
    full = [b["index"].tolist() for b in make_loader(ShardStream(folder, **kw), 8, num_workers=workers)]
    ds = ShardStream(folder, **kw)
    cursor = LoaderCursor(ds, workers)
    it = iter(make_loader(ds, 8, num_workers=workers, **({"prefetch_factor": 4} if workers else {})))
    got = []
    for _ in range(cut):
        b = next(it)
        cursor.update(b)
        got.append(b["index"].tolist())
    state = cursor.state_dict()
    del it
    again = ShardStream(folder, **kw)
    again.load_state_dict(state)
    rest = [b["index"].tolist() for b in make_loader(again, 8, num_workers=workers)]
    assert got + rest == full


def test_resume_with_another_layout_is_refused(folder):
    ds = ShardStream(folder)
    it = iter(make_loader(ds, 8, num_workers=0))
    cursor = LoaderCursor(ds, 0)
    cursor.update(next(it))
    again = ShardStream(folder)
    again.load_state_dict(cursor.state_dict())
    with pytest.raises(ValueError, match="same world_size and num_workers"):
        next(iter(make_loader(again, 8, num_workers=2)))
    with pytest.raises(ValueError, match="seed"):
        ShardStream(folder, seed=9).load_state_dict(cursor.state_dict())


def test_memory_stays_flat_as_the_dataset_grows_10x(tmp_path):
    seq, rows = 512, 64  # samples of 513 uint16 = 1026 bytes; 400k tokens: 779 samples (0.8 MB) per copy
    tokens = _tokens(400_000)
    small = write_shards(tmp_path / "x1", tokens, seq=seq, rows_per_shard=rows, repeat=1)
    big = write_shards(tmp_path / "x10", tokens, seq=seq, rows_per_shard=rows, repeat=10)
    sample = (seq + 1) * 2
    bound = 2 * rows * sample + 64 * sample * 4 + 2 * 2**20  # 2 open shards, the buffer, 2 MiB of slack
    assert open_shards(big).nbytes > 3 * bound  # the 10x set is far larger than what the stream may hold
    for f in (small, big):
        m = stream_memory_fresh(f, batch_size=16, shuffle_buffer=64, every=8)  # a clean process, as training
        assert m.samples == open_shards(f).num_samples  # a whole epoch was read
        assert m.growth <= bound, (f.name, m)
    # the same bound fails for the naive way: the 10x set read into memory grows by its own size
    assert in_memory_growth_fresh(big) >= 0.9 * open_shards(big).nbytes > bound


def test_shard_reads_names_a_bad_field_and_does_not_change_the_order(folder):
    for bad, msg in ((dict(open_shards=0), "^open_shards must be an integer >= 1"),
                     (dict(open_shards=True), "^open_shards must be"), (dict(delay_s=-1.0), "^delay_s must be"),
                     (dict(delay_s=float("nan")), "^delay_s must be")):
        with pytest.raises(ValueError, match=msg):
            ShardReads(**bad)
    with pytest.raises(ValueError, match="^shuffle_buffer must be >= 0"):
        ShardStream(folder, shuffle_buffer=-1)
    order = [s["index"] for s in ShardStream(folder, shuffle_buffer=16, seed=3)]
    assert [s["index"] for s in ShardStream(folder, shuffle_buffer=16, seed=3, reads=ShardReads(1, 0.0))] == order


def test_missing_folder_truncated_and_corrupt_shards_raise_clear_errors(tmp_path):
    with pytest.raises(ShardError, match="does not exist"):
        ShardStream(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ShardError, match="no index.json"):
        ShardStream(tmp_path / "empty")
    f = write_shards(tmp_path / "s", _tokens(), seq=SEQ, rows_per_shard=40)
    s = open_shards(f)
    # corrupt one row of shard 1 (a token no byte tokenizer makes): the stream stops there, position kept
    arr = np.load(f / s.files[1], mmap_mode="r+")
    arr[5, 3] = 4000
    arr.flush()
    del arr
    with pytest.raises(ShardError, match="CRC-32"):
        s.verify()
    ds = ShardStream(f, shuffle_shards=False)
    cursor, seen = LoaderCursor(ds, 0), 0
    with pytest.raises(ShardError, match=r"shard-00001.npy row 5 is corrupt"):
        for b in make_loader(ds, 1):
            cursor.update(b)
            seen += 1
    assert seen == 40 + 5 and cursor.state_dict()["consumed"] == {0: 45}
    # truncate shard 2
    path = f / s.files[2]
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ShardError, match="truncated"):
        s.open(2)
    (f / s.files[3]).unlink()
    with pytest.raises(ShardError, match="missing"):
        open_shards(f)


def test_loader_knob_mistakes_raise_one_line_errors(folder):
    ds = ShardStream(folder)
    with pytest.raises(ValueError, match="prefetch_factor=2 needs num_workers > 0"):
        make_loader(ds, 8, num_workers=0, prefetch_factor=2)
    with pytest.raises(ValueError, match="persistent_workers"):
        make_loader(ds, 8, persistent_workers=True)
    with pytest.raises(ValueError, match="batch_size"):
        make_loader(ds, 0)


def test_after_a_resume_the_next_epoch_is_whole_and_a_new_pass_starts_over(folder):
    kw = dict(shuffle_buffer=16, seed=5)
    fresh = ShardStream(folder, **kw)
    fresh.set_epoch(1)
    epoch1 = [b["index"].tolist() for b in make_loader(fresh, 8, num_workers=2)]
    ds = ShardStream(folder, **kw)
    it = iter(make_loader(ds, 8, num_workers=2))
    cursor = LoaderCursor(ds, 2)
    for _ in range(3):
        cursor.update(next(it))
    del it
    again = ShardStream(folder, **kw)
    again.load_state_dict(cursor.state_dict())
    for epoch in (0, 1):  # the usual loop: set_epoch at the top of every epoch
        again.set_epoch(epoch)
        batches = [b["index"].tolist() for b in make_loader(again, 8, num_workers=2)]
        if epoch == 0:
            assert len(sum(batches, [])) == open_shards(folder).num_samples - 3 * 8
    assert batches == epoch1
    # a pass broken off early, then a new one: the epoch starts over (no position was loaded)
    ds = ShardStream(folder, **kw)
    first = next(iter(make_loader(ds, 8)))["index"].tolist()
    assert next(iter(make_loader(ds, 8)))["index"].tolist() == first


def test_copy_on_access_a_list_is_copied_into_the_workers_an_array_is_not():
    """The lesson-12 trap: a list's objects are copied page by page as the workers read them (their
    reference counts are written), one array's rows are not. The bounds come from the payload.

    The array's workers still grow a little, by their own heap (the batches they build and pickle):
    16-90 KB on an idle machine and 331 KB once under CI's load, whatever the payload. At 100,000 items
    a twentieth of the payload (320 KB) was below that once; at 400,000 (25.6 MB, a twentieth 1.28 MB)
    the payload-free floor is far below the bound, and the list still copies 43 MB."""
    from labkit.data.loading import ArrayOfBytes, ListOfBytes, copy_on_access

    items, width = 400_000, 64
    payload = items * width
    listed = copy_on_access(ListOfBytes(items, width), num_workers=2)
    arrayed = copy_on_access(ArrayOfBytes(items, width), num_workers=2)
    assert listed["growth"] > 0.25 * payload, (listed, arrayed)
    assert arrayed["growth"] < 0.05 * payload, (listed, arrayed)
    assert listed["end"] == listed["first"] + listed["growth"]


def test_copy_on_access_refuses_inputs_that_cannot_show_the_effect():
    from labkit.data.loading import ArrayOfBytes, copy_on_access

    with pytest.raises(ValueError, match="num_workers=0"):
        copy_on_access(ArrayOfBytes(10_000), num_workers=0)
    with pytest.raises(ValueError, match="more items than 8192"):
        copy_on_access(ArrayOfBytes(8_000), num_workers=2, batch_size=4096)
