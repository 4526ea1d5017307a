#!/usr/bin/env python3
"""A/B of LMDB read throughput between two `stoker` binaries: 2000 values of
256×256×3 uint8 (192 KiB) stored `raw` or as `.npy`, batches of 64, shuffled,
2 worker threads, page-cached; runs alternate between the binaries and the
median of --reps epochs is reported. Written to measure the value copy the
LMDB fault guard adds (docs/reliability.md).

    python benches/lmdb_copy_ab.py --before OLD/stoker --after target/release/stoker --codec raw
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lmdb
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import Daemon, warm_page_cache  # noqa: E402

N, SHAPE = 2000, (256, 256, 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", required=True)
    ap.add_argument("--codec", choices=["raw", "npy"], default="raw")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    import stoker

    root = Path(tempfile.mkdtemp(prefix="lmdb-ab-", dir="/tmp"))
    env_path = root / "env"
    rng = np.random.default_rng(0)
    env = lmdb.open(str(env_path), map_size=1 << 31)
    with env.begin(write=True) as txn:
        for i in range(N):
            a = rng.integers(0, 256, size=SHAPE, dtype=np.uint8)
            if args.codec == "npy":
                buf = io.BytesIO()
                np.save(buf, a)
                txn.put(f"{i:08d}".encode(), buf.getvalue())
            else:
                txn.put(f"{i:08d}".encode(), a.tobytes())
    env.close()
    warm_page_cache(env_path / "data.mdb")
    field = "npy" if args.codec == "npy" else {"codec": "raw", "dtype": "uint8", "shape": list(SHAPE)}
    rates: dict[str, list[float]] = {"before": [], "after": []}
    for rep in range(args.reps):
        for name, binary in (("before", args.before), ("after", args.after)):
            d = Daemon(binary, root / f"d-{name}-{rep}", root, threads=2, depth=4)
            loader = stoker.Loader(stoker.lmdb(env_path, fields={"img": field}), batch_size=64, socket=d.socket)
            loader.set_epoch(0)
            for _ in loader:
                pass
            loader.set_epoch(1)
            t0, n = time.perf_counter(), 0
            for b in loader:
                n += len(b["img"])
            rates[name].append(n / (time.perf_counter() - t0))
            loader.close()
            d.stop()
    print(f"| binary | {args.codec} samples/s (median of {args.reps}) | runs |")
    print("|---|---|---|")
    for name, r in rates.items():
        print(f"| {name} | {statistics.median(r):.0f} | {', '.join(f'{x:.0f}' for x in r)} |")


if __name__ == "__main__":
    main()
