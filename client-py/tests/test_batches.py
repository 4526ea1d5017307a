"""Batches that behave like DataLoader's: writable without touching anyone
else's data, held as long as memory allows, any size, handed over through the
stream's control page.

Real daemon, real h5py/LMDB files; values compared with the reference readers
byte for byte.
"""

from __future__ import annotations

import ctypes
import gc
import random
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from lmdb_data import key, noise, png_of, write_env

DTYPES = ["?", "u1", "i1", "u2", "i2", "u4", "i4", "u8", "i8", "f2", "f4", "f8"]


def every_dtype_file(root: Path, n: int = 48) -> tuple[Any, dict[str, np.ndarray]]:
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(3)
    ref: dict[str, np.ndarray] = {}
    with h5py.File(root / "d.h5", "w") as f:
        for code in DTYPES:
            dt = np.dtype(code)
            if dt.kind == "b":
                vals = rng.integers(0, 2, size=(n, 5)).astype(bool)
            elif dt.kind in "ui":
                vals = np.frombuffer(rng.bytes(n * 5 * dt.itemsize), dtype=dt).reshape(n, 5).copy()
            else:
                vals = (rng.standard_normal((n, 5)) * 50).astype(dt)
            f.create_dataset(f"v_{code}", data=vals)
            ref[f"v_{code}"] = vals
        f.create_dataset("label", data=np.arange(n, dtype=np.int64))
        ref["label"] = np.arange(n, dtype=np.int64)
    return root / "d.h5", ref


def check(batch: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> list[int]:
    idx = np.array(batch["label"])
    for name, arr in batch.items():
        want = ref[name][idx]
        assert arr.dtype == want.dtype and arr.tobytes() == want.tobytes(), f"{name} differs from h5py"
    return idx.tolist()


def test_in_place_writes_on_every_dtype_stay_in_the_batch(start_daemon, stoker, tmp_path: Path) -> None:
    """Writing into every field of every batch (as `x.sub_(m).div_(s)` does)
    never changes another client's copy of the same batch, nor any later
    batch that reuses the slot, over several epochs."""
    path, ref = every_dtype_file(tmp_path / "d")
    fields = {name: name for name in ref}
    d = start_daemon(depth=2)
    spec = stoker.hdf5(str(path), fields=fields)
    writer = stoker.Loader(spec, batch_size=8, shuffle=True, seed=4, socket=d.socket)
    reader = stoker.Loader(spec, batch_size=8, shuffle=True, seed=4, socket=d.socket)
    for epoch in range(3):
        writer.set_epoch(epoch)
        reader.set_epoch(epoch)
        seen = []
        for mine, theirs in zip(writer, reader):
            seen += check(mine, ref)
            for name, arr in mine.items():
                assert arr.flags.writeable
                if arr.dtype == bool:
                    np.logical_not(arr, out=arr)
                else:
                    np.multiply(arr, 3, out=arr, casting="unsafe")
                    arr += 1
                assert arr.tobytes() != ref[name][np.array(theirs["label"])].tobytes() or arr.size == 0
            check(theirs, ref)
            del mine, theirs, arr
        assert sorted(seen) == list(range(48))
    writer.close()
    reader.close()


def test_a_hundred_held_batches_then_released(start_daemon, stoker, data) -> None:
    """`kept.append(batch)` for a hundred batches works (the ring grows by
    extra segments within the client's budget), every kept batch keeps its
    values, and after they are dropped the stream goes on."""
    d = start_daemon(depth=2)
    loader = stoker.Loader(data.spec(stoker), batch_size=1, shuffle=True, seed=2, socket=d.socket)
    assert len(loader) == 100
    kept = list(loader)
    assert len(kept) == 100
    seen = [i for b in kept for i in data.check_batch(b)]
    assert sorted(seen) == list(range(100))
    # Write into all of them: each is its own copy.
    for b in kept:
        b["x"][...] = -1
    streams = d.status()["streams"]
    assert streams[0]["depth"] >= 100, streams
    del kept, b
    gc.collect()
    for epoch in (1, 2):
        loader.set_epoch(epoch)
        seen = []
        for b in loader:
            seen += data.check_batch(b)
            del b
        assert sorted(seen) == list(range(100))
    # Extras beyond `depth` free slots were destroyed as they came back.
    assert d.status()["streams"][0]["depth"] <= 2 * 2 + 2, d.status()["streams"]
    loader.close()


def test_a_ragged_batch_fifty_times_the_typical_size(start_daemon, stoker, tmp_path: Path) -> None:
    """One image 50× the size of the others, in a folder whose room per sample
    was guessed from the small ones, is served pixel-exact in its batch; the
    other batches are unaffected, epoch after epoch."""
    n = 24
    imgs = [noise(6 + i % 3, 6 + i % 4, 3, seed=i) for i in range(n)]  # ragged, about 190 bytes
    imgs[13] = noise(40, 80, 3, seed=13)  # 9600 bytes: 50 × 192, the room guessed below
    env = write_env(tmp_path / "img", {key(i): png_of(a) for i, a in enumerate(imgs)})
    d = start_daemon(depth=2)
    spec = stoker.lmdb(env, fields={"img": "png"}, max_sample_bytes={"img": 192})
    loader = stoker.Loader(spec, batch_size=4, shuffle=True, seed=1, socket=d.socket)
    for epoch in range(3):
        loader.set_epoch(epoch)
        got = {}
        for batch in loader:
            for arr in batch["img"]:
                matches = [i for i, im in enumerate(imgs) if im.shape == arr.shape and np.array_equal(im, arr)]
                assert len(matches) == 1
                got[matches[0]] = True
            del batch, arr
        assert sorted(got) == list(range(n))
    loader.close()


def control_page_range(stream: int) -> tuple[int, int]:
    """Address range of this process's mapping of stream `stream`'s control page."""
    found = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5] == f"/memfd:stoker-stream-{stream}-control":
                lo, hi = (int(a, 16) for a in parts[0].split("-"))
                found.append((lo, hi - lo))
    assert len(found) == 1, found
    return found[0]


def test_a_client_scribbling_over_its_control_page_breaks_only_itself(start_daemon, stoker, data) -> None:
    """The control page is writable by the client: garbage in it (counters,
    records, release entries, wake flags) must not crash or hang the daemon,
    nor touch anybody else's stream."""
    d = start_daemon(depth=2, datasets={"train": data})
    other = stoker.Loader("train", batch_size=10, shuffle=False, socket=d.socket, timeout=30)
    rng = random.Random(5)
    for attempt in range(6):
        victim = stoker.Loader("train", batch_size=10, shuffle=False, socket=d.socket, timeout=2)
        it = iter(victim)
        next(it)
        start, length = control_page_range(victim._info["stream"])
        garbage = bytes(rng.getrandbits(8) for _ in range(length)) if attempt % 2 else b"\xff" * length
        ctypes.memmove(start, garbage, length)
        try:
            for _ in range(20):
                next(it)
        except (stoker.StokerError, StopIteration):
            pass  # its own stream may fail: that is all it may do
        victim.close()
        del victim, it
        gc.collect()
        assert d.alive()
        # Everybody else is served, exactly.
        other.set_epoch(attempt)
        labels = sorted(i for b in other for i in data.check_batch(b))
        assert labels == list(range(data.n))
