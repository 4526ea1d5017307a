#!/usr/bin/env python3
"""The cost of taking a batch from stoker once it is waiting, of writing to it
(copy-on-write) and of holding more batches than the ring's depth (segment
grow). Not part of the test suite; a few minutes on a 2-core machine.

What it measures (one daemon, one Python process, HDF5 in the page cache):

1. ``next()`` with the batch already waiting, for 64 KiB, 1 MiB, 8 MiB and
   64 MiB batches of one uint8 field (``[batch, 65536]`` rows of an
   uncompressed contiguous dataset, so a batch is exactly that many bytes).
   Each iteration: drop the previous batch, sleep long enough for the daemon
   to refill the slot, then time ``b = next(it)`` alone
   (``time.perf_counter_ns``; the drop is timed separately, as "release").
   The first ``next()`` after each ``iter()`` is not timed. Baseline: one
   ``np.copyto`` of the same number of bytes between two preallocated,
   already-touched arrays (the least a copying loader pays per batch). The
   same loop again with ``output="torch"``.
2. Copy-on-write: on a fresh batch (1 MiB and 64 MiB), time touching one
   byte per 4 KiB page for reading (``flat[::4096].sum()``) versus for
   writing (``flat[::4096] = 1``: one private page copy per page), and the
   release that follows each; then a full read (``np.copyto`` into a
   preallocated buffer) of a fresh batch versus a second full read of the
   same batch (the slot's page-table entries were dropped when it was last
   released, so the first read faults them back in).
3. Segment grow: hold N batches of 1 MiB (N = 2x, 8x, 32x the depth), timing
   every ``next()``; past the depth each one grows the ring by a one-slot
   segment (memfd, fill, socket round trip, mmap). For scale, ``next()``
   within the depth and ``next()`` in a loop that consumes as fast as it can
   (each batch waits for its fill: the steady-state per-batch time).

4. (--read-loop only) MB/s of an epoch loop over 1 MiB and 8 MiB batches,
   empty and copying each batch into one preallocated buffer; numpy output
   only, so a client from before the handoff change runs it too (A/B).

    python benches/handoff.py                 # writes docs/performance-handoff.md (keeps its hand-written part)
    python benches/handoff.py --read-loop --stoker OLD/stoker   # with OLD's virtualenv python
    python benches/handoff.py --quick --out - # smoke test, prints only
"""

from __future__ import annotations

import argparse
import gc
import math
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
ROW = 64 << 10  # bytes per sample (one uint8 row)
KiB, MiB = 1 << 10, 1 << 20
PAGE = 4096
MARKER = "<!-- Everything below this line is written by hand; benches/handoff.py keeps it. -->"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="/tmp/stoker-bench-handoff", help="where the HDF5 file lives")
    p.add_argument("--sizes", default="64K,1M,8M,64M", help="batch sizes for part 1 (K/M = KiB/MiB)")
    p.add_argument("--nexts", type=int, default=200, help="timed next() per size and output (part 1)")
    p.add_argument("--fill-rate", type=float, default=500.0,
                   help="MB/s assumed for the daemon's refill; the sleep before each timed next() is "
                        "batch bytes at this rate + 2 ms (default 500)")
    p.add_argument("--cow-reps", type=int, default=20, help="fresh batches per measurement in part 2")
    p.add_argument("--grow-reps", type=int, default=3, help="repetitions of each hold count in part 3")
    p.add_argument("--depth", type=int, default=4, help="[ring] depth")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="daemon worker threads")
    p.add_argument("--no-torch", action="store_true", help="skip the output='torch' loop")
    p.add_argument("--stoker", default=None, help="stoker binary (default $STOKER_BIN or target/release/stoker)")
    p.add_argument("--out", default=None, help="markdown output (default docs/performance-handoff.md; '-' prints only)")
    p.add_argument("--read-loop", action="store_true",
                   help="only part 4 (reading loop MB/s, 1 MiB and 8 MiB batches; numpy output, so older "
                        "clients run it too), printed as one line of JSON")
    p.add_argument("--read-passes", type=int, default=5, help="epochs per body in part 4")
    p.add_argument("--quick", action="store_true", help="few iterations, smaller sizes (smoke test)")
    a = p.parse_args()
    a.sizes = [parse_size(s) for s in a.sizes.split(",")]
    if a.quick:
        a.sizes = [s for s in a.sizes if s <= 8 * MiB] or [64 * KiB]
        a.nexts, a.cow_reps, a.grow_reps = 20, 3, 1
    if a.out is None:
        a.out = "-" if a.quick else str(REPO / "docs" / "performance-handoff.md")
    return a


def parse_size(s: str) -> int:
    s = s.strip().upper().rstrip("IB")
    mult = {"K": KiB, "M": MiB}.get(s[-1:], 1)
    n = int(s[:-1] if s[-1:] in "KM" else s) * mult
    if n % ROW:
        sys.exit(f"batch size {s} is not a multiple of {ROW} bytes")
    return n


def human(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def stats_us(ns: list[int]) -> dict[str, float]:
    """Median and p99 (nearest rank) in µs."""
    s = sorted(ns)
    p99 = s[min(len(s) - 1, max(0, math.ceil(0.99 * len(s)) - 1))]
    return {"n": len(s), "median": statistics.median(s) / 1e3, "p99": p99 / 1e3, "max": s[-1] / 1e3}


# ---------------------------------------------------------------------------
# Data and daemon
# ---------------------------------------------------------------------------


def ensure_file(path: Path, rows: int) -> None:
    """[rows, ROW] uint8, contiguous, uncompressed."""
    if path.exists():
        try:
            with h5py.File(path, "r") as f:
                if f["x"].shape == (rows, ROW) and f["x"].chunks is None and f["x"].dtype == np.uint8:
                    return
        except (OSError, KeyError):
            pass
    print(f"writing {path} ({rows} x {ROW} B)", file=sys.stderr)
    rng = np.random.default_rng(0)
    tmp = path.with_suffix(".tmp")
    with h5py.File(tmp, "w") as f:
        ds = f.create_dataset("x", shape=(rows, ROW), dtype=np.uint8)  # contiguous by default
        step = (64 * MiB) // ROW
        for i in range(0, rows, step):
            k = min(step, rows - i)
            ds[i : i + k] = rng.integers(0, 256, size=(k, ROW), dtype=np.uint8)
    tmp.rename(path)


class Stream:
    """An iterator over epochs of one loader that restarts at each epoch's end
    and says whether a batch was the first after an ``iter()``."""

    def __init__(self, stoker, spec, batch: int, sock: str, output: str = "numpy") -> None:
        self.loader = stoker.Loader(spec, batch_size=batch // ROW, shuffle=False, socket=sock, output=output)
        self.epoch = 0
        self.loader.set_epoch(0)
        self.it = iter(self.loader)
        self.fresh = True

    def timed_next(self):
        """(batch, ns, first-after-iter); the restart at an epoch's end is not timed."""
        while True:
            t0 = time.perf_counter_ns()
            try:
                b = next(self.it)
            except StopIteration:
                self.epoch += 1
                self.loader.set_epoch(self.epoch)
                self.it = iter(self.loader)
                self.fresh = True
                continue
            dt = time.perf_counter_ns() - t0
            first, self.fresh = self.fresh, False
            return b, dt, first

    def close(self) -> None:
        self.it = None
        self.loader.close()


# ---------------------------------------------------------------------------
# 1. next() with the batch waiting, vs np.copyto
# ---------------------------------------------------------------------------


def part_next(stoker, spec, sock: str, size: int, a, output: str) -> dict:
    """Cycles of: sleep until the ring is full again, then take `depth` waiting
    batches one after another, dropping each before the next. The first
    next() of a cycle runs after the sleep ("after a sleep"); the others run
    straight after the previous next() and drop ("back-to-back")."""
    s = Stream(stoker, spec, size, sock, output)
    refill = a.depth * size / (a.fill_rate * 1e6) + 0.002
    cold, warm, releases = [], [], []
    want = a.nexts if size <= 8 * MiB else a.nexts // 2
    b, _, _ = s.timed_next()
    t0 = time.perf_counter_ns()
    del b
    releases.append(time.perf_counter_ns() - t0)
    while len(warm) < want:
        time.sleep(refill)
        for i in range(a.depth):
            b, dt, first = s.timed_next()
            if not first:
                (cold if i == 0 else warm).append(dt)
            t0 = time.perf_counter_ns()
            del b  # the last reference: the slot goes back
            releases.append(time.perf_counter_ns() - t0)
    s.close()
    return {"cold": stats_us(cold), "warm": stats_us(warm), "release": stats_us(releases),
            "refill_ms": refill * 1e3}


def part_copy(size: int, reps: int, sleep: float) -> dict:
    """np.copyto of `size` bytes between preallocated, touched arrays: after
    the same sleep as part_next's first next(), and back-to-back."""
    src = np.random.default_rng(0).integers(0, 256, size=size, dtype=np.uint8)
    dst = np.empty_like(src)
    dst.fill(0)
    cold, warm = [], []
    for _ in range(reps):
        time.sleep(sleep)
        t0 = time.perf_counter_ns()
        np.copyto(dst, src)
        t1 = time.perf_counter_ns()
        np.copyto(dst, src)
        t2 = time.perf_counter_ns()
        cold.append(t1 - t0)
        warm.append(t2 - t1)
    return {"cold": stats_us(cold), "warm": stats_us(warm)}


def part_floor(reps: int, sleep: float) -> dict:
    """What waking up costs here: a numpy view of 1 MiB wrapped in a dict (about
    the Python-side work of a next()), after the same sleep and back-to-back."""
    buf = bytearray(MiB)
    cold, warm = [], []
    for _ in range(reps):
        time.sleep(sleep)
        t0 = time.perf_counter_ns()
        d = {"x": np.frombuffer(buf, dtype=np.uint8).reshape(16, ROW)}
        t1 = time.perf_counter_ns()
        d = {"x": np.frombuffer(buf, dtype=np.uint8).reshape(16, ROW)}
        t2 = time.perf_counter_ns()
        cold.append(t1 - t0)
        warm.append(t2 - t1)
    del d
    return {"cold": stats_us(cold), "warm": stats_us(warm)}


# ---------------------------------------------------------------------------
# 2. copy-on-write
# ---------------------------------------------------------------------------


def part_cow(stoker, spec, sock: str, size: int, a) -> dict:
    s = Stream(stoker, spec, size, sock)
    refill = size / (a.fill_rate * 1e6) + 0.002
    dst = np.empty(size, dtype=np.uint8)
    dst.fill(0)
    out: dict[str, list[int]] = {k: [] for k in
                                 ("touch_read", "release_after_read", "touch_write", "release_after_write",
                                  "full_read_first", "full_read_second", "release_after_full_read")}
    b, _, _ = s.timed_next()
    for _ in range(a.cow_reps):
        for mode in ("read", "write", "full"):
            del b
            time.sleep(refill)
            b, _, _ = s.timed_next()
            flat = b["x"].reshape(-1)
            assert flat.nbytes == size and flat.flags.writeable
            if mode == "read":
                t0 = time.perf_counter_ns()
                flat[::PAGE].sum()
                out["touch_read"].append(time.perf_counter_ns() - t0)
            elif mode == "write":
                t0 = time.perf_counter_ns()
                flat[::PAGE] = 1
                out["touch_write"].append(time.perf_counter_ns() - t0)
            else:
                t0 = time.perf_counter_ns()
                np.copyto(dst, flat)
                t1 = time.perf_counter_ns()
                np.copyto(dst, flat)
                t2 = time.perf_counter_ns()
                out["full_read_first"].append(t1 - t0)
                out["full_read_second"].append(t2 - t1)
            del flat
            key = {"read": "release_after_read", "write": "release_after_write",
                   "full": "release_after_full_read"}[mode]
            t0 = time.perf_counter_ns()
            del b  # the last reference: the slot goes back
            out[key].append(time.perf_counter_ns() - t0)
            b = None
    s.close()
    return {k: stats_us(v) for k, v in out.items()}


# ---------------------------------------------------------------------------
# 3. segment grow
# ---------------------------------------------------------------------------


def part_grow(stoker, spec, sock: str, size: int, a) -> dict:
    within, past, release_all = [], [], []
    per_n: dict[int, dict] = {}
    for mult in (2, 8, 32):
        n = mult * a.depth
        past_n = []
        for _ in range(a.grow_reps):
            s = Stream(stoker, spec, size, sock)
            if len(s.loader) < n + 1:
                sys.exit(f"the file has {len(s.loader)} batches of {human(size)}; part 3 needs {n + 1}")
            b, _, _ = s.timed_next()  # stream started
            del b
            time.sleep(0.2 + a.depth * size / (a.fill_rate * 1e6))  # ring full
            held = []
            for i in range(n):
                b, dt, first = s.timed_next()
                held.append(b)
                if first:
                    continue
                (within if i < a.depth else past_n).append(dt)
            del b
            t0 = time.perf_counter_ns()
            held.clear()
            release_all.append((time.perf_counter_ns() - t0) / n)
            s.close()
            time.sleep(0.1)
        per_n[n] = stats_us(past_n)
        past += past_n
    # Steady state: consume as fast as possible, nothing held; each next waits for its fill.
    s = Stream(stoker, spec, size, sock)
    b, _, _ = s.timed_next()
    drain = []
    for _ in range(8 * a.depth):
        del b
        b, dt, first = s.timed_next()
        if not first:
            drain.append(dt)
    del b
    s.close()
    return {"within": stats_us(within), "past": per_n, "drain": stats_us(drain),
            "release_per_batch": stats_us([int(x) for x in release_all])}


# ---------------------------------------------------------------------------
# 4. reading loop (runs on older clients too: --read-loop)
# ---------------------------------------------------------------------------


def part_read(stoker, spec, sock: str, size: int, passes: int) -> dict:
    """Epochs/s of a loop that copies every batch into one preallocated buffer
    (what staging into pinned memory for `.to("cuda")` does), and of an empty
    loop, as MB/s of batch bytes; median of `passes` epochs each."""
    loader = stoker.Loader(spec, batch_size=size // ROW, shuffle=False, socket=sock)
    dst = np.empty(size, dtype=np.uint8)
    dst.fill(0)
    out = {}
    for body in ("empty", "copyto"):
        rates = []
        for p in range(passes + 1):
            loader.set_epoch(p)
            n, t0 = 0, time.perf_counter()
            for b in loader:
                if body == "copyto":
                    np.copyto(dst, b["x"].reshape(-1))
                n += b["x"].nbytes
            del b
            if p:  # the first epoch warms up
                rates.append(n / (time.perf_counter() - t0) / 1e6)
        out[body] = {"median": statistics.median(rates), "runs": rates}
    loader.close()
    return out


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------


def render(a, info, version, rows, load0, load1, res) -> str:
    cmd = "python " + " ".join(shlex.quote(x) for x in [os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]])
    L = [
        "# Batch handoff: next(), copy-on-write, segment grow",
        "",
        f"Command: `{cmd}` (written by `benches/handoff.py`; see its docstring for the method).",
        "",
        f"Machine: {info['nproc']} CPUs ({info['cpu']}), {info['memory']} RAM, Linux {info['kernel']}; "
        f"Python {info['python']}, numpy {info['numpy']}, h5py {info['h5py']}, torch {info.get('torch', '-')}; "
        f"`stoker --version`: {version}. Load average {load0:.2f} at the start, {load1:.2f} at the end "
        "(the machine is shared; other work runs on it).",
        f"Daemon: {a.threads} worker threads, `[ring] depth = {a.depth}`, `[cache] chunk_bytes` 1 GiB. "
        f"Data: one HDF5 dataset `[{rows}, {ROW}]` uint8, uncompressed, contiguous, written by h5py, "
        "read once before measuring (page cache); `shuffle=False`; batch = batch_size rows of 64 KiB.",
        "All times in µs; p99 is nearest-rank over the n timed calls.",
        "",
        "## 1. `next()` with the batch already waiting",
        "",
        f"Cycles: sleep until the daemon has refilled the whole ring (depth × batch bytes / {a.fill_rate:.0f} MB/s "
        "+ 2 ms), then take the `depth` waiting batches one after another, dropping each (\"release\", timed "
        "apart) before the next. *Back-to-back*: the 2nd to last `next()` of a cycle; *after a sleep*: the first. "
        "`np.copyto`: the same bytes between two preallocated, touched arrays, also back-to-back and after the "
        "same sleep. copyto / next compares medians, back-to-back.",
        "",
        "| batch | output | n | next() median | next() p99 | after a sleep: median | p99 "
        "| release median | release p99 | np.copyto median | np.copyto p99 | copyto after a sleep | copyto / next |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for size, by_out in res["next"].items():
        c = res["copy"][size]
        for output, r in by_out.items():
            w, k, rel = r["warm"], r["cold"], r["release"]
            L.append(
                f"| {human(size)} | {output} | {w['n']} | **{w['median']:.1f}** | **{w['p99']:.1f}** | "
                f"{k['median']:.1f} | {k['p99']:.1f} | {rel['median']:.1f} | {rel['p99']:.1f} | "
                f"{c['warm']['median']:,.1f} | {c['warm']['p99']:,.1f} | {c['cold']['median']:,.1f} | "
                f"{c['warm']['median'] / w['median']:,.1f}× |"
            )
    f = res["floor"]
    L += [
        "",
        f"For scale, what waking up costs on this machine: building `{{\"x\": np.frombuffer(buf).reshape(16, 65536)}}` "
        f"(about the Python-side work of a `next()`) takes {f['warm']['median']:.1f} µs median back-to-back and "
        f"{f['cold']['median']:.1f} µs (p99 {f['cold']['p99']:.1f}) right after a 10 ms sleep (n = {f['cold']['n']}).",
    ]
    L += [
        "",
        "## 2. Copy-on-write",
        "",
        f"{a.cow_reps} fresh batches per row. \"touch\": one byte per 4 KiB page; read = "
        "`flat[::4096].sum()`, write = `flat[::4096] = 1` (a private copy of every page). "
        "\"full read\": `np.copyto` of the whole batch into a preallocated buffer, first on the fresh batch "
        "(page-table entries dropped at the slot's last release, so it faults them in), then again. "
        "Release: dropping the batch after it (MADV_DONTNEED of the slot, then the slot goes back).",
        "",
        "| batch | touch read | touch write | release after read | release after write "
        "| full read, first | full read, second | release after full read |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for size, r in res["cow"].items():
        def f(k: str) -> str:
            return f"{r[k]['median']:,.0f} (p99 {r[k]['p99']:,.0f})"
        L.append(
            f"| {human(size)} | {f('touch_read')} | {f('touch_write')} | {f('release_after_read')} | "
            f"{f('release_after_write')} | {f('full_read_first')} | {f('full_read_second')} | "
            f"{f('release_after_full_read')} |"
        )
    g = res["grow"]
    L += [
        "",
        "## 3. Segment grow",
        "",
        f"1 MiB batches, depth {a.depth}; hold N batches (every one kept), {a.grow_reps} repetitions per N, "
        "after the ring was given time to fill. Past the depth, each `next()` waits for the daemon to grow "
        "the ring by a one-slot segment, fill it, and for the client to fetch and map it. "
        "For scale: `next()` within the depth (waiting batches), and `next()` in a loop that holds nothing "
        "and consumes as fast as it can (each waits for a fill: the daemon's steady-state time per batch).",
        "",
        "| what | n | median | p99 |",
        "| --- | ---: | ---: | ---: |",
        f"| next() within the depth | {g['within']['n']} | {g['within']['median']:.1f} | {g['within']['p99']:.1f} |",
    ]
    for n, r in g["past"].items():
        L.append(f"| next() past the depth, holding up to {n} | {r['n']} | {r['median']:,.1f} | {r['p99']:,.1f} |")
    L += [
        f"| next(), consuming as fast as possible (steady state) | {g['drain']['n']} | "
        f"{g['drain']['median']:,.1f} | {g['drain']['p99']:,.1f} |",
        f"| release of the held batches, per batch | {g['release_per_batch']['n']} | "
        f"{g['release_per_batch']['median']:,.1f} | {g['release_per_batch']['p99']:,.1f} |",
        "",
    ]
    return "\n".join(L)


def main() -> int:
    a = parse_args()
    binary = stoker_bin(a.stoker)
    import stoker

    root = Path(a.dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    # Enough rows for 4 batches of the largest size and for part 3 (32x depth + slack of 1 MiB batches).
    rows = max(8 * max(a.sizes), (32 * a.depth + 2 * a.depth) * MiB) // ROW
    path = root / f"u8-{rows}x{ROW}.h5"
    ensure_file(path, rows)
    warm_page_cache(path)
    spec = stoker.hdf5(str(path), fields={"x": "x"})
    outputs = ["numpy"] if a.no_torch else ["numpy", "torch"]
    if a.read_loop:
        import json

        workdir = Path(tempfile.mkdtemp(prefix="stoker-handoff-"))
        try:
            with Daemon(binary, workdir, root, threads=a.threads, depth=a.depth,
                        extra=f"[cache]\nchunk_bytes = {1 << 30}\n") as d:
                res4 = {human(size): part_read(stoker, spec, d.socket, size, a.read_passes) for size in (MiB, 8 * MiB)}
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        print(json.dumps(res4))
        return 0
    info = machine_info()
    if not a.no_torch:
        import torch

        info["torch"] = torch.__version__

    version = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout.strip() or "unknown"
    workdir = Path(tempfile.mkdtemp(prefix="stoker-handoff-"))
    extra = f"[cache]\nchunk_bytes = {1 << 30}\n"
    load0 = os.getloadavg()[0]
    res: dict = {"next": {}, "copy": {}, "cow": {}, "floor": {}}
    gc.disable()  # no collector pauses inside timed calls (batches are freed by refcount)
    try:
        with Daemon(binary, workdir, root, threads=a.threads, depth=a.depth, extra=extra) as d:
            for size in a.sizes:
                res["next"][size] = {}
                for output in outputs:
                    r = part_next(stoker, spec, d.socket, size, a, output)
                    res["next"][size][output] = r
                    print(f"{human(size)} {output}: next() back-to-back median {r['warm']['median']:.1f} "
                          f"p99 {r['warm']['p99']:.1f} µs; after a sleep median {r['cold']['median']:.1f} µs; "
                          f"release median {r['release']['median']:.1f} µs", file=sys.stderr)
                reps = a.nexts // 4 if size <= 8 * MiB else max(10, a.nexts // 20)
                res["copy"][size] = c = part_copy(size, reps, a.depth * size / (a.fill_rate * 1e6) + 0.002)
                print(f"{human(size)} np.copyto back-to-back median {c['warm']['median']:.1f} µs, "
                      f"after a sleep {c['cold']['median']:.1f} µs", file=sys.stderr)
            res["floor"] = part_floor(a.nexts // 4, 0.01)
            for size in ([MiB, 64 * MiB] if not a.quick else [MiB]):
                res["cow"][size] = part_cow(stoker, spec, d.socket, size, a)
                print(f"{human(size)} cow: " + ", ".join(f"{k} {v['median']:.0f}" for k, v in res["cow"][size].items()),
                      file=sys.stderr)
            res["grow"] = part_grow(stoker, spec, d.socket, MiB, a)
            print(f"grow: within {res['grow']['within']['median']:.1f} µs, past "
                  + ", ".join(f"{n}: {r['median']:.0f}" for n, r in res["grow"]["past"].items())
                  + f", drain {res['grow']['drain']['median']:.0f} µs", file=sys.stderr)
    finally:
        gc.enable()
        shutil.rmtree(workdir, ignore_errors=True)
    load1 = os.getloadavg()[0]

    report = render(a, info, version, rows, load0, load1, res)
    print(report)
    if a.out != "-":
        # Keep the hand-written analysis below the marker, if the file has one.
        out = Path(a.out)
        if out.exists() and MARKER in out.read_text():
            report += "\n" + MARKER + out.read_text().split(MARKER, 1)[1]
        out.write_text(report)
        print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
