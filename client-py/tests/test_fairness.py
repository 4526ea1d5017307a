"""Fair shares of the worker pool between users, then between one user's
streams (issue 22, item 5): fills in flight are bounded per user, a user's
streams take turns, and a slow stream does not hold back its owner's other
streams. Real daemon, real HDF5 files, real Loaders; what the daemon does is
read from its own reports (`stoker status`, the Prometheus endpoint), never
from timings.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import h5py
import numpy as np

from conftest import Daemon, poll
from test_metrics import samples, scrape, value, with_metrics

#: One gzip chunk of 64 rows x 4 MiB of zeros: with no chunk cache every row
#: inflates the whole 256 MiB chunk on a worker (a fraction of a second), so
#: a batch of such rows keeps workers busy while the test looks at what else runs.
SLOW_ROW = 1 << 22


def slow_file(path: Path) -> Path:
    with h5py.File(path, "w") as f:
        f.create_dataset("x", shape=(64, SLOW_ROW), dtype=np.uint8, chunks=(64, SLOW_ROW), compression="gzip",
                         fillvalue=0)
        f["x"][0, :8] = np.arange(1, 9, dtype=np.uint8)
    return path


def fast_file(path: Path) -> Path:
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.arange(64 * 4, dtype=np.float32).reshape(64, 4))
    return path


NO_CHUNK_CACHE = "[cache]\nchunk_bytes = 0\n[limits]\nidle_close_s = 0\n"


def ours(d: Daemon, dataset: str) -> list[dict[str, Any]]:
    return [s for s in d.status()["streams"] if s["pid"] == os.getpid() and s["dataset"].endswith(dataset)]


def test_a_users_many_loaders_keep_a_bounded_number_of_fills_in_flight(
    start_daemon: Callable[..., Daemon], stoker: Any, tmp_path: Path
) -> None:
    """Item 5 of issue 22: one user's 12 Loaders of depth 4 asked for 48 fills
    at once and all of them sat in the worker pool's queue. Fills in flight
    are now bounded per user (four per worker: 8 here) and the other
    streams wait for their turn, visible in `stoker_fills_in_flight` and
    `stoker_streams_waiting`; every stream still gets its batches."""
    slow = slow_file(tmp_path / "slow.h5")
    d, base = with_metrics(start_daemon, threads=2, depth=4, extra=NO_CHUNK_CACHE)
    loaders = [stoker.Loader(stoker.hdf5(str(slow), fields={"x": "x"}), batch_size=1, shuffle=False,
                             socket=d.socket, timeout=120) for _ in range(12)]
    its = [iter(loader) for loader in loaders]
    try:
        seen = []

        def both_seen() -> bool:
            parsed = samples(scrape(base)[1])
            in_flight = value(parsed, "stoker_fills_in_flight")
            waiting = value(parsed, "stoker_streams_waiting")
            seen.append((in_flight, waiting))
            return waiting >= 1

        assert poll(both_seen, 60), seen
        assert max(f for f, _ in seen) <= 8, f"more than 8 fills in flight for one user: {seen}"
        # Every stream gets its batches (each its first row, then the next).
        for it in its:
            first = next(it)["x"]
            assert first.shape == (1, SLOW_ROW) and list(first[0, :8]) == list(range(1, 9))
        parsed = samples(scrape(base)[1])
        assert value(parsed, "stoker_fills_in_flight") <= 8
    finally:
        for loader in loaders:
            loader.close()


def test_a_users_fast_stream_is_not_held_behind_its_slow_stream(
    start_daemon: Callable[..., Daemon], stoker: Any, tmp_path: Path
) -> None:
    """Item 5 of issue 22, within one user: a stream of slow rows (each
    inflates a 256 MiB chunk) queued its whole depth of fills, and the same
    user's second stream over a small file waited until all of them were
    done. Now the user's streams share its fills and workers: the small
    file's epoch is served while the slow stream has filled at most half of
    its ring."""
    slow = slow_file(tmp_path / "slow.h5")
    fast = fast_file(tmp_path / "fast.h5")
    depth = 4
    d = start_daemon(threads=2, depth=depth, extra=NO_CHUNK_CACHE)
    slow_loader = stoker.Loader(stoker.hdf5(str(slow), fields={"x": "x"}), batch_size=4, shuffle=False,
                                socket=d.socket, timeout=120)
    slow_it = iter(slow_loader)
    fast_loader = stoker.Loader(stoker.hdf5(str(fast), fields={"x": "x"}), batch_size=16, shuffle=False,
                                socket=d.socket, timeout=120)
    try:
        # The slow stream is open and filling (its fills are queued first).
        assert poll(lambda: ours(d, "slow.h5"), 30), d.status()
        got = np.concatenate([b["x"].copy() for b in fast_loader])
        filled = ours(d, "slow.h5")[0]["slots_filled"]
        assert np.array_equal(got, np.arange(64 * 4, dtype=np.float32).reshape(64, 4))
        assert filled <= depth // 2, f"the small file waited for {filled} of the slow stream's {depth} batches"
        # And the slow stream is served right.
        first = next(slow_it)["x"]
        assert list(first[0, :8]) == list(range(1, 9)) and not first[1:].any()
    finally:
        fast_loader.close()
        slow_loader.close()
