#!/usr/bin/env python3
"""Throughput and Python-side per-batch cost of stoker on page-cached HDF5.

What it measures (all numbers are medians over repeated passes):

* Throughput: one loader per file, batch_size 256 (--batch-size), shuffle on;
  the time from ``iter(loader)`` to the last batch of an epoch (or of
  --batches batches), as samples/s and MB/s of sample data delivered.
  The loop body does nothing with the batch: this is the rate at which the
  daemon delivers batches to one Python process.
* Python-side cost per batch: the ring (depth 8) is given 1 s to fill, then
  each ``b = next(it)`` is timed on its own (fetching the next batch and
  dropping the previous one, i.e. what an empty ``for b in loader: pass``
  body costs per iteration) for the batches that were already waiting.
  For scale, ``np.copyto`` of one batch's bytes is timed in the same run.

The data: one file of 16 KiB samples ([N, 4096] f32) and one of 1 MiB samples
([N, 262144] f32), uncompressed and contiguous, about --gb GB in total,
generated in --dir if missing and read once before measuring so they sit in
the page cache.

    python benches/hdf5_throughput.py              # ~2 GB, writes docs/performance-hdf5-skeleton.md
    python benches/hdf5_throughput.py --quick      # ~64 MB smoke test, prints only
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import Daemon, machine_info, stoker_bin, warm_page_cache  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SIZES = {"16KiB": 4096, "1MiB": 262144}  # name -> f32 elements per sample
MB = 1e6


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=2.0, help="total dataset size in GB (default 2)")
    p.add_argument("--dir", default="/tmp/stoker-bench", help="where the HDF5 files live")
    p.add_argument("--batch-size", type=int, default=None, help="default 256 (8 with --quick)")
    p.add_argument("--batches", type=int, default=None, help="batches per pass (default: one epoch)")
    p.add_argument("--passes", type=int, default=3, help="throughput passes per size (median reported)")
    p.add_argument("--reps", type=int, default=7, help="repetitions of the per-batch cost measurement")
    p.add_argument("--depth", type=int, default=8, help="ring depth in the daemon config")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="daemon worker threads")
    p.add_argument("--stoker", default=None, help="stoker binary (default $STOKER_BIN or target/release/stoker)")
    p.add_argument("--out", default=None, help="markdown output (default docs/performance-hdf5-skeleton.md; none with --quick)")
    p.add_argument("--quick", action="store_true", help="~64 MB total, for smoke tests")
    a = p.parse_args()
    if a.batch_size is None:
        a.batch_size = 8 if a.quick else 256
    if a.quick:
        a.gb = 0.064
        a.passes = min(a.passes, 3)
        a.reps = min(a.reps, 3)
    if a.out is None and not a.quick:
        a.out = str(REPO / "docs" / "performance-hdf5-skeleton.md")
    return a


# ---------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------


def ensure_file(path: Path, n: int, elems: int) -> None:
    """[n, elems] f32, contiguous, uncompressed; rewritten if the shape differs."""
    if path.exists():
        try:
            with h5py.File(path, "r") as f:
                if f["x"].shape == (n, elems) and f["x"].chunks is None:
                    return
        except (OSError, KeyError):
            pass
    print(f"writing {path} ({n} x {elems * 4} B)", file=sys.stderr)
    rng = np.random.default_rng(0)
    rows = max(1, (64 << 20) // (elems * 4))
    tmp = path.with_suffix(".tmp")
    with h5py.File(tmp, "w") as f:
        ds = f.create_dataset("x", shape=(n, elems), dtype="<f4")  # contiguous by default
        for i in range(0, n, rows):
            k = min(rows, n - i)
            ds[i : i + k] = rng.standard_normal((k, elems), dtype=np.float32)
    tmp.rename(path)


# ---------------------------------------------------------------------------
# Daemon
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------


def throughput(stoker, spec, sample_bytes: int, a: argparse.Namespace, sock: str) -> dict[str, float]:
    loader = stoker.Loader(spec, batch_size=a.batch_size, shuffle=True, seed=0, socket=sock)
    limit = a.batches or len(loader)
    rates = []
    for p in range(a.passes):
        loader.set_epoch(p)
        samples = 0
        batch = None
        t0 = time.perf_counter()
        for i, batch in enumerate(loader):
            samples += len(batch["x"])
            if i + 1 >= limit:
                break
        dt = time.perf_counter() - t0
        del batch
        rates.append(samples / dt)
    loader.close()
    sps = statistics.median(rates)
    return {"batches": limit, "samples_per_s": sps, "mb_per_s": sps * sample_bytes / MB}


def per_batch_cost(stoker, spec, sample_bytes: int, a: argparse.Namespace, sock: str) -> dict[str, float]:
    loader = stoker.Loader(spec, batch_size=a.batch_size, shuffle=True, seed=0, socket=sock)
    # Batches that can be waiting when the loop starts: every slot, but not
    # past the end of the epoch; the first is not timed (see below).
    waiting = min(a.depth, len(loader))
    times_ns: list[int] = []
    rep_medians = []
    for rep in range(a.reps):
        loader.set_epoch(1000 + rep)
        it = iter(loader)
        b = next(it)  # the first next() of an epoch may wait for the stream to start
        time.sleep(1.0)  # let the ring fill
        rep_times = []
        for _ in range(waiting - 1):
            t0 = time.perf_counter_ns()
            b = next(it)  # fetch the next batch + drop the previous one
            rep_times.append(time.perf_counter_ns() - t0)
        del b, it
        times_ns += rep_times
        if rep_times:
            rep_medians.append(statistics.median(rep_times))
    batch_bytes = a.batch_size * sample_bytes
    src = np.random.default_rng(0).standard_normal(batch_bytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    copies = []
    for _ in range(max(5, a.reps)):
        t0 = time.perf_counter_ns()
        np.copyto(dst, src)
        copies.append(time.perf_counter_ns() - t0)
    loader.close()
    return {
        "timed": len(times_ns),
        "next_us": statistics.median(times_ns) / 1e3 if times_ns else float("nan"),
        "next_us_min": min(times_ns) / 1e3 if times_ns else float("nan"),
        "next_us_max": max(times_ns) / 1e3 if times_ns else float("nan"),
        "copy_us": statistics.median(copies) / 1e3,
        "batch_mb": batch_bytes / MB,
    }


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------


def render(a: argparse.Namespace, info: dict[str, str], files: dict[str, tuple[Path, int]],
           tp: dict[str, dict], cost: dict[str, dict], version: str) -> str:
    cmd = "python " + " ".join(shlex.quote(x) for x in [os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]])
    lines = [
        "# HDF5 throughput (skeleton)",
        "",
        f"Command: `{cmd}`",
        "",
        f"Machine: {info['nproc']} CPUs ({info['cpu']}), {info['memory']} RAM, Linux {info['kernel']}; "
        f"Python {info['python']}, numpy {info['numpy']}, h5py {info['h5py']}; `stoker --version`: {version}.",
        f"Daemon: {a.threads} worker threads, ring depth {a.depth}. Data: uncompressed contiguous f32 "
        "HDF5, in the page cache (read once before measuring).",
        "",
        "## Throughput (one Python process, empty loop body)",
        "",
        f"batch_size {a.batch_size}, shuffle=True; median of {a.passes} passes, each timed from `iter()` "
        "to the last batch. MB = 10^6 bytes of sample data delivered.",
        "",
        "| sample size | samples in file | file size | batches per pass | samples/s | MB/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, (path, n) in files.items():
        r = tp[name]
        lines.append(
            f"| {name} | {n} | {path.stat().st_size / MB:.0f} MB | {r['batches']} | "
            f"{r['samples_per_s']:,.0f} | {r['mb_per_s']:,.0f} |"
        )
    lines += [
        "",
        "## Python-side cost per batch (batches already waiting)",
        "",
        f"Ring depth {a.depth}, 1 s to fill; each `b = next(it)` timed alone (fetch the next batch, "
        f"drop the previous one) for the batches that were waiting; median of all nexts timed over {a.reps} repetitions. "
        "`np.copyto` of one batch's bytes in the same run, for scale.",
        "",
        "| sample size | batch | batch bytes | nexts timed | median µs/batch | min–max µs | np.copyto of one batch, µs |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in files:
        c = cost[name]
        lines.append(
            f"| {name} | {a.batch_size} | {c['batch_mb']:.1f} MB | {c['timed']} | {c['next_us']:.1f} | "
            f"{c['next_us_min']:.1f}–{c['next_us_max']:.1f} | {c['copy_us']:,.0f} |"
        )
    lines.append("")
    return "\n".join(lines)


def main() -> int:
    a = parse_args()
    binary = stoker_bin(a.stoker)
    try:
        import stoker
    except ImportError as e:
        sys.exit(f"cannot import stoker ({e}); build the Python package first")

    root = Path(a.dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    half = a.gb * 1e9 / 2
    files: dict[str, tuple[Path, int]] = {}
    for name, elems in SIZES.items():
        n = max(1, int(half // (elems * 4)))
        path = root / f"{name}-{n}.h5"
        ensure_file(path, n, elems)
        files[name] = (path, n)
    for path, _ in files.values():
        warm_page_cache(path)

    version = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout.strip() or "unknown"
    workdir = Path(tempfile.mkdtemp(prefix="stoker-bench-"))
    daemon = Daemon(binary, workdir, root, threads=a.threads, depth=a.depth)
    tp, cost = {}, {}
    try:
        for name, (path, _) in files.items():
            spec = stoker.hdf5(str(path), fields={"x": "x"})
            sample_bytes = SIZES[name] * 4
            tp[name] = throughput(stoker, spec, sample_bytes, a, daemon.socket)
            print(f"{name}: {tp[name]['samples_per_s']:,.0f} samples/s, {tp[name]['mb_per_s']:,.0f} MB/s",
                  file=sys.stderr)
            cost[name] = per_batch_cost(stoker, spec, sample_bytes, a, daemon.socket)
            print(f"{name}: next() {cost[name]['next_us']:.1f} µs/batch, copy {cost[name]['copy_us']:.0f} µs",
                  file=sys.stderr)
    finally:
        daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    report = render(a, machine_info(), files, tp, cost, version)
    print(report)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(report)
        print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
