#!/usr/bin/env python3
"""A mutation fuzzer of HDF5 files, through the real daemon.

Writes a small HDF5 file with h5py (a gzip-chunked float32 field, a
contiguous int64 field, an attribute), then for each case mutates it
(random bytes of the metadata, of anything, chunk dimensions set to hostile
values, filter parameters) and reads it through a running `stoker serve` as
an ad-hoc dataset: open, then up to four batches. Half the cases run on a
daemon with the fast path (Rust decoders), half with `[hdf5] fast_path =
false` (every read through libhdf5, in the HDF5 helper). Counted: cases,
outcomes (served, DatasetError, LimitError, anything else), HDF5 helper
deaths (crashes, timeouts) from the daemon's log, and daemon deaths. After
the cases a clean file must be served exactly by each daemon.

Exit status 1 when a daemon died, a case raised anything but a
stoker error, or the clean file was not served exactly.

    python benches/fuzz_hdf5.py --cases 2000           # prints the figures
    python benches/fuzz_hdf5.py --cases 300 --json     # one JSON object (the tests use this)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import Daemon, stoker_bin  # noqa: E402

ROWS = 64


def write_seed(path: Path) -> tuple[np.ndarray, np.ndarray]:
    x = np.arange(ROWS * 4, dtype=np.float32).reshape(ROWS, 4)
    y = np.arange(ROWS, dtype=np.int64) * 3
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=x, chunks=(16, 4), compression="gzip")
        f.create_dataset("y", data=y)
        f.attrs["note"] = "fuzz seed"
    return x, y


def mutate(seed: bytes, rng: random.Random) -> bytes:
    b = bytearray(seed)
    kind = rng.randrange(5)
    if kind == 0:  # a few random bytes of the metadata (the first 2 KiB)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(min(2048, len(b)))] = rng.randrange(256)
    elif kind == 1:  # a few random bytes anywhere
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif kind == 2:  # chunk dimensions (16, 4, element size 4) set to hostile values
        pat = (16).to_bytes(4, "little") + (4).to_bytes(4, "little") + (4).to_bytes(4, "little")
        at = b.find(pat)
        if at >= 0:
            which = rng.randrange(3)
            value = rng.choice([0, 1, 3, 2**16, 2**23 + 4, 2**31, 2**32 - 1, rng.randrange(2**32)])
            b[at + 4 * which : at + 4 * which + 4] = value.to_bytes(4, "little")
    elif kind == 3:  # a 32-bit word near a u32 that looks like a size or parameter
        at = rng.randrange(0, min(2048, len(b)) - 4)
        b[at : at + 4] = rng.choice([0, 1, 2**31, 2**32 - 1, rng.randrange(2**32)]).to_bytes(4, "little")
    else:  # truncation
        del b[rng.randrange(len(b) // 2, len(b)) :]
    return bytes(b)


def read_case(stoker, path: Path, socket: str) -> str:
    try:
        loader = stoker.Loader(
            stoker.hdf5(str(path), fields={"x": "x", "y": "y"}),
            batch_size=16,
            shuffle=False,
            socket=socket,
            timeout=120,
            reconnect=0,
        )
        for n, _ in enumerate(loader):
            if n >= 3:
                break
        loader.close()
        return "served"
    except stoker.LimitError:
        return "LimitError"
    except stoker.DatasetError:
        return "DatasetError"
    except stoker.DaemonUnavailable:
        return "DaemonUnavailable"
    except stoker.StokerError as e:
        return type(e).__name__


def run(cases: int, seed: int, binary: str, workdir: Path) -> dict:
    import stoker

    data = workdir / "data"
    data.mkdir(parents=True, exist_ok=True)
    x, y = write_seed(data / "seed.h5")
    seed_bytes = (data / "seed.h5").read_bytes()
    rng = random.Random(seed)
    figures: dict = {"cases": 0, "outcomes": {}, "helper_deaths": 0, "daemon_deaths": 0, "clean_served": True}
    # A file that makes libhdf5 loop is answered after helper_timeout_s (its
    # helper killed, the batch failed) well within the Loader's timeout.
    hang = "helper_timeout_s = 10.0\n"
    daemons = [
        Daemon(binary, workdir / "fast", data, threads=2, depth=2, extra="[hdf5]\n" + hang),
        Daemon(binary, workdir / "library", data, threads=2, depth=2, extra="[hdf5]\nfast_path = false\n" + hang),
    ]
    start = time.monotonic()
    try:
        for case in range(cases):
            d = daemons[case % 2]
            path = data / f"case-{case % 8}.h5"
            path.write_bytes(mutate(seed_bytes, rng))
            outcome = read_case(stoker, path, d.socket)
            figures["outcomes"][outcome] = figures["outcomes"].get(outcome, 0) + 1
            figures["cases"] += 1
            if d.proc.poll() is not None:
                figures["daemon_deaths"] += 1
                break
        for d in daemons:
            if d.proc.poll() is not None:
                continue
            loader = stoker.Loader(
                stoker.hdf5(str(data / "seed.h5"), fields={"x": "x", "y": "y"}),
                batch_size=16,
                shuffle=False,
                socket=d.socket,
                timeout=60,
                reconnect=0,
            )
            got = list(loader)
            ok = np.array_equal(np.concatenate([b["x"] for b in got]), x) and np.array_equal(
                np.concatenate([b["y"] for b in got]), y
            )
            figures["clean_served"] = figures["clean_served"] and ok
            loader.close()
    finally:
        for d in daemons:
            d.stop()
    for d in daemons:
        log = (Path(d.socket).parent / "daemon.log").read_text(errors="replace")
        figures["helper_deaths"] += log.count("HDF5 helper died")
        if d.proc.returncode not in (0, None):
            figures["daemon_deaths"] += int(d.proc.returncode != 0)
    figures["seconds"] = round(time.monotonic() - start, 1)
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--stoker", default=None, help="the stoker binary (default $STOKER_BIN, else target/release)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="stk-fuzz-") as tmp:
        figures = run(args.cases, args.seed, stoker_bin(args.stoker), Path(tmp))
    if args.json:
        print(json.dumps(figures))
    else:
        print(f"command: python benches/fuzz_hdf5.py --cases {args.cases} --seed {args.seed}")
        for k, v in figures.items():
            print(f"{k}: {v}")
    allowed = {"served", "DatasetError", "LimitError"}
    bad = set(figures["outcomes"]) - allowed
    sys.exit(1 if figures["daemon_deaths"] or bad or not figures["clean_served"] else 0)


if __name__ == "__main__":
    main()
