"""libhdf5 runs in helper processes, never in the daemon (issue 22, finding 1).

A crafted HDF5 file whose chunk dimensions were changed to (16, 8388612)
made libhdf5 1.10's `H5Dread` copy out of bounds (SIGSEGV) inside the shared
daemon: every user's streams died. Now the crash kills one helper process:
the batch that asked fails with a DatasetError naming the file, field and
sample; the daemon, its other streams and other files keep serving.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]


def write_good(path: Path) -> np.ndarray:
    x = np.arange(256, dtype=np.float32).reshape(64, 4)
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=x, chunks=(16, 4), compression="gzip")
    return x


def write_crafted(path: Path) -> None:
    """The reproduction: a 64×4 float32 gzip dataset whose chunk dimensions
    in the layout message read (16, 8388612)."""
    write_good(path)
    raw = path.read_bytes()
    pattern = (16).to_bytes(4, "little") + (4).to_bytes(4, "little") + (4).to_bytes(4, "little")
    at = raw.find(pattern)
    assert at > 0 and raw.count(pattern) == 1
    path.write_bytes(raw[: at + 4] + (8388612).to_bytes(4, "little") + raw[at + 8 :])


def helpers_of(pid: int) -> list[int]:
    """Pids of the daemon's HDF5 helper processes."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("PPid:"))
        if ppid == pid and b"hdf5-helper" in cmdline:
            out.append(int(entry.name))
    return out


def read_all(stoker: Any, path: Path, socket: str) -> np.ndarray:
    loader = stoker.Loader(stoker.hdf5(str(path), fields={"x": "x"}), batch_size=8, shuffle=False, socket=socket,
                           timeout=60, reconnect=0)
    out = np.concatenate([b["x"].copy() for b in loader])
    loader.close()
    return out


@pytest.mark.parametrize("fast_path", [False, True])
def test_a_file_that_crashes_libhdf5_fails_its_batch_and_nobody_else_notices(
    start_daemon, stoker, tmp_path, fast_path
) -> None:
    good = write_good(tmp_path / "good.h5")
    write_crafted(tmp_path / "crafted.h5")
    d = start_daemon(extra=f"[hdf5]\nfast_path = {str(fast_path).lower()}\n")
    # A stream of the good file, open before the attack, in the same trust domain.
    before = stoker.Loader(stoker.hdf5(str(tmp_path / "good.h5"), fields={"x": "x"}), batch_size=8, shuffle=False,
                           socket=d.socket, timeout=60, reconnect=0)
    it = iter(before)
    first = next(it)["x"].copy()
    with pytest.raises(stoker.DatasetError) as err:
        read_all(stoker, tmp_path / "crafted.h5", d.socket)
    msg = str(err.value)
    assert "crafted.h5" in msg and '"x"' in msg, msg
    if not fast_path:
        # The library path reads it: libhdf5 crashes, in the helper.
        assert "crashed" in msg and "SIGSEGV" in msg and "h5dump" in msg, msg
    assert d.alive(), d.stderr()
    # The stream opened before goes on, exactly.
    rest = np.concatenate([first] + [b["x"].copy() for b in it])
    assert np.array_equal(rest, good)
    before.close()
    # New opens are served, exactly.
    assert np.array_equal(read_all(stoker, tmp_path / "good.h5", d.socket), good)
    assert d.alive(), d.stderr()
    if not fast_path:
        assert "HDF5 helper died" in d.stderr()
        # The file that crashed its helper is not handed to libhdf5 again
        # until it changes: the same error, and no further helper death.
        deaths = d.stderr().count("HDF5 helper died")
        with pytest.raises(stoker.DatasetError) as again:
            read_all(stoker, tmp_path / "crafted.h5", d.socket)
        assert "crafted.h5" in str(again.value) and "until it changes" in str(again.value), again.value
        assert d.stderr().count("HDF5 helper died") == deaths, d.stderr()


def test_libhdf5_runs_in_helper_processes_not_in_the_daemon(start_daemon, stoker, tmp_path) -> None:
    good = write_good(tmp_path / "good.h5")
    d = start_daemon(extra="[hdf5]\nfast_path = false\n")
    assert helpers_of(d.proc.pid) == [], "no helper before any HDF5 file is opened"
    assert np.array_equal(read_all(stoker, tmp_path / "good.h5", d.socket), good)
    helpers = helpers_of(d.proc.pid)
    assert len(helpers) == 1, helpers
    status = Path(f"/proc/{helpers[0]}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    assert fields["NoNewPrivs"].strip() == "1", status
    # Under its seccomp filter (mode 2: filtered).
    assert fields["Seccomp"].strip() == "2", status
    assert int(fields["CapEff"].strip(), 16) & ~(1 << 2) == 0, "no capability but CAP_DAC_READ_SEARCH"
    limits = Path(f"/proc/{helpers[0]}/limits").read_text()
    assert any(line.startswith("Max address space") and "unlimited" not in line for line in limits.splitlines())
    # Each request's CPU is bounded too (renewed per request; the default
    # helper_timeout_s is 60): RLIMIT_CPU's soft limit, a little past 60 s.
    cpu = [line.split() for line in limits.splitlines() if line.startswith("Max cpu time")]
    assert cpu and cpu[0][3] != "unlimited" and 60 < int(cpu[0][3]) <= 62 + 5, limits
    # A helper killed between requests (out of memory while idle, say) costs
    # nothing but a reopen.
    os.kill(helpers[0], 9)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{helpers[0]}/stat").read_text().split(") ", 1)[1].startswith("Z"):
                break
        except OSError:
            break
        time.sleep(0.01)
    assert np.array_equal(read_all(stoker, tmp_path / "good.h5", d.socket), good)
    assert d.alive(), d.stderr()


def test_the_hdf5_mutation_fuzzer_kills_no_daemon(tmp_path) -> None:
    """Mutated HDF5 files (metadata bytes, chunk dimensions, filter
    parameters, truncation) through the real daemon, with and without the
    fast path; longer runs: `python benches/fuzz_hdf5.py --cases 2000`."""
    cases = int(os.environ.get("STOKER_FUZZ_CASES", "240"))
    res = subprocess.run(
        [sys.executable, str(REPO / "benches" / "fuzz_hdf5.py"), "--cases", str(cases), "--json"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.stdout.strip(), res.stderr[-3000:]
    figures = json.loads(res.stdout.strip().splitlines()[-1])
    assert figures["daemon_deaths"] == 0, figures
    assert figures["cases"] == cases, figures
    assert set(figures["outcomes"]) <= {"served", "DatasetError", "LimitError"}, figures
    assert figures["clean_served"], figures
    assert res.returncode == 0, (figures, res.stderr[-3000:])
