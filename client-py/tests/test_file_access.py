"""How the daemon opens the files a client names: regular files only, by handle
beneath the allowed roots (a symlink swapped in cannot lead outside), with the
client's rights when the daemon runs as root, re-opened when they change,
closed when no stream uses them, and never more at once than the descriptor
limit allows."""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import h5py
import numpy as np
import pytest

from conftest import SUBPROCESS_TIMEOUT_S, Daemon, check_field, make_config, poll, stoker_bin
from lmdb_data import key, write_env

TEST_USER = "stoker-fa-test"
TEST_GROUP = "stoker-fa-grp"


def write_rows(path: Path, values: np.ndarray) -> None:
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=values, maxshape=(None, *values.shape[1:]))


def read_all(stoker: Any, spec: Any, socket: str, batch_size: int = 64, **kw: Any) -> np.ndarray:
    loader = stoker.Loader(spec, batch_size=batch_size, shuffle=False, socket=socket, timeout=60, **kw)
    try:
        return np.concatenate([np.array(b["x"]) for b in loader])
    finally:
        loader.close()


def fd_targets(pid: int) -> list[str]:
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return out


# --------------------------------------------------------------------------
# Regular files only: a FIFO must not block an open
# --------------------------------------------------------------------------


def test_fifo_key_file_is_refused_quickly(stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path) -> None:
    env = write_env(tmp_path / "env.lmdb", {key(i): bytes([i]) * 4 for i in range(8)})
    fifo = tmp_path / "keys.fifo"
    os.mkfifo(fifo)
    daemon = start_daemon(allowed_roots=[tmp_path], threads=2)
    spec = stoker.lmdb(env, fields={"x": {"codec": "raw", "dtype": "uint8", "shape": [4]}}, key_file=fifo)
    # Before the fix each open blocked a thread of the blocking pool forever;
    # enough of them exhausted it. Now each is refused at once.
    for _ in range(40):
        with pytest.raises(stoker.DatasetError) as err:
            loader = stoker.Loader(spec, batch_size=4, socket=daemon.socket, timeout=30)
            next(iter(loader))
        message = str(err.value)
        assert "FIFO" in message and str(fifo) in message, message
    # The daemon still serves.
    plain = stoker.lmdb(env, fields={"x": {"codec": "raw", "dtype": "uint8", "shape": [4]}})
    loader = stoker.Loader(plain, batch_size=8, shuffle=False, socket=daemon.socket, timeout=30)
    (batch,) = list(loader)
    assert np.array_equal(np.array(batch["x"])[:, 0], np.arange(8))
    loader.close()


def test_key_files_are_bounded_before_they_are_read(
    stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path
) -> None:
    """A key file is a user's file: a 2 GiB sparse one (no disk blocks) took
    the daemon to 8 GiB; now its size, line length, key length and the key
    text echoed in messages are all bounded, and the daemon serves on."""
    env = write_env(tmp_path / "env.lmdb", {key(i): bytes([i]) * 4 for i in range(8)})
    daemon = start_daemon(allowed_roots=[tmp_path], threads=2)
    fields = {"x": {"codec": "raw", "dtype": "uint8", "shape": [4]}}
    sparse = tmp_path / "sparse.txt"
    with open(sparse, "wb") as f:
        f.truncate(2 << 30)
    long_line = tmp_path / "long-line.txt"
    long_line.write_bytes(key(0).encode() + b"\n" + b"k" * 10_000 + b"\n")
    long_key = tmp_path / "long-key.txt"
    long_key.write_bytes(b"k" * 600 + b"\n")
    not_text = tmp_path / "binary.txt"
    not_text.write_bytes(b"\xff\xfe\n")
    cases = [
        (sparse, "more than a key file may be"),
        (long_line, "line 2 is longer than 4096 bytes"),
        (long_key, "more than LMDB's 511-byte limit"),
        (not_text, "line 1 is not UTF-8"),
    ]
    for path, expected in cases:
        with pytest.raises(stoker.DatasetError) as err:
            loader = stoker.Loader(
                stoker.lmdb(env, fields=fields, key_file=path), batch_size=4, socket=daemon.socket, timeout=30
            )
            next(iter(loader))
        message = str(err.value)
        assert expected in message and str(path) in message, message
    # A listed key the environment lacks is named, cut to a bounded length.
    missing = tmp_path / "missing.txt"
    missing.write_bytes(key(0).encode() + b"\n" + b"z" * 400 + b"\n")
    with pytest.raises(stoker.DatasetError) as err:
        loader = stoker.Loader(
            stoker.lmdb(env, fields=fields, key_file=missing), batch_size=4, socket=daemon.socket, timeout=30
        )
        next(iter(loader))
    message = str(err.value)
    assert "z" * 100 in message and "z" * 101 not in message and "400 bytes" in message, message
    # Nothing of the 2 GiB was ever allocated.
    status = Path(f"/proc/{daemon.proc.pid}/status").read_text()
    peak_kib = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")))
    assert peak_kib < 512 * 1024, f"daemon peak RSS {peak_kib} KiB"
    # The daemon still serves, a key file that is right included.
    good = tmp_path / "good.txt"
    good.write_bytes(b"".join(key(i).encode() + b"\n" for i in (3, 1, 2, 0)))
    loader = stoker.Loader(
        stoker.lmdb(env, fields=fields, key_file=good), batch_size=4, shuffle=False, socket=daemon.socket, timeout=30
    )
    (batch,) = list(loader)
    assert np.array_equal(np.array(batch["x"])[:, 0], [3, 1, 2, 0])
    loader.close()


def test_globs_are_bounded_walks_beneath_the_allowed_roots(
    stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path
) -> None:
    """`loop/**/x.h5` over two self-symlinks kept a daemon thread busy, memory
    growing, long after the client gave up; and the walk ran before the
    allowed_roots check. Now `**` does not follow symlinks into directories,
    and a pattern outside the roots is refused before anything is listed."""
    loop = tmp_path / "loop"
    loop.mkdir()
    os.symlink(loop, loop / "self")
    os.symlink(loop, loop / "again")
    daemon = start_daemon(allowed_roots=[tmp_path], threads=2)
    for _ in range(3):
        with pytest.raises(stoker.DatasetError, match="no files match"):
            stoker.Loader(
                stoker.hdf5(str(loop / "**" / "x.h5"), fields={"x": "x"}), batch_size=2, socket=daemon.socket, timeout=30
            )
    # One file in the tree: found once, not once per path through the links.
    write_rows(loop / "x.h5", np.arange(4, dtype="<i4").reshape(2, 2))
    loader = stoker.Loader(
        stoker.hdf5(str(loop / "**" / "x.h5"), fields={"x": "x"}), batch_size=2, socket=daemon.socket, timeout=30
    )
    assert len(loader) == 1
    loader.close()
    with pytest.raises(stoker.AccessDenied, match="allowed_roots"):
        stoker.Loader(stoker.hdf5("/usr/**/nothing.h5", fields={"x": "x"}), batch_size=2, socket=daemon.socket, timeout=30)
    # No thread of the daemon is left walking.
    busy = Path(f"/proc/{daemon.proc.pid}/stat").read_text().split()
    before = int(busy[13]) + int(busy[14])
    time.sleep(1.0)  # a walker left behind would use this second of CPU
    busy = Path(f"/proc/{daemon.proc.pid}/stat").read_text().split()
    assert int(busy[13]) + int(busy[14]) - before < 50, "the daemon is still busy after the clients left"


def test_a_glob_walk_stops_when_its_client_leaves(
    stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path
) -> None:
    """Item 3 of issue 22: a walk went on (bounded at 60 s) after the client
    that asked for it had gone. Six `**` over a chain of 40 directories is a
    walk of millions of listings; the client is killed a second in, and the
    daemon stops walking: its CPU time stays still."""
    chain = tmp_path / "chain"
    deep = chain
    for i in range(40):
        deep = deep / f"d{i}"
    deep.mkdir(parents=True)
    daemon = start_daemon(allowed_roots=[tmp_path], threads=2)
    pattern = str(chain / "**" / "**" / "**" / "**" / "**" / "**" / "nothing.h5")
    script = (
        "import stoker, sys\n"
        "stoker.Loader(stoker.hdf5(sys.argv[1], fields={'x': 'x'}), batch_size=2, socket=sys.argv[2], timeout=120)\n"
    )
    client = subprocess.Popen([sys.executable, "-c", script, pattern, daemon.socket])

    def cpu() -> int:
        fields = Path(f"/proc/{daemon.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])

    start = cpu()
    assert poll(lambda: cpu() - start > 50, 30), "the walk never started"  # half a second of walking
    client.kill()
    client.wait()
    time.sleep(0.5)  # the walk notices at its next directory entry
    before = cpu()
    time.sleep(1.5)  # a walker left behind would use this time
    assert cpu() - before < 30, "the daemon is still walking after its client left"
    assert daemon.alive()


def test_a_new_file_on_a_freed_inode_is_not_served_the_old_files_cache(
    stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path
) -> None:
    """The chunk cache was keyed by (device, inode, size, mtime), all of which
    a file's owner can match: a file created on a freed inode, truncated to
    the old size and given the old mtime (`utimensat`) was served the deleted
    file's decoded chunks. The status-change time, which only the kernel sets,
    is part of a file's identity now."""
    path = tmp_path / "d.h5"

    def write(values: np.ndarray) -> None:
        with h5py.File(path, "w") as f:
            f.create_dataset("x", data=values, chunks=(8, 4), compression="gzip")

    secret = np.arange(64 * 4, dtype="<i4").reshape(64, 4) + 1000
    write(secret)
    daemon = start_daemon(allowed_roots=[tmp_path], extra="[limits]\nidle_close_s = 0\n")
    spec = stoker.hdf5(str(path), fields={"x": "x"})

    def read() -> np.ndarray:
        loader = stoker.Loader(spec, batch_size=16, shuffle=False, socket=daemon.socket, timeout=30)
        out = np.concatenate([np.array(b["x"]) for b in loader])
        loader.close()
        return out

    assert np.array_equal(read(), secret)
    assert np.array_equal(read(), secret)  # served from the chunk cache now
    before = os.stat(path)

    def daemon_holds_it() -> bool:
        fds = Path(f"/proc/{daemon.proc.pid}/fd")
        return any(str(path) in os.readlink(fd) for fd in fds.iterdir() if fd.is_symlink())

    deadline = time.monotonic() + 30
    while daemon_holds_it():
        assert time.monotonic() < deadline, "the daemon kept the file open"
        time.sleep(0.05)
    path.unlink()
    write(np.zeros_like(secret))
    after = os.stat(path)
    if after.st_ino != before.st_ino:
        pytest.skip("the file system did not hand the freed inode to the new file")
    assert after.st_size <= before.st_size
    os.truncate(path, before.st_size)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    again = os.stat(path)
    assert (again.st_ino, again.st_size, again.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    assert np.array_equal(read(), np.zeros_like(secret)), "the new file was served the old file's cached chunks"


def test_a_readers_exclusive_lock_does_not_lock_the_daemon_out(
    stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path
) -> None:
    """Any user who can read a shared file could `flock(LOCK_EX)` it and make
    every libhdf5 open of it fail ("unable to lock file, errno = 11"), for all
    users and mid-epoch re-opens alike. The daemon opens HDF5 files without
    libhdf5's file locking."""
    import fcntl

    path = tmp_path / "shared.h5"
    write_rows(path, np.arange(16, dtype="<i4").reshape(8, 2))
    daemon = start_daemon(allowed_roots=[tmp_path])
    with open(path, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        loader = stoker.Loader(
            stoker.hdf5(str(path), fields={"x": "x"}), batch_size=4, shuffle=False, socket=daemon.socket, timeout=30
        )
        x = np.concatenate([np.array(b["x"]) for b in loader])
        loader.close()
    assert np.array_equal(x, np.arange(16, dtype="<i4").reshape(8, 2))


def test_hdf5_glob_matching_a_fifo_is_refused(stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path) -> None:
    write_rows(tmp_path / "a.h5", np.arange(6, dtype="<i4").reshape(3, 2))
    os.mkfifo(tmp_path / "b.h5")
    daemon = start_daemon(allowed_roots=[tmp_path])
    with pytest.raises(stoker.DatasetError) as err:
        loader = stoker.Loader(
            stoker.hdf5(str(tmp_path / "*.h5"), fields={"x": "x"}), batch_size=3, socket=daemon.socket, timeout=30
        )
        next(iter(loader))
    message = str(err.value)
    assert "FIFO" in message and str(tmp_path / "b.h5") in message, message


# --------------------------------------------------------------------------
# allowed_roots: resolved once, read by handle
# --------------------------------------------------------------------------


def test_symlink_swap_never_reads_outside_the_root(stoker: Any, start_daemon: Callable[..., Any]) -> None:
    base = Path(tempfile.mkdtemp(prefix="stk-fa-", dir="/tmp"))
    try:
        root, outside = base / "root", base / "outside"
        (root / "real").mkdir(parents=True)
        outside.mkdir()
        write_rows(root / "real" / "d.h5", np.zeros((4, 2), dtype="<i4"))
        write_rows(outside / "d.h5", np.full((4, 2), 999, dtype="<i4"))
        daemon = start_daemon(allowed_roots=[root])
        link = root / "sub"
        stop = threading.Event()

        def swap() -> None:
            # `sub` flips between a symlink inside the root and one leading out of it.
            while not stop.is_set():
                for target in (root / "real", outside):
                    tmp = root / "sub.tmp"
                    try:
                        tmp.unlink()
                    except FileNotFoundError:
                        pass
                    tmp.symlink_to(target)
                    os.replace(tmp, link)

        link.symlink_to(root / "real")
        swapper = threading.Thread(target=swap, daemon=True)
        swapper.start()
        served, refused = 0, 0
        try:
            for _ in range(150):
                try:
                    x = read_all(stoker, stoker.hdf5(str(link / "d.h5"), fields={"x": "x"}), daemon.socket)
                except (stoker.AccessDenied, stoker.DatasetError):
                    refused += 1
                    continue
                assert not (x == 999).any(), "served a file from outside allowed_roots"
                served += 1
        finally:
            stop.set()
            swapper.join()
        assert served + refused == 150
    finally:
        shutil.rmtree(base, ignore_errors=True)


# --------------------------------------------------------------------------
# The client's rights (daemon running as root)
# --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def other_user() -> Iterator[tuple[int, int, int]]:
    """(uid, gid, supplementary gid) of a throwaway user; root only."""
    if os.geteuid() != 0:
        pytest.skip("needs root: creates a user and runs the daemon as root")
    if shutil.which("useradd") is None or shutil.which("groupadd") is None:
        pytest.skip("needs useradd and groupadd")
    created_user = created_group = False
    try:
        grp.getgrnam(TEST_GROUP)
    except KeyError:
        subprocess.run(["groupadd", TEST_GROUP], check=True)
        created_group = True
    try:
        pwd.getpwnam(TEST_USER)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "-G", TEST_GROUP, TEST_USER], check=True)
        created_user = True
    pw = pwd.getpwnam(TEST_USER)
    yield pw.pw_uid, pw.pw_gid, grp.getgrnam(TEST_GROUP).gr_gid
    if created_user:
        subprocess.run(["userdel", TEST_USER], check=False)
    if created_group:
        subprocess.run(["groupdel", TEST_GROUP], check=False)


CLIENT = r"""
import json, os, sys
import numpy as np
import stoker
args = json.loads(sys.argv[1])
# Everything is imported (the interpreter may live where the user cannot
# read); now become the user, with exactly the groups given.
os.setgroups(args["groups"])
os.setgid(args["gid"])
os.setuid(args["uid"])
try:
    if args["kind"] == "lmdb":
        spec = stoker.lmdb(args["files"], fields={"x": {"codec": "raw", "dtype": "int32", "shape": [2]}})
    else:
        spec = stoker.hdf5(args["files"], fields=args["fields"], transforms=args.get("transforms"))
    loader = stoker.Loader(spec, batch_size=4, shuffle=False, socket=args["socket"], timeout=60)
    x = np.concatenate([np.array(b["x"]) for b in loader])
    print(json.dumps({"ok": x.tolist()}))
except stoker.StokerError as e:
    print(json.dumps({"error": type(e).__name__, "message": str(e)}))
"""


def run_as(
    uid: int,
    gid: int,
    groups: list[int],
    socket: str,
    files: str,
    kind: str = "hdf5",
    transforms: Any = None,
    fields: dict[str, str] | None = None,
) -> dict[str, Any]:
    args = {"socket": socket, "files": files, "uid": uid, "gid": gid, "groups": groups, "kind": kind}
    args["fields"] = fields or {"x": "x"}
    if transforms is not None:
        args["transforms"] = transforms
    res = subprocess.run(
        [sys.executable, "-c", CLIENT, json.dumps(args)], capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def _root_daemon_and_files(uid: int, extra: str = "", limits: str = "") -> Iterator[tuple[Path, Path, Daemon]]:
    """A daemon running as root that serves `uid` too (socket open to all,
    allowed root `base`), with `base/public/p.h5` (0..7) readable by all and
    `base/secret/s.h5` (999s) readable by root only: `(public, secret, daemon)`."""
    base = Path(tempfile.mkdtemp(prefix="stk-fa-", dir="/tmp"))
    workdir = Path(tempfile.mkdtemp(prefix="stk-", dir="/tmp"))
    d = None
    try:
        os.chmod(base, 0o755)
        os.chmod(workdir, 0o755)
        public = base / "public"
        public.mkdir(mode=0o755)
        secret = base / "secret"
        secret.mkdir(mode=0o700)
        write_rows(public / "p.h5", np.arange(8, dtype="<i4").reshape(4, 2))
        write_rows(secret / "s.h5", np.full((4, 2), 999, dtype="<i4"))
        os.chmod(secret / "s.h5", 0o600)
        config = make_config(str(workdir / "stoker.sock"), allowed_roots=[base])
        config = config.replace("[server]\n", f"[server]\nallowed_uids = [{uid}]\n", 1)
        d = Daemon(workdir, config + "\n[limits]\nidle_close_s = 0\n" + limits + extra)
        os.chmod(d.socket, 0o777)
        yield public, secret, d
    finally:
        if d is not None:
            d.stop()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)


def test_client_reads_only_what_it_may(stoker: Any, other_user: tuple[int, int, int]) -> None:
    uid, gid, extra_gid = other_user
    with _root_daemon_and_files(uid) as (public, secret, d):
        shared = public.parent / "shared"
        shared.mkdir(mode=0o750)
        os.chown(shared, 0, extra_gid)
        write_rows(shared / "g.h5", np.full((4, 2), 7, dtype="<i4"))
        os.chown(shared / "g.h5", 0, extra_gid)
        os.chmod(shared / "g.h5", 0o640)
        # Root opens the shared file first: a cached dataset is no way around the check.
        x = read_all(stoker, stoker.hdf5(str(shared / "g.h5"), fields={"x": "x"}), d.socket)
        assert (x == 7).all()
        # As root, the daemon could read all three; the user can read two.
        got = run_as(uid, gid, [extra_gid], d.socket, str(public / "p.h5"))
        assert got.get("ok") == np.arange(8).reshape(4, 2).tolist(), got
        got = run_as(uid, gid, [extra_gid], d.socket, str(shared / "g.h5"))
        assert got.get("ok") == np.full((4, 2), 7).tolist(), got
        got = run_as(uid, gid, [extra_gid], d.socket, str(secret / "s.h5"))
        assert got.get("error") == "AccessDenied", got
        assert str(secret / "s.h5") in got["message"] and "client's rights" in got["message"], got
        # Without the group, the shared file is closed to it.
        got = run_as(uid, gid, [], d.socket, str(shared / "g.h5"))
        assert got.get("error") == "AccessDenied", got
        # The same for LMDB environments.
        rows = {key(i): np.array([i, -i], dtype="<i4").tobytes() for i in range(4)}
        write_env(public / "env.lmdb", rows)
        write_env(secret / "env.lmdb", rows)
        got = run_as(uid, gid, [extra_gid], d.socket, str(public / "env.lmdb"), kind="lmdb")
        assert got.get("ok") == [[i, -i] for i in range(4)], got
        got = run_as(uid, gid, [extra_gid], d.socket, str(secret / "env.lmdb"), kind="lmdb")
        assert got.get("error") == "AccessDenied", got
        assert str(secret / "env.lmdb") in got["message"], got
        # A normalize statistics file is read with the client's rights too: a
        # secret one is refused without a word of its contents.
        stats = "mean: {x: 1.0}\nstd: {x: 2.0}\nsecret_key_name: {hidden: 1}\n"
        (public / "stats.yaml").write_text(stats)
        (secret / "stats.yaml").write_text(stats.replace("1.0", "3.0"))
        os.chmod(public / "stats.yaml", 0o644)
        os.chmod(secret / "stats.yaml", 0o600)
        norm = lambda where: {"x": [{"normalize": {"stats": str(where / "stats.yaml")}}]}  # noqa: E731
        got = run_as(uid, gid, [extra_gid], d.socket, str(public / "p.h5"), transforms=norm(public))
        assert got.get("ok") == ((np.arange(8).reshape(4, 2) - 1.0) / 2.0).tolist(), got
        got = run_as(uid, gid, [extra_gid], d.socket, str(public / "p.h5"), transforms=norm(secret))
        assert got.get("error") == "AccessDenied", got
        assert str(secret / "stats.yaml") in got["message"] and "3.0" not in got["message"], got
        assert "secret_key_name" not in got["message"], got
        # Root itself still reads the secret file.
        x = read_all(stoker, stoker.hdf5(str(secret / "s.h5"), fields={"x": "x"}), d.socket)
        assert (x == 999).all()


def _write_redirects(public: Path, secret: Path) -> dict[str, Path]:
    """HDF5 files in `public` whose field `x` takes its values from `secret`:
    through an external link (to the dataset, or to a group on the way), a
    virtual dataset, and external raw storage (any file's bytes, not only
    HDF5's). libhdf5 opens those files itself, by path, when it meets them."""
    raw = secret / "raw.bin"
    raw.write_bytes(np.full((4, 2), 999, dtype="<i4").tobytes())
    os.chmod(raw, 0o600)
    out = {name: public / f"{name}.h5" for name in ("elink", "elink_group", "soft_elink", "vds", "efl")}
    with h5py.File(out["elink"], "w") as f:
        f["x"] = h5py.ExternalLink(str(secret / "s.h5"), "/x")
    with h5py.File(out["elink_group"], "w") as f:
        f["g"] = h5py.ExternalLink(str(secret / "s.h5"), "/")
    with h5py.File(out["soft_elink"], "w") as f:  # a soft link whose path crosses an external one
        f["g"] = h5py.ExternalLink(str(secret / "s.h5"), "/")
        f["x"] = h5py.SoftLink("/g/x")
    layout = h5py.VirtualLayout(shape=(4, 2), dtype="<i4")
    layout[:] = h5py.VirtualSource(str(secret / "s.h5"), "x", shape=(4, 2))
    with h5py.File(out["vds"], "w") as f:
        f.create_virtual_dataset("x", layout)
    with h5py.File(out["efl"], "w") as f:
        f.create_dataset("x", shape=(4, 2), dtype="<i4", external=[(str(raw), 0, 32)])
    for path in out.values():
        os.chmod(path, 0o644)
    return out


def _assert_refused(got: dict[str, Any], path: Path, name: str) -> None:
    assert "ok" not in got, (name, got)
    assert got["error"] == "DatasetError", (name, got)
    assert str(path) in got["message"] and '"x"' in got["message"], (name, got)
    assert "name the file that holds the data" in got["message"], (name, got)
    assert "999" not in got["message"], (name, got)


def _fields(name: str) -> dict[str, str]:
    return {"x": "g/x"} if name == "elink_group" else {"x": "x"}


def test_hdf5_files_cannot_lead_the_daemon_outside_the_allowed_roots(
    stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path
) -> None:
    """A file beneath the allowed roots whose field is an external link, a
    virtual dataset or external raw storage would have libhdf5 open a file
    outside them, by path (a virtual dataset and external storage were served,
    an external link read the other file's chunk offsets from this one). Each
    is refused when the stream opens, naming file, field and what to do;
    `stoker inspect` marks them not servable; the daemon serves on."""
    public, outside = tmp_path / "root", tmp_path / "outside"
    public.mkdir()
    outside.mkdir()
    write_rows(public / "p.h5", np.arange(8, dtype="<i4").reshape(4, 2))
    write_rows(outside / "s.h5", np.full((4, 2), 999, dtype="<i4"))
    escapes = _write_redirects(public, outside)
    d = start_daemon(allowed_roots=[public])
    for name, path in escapes.items():
        with pytest.raises(stoker.DatasetError) as exc:
            read_all(stoker, stoker.hdf5(str(path), fields=_fields(name)), d.socket)
        _assert_refused({"error": "DatasetError", "message": str(exc.value)}, path, name)
        # The same file named in a glob with a good one: the whole open is refused.
        with pytest.raises(stoker.DatasetError):
            read_all(stoker, stoker.hdf5(str(public / "*.h5"), fields=_fields(name)), d.socket)
    assert not [t for t in fd_targets(d.proc.pid) if str(outside) in t]
    # Links within the file are followed as before.
    with h5py.File(public / "p.h5", "a") as f:
        f["soft"] = h5py.SoftLink("/x")
        f["hard"] = f["x"]
    for path in ("x", "soft", "hard"):
        x = read_all(stoker, stoker.hdf5(str(public / "p.h5"), fields={"x": path}), d.socket)
        assert (x == np.arange(8).reshape(4, 2)).all(), path
    assert d.alive()
    # stoker inspect follows no external link and says why each is not servable.
    for name, path in escapes.items():
        res = subprocess.run(
            [str(stoker_bin()), "inspect", "--json", str(path)], capture_output=True, text=True, timeout=60
        )
        assert res.returncode == 0, res.stderr
        reports = {r["path"]: r for r in json.loads(res.stdout)}
        top = "g" if name == "elink_group" else "x"
        assert not reports[top]["servable"], (name, reports)
        assert "not servable" in reports[top]["read_path"], (name, reports)
        assert "999" not in res.stdout


HOLDER = r"""
import os, socket, sys
uid, gid, path, n = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
os.setgroups([])
os.setgid(gid)
os.setuid(uid)
held = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    held.append(s)
print("held", flush=True)
sys.stdin.read()
"""


def test_connections_of_a_refused_uid_cannot_pile_up(other_user: tuple[int, int, int]) -> None:
    """A uid that is not allowed (socket 0666, as the docs prescribe with
    allowed_uids) opened connections in a loop: each was held while the daemon
    waited to tell it why, until the daemon ran out of descriptors and root
    could not get in. Refusals being told are bounded; the rest are closed."""
    uid, gid, _ = other_user
    with _root_daemon_and_files(uid + 54321) as (public, _secret, d):
        fds = Path(f"/proc/{d.proc.pid}/fd")
        before = len(list(fds.iterdir()))
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(uid), str(gid), d.socket, "600"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
            # Let the daemon accept them all; those beyond the bound are closed
            # at once (the old daemon held each for frame_timeout_s, 10 s).
            deadline = time.monotonic() + 5
            while True:
                held = len(list(fds.iterdir())) - before
                if held <= 100 or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert held <= 100, f"the daemon holds {held} descriptors for refused connections"
            # Root is served meanwhile.
            res = run_as(0, 0, [0], d.socket, str(public / "p.h5"))
            assert res == {"ok": np.arange(8).reshape(4, 2).tolist()}, res
        finally:
            holder.kill()
            holder.wait()
        assert d.alive()


def test_hdf5_files_cannot_read_another_users_files_through_the_daemon(
    stoker: Any, other_user: tuple[int, int, int]
) -> None:
    """The same redirections, made by a user to a file only root may read,
    with the daemon running as root: refused, and the values never reach the
    user."""
    uid, gid, extra_gid = other_user
    with _root_daemon_and_files(uid) as (public, secret, d):
        redirects = _write_redirects(public, secret)
        for name, path in redirects.items():
            got = run_as(uid, gid, [extra_gid], d.socket, str(path), fields=_fields(name))
            _assert_refused(got, path, name)
        assert not [t for t in fd_targets(d.proc.pid) if str(secret) in t]
        got = run_as(uid, gid, [extra_gid], d.socket, str(public / "p.h5"))
        assert got.get("ok") == np.arange(8).reshape(4, 2).tolist(), got
        assert d.alive()


# --------------------------------------------------------------------------
# Identity: changed files are re-opened, never served stale or mixed
# --------------------------------------------------------------------------


def test_deleted_and_replaced_files_are_not_served_stale(
    stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path
) -> None:
    path = tmp_path / "d.h5"
    write_rows(path, np.zeros((4, 2), dtype="<i4"))
    daemon = start_daemon(allowed_roots=[tmp_path], extra="\n[limits]\nidle_close_s = 60\n")
    spec = stoker.hdf5(str(path), fields={"x": "x"})
    assert (read_all(stoker, spec, daemon.socket) == 0).all()
    # Replaced by rename: a new Loader reads the new contents.
    tmp = tmp_path / "d.h5.tmp"
    write_rows(tmp, np.full((6, 2), 5, dtype="<i4"))
    os.replace(tmp, path)
    x = read_all(stoker, spec, daemon.socket)
    assert x.shape == (6, 2) and (x == 5).all(), x
    # Deleted: a new Loader fails naming the file, rather than serving the old rows.
    path.unlink()
    with pytest.raises(stoker.DatasetError) as err:
        read_all(stoker, spec, daemon.socket)
    assert str(path) in str(err.value) or "no files match" in str(err.value), str(err.value)


def test_rows_appended_while_served(stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path) -> None:
    path = tmp_path / "grow.h5"
    write_rows(path, np.arange(64, dtype="<i4").reshape(32, 2))
    daemon = start_daemon(allowed_roots=[tmp_path], depth=2, extra="\n[limits]\nidle_close_s = 60\n")
    spec = stoker.hdf5(str(path), fields={"x": "x"})
    loader = stoker.Loader(spec, batch_size=2, shuffle=False, socket=daemon.socket, timeout=60)
    it = iter(loader)
    first = np.array(next(it)["x"])
    assert np.array_equal(first, [[0, 1], [2, 3]])
    # A writer appends rows (HDF5 file locking off, as users do to write while serving).
    with h5py.File(path, "a", locking=False) as f:
        f["x"].resize((48, 2))
        f["x"][32:] = np.arange(64, 96, dtype="<i4").reshape(16, 2)
    # The open stream fails naming the file, or serves only rows it read before the change.
    with pytest.raises(stoker.DatasetError) as err:
        for batch in it:
            x = np.array(batch["x"])
            rows = x[:, 0] // 2
            assert np.array_equal(x, np.stack([2 * rows, 2 * rows + 1], axis=1)), x
    message = str(err.value)
    assert str(path) in message and "while being served" in message, message
    loader.close()
    # A Loader opened after the writer finished reads every row, correctly.
    x = read_all(stoker, spec, daemon.socket)
    assert np.array_equal(x, np.arange(96, dtype="<i4").reshape(48, 2))


def test_files_close_when_the_last_loader_closes(
    stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path
) -> None:
    path = tmp_path / "own.h5"
    write_rows(path, np.arange(8, dtype="<i4").reshape(4, 2))
    daemon = start_daemon(allowed_roots=[tmp_path], extra="\n[limits]\nidle_close_s = 0\n")
    spec = stoker.hdf5(str(path), fields={"x": "x"})
    loader = stoker.Loader(spec, batch_size=4, shuffle=False, socket=daemon.socket, timeout=60)
    assert len(list(loader)) == 1
    assert str(path) in fd_targets(daemon.proc.pid)
    loader.close()
    del loader
    # Closed (and its HDF5 lock released) soon after: the owner can write it again.
    deadline = time.monotonic() + 20
    while str(path) in fd_targets(daemon.proc.pid):
        assert time.monotonic() < deadline, "the file is still open after its last Loader closed"
        time.sleep(0.05)
    with h5py.File(path, "a") as f:  # file locking on
        f["x"][0] = [100, 101]
    x = read_all(stoker, spec, daemon.socket)
    assert np.array_equal(x[0], [100, 101])


# --------------------------------------------------------------------------
# Descriptor limits: many files, bounded descriptors
# --------------------------------------------------------------------------


def limited_stoker(tmp: Path, nofile: int) -> Path:
    """A wrapper that starts the real binary with RLIMIT_NOFILE soft = hard = `nofile`."""
    wrapper = tmp / "stoker-limited"
    wrapper.write_text(f'#!/bin/sh\nulimit -n {nofile} || exit 99\nexec "{stoker_bin()}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    return wrapper


@pytest.mark.parametrize("max_open_files", [None, 64])
def test_many_files_under_a_low_descriptor_limit(
    stoker: Any,
    start_daemon: Callable[..., Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    max_open_files: int | None,
) -> None:
    root = tmp_path / "many"
    root.mkdir()
    rng = np.random.default_rng(5)
    ref = []
    for i in range(1100):
        rows = rng.integers(-(2**31), 2**31 - 1, size=(3, 4), dtype="<i4")
        rows[:, 0] = np.arange(3 * i, 3 * i + 3)
        write_rows(root / f"f{i:05d}.h5", rows)
        ref.append(rows)
    want = np.concatenate(ref)
    monkeypatch.setenv("STOKER_BIN", str(limited_stoker(tmp_path, 1024)))
    extra = "" if max_open_files is None else f"\n[limits]\nmax_open_files = {max_open_files}\n"
    daemon = start_daemon(allowed_roots=[tmp_path], extra=extra)
    with open(f"/proc/{daemon.proc.pid}/limits") as f:
        assert any(line.startswith("Max open files") and "1024" in line for line in f), "limit not applied"
    spec = stoker.hdf5(str(root / "*.h5"), fields={"x": "x"})
    loader = stoker.Loader(spec, batch_size=100, shuffle=True, seed=1, socket=daemon.socket, timeout=120)
    seen = np.zeros(len(want), dtype=bool)
    peak = 0
    for batch in loader:
        x = np.array(batch["x"])
        idx = x[:, 0]
        check_field("x", x, want[idx])
        seen[idx] = True
        peak = max(peak, sum(t.startswith(str(root)) for t in fd_targets(daemon.proc.pid)))
    loader.close()
    assert seen.all(), f"{(~seen).sum()} rows never served"
    # Two descriptors per open file, plus a few for files being opened or
    # still read by a worker thread right after they were closed.
    bound = 2 * (max_open_files or (1024 - 128) // 2) + 16
    assert peak <= bound, f"{peak} descriptors open under {root} (bound {bound})"
    assert len(fd_targets(daemon.proc.pid)) < 1024
    assert "EMFILE" not in daemon.stderr() and "Too many open files" not in daemon.stderr()


def test_a_users_hdf5_helper_runs_as_that_user_and_their_crafted_file_harms_nobody_else(
    stoker: Any, other_user: tuple[int, int, int]
) -> None:
    """Finding 1 of issue 22, as a real second user: a crafted file that
    crashes libhdf5 (chunk dimensions (16, 8388612), read through the library
    path) kills that user's helper only; root's stream on another file goes
    on, the daemon lives, and the user's helper ran with the user's uid."""
    from test_hdf5_helpers import helpers_of, write_crafted

    uid, gid, extra_gid = other_user
    with _root_daemon_and_files(uid, extra="[hdf5]\nfast_path = false\n") as (public, secret, d):
        mine = public.parent / "mine"
        mine.mkdir(mode=0o755)
        os.chown(mine, uid, gid)
        write_crafted(mine / "crafted.h5")
        os.chown(mine / "crafted.h5", uid, gid)
        loader = stoker.Loader(stoker.hdf5(str(public / "p.h5"), fields={"x": "x"}), batch_size=1, shuffle=False,
                               socket=d.socket, timeout=60, reconnect=0)
        it = iter(loader)
        first = next(it)["x"].copy()
        # The user's ad-hoc files are read by a helper running as the user.
        got = run_as(uid, gid, [extra_gid], d.socket, str(public / "p.h5"))
        assert got.get("ok") == np.arange(8).reshape(4, 2).tolist(), got
        uids = {}
        for pid in helpers_of(d.proc.pid):
            status = Path(f"/proc/{pid}/status").read_text()
            uids[pid] = [line.split()[1:] for line in status.splitlines() if line.startswith(("Uid:", "Gid:"))]
        assert [[str(uid)] * 4, [str(gid)] * 4] in uids.values(), uids
        # The attack: libhdf5 crashes on the user's file (this daemon reads
        # everything through libhdf5; a fast path that declines a file does too).
        got = run_as(uid, gid, [extra_gid], d.socket, str(mine / "crafted.h5"))
        assert got.get("error") == "DatasetError", got
        assert "crafted.h5" in got["message"] and "crashed" in got["message"], got
        assert d.alive(), d.stderr()
        rest = [first] + [b["x"].copy() for b in it]
        assert np.array_equal(np.concatenate(rest), np.arange(8).reshape(4, 2))
        loader.close()


def test_the_socket_mode_and_group_are_never_set_through_a_path_a_user_can_swap(
    other_user: tuple[int, int, int], tmp_path: Path
) -> None:
    """Finding 13 of issue 22: `chmod`/`chown` by path after `bind` follow a
    symlink the owner of the socket directory swaps in; a root daemon then
    gave a root-owned 0600 file the socket's mode and group. The socket is now
    bound, given its group and mode in a private directory and renamed into
    place, so the swap loop below has nothing to redirect."""
    uid, gid, extra_gid = other_user
    sockdir = Path(tempfile.mkdtemp(prefix="stk-sd-", dir="/tmp"))
    victim_dir = Path(tempfile.mkdtemp(prefix="stk-victim-", dir="/tmp"))
    try:
        os.chown(sockdir, uid, gid)
        os.chmod(sockdir, 0o755)
        victim = victim_dir / "secret"
        victim.write_text("root only")
        os.chmod(victim, 0o600)
        sock = sockdir / "s.sock"
        attacker = subprocess.Popen(
            [sys.executable, "-c", SWAPPER, str(sock), str(victim), str(uid), str(gid)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        try:
            for start in range(5):
                config = make_config(str(sock)).replace("[server]\n", f'[server]\nsocket_group = "{TEST_GROUP}"\n', 1)
                workdir = Path(tempfile.mkdtemp(prefix="stk-", dir="/tmp"))
                (workdir / "stoker.toml").write_text(config)
                # Not conftest's Daemon: the swapper replaces the socket, so
                # readiness is read from the log instead.
                serve = subprocess.Popen(
                    [str(stoker_bin()), "serve", "--config", str(workdir / "stoker.toml")],
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                )
                try:
                    deadline = time.monotonic() + 20
                    log = ""
                    while "listening" not in log and serve.poll() is None and time.monotonic() < deadline:
                        log += serve.stderr.readline()
                    assert "listening" in log, log
                    st = os.stat(victim)
                    assert (st.st_mode & 0o777, st.st_gid) == (0o600, 0), f"start {start}: victim now {st}"
                finally:
                    serve.terminate()
                    serve.wait(10)
                    shutil.rmtree(workdir, ignore_errors=True)
        finally:
            attacker.kill()
            attacker.wait()
        st = os.stat(victim)
        assert (st.st_mode & 0o777, st.st_gid) == (0o600, 0), st
    finally:
        shutil.rmtree(sockdir, ignore_errors=True)
        shutil.rmtree(victim_dir, ignore_errors=True)


# As the owner of the socket directory: keep swapping the socket path for a
# symlink to the victim (what a racing `chmod(path)` would follow).
SWAPPER = r"""
import os, sys
sock, victim, uid, gid = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
os.setgroups([]); os.setgid(gid); os.setuid(uid)
tmp = sock + ".lnk"
while True:
    try:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        os.symlink(victim, tmp)
        os.replace(tmp, sock)
    except OSError:
        pass
"""


def test_a_reopen_tells_a_user_nothing_of_paths_they_cannot_search(
    other_user: tuple[int, int, int]
) -> None:
    """Finding 12 of issue 22: a file closed by the open-files bound was
    opened again by path with the daemon's (root's) rights, so a user who
    swapped it for a symlink into a directory closed to them learnt from the
    error whether the target existed. Reopens now carry the client's rights:
    both targets give the same refusal."""
    uid, gid, extra_gid = other_user
    with _root_daemon_and_files(uid, limits="max_open_files = 1\n") as (public, secret, d):
        mine = public.parent / "mine"
        mine.mkdir(mode=0o755)
        for name in ("a.h5", "b.h5"):
            write_rows(mine / name, np.arange(8, dtype="<i4").reshape(4, 2))
        for p in (mine, mine / "a.h5", mine / "b.h5"):
            os.chown(p, uid, gid)
        messages = {}
        for target in ("s.h5", "nothing-here.h5"):
            args = {"socket": d.socket, "files": str(mine / "*.h5"), "uid": uid, "gid": gid, "groups": [extra_gid],
                    "swap": str(mine / "a.h5"), "target": str(secret / target)}
            res = subprocess.run([sys.executable, "-c", REOPENER, json.dumps(args)], capture_output=True, text=True,
                                 timeout=SUBPROCESS_TIMEOUT_S)
            assert res.returncode == 0, res.stderr
            got = json.loads(res.stdout.strip().splitlines()[-1])
            assert "error" in got, got
            messages[target] = got["message"].replace(target, "TARGET")
            (mine / "a.h5").unlink()
            write_rows(mine / "a.h5", np.arange(8, dtype="<i4").reshape(4, 2))
            os.chown(mine / "a.h5", uid, gid)
        assert messages["s.h5"] == messages["nothing-here.h5"], messages
        assert d.alive(), d.stderr()


# As the user: read both files of a dataset (the bound of one open file closes
# a.h5 to open b.h5), swap a.h5 for a symlink, and read a.h5 again.
REOPENER = r"""
import json, os, sys
import numpy as np
import stoker
args = json.loads(sys.argv[1])
os.setgroups(args["groups"]); os.setgid(args["gid"]); os.setuid(args["uid"])
loader = stoker.Loader(stoker.hdf5(args["files"], fields={"x": "x"}), batch_size=4, shuffle=False,
                       socket=args["socket"], timeout=60, reconnect=0)
list(loader)
os.unlink(args["swap"])
os.symlink(args["target"], args["swap"])
try:
    # The ring may hold batches read ahead before the swap: read past them.
    for _ in range(6):
        list(loader)
    print(json.dumps({"ok": True}))
except stoker.StokerError as e:
    print(json.dumps({"error": type(e).__name__, "message": str(e)}))
"""


def test_an_lmdb_environment_swapped_for_a_fifo_blocks_no_other_open(
    start_daemon: Callable[..., Daemon], stoker: Any, tmp_path: Path
) -> None:
    """Finding 5 of issue 22: LMDB environments were opened again by name
    (`mdb_env_open(path)`) after the checked open, with the process-wide
    table locked; a user swapping their `data.mdb` for a FIFO in a loop left
    a daemon thread blocked in the FIFO's open, and every other LMDB open
    waited behind it. LMDB now maps the data file checked by handle, and the
    table is never locked across an open."""
    rows = {key(i): bytes([i]) * 4 for i in range(8)}
    good = write_env(tmp_path / "good.lmdb", rows)
    evil = write_env(tmp_path / "evil.lmdb", rows)
    fifo = evil / "fifo"
    os.mkfifo(fifo)
    # Every open maps the environment anew (nothing stays open between Loaders).
    d = start_daemon(extra="[limits]\nidle_close_s = 0\n")
    # Another process (this one's GIL is held while a Loader opens).
    swapper = subprocess.Popen([sys.executable, "-c", EXCHANGER, str(evil / "data.mdb"), str(fifo)])
    try:
        spec = stoker.lmdb(str(evil), fields={"x": {"codec": "raw", "dtype": "uint8", "shape": [4]}})
        for _ in range(1000):
            try:
                loader = stoker.Loader(spec, batch_size=8, socket=d.socket, timeout=2, reconnect=0)
                list(loader)
                loader.close()
            except (stoker.DatasetError, stoker.AccessDenied, stoker.Timeout):
                pass
    finally:
        swapper.kill()
        swapper.wait()
    # Another environment opens at once.
    spec = stoker.lmdb(str(good), fields={"x": {"codec": "raw", "dtype": "uint8", "shape": [4]}})
    start = time.monotonic()
    x = read_all(stoker, spec, d.socket)
    assert time.monotonic() - start < 10
    assert sorted(x[:, 0].tolist()) == list(range(8))
    assert d.alive(), d.stderr()


# Swaps two paths (renameat2 RENAME_EXCHANGE) as fast as it can, until killed.
EXCHANGER = r"""
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
a, b = sys.argv[1].encode(), sys.argv[2].encode()
while True:
    libc.renameat2(-100, a, -100, b, 2)
"""


def test_one_users_many_loaders_leave_memory_for_another_user(stoker: Any, other_user: tuple[int, int, int]) -> None:
    """Finding 10 of issue 22: budgets were per connection only, so one
    user's Loaders could take the whole daemon budget (13 of them held 895
    MiB of 1 GiB) and root's small stream got LimitError. Each uid's streams
    now hold at most `max_memory_bytes_per_uid` (half the budget by default)."""
    uid, gid, extra_gid = other_user
    limits = "max_memory_bytes = 67108864\n"  # 64 MiB, no caches: 32 MiB per uid
    extra = "[cache]\nchunk_bytes = 0\nsample_bytes = 0\n"
    with _root_daemon_and_files(uid, extra=extra, limits=limits) as (public, secret, d):
        big = public.parent / "big"
        big.mkdir(mode=0o755)
        write_rows(big / "b.h5", np.zeros((64, 262144), dtype=np.uint8))  # 256 KiB rows
        hog = subprocess.Popen(
            [sys.executable, "-c", HOG, json.dumps({"socket": d.socket, "files": str(big / "b.h5"), "uid": uid,
                                                    "gid": gid, "groups": [extra_gid]})],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        try:
            line = hog.stdout.readline()
            got = json.loads(line)
            # 8 MiB rings (4 slots of 8 rows of 256 KiB): at most 4 fit in 32 MiB.
            assert 1 <= got["opened"] <= 4, got
            assert "max_memory_bytes_per_uid" in got["refusal"] and str(uid) in got["refusal"], got
            # Root's stream of the same size still opens while the user's are held.
            loader = stoker.Loader(stoker.hdf5(str(big / "b.h5"), fields={"x": "x"}), batch_size=8,
                                   socket=d.socket, timeout=60)
            assert next(iter(loader))["x"].shape == (8, 262144)
            loader.close()
        finally:
            hog.stdin.close()
            hog.wait(30)


# As the user: open Loaders (8 MiB rings) until one is refused, report, and
# hold them until stdin closes.
HOG = r"""
import json, os, sys
import stoker
args = json.loads(sys.argv[1])
os.setgroups(args["groups"]); os.setgid(args["gid"]); os.setuid(args["uid"])
held, refusal = [], ""
for _ in range(32):
    try:
        held.append(stoker.Loader(stoker.hdf5(args["files"], fields={"x": "x"}), batch_size=8,
                                  socket=args["socket"], timeout=60))
    except stoker.LimitError as e:
        refusal = str(e)
        break
print(json.dumps({"opened": len(held), "refusal": refusal}), flush=True)
sys.stdin.read()
"""


def test_a_per_user_daemon_serves_its_users_files_without_allowed_roots(other_user: tuple[int, int, int]) -> None:
    """Issue 24, item 9: a per-user daemon (not root, serving only its own
    user) refused the user's own ad-hoc files unless its config listed
    `allowed_roots`. Unset, such a daemon now allows `/`: it reads with that
    user's rights, for that user alone. Too long a socket path is named with
    its length and the limit."""
    uid, gid, extra_gid = other_user
    base = Path(tempfile.mkdtemp(prefix="stk-pu-", dir="/tmp"))
    try:
        os.chown(base, uid, gid)
        write_rows(base / "mine.h5", np.arange(8, dtype="<i4").reshape(4, 2))
        os.chown(base / "mine.h5", uid, gid)
        sock = base / "stoker.sock"

        def as_user() -> None:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)

        daemon = subprocess.Popen([str(stoker_bin()), "serve", "--socket", str(sock)], preexec_fn=as_user,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            ready = subprocess.run([str(stoker_bin()), "status", "--wait", "30", "--socket", str(sock)],
                                   capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S, preexec_fn=as_user)
            assert ready.returncode == 0, ready.stderr
            got = run_as(uid, gid, [], str(sock), str(base / "mine.h5"))
            assert got.get("ok") == np.arange(8).reshape(4, 2).tolist(), got
        finally:
            daemon.terminate()
            daemon.wait(timeout=SUBPROCESS_TIMEOUT_S)
        long = "/tmp/" + "s" * 120 + ".sock"
        res = subprocess.run([str(stoker_bin()), "serve", "--socket", long], capture_output=True, text=True,
                             timeout=SUBPROCESS_TIMEOUT_S)
        assert res.returncode != 0 and "at most 107" in res.stderr and "130 bytes" in res.stderr, res.stderr
        res = subprocess.run([str(stoker_bin()), "status", "--socket", long], capture_output=True, text=True,
                             timeout=SUBPROCESS_TIMEOUT_S)
        assert "at most 107" in res.stderr and "130 bytes" in res.stderr, res.stderr
    finally:
        shutil.rmtree(base, ignore_errors=True)
