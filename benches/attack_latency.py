#!/usr/bin/env python3
"""What another user sees while one user reads a pathologically slow HDF5 file.

The attack of issue 22, finding 6: a file whose field only libhdf5 can read
(scale-offset filter) with one 256 MiB chunk, so that every row read makes
libhdf5 decode the whole chunk. The attacker (a second uid, default 65534,
run as root) keeps two streams of it busy; the victim (root) meanwhile opens
a small contiguous dataset and reads its first batch. Reported per binary
(``--stoker`` once or twice, alternating rounds): median open time and
first-batch time of the victim, with and without the attack.

    sudo python benches/attack_latency.py --stoker target/release/stoker --stoker /tmp/stoker-before
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import Daemon  # noqa: E402

ATTACKER = r"""
import json, os, sys, threading
import stoker
a = json.loads(sys.argv[1])
os.setgroups([]); os.setgid(a["uid"]); os.setuid(a["uid"])
def run(seed):
    while True:
        try:
            loader = stoker.Loader(stoker.hdf5(a["file"], fields={"x": "x"}), batch_size=2, seed=seed,
                                   socket=a["socket"], timeout=600, reconnect=0)
            for _ in loader:
                pass
        except stoker.StokerError as e:
            print("attacker:", e, file=sys.stderr)
for s in range(2):
    threading.Thread(target=run, args=(s,), daemon=True).start()
print("started", flush=True)
sys.stdin.read()
"""


def victim(stoker, path: Path, socket: str) -> tuple[float, float]:
    t0 = time.perf_counter()
    loader = stoker.Loader(stoker.hdf5(str(path), fields={"x": "x"}), batch_size=8, socket=socket, timeout=600)
    t1 = time.perf_counter()
    next(iter(loader))
    t2 = time.perf_counter()
    loader.close()
    return t1 - t0, t2 - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stoker", action="append", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--uid", type=int, default=65534)
    ap.add_argument("--settle", type=float, default=3.0, help="seconds the attack runs before the victim starts")
    ap.add_argument(
        "--fast-path",
        action="store_true",
        help="attack with a file the fast path decodes (one 256 MiB gzip chunk of zeros, no chunk cache: every row "
        "inflates it in Rust on a worker) instead of a libhdf5-only one",
    )
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root: the attacker is another uid")
    import stoker

    with tempfile.TemporaryDirectory(prefix="stk-attack-") as tmp:
        root = Path(tmp)
        os.chmod(root, 0o755)
        data = root / "data"
        data.mkdir(mode=0o755)
        slow = data / "slow.h5"
        with h5py.File(slow, "w") as f:
            if args.fast_path:
                f.create_dataset("x", shape=(64, 1 << 22), dtype=np.uint8, chunks=(64, 1 << 22), compression="gzip",
                                 fillvalue=0)
                f["x"][0] = np.ones(1 << 22, dtype=np.uint8)
            else:
                f.create_dataset("x", data=np.arange(64 * (1 << 20), dtype=np.int32).reshape(64, 1 << 20) % 1000,
                                 chunks=(64, 1 << 20), scaleoffset=0)
        fast = data / "fast.h5"
        with h5py.File(fast, "w") as f:
            f.create_dataset("x", data=np.arange(64 * 16, dtype=np.float32).reshape(64, 16))
        for p in (slow, fast):
            os.chmod(p, 0o644)
        results: dict[str, dict[str, list[tuple[float, float]]]] = {b: {"quiet": [], "attack": []} for b in args.stoker}
        for r in range(args.rounds):
            for n, binary in enumerate(args.stoker):
                extra = "[limits]\nidle_close_s = 0\n[cache]\nchunk_bytes = 0\n"
                workdir = root / f"d{r}-{n}"
                server = f"allowed_uids = [{args.uid}]\n"
                with Daemon(binary, workdir, data, threads=2, depth=2, extra=extra, server=server) as d:
                    os.chmod(workdir, 0o755)
                    results[binary]["quiet"].append(victim(stoker, fast, d.socket))
                    attacker = subprocess.Popen(
                        [sys.executable, "-c", ATTACKER,
                         json.dumps({"uid": args.uid, "file": str(slow), "socket": d.socket})],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                    )
                    try:
                        attacker.stdout.readline()
                        time.sleep(args.settle)
                        results[binary]["attack"].append(victim(stoker, fast, d.socket))
                    finally:
                        attacker.kill()
                        attacker.wait()
        what = "256 MiB gzip chunk (fast path)" if args.fast_path else "256 MiB scale-offset chunk (libhdf5)"
        print(f"victim (root) while another uid reads a {what} row by row; medians of {args.rounds} rounds, "
              "2 worker threads, no chunk cache")
        print("| binary | quiet: open | quiet: first batch | attack: open | attack: first batch |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for binary, res in results.items():
            med = lambda xs, i: statistics.median(x[i] for x in xs)  # noqa: E731
            print(f"| {binary} | {med(res['quiet'], 0):.3f} s | {med(res['quiet'], 1):.3f} s | "
                  f"{med(res['attack'], 0):.3f} s | {med(res['attack'], 1):.3f} s |")


if __name__ == "__main__":
    main()
