"""Every numeric dtype, both byte orders, contiguous and chunked layouts,
never-written chunks with a fill value: served bytes equal h5py's."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np

from conftest import check_field

KINDS = ["u1", "u2", "u4", "u8", "i1", "i2", "i4", "i8", "f2", "f4", "f8"]


def _values(rng: np.random.Generator, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    if dtype.kind == "f":
        v = rng.standard_normal(shape) * 1000
        v.flat[:3] = [np.inf, -0.0, -np.inf]  # edge values survive byte-exact
        return v.astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, dtype=dtype.newbyteorder("="), endpoint=True).astype(dtype)


def _write(path: Path, n: int, offset: int, rng: np.random.Generator) -> dict[str, str]:
    fields = {"label": "label"}
    with h5py.File(path, "w") as f:
        f.create_dataset("label", data=np.arange(offset, offset + n, dtype="<i8"))
        for kind in KINDS:
            for order in "<>":
                dtype = np.dtype(order + kind)
                tag = f"{kind}_{'le' if order == '<' else 'be'}"
                data = _values(rng, dtype, (n, 3, 2))
                f.create_dataset(f"contig/{tag}", data=data)
                # Chunks of 4 rows straddle batches; n is not a multiple of 4 (partial edge chunk).
                f.create_dataset(f"gzip/{tag}", data=data, chunks=(4, 3, 2), compression="gzip", shuffle=True)
                fields[f"contig_{tag}"] = f"contig/{tag}"
                fields[f"gzip_{tag}"] = f"gzip/{tag}"
        f.create_dataset("flag", data=rng.integers(0, 2, size=(n, 5)).astype(bool))
        fields["flag"] = "flag"
        # Chunked with a fill value, only the first rows written: the rest must read as the fill value.
        fill = f.create_dataset("sparse", shape=(n, 2), dtype=">f4", chunks=(2, 2), fillvalue=7.5)
        fill[:3] = [[1, 2], [3, 4], [5, 6]]
        fields["sparse"] = "sparse"
        # Contiguous, never written: no storage allocated, fill value 0.
        f.create_dataset("empty", shape=(n,), dtype="<u2")
        fields["empty"] = "empty"
    return fields


def test_every_dtype_layout_and_byte_order_matches_h5py(start_daemon, stoker, tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    root = tmp_path / "dtypes"
    root.mkdir()
    lengths = [23, 18]
    fields: dict[str, str] = {}
    for i, n in enumerate(lengths):
        fields = _write(root / f"d{i}.h5", n, sum(lengths[:i]), rng)
    ref: dict[str, np.ndarray] = {}
    for name, h5path in fields.items():
        parts = []
        for i in range(len(lengths)):
            with h5py.File(root / f"d{i}.h5") as f:
                parts.append(f[h5path][()])
        ref[name] = np.concatenate(parts, dtype=parts[0].dtype)

    daemon = start_daemon()
    loader = stoker.Loader(stoker.hdf5(str(root / "*.h5"), fields=fields), batch_size=8, seed=3, socket=daemon.socket)
    for name in fields:
        assert loader.fields[name][0] == ref[name].dtype.newbyteorder("="), name
    seen = []
    for batch in loader:
        idx = batch["label"].astype(np.int64)
        for name in fields:
            check_field(name, batch[name], ref[name][idx])
        seen += idx.tolist()
    assert sorted(seen) == list(range(sum(lengths)))
