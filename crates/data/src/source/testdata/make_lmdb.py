#!/usr/bin/env python3
"""Writes LMDB environments with Python's `lmdb` package for the LMDB source tests.

Usage: make_lmdb.py OUT_DIR   (the Rust tests call it with a temporary directory)

Pixel values encode the key: image i of 6×8×3 has pixel (y, x, c) = (7i + 3y + 5x + 40c) % 256,
so a test can tell which key a sample came from without a reference decoder.
"""

import io
import pickle
import sys
from pathlib import Path

import lmdb
import numpy as np
import zstandard
from PIL import Image

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)


def lr_image(i, h=6, w=8):
    y, x, c = np.mgrid[0:h, 0:w, 0:3]
    return ((7 * i + 3 * y + 5 * x + 40 * c) % 256).astype(np.uint8)


def png(a):
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    return buf.getvalue()


def npy(a):
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def write_env(path, entries, subdir=True):
    env = lmdb.open(str(path), map_size=1 << 26, subdir=subdir)
    with env.begin(write=True) as txn:
        for key, value in entries:
            txn.put(key.encode() if isinstance(key, str) else key, value)
    env.close()


keys = [f"img_{i:03d}" for i in range(12)]
lr = {k: png(lr_image(i)) for i, k in enumerate(keys)}
meta = [("__len__", b"12"), ("__keys__", pickle.dumps(keys)), ("length", b"12")]
write_env(out / "single.lmdb", list(lr.items()) + meta)
write_env(out / "single_file.mdb", list(lr.items()) + meta, subdir=False)

# Paired super-resolution: HR is LR blown up 4× (nearest), BasicSR layout with meta_info.txt.
write_env(out / "lr.lmdb", list(lr.items()))
hr = {k: png(lr_image(i).repeat(4, axis=0).repeat(4, axis=1)) for i, k in enumerate(keys)}
write_env(out / "hr.lmdb", list(hr.items()))
(out / "hr.lmdb" / "meta_info.txt").write_text("".join(f"{k}.png (24,32,3) 1\n" for k in sorted(keys)[::-1]))
write_env(out / "lr_missing.lmdb", [(k, v) for k, v in lr.items() if k != "img_004"])

# Bad values: "c" is a truncated npy, "e" has another shape.
good = {k: npy(np.full((3, 3), i, np.float32)) for i, k in enumerate("abcdef")}
good["c"] = good["c"][:-7]
good["e"] = npy(np.zeros((2, 3), np.float32))
write_env(out / "corrupt.lmdb", list(good.items()))

# Variable sizes.
write_env(out / "variable.lmdb", [(f"v{i}", png(lr_image(i, 5 + i, 7 + 2 * i))) for i in range(5)])

# zstd-wrapped npy, float32 with a key-dependent value.
write_env(out / "zstd.lmdb", [(f"z{i}", zstandard.ZstdCompressor().compress(npy(np.full((4, 4), i / 2, np.float32))))
                              for i in range(4)])
print("ok")
