"""The Pythonic edges of `stoker.Loader`: exceptions that are also builtins,
rank/world detection that never surprises, pickling and fork, and
DataLoader-like re-iteration."""

from __future__ import annotations

import copy
import json
import logging
import os
import pickle
import socket as socketlib
import subprocess
import sys
import textwrap
import warnings
from typing import Any

import numpy as np
import pytest

from conftest import SUBPROCESS_TIMEOUT_S, _clean_env

BATCH = 8


def labels(batches: Any) -> list[int]:
    return [int(v) for b in batches for v in np.asarray(b["label"])]


def epoch_labels(loader: Any, epoch: int) -> list[int]:
    loader.set_epoch(epoch)
    return labels(loader)


@pytest.fixture
def no_rank_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """An environment with no launcher variables (the test adds what it needs)."""
    for k in list(os.environ):
        if k in ("RANK", "WORLD_SIZE") or k.startswith("SLURM_"):
            monkeypatch.delenv(k)
    return monkeypatch


# ---------------------------------------------------------------------------
# Exceptions: each a StokerError and its builtin, raised by the real daemon
# ---------------------------------------------------------------------------

BUILTINS = {
    "Timeout": TimeoutError,
    "DaemonUnavailable": ConnectionError,
    "AccessDenied": PermissionError,
    "LimitError": MemoryError,
    "DatasetError": OSError,
    "ProtocolError": RuntimeError,
}


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_each_exception_is_a_stoker_error_and_its_builtin_and_pickles(stoker, name) -> None:
    import stoker._native as native

    cls = getattr(stoker, name)
    assert cls is getattr(native, name), "stoker._native must expose the same class"
    assert issubclass(cls, stoker.StokerError) and issubclass(cls, BUILTINS[name])
    assert cls.__module__ == "stoker" and getattr(stoker, cls.__qualname__) is cls
    err = cls("the file /data/x.h5, field 'x', index 7")
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is cls and again.args == err.args and str(again) == str(err)


def test_daemon_unavailable_is_a_connection_error(stoker, short_tmp) -> None:
    with pytest.raises(ConnectionError) as exc:
        stoker.Loader("train", batch_size=4, socket=str(short_tmp / "none.sock"), reconnect=0)
    assert isinstance(exc.value, stoker.DaemonUnavailable)
    assert "none.sock" in str(exc.value)


def test_timeout_is_a_timeout_error(stoker, short_tmp) -> None:
    path = str(short_tmp / "mute.sock")
    mute = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    mute.bind(path)
    mute.listen(4)  # accepted into the backlog, never answered
    try:
        with pytest.raises(TimeoutError) as exc:
            stoker.Loader("train", batch_size=4, socket=path, timeout=0.3)
        assert isinstance(exc.value, stoker.Timeout)
    finally:
        mute.close()


def test_dataset_error_is_an_os_error(start_daemon, stoker, data) -> None:
    d = start_daemon()
    with pytest.raises(OSError) as exc:
        stoker.Loader(stoker.hdf5(data.glob, fields={"x": "no/such/path"}), batch_size=4, socket=d.socket)
    assert isinstance(exc.value, stoker.DatasetError)
    assert "no/such/path" in str(exc.value)
    # Picklable as raised (crosses multiprocessing boundaries intact).
    again = pickle.loads(pickle.dumps(exc.value))
    assert type(again) is stoker.DatasetError and str(again) == str(exc.value)


def test_access_denied_is_a_permission_error(start_daemon, stoker, data, tmp_path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    d = start_daemon(allowed_roots=[elsewhere])
    with pytest.raises(PermissionError) as exc:
        stoker.Loader(data.spec(stoker), batch_size=4, socket=d.socket)
    assert isinstance(exc.value, stoker.AccessDenied)


def test_limit_error_is_a_memory_error(start_daemon, stoker, data) -> None:
    d = start_daemon(extra="[limits]\nmax_batch_bytes = 8192\n")
    with pytest.raises(MemoryError) as exc:
        stoker.Loader(data.spec(stoker), batch_size=1000, socket=d.socket)
    assert isinstance(exc.value, stoker.LimitError)
    assert "max_batch_bytes" in str(exc.value)


# ---------------------------------------------------------------------------
# Rank and world
# ---------------------------------------------------------------------------


def test_slurm_ntasks_alone_does_not_shard(start_daemon, stoker, data, no_rank_env) -> None:
    """`sbatch --ntasks=4` sets SLURM_NTASKS (and SLURM_PROCID=0) in the batch
    script, where one process runs: it must see all the data."""
    no_rank_env.setenv("SLURM_NTASKS", "4")
    no_rank_env.setenv("SLURM_PROCID", "0")
    no_rank_env.setenv("SLURM_JOB_ID", "4242")
    d = start_daemon()
    loader = stoker.Loader(data.spec(stoker), batch_size=BATCH, shuffle=False, socket=d.socket)
    assert (loader.rank, loader.world_size, loader.rank_source) == (0, 1, "default")
    got = labels(loader)
    assert got == list(range(data.n))
    assert len(loader) == -(-data.n // BATCH)


@pytest.mark.parametrize(
    "env, args, expected",
    [
        ({}, {}, (0, 1, "default")),
        ({"RANK": "2", "WORLD_SIZE": "3"}, {}, (2, 3, "env RANK/WORLD_SIZE")),
        # A task of `srun -n 3`: Slurm sets the step id.
        ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "3"}, {}, (1, 3, "slurm")),
        # srun with fewer tasks than the allocation: the step's count.
        ({"SLURM_STEP_ID": "1", "SLURM_PROCID": "1", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "2"}, {},
         (1, 2, "slurm")),
        # One task in a step (`srun -n 1 python train.py`): not sharded.
        ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, {}, (0, 1, "default")),
        # torchrun's variables win over Slurm's.
        ({"RANK": "0", "WORLD_SIZE": "2", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "4"}, {},
         (0, 2, "env RANK/WORLD_SIZE")),
        # Arguments win over everything.
        ({"RANK": "2", "WORLD_SIZE": "3"}, {"rank": 1, "world_size": 2}, (1, 2, "argument")),
    ],
    ids=["default", "torchrun", "srun", "srun-step-tasks", "srun-one-task", "env-over-slurm", "argument"],
)
def test_rank_world_rules(start_daemon, stoker, data, no_rank_env, env, args, expected) -> None:
    for k, v in env.items():
        no_rank_env.setenv(k, v)
    d = start_daemon()
    loader = stoker.Loader(data.spec(stoker), batch_size=BATCH, shuffle=False, socket=d.socket, **args)
    assert (loader.rank, loader.world_size, loader.rank_source) == expected
    rank, world, _ = expected
    # The shard is the one those numbers select (positions rank, rank + world, ...).
    assert labels(loader) == list(range(data.n))[rank::world] + (
        [] if data.n % world == 0 or rank < data.n % world else [rank - data.n % world]
    )


@pytest.mark.parametrize(
    "env, args, needle",
    [
        ({"RANK": "1"}, {}, "$RANK is set but $WORLD_SIZE is not"),
        ({"WORLD_SIZE": "2"}, {}, "$WORLD_SIZE is set but $RANK is not"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, {}, "$RANK='x' is not an integer"),
        ({}, {"rank": 1}, "pass both rank and world_size"),
        ({"RANK": "3", "WORLD_SIZE": "2"}, {}, "from env RANK/WORLD_SIZE"),
    ],
    ids=["rank-only", "world-only", "not-int", "one-arg", "out-of-range"],
)
def test_rank_world_mistakes_are_value_errors(stoker, no_rank_env, short_tmp, env, args, needle) -> None:
    for k, v in env.items():
        no_rank_env.setenv(k, v)
    with pytest.raises(ValueError) as exc:
        stoker.Loader("train", batch_size=4, socket=str(short_tmp / "none.sock"), **args)
    assert needle in str(exc.value)


def test_rank_choice_is_logged_once_at_info(start_daemon, stoker, data, no_rank_env, caplog) -> None:
    no_rank_env.setenv("RANK", "1")
    no_rank_env.setenv("WORLD_SIZE", "5")  # a combination no other test logs
    d = start_daemon()
    with caplog.at_level(logging.INFO, logger="stoker"):
        for _ in range(3):
            stoker.Loader(data.spec(stoker), batch_size=BATCH, socket=d.socket)
    lines = [r for r in caplog.records if r.name == "stoker" and "world_size 5" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    assert lines[0].levelno == logging.INFO
    assert "rank 1" in lines[0].getMessage() and "env RANK/WORLD_SIZE" in lines[0].getMessage()


def test_numpy_output_does_not_import_torch(start_daemon, data) -> None:
    d = start_daemon()
    src = textwrap.dedent(
        f"""
        import sys, stoker
        loader = stoker.Loader(stoker.hdf5({data.glob!r}, fields={data.fields!r}), batch_size=8,
                               socket={d.socket!r})
        n = sum(1 for _ in loader)
        assert n == len(loader), n
        print("torch" in sys.modules)
        """
    )
    res = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True,
                         timeout=SUBPROCESS_TIMEOUT_S, env=_clean_env(None))
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["False"], res.stdout


def test_output_other_than_numpy_or_torch_is_a_value_error(stoker, short_tmp) -> None:
    with pytest.raises(ValueError, match="output must be 'numpy' or 'torch'"):
        stoker.Loader("train", batch_size=4, socket=str(short_tmp / "none.sock"), output="jax")


# ---------------------------------------------------------------------------
# Pickling, deepcopy, spawn and fork
# ---------------------------------------------------------------------------


def test_the_package_re_exports_its_api_and_pickles_name_stoker(stoker) -> None:
    """The classes live in private modules (`stoker._loader`, `stoker._specs`, ...);
    users import them from `stoker`, and a pickled Loader names `stoker.Loader`
    as it did before the split, so pickles load in either version."""
    for name in stoker.__all__:
        assert getattr(stoker, name) is not None, name
    assert set(stoker._errors.__all__) <= set(stoker.__all__)
    assert (stoker.Loader.__module__, stoker.Loader.__qualname__) == ("stoker", "Loader")
    assert b"cstoker\nLoader\n" in pickle.dumps(stoker.Loader, protocol=2)  # the GLOBAL opcode
    assert pickle.loads(b"cstoker\nLoader\n.") is stoker.Loader
    for name in ("Hdf5Spec", "LmdbSpec", "hdf5", "lmdb", "_EpochSampler"):
        obj = getattr(stoker, name)
        assert pickle.loads(pickle.dumps(obj)) is obj, name
        assert pickle.loads(f"cstoker\n{name}\n.".encode()) is obj, name


def test_pickle_round_trip_keeps_config_and_position_and_reconnects_lazily(start_daemon, stoker, data) -> None:
    d = start_daemon(datasets={"train": data})
    kw = dict(batch_size=BATCH, shuffle=True, seed=5, rank=1, world_size=2, socket=d.socket)
    loader = stoker.Loader("train", **kw)
    expected = {e: epoch_labels(loader, e) for e in (2, 3)}

    loader.set_epoch(2)
    blob = pickle.dumps(loader)
    assert b"stoker._loader" not in blob
    copy_ = pickle.loads(blob)
    assert copy_._stream is None, "unpickling must not connect"
    assert (copy_.rank, copy_.world_size, copy_.rank_source, copy_.epoch) == (1, 2, "argument", 2)
    assert len(copy_) == len(loader)  # opens the stream on first use
    assert copy_.fields == loader.fields
    assert labels(copy_) == expected[2]
    assert epoch_labels(copy_, 3) == expected[3]

    # A pending resume travels too: the copy starts at the saved step.
    state = {**loader.state_dict(), "epoch": 3, "step": 2, "_num_yielded": 2}
    loader.load_state_dict(state)
    resumed = pickle.loads(pickle.dumps(loader))
    assert labels(resumed) == expected[3][2 * BATCH:]
    # and the original is untouched by its copies
    assert labels(loader) == expected[3][2 * BATCH:]


def test_deepcopy_is_an_independent_loader(start_daemon, stoker, data) -> None:
    d = start_daemon()
    loader = stoker.Loader(data.spec(stoker), batch_size=BATCH, seed=3, socket=d.socket)
    loader.set_epoch(1)
    twin = copy.deepcopy(loader)
    assert twin is not loader and twin._stream is None
    a, b = iter(loader), iter(twin)
    first_a, first_b = next(a), next(b)
    assert np.array_equal(first_a["label"], first_b["label"])
    rest_a, rest_b = labels(a), labels(b)  # interleaving is fine: separate streams
    assert rest_a == rest_b
    assert sorted(labels([first_a]) + rest_a) == list(range(data.n))
    assert loader._mapping_range() != twin._mapping_range()


SPAWN_SRC = r"""
import json, multiprocessing as mp, sys, zlib
import numpy as np
import stoker

def checksums(loader, epoch):
    loader.set_epoch(epoch)
    return [[int(zlib.crc32(np.ascontiguousarray(v).tobytes())) for _, v in sorted(b.items())] for b in loader]

def child(loader):
    return {"len": len(loader), "rank": loader.rank, "source": loader.rank_source,
            "sums": checksums(loader, 4)}

if __name__ == "__main__":
    a = json.loads(sys.argv[1])
    loader = stoker.Loader(stoker.hdf5(a["glob"], fields=a["fields"]), batch_size=8, seed=9,
                           rank=1, world_size=2, socket=a["socket"])
    mine = checksums(loader, 4)
    with mp.get_context("spawn").Pool(1) as pool:
        got = pool.apply(child, (loader,))
    print(json.dumps({"parent": mine, "len": len(loader), "child": got}))
"""


def test_spawn_child_iterates_a_pickled_loader(start_daemon, data, tmp_path) -> None:
    d = start_daemon()
    script = tmp_path / "spawn_child.py"
    script.write_text(SPAWN_SRC)
    args = {"glob": data.glob, "fields": data.fields, "socket": d.socket}
    res = subprocess.run([sys.executable, str(script), json.dumps(args)], capture_output=True, text=True,
                         timeout=SUBPROCESS_TIMEOUT_S, env=_clean_env(None))
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["child"]["len"] == out["len"] == len(out["parent"]) > 0
    assert (out["child"]["rank"], out["child"]["source"]) == (1, "argument")
    assert out["child"]["sums"] == out["parent"]


FORK_SRC = r"""
import gc, json, os, sys
import stoker
a = json.loads(sys.argv[1])
loader = stoker.Loader(stoker.hdf5(a["glob"], fields=a["fields"]), batch_size=4,
                       shuffle=False, rank=0, world_size=1, socket=a["socket"])
it = iter(loader)
first = next(it)
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    try:
        rest = [int(i) for b in it for i in b["label"]]
        again = [int(i) for b in loader for i in b["label"]]  # a new epoch pass in the child
        msg = {"rest": rest, "again": again, "len": len(loader)}
        # A loader of the child's own, then the inherited one dropped: the
        # parent's memory is not mapped here, and dropping what the child
        # inherited must not unmap what the child mapped since.
        own = stoker.Loader(stoker.hdf5(a["glob"], fields=a["fields"]), batch_size=3,
                            shuffle=False, rank=0, world_size=1, socket=a["socket"])
        del it, loader
        gc.collect()
        msg["own"] = [int(i) for b in own for i in b["label"]]
    except BaseException as e:
        msg = {"error": f"{type(e).__qualname__}: {e}"}
    os.write(w, json.dumps(msg).encode())
    os._exit(0)
os.close(w)
child = json.loads(os.read(r, 1 << 20).decode())
os.waitpid(pid, 0)
del first
parent = [int(i) for b in it for i in b["label"]]
print(json.dumps({"child": child, "parent": parent}))
"""


def test_forked_child_reopens_its_own_stream(start_daemon, data) -> None:
    d = start_daemon()
    args = {"glob": data.glob, "fields": data.fields, "socket": d.socket}
    res = subprocess.run([sys.executable, "-c", FORK_SRC, json.dumps(args)], capture_output=True, text=True,
                         timeout=SUBPROCESS_TIMEOUT_S, env=_clean_env(None))
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert "error" not in out["child"], out["child"]
    # The child goes on from where the parent stood, on its own connection.
    assert out["child"]["rest"] == list(range(4, data.n))
    assert out["child"]["again"] == list(range(data.n))
    assert out["child"]["len"] == -(-data.n // 4)
    assert out["child"]["own"] == list(range(data.n))
    # The parent's loader is unaffected.
    assert out["parent"] == list(range(4, data.n))
    assert d.alive()


# ---------------------------------------------------------------------------
# Re-iteration and the repeated-epoch warning
# ---------------------------------------------------------------------------


def test_iterating_a_shuffled_epoch_twice_without_set_epoch_warns_once(start_daemon, stoker, data) -> None:
    d = start_daemon()
    loader = stoker.Loader(data.spec(stoker), batch_size=BATCH, shuffle=True, seed=2, socket=d.socket)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = labels(loader)
        assert not caught
        second = labels(loader)  # the classic mistake: no set_epoch
        third = labels(loader)
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1, msgs
    assert "set_epoch(epoch)" in msgs[0] and "epoch 0" in msgs[0]
    assert caught[0].filename == __file__, "the warning points at the user's loop"
    assert first == second == third

    # The right loop never warns; nor does an unshuffled loader.
    quiet = stoker.Loader(data.spec(stoker), batch_size=BATCH, shuffle=True, seed=2, socket=d.socket)
    plain = stoker.Loader(data.spec(stoker), batch_size=BATCH, shuffle=False, socket=d.socket)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        orders = [epoch_labels(quiet, e) for e in range(3)]
        quiet.set_epoch(2)
        assert labels(quiet) == orders[2]  # set_epoch again, same epoch on purpose: no warning
        labels(plain), labels(plain)
    assert not caught, [str(w.message) for w in caught]
    assert orders[0] != orders[1] != orders[2]


def test_each_iter_restarts_the_epoch_like_a_dataloader(start_daemon, stoker, data) -> None:
    d = start_daemon()
    loader = stoker.Loader(data.spec(stoker), batch_size=BATCH, shuffle=False, socket=d.socket)
    full = list(range(data.n))
    it = iter(loader)
    head = [next(it) for _ in range(2)]
    assert labels(head) == full[: 2 * BATCH]
    del head
    # A new iter() starts over from the first batch, like DataLoader.
    fresh = iter(loader)
    assert labels(fresh) == full
    # The older iterator does not silently take batches of the newer pass.
    with pytest.raises(RuntimeError, match="newer iter"):
        next(it)
    assert len(loader) == -(-data.n // BATCH)
    assert sum(1 for _ in loader) == len(loader)

    # After load_state_dict only the first iter() resumes; the next restarts.
    loader.load_state_dict({**loader.state_dict(), "epoch": 0, "step": 3})
    assert labels(loader) == full[3 * BATCH:]
    assert labels(loader) == full


def test_state_dict_has_stateful_dataloader_keys(start_daemon, stoker, data) -> None:
    d = start_daemon()
    loader = stoker.Loader(data.spec(stoker), batch_size=BATCH, shuffle=True, seed=1, socket=d.socket)
    loader.set_epoch(2)
    it = iter(loader)
    next(it), next(it), next(it)
    state = loader.state_dict()
    assert (state["epoch"], state["step"], state["_num_yielded"], state["_iterator_finished"]) == (2, 3, 3, False)
    expected = labels(it)
    # A state with only torchdata's key resumes the same way.
    other = stoker.Loader(data.spec(stoker), batch_size=BATCH, shuffle=True, seed=1, socket=d.socket)
    other.load_state_dict({"epoch": 2, "_num_yielded": 3, "seed": 1})
    assert labels(other) == expected
    assert other.state_dict()["_iterator_finished"] is True
    with pytest.raises(ValueError, match="neither 'step' nor '_num_yielded'"):
        other.load_state_dict({"epoch": 2})
