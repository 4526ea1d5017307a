"""Regenerate the HDF5 chunk fixtures used by `crates/decode/src/filter/tests.rs`.

Writes small datasets with h5py + hdf5plugin, one per filter pipeline, then
dumps chunk (0, ...) of each as libhdf5 stored it (`read_direct_chunk`), the
bytes libhdf5 decodes it to (a plain dataset read), and the filter pipeline
as `H5Pget_filter2` reports it, into `cases.json` next to this script.

Run from anywhere (needs numpy, h5py and hdf5plugin):

    /work/main/.venv/bin/python crates/decode/src/filter/testdata/make.py

The output is deterministic except for what the filters themselves embed.
"""

import hashlib
import json
import os
import tempfile

import h5py
import hdf5plugin
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
rng = np.random.RandomState(20240611)


def smooth(n, dtype):
    """Compressible but not trivial data: a noisy ramp."""
    x = np.arange(n, dtype=np.float64)
    v = 1000.0 * np.sin(x / 37.0) + x / 3.0 + rng.normal(0, 2.0, n)
    if np.dtype(dtype).kind == "f":
        return v.astype(dtype)
    info = np.iinfo(dtype)
    return np.clip(np.round(v), info.min, info.max).astype(dtype)


def noise(n, dtype):
    """Incompressible bytes (exercises the codecs' stored-raw paths)."""
    return np.frombuffer(rng.bytes(n * np.dtype(dtype).itemsize), dtype=dtype).copy()


def pipeline(ds):
    plist = ds.id.get_create_plist()
    out = []
    for i in range(plist.get_nfilters()):
        code, flags, cd, name = plist.get_filter(i)
        out.append({"id": int(code), "flags": int(flags), "client_data": [int(c) for c in cd],
                    "name": name.decode("ascii", "replace")})
    return out


def store(blob, suffix):
    name = hashlib.sha256(blob).hexdigest()[:16] + suffix
    path = os.path.join(HERE, name)
    if not os.path.exists(path):
        with open(path, "wb") as f:
            f.write(blob)
    return name


cases = []
todo = []  # (name, note): dumped after the file is closed and reopened


def dump(name, ds, note):
    # Dump after reopening: a handle that wrote chunks with write_direct_chunk
    # keeps stale filter masks in its chunk cache.
    todo.append((name, note))


def dump_now(name, ds, note):
    chunks = ds.chunks
    origin = (0,) * len(chunks)
    mask, stored = ds.id.read_direct_chunk(origin)
    expected = ds[tuple(slice(0, c) for c in chunks)]
    assert expected.shape == chunks, (name, expected.shape, chunks)
    expected = np.ascontiguousarray(expected).tobytes()
    cases.append({
        "name": name,
        "note": note,
        "dtype": ds.dtype.str,
        "element_size": ds.dtype.itemsize,
        "chunk_shape": list(chunks),
        "chunk_bytes": len(expected),
        "filter_mask": int(mask),
        "pipeline": pipeline(ds),
        "stored": store(bytes(stored), ".stored"),
        "expected": store(expected, ".raw"),
    })
    print(f"{name:32} {len(stored):6} -> {len(expected):6}  {[p['id'] for p in cases[-1]['pipeline']]}")


def make(f, name, data, chunks, note, **kw):
    ds = f.create_dataset(name, data=data, chunks=chunks, **kw)
    dump(name, ds, note)


with tempfile.TemporaryDirectory() as tmp:
    with h5py.File(os.path.join(tmp, "fixtures.h5"), "w") as f:
        n = 1024
        f32 = smooth(n, "<f4")
        i16 = smooth(n, "<i2")
        u8 = smooth(1001, "u1")

        # Built-in filters.
        make(f, "gzip_f32", f32, (n,), "deflate alone", compression="gzip", compression_opts=4)
        make(f, "gzip_shuffle_f32", f32, (n,), "shuffle + deflate", compression="gzip", shuffle=True)
        make(f, "gzip_shuffle_fletcher_i16", i16, (n,), "shuffle + deflate + fletcher32",
             compression="gzip", shuffle=True, fletcher32=True)
        make(f, "fletcher_odd_u8", u8, (1001,), "fletcher32 alone over an odd byte count", fletcher32=True)
        make(f, "fletcher_i16", i16, (n,), "fletcher32 alone, even byte count", fletcher32=True)
        make(f, "shuffle_f64_2d", smooth(16 * 24, "<f8").reshape(16, 24), (16, 24), "shuffle alone, 2-D",
             shuffle=True)
        make(f, "shuffle_odd_f32", smooth(999, "<f4"), (999,), "shuffle alone, 999 elements", shuffle=True)
        make(f, "lzf_i16", i16, (n,), "h5py's lzf filter", compression="lzf")
        make(f, "lzf_shuffle_f32", f32, (n,), "shuffle + lzf", compression="lzf", shuffle=True)

        # fletcher32 *before* deflate (low-level API: h5py's high level puts it last).
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_chunk((n,))
        dcpl.set_fletcher32()
        dcpl.set_deflate(6)
        space = h5py.h5s.create_simple((n,))
        h5py.h5d.create(f.id, b"fletcher_then_gzip_i16", h5py.h5t.STD_I16LE, space, dcpl=dcpl)
        ds = f["fletcher_then_gzip_i16"]
        ds[...] = i16
        dump("fletcher_then_gzip_i16", ds, "fletcher32 applied first, deflate second")

        # A chunk written with deflate skipped (filter_mask bit 0), read back by libhdf5.
        ds = f.create_dataset("masked_gzip_i16", shape=(2 * n,), dtype="<i2", chunks=(n,),
                              compression="gzip", shuffle=True)
        ds[n:] = i16
        ds.id.write_direct_chunk((0,), np.ascontiguousarray(i16[::-1]).tobytes(), filter_mask=0b11)
        dump("masked_gzip_i16", ds, "shuffle and deflate both skipped for this chunk (mask 0b11)")
        ds = f.create_dataset("masked_one_i16", shape=(2 * n,), dtype="<i2", chunks=(n,),
                              compression="gzip", shuffle=True)
        shuffled = np.ascontiguousarray(i16).view(np.uint8).reshape(n, 2).T.copy().tobytes()
        ds.id.write_direct_chunk((0,), shuffled, filter_mask=0b10)
        dump("masked_one_i16", ds, "deflate skipped (mask 0b10), shuffle applied")

        # LZ4 plugin framing.
        make(f, "lz4_f32", f32, (n,), "one block", **hdf5plugin.LZ4())
        make(f, "lz4_blocks_i16", i16, (n,), "512-byte blocks, last one short", **hdf5plugin.LZ4(nbytes=600))
        make(f, "lz4_noise_u8", noise(3000, "u1"), (3000,), "incompressible: blocks stored raw",
             **hdf5plugin.LZ4(nbytes=1024))

        # Zstd plugin.
        make(f, "zstd_f32", f32, (n,), "one frame", **hdf5plugin.Zstd(clevel=5))

        # Bitshuffle, all compressions, element sizes 1/2/4/8, leftovers and small blocks.
        make(f, "bshuf_none_i16", i16, (n,), "no compression", **hdf5plugin.Bitshuffle(cname="none"))
        make(f, "bshuf_lz4_f32", f32, (n,), "lz4, default block", **hdf5plugin.Bitshuffle(cname="lz4"))
        make(f, "bshuf_zstd_f32", f32, (n,), "zstd, default block", **hdf5plugin.Bitshuffle(cname="zstd"))
        make(f, "bshuf_lz4_u8_odd", u8, (1001,), "1-byte elements, 1001 elements: 1 leftover",
             **hdf5plugin.Bitshuffle(nelems=64, cname="lz4"))
        make(f, "bshuf_lz4_f64_blocks", smooth(203, "<f8"), (203,),
             "8-byte elements, 64-element blocks, short last block and 3 leftover elements",
             **hdf5plugin.Bitshuffle(nelems=64, cname="lz4"))
        make(f, "bshuf_lz4_i16_big", (np.arange(5003) // 7).astype("<i2"), (5003,),
             "default block size (4096 elements): two blocks + leftover",
             **hdf5plugin.Bitshuffle(cname="lz4"))
        make(f, "bshuf_none_u32_blocks", smooth(517, "<u4"), (517,), "no compression, 16-element blocks",
             **hdf5plugin.Bitshuffle(nelems=16, cname="none"))
        make(f, "bshuf_zstd_i16_blocks", smooth(1003, "<i2"), (1003,), "zstd, 128-element blocks",
             **hdf5plugin.Bitshuffle(nelems=128, cname="zstd"))

        # Blosc 1 frames.
        B = hdf5plugin.Blosc
        make(f, "blosc_lz4_shuffle_f32", f32, (n,), "lz4, byte shuffle", **B(cname="lz4", shuffle=B.SHUFFLE))
        make(f, "blosc_lz4hc_bitshuffle_i16", i16, (n,), "lz4hc, bit shuffle",
             **B(cname="lz4hc", shuffle=B.BITSHUFFLE))
        make(f, "blosc_zlib_noshuffle_f64", (np.arange(512) // 3).astype("<f8"), (512,), "zlib, no shuffle",
             **B(cname="zlib", shuffle=B.NOSHUFFLE))
        make(f, "blosc_zstd_shuffle_f64", smooth(512, "<f8"), (512,), "zstd, byte shuffle",
             **B(cname="zstd", shuffle=B.SHUFFLE))
        make(f, "blosc_zstd_bitshuffle_odd", smooth(1001, "<i2"), (1001,), "zstd, bit shuffle, 1001 elements",
             **B(cname="zstd", shuffle=B.BITSHUFFLE))
        make(f, "blosc_lz4_tiny", smooth(20, "<i4"), (20,), "80 bytes: too small for blosc, stored unfiltered", **B(cname="lz4"))
        make(f, "blosc_lz4_noise", noise(256, "<u4"), (256,), "incompressible: libhdf5 stores it unfiltered",
             **B(cname="lz4", shuffle=B.SHUFFLE))
        make(f, "blosc_lz4_clevel0", f32, (n,), "clevel 0: no gain, stored unfiltered", **B(cname="lz4", clevel=0))
        make(f, "blosc_zstd_blocks_i32", (np.arange(8300) // 3).astype("<i4"), (8300,),
             "two blocks, the second a short leftover block", **B(cname="zstd", clevel=1, shuffle=B.SHUFFLE))
        make(f, "blosc_blosclz_f32", f32, (n,), "blosclz, noisy floats", **B(cname="blosclz"))
        make(f, "blosc_blosclz_ramp_i4", (np.arange(1024) // 5).astype("<i4"), (1024,), "blosclz, no shuffle",
             **B(cname="blosclz", shuffle=B.NOSHUFFLE))

        # Blosc2 frames (hdf5-blosc2, filter 32026): a plain chunk per frame for
        # 1-D chunks, a b2nd array (blocks padded to the block shape) for 2-D+.
        B2 = hdf5plugin.Blosc2
        make(f, "blosc2_lz4_shuffle_f32", f32, (n,), "1-D frame, lz4, byte shuffle",
             **B2(cname="lz4", filters=B2.SHUFFLE))
        make(f, "blosc2_zstd_bitshuffle_odd", smooth(1001, "<i2"), (1001,), "1-D frame, zstd, bit shuffle, 1001 elements",
             **B2(cname="zstd", filters=B2.BITSHUFFLE))
        make(f, "blosc2_blosclz_noshuffle_f64", (np.arange(512) // 3).astype("<f8"), (512,), "blosclz, no filter",
             **B2(cname="blosclz", filters=B2.NOFILTER))
        make(f, "blosc2_b2nd_zlib_2d", smooth(30 * 50, "<f4").reshape(30, 50), (30, 50),
             "b2nd 30×50, zlib, byte shuffle", **B2(cname="zlib", filters=B2.SHUFFLE))
        make(f, "blosc2_b2nd_lz4hc_3d", smooth(7 * 9 * 11, "<i2").reshape(7, 9, 11), (7, 9, 11),
             "b2nd 7×9×11 (padded blocks), lz4hc, bit shuffle", **B2(cname="lz4hc", filters=B2.BITSHUFFLE))
        make(f, "blosc2_b2nd_zeros_2d", np.zeros((64, 64), "<f8"), (64, 64), "b2nd, all zeros: special chunk",
             **B2(cname="zstd"))
        make(f, "blosc2_b2nd_zstd_blocks_4d", (np.arange(6 * 40 * 40 * 3) // 7).astype("<u2").reshape(6, 40, 40, 3),
             (6, 40, 40, 3), "b2nd 4-D, several blocks", **B2(cname="zstd", clevel=1, filters=B2.SHUFFLE))

    with h5py.File(os.path.join(tmp, "fixtures.h5"), "r") as f:
        for name, note in todo:
            dump_now(name, f[name], note)

with open(os.path.join(HERE, "cases.json"), "w") as out:
    json.dump({"generator": "make.py", "h5py": h5py.version.version, "hdf5": h5py.version.hdf5_version,
               "hdf5plugin": hdf5plugin.version, "cases": cases}, out, indent=1)
    out.write("\n")
