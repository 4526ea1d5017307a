"""Deployment recipes: the systemd unit and its sysusers/tmpfiles snippets, the
Slurm per-job and node-wide scripts, and `stoker status --wait` that they use.

The unit is checked with `systemd-analyze verify` (Debian's `systemd` package,
installed by scripts/setup.sh); the per-job batch script runs for real without
Slurm, with a stand-in `srun` on PATH that runs its command, against the real
daemon and a Python Loader.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket as pysocket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import REPO, Daemon, make_config, poll, stoker_bin, write_h5

SYSTEMD = REPO / "config" / "systemd"
SLURM = REPO / "config" / "slurm"
UNIT = SYSTEMD / "stoker.service"
ROOT_DROPIN = SYSTEMD / "stoker.service.d" / "root.conf"
SHELL_SCRIPTS = [SLURM / "job-with-daemon.sbatch", SLURM / "prolog.sh", SLURM / "epilog.sh"]
TIMEOUT_S = 120


def need_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (Debian: apt-get install systemd; scripts/setup.sh does it)")
    return path


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # Socket paths are limited to 107 bytes; pytest's tmp_path can be longer.
    d = Path(tempfile.mkdtemp(prefix="stk-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def unit_settings(text: str) -> dict[str, list[str]]:
    """Key -> values of the uncommented `Key=value` lines of a unit file."""
    settings: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z]+)=(.*)$", line)
        if m:
            settings.setdefault(m.group(1), []).append(m.group(2))
    return settings


# --------------------------------------------------------------------------
# systemd
# --------------------------------------------------------------------------


def verify_unit(unit_text: str, workdir: Path, dropin: str | None = None) -> subprocess.CompletedProcess[str]:
    """`systemd-analyze verify` on a copy of the unit whose stoker paths point at
    the built binary (verify checks that ExecStart= programs exist)."""
    analyze = need_tool("systemd-analyze")
    path = workdir / "stoker.service"
    path.write_text(unit_text.replace("/usr/local/bin/stoker", str(stoker_bin())))
    if dropin is not None:
        (workdir / "stoker.service.d").mkdir()
        (workdir / "stoker.service.d" / "root.conf").write_text(dropin)
    return subprocess.run(
        [analyze, "verify", "--man=no", str(path)], capture_output=True, text=True, timeout=TIMEOUT_S, cwd=workdir
    )


def complaints(res: subprocess.CompletedProcess[str], workdir: Path) -> list[str]:
    """Lines of verify's output about our files: unknown keys and bad values are
    only warnings (exit 0), so they are looked for explicitly."""
    out = res.stdout + res.stderr
    return [line for line in out.splitlines() if "stoker.service" in line or str(workdir) in line]


def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    if not stoker_bin().is_file():
        pytest.fail(f"stoker binary not found at {stoker_bin()} (build it or set STOKER_BIN)")
    res = verify_unit(UNIT.read_text(), tmp_path, dropin=ROOT_DROPIN.read_text())
    assert res.returncode == 0, f"systemd-analyze verify failed:\n{res.stdout}{res.stderr}"
    assert complaints(res, tmp_path) == [], "\n".join(complaints(res, tmp_path))


def test_verify_catches_a_broken_unit(tmp_path: Path) -> None:
    # The check above would notice a typo: verify reports it (as a warning).
    broken = UNIT.read_text().replace("LockPersonality=yes", "LockPersonalty=yes")
    res = verify_unit(broken, tmp_path)
    assert any("LockPersonalty" in line for line in complaints(res, tmp_path)), res.stdout + res.stderr


def test_unit_runs_the_daemon_as_documented() -> None:
    s = unit_settings(UNIT.read_text())
    assert s["Type"] == ["notify"] and s["NotifyAccess"] == ["main"] and s["WatchdogSec"] == ["30"]
    assert s["ExecStartPre"] == ["/usr/local/bin/stoker validate --skip-files /etc/stoker/stoker.toml"]
    assert s["ExecStart"] == ["/usr/local/bin/stoker serve --config /etc/stoker/stoker.toml"]
    assert s["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert s["KillSignal"] == ["SIGTERM"]
    assert s["User"] == ["stoker"] and s["Group"] == ["stoker"]
    assert s["RuntimeDirectory"] == ["stoker"] and s["RuntimeDirectoryMode"] == ["0755"]
    assert s["LimitNOFILE"] == ["65536"]
    assert s["ProtectSystem"] == ["strict"] and s["MemoryDenyWriteExecute"] == ["yes"]
    assert "RemoveIPC" not in s, "RemoveIPC= would delete the stoker user's other IPC objects on every stop"
    assert "ProtectProc" not in s and "PrivateUsers" not in s, "both break reading and serving clients' identities"
    # Root mode adds back exactly the capabilities fsaccess.rs needs.
    root = unit_settings(ROOT_DROPIN.read_text())
    assert root["User"] == [""] and root["Group"] == [""]
    assert set(root["CapabilityBoundingSet"][0].split()) == {"CAP_SETUID", "CAP_SETGID", "CAP_DAC_READ_SEARCH", "CAP_CHOWN"}


def test_shipped_config_passes_the_units_exec_start_pre() -> None:
    # ExecStartPre= runs `stoker validate` on the installed config; the shipped
    # defaults must pass it as they are.
    res = subprocess.run(
        [str(stoker_bin()), "validate", "--skip-files", str(REPO / "config" / "stoker.toml")],
        capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "/run/stoker/stoker.sock" in res.stdout, res.stdout


def test_sysusers_and_tmpfiles_snippets_apply(tmp_path: Path) -> None:
    sysusers = need_tool("systemd-sysusers")
    tmpfiles = need_tool("systemd-tmpfiles")
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    # Into a scratch root, not the host: creates the user in root/etc/passwd.
    res = subprocess.run(
        [sysusers, f"--root={root}", str(SYSTEMD / "stoker.sysusers")], capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert res.returncode == 0, res.stdout + res.stderr
    users = {line.split(":")[0]: line.split(":") for line in (root / "etc" / "passwd").read_text().splitlines()}
    assert "stoker" in users, (root / "etc" / "passwd").read_text()
    uid, gid, home, shell = int(users["stoker"][2]), int(users["stoker"][3]), users["stoker"][5], users["stoker"][6]
    assert shell == "/usr/sbin/nologin" and home == "/", users["stoker"]
    assert "stoker:" in (root / "etc" / "group").read_text()

    if os.geteuid() != 0:
        pytest.skip("systemd-tmpfiles --create chowns /run/stoker to the stoker user: needs root")
    res = subprocess.run(
        [tmpfiles, f"--root={root}", "--create", str(SYSTEMD / "stoker.tmpfiles")],
        capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    st = (root / "run" / "stoker").stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (uid, gid, 0o755)


# --------------------------------------------------------------------------
# stoker status --wait
# --------------------------------------------------------------------------


def test_status_wait_succeeds_once_the_daemon_starts(short_dir: Path, tmp_path: Path) -> None:
    sock = short_dir / "stoker.sock"
    waiter = subprocess.Popen(
        [str(stoker_bin()), "status", "--wait", "20", "--json", "--socket", str(sock)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        # No daemon yet: the waiter must still be retrying, not have given up.
        with pytest.raises(subprocess.TimeoutExpired):
            waiter.wait(0.5)
        data = write_h5(tmp_path / "data")
        daemon = Daemon(short_dir, make_config(str(sock), allowed_roots=[tmp_path], datasets={"train": data}))
        try:
            out, err = waiter.communicate(timeout=TIMEOUT_S)
            assert waiter.returncode == 0, err
            assert json.loads(out)["pid"] == daemon.proc.pid
        finally:
            daemon.stop()
    finally:
        waiter.kill()
        waiter.wait()


def test_status_wait_without_a_value_and_without_wait(short_dir: Path) -> None:
    sock = short_dir / "stoker.sock"
    daemon = Daemon(short_dir, make_config(str(sock)))
    try:
        for args in (["--wait"], []):
            res = daemon.cli("status", "--json", *args)
            assert json.loads(res.stdout)["pid"] == daemon.proc.pid
    finally:
        daemon.stop()


def test_status_wait_times_out_with_a_clear_message(short_dir: Path) -> None:
    sock = short_dir / "nobody-here.sock"
    res = subprocess.run(
        [str(stoker_bin()), "status", "--wait", "0.5", "--socket", str(sock)],
        capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    assert res.returncode == 1, res
    assert f"no stoker daemon answered at {sock} within 0.5 s" in res.stderr, res.stderr
    assert "No such file" in res.stderr, res.stderr  # the last cause, for the admin


def test_status_wait_gives_up_on_a_socket_that_never_answers(short_dir: Path) -> None:
    # Something accepts connections (the kernel's backlog) but never replies: the
    # wait must still end at its deadline.
    sock = short_dir / "silent.sock"
    listener = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    listener.bind(str(sock))
    listener.listen(16)
    try:
        res = subprocess.run(
            [str(stoker_bin()), "status", "--wait", "1", "--socket", str(sock)],
            capture_output=True, text=True, timeout=TIMEOUT_S,
        )
    finally:
        listener.close()
    assert res.returncode == 1, res
    assert "accepted the connection but did not answer within 1 s" in res.stderr, res.stderr


def test_status_wait_rejects_a_bad_duration(short_dir: Path) -> None:
    for bad in ("soon", "inf", "NaN"):
        res = subprocess.run(
            [str(stoker_bin()), "status", "--wait", bad, "--socket", str(short_dir / "s.sock")],
            capture_output=True, text=True, timeout=TIMEOUT_S,
        )
        assert res.returncode != 0, (bad, res)
        assert "--wait" in res.stderr, (bad, res.stderr)


# --------------------------------------------------------------------------
# Slurm
# --------------------------------------------------------------------------


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_slurm_scripts_parse(script: Path) -> None:
    res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert res.returncode == 0, res.stderr
    assert os.access(script, os.X_OK), f"{script} is not executable"
    shellcheck = shutil.which("shellcheck")
    if shellcheck:  # optional: not a Debian default
        res = subprocess.run([shellcheck, "-s", "bash", str(script)], capture_output=True, text=True, timeout=TIMEOUT_S)
        assert res.returncode == 0, res.stdout


# Stands in for srun: logs its pid (the daemon's, for `serve`, since it execs)
# and arguments, drops the options and runs the command on this machine.
SRUN_SHIM = """#!/bin/bash
printf '%s %s\\n' "$$" "$*" >> "$SRUN_LOG"
while [ $# -gt 0 ] && [[ $1 == -* ]]; do shift; done
exec "$@"
"""

TRAIN_PY = """
import json, os, sys
import numpy as np
import stoker

loader = stoker.Loader("train", batch_size=8, shuffle=False)
labels = []
for batch in loader:
    labels += np.asarray(batch["label"]).astype(int).tolist()
loader.close()
with open(os.environ["TRAIN_OUT"], "w") as f:
    json.dump({"labels": labels, "socket": os.environ["STOKER_SOCKET"]}, f)
sys.exit(int(os.environ.get("TRAIN_EXIT", "0")))
"""


def run_batch_script(job_dir: Path, data_root: Path, train_exit: int) -> tuple[subprocess.CompletedProcess[str], Path]:
    bin_dir = job_dir / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(SRUN_SHIM)
    (bin_dir / "srun").chmod(0o755)
    (bin_dir / "stoker").symlink_to(stoker_bin())
    # (a wrapper, not a symlink: a symlinked venv python would not find its venv)
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python").chmod(0o755)
    (job_dir / "train.py").write_text(TRAIN_PY)
    data = write_h5(data_root)
    config = job_dir / "stoker.toml"
    config.write_text(make_config("/run/stoker/unused.sock", allowed_roots=[data_root], datasets={"train": data}))
    tmpdir = job_dir / "tmp"
    tmpdir.mkdir()
    env = {
        k: v for k, v in os.environ.items()
        if not k.startswith("SLURM_") and k not in ("RANK", "WORLD_SIZE", "STOKER_SOCKET", "TMPDIR")
    }
    env.update(
        PATH=f"{bin_dir}:{env.get('PATH', '/usr/bin:/bin')}",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NUM_NODES="1",
        SLURM_CPUS_ON_NODE="2",
        TMPDIR=str(tmpdir),
        STOKER_CONFIG=str(config),
        SRUN_LOG=str(job_dir / "srun.log"),
        TRAIN_OUT=str(job_dir / "train.json"),
        TRAIN_EXIT=str(train_exit),
    )
    res = subprocess.run(
        ["bash", str(SLURM / "job-with-daemon.sbatch")],
        cwd=job_dir, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    return res, tmpdir


def srun_calls(job_dir: Path) -> list[tuple[int, str]]:
    calls = []
    for line in (job_dir / "srun.log").read_text().splitlines():
        pid, args = line.split(" ", 1)
        calls.append((int(pid), args))
    return calls


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_per_job_batch_script_starts_waits_trains_and_stops_the_daemon(short_dir: Path, tmp_path: Path) -> None:
    res, tmpdir = run_batch_script(short_dir, tmp_path / "data", train_exit=0)
    assert res.returncode == 0, f"stdout:\n{res.stdout}\nstderr:\n{res.stderr}"

    calls = srun_calls(short_dir)
    sock = tmpdir / "stoker-4242.sock"
    serve = [(pid, a) for pid, a in calls if " serve " in f" {a} "]
    assert len(serve) == 1, calls
    daemon_pid, serve_args = serve[0]
    assert "--overlap" in serve_args and "--ntasks-per-node=1" in serve_args, serve_args
    assert f"--socket {sock}" in serve_args, serve_args
    # The daemon and the readiness wait (in either order: the daemon step runs in
    # the background, so the wait may well start first and retry), then training.
    assert len(calls) == 3, calls
    assert sorted(" serve " in a for _, a in calls[:2]) == [False, True], calls
    assert any(" status --wait " in a for _, a in calls[:2]), calls
    assert calls[2][1].endswith("python train.py"), calls

    out = json.loads((short_dir / "train.json").read_text())
    assert out["socket"] == str(sock)
    assert sorted(out["labels"]) == list(range(100)), out["labels"]
    # Stopped with SIGTERM (a drain), its socket removed.
    assert "SIGTERM: draining" in res.stderr, res.stderr
    assert gone(daemon_pid), f"daemon {daemon_pid} still running"
    assert not sock.exists()


def test_per_job_batch_script_stops_the_daemon_when_training_fails(short_dir: Path, tmp_path: Path) -> None:
    res, tmpdir = run_batch_script(short_dir, tmp_path / "data", train_exit=3)
    assert res.returncode == 3, f"stdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    daemon_pid = next(pid for pid, a in srun_calls(short_dir) if " serve " in f" {a} ")
    assert "SIGTERM: draining" in res.stderr, res.stderr
    assert gone(daemon_pid), f"daemon {daemon_pid} outlived the failed job"
    assert not (tmpdir / "stoker-4242.sock").exists()


def test_epilog_stops_an_idle_daemon_only_when_asked(short_dir: Path) -> None:
    if shutil.which("python3") is None:
        pytest.skip("the epilog's idle check needs python3")
    sock = short_dir / "stoker.sock"
    daemon = Daemon(short_dir, make_config(str(sock)))
    try:
        env = dict(os.environ, STOKER=str(stoker_bin()), STOKER_SOCKET=str(sock))
        env.pop("STOKER_EPILOG_STOP", None)
        res = subprocess.run(["bash", str(SLURM / "epilog.sh")], env=env, capture_output=True, text=True,
                             timeout=TIMEOUT_S)
        assert res.returncode == 0, res.stderr
        assert daemon.alive(), "the default epilog leaves the daemon running"

        env["STOKER_EPILOG_STOP"] = "idle"
        res = subprocess.run(["bash", str(SLURM / "epilog.sh")], env=env, capture_output=True, text=True,
                             timeout=TIMEOUT_S)
        assert res.returncode == 0, res.stderr
        assert daemon.proc.wait(TIMEOUT_S) == 0
        assert "SIGTERM: draining" in daemon.stderr()
    finally:
        daemon.stop()


def test_epilog_leaves_a_daemon_with_a_client_running(short_dir: Path, stoker, tmp_path: Path) -> None:
    sock = short_dir / "stoker.sock"
    data = write_h5(tmp_path / "data")
    daemon = Daemon(short_dir, make_config(str(sock), allowed_roots=[tmp_path], datasets={"train": data}))
    try:
        loader = stoker.Loader("train", batch_size=8, socket=str(sock))
        env = dict(os.environ, STOKER=str(stoker_bin()), STOKER_SOCKET=str(sock), STOKER_EPILOG_STOP="idle")
        res = subprocess.run(["bash", str(SLURM / "epilog.sh")], env=env, capture_output=True, text=True,
                             timeout=TIMEOUT_S)
        assert res.returncode == 0, res.stderr
        assert daemon.alive(), "the epilog stopped a daemon another job still uses"
        assert sum(1 for _ in loader) == len(loader)
        loader.close()
    finally:
        daemon.stop()


def test_prolog_starts_a_daemon_without_systemd_and_is_idempotent(short_dir: Path) -> None:
    if shutil.which("systemctl") and subprocess.run(["systemctl", "cat", "stoker.service"],
                                                    capture_output=True).returncode == 0:
        pytest.skip("a stoker.service unit is installed here; the prolog would use it")
    sock = short_dir / "run" / "stoker.sock"
    config = short_dir / "stoker.toml"
    config.write_text(make_config(str(sock)))
    user = subprocess.run(["id", "-un"], capture_output=True, text=True).stdout.strip()
    env = dict(
        os.environ, STOKER=str(stoker_bin()), STOKER_SOCKET=str(sock), STOKER_CONFIG=str(config),
        STOKER_USER=user, STOKER_LOG_FILE=str(short_dir / "stoker.log"), STOKER_WAIT_S="20",
    )
    if os.geteuid() != 0:
        pytest.skip("the prolog creates the socket directory for the stoker user: run as root (slurmd does)")
    pids = []
    try:
        for _ in range(2):
            res = subprocess.run(["bash", str(SLURM / "prolog.sh")], env=env, capture_output=True, text=True,
                                 timeout=TIMEOUT_S)
            assert res.returncode == 0, res.stderr
            status = subprocess.run([str(stoker_bin()), "status", "--json", "--socket", str(sock)],
                                    capture_output=True, text=True, timeout=TIMEOUT_S)
            assert status.returncode == 0, (status.stderr, (short_dir / "stoker.log").read_text())
            pids.append(json.loads(status.stdout)["pid"])
        assert pids[0] == pids[1], "the second prolog started another daemon"
    finally:
        for pid in set(pids):
            os.kill(pid, signal.SIGTERM)
        for pid in set(pids):
            poll(lambda pid=pid: gone(pid), TIMEOUT_S)
