"""The daemon survives bad clients and bad input, and says what went wrong.

Clients that are SIGKILLed, datasets that are broken in each way a user can
break them, garbage on the socket: each is answered with a clear error (or a
clean-up), and the same daemon goes on serving correct batches.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from conftest import stop_process, wait_until_blocked

BATCH = 4

# A training process that takes `hold` batches, keeps them and says READY;
# then it either sleeps ("sleep"), or waits for a line on stdin and iterates
# the rest of the epoch ("iterate"), which blocks in next() while the test
# has the daemon stopped.
SLOW_CLIENT = r"""
import json, sys, time
import stoker
a = json.loads(sys.argv[1])
loader = stoker.Loader(stoker.hdf5(a["glob"], fields=a["fields"]), batch_size=a["batch_size"],
                       shuffle=True, seed=0, rank=0, world_size=1, socket=a["socket"])
it = iter(loader)
held = [next(it) for _ in range(a["hold"])]
print("READY", flush=True)
if a["mode"] == "iterate":
    sys.stdin.readline()
    del held
    try:
        print("ITERATING", flush=True)
        for batch in it:
            print("BATCH", flush=True)
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
        sys.exit(0)
    print("EPOCH DONE", flush=True)
time.sleep(600)
"""


def spawn_slow_client(d: Any, data: Any, hold: int, mode: str = "sleep") -> subprocess.Popen[str]:
    args = {"glob": data.glob, "fields": data.fields, "batch_size": BATCH, "socket": d.socket,
            "hold": hold, "mode": mode}
    p = subprocess.Popen(
        [sys.executable, "-c", SLOW_CLIENT, json.dumps(args)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    ready, _, _ = select.select([p.stdout], [], [], 60)
    line = p.stdout.readline() if ready else ""
    if line.strip() != "READY":
        p.kill()
        _, err = p.communicate()
        pytest.fail(f"slow client did not get ready: {line!r}\n{err}")
    return p


def block_in_next(d: Any, child: subprocess.Popen[str]) -> None:
    """Stop the daemon (SIGSTOP), then let `child` iterate: once it has taken
    the batches already in its ring, its next() waits for the daemon."""
    def filled() -> bool:
        s = streams_of(d.status(), child.pid)
        return bool(s) and s[0]["slots_filled"] >= 1

    deadline = time.monotonic() + 10
    while not filled() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert filled(), f"child's ring never filled: {d.status()}"
    stop_process(d.proc.pid)
    child.stdin.write("go\n")
    child.stdin.flush()
    # Once it says ITERATING it is about to call next(); wait until it has
    # taken any batch that needs no answer from the daemon and waits for one.
    ready, _, _ = select.select([child.stdout], [], [], 30)
    line = child.stdout.readline() if ready else ""
    assert line.strip() == "ITERATING", (line, child.poll())
    wait_until_blocked(child, "the child waiting in next() for the stopped daemon")


def streams_of(status: dict[str, Any], pid: int) -> list[dict[str, Any]]:
    return [s for s in status["streams"] if s["pid"] == pid]


def clients_of(status: dict[str, Any], pid: int) -> list[dict[str, Any]]:
    return [c for c in status["clients"] if c["pid"] == pid]


def epoch_indices(loader: Any, data: Any) -> list[int]:
    return [i for b in loader for i in data.check_batch(b)]


def assert_serves(stoker: Any, d: Any, data: Any) -> None:
    """A fresh loader on daemon `d` yields a full, correct epoch."""
    loader = stoker.Loader(data.spec(stoker), batch_size=BATCH, shuffle=True, seed=1, socket=d.socket)
    assert sorted(epoch_indices(loader, data)) == list(range(data.n))
    loader.close()


# ---------------------------------------------------------------------------
# Dead clients
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "hold,mode",
    [(1, "sleep"), (4, "sleep"), (1, "iterate")],
    ids=["holding-one-batch", "holding-every-slot", "blocked-in-next"],
)
def test_sigkilled_client_is_cleaned_up(start_daemon, data, stoker, poll_until, hold, mode) -> None:
    depth = 4
    d = start_daemon(depth=depth)
    child = spawn_slow_client(d, data, hold=hold, mode=mode)
    try:
        def child_stream() -> dict[str, Any] | None:
            s = streams_of(d.status(), child.pid)
            return s[0] if s and s[0]["slots_leased"] == hold else None

        stream = poll_until(child_stream, 10)
        assert stream, f"no stream with pid {child.pid} and {hold} leased slots: {d.status()}"
        assert stream["depth"] >= depth  # a client holding every slot may get one more (ring growth)

        # Another client is not stalled by the one that holds its slots.
        assert_serves(stoker, d, data)

        if mode == "iterate":
            # Killed while waiting for the daemon (a request in flight).
            block_in_next(d, child)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        d.proc.send_signal(signal.SIGCONT)

    # Right after the kill (clean-up may still be under way) a new client is served.
    loader = stoker.Loader(data.spec(stoker), batch_size=BATCH, shuffle=True, seed=0, socket=d.socket)
    loader.set_epoch(1)
    assert sorted(epoch_indices(loader, data)) == list(range(data.n))

    def gone() -> bool:
        st = d.status()
        return not streams_of(st, child.pid) and not clients_of(st, child.pid)

    assert poll_until(gone, 10), f"dead client {child.pid} still listed: {d.status()}"
    assert streams_of(d.status(), os.getpid()), "our open stream is not listed"
    loader.close()
    assert poll_until(lambda: not streams_of(d.status(), os.getpid()), 10), "closed stream still listed"
    assert d.alive()


def test_holding_every_slot_grows_the_ring_then_raises_past_the_budget(start_daemon, data, stoker) -> None:
    """Prefetch depth is not hold capacity: a process that keeps every batch
    gets more shared memory, up to [limits] max_ring_bytes_per_client; past it
    the next batch raises LimitError (never a hang), and dropping one lets it
    go on."""
    depth = 2
    # Ring: a header page and two one-page slots, plus a 16 KiB control page
    # (28 KiB); room for 3 more one-slot segments of two pages each.
    d = start_daemon(depth=depth, extra="[limits]\nmax_ring_bytes_per_client = 53248\n")
    loader = stoker.Loader(data.spec(stoker), batch_size=BATCH, shuffle=False, socket=d.socket)
    it = iter(loader)
    held = [next(it) for _ in range(depth + 3)]
    with pytest.raises(stoker.LimitError) as exc:
        next(it)
    assert "max_ring_bytes_per_client" in str(exc.value)
    assert isinstance(exc.value, MemoryError)
    with pytest.raises(stoker.LimitError):
        next(it)
    labels = [data.check_batch(b) for b in held]
    del held
    rest = []
    for b in it:
        rest.append(data.check_batch(b))
        del b
    assert [i for b in labels + rest for i in b] == list(range(data.n))
    loader.close()


def test_ctrl_c_interrupts_a_waiting_next(start_daemon, data, stoker) -> None:
    """A process blocked in next() (the daemon is stopped) answers SIGINT
    with KeyboardInterrupt."""
    d = start_daemon(depth=2)
    child = spawn_slow_client(d, data, hold=1, mode="iterate")
    try:
        block_in_next(d, child)
        child.send_signal(signal.SIGINT)
        try:
            out, err = child.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            pytest.fail("next() did not answer SIGINT within 30 s")
        assert out.split()[-1:] == ["INTERRUPTED"], (out, err)
        assert set(out.split()) <= {"BATCH", "INTERRUPTED"}, (out, err)
        assert child.returncode == 0, err
    finally:
        child.kill()
        d.proc.send_signal(signal.SIGCONT)
    assert d.alive()
    assert_serves(stoker, d, data)


FORK_CLIENT = r"""
import json, os, sys
import stoker
a = json.loads(sys.argv[1])
loader = stoker.Loader(stoker.hdf5(a["glob"], fields=a["fields"]), batch_size=4,
                       shuffle=False, rank=0, world_size=1, socket=a["socket"])
it = iter(loader)
first = next(it)
pid = os.fork()
if pid == 0:
    try:
        b = next(it)
        print("child got a batch", b["label"].tolist(), flush=True)
    except stoker.StokerError as e:
        print("child StokerError:", e, flush=True)
    except BaseException as e:
        print("child wrong exception:", type(e).__qualname__, e, flush=True)
        os._exit(2)
    os._exit(0)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
# The parent's loader is unaffected.
del first
labels = [i for b in it for i in b["label"].tolist()]
assert labels == list(range(4, a["n"])), labels
print("parent ok", flush=True)
"""


def test_forked_child_fails_clearly_or_works(start_daemon, data) -> None:
    """(STYLE.md) A loader used in a forked child raises a StokerError or
    works; it never hangs, and the parent's loader is unaffected."""
    d = start_daemon()
    args = {"glob": data.glob, "fields": data.fields, "socket": d.socket, "n": data.n}
    try:
        res = subprocess.run(
            [sys.executable, "-c", FORK_CLIENT, json.dumps(args)], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"hung after fork: {e.stdout!r} {e.stderr!r}")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "parent ok" in res.stdout, res.stdout
    assert d.alive()


# ---------------------------------------------------------------------------
# Broken datasets: DatasetError at construction, naming file, field, path
# ---------------------------------------------------------------------------


def _good_file(path: Path, n: int, fields: dict[str, str]) -> None:
    with h5py.File(path, "w") as f:
        for h5path in fields.values():
            f.create_dataset(h5path, data=np.arange(n * 2, dtype="<f4").reshape(n, 2))


BAD_FIELDS = {"xfield": "data/x", "tgt_field": "meta/target"}


def _bad_dataset(kind: str, root: Path) -> tuple[str, dict[str, str], list[str], list[str]]:
    """Write a broken dataset; returns (glob, fields, must_contain, contains_one_of)."""
    root.mkdir(parents=True)
    glob = str(root / "*.h5")
    fields = dict(BAD_FIELDS)
    if kind == "no-match":
        (root / "not-hdf5.txt").write_text("nothing to see")
        return glob, fields, [glob], []
    _good_file(root / "a.h5", 5, fields)
    bad = root / "b.h5"
    if kind == "missing-path":
        _good_file(bad, 4, {"xfield": "data/x"})
        _good_file(root / "c.h5", 3, fields)
        return glob, fields, [str(bad), "tgt_field", "meta/target"], []
    if kind == "length-mismatch":
        with h5py.File(bad, "w") as f:
            f.create_dataset("data/x", data=np.zeros((10, 2), dtype="f4"))
            f.create_dataset("meta/target", data=np.zeros((9, 2), dtype="f4"))
        _good_file(root / "c.h5", 3, fields)
        return glob, fields, [str(bad)], ["xfield", "tgt_field"]
    if kind == "string-dtype":
        fields["name_field"] = "meta/name"
        with h5py.File(root / "a.h5", "a") as f:
            f.create_dataset("meta/name", data=np.zeros((5, 2), dtype="f4"))
        with h5py.File(bad, "w") as f:
            f.create_dataset("data/x", data=np.zeros((4, 2), dtype="f4"))
            f.create_dataset("meta/target", data=np.zeros((4, 2), dtype="f4"))
            f.create_dataset("meta/name", data=["a", "bb", "ccc", "d"], dtype=h5py.string_dtype())
        return glob, fields, [str(bad), "name_field", "meta/name"], []
    if kind == "not-hdf5":
        bad.write_bytes(b"this is not an HDF5 file\n" * 100)
        return glob, fields, [str(bad)], []
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["no-match", "missing-path", "length-mismatch", "string-dtype", "not-hdf5"])
def test_bad_dataset_raises_dataset_error(start_daemon, data, tmp_path, stoker, kind) -> None:
    d = start_daemon()
    glob, fields, must, one_of = _bad_dataset(kind, tmp_path / "bad")
    with pytest.raises(stoker.DatasetError) as info:
        stoker.Loader(stoker.hdf5(glob, fields=fields), batch_size=BATCH, socket=d.socket)
    msg = str(info.value)
    for s in must:
        assert s in msg, f"{s!r} not in error message: {msg!r}"
    if one_of:
        assert any(s in msg for s in one_of), f"none of {one_of} in error message: {msg!r}"
    assert isinstance(info.value, stoker.StokerError)
    assert d.alive()
    assert_serves(stoker, d, data)


def test_bad_named_dataset_in_config(start_daemon, data, tmp_path, stoker) -> None:
    """A named dataset that is broken fails when a client opens it (not the
    daemon start), and the other named datasets keep working."""
    glob, fields, must, _ = _bad_dataset("missing-path", tmp_path / "bad")
    section = (
        "\n[datasets.broken]\nformat = \"hdf5\"\n"
        f"files = {json.dumps(glob)}\n"
        "fields = { " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in fields.items()) + " }\n"
    )
    d = start_daemon(datasets={"train": data}, extra=section)
    with pytest.raises(stoker.DatasetError) as info:
        stoker.Loader("broken", batch_size=BATCH, socket=d.socket)
    for s in must:
        assert s in str(info.value), f"{s!r} not in {str(info.value)!r}"
    loader = stoker.Loader("train", batch_size=BATCH, shuffle=True, socket=d.socket)
    assert sorted(epoch_indices(loader, data)) == list(range(data.n))
    loader.close()


def test_unknown_named_dataset(start_daemon, data, stoker) -> None:
    d = start_daemon(datasets={"train": data})
    with pytest.raises(stoker.StokerError) as info:
        stoker.Loader("no-such-dataset", batch_size=BATCH, socket=d.socket)
    assert "no-such-dataset" in str(info.value)
    assert_serves(stoker, d, data)


@pytest.mark.parametrize("how", ["outside", "dotdot", "symlink"])
def test_adhoc_dataset_outside_allowed_roots(start_daemon, data, tmp_path, stoker, how) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "link").symlink_to(data.root, target_is_directory=True)
    glob = {
        "outside": data.glob,
        "dotdot": str(allowed / ".." / "data" / "*.h5"),
        "symlink": str(allowed / "link" / "*.h5"),
    }[how]
    d = start_daemon(allowed_roots=[allowed], datasets={"train": data})
    with pytest.raises(stoker.StokerError) as info:
        stoker.Loader(stoker.hdf5(glob, fields=data.fields), batch_size=BATCH, socket=d.socket)
    msg = str(info.value)
    assert os.path.dirname(glob) in msg or str(data.root) in msg, msg
    # Named datasets are the operator's choice, not limited to allowed roots.
    loader = stoker.Loader("train", batch_size=BATCH, socket=d.socket)
    assert sorted(epoch_indices(loader, data)) == list(range(data.n))
    loader.close()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"batch_size": 0},
        {"batch_size": -3},
        {"rank": 3, "world_size": 3},
        {"rank": -1, "world_size": 3},
        {"rank": 0, "world_size": 0},
    ],
    ids=["batch0", "batch-neg", "rank-eq-world", "rank-neg", "world0"],
)
def test_invalid_loader_arguments(start_daemon, data, stoker, kwargs) -> None:
    d = start_daemon()
    args = {"batch_size": BATCH, **kwargs}
    with pytest.raises((ValueError, OverflowError, stoker.StokerError)):
        stoker.Loader(data.spec(stoker), socket=d.socket, **args)
    assert_serves(stoker, d, data)


def test_exception_hierarchy(stoker) -> None:
    for name in ("DaemonUnavailable", "DatasetError", "ProtocolError"):
        cls = getattr(stoker, name)
        assert issubclass(cls, stoker.StokerError), name
        assert issubclass(cls, Exception), name


# ---------------------------------------------------------------------------
# No daemon
# ---------------------------------------------------------------------------

NO_DAEMON_CLIENT = r"""
import json, sys
import stoker
a = json.loads(sys.argv[1])
kw = {} if a["socket"] is None else {"socket": a["socket"]}
try:
    stoker.Loader(stoker.hdf5(a["glob"], fields=a["fields"]), batch_size=4, **kw)
except stoker.DaemonUnavailable as e:
    assert isinstance(e, stoker.StokerError)
    print("DaemonUnavailable:", e)
    sys.exit(0)
except BaseException as e:
    print("wrong exception:", type(e).__module__, type(e).__qualname__, e)
    sys.exit(2)
print("no exception")
sys.exit(3)
"""


@pytest.mark.parametrize("how", ["missing", "stale-socket", "regular-file", "env-missing"])
def test_daemon_unavailable(data, short_tmp, how) -> None:
    path = str(short_tmp / "stoker.sock")
    env = {k: v for k, v in os.environ.items() if k != "STOKER_SOCKET"}
    sock_arg: str | None = path
    if how == "stale-socket":
        # A socket file nobody listens on (a daemon that died).
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(path)
        s.close()
    elif how == "regular-file":
        Path(path).write_text("")
    elif how == "env-missing":
        env["STOKER_SOCKET"] = path
        sock_arg = None
    args = {"glob": data.glob, "fields": data.fields, "socket": sock_arg}
    try:
        res = subprocess.run(
            [sys.executable, "-c", NO_DAEMON_CLIENT, json.dumps(args)],
            capture_output=True, text=True, timeout=60, env=env,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("Loader() with no daemon hung (no answer in 60 s)")
    assert res.returncode == 0, res.stdout + res.stderr
    assert path in res.stdout, f"socket path not named in: {res.stdout!r}"


# ---------------------------------------------------------------------------
# Garbage on the socket
# ---------------------------------------------------------------------------


def test_garbage_on_the_socket(start_daemon, data, stoker) -> None:
    d = start_daemon()
    payloads = [
        b"",
        b"\x00",
        b"\xff" * 8 + os.urandom(64),  # an absurd length prefix (u32 or u64)
        (1 << 30).to_bytes(4, "little") + b"\x00" * 16,
        (1 << 30).to_bytes(8, "little") + b"\x00" * 16,
        b"\x04\x00\x00\x00\x00\x00\x00\x00" + b"\x01\x02\x03\x04",
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        os.urandom(4096),
    ]
    # A connection that never says anything must not block anyone.
    idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    idle.connect(d.socket)
    for payload in payloads:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(d.socket)
        try:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            while s.recv(65536):
                pass
        except OSError:
            pass  # the daemon may reset the connection: fine
        finally:
            s.close()
        assert d.alive(), f"daemon died on {payload[:16]!r}:\n{d.stderr()}"
    # A half message, then the client vanishes.
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(d.socket)
    s.sendall(b"\x40\x00\x00\x00")
    s.close()

    assert d.alive()
    d.status()
    assert_serves(stoker, d, data)
    idle.close()


# ---------------------------------------------------------------------------
# Status, CLI, config, shutdown
# ---------------------------------------------------------------------------


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def test_status_reports_clients_and_streams(start_daemon, data, stoker, poll_until) -> None:
    depth = 4
    d = start_daemon(depth=depth, datasets={"train": data})
    st = d.status()
    assert _is_num(st["uptime_s"]) and st["uptime_s"] >= 0
    assert isinstance(st["clients"], list) and isinstance(st["streams"], list)
    # (the fixture's readiness probe may still be listed for a moment)
    assert poll_until(lambda: d.status()["streams"] == [], 10), d.status()

    loader = stoker.Loader("train", batch_size=BATCH, shuffle=False, rank=0, world_size=1, socket=d.socket)
    it = iter(loader)
    b = [next(it) for _ in range(3)]
    del b[:2]  # hold exactly one batch

    def ours() -> dict[str, Any] | None:
        s = streams_of(d.status(), os.getpid())
        return s[0] if s and s[0]["slots_leased"] == 1 and s[0]["batches"] >= 3 else None

    stream = poll_until(ours, 10)
    st = d.status()
    assert stream, f"our stream (3 batches, 1 leased) not in {st}"

    ints = ["id", "client_id", "pid", "epoch", "step", "batches_per_epoch", "batches",
            "slots_filled", "slots_leased", "depth"]
    for k in ints:
        assert _is_int(stream[k]), (k, stream)
    for k in ["batches_per_s", "mb_per_s", "wait_s"]:
        assert _is_num(stream[k]) and stream[k] >= 0, (k, stream)
    assert stream["dataset"] == "train"
    assert stream["epoch"] == 0
    assert 0 <= stream["step"] <= stream["batches_per_epoch"]
    assert stream["batches_per_epoch"] == len(loader)
    assert stream["depth"] == depth
    assert 0 <= stream["slots_filled"] <= depth

    clients = clients_of(st, os.getpid())
    assert len(clients) >= 1, st
    client = [c for c in clients if c["id"] == stream["client_id"]]
    assert client, f"stream's client {stream['client_id']} not listed: {st}"
    assert client[0]["uid"] == os.getuid()
    assert client[0]["streams"] >= 1
    for k in ["id", "pid", "uid", "streams"]:
        assert _is_int(client[0][k]), (k, client)

    # The epoch shows up once the next epoch starts.
    del b, it
    loader.set_epoch(1)
    it = iter(loader)
    first = next(it)
    assert poll_until(lambda: (streams_of(d.status(), os.getpid()) or [{}])[0].get("epoch") == 1, 10)
    del first, it

    text = d.cli("status").stdout
    assert str(os.getpid()) in text and "train" in text, text
    assert "train" in d.cli("datasets").stdout
    loader.close()


def test_config_unknown_key_is_an_error(tmp_path, short_tmp, stoker_binary) -> None:
    config = tmp_path / "bad.toml"
    config.write_text('[server]\nallowed_roots = []\n[ring]\ndepht = 4\n')
    try:
        res = subprocess.run(
            [str(stoker_binary), "serve", "--config", str(config), "--socket", str(short_tmp / "s.sock")],
            capture_output=True, text=True, timeout=20,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("stoker serve accepted a config with an unknown key (still running after 20 s)")
    assert res.returncode != 0
    assert "depht" in res.stderr, res.stderr


def test_sigterm_stops_the_daemon(start_daemon, data, stoker) -> None:
    """SIGTERM with a client connected: the daemon exits 0 promptly, and the
    client gets an error instead of hanging."""
    d = start_daemon(depth=2)
    loader = stoker.Loader(data.spec(stoker), batch_size=BATCH, shuffle=False, socket=d.socket, reconnect=0)
    it = iter(loader)
    data.check_batch(next(it))
    rc = d.terminate(timeout=10)
    assert rc is not None, "daemon still running 10 s after SIGTERM"
    assert rc == 0, f"exit code {rc} after SIGTERM\n{d.stderr()}"
    with pytest.raises(stoker.StokerError):
        for batch in it:
            data.check_batch(batch)
    loader.close()


def test_a_long_run_of_failed_batches_each_raises_its_dataset_error(
    stoker: Any, start_daemon: Any, tmp_path: Path
) -> None:
    """Hundreds of failed batches in a row (values that do not decode): each
    `next()` raises the `DatasetError` naming its key, and iteration goes on to
    the end of the epoch. Taking a failed record frees a place in the record
    queue, which the daemon could fill with newer failures before the client
    fetched the taken one's message; that message was dropped and `next()`
    raised `ProtocolError: ... has no record N with details to fetch`."""
    from lmdb_data import key, photo, png_of, write_env

    n, good = 600, 8
    items = {key(i): b"\x89PNG not an image %d" % i for i in range(n)}
    items.update({key(i): png_of(photo(32, 24, 3, seed=i)) for i in range(good)})
    env = write_env(tmp_path / "env", items)
    d = start_daemon()
    for _ in range(3):
        spec = stoker.lmdb(
            str(env), fields={"im": {"codec": "png", "mode": "RGB"}}, transforms={"im": [{"resize": [16, 12]}]}
        )
        loader = stoker.Loader(spec, batch_size=1, shuffle=False, socket=d.socket, timeout=60)
        served, failed = 0, []
        it = iter(loader)
        while True:
            try:
                next(it)
                served += 1
            except StopIteration:
                break
            except stoker.DatasetError as e:
                failed.append(str(e))
        loader.close()
        assert served == good and len(failed) == n - good
        assert all(f'key "{key(good + i)}"' in m for i, m in enumerate(failed)), failed[:3]
    assert d.alive()
    # The failures are in the client's exceptions; the daemon's log says so
    # once per stream and interval (it wrote a warning per failed batch: ~5 MB/s
    # for a client taking an all-failing stream's records).
    warnings = d.stderr().count("batch failed")
    assert 1 <= warnings <= 30, f"{warnings} 'batch failed' warnings for {3 * (n - good)} failed batches"
