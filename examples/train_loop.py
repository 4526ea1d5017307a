#!/usr/bin/env python3
"""Quick start: a training-style loop fed by a stoker daemon.

Writes a small HDF5 dataset (3 files, 20k samples of x: f32 [3, 32, 32] and
y: int64) to a temporary directory, starts `stoker serve` with a config that
names it "demo", runs two epochs over it (batch 256, shuffled, set_epoch each
epoch) with a stand-in for a training step, prints `stoker status` while the
loader is open, then stops the daemon and cleans up.

    python examples/train_loop.py [--stoker PATH] [--samples 20000]

The daemon binary is --stoker, else $STOKER_BIN, else target/release/stoker.
In a real job the daemon runs once per node (systemd or `srun ... stoker
serve`) and the training script only creates the Loader.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

REPO = Path(__file__).resolve().parents[1]


def write_dataset(root: Path, samples: int, files: int = 3) -> None:
    rng = np.random.default_rng(0)
    bounds = np.linspace(0, samples, files + 1).astype(int)
    for i in range(files):
        n = int(bounds[i + 1] - bounds[i])
        with h5py.File(root / f"demo-{i:02d}.h5", "w") as f:
            f.create_dataset("x", data=rng.standard_normal((n, 3, 32, 32), dtype=np.float32))
            f.create_dataset("y", data=rng.integers(0, 10, size=n, dtype=np.int64))


def start_daemon(binary: str, workdir: Path, data: Path) -> tuple[subprocess.Popen, str]:
    sock = str(workdir / "stoker.sock")
    config = workdir / "stoker.toml"
    config.write_text(
        f"""[server]
socket = "{sock}"
allowed_roots = ["{data}"]

[workers]
threads = {os.cpu_count() or 2}

[ring]
depth = 4

[datasets.demo]
format = "hdf5"
files = "{data}/*.h5"
fields = {{ x = "x", y = "y" }}
"""
    )
    log = open(workdir / "daemon.log", "wb")  # the daemon logs to stderr
    proc = subprocess.Popen(
        [binary, "serve", "--config", str(config), "--socket", sock],
        stdin=subprocess.DEVNULL, stdout=log, stderr=log,
    )
    log.close()
    deadline = time.monotonic() + 20
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"stoker serve exited with {proc.returncode}")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(sock)
            return proc, sock
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError("stoker serve did not start listening within 20 s") from None
            time.sleep(0.05)
        finally:
            s.close()


def stop_daemon(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def train(binary: str, sock: str, samples: int, epochs: int) -> None:
    import stoker

    loader = stoker.Loader("demo", batch_size=256, shuffle=True, seed=0, socket=sock)
    print(f"{len(loader)} batches per epoch")
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        seen, nbytes, acc = 0, 0, 0.0
        t0 = time.perf_counter()
        for batch in loader:
            x, y = batch["x"], batch["y"]  # read-only numpy views of shared memory, no copy
            acc += float(x.mean())  # the "training step"
            assert x.shape[1:] == (3, 32, 32) and ((y >= 0) & (y < 10)).all()
            seen += len(y)
            nbytes += x.nbytes + y.nbytes
        dt = time.perf_counter() - t0
        if seen != samples:
            raise RuntimeError(f"epoch {epoch}: {seen} samples, expected {samples}")
        print(
            f"epoch {epoch}: {seen} samples in {dt:.2f} s: "
            f"{seen / dt:,.0f} samples/s, {nbytes / dt / 1e6:,.0f} MB/s (mean of x {acc / len(loader):+.4f})"
        )
    # Still open: the daemon shows this stream.
    status = subprocess.run([binary, "status", "--socket", sock], capture_output=True, text=True)
    print(status.stdout, end="")
    if status.returncode != 0:
        raise RuntimeError(f"stoker status failed: {status.stderr}")
    loader.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stoker", default=None, help="stoker binary")
    p.add_argument("--samples", type=int, default=20_000)
    p.add_argument("--epochs", type=int, default=2)
    a = p.parse_args()
    binary = a.stoker or os.environ.get("STOKER_BIN") or str(REPO / "target" / "release" / "stoker")
    if not Path(binary).is_file():
        print(f"stoker binary not found at {binary}", file=sys.stderr)
        return 1

    workdir = Path(tempfile.mkdtemp(prefix="stoker-demo-"))
    proc = None
    try:
        data = workdir / "data"
        data.mkdir()
        write_dataset(data, a.samples)
        proc, sock = start_daemon(binary, workdir, data)
        train(binary, sock, a.samples, a.epochs)
        return 0
    except Exception as e:  # noqa: BLE001 - report and fail the example
        print(f"train_loop failed: {type(e).__name__}: {e}", file=sys.stderr)
        log = workdir / "daemon.log"
        if log.exists():
            print("daemon log:\n" + log.read_text(errors="replace")[-4000:], file=sys.stderr)
        return 1
    finally:
        if proc is not None:
            stop_daemon(proc)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
