#!/usr/bin/env python3
"""Decode throughput of a gzip- (or Blosc2-) chunked f32 HDF5 dataset.

Compares, on the same page-cached file, in one run:

* stoker's fast path (pread + inflate/unshuffle in Rust on the worker
  threads, outside libhdf5's lock) with 1 and with 2 worker threads;
* stoker with ``[hdf5] fast_path = false`` (every read through libhdf5's
  ``H5Dread``, one thread at a time under its global lock), 2 worker threads;
* h5py in a 2-process ``multiprocessing`` pool, each worker holding the file
  open and reading whole chunk-aligned batches (what DataLoader workers with
  cached file handles do).

Each stoker run uses a fresh daemon (empty chunk cache) and one epoch in file
order (``shuffle=False``), so every chunk is read and decompressed exactly once
and its samples are served from the decoded chunk. Reported: decoded MB/s
and samples/s, median of --passes runs, and the 2-thread/1-thread ratio.

    python benches/hdf5_decode.py                # ~300 MB decoded, writes docs/performance-hdf5-decode.md
    python benches/hdf5_decode.py --mb 50 --out - # quicker, prints only
    python benches/hdf5_decode.py --filter blosc2 # Blosc2 (zstd + shuffle, b2nd chunks):
        # stoker's Rust decoder vs c-blosc2 through hdf5plugin in libhdf5 and in h5py,
        # writes docs/performance-hdf5-blosc2.md
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import REPO, Daemon, machine_info, stoker_bin, warm_page_cache  # noqa: E402

ELEMS = 16384  # f32 per sample: 64 KiB samples
CHUNK_ROWS = 16  # 1 MiB chunks
BATCH = 64


def ensure_file(path: Path, n: int, filter: str = "gzip") -> None:
    if path.exists():
        with h5py.File(path) as f:
            if f["x"].shape == (n, ELEMS):
                return
    print(f"writing {path}", file=sys.stderr)
    rng = np.random.default_rng(0)
    tmp = path.with_suffix(".tmp")
    with h5py.File(tmp, "w") as f:
        if filter == "blosc2":
            import hdf5plugin

            kw = dict(hdf5plugin.Blosc2(cname="zstd", clevel=5, filters=hdf5plugin.Blosc2.SHUFFLE))
        else:
            kw = {"compression": "gzip", "compression_opts": 4, "shuffle": True}
        ds = f.create_dataset("x", shape=(n, ELEMS), dtype="<f4", chunks=(CHUNK_ROWS, ELEMS), **kw)
        for i in range(0, n, 256):
            k = min(256, n - i)
            # Smooth signals plus noise quantized to 1/256: compresses about 2-3x, like measured fields.
            t = np.linspace(0, 20, ELEMS, dtype=np.float32)
            phase = rng.uniform(0, 6.28, size=(k, 1)).astype(np.float32)
            noise = rng.integers(-8, 8, size=(k, ELEMS)).astype(np.float32) / 256
            ds[i : i + k] = np.sin(t[None, :] + phase) + noise
    tmp.rename(path)


def run_stoker(binary: str, path: Path, threads: int, fast: bool, n: int) -> float:
    import stoker

    with tempfile.TemporaryDirectory(prefix="stk-bench-") as tmp:
        extra = f"[hdf5]\nfast_path = {'true' if fast else 'false'}\n[cache]\nchunk_bytes = 67108864\n"
        with Daemon(binary, Path(tmp), path.parent, threads=threads, depth=8, extra=extra) as d:
            loader = stoker.Loader(stoker.hdf5(str(path), fields={"x": "x"}), batch_size=BATCH, shuffle=False, socket=d.socket)
            t0 = time.perf_counter()
            rows = 0
            for b in loader:
                rows += len(b["x"])
            dt = time.perf_counter() - t0
            loader.close()
    assert rows == n, (rows, n)
    return dt


def _h5py_worker(args: tuple[str, int, int]) -> int:
    path, start, stop = args
    global _H5
    if _H5 is None:
        import hdf5plugin  # noqa: F401  (registers Blosc2 with h5py's libhdf5)

        _H5 = h5py.File(path, "r")
    return _H5["x"][start:stop].nbytes


_H5 = None


def run_h5py(path: Path, n: int, procs: int) -> float:
    tasks = [(str(path), i, min(i + BATCH, n)) for i in range(0, n, BATCH)]
    with mp.get_context("fork").Pool(procs) as pool:
        pool.map(_h5py_worker, tasks[: procs * 2])  # open the files in every worker first
        t0 = time.perf_counter()
        total = sum(pool.imap(_h5py_worker, tasks, chunksize=1))
        dt = time.perf_counter() - t0
    assert total == n * ELEMS * 4
    return dt


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=320, help="decoded dataset size in MB (default 320)")
    p.add_argument("--dir", default="/tmp/stoker-bench")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--stoker", default=None)
    p.add_argument("--filter", choices=["gzip", "blosc2"], default="gzip")
    p.add_argument("--out", default=None, help="markdown file, or - to only print")
    a = p.parse_args()
    if a.out is None:
        name = "performance-hdf5-decode.md" if a.filter == "gzip" else "performance-hdf5-blosc2.md"
        a.out = str(REPO / "docs" / name)
    if a.filter == "blosc2":
        import os

        import hdf5plugin

        # The daemons inherit it: with fast_path = false, libhdf5 decodes through c-blosc2.
        os.environ["HDF5_PLUGIN_PATH"] = hdf5plugin.PLUGIN_PATH
    binary = stoker_bin(a.stoker)
    n = (a.mb * 1_000_000 // (ELEMS * 4)) // CHUNK_ROWS * CHUNK_ROWS
    root = Path(a.dir)
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"decode-{a.filter}-{n}.h5"
    ensure_file(path, n, a.filter)
    warm_page_cache(path)
    decoded = n * ELEMS * 4
    stored = path.stat().st_size

    runs = {
        "stoker fast path, 1 worker thread": lambda: run_stoker(binary, path, 1, True, n),
        "stoker fast path, 2 worker threads": lambda: run_stoker(binary, path, 2, True, n),
        "stoker via libhdf5 (fast_path = false), 2 worker threads": lambda: run_stoker(binary, path, 2, False, n),
        "h5py, 2-process multiprocessing pool": lambda: run_h5py(path, n, 2),
    }
    results = {}
    for name, fn in runs.items():
        times = [fn() for _ in range(a.passes)]
        results[name] = statistics.median(times)
        print(f"{name:<60} {decoded / results[name] / 1e6:8.1f} MB/s  ({[round(t, 3) for t in times]} s)", file=sys.stderr)

    one = results["stoker fast path, 1 worker thread"]
    two = results["stoker fast path, 2 worker threads"]
    info = machine_info()
    lines = [
        f"# HDF5 decode throughput ({a.filter}-chunked f32)",
        "",
        f"Command: `python {shlex.join(['benches/hdf5_decode.py', *sys.argv[1:]])}`",
        "",
        f"Dataset: one file, {n} samples of {ELEMS} f32 ({ELEMS * 4 // 1024} KiB), chunks of {CHUNK_ROWS} samples "
        f"(1 MiB), {'gzip level 4 + shuffle' if a.filter == 'gzip' else 'Blosc2 zstd level 5 + shuffle (b2nd chunks, hdf5plugin)'}; {decoded / 1e6:.0f} MB decoded, {stored / 1e6:.0f} MB on disk "
        f"(ratio {decoded / stored:.2f}), page-cached. One epoch in file order, batch {BATCH}; every chunk is "
        "decompressed once. Median of " + str(a.passes) + " runs.",
        "",
        f"Machine: {info['nproc']} CPUs ({info['cpu']}), {info['memory']}, Linux {info['kernel']}, "
        f"Python {info['python']}, numpy {info['numpy']}, h5py {info['h5py']}.",
        "",
        "| reader | decoded MB/s | samples/s | vs. stoker 1 thread |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, t in results.items():
        lines.append(f"| {name} | {decoded / t / 1e6:.0f} | {n / t:.0f} | {one / t:.2f}× |")
    lines += ["", f"Scaling of the fast path from 1 to 2 worker threads: **{one / two:.2f}×**.", ""]
    text = "\n".join(lines)
    print(text)
    if a.out != "-":
        Path(a.out).write_text(text)
        print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
