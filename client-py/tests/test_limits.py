"""Sizes a client or a file declares are checked before anything is allocated,
and the daemon survives every one of them.

Each test is a reproduction from issue 7 ("a node service no client or file can
crash"): a request or a file that used to abort the daemon (an overflow panic,
a multi-terabyte allocation, the OOM killer) must now fail that one request
with an error naming the field, the size and the config key, and the same
daemon must go on serving correct data to the next stream.
"""

from __future__ import annotations

import os
import struct
import subprocess
import zlib
from pathlib import Path
from typing import Any, Callable

import h5py
import numpy as np
import pytest

from conftest import Daemon, H5Data, assert_names, make_config, stoker_bin
from lmdb_data import key, noise, npy_bytes, png_of, write_env

# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def paths(p: Path) -> tuple[str, str]:
    return str(p), os.path.realpath(p)


def assert_still_serving(stoker: Any, d: Daemon, data: H5Data) -> None:
    """The daemon process is alive and serves a normal dataset, byte-exact."""
    assert d.alive(), f"the daemon died:\n{d.stderr()[-4000:]}"
    loader = stoker.Loader(data.spec(stoker), batch_size=16, shuffle=True, seed=3, socket=d.socket)
    seen: list[int] = []
    for batch in loader:
        seen.extend(data.check_batch(batch))
        del batch
    loader.close()
    assert sorted(seen) == list(range(data.n))
    assert d.alive()
    assert "panicked" not in d.stderr(), d.stderr()[-4000:]


def variable_pngs(path: Path, n: int, extra: dict[int, bytes] | None = None) -> Path:
    """PNGs of varying sizes (a ragged field), some values replaced by `extra`."""
    values = {key(i): png_of(noise(6 + i % 3, 8 + i % 4, 3, seed=i)) for i in range(n)}
    for i, v in (extra or {}).items():
        values[key(i)] = v
    return write_env(path, values)


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR declares `width × height` RGB8, with one empty IDAT:
    tiny on disk, enormous once decoded."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


# --------------------------------------------------------------------------
# Batch layout: ragged room, batch and ring sizes
# --------------------------------------------------------------------------


def test_ragged_room_of_2_to_the_58_is_a_limit_error(
    stoker: Any, start_daemon: Callable[..., Daemon], data: H5Data, tmp_path: Path
) -> None:
    """max_sample_bytes = 2**58 with batch_size 64 overflowed the ring size
    and aborted the daemon; it is a LimitError naming field, size and key."""
    env = variable_pngs(tmp_path / "img", 10)
    d = start_daemon()
    spec = stoker.lmdb(env, fields={"img": "png"}, max_sample_bytes={"img": 2**58})
    with pytest.raises(stoker.LimitError) as exc:
        stoker.Loader(spec, batch_size=64, socket=d.socket)
    assert_names(str(exc.value), '"img"', str(2**58), "[limits] max_sample_bytes", str(1 << 30))
    assert_still_serving(stoker, d, data)


def test_batch_and_total_ring_limits(
    stoker: Any, start_daemon: Callable[..., Daemon], data: H5Data, tmp_path: Path
) -> None:
    """A batch larger than [limits] max_batch_bytes, and rings beyond the
    daemon-wide [limits] max_memory_bytes (rings plus the caches), are refused with LimitError."""
    # A sample of x is 4 × 3 float32 = 48 bytes, a slot at least one page.
    d = start_daemon(depth=2, extra="[limits]\nmax_batch_bytes = 8192\nmax_memory_bytes = 90112\n[cache]\nchunk_bytes = 4096\nsample_bytes = 0\n")
    with pytest.raises(stoker.LimitError) as exc:
        stoker.Loader(data.spec(stoker), batch_size=1000, socket=d.socket)
    assert_names(str(exc.value), "1000 rows", "[limits] max_batch_bytes", "8192", "use batch_size")
    # Each stream of batch_size 16 takes a header page and two one-page slots
    # (12 KiB) and a 16 KiB control page: three fit beside the 4 KiB chunk
    # cache in 88 KiB, across clients; the fourth does not.
    held = [stoker.Loader(data.spec(stoker), batch_size=16, socket=d.socket) for _ in range(3)]
    with pytest.raises(stoker.LimitError) as exc:
        stoker.Loader(data.spec(stoker), batch_size=16, socket=d.socket)
    assert_names(str(exc.value), "[limits] max_memory_bytes", "90112", "already hold 86016", "4096 bytes of caches")
    held.pop().close()
    assert_still_serving(stoker, d, data)
    for loader in held:
        loader.close()


# --------------------------------------------------------------------------
# LMDB transforms and decoded sizes
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "steps, step_name",
    [
        ([{"resize": (2**31, 2**31)}, "to_f32"], "resize to 2147483648×2147483648"),
        ([{"resize": (2**20, 2**20)}, {"center_crop": 8}], "resize to 1048576×1048576"),
        ([{"resize": (15000, 15000)}, "to_f32", {"center_crop": 8}], "to_f32"),
    ],
)
def test_transform_sizes_are_checked_at_open(
    stoker: Any,
    start_daemon: Callable[..., Daemon],
    data: H5Data,
    tmp_path: Path,
    steps: list[Any],
    step_name: str,
) -> None:
    """A resize to 2**31 × 2**31 then to_f32 overflowed; to 2**20 × 2**20 then
    center_crop 8 allocated 3.3 TB; 15000 × 15000 × 3 then to_f32 is 2.7 GB.
    Each fails at open, naming the field, the step, the size and the key."""
    env = write_env(tmp_path / "img", {key(i): png_of(noise(16, 16, 3, seed=i)) for i in range(8)})
    d = start_daemon()
    spec = stoker.lmdb(env, fields={"img": "png"}, transforms={"img": steps})
    with pytest.raises(stoker.LimitError) as exc:
        stoker.Loader(spec, batch_size=4, socket=d.socket)
    assert_names(str(exc.value), '"img"', paths(env), step_name, "[limits] max_sample_bytes", "bytes")
    assert_still_serving(stoker, d, data)


def test_transform_sizes_are_checked_per_sample(
    stoker: Any, start_daemon: Callable[..., Daemon], data: H5Data, tmp_path: Path
) -> None:
    """Where the size is only known per sample (images of varying size), each
    value is checked before its buffers grow: the batch fails with a
    DatasetError naming environment, key and field."""
    big = noise(64, 64, 3, seed=99)
    env = variable_pngs(tmp_path / "img", 12, extra={10: png_of(big)})
    # 64 × 64 × 3 × 4 bytes after to_f32 is 49152 bytes: over a limit of 40000;
    # the first eight values (probed at open) are small enough.
    d = start_daemon(extra="[limits]\nmax_sample_bytes = 40000\n")
    spec = stoker.lmdb(env, fields={"img": "png"}, transforms={"img": ["to_f32"]})
    loader = stoker.Loader(spec, batch_size=4, shuffle=False, socket=d.socket)
    ok = 0
    with pytest.raises(stoker.DatasetError) as exc:
        for _ in loader:
            ok += 1
    assert ok == 2, "batches 0 and 1 hold only small values"
    assert_names(str(exc.value), paths(env), key(10), '"img"', "to_f32", "[limits] max_sample_bytes", "40000")
    loader.close()
    assert_still_serving(stoker, d, data)


def test_image_header_sizes_are_checked_before_decoding(
    stoker: Any, start_daemon: Callable[..., Daemon], data: H5Data, tmp_path: Path
) -> None:
    """A 60-byte PNG declaring 65535 × 65535 RGB (12.9 GB decoded) fails from
    its header, before any buffer is made, under fail and skip alike."""
    env = variable_pngs(tmp_path / "img", 12, extra={9: png_header_only(65535, 65535)})
    d = start_daemon()
    spec = stoker.lmdb(env, fields={"img": "png"}, transforms={"img": [{"center_crop": 4}]})
    loader = stoker.Loader(spec, batch_size=4, shuffle=False, socket=d.socket)
    with pytest.raises(stoker.DatasetError) as exc:
        list(loader)
    assert_names(str(exc.value), paths(env), key(9), '"img"', "65535, 65535, 3", "[limits] max_sample_bytes")
    loader.close()
    skip = stoker.lmdb(env, fields={"img": "png"}, transforms={"img": [{"center_crop": 4}]}, on_error="skip")
    loader = stoker.Loader(skip, batch_size=4, shuffle=False, socket=d.socket)
    served = [np.array(a) for b in loader for a in b["img"]]
    assert len(served) == 12 and all(a.shape == (4, 4, 3) for a in served)
    loader.close()
    assert_still_serving(stoker, d, data)


# --------------------------------------------------------------------------
# LMDB values of another rank or dtype
# --------------------------------------------------------------------------


@pytest.mark.parametrize("odd_shape", [(4, 4, 4), (16,)], ids=["rank3", "rank1"])
@pytest.mark.parametrize("ragged", [True, False], ids=["ragged", "fixed"])
def test_lmdb_value_of_another_rank(
    stoker: Any,
    start_daemon: Callable[..., Daemon],
    data: H5Data,
    tmp_path: Path,
    odd_shape: tuple[int, ...],
    ragged: bool,
) -> None:
    """Probed values are 2-D; key 9 holds a value of another rank. This
    panicked in source/lmdb.rs (ragged rows); now the batch fails naming
    environment, key, field and index, or the value is skipped."""
    n = 12
    shapes = [(4, 4 + (i % 3 if ragged else 0)) for i in range(n)]
    arrays = [np.full(s, i, dtype=np.float32) for i, s in enumerate(shapes)]
    arrays[9] = np.full(odd_shape, 9, dtype=np.float32)
    env = write_env(tmp_path / "arr", {key(i): npy_bytes(a) for i, a in enumerate(arrays)})
    d = start_daemon()
    loader = stoker.Loader(stoker.lmdb(env, fields={"a": "npy"}), batch_size=4, shuffle=False, socket=d.socket)
    with pytest.raises(stoker.DatasetError) as exc:
        list(loader)
    assert_names(str(exc.value), paths(env), key(9), '"a"', "sample 9", str(list(odd_shape)))
    loader.close()
    skip = stoker.lmdb(env, fields={"a": "npy"}, on_error="skip")
    loader = stoker.Loader(skip, batch_size=4, shuffle=False, socket=d.socket)
    served = [np.array(v) for b in loader for v in b["a"]]
    loader.close()
    assert len(served) == n
    for i, v in enumerate(served):
        want = 10 if i == 9 else i  # the next good sample stands in
        assert v.ndim == 2 and (v == want).all(), (i, v)
    assert_still_serving(stoker, d, data)


def test_lmdb_value_of_another_dtype_in_a_ragged_field(
    stoker: Any, start_daemon: Callable[..., Daemon], data: H5Data, tmp_path: Path
) -> None:
    """A float64 value among float32 ones in a variable-shape field is an
    error naming the dtypes, not float64 bytes delivered as float32."""
    arrays = [np.full((4, 4 + i % 3), i, dtype=np.float32) for i in range(12)]
    arrays[10] = np.full((4, 5), 10, dtype=np.float64)
    env = write_env(tmp_path / "arr", {key(i): npy_bytes(a) for i, a in enumerate(arrays)})
    d = start_daemon()
    loader = stoker.Loader(stoker.lmdb(env, fields={"a": "npy"}), batch_size=4, shuffle=False, socket=d.socket)
    with pytest.raises(stoker.DatasetError) as exc:
        list(loader)
    assert_names(str(exc.value), paths(env), key(10), '"a"', "float64", "float32")
    loader.close()
    assert_still_serving(stoker, d, data)


# --------------------------------------------------------------------------
# HDF5 shapes
# --------------------------------------------------------------------------


def test_hdf5_shape_beyond_64_bits(
    stoker: Any, start_daemon: Callable[..., Daemon], data: H5Data, tmp_path: Path
) -> None:
    """A small file declaring a (2, 2**31, 2**31) float64 dataset (nothing
    written) panicked in source/hdf5/field.rs; it fails at open naming file,
    HDF5 path and shape."""
    path = tmp_path / "huge" / "huge.h5"
    path.parent.mkdir()
    with h5py.File(path, "w") as f:
        f.create_dataset("grp/x", shape=(2, 2**31, 2**31), dtype="f8", chunks=(1, 1024, 1024))
    assert path.stat().st_size < 16384
    d = start_daemon()
    with pytest.raises(stoker.LimitError) as exc:
        stoker.Loader(stoker.hdf5(str(path), fields={"x": "grp/x"}), batch_size=2, socket=d.socket)
    assert_names(str(exc.value), paths(path), '"grp/x"', "2147483648", "2^63")
    assert_still_serving(stoker, d, data)


def test_hdf5_sample_beyond_the_sample_limit(
    stoker: Any, start_daemon: Callable[..., Daemon], data: H5Data, tmp_path: Path
) -> None:
    """A (3, 2**16, 2**16) float64 dataset has 32 GiB samples: a LimitError
    naming dataset, field, HDF5 path, size and key."""
    path = tmp_path / "big" / "big.h5"
    path.parent.mkdir()
    with h5py.File(path, "w") as f:
        f.create_dataset("x", shape=(3, 2**16, 2**16), dtype="f8", chunks=(1, 1024, 1024))
    d = start_daemon()
    with pytest.raises(stoker.LimitError) as exc:
        stoker.Loader(stoker.hdf5(str(path), fields={"v": "x"}), batch_size=1, socket=d.socket)
    assert_names(str(exc.value), paths(path), '"v"', str(8 * 2**32), "[limits] max_sample_bytes")
    assert_still_serving(stoker, d, data)


def test_hdf5_compressed_chunk_beyond_the_sample_limit(
    stoker: Any, start_daemon: Callable[..., Daemon], data: H5Data, tmp_path: Path
) -> None:
    """Every read of a compressed field decodes its chunk whole: a 9 MB file
    whose one gzip chunk holds 2 GiB of zeros made each worker allocate 2 GiB
    for every batch (HDF5 allows 4 GiB chunks, so 4 GiB per worker). A chunk
    that decodes to more than `[limits] max_sample_bytes` is refused at open,
    naming file, field, chunk shape and what to do; uncompressed chunks are
    read in place (only the rows asked for) and stay served."""
    root = tmp_path / "chunks"
    root.mkdir()
    rows = np.arange(64 * 1024, dtype=np.uint8).reshape(64, 1024)
    with h5py.File(root / "gz.h5", "w") as f:
        f.create_dataset("x", data=rows, chunks=(64, 1024), compression="gzip")  # 64 KiB chunks
        f.create_dataset("plain", data=rows, chunks=(64, 1024))
        f.create_dataset("small", data=rows, chunks=(16, 1024), compression="gzip")  # 16 KiB chunks
    d = start_daemon(extra="\n[limits]\nmax_sample_bytes = 32768\n")
    with pytest.raises(stoker.LimitError) as exc:
        stoker.Loader(stoker.hdf5(str(root / "gz.h5"), fields={"x": "x"}), batch_size=4, socket=d.socket)
    assert_names(str(exc.value), paths(root / "gz.h5"), '"x"', "[64, 1024]", "65536", "max_sample_bytes", "rechunk")
    for field in ("plain", "small"):
        spec = stoker.hdf5(str(root / "gz.h5"), fields={"x": field})
        loader = stoker.Loader(spec, batch_size=8, shuffle=False, socket=d.socket)
        np.testing.assert_array_equal(np.concatenate([np.array(b["x"]) for b in loader]), rows)
    # `stoker validate` checks a named dataset against the same limit.
    config = root / "stoker.toml"
    config.write_text(
        make_config(str(root / "unused.sock"))
        + f'\n[limits]\nmax_sample_bytes = 32768\n\n[datasets.gz]\nformat = "hdf5"\nfiles = "{root / "gz.h5"}"\n'
        + 'fields = { x = "x" }\n'
    )
    res = subprocess.run([str(stoker_bin()), "validate", str(config)], capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "datasets.gz" in res.stderr and "rechunk" in res.stderr, res.stderr
    assert_still_serving(stoker, d, data)
