#!/usr/bin/env python3
"""Host→GPU bandwidth from stoker's ring against PyTorch's usual paths.

Needs a CUDA GPU (exits with a message elsewhere). One daemon serves one
uncompressed uint8 HDF5 field of 1 MiB rows (in the page cache); for batches
of 1, 4, 16, 64 and 256 MiB it reports GB/s (10^9 bytes/s) of:

- ``ring, registered``: stoker's ``device=`` path: the ring registered
  read-only once, ``tensor.to(device, non_blocking=True)`` straight from the
  slot on a side stream;
- ``ring, staging``: the fallback: one host copy into a pinned buffer, then the
  same asynchronous copy;
- ``pin_memory()``: ``torch.from_numpy(batch).pin_memory().to(device,
  non_blocking=True)`` (what DataLoader's ``pin_memory=True`` pays: a copy into
  pinned memory, then the transfer);
- ``pageable``: ``torch.from_numpy(batch).to(device)``.

Each figure is bytes over the wall time from having the host batch to the
device copy having completed (``torch.cuda.synchronize``), the median of the
timed batches (the first of each size is not timed); taking the batch from
the daemon is not timed. ``copy only`` is the device copy alone for the
registered ring (CUDA events on the copy stream). Last, the time to register
and unregister a ring of 4 slots of each size (``cuMemHostRegister`` with
``CU_MEMHOSTREGISTER_READ_ONLY``).

    python benches/gpu_upload.py                    # prints the table
    python benches/gpu_upload.py --out docs/performance-gpu.md
    python benches/gpu_upload.py --sizes 1,16 --batches 4   # quick
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import Daemon, machine_info, stoker_bin, warm_page_cache  # noqa: E402

MIB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,4,16,64,256", help="batch sizes in MiB")
    ap.add_argument("--batches", type=int, default=12, help="timed batches per size and path")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--stoker", help="stoker binary (default $STOKER_BIN or target/release/stoker)")
    ap.add_argument("--out", help="also write the table (markdown) here")
    args = ap.parse_args()

    try:
        import torch
    except ImportError:
        sys.exit("gpu_upload.py needs PyTorch with CUDA (pip install torch); nothing measured")
    if not torch.cuda.is_available():
        sys.exit(
            f"gpu_upload.py needs a CUDA GPU, and torch.cuda.is_available() is False here (torch "
            f"{torch.__version__}, CUDA {torch.version.cuda}); run it on a GPU node. Nothing measured."
        )
    import h5py
    import numpy as np

    import stoker
    from stoker import _cuda

    sizes = [int(s) for s in args.sizes.split(",")]
    binary = stoker_bin(args.stoker)
    device = torch.device(args.device)
    rows_total = max(sizes) * 2
    rows: list[str] = []
    with tempfile.TemporaryDirectory(prefix="stoker-gpu-") as tmp:
        root = Path(tmp)
        path = root / "data" / "rows.h5"
        path.parent.mkdir()
        with h5py.File(path, "w") as f:
            ds = f.create_dataset("x", shape=(rows_total, MIB), dtype="u1")
            block = np.random.default_rng(0).integers(0, 255, size=(16, MIB), dtype=np.uint8)
            for i in range(0, rows_total, 16):
                ds[i : i + 16] = block[: min(16, rows_total - i)]
        warm_page_cache(path)
        daemon = Daemon(binary, root / "d", root / "data", threads=4, depth=4)
        try:
            for size in sizes:
                rows.append(measure(stoker, _cuda, torch, device, daemon.socket, path, size, args.batches))
                print(rows[-1], flush=True)
        finally:
            daemon.stop()

    info = machine_info()
    table = "\n".join(
        [
            f"GPU: {torch.cuda.get_device_name(device)}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
            + ", ".join(f"{k}: {v}" for k, v in info.items()),
            "",
            "| batch | ring, registered | copy only | ring, staging | pin_memory() | pageable | register 4 slots |",
            "| --- | --- | --- | --- | --- | --- | --- |",
            *rows,
            "",
            "GB/s = 10^9 bytes/s, medians; `python benches/gpu_upload.py`",
        ]
    )
    print()
    print(table)
    if args.out:
        Path(args.out).write_text("# Host→GPU upload\n\nWritten by `benches/gpu_upload.py`.\n\n" + table + "\n")


def measure(stoker, _cuda, torch, device, socket, path, size: int, batches: int) -> str:
    spec = stoker.hdf5(str(path), fields={"x": "x"})
    loader = stoker.Loader(spec, batch_size=size, shuffle=False, socket=socket)
    nbytes = size * MIB

    def host_batches():
        while True:
            for b in loader:
                yield b

    gen = host_batches()

    def wall(fn) -> float:
        times = []
        for i in range(batches + 1):
            batch = next(gen)
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn(batch)
            torch.cuda.synchronize(device)
            if i:
                times.append(time.perf_counter() - t0)
            del batch
        return nbytes / statistics.median(times) / 1e9

    results = {}
    copy_only = []
    for mode in ("registered", "staging"):
        up = _cuda.Uploader(str(device), mode="auto" if mode == "registered" else "staging")

        def via_ring(batch, up=up):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(up.stream)
            up.upload(loader._native(), batch)
            end.record(up.stream)
            up.reap(keep=0)
            if up.mode == "registered":
                copy_only.append(start.elapsed_time(end) / 1e3)

        results[mode] = wall(via_ring) if up.mode == mode else float("nan")
        up.close()
    results["pinned"] = wall(lambda b: torch.from_numpy(b["x"]).pin_memory().to(device, non_blocking=True))
    results["pageable"] = wall(lambda b: torch.from_numpy(b["x"]).to(device))

    # Registration of a fresh ring of 4 slots of this size.
    ring = stoker.Loader(spec, batch_size=size, shuffle=False, socket=socket)
    start, length = ring._mapping_range()
    driver = _cuda._Driver(device.index or 0)
    t0 = time.perf_counter()
    code = driver.register_read_only(start, length)
    reg = time.perf_counter() - t0
    if code == 0:
        t0 = time.perf_counter()
        driver.unregister(start)
        unreg = time.perf_counter() - t0
        register = f"{reg * 1e3:.1f} ms (+{unreg * 1e3:.1f} ms to unregister), {length / MIB:.0f} MiB"
    else:
        register = f"refused (error {code})"
    ring.close()
    loader.close()
    copy = f"{nbytes / statistics.median(copy_only) / 1e9:.1f}" if copy_only else "n/a"
    fmt = lambda v: "n/a" if v != v else f"{v:.1f}"  # noqa: E731
    return (
        f"| {size} MiB | {fmt(results['registered'])} | {copy} | {fmt(results['staging'])} | "
        f"{fmt(results['pinned'])} | {fmt(results['pageable'])} | {register} |"
    )


if __name__ == "__main__":
    main()
