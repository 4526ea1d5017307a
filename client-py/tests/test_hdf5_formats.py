"""HDF5 types and filters beyond plain numbers: enum datasets (served as their
base integers), bitfields (PyTables' bool arrays; served as unsigned integers,
as h5py reads them), Blosc2 (PyTables' and hdf5plugin's filter 32026, b2nd
chunks included, decoded in Rust without any plugin; damaged frames fail the
batch, naming the file and field), and a filter nothing here can decode
without hdf5plugin's plugin on HDF5_PLUGIN_PATH (bzip2), refused when the
dataset opens, naming it."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import hdf5plugin
import numpy as np
import pytest

from conftest import SUBPROCESS_TIMEOUT_S, Daemon, assert_names, make_config, stoker_bin

N = 12


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Any]:
    """`daemon(plugins=True)`: a daemon with (or without) HDF5_PLUGIN_PATH."""
    started: list[tuple[Daemon, Path]] = []

    def start(*, plugins: bool) -> Daemon:
        workdir = Path(tempfile.mkdtemp(prefix="stk-", dir="/tmp"))
        env = {k: v for k, v in os.environ.items() if k != "HDF5_PLUGIN_PATH"}
        if plugins:
            env["HDF5_PLUGIN_PATH"] = hdf5plugin.PLUGIN_PATH
        d = Daemon(workdir, make_config(str(workdir / "x.sock"), allowed_roots=[tmp_path]), env=env)
        started.append((d, workdir))
        return d

    yield start
    for d, workdir in started:
        d.stop()
        d.kill()
        shutil.rmtree(workdir, ignore_errors=True)


def serve_all(stoker: Any, d: Daemon, path: Path, fields: dict[str, str]) -> dict[str, np.ndarray]:
    loader = stoker.Loader(stoker.hdf5(str(path), fields=fields), batch_size=N, shuffle=False, socket=d.socket)
    loader.set_epoch(0)
    (batch,) = [{k: np.array(v) for k, v in b.items()} for b in loader]
    return batch


def test_enum_and_bitfield_served_as_h5py_reads_them(stoker: Any, daemon: Any, tmp_path: Path) -> None:
    tables = pytest.importorskip("tables")
    path = tmp_path / "types.h5"
    rng = np.random.default_rng(0)
    flags = rng.integers(0, 2, size=(N, 5)).astype(bool)
    with tables.open_file(str(path), "w") as f:
        f.create_array("/", "flags", flags)  # PyTables writes bool as an 8-bit H5T_BITFIELD
    with h5py.File(path, "a") as f:
        enum8 = h5py.enum_dtype({"RED": 0, "GREEN": 1, "BLUE": 7}, basetype="u1")
        enum16 = h5py.enum_dtype({"LOW": -300, "HIGH": 300}, basetype="<i2")
        f.create_dataset("colour", data=rng.choice([0, 1, 7], size=(N, 3)).astype("u1"), dtype=enum8)
        f.create_dataset("level", data=rng.choice([-300, 300], size=(N,)).astype("<i2"), dtype=enum16, chunks=(4,),
                         compression="gzip")
        # A big-endian 32-bit bitfield, written with h5py's low-level API.
        b32 = h5py.h5t.STD_B32BE
        ds = h5py.h5d.create(f.id, b"mask", b32, h5py.h5s.create_simple((N, 2)))
        mask = rng.integers(0, 2**32, size=(N, 2), dtype=np.uint64).astype(">u4")
        ds.write(h5py.h5s.ALL, h5py.h5s.ALL, mask, mtype=b32)
    with h5py.File(path) as f:
        assert f["flags"].id.get_type().get_class() == h5py.h5t.BITFIELD
        want = {k: f[k][()] for k in ("flags", "colour", "level", "mask")}
    d = daemon(plugins=False)
    got = serve_all(stoker, d, path, {k: f"/{k}" for k in want})
    for k, w in want.items():
        assert got[k].dtype == w.dtype.newbyteorder("=") and np.array_equal(got[k], w), k
    assert got["flags"].dtype == np.uint8 and np.array_equal(got["flags"].astype(bool), flags)


def write_blosc2(path: Path) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    data = {
        "x": rng.normal(size=(N, 6, 5)).astype(np.float32),
        "y": rng.integers(0, 1000, size=(N, 40)).astype(np.int32),
    }
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=data["x"], chunks=(4, 6, 5), **hdf5plugin.Blosc2(cname="zstd", clevel=5))
        f.create_dataset("y", data=data["y"], chunks=(3, 40), **hdf5plugin.Blosc2(cname="lz4"))
    return data


B2 = hdf5plugin.Blosc2
# Arrays (first axis: samples) and chunk shapes: 1-D chunks are plain Blosc2
# frames, 2-D and more b2nd arrays with blocks padded past partial edges.
BLOSC2_ARRAYS: dict[str, tuple[np.ndarray, tuple[int, ...]]] = {
    "f8_3d": (np.random.default_rng(3).normal(size=(N, 7, 9)), (5, 3, 5)),
    "i2_2d": (np.random.default_rng(4).integers(-3000, 3000, size=(N, 37)).astype("<i2"), (5, 10)),
    "u1_1d": (np.random.default_rng(5).integers(0, 7, size=(N,)).astype(np.uint8), (5,)),
    "bool_2d": (np.random.default_rng(6).integers(0, 2, size=(N, 13)).astype(bool), (3, 13)),
    "f4_4d": (np.random.default_rng(7).normal(size=(N, 3, 4, 5)).astype(np.float32), (2, 3, 4, 5)),
    "u2_big": ((np.arange(N * 64 * 64) // 5 % 4096).astype("<u2").reshape(N, 64, 64), (N, 64, 64)),
    "zeros": (np.zeros((N, 50), np.float32), (5, 50)),
    "nan": (np.full((N, 20), np.nan, np.float64), (4, 20)),
}


@pytest.mark.parametrize("cname", ["blosclz", "lz4", "lz4hc", "zlib", "zstd"])
@pytest.mark.parametrize("filters", [B2.NOFILTER, B2.SHUFFLE, B2.BITSHUFFLE], ids=["nofilter", "shuffle", "bitshuffle"])
def test_blosc2_decoded_in_rust_bit_exact_without_any_plugin(
    stoker: Any, daemon: Any, tmp_path: Path, cname: str, filters: int
) -> None:
    """hdf5plugin.Blosc2 files, every codec and filter, 1-D to 4-D chunks with
    partial edges and special (all-zero, all-NaN) chunks, served by a daemon
    whose libhdf5 has no plugin (HDF5_PLUGIN_PATH unset: only the Rust decoder
    can read them), equal byte for byte to h5py's reads with hdf5plugin."""
    path = tmp_path / "b2.h5"
    with h5py.File(path, "w") as f:
        for name, (a, chunks) in BLOSC2_ARRAYS.items():
            f.create_dataset(name, data=a, chunks=chunks, **B2(cname=cname, clevel=5, filters=filters))
    with h5py.File(path) as f:
        want = {name: f[name][()] for name in BLOSC2_ARRAYS}
        assert all(f[name].id.get_create_plist().get_filter(0)[0] == 32026 for name in BLOSC2_ARRAYS)
    d = daemon(plugins=False)
    got = serve_all(stoker, d, path, {k: f"/{k}" for k in want})
    for k, w in want.items():
        g = got[k].view(np.uint8) if w.dtype == bool else got[k]
        w = w.view(np.uint8) if w.dtype == bool else w
        assert g.dtype == w.dtype and g.tobytes() == w.tobytes(), k


def test_blosc2_served_bit_exact_with_hdf5plugin_too(stoker: Any, daemon: Any, tmp_path: Path) -> None:
    path = tmp_path / "blosc2.h5"
    want = write_blosc2(path)
    d = daemon(plugins=True)
    got = serve_all(stoker, d, path, {"x": "/x", "y": "/y"})
    for k, w in want.items():
        assert got[k].dtype == w.dtype and np.array_equal(got[k], w), k


@pytest.mark.parametrize("complib", ["blosc2", "blosc2:zstd", "blosc2:lz4", "blosc2:blosclz", "blosc2:zlib"])
@pytest.mark.parametrize("shuffle", ["shuffle", "bitshuffle"])
def test_pytables_blosc2_bool_and_float_bit_exact_without_any_plugin(
    stoker: Any, daemon: Any, tmp_path: Path, complib: str, shuffle: str
) -> None:
    tables = pytest.importorskip("tables")
    path = tmp_path / "pt.h5"
    rng = np.random.default_rng(2)
    x = rng.normal(size=(N, 16, 16)).astype(np.float32)
    flags = rng.integers(0, 2, size=(N, 9)).astype(bool)
    ints = rng.integers(-(2**40), 2**40, size=(N, 33)).astype(np.int64)
    kw = {"shuffle": shuffle == "shuffle", "bitshuffle": shuffle == "bitshuffle"}
    filters = tables.Filters(complevel=5, complib=complib, **kw)
    with tables.open_file(str(path), "w") as f:
        f.create_carray("/", "x", obj=x, filters=filters, chunkshape=(5, 16, 16))
        f.create_carray("/", "flags", obj=flags, filters=filters)
        f.create_carray("/", "ints", obj=ints, filters=filters, chunkshape=(4, 10))
    d = daemon(plugins=False)
    got = serve_all(stoker, d, path, {"x": "/x", "flags": "/flags", "ints": "/ints"})
    assert np.array_equal(got["x"], x)
    assert np.array_equal(got["ints"], ints)
    assert got["flags"].dtype == np.uint8 and np.array_equal(got["flags"], flags.astype(np.uint8))


def test_damaged_blosc2_frames_fail_their_batch_or_read_as_h5py_does(stoker: Any, daemon: Any, tmp_path: Path) -> None:
    """Bytes overwritten in one stored Blosc2 frame. Where the frame's
    structure is hit (chunk sizes, block starts, the chunk index), the batch
    holding it fails with an error naming the file, the field and blosc2, and
    h5py fails too; where only compressed payload is hit (Blosc2 keeps no
    checksum), the values served equal h5py's (c-blosc2's) reading of the
    same damaged file. The daemon serves the other field throughout."""
    a = (np.arange(N * 64) % 251).astype(np.float32).reshape(N, 64)
    path = tmp_path / "frames.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("v", data=a, chunks=(4, 64), **B2(cname="zstd", filters=B2.SHUFFLE))
        f.create_dataset("ok", data=a, chunks=(4, 64), **B2(cname="lz4"))
        info = f["v"].id.get_chunk_info(1)  # samples 4..7
        raw = f["v"].id.read_direct_chunk((4, 0))[1]
    header_len = int.from_bytes(raw[11:15], "big")
    data_bytes = int.from_bytes(raw[39:47], "big")
    structure = {
        "chunk size": header_len + 4,
        "block start": header_len + 32,
        "chunk index": header_len + data_bytes + 12,
    }
    payload = header_len + 32 + 4 + data_bytes // 2
    d = daemon(plugins=False)
    pristine = path.read_bytes()
    for what, at in [*structure.items(), ("payload", payload)]:
        damaged = bytearray(pristine)
        damaged[info.byte_offset + at : info.byte_offset + at + 4] = b"\xff\xff\xff\x7f"
        bad = tmp_path / f"bad-{at}.h5"
        bad.write_bytes(bytes(damaged))
        with h5py.File(bad) as f:
            try:
                reference: np.ndarray | None = f["v"][4:8]
            except OSError:
                reference = None
        loader = stoker.Loader(stoker.hdf5(str(bad), fields={"v": "/v"}), batch_size=4, shuffle=False, socket=d.socket)
        loader.set_epoch(0)
        if what != "payload":
            assert reference is None, f"h5py read a frame with a damaged {what}"
        served: list[np.ndarray] = []
        try:
            for b in loader:
                served.append(np.array(b["v"]))
        except stoker.StokerError as e:
            assert reference is None, f"{what}: stoker failed ({e}) where h5py read the chunk"
            assert_names(str(e), str(bad), '"v"', "blosc2")
        else:
            assert reference is not None, f"{what}: stoker served a chunk h5py cannot read"
            assert served[1].tobytes() == reference.tobytes(), what
            assert served[0].tobytes() == a[:4].tobytes() and served[2].tobytes() == a[8:].tobytes()
        loader.close()
        assert d.alive()
        assert np.array_equal(serve_all(stoker, d, bad, {"ok": "/ok"})["ok"], a)


def write_bzip2(path: Path) -> None:
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.arange(N * 30, dtype=np.float32).reshape(N, 30), chunks=(4, 30),
                         **hdf5plugin.BZip2())


def test_undecodable_filter_refused_at_open_naming_it(stoker: Any, daemon: Any, tmp_path: Path) -> None:
    path = tmp_path / "bzip2.h5"
    write_bzip2(path)
    d = daemon(plugins=False)
    with pytest.raises(stoker.StokerError) as e:
        stoker.Loader(stoker.hdf5(str(path), fields={"x": "/x"}), batch_size=N, socket=d.socket)
    assert_names(str(e.value), "bzip2", "307", "hdf5plugin", "HDF5_PLUGIN_PATH", '"x"')
    # With hdf5plugin's plugins on HDF5_PLUGIN_PATH, libhdf5 decodes it.
    d = daemon(plugins=True)
    got = serve_all(stoker, d, path, {"x": "/x"})
    assert np.array_equal(got["x"], np.arange(N * 30, dtype=np.float32).reshape(N, 30))


def test_unknown_filter_id_refused_at_open(stoker: Any, daemon: Any, tmp_path: Path) -> None:
    path = tmp_path / "fake.h5"
    with h5py.File(path, "w") as f:
        # An optional filter libhdf5 does not have is skipped when writing, so the file holds a
        # pipeline that names filter 31999 although the chunks are plain.
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_chunk((4,))
        dcpl.set_filter(31999, h5py.h5z.FLAG_OPTIONAL, (1, 2))
        ds = h5py.h5d.create(f.id, b"v", h5py.h5t.NATIVE_INT32, h5py.h5s.create_simple((N,)), dcpl=dcpl)
        ds.write(h5py.h5s.ALL, h5py.h5s.ALL, np.arange(N, dtype=np.int32))
    d = daemon(plugins=True)
    with pytest.raises(stoker.StokerError) as e:
        stoker.Loader(stoker.hdf5(str(path), fields={"v": "/v"}), batch_size=N, socket=d.socket)
    assert_names(str(e.value), "31999", "HDF5_PLUGIN_PATH")


def test_inspect_shows_each_filter_and_its_decoder(tmp_path: Path) -> None:
    path = tmp_path / "filters.h5"
    write_blosc2(path)
    with h5py.File(path, "a") as f:
        f.create_dataset("z", data=np.arange(N * 4).reshape(N, 4), chunks=(4, 4), shuffle=True, compression="gzip")
        f.create_dataset("b", data=np.arange(N * 4.0).reshape(N, 4), chunks=(4, 4), **hdf5plugin.BZip2())
    env = {k: v for k, v in os.environ.items() if k != "HDF5_PLUGIN_PATH"}
    run = lambda e: subprocess.run(  # noqa: E731
        [str(stoker_bin()), "inspect", str(path)], capture_output=True, text=True, env=e, timeout=SUBPROCESS_TIMEOUT_S
    )
    without = run(env)
    assert "blosc2 (32026): decoded by Rust" in without.stdout, without.stdout + without.stderr
    assert "deflate (1): decoded by Rust" in without.stdout
    assert "bzip2 (307): NOT decodable" in without.stdout
    with_plugins = run({**env, "HDF5_PLUGIN_PATH": hdf5plugin.PLUGIN_PATH})
    assert "bzip2 (307): decoded by libhdf5" in with_plugins.stdout, with_plugins.stdout
    assert "blosc2 (32026): decoded by Rust" in with_plugins.stdout
