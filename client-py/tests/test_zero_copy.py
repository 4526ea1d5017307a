"""Batches are writable, copy-on-write numpy views into the stream's
shared-memory mapping.

No copy on the Python side: every array's data pointer lies inside the
mapping; a write changes only this process's copy; and a batch the user keeps
alive keeps its slot (its values never change under it) while the ring goes
round.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import h5py
import numpy as np
import pytest

BATCH = 4


def mapping_perms(start: int, length: int) -> list[str]:
    """Permissions of every /proc/self/maps entry overlapping [start, start+length)."""
    perms = []
    with open("/proc/self/maps") as f:
        for line in f:
            addrs, perm = line.split()[:2]
            lo, hi = (int(a, 16) for a in addrs.split("-"))
            if lo < start + length and start < hi:
                perms.append(perm)
    return perms


def assert_inside(arr: np.ndarray, start: int, length: int, name: str) -> None:
    ptr = arr.__array_interface__["data"][0]
    assert arr.ctypes.data == ptr
    assert start <= ptr and ptr + arr.nbytes <= start + length, (
        f"{name}: data at {ptr:#x}+{arr.nbytes} is outside the mapping {start:#x}+{length}"
    )


def private_mapping_of(ptr: int) -> str:
    """Permissions of the /proc/self/maps entry holding address `ptr`."""
    with open("/proc/self/maps") as f:
        for line in f:
            addrs, perm = line.split()[:2]
            lo, hi = (int(a, 16) for a in addrs.split("-"))
            if lo <= ptr < hi:
                return perm
    raise AssertionError(f"{ptr:#x} is in no mapping")


def drain(loader: Any) -> Iterator[Any]:
    """Iterate `loader`, dropping each batch before asking for the next one
    (a plain `for b in loader` holds the previous batch during `next()`, which
    needs one more free slot)."""
    it = iter(loader)
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return
        yield batch
        del batch


def test_arrays_are_copy_on_write_views_into_the_mapping(start_daemon, data, stoker) -> None:
    """Every array is a writable view into the private (copy-on-write) mapping:
    writing to it changes this process's copy only, never the daemon's slot,
    a later batch in the same slot, or another client's batch."""
    d = start_daemon(depth=2)
    loader = stoker.Loader(data.spec(stoker), batch_size=BATCH, shuffle=True, seed=1, socket=d.socket)
    other = stoker.Loader(data.spec(stoker), batch_size=BATCH, shuffle=True, seed=1, socket=d.socket)
    start, length = loader._mapping_range()
    assert isinstance(start, int) and isinstance(length, int)
    assert start > 0 and length > 0

    perms = mapping_perms(start, length)
    assert perms, f"mapping {start:#x}+{length} is not in /proc/self/maps"
    for perm in perms:
        assert perm[3] == "p", f"mapping is not private (copy-on-write): {perm}"

    seen = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        other.set_epoch(epoch)
        for batch, twin in zip(drain(loader), drain(other)):
            spans = []
            # Values first, before anything is written.
            seen += data.check_batch(batch)
            data.check_batch(twin)
            for name, arr in batch.items():
                assert arr.flags.writeable, f"{name} is not writeable"
                # In the ring, or in an extra segment the ring grew (the loop
                # holds the previous pair while it takes the next one).
                assert private_mapping_of(arr.ctypes.data) == "rw-p", name
                spans.append((arr.ctypes.data, arr.ctypes.data + arr.nbytes))
                before = twin[name].copy()
                # Scribble over every byte, in place.
                arr.view(np.uint8)[...] = 0xA5
                assert (arr.view(np.uint8) == 0xA5).all()
                np.add(arr, 1, out=arr, casting="unsafe")
                # The other client's copy of the same batch is untouched.
                assert twin[name].tobytes() == before.tobytes(), f"{name}: a write reached another client"
            # Fields of one batch do not overlap.
            spans.sort()
            for (_, end), (begin, _) in zip(spans, spans[1:]):
                assert end <= begin, "fields of one batch overlap"
            del arr, twin
    # Every later batch (reusing the written slots many times over) was exact.
    assert sorted(seen) == sorted(list(range(data.n)) * 3)
    loader.close()
    other.close()


def test_fields_are_64_byte_aligned(start_daemon, data, stoker) -> None:
    d = start_daemon()
    loader = stoker.Loader(data.spec(stoker), batch_size=3, shuffle=False, socket=d.socket)
    for batch in loader:
        for name, arr in batch.items():
            assert arr.ctypes.data % 64 == 0, f"{name} at {arr.ctypes.data:#x}"
            assert arr.flags.c_contiguous, name
        del arr, batch
    loader.close()


def test_held_batch_keeps_its_slot(start_daemon, data, stoker) -> None:
    """Hold batch 0's arrays (and a slice of one) while 3 * depth more batches
    go through the ring: their values never change."""
    depth = 2
    d = start_daemon(depth=depth)
    loader = stoker.Loader(data.spec(stoker), batch_size=BATCH, shuffle=True, seed=9, socket=d.socket)
    n_batches = len(loader)
    assert n_batches >= 1 + 3 * depth
    start, length = loader._mapping_range()

    it = iter(loader)
    batch0 = next(it)
    held = dict(batch0)
    saved = {k: v.copy() for k, v in held.items()}
    view = held["x"][1:, 1]
    saved_view = view.copy()
    labels = [data.check_batch(batch0)]
    del batch0

    # Only one slot is left for the stream: each batch must be dropped before
    # asking for the next one.
    for _ in range(n_batches - 1):
        batch = next(it)
        labels.append(data.check_batch(batch))
        for name, arr in held.items():
            assert_inside(arr, start, length, name)
            assert arr.tobytes() == saved[name].tobytes(), f"held {name} changed"
        del batch, arr
    with pytest.raises(StopIteration):
        next(it)

    for name, arr in held.items():
        assert arr.tobytes() == saved[name].tobytes(), f"held {name} changed"
    del arr
    assert view.tobytes() == saved_view.tobytes()
    data.check_batch(held)
    assert sorted(i for b in labels for i in b) == list(range(data.n))

    # Dropping everything but a slice still keeps the slot.
    del held
    gc.collect()
    loader.set_epoch(1)
    seen = []
    for b in drain(loader):
        seen += data.check_batch(b)
        del b
    assert sorted(seen) == list(range(data.n))
    assert view.tobytes() == saved_view.tobytes()
    del view
    gc.collect()

    # With nothing held, the whole ring is available again.
    loader.set_epoch(2)
    it = iter(loader)
    held_all = [next(it) for _ in range(depth)]
    for b in held_all:
        data.check_batch(b)
    del held_all, it
    loader.close()


def test_arrays_outlive_the_loader(start_daemon, data, stoker) -> None:
    """An array kept after close() still reads its values (the mapping lives
    as long as a view of it does)."""
    d = start_daemon()
    loader = stoker.Loader(data.spec(stoker), batch_size=BATCH, shuffle=False, socket=d.socket)
    batch = dict(next(iter(loader)))
    saved = {k: v.copy() for k, v in batch.items()}
    loader.close()
    del loader
    gc.collect()
    for name, arr in batch.items():
        assert arr.tobytes() == saved[name].tobytes(), name
    data.check_batch(batch)


# ---------------------------------------------------------------------------
# Served values: every dtype, both byte orders, native-endian on delivery.
# ---------------------------------------------------------------------------

MULTI_BYTE = ["u2", "u4", "u8", "i2", "i4", "i8", "f2", "f4", "f8"]


def _values(rng: np.random.Generator, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    n = int(np.prod(shape))
    if dtype.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.kind in "ui":
        # Random bytes: the whole range, including the extremes.
        raw = np.frombuffer(rng.bytes(n * dtype.itemsize), dtype=dtype.newbyteorder("="))
        return raw.reshape(shape).astype(dtype)
    vals = (rng.standard_normal(n) * 100).astype(dtype.newbyteorder("="))
    vals[:4] = [np.inf, -np.inf, -0.0, 0.0][: min(4, n)]
    return vals.reshape(shape).astype(dtype)


def test_every_dtype_both_byte_orders(start_daemon, tmp_path, load_reference, stoker) -> None:
    root = tmp_path / "dtypes"
    root.mkdir()
    rng = np.random.default_rng(5)
    dtypes = {"bool": np.dtype("?"), "u1": np.dtype("u1"), "i1": np.dtype("i1")}
    for code in MULTI_BYTE:
        dtypes[f"{code}_le"] = np.dtype("<" + code)
        dtypes[f"{code}_be"] = np.dtype(">" + code)
    fields = {name: f"d/{name}" for name in dtypes}
    fields["label"] = "label"

    files, offset = [], 0
    for i, n in enumerate((20, 17)):
        path = root / f"f{i}.h5"
        with h5py.File(path, "w") as f:
            for j, (name, dt) in enumerate(dtypes.items()):
                shape = (n,) if j % 3 == 0 else (n, 3) if j % 3 == 1 else (n, 2, 5)
                f.create_dataset(fields[name], data=_values(rng, dt, shape))
            f.create_dataset("label", data=np.arange(offset, offset + n, dtype=">i4"))
        files.append(path)
        offset += n
    ref = load_reference(root, files, fields)
    # h5py must have kept the byte order we asked for, or the test is moot.
    assert ref.ref["u4_be"].dtype == np.dtype(">u4")
    assert ref.ref["f8_be"].dtype == np.dtype(">f8")

    d = start_daemon(datasets={"dtypes": ref})
    for source in (ref.spec(stoker), "dtypes"):
        loader = stoker.Loader(source, batch_size=6, shuffle=True, seed=2, socket=d.socket)
        seen = [i for b in loader for i in ref.check_batch(b)]
        assert sorted(seen) == list(range(ref.n))
        loader.close()


def test_chunked_and_compressed_layouts(start_daemon, tmp_path, load_reference, stoker) -> None:
    """The same values whether a dataset is contiguous, chunked, or chunked
    with gzip + shuffle filters (served by the fast path or libhdf5's read)."""
    root = tmp_path / "layouts"
    root.mkdir()
    rng = np.random.default_rng(8)
    layouts = [
        {},
        {"chunks": (7, 4, 3)},
        {"chunks": (5, 2, 3), "compression": "gzip", "compression_opts": 4, "shuffle": True},
        {"chunks": (16, 4, 3), "compression": "gzip"},
    ]
    fields = {"x": "data/x", "label": "label"}
    files, offset = [], 0
    for i, layout in enumerate(layouts):
        n = 23 + 9 * i
        path = root / f"l{i}.h5"
        with h5py.File(path, "w") as f:
            f.create_dataset("data/x", data=rng.standard_normal((n, 4, 3)).astype(">f4"), **layout)
            lab_layout = {k: v for k, v in layout.items() if k != "chunks"}
            if layout:
                lab_layout["chunks"] = (layout["chunks"][0],)
            f.create_dataset("label", data=np.arange(offset, offset + n, dtype="<i4"), **lab_layout)
        files.append(path)
        offset += n
    ref = load_reference(root, files, fields)

    d = start_daemon()
    for shuffle in (False, True):
        loader = stoker.Loader(ref.spec(stoker), batch_size=10, shuffle=shuffle, seed=4, socket=d.socket)
        seen = [i for b in loader for i in ref.check_batch(b)]
        if shuffle:
            assert sorted(seen) == list(range(ref.n))
        else:
            assert seen == list(range(ref.n))
        loader.close()


def test_sample_shapes(start_daemon, tmp_path, make_h5, stoker) -> None:
    """Scalar-per-sample and multi-dimensional fields keep their sample shape."""
    small = make_h5(tmp_path / "shapes", lengths=(9, 4), sample_shape=(2, 3, 5))
    d = start_daemon()
    loader = stoker.Loader(small.spec(stoker), batch_size=5, shuffle=False, socket=d.socket)
    shapes = [(b["x"].shape, b["y"].shape, b["label"].shape) for b in loader]
    assert shapes == [((5, 2, 3, 5), (5,), (5,)), ((5, 2, 3, 5), (5,), (5,)), ((3, 2, 3, 5), (3,), (3,))]
    loader.close()

