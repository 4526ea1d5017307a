"""Latency of one metrics scrape (`GET /metrics`) with N streams open.

Starts the release daemon with `[metrics] listen` on a free port, opens N
streams (one Loader each, each holding a batch so its ring is busy) on an
HDF5 dataset written here, then times `--scrapes` scrapes over HTTP with
urllib (connect, request, render, transfer) and prints the median and p90.

    .venv/bin/python benches/metrics_scrape.py --streams 16 --scrapes 50
"""

from __future__ import annotations

import argparse
import socket
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import h5py
import numpy as np

from benchlib import Daemon, machine_info, stoker_bin


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--scrapes", type=int, default=50)
    ap.add_argument("--stoker", help="stoker binary (default: target/release/stoker)")
    args = ap.parse_args()

    import stoker

    with tempfile.TemporaryDirectory(prefix="stk-bench-") as tmp:
        root = Path(tmp)
        data = root / "data"
        data.mkdir()
        for i in range(4):
            with h5py.File(data / f"part-{i}.h5", "w") as f:
                f.create_dataset("x", data=np.zeros((1000, 64), dtype=np.float32))
                f.create_dataset("y", data=np.arange(1000, dtype=np.int64))
        port = free_port()
        extra = f'[metrics]\nlisten = "127.0.0.1:{port}"\n'
        with Daemon(stoker_bin(args.stoker), root / "daemon", data, threads=2, depth=4, extra=extra) as daemon:
            spec = stoker.hdf5(str(data / "*.h5"), fields={"x": "x", "y": "y"})
            loaders, held = [], []
            for rank in range(args.streams):
                loader = stoker.Loader(spec, batch_size=32, rank=rank, world_size=args.streams, socket=daemon.socket)
                loaders.append(loader)
                held.append(next(iter(loader)))
            url = f"http://127.0.0.1:{port}/metrics"
            with urllib.request.urlopen(url, timeout=30) as resp:
                body = resp.read()
            series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
            times = []
            for _ in range(args.scrapes):
                t0 = time.perf_counter()
                with urllib.request.urlopen(url, timeout=30) as resp:
                    resp.read()
                times.append(time.perf_counter() - t0)
            del held
            for loader in loaders:
                loader.close()

    times.sort()
    p90 = times[min(len(times) - 1, int(0.9 * len(times)))]
    info = machine_info()
    print(f"machine: {info}")
    print(f"| streams | scrapes | series | bytes | median ms | p90 ms |")
    print(f"|--------:|--------:|-------:|------:|----------:|-------:|")
    print(
        f"| {args.streams} | {args.scrapes} | {series} | {len(body)} | "
        f"{statistics.median(times) * 1e3:.2f} | {p90 * 1e3:.2f} |"
    )


if __name__ == "__main__":
    main()
