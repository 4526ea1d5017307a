"""A Loader inside torch's DataLoader (issue 24, item 2): wrapped with
`batch_size=None` it is served exactly once per epoch; iterated in more than
one DataLoader worker (each would iterate its own copy: every sample twice
with 2 workers) it refuses, saying what to do, under fork, spawn and
forkserver; and a pickled Loader goes on where its state_dict says."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, IterableDataset  # noqa: E402

BATCH = 8


class Wrapped(IterableDataset):
    """The usual three-line wrapper users write around an iterable."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __iter__(self) -> Any:
        return iter(self.loader)


def labels_of(batches: Any) -> list[int]:
    out: list[int] = []
    for b in batches:
        out += np.asarray(b["label"]).astype(np.int64).tolist()
    return out


def test_dataloader_with_batch_size_none_serves_each_sample_once(start_daemon, stoker, data) -> None:
    d = start_daemon()
    loader = stoker.Loader(data.spec(stoker), batch_size=BATCH, shuffle=True, seed=3, socket=d.socket)
    twin = stoker.Loader(data.spec(stoker), batch_size=BATCH, shuffle=True, seed=3, socket=d.socket)
    assert isinstance(loader, IterableDataset)
    dl = DataLoader(loader, batch_size=None)
    assert len(dl) == len(loader)
    seen = []
    for batch, ref in zip(dl, twin):
        for name, t in batch.items():
            assert isinstance(t, torch.Tensor)
            assert np.array_equal(t.numpy(), ref[name])
        seen += data.check_batch({k: t.numpy() for k, t in batch.items()})
    assert sorted(seen) == list(range(data.n))
    loader.close()
    twin.close()


# torch's SIGCHLD handler may report the second refused worker's exit while the
# first one's error unwinds the DataLoader: expected here, not a leak.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_two_dataloader_workers_are_refused_never_duplicated(start_daemon, stoker, data, context) -> None:
    d = start_daemon()
    loader = stoker.Loader(data.spec(stoker), batch_size=BATCH, shuffle=False, socket=d.socket, timeout=60)
    for dataset in (Wrapped(loader), loader):
        dl = DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context=context)
        with pytest.raises(RuntimeError, match="2 DataLoader worker processes") as refused:
            labels_of(dl)
        assert "num_workers=0" in str(refused.value)
    # One worker is one copy: every sample exactly once.
    dl = DataLoader(Wrapped(loader), batch_size=None, num_workers=1, multiprocessing_context=context)
    assert sorted(labels_of(dl)) == list(range(data.n))
    # And none, in this process.
    assert sorted(labels_of(DataLoader(Wrapped(loader), batch_size=None))) == list(range(data.n))
    loader.close()


def test_an_unpickled_loader_goes_on_where_its_state_dict_says(start_daemon, stoker, data) -> None:
    d = start_daemon()
    loader = stoker.Loader(data.spec(stoker), batch_size=BATCH, shuffle=True, seed=5, socket=d.socket)
    it = iter(loader)
    first = labels_of([next(it) for _ in range(3)])
    copy = pickle.loads(pickle.dumps(loader))
    assert copy.state_dict()["step"] == 3 == loader.state_dict()["step"]
    rest = labels_of(copy)
    assert sorted(first + rest) == list(range(data.n))
    loader.close()
    copy.close()
