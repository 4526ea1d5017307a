#!/usr/bin/env python3
"""The reliability suite's figures: what the daemon survives, and what it leaks.

Runs, against the real `stoker` binary and real files (h5py, lmdb):

* client SIGKILL rounds: a process opens a stream, holds two batches and is
  killed with SIGKILL; the daemon's descriptors, memfds, RSS and client count
  before and after;
* daemon restarts mid-epoch (SIGTERM, a new daemon on the same socket): a
  client with ``reconnect=`` must see every epoch exactly (no sample repeated
  or skipped);
* fuzzed frames: random and mutated requests on many connections, crash count;
* files that change under the daemon: HDF5 replaced, grown, deleted; LMDB
  truncated and corrupted; the outcome of each and whether the daemon lived;
* concurrent clients: processes reading one dataset at once, every value
  checked against h5py.

    python benches/reliability.py            # writes docs/reliability-figures.md
    python benches/reliability.py --quick    # fewer rounds, prints only
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import REPO, Daemon, machine_info, stoker_bin  # noqa: E402

import stoker  # noqa: E402


def fds(pid: int) -> tuple[int, int]:
    """(descriptors, memfds) of process `pid`."""
    n = m = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        n += 1
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:"):
                m += 1
        except OSError:
            pass
    return n, m


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def write_h5(path: Path, n: int, side: int = 32) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.arange(n * side, dtype=np.float32).reshape(n, side), chunks=(16, side))
        f.create_dataset("label", data=np.arange(n, dtype=np.int64), chunks=(16,))


KILLED_CLIENT = """
import os, sys, time, stoker
l = stoker.Loader(stoker.hdf5(sys.argv[1], fields={"x": "x"}), batch_size=8, socket=sys.argv[2])
it = iter(l)
held = [next(it), next(it)]
print("holding", flush=True)
time.sleep(60)
"""


def client_kills(binary: str, work: Path, rounds: int) -> dict:
    data = work / "kill" / "d.h5"
    write_h5(data, 1024)
    with Daemon(binary, work / "kill-daemon", work, threads=2, depth=4) as d:
        warm = stoker.Loader(stoker.hdf5(str(data), fields={"x": "x"}), batch_size=8, socket=d.socket)
        next(iter(warm))
        warm.close()
        del warm
        time.sleep(0.5)
        before = (*fds(d.proc.pid), rss_mb(d.proc.pid))
        for _ in range(rounds):
            p = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, str(data), d.socket], stdout=subprocess.PIPE)
            assert p.stdout is not None
            p.stdout.readline()
            p.kill()
            p.wait()
        time.sleep(1.0)
        after = (*fds(d.proc.pid), rss_mb(d.proc.pid))
        # (the status query does not list itself)
        clients = len(stoker_status(binary, d.socket)["clients"])
        return {"rounds": rounds, "before": before, "after": after, "clients_after": clients,
                "alive": d.proc.poll() is None}


def stoker_status(binary: str, sock: str) -> dict:
    import json

    out = subprocess.run([binary, "status", "--json", "--socket", sock], capture_output=True, text=True, timeout=30)
    return json.loads(out.stdout)


def restarts(binary: str, work: Path, epochs: int, kills: int) -> dict:
    data = work / "restart" / "d.h5"
    n = 4096
    write_h5(data, n)
    spec = stoker.hdf5(str(data), fields={"label": "label"})
    d = Daemon(binary, work / "restart-daemon", work, threads=2, depth=4)
    kw = dict(batch_size=32, shuffle=True, seed=9, socket=d.socket)
    ref = stoker.Loader(spec, **kw)
    expected = []
    for e in range(epochs):
        ref.set_epoch(e)
        expected.append(np.concatenate([np.array(b["label"]) for b in ref]))
    ref.close()
    del ref
    loader = stoker.Loader(spec, reconnect=60, **kw)
    rng = random.Random(1)
    total = epochs * len(loader)
    kill_at = sorted(rng.sample(range(1, total), kills))
    exact = 0
    step = 0
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for e in range(epochs):
            loader.set_epoch(e)
            got = []
            for b in loader:
                got.append(np.array(b["label"]))
                del b
                step += 1
                if kill_at and step == kill_at[0]:
                    kill_at.pop(0)
                    d.stop()
                    d = Daemon(binary, work / "restart-daemon", work, threads=2, depth=4)
            exact += int(np.array_equal(np.concatenate(got), expected[e]))
    d.stop()
    return {"epochs": epochs, "restarts": kills, "exact_epochs": exact}


def fuzz(binary: str, work: Path, connections: int) -> dict:
    data = work / "fuzz" / "d.h5"
    write_h5(data, 256)
    rng = random.Random(7)
    hello = b"\x00\x06\x04fuzz\x00"  # Hello, protocol 6, client "fuzz", no job
    with Daemon(binary, work / "fuzz-daemon", work, threads=2, depth=4) as d:
        import socket

        sent = 0
        for i in range(connections):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(2)
            try:
                s.connect(d.socket)
                if rng.random() < 0.7:
                    s.sendall(struct.pack("<I", len(hello)) + hello)
                for _ in range(rng.randint(1, 8)):
                    kind = rng.random()
                    if kind < 0.4:
                        body = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))
                        frame = struct.pack("<I", len(body)) + body
                    elif kind < 0.6:  # a valid-looking header with a hostile length
                        frame = struct.pack("<I", rng.choice([0, 1 << 20, (1 << 32) - 1, rng.getrandbits(32)]))
                    elif kind < 0.8:  # Next / Release / SetEpoch / Close / Wake / Fetch / Segment, random ids
                        v = rng.choice([2, 3, 4, 7, 8, 9, 10])
                        body = bytes([v]) + bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 20)))
                        frame = struct.pack("<I", len(body)) + body
                    else:
                        frame = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 40)))
                    s.sendall(frame)
                    sent += 1
                try:
                    s.recv(4096)
                except OSError:
                    pass
            except OSError:
                pass
            finally:
                s.close()
        alive = d.proc.poll() is None
        loader = stoker.Loader(stoker.hdf5(str(data), fields={"label": "label"}), batch_size=16, shuffle=False,
                               socket=d.socket)
        served = np.array_equal(np.concatenate([np.array(b["label"]) for b in loader]), np.arange(256))
        return {"connections": connections, "frames": sent, "crashes": int(not alive), "served_after": served}


def changing_files(binary: str, work: Path) -> list[tuple[str, str, bool]]:
    """(case, outcome, daemon alive) for files that change under the daemon."""
    out = []
    root = work / "change"
    with Daemon(binary, work / "change-daemon", work, threads=2, depth=2) as d:
        def attempt(spec, n_expected=None, check=None) -> str:
            try:
                loader = stoker.Loader(spec, batch_size=16, shuffle=False, socket=d.socket, timeout=60)
                rows = [np.array(b["label"] if "label" in b else b["v"]) for b in loader]
                got = np.concatenate(rows) if rows else np.array([])
                if check is not None:
                    return "correct data" if check(got) else f"WRONG DATA ({got[:5]}…)"
                return f"{len(got)} rows"
            except stoker.StokerError as e:
                return f"{type(e).__name__}: {str(e)[:110]}"

        # HDF5 replaced by rename while a stream of it is open, then read anew.
        path = root / "r.h5"
        write_h5(path, 64)
        spec = stoker.hdf5(str(path), fields={"label": "label"})
        first = stoker.Loader(spec, batch_size=16, shuffle=False, socket=d.socket)
        it = iter(first)
        next(it)
        tmp = root / "r.tmp.h5"
        with h5py.File(tmp, "w") as f:
            f["label"] = np.arange(1000, 1080, dtype=np.int64)
            f["x"] = np.zeros((80, 32), np.float32)
        os.rename(tmp, path)
        out.append(("HDF5 replaced by rename, new Loader",
                    attempt(spec, check=lambda g: np.array_equal(g, np.arange(1000, 1080))), d.proc.poll() is None))
        first.close()
        # HDF5 grown (rows appended, locking off as on Lustre/NFS).
        grown = root / "g.h5"
        with h5py.File(grown, "w") as f:
            f.create_dataset("label", data=np.arange(960, dtype=np.int64), maxshape=(None,), chunks=(64,))
        gspec = stoker.hdf5(str(grown), fields={"label": "label"})
        attempt(gspec)
        env = dict(os.environ, HDF5_USE_FILE_LOCKING="FALSE")
        subprocess.run([sys.executable, "-c", (
            "import h5py, numpy as np, sys\n"
            "with h5py.File(sys.argv[1], 'a') as f:\n"
            "    f['label'].resize((1100,)); f['label'][960:] = np.arange(960, 1100)\n"
        ), str(grown)], env=env, check=True)
        out.append(("HDF5 grown by 140 rows, new Loader",
                    attempt(gspec, check=lambda g: np.array_equal(g, np.arange(1100))), d.proc.poll() is None))
        # HDF5 deleted.
        gone = root / "x.h5"
        write_h5(gone, 32)
        xspec = stoker.hdf5(str(gone), fields={"label": "label"})
        attempt(xspec)
        gone.unlink()
        out.append(("HDF5 deleted, new Loader", attempt(xspec), d.proc.poll() is None))
        # LMDB truncated at rest, and corrupted pages.
        try:
            import lmdb
        except ImportError:
            lmdb = None
        if lmdb is not None:
            for case in ("truncated to half", "truncated to 0", "random bytes in data pages"):
                envdir = root / f"env-{case.replace(' ', '-')}"
                e = lmdb.open(str(envdir), map_size=64 << 20)
                with e.begin(write=True) as txn:
                    for i in range(2000):
                        txn.put(f"{i:08d}".encode(), np.full(64, i, np.int32).tobytes())
                e.close()
                mdb = envdir / "data.mdb"
                size = mdb.stat().st_size
                if case == "truncated to half":
                    os.truncate(mdb, size // 2)
                elif case == "truncated to 0":
                    os.truncate(mdb, 0)
                else:
                    rng = random.Random(3)
                    with open(mdb, "r+b") as f:
                        for _ in range(6):
                            f.seek(rng.randrange(2 * 4096, size - 64))
                            f.write(bytes(rng.getrandbits(8) for _ in range(64)))
                lspec = stoker.lmdb(str(envdir), fields={"v": {"codec": "raw", "dtype": "int32", "shape": [64]}})
                out.append((f"LMDB {case}", attempt(lspec), d.proc.poll() is None))
                if d.proc.poll() is not None:
                    break
    return out


def concurrent_reader(args: tuple[str, str, int, int]) -> bool:
    path, sock, rank, world = args
    loader = stoker.Loader(stoker.hdf5(path, fields={"x": "x", "label": "label"}), batch_size=32, shuffle=True,
                           seed=rank, socket=sock)
    with h5py.File(path, "r") as f:
        ref = f["x"][:]
    ok = True
    for b in loader:
        ok &= bool(np.array_equal(np.asarray(b["x"]), ref[np.asarray(b["label"])]))
    return ok


def concurrency(binary: str, work: Path, clients: int) -> dict:
    data = work / "conc" / "d.h5"
    write_h5(data, 4096)
    with Daemon(binary, work / "conc-daemon", work, threads=2, depth=4) as d:
        t0 = time.perf_counter()
        with mp.get_context("spawn").Pool(min(clients, 8)) as pool:
            oks = pool.map(concurrent_reader, [(str(data), d.socket, r, clients) for r in range(clients)])
        wall = time.perf_counter() - t0
        return {"clients": clients, "all_exact": all(oks), "wall_s": wall, "alive": d.proc.poll() is None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--stoker")
    args = ap.parse_args()
    binary = stoker_bin(args.stoker)
    work = Path(tempfile.mkdtemp(prefix="stoker-rel-"))
    try:
        kills = client_kills(binary, work, 10 if args.quick else 100)
        rs = restarts(binary, work, 2 if args.quick else 4, 3 if args.quick else 10)
        fz = fuzz(binary, work, 200 if args.quick else 3000)
        ch = changing_files(binary, work)
        cc = concurrency(binary, work, 8 if args.quick else 32)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    b, a = kills["before"], kills["after"]
    lines = [
        "# Reliability figures",
        "",
        "Produced by `benches/reliability.py` against the real daemon; rerun with",
        "",
        "```sh",
        f".venv/bin/python benches/{Path(__file__).name}{' ' + shlex.join(sys.argv[1:]) if sys.argv[1:] else ''}",
        "```",
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in machine_info().items()),
        "",
        "| check | result |",
        "| --- | --- |",
        f"| {kills['rounds']} clients SIGKILLed holding 2 batches each | descriptors {b[0]} → {a[0]}, memfds {b[1]} → "
        f"{a[1]}, RSS {b[2]:.0f} → {a[2]:.0f} MB, other clients left {kills['clients_after']}, daemon alive: "
        f"{kills['alive']} |",
        f"| daemon restarted (SIGTERM + new daemon) {rs['restarts']} times during {rs['epochs']} epochs, client "
        f"`reconnect=60` | {rs['exact_epochs']}/{rs['epochs']} epochs exact (no sample repeated or skipped) |",
        f"| {fz['connections']} connections of fuzzed frames ({fz['frames']} frames) | {fz['crashes']} crashes; "
        f"served correctly afterwards: {fz['served_after']} |",
        f"| {cc['clients']} concurrent client processes, values checked against h5py | all exact: "
        f"{cc['all_exact']}, {cc['wall_s']:.1f} s, daemon alive: {cc['alive']} |",
    ]
    for case, outcome, alive in ch:
        lines.append(f"| {case} | {outcome.replace('|', '/')}; daemon alive: {alive} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.quick:
        (REPO / "docs" / "reliability-figures.md").write_text(text)


if __name__ == "__main__":
    main()
