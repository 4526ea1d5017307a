#!/usr/bin/env python3
"""The node-wide caches: hit rate and epoch time, Belady against LRU.

Datasets about twice the largest cache tried:
- PNG-in-LMDB: 64×64 RGB PNGs (synthetic photos), decoded by the daemon;
  the sample cache holds 25 / 50 / 75 % of the decoded bytes.
- gzip-chunked HDF5: 16 KiB int32 rows, 16 rows per chunk; the chunk cache
  holds 25 / 50 / 75 % of the decompressed bytes.
For each size, one daemon per policy (`[cache] policy = "belady"`, then
`"lru"`) serves one shuffled stream for --epochs epochs; per epoch we read
the cache's hit and miss counters (`stoker cache ls --json`) and time the
epoch. Then, at 50 %: a second job's first-epoch hit rate after a first job
(another seed) finished, and two concurrent jobs with different seeds.
HDF5 also runs with no cache and against DataLoader + h5py (persistent
workers, exact shuffle, the best of 1 and 2 workers) on the same cores, and
with `shuffle="block"` where the client supports it.

    python benches/cache.py            # ~3 minutes on 2 cores
    python benches/cache.py --quick    # smaller datasets, 3 epochs
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import Daemon, machine_info, stoker_bin, warm_page_cache  # noqa: E402

FRACTIONS = (0.25, 0.5, 0.75)
SIDE = 64
ROW_INTS = 4096  # 16 KiB rows
CHUNK_ROWS = 16
BATCH = 32


def write_pngs(root: Path, n: int) -> Path:
    import lmdb
    from PIL import Image

    path = root / f"png-{n}"
    if (path / "data.mdb").is_file():
        return path
    rng = np.random.default_rng(0)
    env = lmdb.open(str(path), map_size=1 << 31)
    with env.begin(write=True) as txn:
        y, x = np.mgrid[0:SIDE, 0:SIDE]
        for i in range(n):
            base = (np.sin(x / rng.uniform(3, 12)) + np.cos(y / rng.uniform(3, 12))) * 60 + 128
            im = np.stack([base + rng.normal(0, 8, base.shape) for _ in range(3)], -1).clip(0, 255).astype(np.uint8)
            buf = io.BytesIO()
            Image.fromarray(im).save(buf, format="PNG")
            txn.put(f"{i:08d}".encode(), buf.getvalue())
    env.close()
    return path


def write_h5(root: Path, rows: int) -> Path:
    import h5py

    path = root / f"gzip-{rows}.h5"
    if path.is_file():
        return path
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        d = f.create_dataset("x", shape=(rows, ROW_INTS), dtype=np.int32, chunks=(CHUNK_ROWS, ROW_INTS),
                             compression="gzip", compression_opts=4)
        for at in range(0, rows, 256):
            n = min(256, rows - at)
            d[at:at + n] = rng.integers(0, 50, size=(n, ROW_INTS), dtype=np.int32)
    return path


def cache_ls(binary: str, sock: str) -> dict:
    out = subprocess.run([binary, "cache", "ls", "--json", "--socket", sock], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def counters(binary: str, sock: str, cache: str) -> tuple[int, int]:
    r = cache_ls(binary, sock)[cache]
    return r["hits"], r["misses"]


def run_epochs(stoker, spec, binary, sock, cache, epochs, seed=0, **kw) -> list[tuple[float, float]]:
    """(hit rate, seconds) per epoch of one shuffled stream."""
    loader = stoker.Loader(spec, batch_size=BATCH, seed=seed, socket=sock, **kw)
    out = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        h0, m0 = counters(binary, sock, cache)
        t0 = time.perf_counter()
        for _ in loader:
            pass
        dt = time.perf_counter() - t0
        h1, m1 = counters(binary, sock, cache)
        out.append(((h1 - h0) / max(1, (h1 - h0) + (m1 - m0)), dt))
    loader.close()
    return out


def config(cache: str, size: int, policy: str) -> str:
    other = "chunk_bytes = 1048576" if cache == "samples" else "sample_bytes = 0"
    key = "sample_bytes" if cache == "samples" else "chunk_bytes"
    return f"[cache]\n{key} = {size}\n{other}\npolicy = \"{policy}\"\n"


def policy_table(stoker, binary, root, spec, cache, decoded, epochs, tmp) -> list[str]:
    lines = ["| cache size | policy | hit rate, epochs 2+ (median) | epoch s (median) |", "|---|---|---|---|"]
    for frac in FRACTIONS:
        for policy in ("belady", "lru"):
            with Daemon(binary, tmp / f"{cache}-{frac}-{policy}", root, threads=2, depth=4,
                        extra=config(cache, int(decoded * frac), policy)) as d:
                res = run_epochs(stoker, spec, binary, d.socket, cache, epochs)
            later = res[1:]
            lines.append(f"| {frac:.0%} | {policy} | {statistics.median(h for h, _ in later):.1%} | "
                         f"{statistics.median(t for _, t in later):.3f} |")
            print(lines[-1], file=sys.stderr)
    return lines


def jobs_table(stoker, binary, root, spec, cache, decoded, tmp) -> list[str]:
    lines = ["| at 50 % | policy | hit rate |", "|---|---|---|"]
    for policy in ("belady", "lru"):
        with Daemon(binary, tmp / f"jobs-{cache}-{policy}", root, threads=2, depth=4,
                    extra=config(cache, int(decoded * 0.5), policy)) as d:
            run_epochs(stoker, spec, binary, d.socket, cache, 2, seed=1)
            (second, _), = run_epochs(stoker, spec, binary, d.socket, cache, 1, seed=2)
            lines.append(f"| second job, first epoch | {policy} | {second:.1%} |")
            results: list[list[tuple[float, float]]] = [[], []]

            def job(k: int) -> None:
                results[k] = run_epochs(stoker, spec, binary, d.socket, cache, 3, seed=10 + k)

            threads = [threading.Thread(target=job, args=(k,)) for k in range(2)]
            h0, m0 = counters(binary, d.socket, cache)
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            h1, m1 = counters(binary, d.socket, cache)
            lines.append(f"| two concurrent jobs, seeds 10/11, 3 epochs | {policy} | "
                         f"{(h1 - h0) / max(1, h1 - h0 + m1 - m0):.1%} (both jobs' lookups) |")
            print(lines[-2:], file=sys.stderr)
    return lines


class H5Rows:
    def __init__(self, path: str) -> None:
        self.path, self.f = path, None

    def __len__(self) -> int:
        import h5py

        with h5py.File(self.path, "r") as f:
            return len(f["x"])

    def __getitem__(self, i: int) -> np.ndarray:
        import h5py

        if self.f is None:
            self.f = h5py.File(self.path, "r")
        return self.f["x"][i]


def dataloader_s(path: Path, epochs: int) -> float:
    import torch

    best = None
    for workers in (1, 2):
        dl = torch.utils.data.DataLoader(H5Rows(str(path)), batch_size=BATCH, shuffle=True, num_workers=workers,
                                         persistent_workers=True)
        times = []
        for _ in range(epochs):
            t0 = time.perf_counter()
            for _ in dl:
                pass
            times.append(time.perf_counter() - t0)
        med = statistics.median(times[1:] or times)
        best = med if best is None else min(best, med)
        del dl
    return best


def fdstore_restart(stoker, binary, root, spec, decoded, tmp) -> list[str]:
    """Fill the chunk cache, stop the daemon the way systemd does with an fd
    store, start the next one with the stored memfd; report the logged times."""
    import array
    import os
    import re
    import socket as socketlib

    notify = tmp / "notify"
    sock = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_DGRAM)
    sock.bind(str(notify))
    env = {**os.environ, "NOTIFY_SOCKET": str(notify), "FDSTORE": "1"}
    extra = config("chunks", decoded * 2, "belady")

    def start(workdir: Path, command: list[str], fds: tuple[int, ...]) -> subprocess.Popen:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "stoker.toml").write_text(
            f'[server]\nsocket = "{workdir}/s"\nallowed_roots = ["{root.resolve()}"]\n[workers]\nthreads = 2\n' + extra)
        log = open(workdir / "log", "wb")
        proc = subprocess.Popen([*command, "serve", "--config", str(workdir / "stoker.toml")], env=env,
                                stdout=log, stderr=log, pass_fds=fds)
        while not (workdir / "s").exists():
            time.sleep(0.05)
        return proc

    first = start(tmp / "fd-a", [binary], ())
    loader = stoker.Loader(spec, batch_size=BATCH, shuffle=False, socket=str(tmp / "fd-a" / "s"))
    for _ in loader:
        pass
    loader.close()
    first.terminate()
    first.wait()
    fds = array.array("i")
    _, anc, _, _ = sock.recvmsg(4096, socketlib.CMSG_SPACE(4), 0)
    while not any(level == socketlib.SOL_SOCKET for level, _, _ in anc):
        _, anc, _, _ = sock.recvmsg(4096, socketlib.CMSG_SPACE(4), 0)
    for level, kind, data in anc:
        if level == socketlib.SOL_SOCKET and kind == socketlib.SCM_RIGHTS:
            fds.frombytes(data[:4])
    fd = fds[0]
    wrapper = [sys.executable, "-c", "import os, sys\n"
               f"os.dup2({fd}, 3)\nos.close({fd})\n"
               "os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS='1', LISTEN_FDNAMES='stoker-cache')\n"
               "os.execv(sys.argv[1], sys.argv[1:])\n", binary]
    second = start(tmp / "fd-b", wrapper, (fd,))
    os.close(fd)
    time.sleep(0.5)
    second.terminate()
    second.wait()
    sock.close()
    seconds = lambda text, what: re.search(rf"{what}.*?seconds=([0-9.e-]+)", text)  # noqa: E731
    a, b = (tmp / "fd-a" / "log").read_text(), (tmp / "fd-b" / "log").read_text()
    out, back = seconds(a, "handed to systemd"), seconds(b, "restored from systemd")
    size = re.search(r"restored from systemd.*?bytes=(\d+)", b)
    return [f"fd store across a restart: {int(size.group(1)) / 2**20:.1f} MiB of chunks written in "
            f"{float(out.group(1)):.3f} s at stop, restored in {float(back.group(1)):.3f} s at start"
            if out and back and size else "fd store: not measured (see the daemon logs)"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--stoker")
    ap.add_argument("--data", default="/tmp/stoker-bench-cache")
    a = ap.parse_args()
    binary = stoker_bin(a.stoker)
    import stoker

    root = Path(a.data)
    root.mkdir(parents=True, exist_ok=True)
    n_png = 800 if a.quick else 3000
    rows = 1024 if a.quick else 4096
    epochs = 3 if a.quick else 4
    png, h5 = write_pngs(root, n_png), write_h5(root, rows)
    for p in (png / "data.mdb", h5):
        warm_page_cache(p)
    png_decoded = n_png * SIDE * SIDE * 3
    h5_decoded = rows * ROW_INTS * 4
    info = machine_info()
    out = [f"Machine: {info['nproc']} CPUs, {info['cpu']}; `python benches/cache.py{' --quick' if a.quick else ''}`", ""]
    with tempfile.TemporaryDirectory(prefix="stk-bench-") as tmp_s:
        tmp = Path(tmp_s)
        png_spec = stoker.lmdb(png, fields={"img": "png"})
        h5_spec = stoker.hdf5(str(h5), fields={"x": "/x"})
        out += [f"### PNG in LMDB: {n_png} images, {png_decoded / 2**20:.1f} MiB decoded", ""]
        out += policy_table(stoker, binary, root, png_spec, "samples", png_decoded, epochs, tmp) + [""]
        out += jobs_table(stoker, binary, root, png_spec, "samples", png_decoded, tmp) + [""]
        out += [f"### gzip HDF5: {rows} rows of 16 KiB, {CHUNK_ROWS} rows per chunk, "
                f"{h5_decoded / 2**20:.1f} MiB decompressed", ""]
        out += policy_table(stoker, binary, root, h5_spec, "chunks", h5_decoded, epochs, tmp) + [""]
        out += jobs_table(stoker, binary, root, h5_spec, "chunks", h5_decoded, tmp) + [""]
        # Beyond the cache: half, then a quarter of the data fits.
        lines = ["| gzip HDF5 beyond the cache | epoch s (median) | rows/s | vs DataLoader |", "|---|---|---|---|"]
        runs = {}
        with Daemon(binary, tmp / "none", root, threads=2, depth=4, extra=config("chunks", 0, "belady")) as d:
            runs["stoker, no chunk cache"] = run_epochs(stoker, h5_spec, binary, d.socket, "chunks", epochs)
        with Daemon(binary, tmp / "h", root, threads=2, depth=4,
                    extra=config("chunks", h5_decoded // 2, "belady")) as d:
            runs["stoker, exact shuffle, Belady, cache = 50 %"] = run_epochs(
                stoker, h5_spec, binary, d.socket, "chunks", epochs)
        with Daemon(binary, tmp / "q", root, threads=2, depth=4,
                    extra=config("chunks", h5_decoded // 4, "belady")) as d:
            runs["stoker, exact shuffle, Belady, cache = 25 %"] = run_epochs(
                stoker, h5_spec, binary, d.socket, "chunks", epochs)
            try:
                runs["stoker, shuffle=\"block\" (64 rows × window 8), Belady, cache = 25 %"] = run_epochs(
                    stoker, h5_spec, binary, d.socket, "chunks", epochs, shuffle="block", block_size=64,
                    block_window=8)
            except (TypeError, ValueError) as e:
                print(f"block order not available: {e}", file=sys.stderr)
        base = dataloader_s(h5, epochs)
        lines.append(f"| DataLoader + h5py (best of 1–2 workers, exact shuffle) | {base:.3f} | {rows / base:,.0f} | 1.0× |")
        for name, res in runs.items():
            t = statistics.median(s for _, s in res[1:])
            lines.append(f"| {name} | {t:.3f} | {rows / t:,.0f} | {base / t:.1f}× |")
        out += lines + [""]
        out += fdstore_restart(stoker, binary, root, h5_spec, h5_decoded, tmp)
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
