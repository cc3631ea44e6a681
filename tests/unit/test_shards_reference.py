"""ShardStream under torchdata's StatefulDataLoader (the reference loader, pinned in pyproject's test extra):
the same batches in the same order as a plain DataLoader, and its own resume lands on the same batch as ours."""

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from labkit.data.loading import make_loader
from labkit.data.shards import LoaderCursor, ShardStream, collate, write_shards

SEQ = 32
# torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates: not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")


def _tokens(n=6000, seed=0):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_shards(tmp_path_factory.mktemp("ref"), _tokens(), seq=SEQ, rows_per_shard=40, repeat=3)


@pytest.mark.parametrize("workers", [0, 2])
def test_same_batches_in_the_same_order(folder, workers):
    ours = [b["index"].tolist() for b in make_loader(ShardStream(folder, shuffle_buffer=16), 8, num_workers=workers)]
    ref = [b["index"].tolist() for b in StatefulDataLoader(ShardStream(folder, shuffle_buffer=16), batch_size=8,
                                                          num_workers=workers, collate_fn=collate)]
    assert ours == ref


@pytest.mark.parametrize("workers, cut", [(0, 7), (2, 7), (2, 30)])
def test_reference_resume_matches_ours(folder, workers, cut):
    def loader(ds):
        return StatefulDataLoader(ds, batch_size=8, num_workers=workers, collate_fn=collate)

    full = [b["index"].tolist() for b in loader(ShardStream(folder, shuffle_buffer=16))]
    ref_loader, ds = loader(ShardStream(folder, shuffle_buffer=16)), None
    it = iter(ref_loader)
    for _ in range(cut):
        next(it)
    ref_state = ref_loader.state_dict()
    del it
    resumed = loader(ShardStream(folder, shuffle_buffer=16))
    resumed.load_state_dict(ref_state)
    ref_rest = [b["index"].tolist() for b in resumed]
    ds = ShardStream(folder, shuffle_buffer=16)
    cursor = LoaderCursor(ds, workers)
    it = iter(make_loader(ds, 8, num_workers=workers))
    for _ in range(cut):
        cursor.update(next(it))
    del it
    again = ShardStream(folder, shuffle_buffer=16)
    again.load_state_dict(cursor.state_dict())
    ours_rest = [b["index"].tolist() for b in make_loader(again, 8, num_workers=workers)]
    assert ref_rest == ours_rest == full[cut:]
