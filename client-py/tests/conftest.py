"""Shared fixtures for the end-to-end tests of the Python client.

Every test starts its own `stoker serve` (the real release binary) on a socket
in a fresh temporary directory, writes real HDF5 files with h5py, and talks to
the daemon through the `stoker` package, in this process or in subprocesses
that stand in for the ranks of a training job.

The binary is `$STOKER_BIN` if set, else `<repo>/target/release/stoker`.
"""

from __future__ import annotations

import ctypes
import faulthandler
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import h5py
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]

# A suite started in the background of a non-interactive shell (`cmd &`, as a
# CI runner may do) inherits SIGINT and SIGQUIT ignored, and an ignored signal
# stays ignored across exec: Python then installs no KeyboardInterrupt
# handler, and the tests that press Ctrl-C on a client or on `stoker status
# --watch` would wait forever. Catching them here resets them to their default
# in every process the tests exec.
for _sig, _handler in ((signal.SIGINT, signal.default_int_handler), (signal.SIGQUIT, signal.SIG_DFL)):
    if signal.getsignal(_sig) == signal.SIG_IGN:
        signal.signal(_sig, _handler)

#: How long a daemon may take to start listening before the fixture gives up.
READY_TIMEOUT_S = 20.0
#: How long a daemon may take to exit after SIGTERM before it is SIGKILLed.
STOP_TIMEOUT_S = 5.0
#: Guard against hangs in subprocesses (a hang fails the test; speed is not
#: asserted anywhere, that belongs to benchmarks).
SUBPROCESS_TIMEOUT_S = 120.0

#: Rows per file of the default dataset: uneven, so files straddle batches.
DEFAULT_LENGTHS = (37, 50, 13)
#: field name -> HDF5 path of the default dataset.
DEFAULT_FIELDS = {"x": "data/x", "y": "y", "label": "label"}


#: A test that runs longer than this is hung: SIGALRM raises in it (the
#: client's waits answer signals), and if even that does not end it, the whole
#: run is stopped with a traceback of every thread.
HANG_TIMEOUT_S = 150


def _die_with_parent() -> None:
    # In the child before exec: a daemon must not outlive a killed test run.
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def stoker_bin() -> Path:
    env = os.environ.get("STOKER_BIN")
    return Path(env) if env else REPO / "target" / "release" / "stoker"


# --------------------------------------------------------------------------
# HDF5 data
# --------------------------------------------------------------------------


@dataclass
class H5Data:
    """A set of HDF5 files written for a test, and the values they hold.

    `ref[field]` is the concatenation over files (sorted order) of that field's
    HDF5 dataset, in the file's own dtype, so `ref[field][i]` is what sample
    `i` must hold.  The field `label` (if present) holds each row's global
    index, which is how tests find out which sample a served row is.
    """

    root: Path
    files: list[Path]
    lengths: list[int]
    fields: dict[str, str]
    ref: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    @property
    def glob(self) -> str:
        return str(self.root / "*.h5")

    @property
    def n(self) -> int:
        return sum(self.lengths)

    @property
    def offsets(self) -> list[int]:
        return [int(o) for o in np.cumsum([0, *self.lengths[:-1]])]

    def spec(self, stoker: Any) -> Any:
        """The ad-hoc `stoker.hdf5(...)` spec for these files."""
        return stoker.hdf5(self.glob, fields=dict(self.fields))

    def toml_dataset(self, name: str) -> str:
        """A `[datasets.NAME]` config section for these files."""
        fields = ", ".join(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in self.fields.items())
        return (
            f"[datasets.{name}]\n"
            f'format = "hdf5"\n'
            f"files = {json.dumps(self.glob)}\n"
            f"fields = {{ {fields} }}\n"
        )

    def worker_args(self) -> dict[str, Any]:
        return {"files": [str(f) for f in self.files], "fields": dict(self.fields)}

    def check_batch(self, batch: Mapping[str, np.ndarray], label: str = "label") -> list[int]:
        """Check every field of a served batch against h5py, byte for byte.

        Returns the global indices of the batch's rows (from `label`).
        """
        assert set(batch.keys()) == set(self.fields), (sorted(batch.keys()), sorted(self.fields))
        idx = np.asarray(batch[label]).astype(np.int64)
        assert idx.ndim == 1
        assert ((idx >= 0) & (idx < self.n)).all(), f"label out of range: {idx.tolist()}"
        for name, arr in batch.items():
            check_field(name, arr, self.ref[name][idx])
        return idx.tolist()


def check_field(name: str, served: np.ndarray, h5_rows: np.ndarray) -> None:
    """`served` must be `h5_rows` converted to native byte order: same dtype,
    shape, values and bytes."""
    native = h5_rows.astype(h5_rows.dtype.newbyteorder("="), copy=False)
    assert isinstance(served, np.ndarray), f"{name}: {type(served)} is not a numpy array"
    assert served.dtype == native.dtype, f"{name}: dtype {served.dtype.str} != {native.dtype.str}"
    assert served.dtype.isnative, f"{name}: dtype {served.dtype.str} is not native-endian"
    assert served.shape == native.shape, f"{name}: shape {served.shape} != {native.shape}"
    assert np.array_equal(served, native), f"{name}: values differ"
    assert served.tobytes() == native.tobytes(), f"{name}: bytes differ"


def write_h5(
    root: Path,
    lengths: tuple[int, ...] | list[int] = DEFAULT_LENGTHS,
    *,
    seed: int = 1234,
    sample_shape: tuple[int, ...] = (4, 3),
) -> H5Data:
    """Write the default test dataset: one file per entry of `lengths`.

    Fields: `data/x` f32 `[n, *sample_shape]` random, `y` u8 `[n]` random and
    `label` big-endian i32 `[n]` holding each row's global index.  Files are
    named so that sorted order is the order of `lengths`.
    """
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    files = []
    offset = 0
    for i, n in enumerate(lengths):
        path = root / f"part-{i:03d}.h5"
        with h5py.File(path, "w") as f:
            f.create_dataset("data/x", data=rng.standard_normal((n, *sample_shape), dtype=np.float32))
            f.create_dataset("y", data=rng.integers(0, 256, size=n, dtype=np.uint8))
            f.create_dataset("label", data=np.arange(offset, offset + n, dtype=">i4"))
        files.append(path)
        offset += n
    return load_h5(root, files, dict(DEFAULT_FIELDS))


def load_h5(root: Path, files: list[Path], fields: dict[str, str]) -> H5Data:
    """Read back the reference values of `fields` from `files` with h5py."""
    ref: dict[str, list[np.ndarray]] = {k: [] for k in fields}
    lengths = []
    for path in files:
        with h5py.File(path, "r") as f:
            for name, h5path in fields.items():
                ref[name].append(f[h5path][()])
            lengths.append(len(ref[next(iter(fields))][-1]))
    return H5Data(
        root=root,
        files=list(files),
        lengths=lengths,
        fields=dict(fields),
        # (concatenate alone would convert to native byte order)
        ref={k: np.concatenate(v, dtype=v[0].dtype) if v else np.array([]) for k, v in ref.items()},
    )


# --------------------------------------------------------------------------
# The daemon
# --------------------------------------------------------------------------


class Daemon:
    """A running `stoker serve` process with its own config and socket."""

    def __init__(
        self,
        workdir: Path,
        config_text: str,
        *,
        args: tuple[str, ...] = (),
        env: Mapping[str, str] | None = None,
        command: list[str] | None = None,
        pass_fds: tuple[int, ...] = (),
    ) -> None:
        """`command` (default: the stoker binary) `serve --config ... --socket ... *args`, with `env`."""
        self.workdir = workdir
        self.socket = str(workdir / "stoker.sock")
        self.config = workdir / "stoker.toml"
        self.config.write_text(config_text)
        self.stderr_path = workdir / "daemon.stderr"
        self._stderr = open(self.stderr_path, "wb")
        self.proc = subprocess.Popen(
            [*(command or [str(stoker_bin())]), "serve", "--config", str(self.config), "--socket", self.socket, *args],
            stdin=subprocess.DEVNULL,
            stdout=self._stderr,
            stderr=self._stderr,
            env=None if env is None else dict(env),
            preexec_fn=_die_with_parent,
            pass_fds=pass_fds,
        )
        self._wait_ready()

    def stderr(self) -> str:
        if not self._stderr.closed:
            self._stderr.flush()
        return self.stderr_path.read_text(errors="replace")

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            rc = self.proc.poll()
            if rc is not None:
                pytest.fail(
                    f"stoker serve exited with {rc} before listening\n"
                    f"config:\n{self.config.read_text()}\nstderr:\n{self.stderr()}"
                )
            if os.path.exists(self.socket):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    s.connect(self.socket)
                    return
                except OSError:
                    pass
                finally:
                    s.close()
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(
                    f"stoker serve not listening on {self.socket} after {READY_TIMEOUT_S} s\n"
                    f"stderr:\n{self.stderr()}"
                )
            time.sleep(0.05)

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run `stoker ARGS --socket SOCKET`."""
        cmd = [str(stoker_bin()), *args, "--socket", self.socket]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
        if check and res.returncode != 0:
            pytest.fail(f"{' '.join(cmd)} exited {res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}")
        return res

    def status(self) -> dict[str, Any]:
        """`stoker status --json`, parsed."""
        res = self.cli("status", "--json")
        try:
            return json.loads(res.stdout)
        except json.JSONDecodeError as e:
            pytest.fail(f"stoker status --json printed invalid JSON ({e}):\n{res.stdout}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def terminate(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, wait up to `timeout`; returns the exit code or None if still running."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                return None
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.terminate() is None:
            self.kill()
        self._stderr.close()


def make_config(
    socket_path: str,
    *,
    allowed_roots: list[Path] | tuple[Path, ...] = (),
    threads: int = 2,
    depth: int = 4,
    datasets: Mapping[str, H5Data] | None = None,
    extra: str = "",
) -> str:
    roots = ", ".join(json.dumps(os.path.realpath(r)) for r in allowed_roots)
    text = (
        "[server]\n"
        f"socket = {json.dumps(socket_path)}\n"
        f"allowed_roots = [{roots}]\n"
        "\n[workers]\n"
        f"threads = {threads}\n"
        "\n[ring]\n"
        f"depth = {depth}\n"
    )
    for name, data in (datasets or {}).items():
        text += "\n" + data.toml_dataset(name)
    return text + extra


def realpaths(p: Path) -> tuple[str, str]:
    """A path as given and as resolved: an error message may name either."""
    return str(p), os.path.realpath(p)


def assert_names(message: str, *needles: str | tuple[str, ...]) -> None:
    """Each needle (or one of a tuple of alternatives) appears in `message`."""
    for needle in needles:
        options = needle if isinstance(needle, tuple) else (needle,)
        assert any(o in message for o in options), f"{options[0]!r} not in error message:\n{message}"


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A directory with a short path: Unix socket paths are limited to 107 bytes
    and pytest's tmp_path can be longer than that."""
    d = Path(tempfile.mkdtemp(prefix="stk-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def start_daemon(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """Factory: `start_daemon(datasets={"train": data}, depth=4, allowed_roots=[...])`.

    `allowed_roots` defaults to `[tmp_path]`.  Every daemon started is stopped
    (SIGTERM, then SIGKILL) at the end of the test; if the test failed its
    stderr is printed.
    """
    if not stoker_bin().is_file():
        pytest.fail(f"stoker binary not found at {stoker_bin()} (build it or set STOKER_BIN)")
    daemons: list[Daemon] = []
    dirs: list[Path] = []

    def start(
        *,
        allowed_roots: list[Path] | None = None,
        threads: int = 2,
        depth: int = 4,
        datasets: Mapping[str, H5Data] | None = None,
        extra: str = "",
    ) -> Daemon:
        workdir = Path(tempfile.mkdtemp(prefix="stk-", dir="/tmp"))
        dirs.append(workdir)
        config = make_config(
            str(workdir / "from-config.sock"),  # overridden by --socket
            allowed_roots=[tmp_path] if allowed_roots is None else allowed_roots,
            threads=threads,
            depth=depth,
            datasets=datasets,
            extra=extra,
        )
        d = Daemon(workdir, config)
        daemons.append(d)
        return d

    yield start

    failed = getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed
    try:
        for i, d in enumerate(daemons):
            d.proc.send_signal(signal.SIGCONT)  # in case a test left it stopped
            d.stop()
            if failed:
                print(f"---- daemon {i} ({d.socket}) stderr ----\n{d.stderr()[-8000:]}")
    finally:
        for d in daemons:
            d.kill()
        for w in dirs:
            shutil.rmtree(w, ignore_errors=True)


def stop_process(pid: int) -> None:
    """SIGSTOP `pid` and wait until every thread of it has actually stopped
    (delivery to a busy multi-threaded process is not instantaneous)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        if all(s in "tT" for s in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"daemon {pid} did not stop")


def wait_until_blocked(proc: subprocess.Popen[str], what: str, timeout: float = 30, looks: int = 5) -> None:
    """Wait until the main thread of `proc` sleeps in the kernel (state S) on
    `looks` consecutive looks: a client that took the batches already in its
    ring and now waits in next() for a daemon that cannot answer (the wait
    sleeps on a futex, waking every 50 ms to run signal handlers). Taking a
    waiting batch makes no blocking system call, so it is not mistaken for
    the wait. Fails naming `what` if that does not happen within `timeout`."""
    streak = 0

    def blocked() -> bool:
        nonlocal streak
        if proc.poll() is not None:
            return True  # reported below
        try:
            with open(f"/proc/{proc.pid}/task/{proc.pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True  # exited meanwhile
        streak = streak + 1 if state == "S" else 0
        return streak >= looks

    poll(blocked, timeout=timeout, interval=0.02)
    if proc.poll() is not None:
        _, err = proc.communicate(timeout=SUBPROCESS_TIMEOUT_S)
        pytest.fail(f"{what}: the process exited ({proc.returncode}) instead of waiting\nstderr:\n{err}")
    assert streak >= looks, f"{what}: the process did not settle into a wait within {timeout} s"


class Hung(Exception):
    pass


@pytest.fixture(autouse=True)
def hang_guard() -> Iterator[None]:
    def on_alarm(signum: int, frame: Any) -> None:
        raise Hung(f"test still running after {HANG_TIMEOUT_S} s: hung")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(HANG_TIMEOUT_S)
    faulthandler.dump_traceback_later(HANG_TIMEOUT_S + 30, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    # Lets fixtures see whether the test body failed (to print daemon logs).
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


# --------------------------------------------------------------------------
# The client
# --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def stoker() -> Any:
    """The `stoker` package (fails, rather than skips, if it is not importable)."""
    try:
        import stoker as mod
    except ImportError as e:
        pytest.fail(f"cannot import stoker: {e}")
    return mod


@pytest.fixture
def data(tmp_path: Path) -> H5Data:
    """The default dataset: 3 files of 37, 50 and 13 rows (N = 100)."""
    return write_h5(tmp_path / "data")


@pytest.fixture
def stoker_binary() -> Path:
    return stoker_bin()


@pytest.fixture
def make_h5() -> Callable[..., H5Data]:
    """`make_h5(dir, lengths=(...))`: write a dataset like `data` (see `write_h5`)."""
    return write_h5


@pytest.fixture
def load_reference() -> Callable[..., H5Data]:
    """`load_reference(root, files, fields)`: read arbitrary files back with h5py."""
    return load_h5


# A rank of a training job: opens a Loader, iterates the given epochs, checks
# every field of every batch against h5py, and writes the global indices of
# each batch (from `label`) as JSON to args["out"].
WORKER_SRC = r"""
import json, os, sys
import numpy as np
import h5py
import stoker

args = json.loads(sys.argv[1])
fields = args["fields"]
ref = {}
for name, path in fields.items():
    parts = []
    for f in args["files"]:
        with h5py.File(f, "r") as h:
            parts.append(h[path][()])
    ref[name] = np.concatenate(parts)

src = args["dataset"]
if isinstance(src, dict):
    src = stoker.hdf5(src["glob"], fields=src["fields"])
loader = stoker.Loader(src, **args["loader"])
out = {"len": len(loader), "pid": os.getpid(), "epochs": {}, "errors": []}
for epoch in args["epochs"]:
    loader.set_epoch(epoch)
    batches = []
    for batch in loader:
        idx = np.asarray(batch["label"]).astype(np.int64)
        if sorted(batch.keys()) != sorted(fields):
            out["errors"].append(f"epoch {epoch}: fields {sorted(batch.keys())}")
        for name, arr in batch.items():
            exp = ref[name][idx]
            exp = exp.astype(exp.dtype.newbyteorder("="), copy=False)
            if arr.dtype != exp.dtype or arr.shape != exp.shape or arr.tobytes() != exp.tobytes():
                out["errors"].append(
                    f"epoch {epoch} batch {len(batches)} field {name}: served "
                    f"{arr.dtype.str}{arr.shape} differs from h5py {exp.dtype.str}{exp.shape}"
                )
            if not arr.flags.writeable:
                out["errors"].append(f"field {name} is not writeable")
        batches.append(idx.tolist())
        del batch, arr
    out["epochs"][str(epoch)] = batches
out["state"] = loader.state_dict()
loader.close()
with open(args["out"], "w") as f:
    json.dump(out, f)
"""


def _clean_env(extra: Mapping[str, str] | None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "STOKER_SOCKET") and not k.startswith("SLURM_")
    }
    env.update(extra or {})
    return env


@pytest.fixture
def run_ranks(tmp_path: Path) -> Callable[..., list[dict[str, Any]]]:
    """Run one worker process per entry of `ranks` concurrently.

    `run_ranks(data, dataset, ranks=[{"rank": 0, "world_size": 3, "socket": s}, ...],
    epochs=[0, 1], env=[{...}, ...], **loader_kwargs)` returns, per rank,
    `{"len": int, "epochs": {"0": [[idx, ...], ...]}, "state": {...}, "pid": int}`.
    `dataset` is a config name or an `H5Data` (served ad hoc).
    """
    counter = iter(range(1_000_000))

    def run(
        data: H5Data,
        dataset: str | H5Data,
        ranks: list[dict[str, Any]],
        epochs: list[int],
        env: list[dict[str, str]] | None = None,
        **loader_kwargs: Any,
    ) -> list[dict[str, Any]]:
        procs = []
        for i, rank_kwargs in enumerate(ranks):
            out = tmp_path / f"worker-{next(counter)}.json"
            ds = (
                {"glob": dataset.glob, "fields": dataset.fields}
                if isinstance(dataset, H5Data)
                else dataset
            )
            args = {
                **data.worker_args(),
                "dataset": ds,
                "loader": {**loader_kwargs, **rank_kwargs},
                "epochs": epochs,
                "out": str(out),
            }
            p = subprocess.Popen(
                [sys.executable, "-c", WORKER_SRC, json.dumps(args)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=_clean_env(env[i] if env else None),
            )
            procs.append((p, out, args))
        results = []
        deadline = time.monotonic() + SUBPROCESS_TIMEOUT_S
        for p, out, args in procs:
            try:
                stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q, _, _ in procs:
                    q.kill()
                stdout, stderr = p.communicate()
                pytest.fail(f"worker {args['loader']} hung\nstdout:\n{stdout}\nstderr:\n{stderr}")
            if p.returncode != 0:
                for q, _, _ in procs:
                    q.kill()
                pytest.fail(
                    f"worker {args['loader']} exited {p.returncode}\nstdout:\n{stdout}\nstderr:\n{stderr}"
                )
            res = json.loads(out.read_text())
            assert not res["errors"], f"worker {args['loader']}: " + "\n".join(res["errors"][:20])
            results.append(res)
        return results

    return run


def poll(predicate: Callable[[], Any], timeout: float, interval: float = 0.1) -> Any:
    """Call `predicate` until it returns something truthy or `timeout` passes;
    returns the last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


@pytest.fixture
def poll_until() -> Callable[..., Any]:
    return poll
