"""Shared pieces of the benchmark scripts: the daemon launcher, page-cache
warming and machine information."""

from __future__ import annotations

import os
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def stoker_bin(arg: str | None = None) -> str:
    path = arg or os.environ.get("STOKER_BIN") or str(REPO / "target" / "release" / "stoker")
    if not Path(path).is_file():
        sys.exit(f"stoker binary not found at {path} (cargo build --release, or --stoker PATH)")
    return path


def warm_page_cache(path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(16 << 20)
        while f.readinto(buf):
            pass


class Daemon:
    """`stoker serve` on a socket in `workdir`, serving files under `allowed`."""

    def __init__(
        self, binary: str, workdir: Path, allowed: Path, threads: int, depth: int, extra: str = "", server: str = ""
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.socket = str(workdir / "stoker.sock")
        config = workdir / "stoker.toml"
        config.write_text(
            "[server]\n"
            f'socket = "{self.socket}"\n'
            f'allowed_roots = ["{allowed.resolve()}"]\n' + server +
            f"[workers]\nthreads = {threads}\n"
            f"[ring]\ndepth = {depth}\n" + extra
        )
        self.log = open(workdir / "daemon.log", "wb")
        self.proc = subprocess.Popen(
            [binary, "serve", "--config", str(config), "--socket", self.socket],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
        )
        deadline = time.monotonic() + 20
        while True:
            if self.proc.poll() is not None:
                sys.exit(f"stoker serve exited with {self.proc.returncode}:\n{(workdir / 'daemon.log').read_text()}")
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(self.socket)
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    sys.exit("stoker serve did not start listening within 20 s")
                time.sleep(0.05)
            finally:
                s.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __enter__(self) -> "Daemon":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def machine_info() -> dict[str, str]:
    cpu, mem = "unknown", "unknown"
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
        mem = next(f"{int(l.split()[1]) / 1024 / 1024:.1f} GiB" for l in open("/proc/meminfo") if l.startswith("MemTotal"))
    except (OSError, StopIteration):
        pass
    import h5py
    import numpy as np

    return {
        "nproc": str(os.cpu_count()),
        "cpu": cpu,
        "memory": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "h5py": h5py.__version__,
    }
