#!/usr/bin/env python3
"""Time to open an HDF5 dataset of many files, and the first batch, through the daemon.

Writes N small HDF5 files (one float32 field of 16 rows each, half gzip-chunked,
half contiguous) and, for each binary given (``--stoker A --stoker B``,
alternating, ``--runs`` times each, a fresh daemon per run), measures the
time from ``stoker.Loader(...)`` to ``len(loader)`` (the dataset opened: every
file probed) and to the first batch. Since libhdf5 moved into helper
processes, every file's open is a round trip to the helper; this measures what
that costs against a binary from before.

    python benches/hdf5_open.py --files 1000 --stoker target/release/stoker --stoker /tmp/stoker-before
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import Daemon  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--stoker", action="append", required=True, help="a stoker binary (give two to compare)")
    args = ap.parse_args()
    import stoker

    with tempfile.TemporaryDirectory(prefix="stk-open-") as tmp:
        root = Path(tmp)
        data = root / "data"
        data.mkdir()
        for i in range(args.files):
            with h5py.File(data / f"f{i:05d}.h5", "w") as f:
                x = np.full((16, 8), i, dtype=np.float32)
                if i % 2:
                    f.create_dataset("x", data=x, chunks=(8, 8), compression="gzip")
                else:
                    f.create_dataset("x", data=x)
        times: dict[str, tuple[list[float], list[float]]] = {b: ([], []) for b in args.stoker}
        for run in range(args.runs):
            for n, binary in enumerate(args.stoker):
                with Daemon(binary, root / f"d{run}-{n}", data, threads=2, depth=2, extra="[limits]\nmax_open_files = 2048\n") as d:
                    t0 = time.perf_counter()
                    loader = stoker.Loader(stoker.hdf5(str(data / "*.h5"), fields={"x": "x"}), batch_size=16,
                                           shuffle=False, socket=d.socket, timeout=600)
                    assert len(loader) == args.files
                    t1 = time.perf_counter()
                    next(iter(loader))
                    t2 = time.perf_counter()
                    loader.close()
                times[binary][0].append(t1 - t0)
                times[binary][1].append(t2 - t0)
        print(f"{args.files} files, {args.runs} runs each, alternating; medians (min–max)")
        print("| binary | open (len) | first batch |")
        print("| --- | --- | --- |")
        for binary, (opens, firsts) in times.items():
            print(
                f"| {binary} | {statistics.median(opens):.3f} s ({min(opens):.3f}–{max(opens):.3f}) "
                f"| {statistics.median(firsts):.3f} s ({min(firsts):.3f}–{max(firsts):.3f}) |"
            )


if __name__ == "__main__":
    main()
