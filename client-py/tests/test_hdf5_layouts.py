"""HDF5 storage at full strength: every numeric dtype across contiguous,
chunked and compact layouts, each compression filter, chunks aligned with
samples, straddling them and cut at the edge, never-written chunks with a fill
value, windowed samples in The Well's layout, corrupt chunks and the libhdf5
fallback. Served bytes are compared with h5py's."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import h5py
import hdf5plugin
import numpy as np
import pytest

from conftest import check_field, stoker_bin

DTYPES = ["|u1", "<u2", ">u4", "<u8", "|i1", ">i2", "<i4", ">i8", "<f2", ">f2", "<f4", ">f4", "<f8", ">f8", "bool"]

FILTERS = {
    "none": {},
    "gzip": {"compression": "gzip", "compression_opts": 4},
    "gzip+shuffle": {"compression": "gzip", "shuffle": True},
    "fletcher32": {"fletcher32": True},
    "gzip+shuffle+fletcher32": {"compression": "gzip", "shuffle": True, "fletcher32": True},
    "lz4": dict(hdf5plugin.LZ4()),
    "zstd": dict(hdf5plugin.Zstd(clevel=3)),
    "bitshuffle+lz4": dict(hdf5plugin.Bitshuffle(cname="lz4")),
    "blosc+lz4": dict(hdf5plugin.Blosc(cname="lz4", shuffle=hdf5plugin.Blosc.SHUFFLE)),
    "blosc+zstd": dict(hdf5plugin.Blosc(cname="zstd", shuffle=hdf5plugin.Blosc.BITSHUFFLE)),
}

# Chunk shapes along (item, a, b) for samples shaped (6, 5): aligned with one
# sample, straddling samples (3 rows, partial edge chunk since 41 % 3 != 0),
# and splitting a sample across chunks in the trailing dims.
CHUNKS = {"aligned": (1, 6, 5), "straddling": (3, 6, 5), "split-sample": (4, 4, 2)}


def _tag(dt: str) -> str:
    """A dataset-name-safe tag for a dtype string: '>i2' -> 'be_i2'."""
    return dt.replace("<", "le_").replace(">", "be_").replace("|", "")


def _values(rng: np.random.Generator, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    if dtype.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.kind == "f":
        return (rng.standard_normal(shape) * 100).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, dtype=dtype.newbyteorder("="), endpoint=True).astype(dtype)


def _compact(f: h5py.File, name: str, data: np.ndarray) -> None:
    """A compact-layout dataset (data stored in the object header)."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.COMPACT)
    space = h5py.h5s.create_simple(data.shape)
    tid = h5py.h5t.py_create(data.dtype, logical=True)
    dset = h5py.h5d.create(f.id, name.encode(), tid, space, dcpl=dcpl)
    dset.write(h5py.h5s.ALL, h5py.h5s.ALL, np.ascontiguousarray(data))


def _reference(files: list[Path], fields: dict[str, str]) -> dict[str, np.ndarray]:
    ref = {}
    for name, path in fields.items():
        parts = []
        for p in files:
            with h5py.File(p) as f:
                parts.append(f[path][()])
        ref[name] = np.concatenate(parts, dtype=parts[0].dtype)
    return ref


def _serve_and_compare(stoker, daemon, files, fields, ref, batch_size=7, **kw) -> None:
    spec = stoker.hdf5(str(files[0].parent / "*.h5"), fields=fields, **kw)
    loader = stoker.Loader(spec, batch_size=batch_size, seed=2, socket=daemon.socket)
    seen = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        for batch in loader:
            idx = batch["index"].astype(np.int64)
            for name in fields:
                check_field(name, batch[name], ref[name][idx])
            seen += idx.tolist()
    assert sorted(seen) == sorted(list(range(len(ref["index"]))) * 2)


def inspect(path: Path) -> dict[str, dict]:
    out = subprocess.run([str(stoker_bin()), "inspect", "--json", str(path)], capture_output=True, text=True, check=True)
    return {d["path"]: d for d in json.loads(out.stdout)}


@pytest.mark.parametrize("filt", list(FILTERS))
def test_filters_and_chunkings_match_h5py(start_daemon, stoker, tmp_path: Path, filt: str) -> None:
    rng = np.random.default_rng(len(filt))
    root = tmp_path / filt
    root.mkdir()
    lengths = [41, 17]
    files, fields = [], {"index": "index"}
    for k, n in enumerate(lengths):
        path = root / f"part{k}.h5"
        with h5py.File(path, "w") as f:
            f.create_dataset("index", data=np.arange(sum(lengths[:k]), sum(lengths[:k]) + n))
            for dt in DTYPES:
                dtype = np.dtype(dt)
                tag = _tag(dt)
                for chunk_name, chunks in CHUNKS.items():
                    name = f"{chunk_name}/{tag}"
                    f.create_dataset(name, data=_values(rng, dtype, (n, 6, 5)), chunks=chunks, **FILTERS[filt])
                    fields[f"{chunk_name}_{tag}"] = name
            # Never-written chunks read as the fill value.
            sparse = f.create_dataset("sparse", shape=(n, 6, 5), dtype=">i4", chunks=(2, 6, 5), fillvalue=-7, **FILTERS[filt])
            sparse[1:4] = 5
            fields["sparse"] = "sparse"
        files.append(path)
    ref = _reference(files, fields)
    daemon = start_daemon(allowed_roots=[tmp_path])
    _serve_and_compare(stoker, daemon, files, fields, ref)

    report = inspect(files[0])
    for name, info in report.items():
        if name == "index":
            continue
        assert info["read_path"].startswith("fast path"), (name, info)


def test_contiguous_and_compact_layouts_match_h5py(start_daemon, stoker, tmp_path: Path) -> None:
    rng = np.random.default_rng(9)
    root = tmp_path / "layouts"
    root.mkdir()
    lengths = [12, 9]
    files, fields = [], {"index": "index"}
    for k, n in enumerate(lengths):
        path = root / f"part{k}.h5"
        with h5py.File(path, "w") as f:
            f.create_dataset("index", data=np.arange(sum(lengths[:k]), sum(lengths[:k]) + n))
            for dt in DTYPES:
                tag = _tag(dt)
                f.create_dataset(f"contiguous/{tag}", data=_values(rng, np.dtype(dt), (n, 3, 2)))
                _compact(f, f"compact_{tag}", _values(rng, np.dtype(dt), (n, 2)))
                fields[f"contiguous_{tag}"] = f"contiguous/{tag}"
                fields[f"compact_{tag}"] = f"compact_{tag}"
            f.create_dataset("unwritten", shape=(n, 4), dtype="<f8", fillvalue=2.5)
            fields["unwritten"] = "unwritten"
        files.append(path)
    report = inspect(files[0])
    assert report["compact_le_u2"]["layout"] == "compact"
    assert report["contiguous/be_f8"]["read_path"].startswith("fast path")
    ref = _reference(files, fields)
    daemon = start_daemon(allowed_roots=[tmp_path])
    _serve_and_compare(stoker, daemon, files, fields, ref, batch_size=4)


def test_filter_without_fast_path_falls_back_to_libhdf5(start_daemon, stoker, tmp_path: Path) -> None:
    root = tmp_path / "fallback"
    root.mkdir()
    path = root / "scaleoffset.h5"
    n = 30
    with h5py.File(path, "w") as f:
        f.create_dataset("index", data=np.arange(n))
        f.create_dataset("x", data=np.arange(n * 8, dtype="<i4").reshape(n, 8) * 3, chunks=(4, 8), scaleoffset=0)
        f.create_dataset("n", data=np.arange(n * 2, dtype=">u2").reshape(n, 2), chunks=(5, 2), scaleoffset=0)
    assert inspect(path)["x"]["read_path"].startswith("libhdf5")
    fields = {"index": "index", "x": "x", "n": "n"}
    daemon = start_daemon(allowed_roots=[tmp_path])
    _serve_and_compare(stoker, daemon, [path], fields, _reference([path], fields), batch_size=4)


def test_the_well_layout_serves_windows_once_per_epoch_across_ranks(start_daemon, stoker, tmp_path: Path) -> None:
    """Files shaped like The Well: t0_fields/<name> [traj, time, x, y],
    t1_fields/<name> [traj, time, x, y, d], and a per-trajectory constant."""
    rng = np.random.default_rng(3)
    root = tmp_path / "well"
    root.mkdir()
    size, stride = 4, 2
    files, meta = [], []
    for k, (traj, time) in enumerate([(3, 11), (2, 9)]):
        path = root / f"shear_flow_{k:02d}.hdf5.h5"
        with h5py.File(path, "w") as f:
            f.attrs["dataset_name"] = "shear_flow"
            f.attrs["n_spatial_dims"] = 2
            f.create_dataset("t0_fields/density", data=rng.standard_normal((traj, time, 8, 6), dtype=np.float32), chunks=(1, 2, 8, 6), compression="gzip")
            f.create_dataset("t1_fields/velocity", data=rng.standard_normal((traj, time, 8, 6, 2), dtype=np.float32))
            f.create_dataset("t0_fields/mask", data=rng.integers(0, 5, size=(traj, 8, 6)).astype(">i2"))
            # trajectory and time coordinates, so tests can tell which window is which
            f.create_dataset("traj_id", data=np.arange(traj) + 100 * k)
            f.create_dataset("time", data=np.broadcast_to(np.arange(time, dtype=np.int32), (traj, time)).copy())
        files.append(path)
        meta.append((traj, time))
    fields = {
        "density": "t0_fields/density",
        "velocity": "t1_fields/velocity",
        "mask": "t0_fields/mask",
        "traj": "traj_id",
        "time": "time",
    }
    spec = stoker.hdf5(str(root / "*.h5"), fields=fields, window={"size": size, "stride": stride}, per_item=["mask", "traj"])
    windows = [(time - size) // stride + 1 for _, time in meta]
    n = sum(t * w for (t, _), w in zip(meta, windows))
    daemon = start_daemon(allowed_roots=[tmp_path])

    def key(b, r):
        return int(b["traj"][r]), int(b["time"][r][0])

    world = 3
    for epoch in range(2):
        seen = []
        for rank in range(world):
            loader = stoker.Loader(spec, batch_size=5, seed=7, rank=rank, world_size=world, socket=daemon.socket)
            assert loader.fields["density"][1] == (size, 8, 6)
            assert loader.fields["velocity"][1] == (size, 8, 6, 2)
            assert loader.fields["mask"][1] == (8, 6)
            loader.set_epoch(epoch)
            for b in loader:
                for r in range(len(b["traj"])):
                    tid, t0 = key(b, r)
                    k, item = divmod(tid, 100)
                    assert t0 % stride == 0 and t0 + size <= meta[k][1]
                    np.testing.assert_array_equal(b["time"][r], np.arange(t0, t0 + size))
                    with h5py.File(files[k]) as f:
                        check_field("density", b["density"][r], f["t0_fields/density"][item, t0 : t0 + size])
                        check_field("velocity", b["velocity"][r], f["t1_fields/velocity"][item, t0 : t0 + size])
                        check_field("mask", b["mask"][r], f["t0_fields/mask"][item])
                    seen.append((tid, t0))
            loader.close()
        total = -(-n // world) * world
        assert len(seen) == total
        assert len(set(seen)) == n, "every window exactly once (plus wrap-around padding)"


def _serve_with_chunk_16_bad(start_daemon, stoker, tmp_path: Path, path: Path, data) -> str:
    """Serves `path` (fields `index`, `x`; batches of 8, chunk rows 16..24 of
    `x` damaged) beside a good dataset, and returns the one error: only the
    batch over the bad chunk fails, and everyone else is served."""
    daemon = start_daemon(allowed_roots=[tmp_path])
    bad = stoker.Loader(stoker.hdf5(str(path), fields={"index": "index", "x": "x"}), batch_size=8, shuffle=False, socket=daemon.socket)
    good = stoker.Loader(data.spec(stoker), batch_size=8, shuffle=True, socket=daemon.socket)
    it = iter(bad)
    errors, rows = [], []
    for _ in range(len(bad)):
        try:
            rows += next(it)["index"].tolist()
        except stoker.DatasetError as e:
            errors.append(str(e))
    assert len(errors) == 1, errors
    assert rows == list(range(0, 16)) + list(range(24, 40))
    assert sorted(i for b in good for i in data.check_batch(b)) == list(range(data.n))
    assert daemon.alive()
    return errors[0]


def test_corrupt_chunk_names_file_field_and_chunk(start_daemon, stoker, tmp_path: Path, data) -> None:
    root = tmp_path / "corrupt"
    root.mkdir()
    path = root / "bad.h5"
    n = 40
    with h5py.File(path, "w") as f:
        f.create_dataset("index", data=np.arange(n))
        f.create_dataset("x", data=np.random.default_rng(0).standard_normal((n, 64)).astype("<f4"), chunks=(8, 64), compression="gzip", shuffle=True)
    with h5py.File(path) as f:
        info = f["x"].id.get_chunk_info(2)
    raw = bytearray(path.read_bytes())
    middle = info.byte_offset + info.size // 2
    raw[middle : middle + 16] = bytes(16)
    path.write_bytes(bytes(raw))

    msg = _serve_with_chunk_16_bad(start_daemon, stoker, tmp_path, path, data)
    assert str(path) in msg and '"x"' in msg and "[16, 0]" in msg, msg


def test_chunk_index_size_past_the_file_fails_its_batch_before_allocating(start_daemon, stoker, tmp_path: Path, data) -> None:
    """A chunk's stored size comes from the file's chunk index: a corrupt one
    (here 2 GiB in a 30 KB file) is refused, naming the file, field and
    chunk, before anything of that size is allocated."""
    import struct

    root = tmp_path / "corrupt"
    root.mkdir()
    path = root / "bad.h5"
    n = 40
    with h5py.File(path, "w", libver="earliest") as f:
        f.create_dataset("index", data=np.arange(n))
        f.create_dataset("x", data=np.random.default_rng(0).standard_normal((n, 64)).astype("<f4"), chunks=(8, 64), compression="gzip")
    with h5py.File(path) as f:
        info = f["x"].id.get_chunk_info(2)
    raw = bytearray(path.read_bytes())
    # The v1 B-tree key of chunk (16, 0): size, filter mask, offsets (with the element axis).
    record = struct.pack("<IIQQQ", info.size, 0, 16, 0, 0)
    assert raw.count(record) == 1
    at = raw.index(record)
    raw[at : at + 4] = struct.pack("<I", 0x7FFF_FFF0)
    path.write_bytes(bytes(raw))
    with h5py.File(path) as f, pytest.raises(Exception):  # noqa: B017 - however h5py fails
        f["x"][16]  # the reference reader fails on it too

    msg = _serve_with_chunk_16_bad(start_daemon, stoker, tmp_path, path, data)
    assert str(path) in msg and '"x"' in msg and "[16, 0]" in msg and "end of the file" in msg, msg


def test_contradictory_window_spec_is_refused_naming_the_dataset(start_daemon, stoker, tmp_path: Path) -> None:
    root = tmp_path / "spec"
    root.mkdir()
    with h5py.File(root / "a.h5", "w") as f:
        f["x"] = np.zeros((3, 5, 2), dtype="<f4")
        f["c"] = np.zeros((3, 2), dtype="<f4")
    daemon = start_daemon(allowed_roots=[tmp_path])
    glob = str(root / "*.h5")
    spec = stoker.hdf5(glob, fields={"x": "x", "c": "c"}, window={"size": 2}, per_item=["x", "c"])
    with pytest.raises(stoker.DatasetError) as e:
        stoker.Loader(spec, batch_size=2, socket=daemon.socket)
    assert glob in str(e.value) and "not per_item" in str(e.value), str(e.value)
