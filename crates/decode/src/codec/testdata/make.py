#!/usr/bin/env python3
"""Writes the codec test fixtures with the reference tools (Pillow, numpy, lz4, zstandard).

Run from anywhere with a Python that has numpy, pillow, lz4 and zstandard:

    .venv/bin/python crates/decode/src/codec/testdata/make.py

Each fixture is listed in manifest.json with its codec, the dtype and shape it
decodes to, and `expect`: the decoded array as C-ordered little-endian bytes.
Expected pixels come from Pillow's decoder (`np.asarray(Image.open(...))`,
converted to the layout stoker delivers) or, for PNGs Pillow cannot write or
read at full depth (16-bit colour, 2/4-bit gray, interlaced), from the array
that was encoded. The output is deterministic.
"""

import io
import json
import struct
import zlib
from pathlib import Path

import lz4.block
import lz4.frame
import numpy as np
import zstandard
from PIL import Image

HERE = Path(__file__).resolve().parent
rng = np.random.default_rng(1234)
manifest = []


def write(name, data):
    (HERE / name).parent.mkdir(parents=True, exist_ok=True)
    (HERE / name).write_bytes(data)


def add(name, data, codec, expect, tolerance=None, raw=None):
    """Records fixture `name` holding `data`, which decodes to `expect` (a numpy array)."""
    write(name, data)
    expect = np.ascontiguousarray(expect)
    expect_name = name + ".expect"
    write(expect_name, expect.astype(expect.dtype.newbyteorder("<")).tobytes())
    entry = {
        "file": name,
        "codec": codec,
        "dtype": expect.dtype.name,
        "shape": list(expect.shape),
        "expect": expect_name,
    }
    if tolerance is not None:
        entry["tolerance"] = tolerance
    if raw is not None:
        entry["raw"] = raw
    manifest.append(entry)


def image(h, w, c, depth=8):
    """A smooth gradient with edges and noise: like a photo, not like noise."""
    y, x = np.mgrid[0:h, 0:w]
    top = (1 << depth) - 1
    planes = []
    for k in range(c):
        base = (x * (k + 1) * 3 + y * (5 - k) * 2) / (w * 3 + h * 10)
        base += 0.25 * ((x // 7 + y // 5 + k) % 2)
        base += rng.normal(0, 0.03, size=(h, w))
        planes.append(np.clip(base, 0, 1) * top)
    dtype = np.uint16 if depth == 16 else np.uint8
    return np.rint(np.stack(planes, axis=-1)).astype(dtype)


def png_bytes(im, **params):
    buf = io.BytesIO()
    im.save(buf, format="PNG", **params)
    return buf.getvalue()


def hwc(a):
    return a[..., None] if a.ndim == 2 else a


# ---- PNG written by Pillow, expected from Pillow's decode ----
H, W = 19, 27
rgb = image(H, W, 3)
rgba = image(H, W, 4)
gray = image(H, W, 1)[..., 0]
la = image(H, W, 2)

for name, im, conv in [
    ("gray8", Image.fromarray(gray, "L"), None),
    ("gray_alpha8", Image.fromarray(la, "LA"), None),
    ("rgb8", Image.fromarray(rgb, "RGB"), None),
    ("rgba8", Image.fromarray(rgba, "RGBA"), None),
    ("palette8", Image.fromarray(rgb, "RGB").quantize(200), "RGB"),
    ("palette4", Image.fromarray(rgb, "RGB").quantize(12), "RGB"),
    ("gray1", Image.fromarray(gray > 128), "L"),
]:
    data = png_bytes(im, optimize=(name == "rgb8"))
    back = Image.open(io.BytesIO(data))
    if conv:
        back = back.convert(conv)
    add(f"png/{name}.png", data, "png", hwc(np.asarray(back)))

# palette with transparency → RGBA; gray / RGB with a tRNS colour key → alpha channel
pal = Image.fromarray(rgb, "RGB").quantize(16)
data = png_bytes(pal, transparency=3)
back = Image.open(io.BytesIO(data)).convert("RGBA")
assert (np.asarray(back)[..., 3] == 0).any()
add("png/palette_trns.png", data, "png", np.asarray(back))

key = int(gray[5, 5])
data = png_bytes(Image.fromarray(gray, "L"), transparency=key)
back = Image.open(io.BytesIO(data)).convert("LA")
assert (np.asarray(back)[..., 1] == 0).sum() == (gray == key).sum()
add("png/gray_trns.png", data, "png", np.asarray(back))

key_rgb = tuple(int(v) for v in rgb[3, 4])
data = png_bytes(Image.fromarray(rgb, "RGB"), transparency=key_rgb)
back = Image.open(io.BytesIO(data)).convert("RGBA")
assert (np.asarray(back)[..., 3] == 0).any()
add("png/rgb_trns.png", data, "png", np.asarray(back))

# 16-bit gray via Pillow's "I;16"
gray16 = image(H, W, 1, depth=16)[..., 0]
data = png_bytes(Image.fromarray(gray16))
back = np.asarray(Image.open(io.BytesIO(data)))
assert back.dtype == np.dtype("<u2") and (back == gray16).all()
add("png/gray16.png", data, "png", hwc(back))


# ---- PNG written by hand (Pillow writes neither 16-bit colour, 2/4-bit gray nor interlaced) ----
def chunk(kind, body):
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)


def scanlines(img, depth):
    out = bytearray()
    for row in img:
        flat = row.reshape(-1)
        if depth == 16:
            packed = flat.astype(">u2").tobytes()
        elif depth == 8:
            packed = flat.astype(np.uint8).tobytes()
        else:
            per = 8 // depth
            flat = np.concatenate([flat, np.zeros((-len(flat)) % per, flat.dtype)]).astype(np.uint8)
            groups = flat.reshape(-1, per)
            shifts = np.array([8 - depth * (i + 1) for i in range(per)], np.uint8)
            packed = (groups << shifts).sum(axis=1).astype(np.uint8).tobytes()
        out += b"\x00" + packed  # filter type 0 (None)
    return bytes(out)


ADAM7 = [(0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2)]


def hand_png(img, color_type, depth, interlace=False):
    h, w = img.shape[:2]
    ihdr = struct.pack(">IIBBBBB", w, h, depth, color_type, 0, 0, 1 if interlace else 0)
    if interlace:
        raw = b"".join(
            scanlines(img[y0::dy, x0::dx], depth)
            for x0, y0, dx, dy in ADAM7
            if img[y0::dy, x0::dx].size
        )
    else:
        raw = scanlines(img, depth)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b"")


rgb16 = image(H, W, 3, depth=16)
rgba16 = image(H, W, 4, depth=16)
la16 = image(H, W, 2, depth=16)
add("png/rgb16.png", hand_png(rgb16, 2, 16), "png", rgb16)
add("png/rgba16.png", hand_png(rgba16, 6, 16), "png", rgba16)
add("png/gray_alpha16.png", hand_png(la16, 4, 16), "png", la16)
for depth in (2, 4):
    top = (1 << depth) - 1
    g = (gray.astype(np.uint16) * top // 255).astype(np.uint8)
    data = hand_png(g, 0, depth)
    expect = g * (255 // top)
    assert (np.asarray(Image.open(io.BytesIO(data))) == expect).all()  # Pillow scales the same way
    add(f"png/gray{depth}.png", data, "png", hwc(expect))
data = hand_png(rgb, 2, 8, interlace=True)
assert (np.asarray(Image.open(io.BytesIO(data))) == rgb).all()
add("png/rgb8_interlaced.png", data, "png", rgb)
add("png/rgb16_interlaced.png", hand_png(rgb16, 2, 16, interlace=True), "png", rgb16)

# ---- JPEG written and decoded by Pillow (libjpeg-turbo); stoker decodes with libjpeg-turbo too: exact ----
photo = image(41, 57, 3)
for name, im, params in [
    ("rgb_baseline420", Image.fromarray(photo, "RGB"), {"quality": 90}),
    ("rgb_baseline444", Image.fromarray(photo, "RGB"), {"quality": 90, "subsampling": 0}),
    ("rgb_baseline422", Image.fromarray(photo, "RGB"), {"quality": 85, "subsampling": 1}),
    ("rgb_progressive", Image.fromarray(photo, "RGB"), {"quality": 90, "progressive": True}),
    ("gray_baseline", Image.fromarray(photo[..., 1], "L"), {"quality": 90}),
    ("gray_progressive", Image.fromarray(photo[..., 1], "L"), {"quality": 90, "progressive": True}),
]:
    buf = io.BytesIO()
    im.save(buf, format="JPEG", **params)
    data = buf.getvalue()
    back = Image.open(io.BytesIO(data))
    assert back.info.get("progressive", 0) == int(params.get("progressive", False)) or "progressive" in params
    # Same library, same settings (accurate integer IDCT, fancy upsampling): bit-exact.
    add(f"jpeg/{name}.jpg", data, "jpeg", hwc(np.asarray(back)))

# ---- npy: dtypes, C/Fortran order, both byte orders, odd shapes ----
def npy_bytes(a, fortran=False):
    buf = io.BytesIO()
    np.save(buf, np.asfortranarray(a) if fortran else np.ascontiguousarray(a))
    return buf.getvalue()


base = rng.normal(0, 1000, size=(3, 4, 5))
for code in ["b1", "u1", "i1", "u2", "i2", "u4", "i4", "u8", "i8", "f2", "f4", "f8"]:
    if code == "b1":
        a = base > 0
    elif code[0] == "u":
        a = np.abs(base).astype(code)
    else:
        a = base.astype(code)
    for order in "<>":
        if code in ("b1", "u1", "i1") and order == ">":
            continue
        typed = a.astype(np.dtype(code).newbyteorder(order))
        for fortran in (False, True):
            name = f"npy/{code}_{'le' if order == '<' else 'be'}_{'f' if fortran else 'c'}.npy"
            data = npy_bytes(typed, fortran)
            assert (b"'fortran_order': True" in data) == fortran
            add(name, data, "npy", a.astype(np.dtype(code).newbyteorder("=")))
add("npy/scalar.npy", npy_bytes(np.float32(2.5)), "npy", np.array(2.5, np.float32))
add("npy/vector.npy", npy_bytes(np.arange(7, dtype="<i4")), "npy", np.arange(7, dtype="<i4"))
add("npy/empty.npy", npy_bytes(np.zeros((0, 3), "<f4")), "npy", np.zeros((0, 3), "<f4"))
big = np.arange(2 * 3 * 4 * 5, dtype=">f8").reshape(2, 3, 4, 5)
add("npy/f8_be_f_4d.npy", npy_bytes(big, True), "npy", big.astype("<f8"))

# ---- wrapped: lz4 frame (Python's default), lz4 block with size prefix, zstd ----
arr = rng.integers(0, 50, size=(8, 12, 3)).astype("<u2")
plain_npy = npy_bytes(arr)
fortran_be = npy_bytes(arr.astype(">u2"), True)
add("wrap/npy.lz4", lz4.frame.compress(plain_npy), "lz4+npy", arr)
add("wrap/npy_linked_checksum.lz4", lz4.frame.compress(plain_npy, block_linked=True, content_checksum=True,
                                                        block_size=lz4.frame.BLOCKSIZE_MAX64KB), "lz4+npy", arr)
add("wrap/npy_fortran_be.lz4", lz4.frame.compress(fortran_be), "lz4+npy", arr)
add("wrap/npy.lz4block", lz4.block.compress(plain_npy), "lz4+npy", arr)
add("wrap/npy.zst", zstandard.ZstdCompressor(level=3).compress(plain_npy), "zstd+npy", arr)
add("wrap/npy_fortran_be.zst", zstandard.ZstdCompressor().compress(fortran_be), "zstd+npy", arr)
add("wrap/npy_nosize.zst", zstandard.ZstdCompressor(write_content_size=False).compress(plain_npy), "zstd+npy", arr)
raw_layout = {"dtype": "<u2", "shape": [8, 12, 3]}
add("wrap/raw.lz4", lz4.frame.compress(arr.tobytes()), "lz4+raw", arr, raw=raw_layout)
add("wrap/raw.lz4block", lz4.block.compress(arr.tobytes()), "lz4+raw", arr, raw=raw_layout)
add("wrap/raw.zst", zstandard.ZstdCompressor().compress(arr.tobytes()), "zstd+raw", arr, raw=raw_layout)
add("wrap/raw_be.zst", zstandard.ZstdCompressor().compress(arr.astype(">u2").tobytes()), "zstd+raw", arr,
    raw={"dtype": ">u2", "shape": [8, 12, 3]})
add("wrap/raw.bin", arr.tobytes(), "raw", arr, raw=raw_layout)
png_rgb = (HERE / "png/rgb8.png").read_bytes()
add("wrap/png.zst", zstandard.ZstdCompressor().compress(png_rgb), "zstd+png", np.asarray(Image.open(io.BytesIO(png_rgb))))
add("wrap/png.lz4", lz4.frame.compress(png_rgb), "lz4+png", np.asarray(Image.open(io.BytesIO(png_rgb))))
jpg = (HERE / "jpeg/rgb_baseline444.jpg").read_bytes()
add("wrap/jpeg.lz4", lz4.frame.compress(jpg), "lz4+jpeg", np.asarray(Image.open(io.BytesIO(jpg))))

# ---- a Pillow bilinear resize, for the resize transform ----
small = Image.fromarray(rgb, "RGB").resize((16, 11), Image.Resampling.BILINEAR)
write("resize/rgb8_to_11x16.expect", np.asarray(small).tobytes())

(HERE / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
total = sum(p.stat().st_size for p in HERE.rglob("*") if p.is_file())
print(f"{len(manifest)} fixtures, {total} bytes")
