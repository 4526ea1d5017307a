"""Data for the LMDB end-to-end tests, made the way users make it.

Environments are written with the `lmdb` package, images encoded by Pillow,
arrays by `np.save`, compressed values by `lz4` and `zstandard`. The few PNG
variants Pillow cannot write (16-bit colour, sub-byte gray) are written by
`hand_png`, a minimal encoder, as other tools (OpenCV, libpng) write them.

`pil_decode` is the reference a served PNG is compared against: Pillow's
decoding, expanded the way the daemon documents (crates/decode/src/codec/image.rs):
palettes → RGB, or RGBA when a tRNS chunk is present; a tRNS chunk on gray or
RGB adds an alpha channel; 1/2/4-bit samples → uint8 scaled to 0–255;
16-bit → uint16; gray keeps a channel axis, `[h, w, 1]`.
"""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Union

import lmdb
import numpy as np
from PIL import Image

Key = Union[str, bytes]


def key(i: int) -> str:
    """The key of sample `i` in the tests' environments: sorted order is index order."""
    return f"{i:08d}"


def write_env(path: Path, items: Mapping[Key, bytes], *, subdir: bool = True) -> Path:
    """Writes an LMDB environment at `path` holding `items` (key → value)."""
    size = sum(len(v) + len(k) + 64 for k, v in items.items())
    map_size = max(1 << 20, 4 * size + (1 << 20))
    env = lmdb.open(str(path), map_size=map_size, subdir=subdir)
    with env.begin(write=True) as txn:
        for k, v in items.items():
            txn.put(k.encode() if isinstance(k, str) else k, v)
    env.close()
    return path


# --------------------------------------------------------------------------
# Pixels
# --------------------------------------------------------------------------


def photo(h: int, w: int, c: int, *, depth: int = 8, seed: int = 0) -> np.ndarray:
    """A smooth gradient with an edge and mild noise: photo-like content
    (what JPEG is made for), `[h, w, c]` uint8 or uint16 (`depth=16`)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    top = (1 << depth) - 1
    phase = rng.uniform(0, 6.28, size=c)
    planes = []
    for k in range(c):
        base = 0.5 + 0.35 * np.sin(x / (w / 3.0) + phase[k]) * np.cos(y / (h / 2.0) - phase[k])
        base += 0.1 * ((x + 2 * y) > (w + h) / 1.5)  # an edge
        base += rng.normal(0, 0.02, size=(h, w))
        planes.append(np.clip(base, 0, 1) * top)
    return np.rint(np.stack(planes, axis=-1)).astype(np.uint16 if depth == 16 else np.uint8)


def noise(h: int, w: int, c: int, *, seed: int = 0, dtype: type = np.uint8) -> np.ndarray:
    """Uniform random pixels: every crop position looks different."""
    info = np.iinfo(dtype)
    return np.random.default_rng(seed).integers(info.min, int(info.max) + 1, size=(h, w, c), dtype=dtype)


# --------------------------------------------------------------------------
# Encoders
# --------------------------------------------------------------------------


def png_bytes(im: Image.Image, **params: object) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG", **params)
    return buf.getvalue()


def jpeg_bytes(im: Image.Image, **params: object) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="JPEG", **params)
    return buf.getvalue()


def npy_bytes(a: np.ndarray, *, fortran: bool = False) -> bytes:
    buf = io.BytesIO()
    a = np.asarray(a)
    # (np.ascontiguousarray would turn a 0-d array into shape (1,).)
    np.save(buf, np.asfortranarray(a) if fortran and a.ndim else np.asarray(a, order="C"))
    return buf.getvalue()


def image_of(a: np.ndarray) -> Image.Image:
    """A Pillow image of an `[h, w, c]` uint8 array (c = 1, 2, 3, 4)."""
    assert a.dtype == np.uint8 and a.ndim == 3 and a.shape[2] in (1, 2, 3, 4), (a.dtype, a.shape)
    im = Image.fromarray(np.ascontiguousarray(a[..., 0] if a.shape[2] == 1 else a))
    assert im.mode == {1: "L", 2: "LA", 3: "RGB", 4: "RGBA"}[a.shape[2]], im.mode
    return im


def png_of(a: np.ndarray) -> bytes:
    """PNG of an `[h, w, c]` uint8 array, by Pillow (16-bit: by `hand_png`)."""
    if a.dtype == np.uint16:
        return hand_png(a, depth=16)
    return png_bytes(image_of(a))


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def hand_png(a: np.ndarray, *, depth: int, trns: bytes | None = None) -> bytes:
    """A non-interlaced PNG of `[h, w, c]` samples (gray, gray+alpha, RGB,
    RGBA by `c`) at bit `depth` (1, 2, 4 for gray; 8 or 16), filter type 0,
    with an optional raw tRNS chunk."""
    h, w, c = a.shape
    color = {1: 0, 2: 4, 3: 2, 4: 6}[c]
    if depth == 16:
        rows = a.astype(">u2").reshape(h, w * c).view(np.uint8).reshape(h, -1)
    elif depth == 8:
        rows = a.astype(np.uint8).reshape(h, w * c)
    else:
        assert c == 1 and depth in (1, 2, 4)
        per = 8 // depth
        padded = np.zeros((h, -(-w // per) * per), dtype=np.uint8)
        padded[:, :w] = a[..., 0]
        packed = np.zeros((h, padded.shape[1] // per), dtype=np.uint8)
        for j in range(per):
            packed |= padded[:, j::per] << (8 - depth * (j + 1))
        rows = packed
    raw = b"".join(b"\x00" + row.tobytes() for row in rows)
    ihdr = struct.pack(">IIBBBBB", w, h, depth, color, 0, 0, 0)
    body = _chunk(b"IHDR", ihdr)
    if trns is not None:
        body += _chunk(b"tRNS", trns)
    return b"\x89PNG\r\n\x1a\n" + body + _chunk(b"IDAT", zlib.compress(raw, 6)) + _chunk(b"IEND", b"")


def png_bit_depth(data: bytes) -> tuple[int, int]:
    """(bit depth, colour type) from a PNG's IHDR."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return data[24], data[25]


# --------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------


def hwc(a: np.ndarray) -> np.ndarray:
    return a[..., None] if a.ndim == 2 else a


def pil_decode(data: bytes) -> np.ndarray:
    """What the daemon must serve for PNG `data`, from Pillow (see the module docs)."""
    im = Image.open(io.BytesIO(data))
    im.load()
    trns = "transparency" in im.info
    if im.mode == "P":
        im = im.convert("RGBA" if trns else "RGB")
    elif im.mode == "1":
        im = im.convert("L")
    elif im.mode in ("L", "RGB") and trns:
        im = im.convert("LA" if im.mode == "L" else "RGBA")
    elif im.mode.startswith("I"):
        # 16-bit gray ("I;16", or "I" in older Pillow); tRNS not covered here.
        assert not trns, "16-bit gray with tRNS: compute the reference from the array"
        a = np.asarray(im)
        assert a.min() >= 0 and a.max() <= 65535
        return hwc(a.astype(np.uint16))
    return hwc(np.asarray(im))


def pil_jpeg(data: bytes) -> np.ndarray:
    """Pillow's (libjpeg-turbo's) decoding of a JPEG, `[h, w, 1 | 3]`."""
    im = Image.open(io.BytesIO(data))
    im.load()
    assert im.mode in ("L", "RGB"), im.mode
    return hwc(np.asarray(im))


def with_alpha_from_trns(a: np.ndarray, transparent: tuple[int, ...]) -> np.ndarray:
    """`a` ([h, w, c], gray or RGB) plus the alpha channel a tRNS colour gives:
    0 where the pixel equals `transparent`, fully opaque elsewhere (libpng's
    `png_set_tRNS_to_alpha`)."""
    top = np.iinfo(a.dtype).max
    opaque = ~(a == np.asarray(transparent, dtype=a.dtype)).all(axis=-1, keepdims=True)
    return np.concatenate([a, (opaque * top).astype(a.dtype)], axis=-1)
