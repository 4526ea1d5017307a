"""Datasets that grow: `rescan="epoch"` matches an HDF5 glob (lists LMDB keys)
again at each new epoch. Real files written by h5py and lmdb between epochs,
a real daemon, values compared with h5py byte for byte."""

from __future__ import annotations

import io
import os
from pathlib import Path

import h5py
import lmdb
import numpy as np
import pytest

from conftest import check_field
from lmdb_data import key, write_env

FIELDS = {"x": "data/x", "y": "y", "label": "label"}


def write_part(path: Path, n: int, base: int, *, seed: int = 0, resizable: bool = False) -> None:
    """A file of `n` rows whose `label` is `base + row` (unique across the test's files)."""
    rng = np.random.default_rng(seed + base)
    tmp = path.with_suffix(".tmp")
    with h5py.File(tmp, "w") as f:
        extra = {"maxshape": (None,), "chunks": (4,)} if resizable else {}
        f.create_dataset(
            "data/x",
            data=rng.standard_normal((n, 4, 3), dtype=np.float32),
            **({"maxshape": (None, 4, 3), "chunks": (4, 4, 3)} if resizable else {}),
        )
        f.create_dataset("y", data=rng.integers(0, 256, size=n, dtype=np.uint8), **extra)
        f.create_dataset("label", data=np.arange(base, base + n, dtype=">i8"), **extra)
    # A new file appears whole (as a writer that renames into place makes it).
    os.replace(tmp, path)


def reference(root: Path) -> dict[int, dict[str, np.ndarray]]:
    """label → the row of every field, read with h5py from the files matching now."""
    rows: dict[int, dict[str, np.ndarray]] = {}
    for path in sorted(root.glob("*.h5")):
        with h5py.File(path, "r") as f:
            values = {name: f[h5][()] for name, h5 in FIELDS.items()}
        for i, label in enumerate(values["label"]):
            rows[int(label)] = {name: v[i : i + 1] for name, v in values.items()}
    return rows


def check_epoch(batches: list[dict[str, np.ndarray]], ref: dict[int, dict[str, np.ndarray]]) -> list[int]:
    """Every batch's rows equal h5py's; returns the labels served."""
    labels = []
    for batch in batches:
        for row, label in enumerate(batch["label"].tolist()):
            assert label in ref, f"label {label} is not in the files matching now: a stale file list"
            for name in FIELDS:
                check_field(name, batch[name][row : row + 1], ref[label][name])
            labels.append(label)
    return labels


def run_epoch(loaders, epoch: int, root: Path) -> list[int]:
    """Every rank's epoch `epoch`, checked; the labels of all ranks together."""
    ref = reference(root)
    labels = []
    for loader in loaders:
        loader.set_epoch(epoch)
        batches = [{k: np.array(v) for k, v in b.items()} for b in loader]
        assert len(batches) == len(loader)
        labels += check_epoch(batches, ref)
    return labels


def spec(stoker, root: Path, **kw):
    return stoker.hdf5(str(root / "*.h5"), fields=FIELDS, **kw)


def test_files_added_and_removed_between_epochs_are_served_exactly_once_across_two_ranks(
    start_daemon, stoker, tmp_path
) -> None:
    root = tmp_path / "grow"
    root.mkdir()
    write_part(root / "a.h5", 10, 0)
    write_part(root / "b.h5", 14, 100)
    daemon = start_daemon()
    loaders = [
        stoker.Loader(spec(stoker, root, rescan="epoch"), batch_size=4, seed=5, rank=r, world_size=2, socket=daemon.socket)
        for r in range(2)
    ]
    plan = [
        # (files to add as (name, rows, first label), files to remove, expected batches per rank)
        ([], [], 3),  # 24 samples: 12 per rank
        ([("c.h5", 20, 200)], ["a.h5"], 5),  # 34: 17 per rank
        ([("d.h5", 6, 300), ("e.h5", 2, 400)], ["b.h5"], 4),  # 28: 14 per rank
    ]
    orders = []
    for epoch, (add, remove, batches) in enumerate(plan):
        for name, n, base in add:
            write_part(root / name, n, base)
        for name in remove:
            (root / name).unlink()
        expected = sorted(reference(root))
        for loader in loaders:
            loader.set_epoch(epoch)
            assert len(loader) == batches, f"epoch {epoch}: len(loader) did not follow the files"
        labels = run_epoch(loaders, epoch, root)
        assert sorted(labels) == expected, f"epoch {epoch}: not exactly once over the files matching now"
        orders.append(labels)
    info = loaders[0]._stream_info()
    assert (info["files"], info["samples"]) == (3, 28)


def test_a_file_appended_to_or_replaced_between_epochs_is_read_fresh(start_daemon, stoker, tmp_path) -> None:
    root = tmp_path / "grow"
    root.mkdir()
    write_part(root / "a.h5", 10, 0, resizable=True)
    write_part(root / "b.h5", 10, 100)
    daemon = start_daemon()
    loader = stoker.Loader(spec(stoker, root, rescan="epoch"), batch_size=4, seed=1, socket=daemon.socket)
    assert sorted(run_epoch([loader], 0, root)) == sorted(reference(root))
    # Append 6 rows to a.h5 in place (same inode), replace b.h5 by a new file with other values.
    rng = np.random.default_rng(99)
    with h5py.File(root / "a.h5", "a", locking=False) as f:  # as users write while serving
        for name in FIELDS.values():
            f[name].resize(16, axis=0)
        f["data/x"][10:] = rng.standard_normal((6, 4, 3), dtype=np.float32)
        f["y"][10:] = rng.integers(0, 256, size=6, dtype=np.uint8)
        f["label"][10:] = np.arange(10, 16)
    write_part(root / "b.h5", 12, 100, seed=7)
    ref = reference(root)
    loader.set_epoch(1)
    assert len(loader) == 7  # 28 samples
    labels = run_epoch([loader], 1, root)
    assert sorted(labels) == sorted(ref) == list(range(16)) + list(range(100, 112))


def test_resuming_against_another_generation_is_an_error_unless_asked_to_continue(
    start_daemon, stoker, tmp_path
) -> None:
    root = tmp_path / "grow"
    root.mkdir()
    write_part(root / "a.h5", 10, 0)
    write_part(root / "b.h5", 10, 100)
    daemon = start_daemon()
    kw = dict(batch_size=4, seed=3, socket=daemon.socket)
    first = stoker.Loader(spec(stoker, root, rescan="epoch"), **kw)
    first.set_epoch(2)
    it = iter(first)
    head = [next(it) for _ in range(2)]
    state = first.state_dict()
    assert state["dataset_files"] == 2 and state["dataset_samples"] == 20
    del head, it
    first.close()

    # The same files: resumes as before.
    same = stoker.Loader(spec(stoker, root, rescan="epoch"), **kw)
    same.load_state_dict(state)
    assert sum(1 for _ in same) == len(same) - 2

    write_part(root / "c.h5", 5, 200)
    resumed = stoker.Loader(spec(stoker, root, rescan="epoch"), **kw)
    with pytest.raises(stoker.DatasetError) as err:
        resumed.load_state_dict(state)
    message = str(err.value)
    for needle in ("2 files", "20 samples", "3 files", "25 samples", "strict=False"):
        assert needle in message, f"{needle!r} not in: {message}"
    with pytest.warns(RuntimeWarning, match="continuing"):
        resumed.load_state_dict(state, strict=False)
    resumed.set_epoch(2)
    labels = check_epoch(list(resumed), reference(root))
    assert len(labels) == 25 - 2 * 4, "the rest of the epoch over the dataset as it is now"
    assert len(set(labels)) == len(labels)
    assert resumed.state_dict()["dataset_files"] == 3


def test_without_rescan_or_on_one_file_the_dataset_stays_as_opened(start_daemon, stoker, tmp_path) -> None:
    root = tmp_path / "grow"
    root.mkdir()
    write_part(root / "a.h5", 10, 0)
    write_part(root / "b.h5", 10, 100)
    daemon = start_daemon()
    plain = stoker.Loader(spec(stoker, root), batch_size=4, seed=2, socket=daemon.socket)
    single = stoker.Loader(
        stoker.hdf5(str(root / "a.h5"), fields=FIELDS, rescan="epoch"), batch_size=4, seed=2, socket=daemon.socket
    )
    ref = reference(root)
    first = sorted(run_epoch([plain], 0, root))
    assert first == sorted(ref)
    assert sorted(run_epoch([single], 0, root)) == list(range(10))
    write_part(root / "c.h5", 7, 200)
    plain.set_epoch(1)
    single.set_epoch(1)
    assert len(plain) == 5 and len(single) == 3
    assert sorted(check_epoch(list(plain), ref)) == first, "without rescan the files stay those matched at open"
    assert sorted(check_epoch(list(single), ref)) == list(range(10))
    assert plain._stream_info()["rescan"] is False


def test_a_named_dataset_with_rescan_in_the_config_grows(start_daemon, stoker, tmp_path) -> None:
    root = tmp_path / "grow"
    root.mkdir()
    write_part(root / "a.h5", 6, 0)
    fields = ", ".join(f'"{k}" = "{v}"' for k, v in FIELDS.items())
    table = f'\n[datasets.grow]\nformat = "hdf5"\nfiles = "{root}/*.h5"\nfields = {{ {fields} }}\nrescan = "epoch"\n'
    daemon = start_daemon(extra=table)
    loader = stoker.Loader("grow", batch_size=4, seed=0, socket=daemon.socket)
    assert sorted(run_epoch([loader], 0, root)) == list(range(6))
    write_part(root / "b.h5", 6, 100)
    assert sorted(run_epoch([loader], 1, root)) == list(range(6)) + list(range(100, 106))
    assert len(loader) == 3


def npy(value: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, value)
    return buf.getvalue()


def test_lmdb_keys_added_between_epochs_appear_with_rescan(start_daemon, stoker, tmp_path) -> None:
    env = write_env(tmp_path / "grow.lmdb", {key(i): npy(np.full(3, i, dtype=np.int32)) for i in range(10)})
    daemon = start_daemon()
    grow = stoker.Loader(
        stoker.lmdb(env, fields={"v": "npy"}, rescan="epoch"), batch_size=4, seed=4, socket=daemon.socket
    )
    fixed = stoker.Loader(stoker.lmdb(env, fields={"v": "npy"}), batch_size=4, seed=4, socket=daemon.socket)

    def values(loader, epoch: int) -> list[int]:
        loader.set_epoch(epoch)
        out = []
        for batch in loader:
            v = np.asarray(batch["v"])
            assert (v == v[:, :1]).all()
            out += v[:, 0].tolist()
        return out

    assert sorted(values(grow, 0)) == list(range(10))
    generation = grow.state_dict()["dataset_generation"]
    w = lmdb.open(str(env), map_size=1 << 22)
    with w.begin(write=True) as txn:
        for i in range(10, 16):
            txn.put(key(i).encode(), npy(np.full(3, i, dtype=np.int32)))
    w.close()
    grow.set_epoch(1)
    assert len(grow) == 4
    assert sorted(values(grow, 1)) == list(range(16)), "each key of the new key list exactly once"
    assert grow.state_dict()["dataset_generation"] != generation
    assert grow.state_dict()["dataset_samples"] == 16
    # Without rescan the key list is the one listed at open.
    assert len(fixed) == 3


def test_a_rescanned_file_with_other_fields_is_refused_naming_them(start_daemon, stoker, tmp_path) -> None:
    root = tmp_path / "grow"
    root.mkdir()
    write_part(root / "a.h5", 8, 0)
    daemon = start_daemon()
    loader = stoker.Loader(spec(stoker, root, rescan="epoch"), batch_size=4, seed=0, socket=daemon.socket)
    assert sorted(run_epoch([loader], 0, root)) == list(range(8))
    with h5py.File(root / "b.h5", "w") as f:
        f.create_dataset("data/x", data=np.zeros((4, 5, 3), dtype=np.float32))
        f.create_dataset("y", data=np.zeros(4, dtype=np.uint8))
        f.create_dataset("label", data=np.arange(100, 104, dtype=">i8"))
    with pytest.raises(stoker.DatasetError) as err:
        loader.set_epoch(1)
    message = str(err.value)
    assert "epoch 1" in message and "b.h5" in message and "[5, 3]" in message, message
    # Files that agree with each other but not with the stream's layout.
    (root / "a.h5").unlink()
    with pytest.raises(stoker.DatasetError) as err:
        loader.set_epoch(1)
    message = str(err.value)
    assert "same fields" in message and "epoch 1" in message and "[5, 3]" in message, message
    # Once the odd file is gone, the epoch goes on over the files that fit.
    (root / "b.h5").unlink()
    write_part(root / "c.h5", 8, 200)
    assert sorted(run_epoch([loader], 1, root)) == list(range(200, 208))
