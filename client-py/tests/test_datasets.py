"""The daemon keeps datasets open for reuse, but not forever: idle ones beyond
a bound are closed, and reopen on demand."""

from __future__ import annotations

import os
import time
from pathlib import Path

import h5py
import numpy as np

KEEP_IDLE = 16  # daemon/src/dataset/mod.rs


def open_files_under(pid: int, root: Path) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(str(root)):
                n += 1
        except OSError:
            pass
    return n


def test_idle_datasets_beyond_the_bound_are_closed_and_reopen(start_daemon, stoker, tmp_path: Path) -> None:
    root = tmp_path / "many"
    root.mkdir()
    paths = []
    for k in range(KEEP_IDLE + 6):
        p = root / f"d{k:02d}.h5"
        with h5py.File(p, "w") as f:
            f["x"] = np.full((5, 3), k, dtype="<i4")
        paths.append(p)
    daemon = start_daemon(allowed_roots=[tmp_path])
    for p in paths:
        loader = stoker.Loader(stoker.hdf5(str(p), fields={"x": "x"}), batch_size=5, socket=daemon.socket)
        assert len(list(loader)) == 1
        loader.close()
        del loader
    # One more open triggers eviction of everything idle beyond the bound.
    again = stoker.Loader(stoker.hdf5(str(paths[0]), fields={"x": "x"}), batch_size=5, socket=daemon.socket)
    (batch,) = list(again)
    assert (batch["x"] == 0).all()
    # Each open HDF5 file holds two descriptors (libhdf5's and the pread one).
    # A closed Loader's stream ends asynchronously: allow it a moment.
    deadline = time.monotonic() + 10
    while (held := open_files_under(daemon.proc.pid, root)) > 2 * (KEEP_IDLE + 1) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert held <= 2 * (KEEP_IDLE + 1), f"{held} descriptors still open under {root}"
    assert "closed idle dataset" in daemon.stderr()
    again.close()
