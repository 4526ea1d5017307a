"""A daemon inside a job's memory cgroup (issue 24, item 1): its memory
budget comes from the cgroup's limit, so with default settings it warms and
serves a dataset nearly as large as the cgroup without being OOM-killed, and
the served values are h5py's. Real cgroup (v1 memory controller or v2),
real daemon; skipped where the test cannot make a cgroup (not root, or no
writable memory controller)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from conftest import SUBPROCESS_TIMEOUT_S, Daemon, make_config, stoker_bin

LIMIT = 200 << 20


class Cgroup:
    """A fresh memory cgroup limited to `limit` bytes (swap included where counted)."""

    def __init__(self, limit: int) -> None:
        v1 = Path("/sys/fs/cgroup/memory")
        v2 = Path("/sys/fs/cgroup")
        name = f"stoker-test-{os.getpid()}"
        if (v1 / "memory.limit_in_bytes").exists():
            self.version, self.dir = 1, v1 / name
            self.dir.mkdir()
            (self.dir / "memory.limit_in_bytes").write_text(str(limit))
            if (self.dir / "memory.memsw.limit_in_bytes").exists():
                (self.dir / "memory.memsw.limit_in_bytes").write_text(str(limit))
        elif (v2 / "cgroup.controllers").exists() and "memory" in (v2 / "cgroup.subtree_control").read_text():
            self.version, self.dir = 2, v2 / name
            self.dir.mkdir()
            (self.dir / "memory.max").write_text(str(limit))
            (self.dir / "memory.swap.max").write_text("0")
        else:
            raise OSError("no writable memory controller")

    def enter_and_exec(self) -> list[str]:
        """A command prefix that moves itself into the cgroup, then runs the rest."""
        return ["sh", "-c", f'echo $$ > {self.dir}/cgroup.procs && exec "$@"', "sh"]

    def oom_kills(self) -> int:
        if self.version == 1:
            text = (self.dir / "memory.oom_control").read_text()
        else:
            text = (self.dir / "memory.events").read_text()
        return sum(int(line.split()[1]) for line in text.splitlines() if line.startswith("oom_kill"))

    def peak(self) -> int | None:
        for name in ("memory.max_usage_in_bytes", "memory.peak"):
            if (self.dir / name).exists():
                return int((self.dir / name).read_text())
        return None

    def remove(self) -> None:
        procs = (self.dir / "cgroup.procs").read_text().split()
        for pid in procs:
            try:
                os.kill(int(pid), 9)
            except ProcessLookupError:
                pass
        for _ in range(100):
            try:
                self.dir.rmdir()
                return
            except OSError:
                import time

                time.sleep(0.05)


@pytest.fixture
def cgroup() -> Iterator[Cgroup]:
    if os.geteuid() != 0:
        pytest.skip("needs root to make a memory cgroup")
    try:
        cg = Cgroup(LIMIT)
    except OSError as e:
        pytest.skip(f"cannot make a memory cgroup here: {e}")
    yield cg
    cg.remove()


def test_a_daemon_in_a_200_mb_cgroup_warms_and_serves_a_196_mb_dataset(cgroup: Cgroup, stoker: Any,
                                                                         tmp_path: Path) -> None:
    """Before: defaults ignored the cgroup (chunk cache 512 MiB, budget half
    of the machine), and warming a 196 MB dataset in a 200 MB cgroup ended
    in "Memory cgroup out of memory: Killed process (stoker)"."""
    rows, width = 196 * 256, 1024  # 196 MiB... of float32 rows of 4 KiB: 50,176 rows
    rng = np.random.default_rng(0)
    path = tmp_path / "big.h5"
    with h5py.File(path, "w") as f:
        x = f.create_dataset("x", shape=(rows, width), dtype=np.float32, chunks=(256, width), compression="gzip",
                             compression_opts=1)
        for start in range(0, rows, 4096):
            n = min(4096, rows - start)
            block = np.repeat(rng.integers(0, 255, size=(n, 1)).astype(np.float32), width, axis=1)
            block[:, 0] = np.arange(start, start + n)
            x[start:start + n] = block
    workdir = Path(tempfile.mkdtemp(prefix="stk-", dir="/tmp"))
    config = make_config("unused", allowed_roots=[tmp_path], extra="", threads=2)
    config += f'\n[datasets.big]\nformat = "hdf5"\nfiles = "{path}"\nfields = {{ x = "x" }}\n'
    d = Daemon(workdir, config, command=[*cgroup.enter_and_exec(), str(stoker_bin())])
    try:
        budget_logged = "memory budget" in d.stderr() and "cgroup" in d.stderr()
        memory = d.status().get("memory", {})
        assert memory.get("budget_bytes") == LIMIT // 2 and "cgroup" in memory.get("source", ""), memory
        warm = subprocess.run([str(stoker_bin()), "cache", "warm", "big", "--socket", d.socket, "--json"],
                              capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
        assert warm.returncode == 0, warm.stderr + d.stderr()[-3000:]
        loader = stoker.Loader("big", batch_size=512, shuffle=True, seed=1, socket=d.socket, timeout=120)
        seen = 0
        with h5py.File(path) as f:
            ref = f["x"]
            for i, batch in enumerate(loader):
                x = batch["x"]
                idx = x[:, 0].astype(np.int64)
                if i % 10 == 0:  # byte for byte against h5py, on every tenth batch
                    order = np.argsort(idx)
                    np.testing.assert_array_equal(x[order], ref[np.sort(idx)])
                seen += len(idx)
        assert seen == rows
        loader.close()
        assert d.alive(), d.stderr()[-3000:]
        assert cgroup.oom_kills() == 0
        assert budget_logged, d.stderr()
        print(f"peak memory of the cgroup: {cgroup.peak()} bytes (limit {LIMIT})")
    finally:
        d.stop()
        shutil.rmtree(workdir, ignore_errors=True)
