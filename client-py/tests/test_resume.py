"""state_dict / load_state_dict resume, and Ctrl-C during a wait."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import stop_process, wait_until_blocked


def _labels(batches) -> list[int]:
    return [int(v) for b in batches for v in b["label"]]


def test_resume_mid_epoch_continues_the_same_order(start_daemon, stoker, data) -> None:
    daemon = start_daemon(datasets={"train": data})
    kw = dict(batch_size=8, shuffle=True, seed=11, rank=1, world_size=2, socket=daemon.socket)

    full = stoker.Loader("train", **kw)
    full.set_epoch(3)
    expected = _labels(full)

    first = stoker.Loader("train", **kw)
    first.set_epoch(3)
    it = iter(first)
    head = [next(it) for _ in range(2)]
    head_labels = _labels(head)
    for b in head:
        data.check_batch(b)
    state = first.state_dict()
    assert (state["epoch"], state["step"]) == (3, 2)
    first.close()

    resumed = stoker.Loader("train", **kw)
    resumed.load_state_dict(state)
    resumed.set_epoch(3)  # the usual epoch loop: keeps the saved step
    tail = []
    for b in resumed:
        data.check_batch(b)
        tail += _labels([b])
    assert head_labels + tail == expected
    assert resumed.state_dict()["step"] == len(resumed)


def test_load_state_dict_refuses_a_different_sampling(start_daemon, stoker, data) -> None:
    daemon = start_daemon(datasets={"train": data})
    a = stoker.Loader("train", batch_size=8, seed=1, socket=daemon.socket)
    b = stoker.Loader("train", batch_size=8, seed=2, socket=daemon.socket)
    try:
        b.load_state_dict(a.state_dict())
    except ValueError as e:
        assert "seed" in str(e)
    else:
        raise AssertionError("load_state_dict accepted another seed")


def test_ctrl_c_interrupts_a_wait_and_the_loader_still_works(start_daemon, stoker, data) -> None:
    daemon = start_daemon(datasets={"train": data})
    child = textwrap.dedent(
        f"""
        import sys, stoker
        loader = stoker.Loader("train", batch_size=8, shuffle=False, socket={daemon.socket!r})
        it = iter(loader)
        print("ready", flush=True)
        sys.stdin.readline()
        print("iterating", flush=True)
        taken = 0
        try:
            while True:  # batches prefetched before the daemon stopped, then a wait
                next(it)
                taken += 1
        except KeyboardInterrupt:
            print("interrupted", taken, flush=True)
        sys.stdin.readline()
        batch = next(it)
        print("label", int(batch["label"][0]), flush=True)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        stop_process(daemon.proc.pid)  # the daemon cannot answer: next() must wait
        try:
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "iterating"
            # Into next(), which cannot return while the daemon is stopped.
            wait_until_blocked(proc, "the client waiting in next() for the stopped daemon")
            proc.send_signal(signal.SIGINT)
            line = proc.stdout.readline().split()
            assert line[:1] == ["interrupted"], proc.stderr.read() if proc.poll() is not None else line
            taken = int(line[1])
            assert taken <= 4, f"{taken} batches while the daemon was stopped: more than the ring holds"
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        line = proc.stdout.readline().split()
        # Nothing was lost to the interrupted wait: the next batch is the one after those taken.
        assert line == ["label", str(8 * taken)], line
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()


def test_timeout_raises_when_the_daemon_does_not_answer_and_the_loader_recovers(start_daemon, stoker, data) -> None:
    daemon = start_daemon(datasets={"train": data})
    loader = stoker.Loader("train", batch_size=8, shuffle=False, socket=daemon.socket, timeout=0.5)
    it = iter(loader)
    first = data.check_batch(next(it))
    stop_process(daemon.proc.pid)
    prefetched = []
    try:
        t0 = time.monotonic()
        with pytest.raises(stoker.Timeout) as exc:
            for _ in range(100):  # batches published before the daemon stopped come first
                prefetched += data.check_batch(next(it))
        assert "did not answer" in str(exc.value)
        assert isinstance(exc.value, TimeoutError)
        assert len(prefetched) <= 4 * 8, "more batches than the ring holds while the daemon was stopped"
        assert time.monotonic() - t0 < 30  # a hang guard, not a timing assertion
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    # Nothing is lost to the timed-out wait: iteration goes on with the next batch.
    rest = [i for b in it for i in data.check_batch(b)]
    assert first + prefetched + rest == list(range(data.n))


def test_iteration_survives_a_daemon_restart(start_daemon, stoker, data) -> None:
    """The daemon is killed mid-epoch and a new one starts on the same socket
    (as systemd would restart it): the loader reconnects and resumes at the
    next batch, so the epoch is exactly the uninterrupted one."""
    from conftest import Daemon

    daemon = start_daemon(datasets={"train": data})
    kw = dict(batch_size=8, shuffle=True, seed=5, socket=daemon.socket)
    expected = _labels(stoker.Loader("train", **kw))

    loader = stoker.Loader("train", reconnect=30, **kw)
    it = iter(loader)
    held = next(it)  # arrays from the old daemon's ring stay valid
    got = _labels([held, next(it)])
    daemon.kill()
    restarted = Daemon(daemon.workdir, daemon.config.read_text())
    try:
        with pytest.warns(RuntimeWarning, match="reconnected"):
            for b in it:
                data.check_batch(b)
                got += _labels([b])
        assert got == expected
        data.check_batch(held)
    finally:
        restarted.stop()


def test_a_socket_that_never_answers_times_out_instead_of_hanging(stoker, short_tmp) -> None:
    """A listener that accepts connections but never speaks (a wedged daemon,
    or some other program on the path): the constructor gives up after
    `timeout` instead of blocking forever."""
    import socket as socketlib

    path = str(short_tmp / "mute.sock")
    mute = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    mute.bind(path)
    mute.listen(4)  # connections complete in the backlog; nothing is ever read or sent
    try:
        with pytest.raises(stoker.Timeout):
            stoker.Loader("train", batch_size=4, socket=path, timeout=0.5)
    finally:
        mute.close()
