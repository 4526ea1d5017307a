"""What an admin sees: the daemon's log (text, JSON, journald, filters) and
`stoker status` (spelled-out columns, datasets, workers, users, Slurm jobs,
data stall, `--watch`), all against the real daemon."""

from __future__ import annotations

import json
import os
import pwd
import re
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest

from conftest import Daemon, H5Data, _die_with_parent, make_config, poll, stoker_bin

BATCH = 8

#: Variables that change how the daemon logs; cleared so the caller's environment cannot leak in.
LOG_ENV = ("JOURNAL_STREAM", "INVOCATION_ID", "RUST_LOG", "STOKER_LOG", "NO_COLOR")

#: The start of a line the text log timestamps (`2026-11-23T17:14:47.123456Z`).
TIMESTAMP = re.compile(r"^\s*\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d")


class ServedDaemon(Daemon):
    """`stoker serve` with extra arguments and environment (conftest's `Daemon`)."""

    def log_lines(self) -> list[str]:
        """The daemon's stderr after it stopped (so every line is written)."""
        self.stop()
        return [line for line in self.stderr().splitlines() if line.strip()]


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., ServedDaemon]]:
    """Factory: `serve("--log-format", "json", env={...}, datasets={...})`."""
    daemons: list[ServedDaemon] = []

    def start(*args: str, env: dict[str, str] | None = None, datasets: dict[str, H5Data] | None = None) -> ServedDaemon:
        workdir = Path(tempfile.mkdtemp(prefix="stk-", dir="/tmp"))
        base = {k: v for k, v in os.environ.items() if k not in LOG_ENV}
        config = make_config(str(workdir / "unused.sock"), allowed_roots=[tmp_path], datasets=datasets)
        d = ServedDaemon(workdir, config, args=args, env={**base, **(env or {})})
        daemons.append(d)
        return d

    yield start
    for d in daemons:
        d.stop()
        d.kill()


def read_some(stoker: Any, spec: Any, socket: str, batches: int = 3) -> None:
    loader = stoker.Loader(spec, batch_size=BATCH, shuffle=False, rank=0, world_size=1, socket=socket)
    it = iter(loader)
    for _ in range(batches):
        next(it)
    loader.close()


# --------------------------------------------------------------------------
# Logs
# --------------------------------------------------------------------------


def test_json_log_lines_parse_with_level_and_fields(serve, data, stoker) -> None:
    d = serve("--log-format", "json")
    read_some(stoker, data.spec(stoker), d.socket)
    lines = d.log_lines()
    assert lines, "the daemon logged nothing"
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError as e:
            pytest.fail(f"log line is not JSON ({e}): {line!r}")
    for ev in events:
        assert ev.get("level") in {"ERROR", "WARN", "INFO", "DEBUG", "TRACE"}, ev
        assert isinstance(ev.get("fields"), dict) and "message" in ev["fields"], ev
        assert "timestamp" in ev, ev
    listening = [ev for ev in events if ev["fields"]["message"] == "listening"]
    assert listening and listening[0]["level"] == "INFO", events
    assert listening[0]["fields"]["socket"] == d.socket
    opened = [ev for ev in events if ev["fields"]["message"] == "stream opened"]
    assert opened, events
    assert opened[0]["fields"]["dataset"] == data.glob
    assert opened[0]["fields"]["uid"] == os.getuid()
    # The connection's span travels with the event.
    assert opened[0].get("span", {}).get("name") == "client", opened[0]


def test_text_log_has_timestamps_except_under_systemd(serve) -> None:
    plain = serve().log_lines()
    assert any("listening" in line for line in plain), plain
    assert all(TIMESTAMP.match(line) for line in plain), plain

    for env in ({"JOURNAL_STREAM": "1:1"}, {"INVOCATION_ID": "0123456789abcdef0123456789abcdef"}):
        journal = serve(env=env).log_lines()
        assert any("listening" in line for line in journal), (env, journal)
        for line in journal:
            assert not TIMESTAMP.match(line), (env, line)
            assert "\x1b[" not in line, (env, line)
        assert re.match(r"^\s*INFO ", next(line for line in journal if "listening" in line)), journal


@pytest.mark.parametrize(
    "how",
    [("--log-level", "warn"), ("env", "STOKER_LOG"), ("env", "RUST_LOG")],
    ids=["flag", "STOKER_LOG", "RUST_LOG"],
)
def test_a_warn_filter_hides_info_lines(serve, data, stoker, how) -> None:
    if how[0] == "env":
        d = serve(env={how[1]: "warn"})
    else:
        d = serve(*how)
    read_some(stoker, data.spec(stoker), d.socket)
    lines = d.log_lines()
    assert not [line for line in lines if " INFO " in f" {line} "], lines
    assert not any("listening" in line or "stream opened" in line for line in lines), lines


def test_filter_directives_pick_one_module(serve, data, stoker) -> None:
    d = serve("--log-level", "warn,stoker_daemon::server=info")
    read_some(stoker, data.spec(stoker), d.socket)
    lines = d.log_lines()
    assert any("listening" in line for line in lines), lines
    assert any("stream opened" in line for line in lines), lines
    # `opened dataset` is logged by stoker_daemon::dataset, which stays at warn.
    assert not any("opened dataset" in line for line in lines), lines


def test_the_flag_overrides_the_environment(serve) -> None:
    lines = serve("--log-level", "info", env={"STOKER_LOG": "error", "RUST_LOG": "error"}).log_lines()
    assert any("listening" in line for line in lines), lines


def test_a_mistyped_filter_is_an_error(tmp_path: Path) -> None:
    for bad in ["infoo", "info,stoker_daemon=loud"]:
        res = subprocess.run(
            [str(stoker_bin()), "serve", "--socket", str(tmp_path / "s.sock"), "--log-level", bad],
            capture_output=True, text=True, timeout=20,
        )
        assert res.returncode != 0, (bad, res.stderr)
        assert "invalid log filter" in res.stderr and bad in res.stderr, res.stderr
        assert "stoker_daemon::server=debug" in res.stderr, res.stderr


# --------------------------------------------------------------------------
# stoker status
# --------------------------------------------------------------------------


def status_json(d: Daemon) -> dict[str, Any]:
    return json.loads(d.cli("status", "--json").stdout)


def test_status_does_not_count_itself(start_daemon) -> None:
    d = start_daemon()
    # The fixture's readiness probe may be listed for a moment; the query itself never is.
    assert poll(lambda: status_json(d)["clients"] == [], timeout=10), status_json(d)
    assert "clients: 0" in d.cli("status").stdout


def test_status_for_an_admin(start_daemon, data, stoker, monkeypatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    d = start_daemon(datasets={"train": data})
    loader = stoker.Loader("train", batch_size=BATCH, shuffle=False, rank=0, world_size=1, socket=d.socket)
    it = iter(loader)
    held = [next(it) for _ in range(3)]

    def ours() -> dict[str, Any] | None:
        st = status_json(d)
        return st if len(st["clients"]) == 1 and st["streams"] and st["streams"][0]["batches"] >= 3 else None

    st = poll(ours, timeout=10)
    assert st, status_json(d)
    user = pwd.getpwuid(os.getuid()).pw_name

    # JSON: everything the table shows.
    (client,) = st["clients"]
    assert client["job"] == "4242" and client["uid"] == os.getuid() and client["streams"] == 1, client
    assert 0 <= client["stall_percent"] <= 100 and client["wait_s"] >= 0, client
    (stream,) = st["streams"]
    assert 0 <= stream["stall_percent"] <= 100 and stream["open_s"] > 0, stream
    (ds,) = st["datasets"]
    assert ds["dataset"] == "train" and ds["format"] == "hdf5", ds
    assert ds["files"] == 3 and ds["bytes"] == sum(f.stat().st_size for f in data.files), ds
    assert ds["samples"] == data.n and ds["streams"] == 1 and ds["ring_bytes"] > 0, ds
    workers = st["workers"]
    assert workers["busy_s"] > 0, workers  # three batches were filled
    assert 0 <= workers["busy_percent"] <= 100 and workers["window_s"] > 0, workers

    text = d.cli("status").stdout
    for header in ["ring filled", "ring leased", "ring depth", "data stall", "user", "slurm job", "on disk",
                   "ring memory", "files", "% busy"]:
        assert header in text, f"{header!r} missing from:\n{text}"
    assert "f/l/d" not in text, text
    assert "clients: 1" in text and "datasets open: 1" in text, text

    def row(section: str, first: str) -> list[str]:
        lines = text.split(f"\n{section}:", 1)[1].split("\n\n", 1)[0].splitlines()
        header = lines[1]
        found = [ln for ln in lines[2:] if ln.split()[0] == first]
        assert found, f"no {section} row starting with {first!r} in:\n{text}"
        return [header, found[0]]

    _, client_row = row("clients", str(client["id"]))
    cells = client_row.split()
    assert user in cells and "4242" in cells and str(os.getpid()) in cells, client_row
    assert re.fullmatch(r"\d+\.\d%", cells[-1]), client_row  # data stall
    header, ds_row = row("datasets open", "train")
    assert ds_row.split()[header.split().index("files")] == "3", (header, ds_row)
    _, stream_row = row("streams", str(stream["id"]))
    assert re.search(r"\d+\.\d%", stream_row), stream_row
    del held, it
    loader.close()


def test_status_watch_redraws_until_interrupted(start_daemon) -> None:
    d = start_daemon()
    assert poll(lambda: status_json(d)["clients"] == [], timeout=10)  # the readiness probe has gone
    out = d.workdir / "watch.out"
    cases = [
        (("--watch", "0.2"), lambda text: text.count("\x1b[2J")),
        (("--watch", "0.2", "--json"), lambda text: text.count("\n")),
    ]
    for args, frames in cases:
        with open(out, "wb") as f:
            proc = subprocess.Popen(
                [str(stoker_bin()), "status", *args, "--socket", d.socket],
                stdout=f, stderr=subprocess.PIPE, preexec_fn=_die_with_parent,
            )
        try:
            seen = poll(lambda frames=frames: frames(out.read_text()) >= 3, timeout=20)
            assert seen, f"fewer than 3 frames of `status {' '.join(args)}`:\n{out.read_text()!r}"
            assert proc.poll() is None, "--watch exited by itself"
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(10)
        text = out.read_text()
        if "--json" in args:
            reports = [json.loads(line) for line in text.splitlines() if line.strip()]
            assert all("workers" in r and "datasets" in r for r in reports), reports
            # Each frame asks on the same kept connection, which is never listed.
            assert all(r["clients"] == [] for r in reports), reports
        else:
            assert text.count("clients: 0") >= 3 and "Ctrl-C" in text, text


def test_status_watch_rejects_a_bad_interval(start_daemon) -> None:
    d = start_daemon()
    res = d.cli("status", "--watch", "0", check=False)
    assert res.returncode != 0 and "--watch" in res.stderr, res.stderr


def test_status_watch_outlives_the_daemon(start_daemon) -> None:
    d = start_daemon()
    out = d.workdir / "watch.out"
    with open(out, "wb") as f:
        proc = subprocess.Popen(
            [str(stoker_bin()), "status", "--watch", "0.2", "--json", "--socket", d.socket],
            stdout=f, stderr=subprocess.PIPE, preexec_fn=_die_with_parent,
        )
    try:
        assert poll(lambda: '"workers"' in out.read_text(), timeout=20), out.read_text()
        d.stop()
        # The daemon is gone: each frame says why, and the watch goes on asking.
        errors = lambda: [ln for ln in out.read_text().splitlines() if '"error"' in ln]  # noqa: E731
        assert poll(lambda: len(errors()) >= 2, timeout=20), out.read_text()
        assert "no stoker daemon" in json.loads(errors()[-1])["error"], errors()
        assert proc.poll() is None, "--watch exited when the daemon stopped"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(10)
