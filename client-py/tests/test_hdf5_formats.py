"""HDF5 types and filters beyond plain numbers: enum datasets (served as their
base integers), bitfields (PyTables' bool arrays; served as unsigned integers,
as h5py reads them), Blosc2 (PyTables' and hdf5plugin's filter 32026, decoded
by libhdf5 through hdf5plugin's plugin on HDF5_PLUGIN_PATH), and a filter
nothing can decode, refused when the dataset opens, naming it."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Iterator

import h5py
import hdf5plugin
import numpy as np
import pytest

from conftest import Daemon, SUBPROCESS_TIMEOUT_S, assert_names, make_config, stoker_bin

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


def test_blosc2_served_bit_exact_with_hdf5plugin(stoker: Any, daemon: Any, tmp_path: Path) -> None:
    path = tmp_path / "blosc2.h5"
    want = write_blosc2(path)
    d = daemon(plugins=True)
    got = serve_all(stoker, d, path, {"x": "/x", "y": "/y"})
    for k, w in want.items():
        assert got[k].dtype == w.dtype and np.array_equal(got[k], w), k


def test_pytables_blosc2_bool_and_float_bit_exact(stoker: Any, daemon: Any, tmp_path: Path) -> None:
    tables = pytest.importorskip("tables")
    path = tmp_path / "pt.h5"
    rng = np.random.default_rng(2)
    x = rng.normal(size=(N, 16, 16)).astype(np.float32)
    flags = rng.integers(0, 2, size=(N, 9)).astype(bool)
    filters = tables.Filters(complevel=5, complib="blosc2")
    with tables.open_file(str(path), "w") as f:
        f.create_carray("/", "x", obj=x, filters=filters, chunkshape=(5, 16, 16))
        f.create_carray("/", "flags", obj=flags, filters=filters)
    d = daemon(plugins=True)
    got = serve_all(stoker, d, path, {"x": "/x", "flags": "/flags"})
    assert np.array_equal(got["x"], x)
    assert got["flags"].dtype == np.uint8 and np.array_equal(got["flags"], flags.astype(np.uint8))


def test_undecodable_filter_refused_at_open_naming_it(stoker: Any, daemon: Any, tmp_path: Path) -> None:
    path = tmp_path / "blosc2.h5"
    write_blosc2(path)
    d = daemon(plugins=False)
    with pytest.raises(stoker.StokerError) as e:
        stoker.Loader(stoker.hdf5(str(path), fields={"x": "/x"}), batch_size=N, socket=d.socket)
    assert_names(str(e.value), "blosc2", "32026", "hdf5plugin", "HDF5_PLUGIN_PATH", '"x"')


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
    path = tmp_path / "blosc2.h5"
    write_blosc2(path)
    with h5py.File(path, "a") as f:
        f.create_dataset("z", data=np.arange(N * 4).reshape(N, 4), chunks=(4, 4), shuffle=True, compression="gzip")
    env = {k: v for k, v in os.environ.items() if k != "HDF5_PLUGIN_PATH"}
    run = lambda e: subprocess.run(  # noqa: E731
        [str(stoker_bin()), "inspect", str(path)], capture_output=True, text=True, env=e, timeout=SUBPROCESS_TIMEOUT_S
    )
    without = run(env)
    assert "blosc2 (32026): NOT decodable" in without.stdout, without.stdout + without.stderr
    assert "deflate (1): decoded by Rust" in without.stdout
    with_plugins = run({**env, "HDF5_PLUGIN_PATH": hdf5plugin.PLUGIN_PATH})
    assert "blosc2 (32026): decoded by libhdf5" in with_plugins.stdout, with_plugins.stdout
