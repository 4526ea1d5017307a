"""LMDB datasets end to end: environments written with the `lmdb` package,
values encoded by Pillow, numpy, lz4 and zstandard, served by a real daemon
through `stoker.lmdb(...)` (or a `[datasets.NAME]` table) and checked against
what Pillow and numpy make of the same bytes.

Samples are identified by an `idx` field: a second environment with the same
keys whose values are `np.save`d int64 scalars holding the sample's index, so
`batch["idx"][j]` says which key row `j` came from even when shuffled.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Callable

import lz4.block
import lz4.frame
import numpy as np
import pytest
import zstandard
from PIL import Image, ImageCms, JpegImagePlugin, PngImagePlugin

from conftest import SUBPROCESS_TIMEOUT_S, assert_names, realpaths
from lmdb_data import (
    hand_png,
    image_of,
    jpeg_bytes,
    key,
    noise,
    npy_bytes,
    photo,
    pil_decode,
    pil_jpeg,
    png_bit_depth,
    png_bytes,
    png_of,
    with_alpha_from_trns,
    write_env,
)

Batch = Mapping[str, Any]


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def idx_env(path: Path, n: int, keys: Sequence[str] | None = None) -> Path:
    """An environment holding, under each key, the sample's index as an npy int64 scalar."""
    keys = [key(i) for i in range(n)] if keys is None else list(keys)
    return write_env(path, {k: npy_bytes(np.int64(i)) for i, k in enumerate(keys)})


def copy_batch(batch: Batch) -> dict[str, Any]:
    """A batch copied out of shared memory (lists of per-sample arrays stay lists)."""
    return {k: [np.array(a) for a in v] if isinstance(v, list) else np.array(v) for k, v in batch.items()}


def run_epoch(loader: Any, epoch: int | None = None) -> list[dict[str, Any]]:
    if epoch is not None:
        loader.set_epoch(epoch)
    return [copy_batch(b) for b in loader]


def rows(batches: Sequence[Batch]) -> list[dict[str, Any]]:
    """Per-sample dicts out of batches."""
    out = []
    for b in batches:
        n = len(next(iter(b.values())))
        assert all(len(v) == n for v in b.values()), {k: len(v) for k, v in b.items()}
        out.extend({k: v[j] for k, v in b.items()} for j in range(n))
    return out


def assert_exact(name: str, served: np.ndarray, expected: np.ndarray) -> None:
    """`served` is `expected` in native byte order: same dtype, shape, values
    and bytes (NaN payloads included), C-contiguous."""
    want = np.asarray(expected, order="C")
    want = want.astype(want.dtype.newbyteorder("="), copy=False)
    assert isinstance(served, np.ndarray), f"{name}: {type(served)} is not a numpy array"
    assert served.dtype == want.dtype, f"{name}: dtype {served.dtype.str} != {want.dtype.str}"
    assert served.dtype.isnative, f"{name}: dtype {served.dtype.str} is not native-endian"
    assert served.shape == want.shape, f"{name}: shape {served.shape} != {want.shape}"
    assert served.flags.c_contiguous, f"{name}: not C-contiguous"
    if served.tobytes() != want.tobytes():
        bad = np.argwhere(~((served == want) | ((served != served) & (want != want))))
        at = tuple(bad[0]) if len(bad) else "(bytes only)"
        detail = f"first at {at}: {served[at]!r} != {want[at]!r}" if len(bad) else "NaN payload or -0.0"
        raise AssertionError(f"{name}: {len(bad)} values differ; {detail}")


def find_crops(src: np.ndarray, crop: np.ndarray, *, mirrored: bool = False) -> list[tuple[int, int]]:
    """Every (top, left) where `crop` (or, with `mirrored`, its mirror) equals a window of `src`."""
    h, w = crop.shape[:2]
    want = crop[:, ::-1] if mirrored else crop
    return [
        (t, left)
        for t in range(src.shape[0] - h + 1)
        for left in range(src.shape[1] - w + 1)
        if np.array_equal(src[t : t + h, left : left + w], want)
    ]


def mapping_check(loader: Any, arr: np.ndarray, name: str) -> None:
    start, length = loader._mapping_range()
    ptr = arr.__array_interface__["data"][0]
    assert start <= ptr and ptr + arr.nbytes <= start + length, (
        f"{name}: data at {ptr:#x}+{arr.nbytes} lies outside the stream's mapping {start:#x}+{length}"
    )


# --------------------------------------------------------------------------
# 1. PNG variants, pixel-exact against Pillow
# --------------------------------------------------------------------------

SRGB_ICC = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()


def test_png_variants_pixel_exact(stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path) -> None:
    n, h, w = 6, 12, 20
    values: dict[str, list[bytes]] = {}
    expected: dict[str, list[np.ndarray]] = {}

    def add(name: str, data: bytes, want: np.ndarray | None = None) -> None:
        values.setdefault(name, []).append(data)
        expected.setdefault(name, []).append(pil_decode(data) if want is None else want)

    for i in range(n):
        rgba = photo(h, w, 4, seed=i)
        rgb = np.ascontiguousarray(rgba[..., :3])
        gray = np.ascontiguousarray(rgba[..., :1])
        add("gray8", png_bytes(image_of(gray)))
        add("gray_alpha8", png_bytes(image_of(rgba[..., [0, 3]])))
        add("rgb8", png_bytes(image_of(rgb)))
        add("rgba8", png_bytes(image_of(rgba)))
        # Gray / RGB with a tRNS colour: the daemon adds an alpha channel.
        gray_t = gray.copy()
        gray_t[1, 2] = gray_t[0, 0]
        add("gray8_trns", png_bytes(image_of(gray_t), transparency=int(gray_t[0, 0, 0])))
        rgb_t = rgb.copy()
        rgb_t[3, 4] = rgb_t[0, 0]
        add("rgb8_trns", png_bytes(image_of(rgb_t), transparency=tuple(int(v) for v in rgb_t[0, 0])))
        # Palettes: 8-bit and 4-bit, without and with transparency (one index, and a full alpha table).
        pal = image_of(rgb).quantize(colors=200)
        add("palette8", png_bytes(pal))
        add("palette8_trns1", png_bytes(pal, transparency=3))
        add("palette8_alpha", png_bytes(pal, transparency=bytes((17 * k) % 256 for k in range(200))))
        add("palette4", png_bytes(image_of(rgb).quantize(colors=16), bits=4))
        add("palette2", png_bytes(image_of(rgb).quantize(colors=4), bits=2))
        add("palette1_trns", png_bytes(image_of(rgb).quantize(colors=2), bits=1, transparency=1))
        # Ancillary chunks before the image data: text, pHYs, an ICC profile.
        info = PngImagePlugin.PngInfo()
        info.add_text("Software", "stoker tests")
        add("rgb8_chunks", png_bytes(image_of(rgb), pnginfo=info, dpi=(72, 72), icc_profile=SRGB_ICC))
        # Sub-byte gray: 1-bit by Pillow, 4-bit by hand; served as uint8 scaled to 0-255.
        add("gray1", png_bytes(Image.fromarray(gray[..., 0] > 120)))
        add("gray4", hand_png(gray >> 4, depth=4))
        # 16-bit: gray by Pillow ("I;16"); colour by hand, since Pillow reads
        # 16-bit colour PNGs as 8-bit: the reference is the array written.
        g16 = photo(h, w, 1, depth=16, seed=100 + i)
        c16 = photo(h, w, 4, depth=16, seed=200 + i)
        add("gray16", png_bytes(Image.fromarray(g16[..., 0])))
        add("gray_alpha16", hand_png(c16[..., [0, 3]], depth=16), c16[..., [0, 3]])
        add("rgb16", hand_png(c16[..., :3], depth=16), c16[..., :3])
        add("rgba16", hand_png(c16, depth=16), c16)
        # One field whose size varies: delivered as a list.
        add("var_rgba8", png_bytes(image_of(photo(9 + i, 30 - 2 * i, 4, seed=300 + i))))

    # The files are what they claim to be.
    assert png_bit_depth(values["gray16"][0]) == (16, 0)
    assert png_bit_depth(values["rgb16"][0]) == (16, 2)
    assert png_bit_depth(values["palette4"][0]) == (4, 3)
    assert png_bit_depth(values["palette8"][0]) == (8, 3)
    assert png_bit_depth(values["gray1"][0]) == (1, 0)
    assert png_bit_depth(values["palette2"][0]) == (2, 3) and png_bit_depth(values["palette1_trns"][0]) == (1, 3)
    assert all(c in values["rgb8_chunks"][0] for c in (b"iCCP", b"tEXt", b"pHYs"))
    assert b"tRNS" in values["palette8_trns1"][0] and b"tRNS" not in values["palette8"][0]
    assert expected["palette8_trns1"][0].shape[2] == 4 and expected["palette8"][0].shape[2] == 3
    assert expected["gray8_trns"][0].shape[2] == 2 and expected["gray8_trns"][0][1, 2, 1] == 0

    envs = {}
    for name, vals in values.items():
        envs[name] = write_env(tmp_path / name, {key(i): v for i, v in enumerate(vals)})
    envs["idx"] = idx_env(tmp_path / "idx", n)
    fields = {name: "png" for name in values} | {"idx": "npy"}

    d = start_daemon()
    loader = stoker.Loader(stoker.lmdb(envs, fields=fields), batch_size=4, shuffle=True, seed=3, socket=d.socket)
    for name, (dtype, shape) in loader.fields.items():
        if name not in ("idx", "var_rgba8"):
            want = expected[name][0]
            assert (dtype, shape) == (want.dtype, want.shape), name
    seen = []
    for b in run_epoch(loader, 0):
        idx = b["idx"].tolist()
        seen += idx
        for name in values:
            if name == "var_rgba8":
                assert isinstance(b[name], list), f"{name}: a variable-size field must come as a list"
                for j, i in enumerate(idx):
                    assert_exact(f"{name}[{i}]", b[name][j], expected[name][i])
            else:
                assert isinstance(b[name], np.ndarray), f"{name}: a fixed-size field must come as one array"
                assert_exact(name, b[name], np.stack([expected[name][i] for i in idx]))
    assert sorted(seen) == list(range(n))


def test_png16_trns_alpha(stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path) -> None:
    """16-bit gray and RGB with a tRNS colour: alpha is 0 exactly where the
    pixel equals the (16-bit) transparent colour, 65535 elsewhere."""
    n, h, w = 3, 6, 7
    values: dict[str, list[bytes]] = {"gray16_trns": [], "rgb16_trns": []}
    expected: dict[str, list[np.ndarray]] = {"gray16_trns": [], "rgb16_trns": []}
    for i in range(n):
        for name, c in (("gray16_trns", 1), ("rgb16_trns", 3)):
            a = photo(h, w, c, depth=16, seed=10 * i + c)
            a[2, 5] = a[0, 0]
            transparent = tuple(int(v) for v in a[0, 0])
            png = hand_png(a, depth=16, trns=np.asarray(transparent, dtype=">u2").tobytes())
            # Pillow reads the same transparent colour from the file.
            assert Image.open(io.BytesIO(png)).info["transparency"] == (transparent if c == 3 else transparent[0])
            values[name].append(png)
            expected[name].append(with_alpha_from_trns(a, transparent))
    envs = {name: write_env(tmp_path / name, {key(i): v for i, v in enumerate(vals)}) for name, vals in values.items()}
    d = start_daemon()
    spec = stoker.lmdb(envs, fields={k: "png" for k in values})
    loader = stoker.Loader(spec, batch_size=n, shuffle=False, socket=d.socket)
    (b,) = run_epoch(loader, 0)
    for name in values:
        assert_exact(name, b[name], np.stack(expected[name]))


# --------------------------------------------------------------------------
# 2. JPEG against Pillow
# --------------------------------------------------------------------------

# JPEG decoders need not agree bit for bit (T.81 allows IDCT rounding
# differences), but the daemon decodes with libjpeg-turbo, as Pillow does, with
# Pillow's settings (accurate integer IDCT, fancy upsampling): served pixels
# equal Pillow's exactly (as in the codec tests, crates/decode/src/codec/testdata/make.py).
# The check keeps its (max, mean) form so a difference is reported by size.
JPEG_TOLERANCE = {"gray": (0, 0.0), "colour": (0, 0.0)}


def assert_jpeg_close(name: str, served: np.ndarray, want: np.ndarray) -> None:
    assert served.dtype == np.uint8 and served.shape == want.shape, (name, served.dtype, served.shape, want.shape)
    diff = np.abs(served.astype(np.int16) - want.astype(np.int16))
    max_abs, mean_abs = diff.max(), diff.mean()
    limit_max, limit_mean = JPEG_TOLERANCE["gray" if want.shape[2] == 1 else "colour"]
    assert max_abs <= limit_max and mean_abs <= limit_mean, (
        f"{name}: max abs diff {max_abs}, mean {mean_abs:.3f} vs Pillow; allowed {limit_max}, {limit_mean}"
    )


def _exif_rotate_90() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90° clockwise to display
    return exif.tobytes()


EXIF_ROTATE_90 = _exif_rotate_90()


def test_jpeg_close_to_pillow(stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path) -> None:
    n, h, w = 4, 37, 53  # not multiples of the 8/16-pixel MCUs: edge blocks are padded
    variants = {
        "rgb_baseline_420": ("RGB", {"quality": 90, "subsampling": 2}),
        "rgb_baseline_444": ("RGB", {"quality": 90, "subsampling": 0}),
        "rgb_progressive_420": ("RGB", {"quality": 90, "subsampling": 2, "progressive": True}),
        "rgb_progressive_444": ("RGB", {"quality": 95, "subsampling": 0, "progressive": True}),
        "gray_baseline": ("L", {"quality": 90}),
        "gray_progressive": ("L", {"quality": 90, "progressive": True}),
        # What else users' JPEGs commonly are: 4:2:2, optimized Huffman
        # tables, restart markers, an EXIF orientation (not applied, as
        # np.asarray(Image.open(...)) does not apply it either).
        "rgb_baseline_422": ("RGB", {"quality": 85, "subsampling": 1}),
        "rgb_optimized": ("RGB", {"quality": 75, "subsampling": 2, "optimize": True}),
        "rgb_restart": ("RGB", {"quality": 90, "subsampling": 2, "restart_marker_blocks": 2}),
        "rgb_exif_rotated": ("RGB", {"quality": 90, "subsampling": 2, "exif": EXIF_ROTATE_90}),
    }
    values: dict[str, list[bytes]] = {k: [] for k in variants}
    for i in range(n):
        pic = photo(h, w, 3, seed=i)
        for name, (mode, params) in variants.items():
            im = image_of(pic) if mode == "RGB" else image_of(pic[..., 1:2])
            values[name].append(jpeg_bytes(im, **params))
    for name, (mode, params) in variants.items():
        im = Image.open(io.BytesIO(values[name][0]))
        assert im.mode == mode and bool(im.info.get("progressive")) == params.get("progressive", False), name
        if mode == "RGB":
            assert JpegImagePlugin.get_sampling(im) == params["subsampling"], name
    assert b"\xff\xdd" in values["rgb_restart"][0]  # DRI marker
    assert Image.open(io.BytesIO(values["rgb_exif_rotated"][0])).getexif().get(0x0112) == 6

    envs = {name: write_env(tmp_path / name, {key(i): v for i, v in enumerate(vals)}) for name, vals in values.items()}
    envs["idx"] = idx_env(tmp_path / "idx", n)
    fields = {name: "jpeg" for name in values} | {"idx": "npy"}
    d = start_daemon()
    loader = stoker.Loader(stoker.lmdb(envs, fields=fields), batch_size=3, seed=1, socket=d.socket)
    seen = []
    for b in run_epoch(loader, 0):
        idx = b["idx"].tolist()
        seen += idx
        for name in values:
            assert b[name].shape[1:] == (h, w, 1 if name.startswith("gray") else 3), (name, b[name].shape)
            for j, i in enumerate(idx):
                assert_jpeg_close(f"{name}[{i}]", b[name][j], pil_jpeg(values[name][i]))
    assert sorted(seen) == list(range(n))


# --------------------------------------------------------------------------
# 3. npy: every dtype, both orders, both byte orders; raw
# --------------------------------------------------------------------------

NPY_CODES = ["b1", "u1", "i1", "u2", "u4", "u8", "i2", "i4", "i8", "f2", "f4", "f8"]


def npy_sample(code: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Values covering the dtype: extremes for integers, NaN/inf/-0.0 for floats."""
    dt = np.dtype(code)
    if dt.kind == "b":
        return rng.random(shape) > 0.5
    if dt.kind in "ui":
        info = np.iinfo(dt)
        a = rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True)
        a.flat[:2] = [info.min, info.max]
        return a
    a = (rng.standard_normal(shape) * 1000).astype(dt)
    a.flat[:4] = [np.nan, np.inf, -np.inf, -0.0]
    return a


def test_npy_every_dtype_order_and_byte_order(stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path) -> None:
    n, shape = 3, (3, 4, 5)
    rng = np.random.default_rng(5)
    values: dict[str, list[bytes]] = {}
    expected: dict[str, list[np.ndarray]] = {}
    for code in NPY_CODES:
        orders = ["|"] if np.dtype(code).itemsize == 1 else ["<", ">"]
        for bo in orders:
            for fortran in (False, True):
                name = f"{code}_{'F' if fortran else 'C'}_{'le' if bo == '<' else 'be' if bo == '>' else 'na'}"
                for _ in range(n):
                    a = npy_sample(code, shape, rng).astype(np.dtype(code).newbyteorder(bo if bo != "|" else "="))
                    data = npy_bytes(a, fortran=fortran)
                    header = data[10:120].decode("latin-1")
                    assert f"'fortran_order': {fortran}" in header, header
                    if bo != "|":
                        assert f"'descr': '{bo}{code}'" in header, header
                    values.setdefault(name, []).append(data)
                    expected.setdefault(name, []).append(a.astype(a.dtype.newbyteorder("=")))
    # Shapes other than 3-D: a scalar, a 1-D big-endian array and a 2-D Fortran one.
    for _ in range(n):
        for name, a, fortran in [
            ("scalar_f8", np.float64(rng.standard_normal()), False),
            ("vec_be_i2", npy_sample("i2", (7,), rng).astype(">i2"), False),
            ("mat_F_be_f4", npy_sample("f4", (5, 2), rng).astype(">f4"), True),
        ]:
            values.setdefault(name, []).append(npy_bytes(np.asarray(a), fortran=fortran))
            expected.setdefault(name, []).append(np.asarray(a).astype(np.asarray(a).dtype.newbyteorder("=")))

    envs = {name: write_env(tmp_path / name, {key(i): v for i, v in enumerate(vals)}) for name, vals in values.items()}
    envs["idx"] = idx_env(tmp_path / "idx", n)
    fields = {name: "npy" for name in values} | {"idx": "npy"}
    d = start_daemon()
    loader = stoker.Loader(stoker.lmdb(envs, fields=fields), batch_size=2, seed=9, socket=d.socket)
    seen = []
    for b in run_epoch(loader, 0):
        idx = b["idx"].tolist()
        seen += idx
        for name in values:
            served = b[name]
            assert served.flags.c_contiguous, name
            assert_exact(name, served, np.stack([expected[name][i] for i in idx]))
    assert sorted(seen) == list(range(n))


def test_raw_declared_dtype_and_shape(stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path) -> None:
    n = 5
    rng = np.random.default_rng(11)
    layouts = {
        "u8_img": ("uint8", (4, 6, 3)),
        "be_i4": (">i4", (5,)),
        "le_f8": ("<f8", (2, 3)),
        "f2": ("float16", (3,)),
        "flags": ("bool", (4,)),
    }
    arrays = {
        name: [npy_sample(np.dtype(dt).str[1:], shape, rng).astype(dt) for _ in range(n)]
        for name, (dt, shape) in layouts.items()
    }
    envs = {}
    for name, arrs in arrays.items():
        # One environment written with subdir=False: the daemon is given its data file.
        envs[name] = write_env(tmp_path / f"{name}.mdb", {key(i): a.tobytes() for i, a in enumerate(arrs)}, subdir=False)
    assert envs["u8_img"].is_file()
    envs["idx"] = idx_env(tmp_path / "idx", n)
    fields: dict[str, Any] = {
        name: {"codec": "raw", "dtype": dt, "shape": list(shape)} for name, (dt, shape) in layouts.items()
    }
    fields["idx"] = "npy"
    d = start_daemon()
    loader = stoker.Loader(stoker.lmdb(envs, fields=fields), batch_size=2, seed=2, socket=d.socket)
    assert loader.fields["be_i4"] == (np.dtype("=i4"), (5,))
    seen = []
    for b in run_epoch(loader, 0):
        idx = b["idx"].tolist()
        seen += idx
        for name, arrs in arrays.items():
            want = np.stack([arrs[i] for i in idx])
            assert_exact(name, b[name], want.astype(want.dtype.newbyteorder("=")))
    assert sorted(seen) == list(range(n))


# --------------------------------------------------------------------------
# 4. lz4 and zstd wrapped values
# --------------------------------------------------------------------------


def test_compressed_values(stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path) -> None:
    n = 5
    rng = np.random.default_rng(21)
    zc = zstandard.ZstdCompressor(level=3)

    def zstd_stream(b: bytes) -> bytes:
        # Streamed frames carry no content size in their header.
        c = zc.compressobj()
        out = c.compress(b) + c.flush()
        assert zstandard.get_frame_parameters(out).content_size == zstandard.CONTENTSIZE_UNKNOWN
        return out

    values: dict[str, list[bytes]] = {}
    expected: dict[str, list[np.ndarray]] = {}
    jpegs: list[bytes] = []
    var_png: list[bytes] = []
    for i in range(n):
        f4 = rng.standard_normal((6, 5, 3)).astype("<f4")
        i2 = npy_sample("i2", (4, 7), rng).astype(">i2")
        f8 = npy_sample("f8", (3, 5), rng).astype(">f8")
        rgb = photo(16, 24, 3, seed=i)
        rgba = photo(16, 24, 4, seed=50 + i)
        u2 = npy_sample("u2", (2, 8), rng).astype(">u2")
        for name, data, want in [
            ("lz4f_npy", lz4.frame.compress(npy_bytes(f4)), f4),
            ("lz4b_npy_F", lz4.block.compress(npy_bytes(i2, fortran=True)), i2),
            ("zstd_npy_F", zc.compress(npy_bytes(f8, fortran=True)), f8),
            ("zstd_stream_npy", zstd_stream(npy_bytes(f4)), f4),
            ("zstd_png", zc.compress(png_of(rgb)), rgb),
            ("lz4b_png", lz4.block.compress(png_of(rgba)), rgba),
            ("lz4f_png16", lz4.frame.compress(png_of(photo(8, 8, 3, depth=16, seed=i))), photo(8, 8, 3, depth=16, seed=i)),
            ("zstd_raw", zc.compress(u2.tobytes()), u2),
            ("zstd_stream_raw", zstd_stream(u2.tobytes()), u2),
            ("lz4f_raw", lz4.frame.compress(u2.tobytes()), u2),
            ("lz4b_raw", lz4.block.compress(u2.tobytes()), u2),
        ]:
            values.setdefault(name, []).append(data)
            expected.setdefault(name, []).append(want.astype(want.dtype.newbyteorder("=")))
        jpegs.append(jpeg_bytes(image_of(rgb), quality=90))
        var_png.append(png_of(photo(10 + 2 * i, 20 - i, 3, seed=70 + i)))
    values["lz4f_jpeg"] = [lz4.frame.compress(j) for j in jpegs]
    values["zstd_png_var"] = [zc.compress(p) for p in var_png]

    envs = {name: write_env(tmp_path / name, {key(i): v for i, v in enumerate(vals)}) for name, vals in values.items()}
    envs["idx"] = idx_env(tmp_path / "idx", n)
    codecs = {
        "lz4f_npy": "lz4+npy",
        "lz4b_npy_F": "lz4+npy",
        "zstd_npy_F": "zstd+npy",
        "zstd_stream_npy": "zstd+npy",
        "zstd_png": "zstd+png",
        "lz4b_png": "lz4+png",
        "lz4f_png16": "lz4+png",
        "zstd_raw": {"codec": "zstd+raw", "dtype": ">u2", "shape": [2, 8]},
        "zstd_stream_raw": {"codec": "zstd+raw", "dtype": ">u2", "shape": [2, 8]},
        "lz4f_raw": {"codec": "lz4+raw", "dtype": ">u2", "shape": [2, 8]},
        "lz4b_raw": {"codec": "lz4+raw", "dtype": ">u2", "shape": [2, 8]},
        "lz4f_jpeg": "lz4+jpeg",
        "zstd_png_var": "zstd+png",
    }
    # The same values again through a transform chain (decoded into a
    # buffer, not straight into the slot): two fields may share an environment.
    extra_envs = {
        "zstd_png_crop": envs["zstd_png"],
        "lz4b_npy_f32": envs["lz4b_npy_F"],
        "zstd_npy_crop": envs["zstd_npy_F"],
    }
    transforms = {
        "zstd_png_crop": [{"center_crop": (10, 14)}],
        "lz4b_npy_f32": [{"to_f32": 2.0}],
        "zstd_npy_crop": [{"center_crop": (2, 3)}],
    }
    fields = {**codecs, "zstd_png_crop": "zstd+png", "lz4b_npy_f32": "lz4+npy", "zstd_npy_crop": "zstd+npy"}
    fields["idx"] = "npy"
    d = start_daemon()
    spec = stoker.lmdb({**envs, **extra_envs}, fields=fields, transforms=transforms)
    loader = stoker.Loader(spec, batch_size=2, seed=4, socket=d.socket)
    seen = []
    for b in run_epoch(loader, 0):
        idx = b["idx"].tolist()
        seen += idx
        for name in expected:
            assert_exact(name, b[name], np.stack([expected[name][i] for i in idx]))
        for j, i in enumerate(idx):
            assert_jpeg_close(f"lz4f_jpeg[{i}]", b["lz4f_jpeg"][j], pil_jpeg(jpegs[i]))
            assert_exact(f"zstd_png_var[{i}]", b["zstd_png_var"][j], pil_decode(var_png[i]))
        assert isinstance(b["zstd_png_var"], list)
        assert_exact("zstd_png_crop", b["zstd_png_crop"], np.stack([expected["zstd_png"][i][3:13, 5:19] for i in idx]))
        f32 = np.stack([expected["lz4b_npy_F"][i] for i in idx]).astype(np.float32) * np.float32(2.0)
        assert_exact("lz4b_npy_f32", b["lz4b_npy_f32"], f32)
        assert_exact("zstd_npy_crop", b["zstd_npy_crop"], np.stack([expected["zstd_npy_F"][i][:2, 1:4] for i in idx]))
    assert sorted(seen) == list(range(n))


# --------------------------------------------------------------------------
# 5. Paired LR/HR crops
# --------------------------------------------------------------------------


def upscale4(a: np.ndarray) -> np.ndarray:
    return np.repeat(np.repeat(a, 4, axis=0), 4, axis=1)


def make_sr_pair(root: Path, names: Sequence[str], *, metadata: bool) -> tuple[Path, Path, dict[str, np.ndarray]]:
    """LR images of varying size and HR = LR upscaled 4× (nearest): an HR crop
    aligned with an LR crop is that crop with every pixel repeated 4×4."""
    lr_vals, hr_vals, lr_arrays = {}, {}, {}
    for i, name in enumerate(names):
        lr = noise(12 + i % 5, 14 + (3 * i) % 7, 3, seed=1000 + i)
        lr_arrays[name] = lr
        lr_vals[name] = png_of(lr)
        hr_vals[name] = png_of(upscale4(lr))
    if metadata:
        # Written by some LMDB dataset tools beside the samples; never samples themselves.
        for vals in (lr_vals, hr_vals):
            vals["__len__"] = str(len(names)).encode()
            vals["__keys__"] = json.dumps(list(names)).encode()
    return write_env(root / "lr.lmdb", lr_vals), write_env(root / "hr.lmdb", hr_vals), lr_arrays


def check_sr_sample(lr_src: np.ndarray, lr: np.ndarray, hr: np.ndarray) -> tuple[tuple[int, int], bool]:
    """The LR crop is a (possibly mirrored) 8×8 crop of its source and the HR
    crop is exactly it upscaled; returns (offset, mirrored)."""
    assert lr.shape == (8, 8, 3) and hr.shape == (32, 32, 3), (lr.shape, hr.shape)
    assert np.array_equal(hr, upscale4(lr)), "HR crop is not the LR crop repeated 4×: pairing is misaligned"
    plain = find_crops(lr_src, lr)
    flipped = find_crops(lr_src, lr, mirrored=True)
    assert plain or flipped, "LR crop is not a crop of its source image at any offset"
    return (plain or flipped)[0], not plain


SR_TRANSFORMS = {"lr": [{"random_crop": 8}, "hflip"], "hr": [{"random_crop": 32}, "hflip"]}


def test_paired_lr_hr_crops_align(stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path) -> None:
    n = 12
    names = [key(i) for i in range(n)]
    lr_env, hr_env, lr_src = make_sr_pair(tmp_path, names, metadata=True)
    idx = idx_env(tmp_path / "idx", n)
    spec = stoker.lmdb(
        {"lr": lr_env, "hr": hr_env, "idx": idx},
        fields={"lr": "png", "hr": "png", "idx": "npy"},
        transforms=SR_TRANSFORMS,
        pair={"hr": ("lr", 4)},
    )
    d = start_daemon()
    loader = stoker.Loader(spec, batch_size=5, seed=8, socket=d.socket)
    assert len(loader) == 3, "metadata keys (__len__, __keys__) must not be samples"
    offsets, flips = set(), Counter()
    for epoch in (0, 1):
        served = rows(run_epoch(loader, epoch))
        assert sorted(int(r["idx"]) for r in served) == list(range(n))
        for r in served:
            offset, mirrored = check_sr_sample(lr_src[key(int(r["idx"]))], r["lr"], r["hr"])
            offsets.add((int(r["idx"]), offset))
            flips[mirrored] += 1
    assert len(offsets) > n, "random crops do not vary"
    assert flips[True] and flips[False], f"flips: {flips}"


def test_paired_with_basicsr_meta_info(stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path) -> None:
    names = [f"{i:04d}" for i in range(1, 9)]  # BasicSR keys: 0001, 0002, ...
    lr_env, hr_env, lr_src = make_sr_pair(tmp_path, names, metadata=True)
    # BasicSR's meta_info.txt: "NAME.png (h,w,c) compression" per line; a
    # subset, in an order of its own, which the samples follow.
    listed = ["0005", "0002", "0008", "0001", "0007", "0003"]
    meta = tmp_path / "meta_info.txt"
    meta.write_text("".join(f"{k}.png ({lr_src[k].shape[0] * 4},{lr_src[k].shape[1] * 4},3) 1\n" for k in listed))
    spec = stoker.lmdb(
        {"lr": lr_env, "hr": hr_env},
        fields={"lr": "png", "hr": "png"},
        transforms=SR_TRANSFORMS,
        pair={"hr": ("lr", 4)},
        key_file=meta,
    )
    d = start_daemon()
    loader = stoker.Loader(spec, batch_size=4, shuffle=False, socket=d.socket)
    assert len(loader) == 2
    served = rows(run_epoch(loader, 0))
    assert len(served) == len(listed)
    for name, r in zip(listed, served):
        check_sr_sample(lr_src[name], r["lr"], r["hr"])
    # Without the key file: every key but the metadata ones, in key order.
    spec_all = stoker.lmdb(
        {"lr": lr_env, "hr": hr_env}, fields={"lr": "png", "hr": "png"}, transforms=SR_TRANSFORMS, pair={"hr": ("lr", 4)}
    )
    loader = stoker.Loader(spec_all, batch_size=4, shuffle=False, socket=d.socket)
    served = rows(run_epoch(loader, 0))
    assert len(served) == len(names)
    for name, r in zip(names, served):
        check_sr_sample(lr_src[name], r["lr"], r["hr"])


def test_pair_size_mismatch_fails(stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path) -> None:
    """An HR image that is not exactly 4× its LR image (a broken pair) fails
    naming the HR environment and the key, rather than serving misaligned crops."""
    names = [key(i) for i in range(8)]
    lr_vals = {k: png_of(noise(12, 12, 3, seed=i)) for i, k in enumerate(names)}
    hr_vals = {k: png_of(upscale4(noise(12, 12, 3, seed=i))) for i, k in enumerate(names)}
    hr_vals[key(5)] = png_of(noise(48, 52, 3, seed=5))
    lr_env, hr_env = write_env(tmp_path / "lr", lr_vals), write_env(tmp_path / "hr", hr_vals)
    spec = stoker.lmdb(
        {"lr": lr_env, "hr": hr_env}, fields={"lr": "png", "hr": "png"}, transforms=SR_TRANSFORMS, pair={"hr": ("lr", 4)}
    )
    d = start_daemon()
    loader = stoker.Loader(spec, batch_size=2, shuffle=False, socket=d.socket)
    with pytest.raises(stoker.DatasetError) as exc:
        run_epoch(loader, 0)
    assert_names(str(exc.value), realpaths(hr_env), key(5))
    assert d.alive()


# --------------------------------------------------------------------------
# 6. Ragged (variable-size) fields
# --------------------------------------------------------------------------


def test_ragged_images_are_zero_copy_lists(stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path) -> None:
    n = 11
    rgb, g16 = [], []
    for i in range(n):
        rgb.append(png_bytes(image_of(photo(8 + 3 * i % 17, 30 - i, 3, seed=i))))
        g16.append(png_bytes(Image.fromarray(photo(5 + i, 4 + 2 * i, 1, depth=16, seed=40 + i)[..., 0])))
    envs = {
        "rgb": write_env(tmp_path / "rgb", {key(i): v for i, v in enumerate(rgb)}),
        "g16": write_env(tmp_path / "g16", {key(i): v for i, v in enumerate(g16)}),
        "idx": idx_env(tmp_path / "idx", n),
    }
    d = start_daemon()
    spec = stoker.lmdb(envs, fields={"rgb": "png", "g16": "png", "idx": "npy"})
    loader = stoker.Loader(spec, batch_size=4, seed=5, socket=d.socket)
    seen = []
    for batch in loader:
        idx = np.asarray(batch["idx"]).tolist()
        seen += idx
        for name, vals in (("rgb", rgb), ("g16", g16)):
            arrs = batch[name]
            assert isinstance(arrs, list) and len(arrs) == len(idx), (name, type(arrs))
            for arr, i in zip(arrs, idx):
                assert_exact(f"{name}[{i}]", arr, pil_decode(vals[i]))
                assert arr.flags.writeable, f"{name}[{i}] is not writeable"
                mapping_check(loader, arr, f"{name}[{i}]")
        del batch, arrs, arr
    assert sorted(seen) == list(range(n))


# --------------------------------------------------------------------------
# 7. Transforms against numpy
# --------------------------------------------------------------------------

MEAN = [0.485, 0.456, 0.406]
STD = [0.229, 0.224, 0.225]


def test_deterministic_transforms_match_numpy(stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path) -> None:
    n, h, w = 7, 20, 24
    imgs = [noise(h, w, 3, seed=i) for i in range(n)]
    grays = [noise(h, w, 1, seed=50 + i) for i in range(n)]
    env = write_env(tmp_path / "rgb", {key(i): png_of(a) for i, a in enumerate(imgs)})
    genv = write_env(tmp_path / "gray", {key(i): png_of(a) for i, a in enumerate(grays)})
    crop = [{"center_crop": (11, 13)}]  # offsets (20-11)//2 = 4 and (24-13)//2 = 5
    transforms = {
        "cc": crop,
        "chw": crop + ["chw"],
        "f32": crop + [{"to_f32": 1 / 255}],
        "norm": crop + [{"to_f32": 1 / 255}, {"normalize": {"mean": MEAN, "std": STD}}, "chw"],
        "norm_u8": [{"normalize": {"mean": [123.675], "std": [58.395]}}],
        "gray_chw": crop + [{"to_f32": 1 / 255}, "chw"],
    }
    g16 = [photo(h, w, 1, depth=16, seed=90 + i) for i in range(n)]
    g16env = write_env(tmp_path / "g16", {key(i): png_of(a) for i, a in enumerate(g16)})
    transforms["g16_f32"] = crop + [{"to_f32": 1 / 65535}]
    envs = {k: env for k in ("cc", "chw", "f32", "norm", "norm_u8")}
    envs |= {"gray_chw": genv, "g16_f32": g16env, "idx": idx_env(tmp_path / "idx", n)}
    fields = {k: "png" for k in transforms} | {"idx": "npy"}
    d = start_daemon()
    loader = stoker.Loader(stoker.lmdb(envs, fields=fields, transforms=transforms), batch_size=3, seed=0, socket=d.socket)
    assert loader.fields["norm"] == (np.dtype(np.float32), (3, 11, 13))
    assert loader.fields["gray_chw"] == (np.dtype(np.float32), (1, 11, 13))
    scale = np.float32(1 / 255)
    seen = []
    for b in run_epoch(loader, 0):
        idx = b["idx"].tolist()
        seen += idx
        src = np.stack([imgs[i] for i in idx])
        cc = src[:, 4:15, 5:18]
        assert_exact("cc", b["cc"], cc)
        assert_exact("chw", b["chw"], cc.transpose(0, 3, 1, 2))
        # to_f32 alone is one float32 multiply per element: exact.
        assert_exact("f32", b["f32"], cc.astype(np.float32) * scale)
        gray = np.stack([grays[i] for i in idx])[:, 4:15, 5:18]
        assert_exact("gray_chw", b["gray_chw"], (gray.astype(np.float32) * scale).transpose(0, 3, 1, 2))
        g = np.stack([g16[i] for i in idx])[:, 4:15, 5:18]
        assert_exact("g16_f32", b["g16_f32"], g.astype(np.float32) * np.float32(1 / 65535))
        # to_f32 + normalize: the daemon folds scale, mean and std into one
        # float32 multiply-add per channel (coefficients computed in float64,
        # rounded once), so it differs from the step-by-step formula by a few
        # float32 ulps; the reference is that formula in float64, and 1e-6
        # relative (plus 1e-6 absolute, for values near zero) is ~10 ulps.
        mean, std = np.float32(MEAN).astype(np.float64), np.float32(STD).astype(np.float64)
        want = (cc.astype(np.float64) * np.float64(scale) - mean) / std
        served = b["norm"]
        assert served.dtype == np.float32 and served.shape == (len(idx), 3, 11, 13) and served.flags.c_contiguous
        np.testing.assert_allclose(served, want.transpose(0, 3, 1, 2), rtol=1e-6, atol=1e-6)
        # One mean/std broadcast to every channel, straight from uint8.
        want_u8 = (src.astype(np.float64) - np.float64(np.float32(123.675))) / np.float64(np.float32(58.395))
        assert b["norm_u8"].dtype == np.float32 and b["norm_u8"].shape == src.shape
        np.testing.assert_allclose(b["norm_u8"], want_u8, rtol=1e-6, atol=1e-6)
    assert sorted(seen) == list(range(n))


def test_resize_matches_pillow(stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path) -> None:
    """Resize fixes the shape of variable-size images; nearest is Pillow's
    exactly, the convolution filters within 1 (rounding of the fixed-point
    accumulation; the daemon's own test holds bilinear to the same bound).

    Sizes avoid exact nearest-neighbour ties (a destination pixel centre
    mapping exactly onto a source pixel edge, (2x + 1)·in / (2·out) an
    integer), where Pillow's choice depends on float rounding: no input
    width is a multiple of 8 (out 12) and no height a multiple of 32 (out 16).
    """
    n = 5
    imgs = [photo(14 + 3 * i, 21 - i, 3, seed=i) for i in range(n)]
    env = write_env(tmp_path / "img", {key(i): png_of(a) for i, a in enumerate(imgs)})
    filters = {
        "nearest": Image.Resampling.NEAREST,
        "bilinear": Image.Resampling.BILINEAR,
        "bicubic": Image.Resampling.BICUBIC,
        "lanczos3": Image.Resampling.LANCZOS,
    }
    size = (16, 12)
    transforms = {f: [{"resize": {"height": size[0], "width": size[1], "filter": f}}] for f in filters}
    envs = {f: env for f in filters} | {"idx": idx_env(tmp_path / "idx", n)}
    d = start_daemon()
    spec = stoker.lmdb(envs, fields={f: "png" for f in filters} | {"idx": "npy"}, transforms=transforms)
    loader = stoker.Loader(spec, batch_size=2, seed=1, socket=d.socket)
    for b in run_epoch(loader, 0):
        for f, pf in filters.items():
            assert isinstance(b[f], np.ndarray) and b[f].shape[1:] == (*size, 3), (f, type(b[f]))
            for j, i in enumerate(b["idx"].tolist()):
                want = np.asarray(Image.fromarray(imgs[i]).resize(size[::-1], pf))
                diff = np.abs(b[f][j].astype(np.int16) - want.astype(np.int16)).max()
                assert diff <= (0 if f == "nearest" else 1), f"{f}[{i}]: max abs diff {diff} from Pillow"


def crop_spec(stoker: Any, tmp_path: Path, n: int) -> tuple[Any, list[np.ndarray]]:
    imgs = [noise(16, 16, 3, seed=i) for i in range(n)]
    env = write_env(tmp_path / "img", {key(i): png_of(a) for i, a in enumerate(imgs)})
    flip_imgs = [noise(6, 10, 3, seed=100 + i) for i in range(n)]
    fenv = write_env(tmp_path / "flip", {key(i): png_of(a) for i, a in enumerate(flip_imgs)})
    spec = stoker.lmdb(
        {"rc": env, "hf": fenv, "fc": env, "idx": idx_env(tmp_path / "idx", n)},
        fields={"rc": "png", "hf": "png", "fc": "png", "idx": "npy"},
        transforms={"rc": [{"random_crop": (8, 9)}], "hf": ["hflip"], "fc": ["hflip", {"random_crop": (5, 7)}]},
    )
    return spec, imgs, flip_imgs


def by_idx(batches: Sequence[Batch], field: str) -> dict[int, bytes]:
    return {int(r["idx"]): r[field].tobytes() for r in rows(batches)}


def test_random_crop_and_flip(stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path) -> None:
    n = 24
    spec, imgs, flip_imgs = crop_spec(stoker, tmp_path, n)
    d = start_daemon()
    loader = stoker.Loader(spec, batch_size=5, seed=13, socket=d.socket)
    offsets, flips, flip_crop = Counter(), Counter(), Counter()
    for r in rows(run_epoch(loader, 0)):
        i = int(r["idx"])
        found = find_crops(imgs[i], r["rc"])
        assert found, f"sample {i}: the 8×9 crop is not a window of the image at any offset"
        assert all(0 <= t <= 8 and 0 <= left <= 7 for t, left in found)
        offsets[found[0]] += 1
        src = flip_imgs[i]
        plain, mirrored = np.array_equal(r["hf"], src), np.array_equal(r["hf"], src[:, ::-1])
        assert plain or mirrored, f"sample {i}: hflip served neither the image nor its mirror"
        flips[mirrored] += 1
        # Flip first, crop second: a crop of the mirrored image is a mirrored crop of the image.
        plain, mirrored = find_crops(imgs[i], r["fc"]), find_crops(imgs[i], r["fc"], mirrored=True)
        assert plain or mirrored, f"sample {i}: hflip + random_crop served neither a crop nor a mirrored crop"
        flip_crop[bool(mirrored) and not plain] += 1
    assert flip_crop[True] and flip_crop[False], f"hflip before random_crop: {flip_crop}"
    assert len(offsets) >= 5, f"random crop offsets barely vary over {n} samples: {offsets}"
    assert flips[True] >= 2 and flips[False] >= 2, f"flips: {flips}"


def test_random_transforms_are_deterministic(stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path) -> None:
    n = 20
    spec, _, _ = crop_spec(stoker, tmp_path, n)
    d = start_daemon()
    a = stoker.Loader(spec, batch_size=4, seed=21, socket=d.socket)
    b = stoker.Loader(spec, batch_size=4, seed=21, socket=d.socket)
    ea0, eb0 = run_epoch(a, 0), run_epoch(b, 0)
    assert len(ea0) == len(eb0) == 5
    for x, y in zip(ea0, eb0):
        for name in x:
            assert x[name].tobytes() == y[name].tobytes(), f"same (seed, epoch), different {name}"
    # Draws depend on (seed, epoch, index) only, not on batching or sharding.
    c = stoker.Loader(spec, batch_size=3, seed=21, rank=1, world_size=2, socket=d.socket)
    crops0 = by_idx(ea0, "rc")
    for idx, crop in by_idx(run_epoch(c, 0), "rc").items():
        assert crop == crops0[idx], f"sample {idx}: crop differs with another batch size / rank"
    # Another epoch (or seed): other crops and flips for the same samples.
    crops1 = by_idx(run_epoch(a, 1), "rc")
    assert sum(crops1[i] != crops0[i] for i in range(n)) >= n // 2, "epoch 1 repeats epoch 0's crops"
    assert by_idx(run_epoch(b, 1), "rc") == crops1
    flips0, flips1 = by_idx(ea0, "hf"), by_idx(run_epoch(a, 1), "hf")
    assert any(flips0[i] != flips1[i] for i in range(n)), "epoch 1 repeats epoch 0's flips"
    # Resuming mid-epoch from a state_dict repeats the rest of the epoch exactly.
    resumed = stoker.Loader(spec, batch_size=4, seed=21, socket=d.socket)
    resumed.load_state_dict({**a.state_dict(), "epoch": 0, "step": 2})
    resumed.set_epoch(0)
    rest = [copy_batch(x) for x in resumed]
    assert len(rest) == 3
    for x, y in zip(rest, ea0[2:]):
        for name in x:
            assert x[name].tobytes() == y[name].tobytes(), f"resumed at step 2: {name} differs"
    other = stoker.Loader(spec, batch_size=4, seed=22, socket=d.socket)
    crops_other = by_idx(run_epoch(other, 0), "rc")
    assert sum(crops_other[i] != crops0[i] for i in range(n)) >= n // 2, "seed 22 repeats seed 21's crops"


# --------------------------------------------------------------------------
# 8. Bad samples
# --------------------------------------------------------------------------


def corrupt_png(data: bytes) -> bytes:
    """Flips bytes in the middle of the IDAT data (the file keeps its length and chunk structure)."""
    at = data.index(b"IDAT") + 4
    length = int.from_bytes(data[at - 8 : at - 4], "big")
    mid = at + length // 2
    out = bytearray(data)
    for k in range(mid - 4, mid + 4):
        out[k] ^= 0xFF
    return bytes(out)


def truncate_jpeg(data: bytes) -> bytes:
    return data[: len(data) * 2 // 3]


def bad_datasets(tmp_path: Path, n: int) -> dict[str, Any]:
    """One environment per kind of bad value, each with one bad key among good ones:

    * `img`: PNG with flipped bytes in the middle of its image data (key 5);
    * `arr`: npy whose value lost its last 7 bytes (key 8);
    * `jpg`: JPEG cut after two thirds (key 6);
    * `size`: a valid PNG of another size than the rest (key 9: 17×16, not 16×16).
    """
    imgs = [noise(16, 16, 3, seed=i) for i in range(n)]
    pngs = [png_of(a) for a in imgs]
    bad_png = corrupt_png(pngs[5])
    with pytest.raises(Exception):  # noqa: B017 - however Pillow fails, it refuses it too
        Image.open(io.BytesIO(bad_png)).load()
    arrs = [np.random.default_rng(i).standard_normal((4, 5)).astype(np.float32) for i in range(n)]
    npys = [npy_bytes(a) for a in arrs]
    jpgs = [jpeg_bytes(image_of(photo(48, 64, 3, seed=i)), quality=90) for i in range(n)]
    # Cut inside the entropy-coded data (the headers are intact: probing at open succeeds).
    assert b"\xff\xda" in truncate_jpeg(jpgs[6])
    with pytest.raises(Exception):  # noqa: B017 - however Pillow fails, it refuses it too
        Image.open(io.BytesIO(truncate_jpeg(jpgs[6]))).load()
    odd = noise(17, 16, 3, seed=99)
    cases = {
        "img": ("png", {**dict(enumerate(pngs)), 5: bad_png}, 5, imgs),
        "arr": ("npy", {**dict(enumerate(npys)), 8: npys[8][:-7]}, 8, arrs),
        "jpg": ("jpeg", {**dict(enumerate(jpgs)), 6: truncate_jpeg(jpgs[6])}, 6, [pil_jpeg(j) for j in jpgs]),
        "size": ("png", {**dict(enumerate(pngs)), 9: png_of(odd)}, 9, imgs),
    }
    return {
        "cases": {
            field: (codec, write_env(tmp_path / field, {key(i): v for i, v in values.items()}), bad_key, ref)
            for field, (codec, values, bad_key, ref) in cases.items()
        },
        "idx_env": idx_env(tmp_path / "idx", n),
    }


def good_dataset(tmp_path: Path, n: int) -> tuple[Path, list[np.ndarray]]:
    arrs = [np.full((3, 3), i, dtype=np.int32) for i in range(n)]
    return write_env(tmp_path / "good", {key(i): npy_bytes(a) for i, a in enumerate(arrs)}), arrs


def assert_served(field: str, served: Any, want: Sequence[np.ndarray]) -> None:
    if field == "jpg":
        for j, w in enumerate(want):
            assert_jpeg_close(f"{field}[{j}]", served[j], w)
    else:
        assert_exact(field, served, np.stack(want))


def test_bad_values_fail_naming_env_key_codec(stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path) -> None:
    n = 12
    bad = bad_datasets(tmp_path, n)
    good_env, good_arrs = good_dataset(tmp_path, 40)
    d = start_daemon()
    good = stoker.Loader(stoker.lmdb(good_env, fields={"v": "npy"}), batch_size=2, shuffle=False, socket=d.socket)
    good.set_epoch(0)
    good_it = iter(good)
    good_rows = [np.array(next(good_it)["v"])]

    for field, (codec, env, bad_key, ref) in bad["cases"].items():
        spec = stoker.lmdb({field: env, "idx": bad["idx_env"]}, fields={field: codec, "idx": "npy"})
        loader = stoker.Loader(spec, batch_size=4, shuffle=False, socket=d.socket)
        delivered = 0
        with pytest.raises(stoker.DatasetError) as exc:
            for batch in loader:
                idx = np.asarray(batch["idx"]).tolist()
                assert idx == list(range(4 * delivered, 4 * delivered + 4))
                assert_served(field, batch[field], [ref[i] for i in idx])
                delivered += 1
                del batch
                good_rows.append(np.array(next(good_it)["v"]))
        # The batches before the bad one arrive; the bad one raises.
        assert delivered == bad_key // 4, f"{field}: {delivered} batches delivered before the bad key {bad_key}"
        assert_names(str(exc.value), realpaths(env), key(bad_key), codec)
        loader.close()
        assert d.alive(), f"the daemon died on a bad {codec} value"

    # The other stream was not disturbed: it finishes its epoch with correct data.
    good_rows += [np.array(b["v"]) for b in good_it]
    assert_exact("good", np.concatenate(good_rows), np.stack(good_arrs))
    assert d.alive()


def test_bad_values_skipped_and_counted(stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path) -> None:
    n = 12
    bad = bad_datasets(tmp_path, n)
    good_env, good_arrs = good_dataset(tmp_path, 12)
    d = start_daemon()
    good = stoker.Loader(stoker.lmdb(good_env, fields={"v": "npy"}), batch_size=3, shuffle=False, socket=d.socket)
    for field, (codec, env, bad_key, ref) in bad["cases"].items():
        spec = stoker.lmdb({field: env, "idx": bad["idx_env"]}, fields={field: codec, "idx": "npy"}, on_error="skip")
        loader = stoker.Loader(spec, batch_size=4, shuffle=False, socket=d.socket)
        for epoch in (0, 1):
            batches = run_epoch(loader, epoch)
            assert len(batches) == len(loader) == 3
            served = [int(r["idx"]) for r in rows(batches)]
            # The bad sample's place is taken by the next good one.
            assert served == [i if i != bad_key else bad_key + 1 for i in range(n)], f"{field}: {served}"
            for b in batches:
                assert_served(field, b[field], [ref[i] for i in b["idx"].tolist()])
            # Meanwhile, another stream on the same daemon gets correct data.
            got = np.concatenate([b["v"] for b in run_epoch(good, epoch)])
            assert_exact("good", got, np.stack(good_arrs))
        skipped = {s["dataset"]: s["skipped"] for s in d.status()["skipped"]}
        label = next((k for k in skipped if k in realpaths(env)), None)
        assert label is not None and skipped[label] >= 1, f"no skip count for {env} in status: {skipped}"
    assert d.alive()


def test_bad_value_among_probed_keys(stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path) -> None:
    """The first key's value is not a PNG at all: the layout is probed from the
    first keys, so "fail" refuses the dataset up front; "skip" serves it."""
    n = 10
    imgs = [noise(8, 8, 3, seed=i) for i in range(n)]
    env = write_env(tmp_path / "img", {key(0): b"not a png"} | {key(i): png_of(imgs[i]) for i in range(1, n)})
    envs = {"img": env, "idx": idx_env(tmp_path / "idx", n)}
    d = start_daemon()
    with pytest.raises(stoker.DatasetError) as exc:
        stoker.Loader(stoker.lmdb(envs, fields={"img": "png", "idx": "npy"}), batch_size=4, socket=d.socket)
    assert_names(str(exc.value), realpaths(env), key(0), "png")
    spec = stoker.lmdb(envs, fields={"img": "png", "idx": "npy"}, on_error="skip")
    loader = stoker.Loader(spec, batch_size=4, shuffle=False, socket=d.socket)
    served = rows(run_epoch(loader, 0))
    assert [int(r["idx"]) for r in served] == [1] + list(range(1, n))
    for r in served:
        assert_exact("img", r["img"], imgs[int(r["idx"])])
    assert any(s["skipped"] >= 1 for s in d.status()["skipped"])


def test_ragged_values_larger_than_their_room_get_a_slot_of_their_own(
    stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path
) -> None:
    """A variable-size value larger than the room reserved per sample is
    served exactly (its batch is produced again in a segment sized for it),
    whatever room was guessed; only [limits] max_sample_bytes, the safety
    limit, refuses it, naming the key and the limit."""
    n = 10
    imgs = [noise(6 + i % 3, 8 + i % 4, 3, seed=i) for i in range(n)]
    imgs[9] = noise(30, 40, 3, seed=9)  # 3600 bytes; the others at most 8 × 11 × 3 = 264
    env = write_env(tmp_path / "img", {key(i): png_of(a) for i, a in enumerate(imgs)})
    d = start_daemon()
    for room in ({"img": 300}, {"img": 3600}, None):
        spec = stoker.lmdb(env, fields={"img": "png"}, max_sample_bytes=room)
        loader = stoker.Loader(spec, batch_size=4, shuffle=False, socket=d.socket)
        for epoch in range(2):
            served = [a for b in run_epoch(loader, epoch) for a in b["img"]]
            assert len(served) == n
            for i, a in enumerate(served):
                assert_exact(f"img[{i}]", a, imgs[i])
        loader.close()
    limited = start_daemon(extra="[limits]\nmax_sample_bytes = 2000\n")
    spec = stoker.lmdb(env, fields={"img": "png"}, max_sample_bytes={"img": 300})
    small = stoker.Loader(spec, batch_size=4, shuffle=False, socket=limited.socket)
    with pytest.raises(stoker.DatasetError) as exc:
        run_epoch(small, 0)
    assert_names(str(exc.value), realpaths(env), key(9), "max_sample_bytes")


def test_key_selection(stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path) -> None:
    """key_prefix and key_regex pick samples; metadata keys are skipped by
    default; binary (non-UTF-8) keys work and sort bytewise."""
    values = {f"train/{i:04d}": np.int64(i) for i in range(7)}
    values |= {f"val/{i:04d}": np.int64(100 + i) for i in range(3)}
    metadata = {"__len__": b"10", "length": b"10", "keys": b"[]"}
    env = write_env(tmp_path / "split", {k: npy_bytes(v) for k, v in values.items()} | metadata)
    binary = write_env(tmp_path / "binary", {i.to_bytes(4, "big"): npy_bytes(np.int64(i)) for i in (0, 1, 255, 256, 70000)})
    d = start_daemon()

    def served(spec: Any) -> list[int]:
        loader = stoker.Loader(spec, batch_size=3, shuffle=False, socket=d.socket)
        return [int(v) for b in run_epoch(loader, 0) for v in b["v"]]

    assert served(stoker.lmdb(env, fields={"v": "npy"})) == list(range(7)) + [100, 101, 102]
    assert served(stoker.lmdb(env, fields={"v": "npy"}, key_prefix="train/")) == list(range(7))
    assert served(stoker.lmdb(env, fields={"v": "npy"}, key_regex=r"^val/000[02]$")) == [100, 102]
    assert served(stoker.lmdb(binary, fields={"v": "npy"})) == [0, 1, 255, 256, 70000]
    with pytest.raises(stoker.DatasetError) as exc:
        stoker.Loader(stoker.lmdb(env, fields={"v": "npy"}, key_prefix="test/"), batch_size=3, socket=d.socket)
    assert_names(str(exc.value), realpaths(env))


# --------------------------------------------------------------------------
# 9. Ranks in separate processes
# --------------------------------------------------------------------------

RANK_SRC = r"""
import json, sys
import numpy as np
import stoker

args = json.loads(sys.argv[1])
ref = np.load(args["ref"])
spec = stoker.lmdb(args["envs"], fields={"img": "png", "idx": "npy"})
loader = stoker.Loader(spec, **args["loader"])
out = {"len": len(loader), "epochs": {}, "errors": []}
for epoch in args["epochs"]:
    loader.set_epoch(epoch)
    order = []
    for batch in loader:
        idx = np.asarray(batch["idx"]).tolist()
        img = batch["img"]
        if img.dtype != ref.dtype or img.shape[1:] != ref.shape[1:] or img.tobytes() != ref[idx].tobytes():
            out["errors"].append(f"epoch {epoch}: batch {len(order)} differs from Pillow for samples {idx}")
        order.append(idx)
        del batch, img
    out["epochs"][str(epoch)] = order
loader.close()
with open(args["out"], "w") as f:
    json.dump(out, f)
"""


def test_ranks_in_processes_cover_every_key(stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path) -> None:
    n, world, batch = 50, 3, 4
    imgs = [photo(16, 16, 3, seed=i) for i in range(n)]
    pngs = [png_of(a) for a in imgs]
    envs = {
        "img": str(write_env(tmp_path / "img", {key(i): v for i, v in enumerate(pngs)})),
        "idx": str(idx_env(tmp_path / "idx", n)),
    }
    ref = tmp_path / "ref.npy"
    np.save(ref, np.stack([pil_decode(p) for p in pngs]))
    d = start_daemon(threads=2)
    procs = []
    for rank in range(world):
        args = {
            "envs": envs,
            "ref": str(ref),
            "loader": {"batch_size": batch, "seed": 17, "rank": rank, "world_size": world, "socket": d.socket},
            "epochs": [0, 1],
            "out": str(tmp_path / f"rank{rank}.json"),
        }
        cmd = [sys.executable, "-c", RANK_SRC, json.dumps(args)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for rank, p in enumerate(procs):
        try:
            stdout, stderr = p.communicate(timeout=SUBPROCESS_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"rank {rank} hung")
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}\n{stderr}"
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert not res["errors"], f"rank {rank}: " + "\n".join(res["errors"][:10])
        results.append(res)
    per_rank = -(-n // world)  # 17: padded to 51 samples, one repeated
    assert all(r["len"] == -(-per_rank // batch) for r in results)
    orders = {}
    for epoch in ("0", "1"):
        flat = [sum(r["epochs"][epoch], []) for r in results]
        assert all(len(f) == per_rank for f in flat), [len(f) for f in flat]
        counts = Counter(i for f in flat for i in f)
        assert set(counts) == set(range(n)), f"epoch {epoch}: keys never served: {set(range(n)) - set(counts)}"
        assert sorted(counts.values()) == [1] * (n - 1) + [2], f"epoch {epoch}: {counts.most_common(3)}"
        # Padding wraps around: the 51st position (rank 2's last) repeats the first (rank 0's first).
        assert flat[2][-1] == flat[0][0]
        orders[epoch] = [i for pos in zip(*flat) for i in pos]
    assert orders["0"] != orders["1"], "epochs 0 and 1 have the same order"
    assert d.alive()


# --------------------------------------------------------------------------
# 10. A named LMDB dataset from the config
# --------------------------------------------------------------------------


def test_named_dataset_from_config(stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path) -> None:
    names = [f"{i:04d}" for i in range(1, 11)]
    lr_env, hr_env, lr_src = make_sr_pair(tmp_path, names, metadata=True)
    config = textwrap.dedent(
        f"""
        [datasets.div2k]
        format = "lmdb"
        on_error = "fail"

        [[datasets.div2k.fields]]
        name = "lr"
        env = {json.dumps(str(lr_env))}
        codec = "png"
        transforms = [{{ random_crop = {{ height = 8, width = 8 }} }}, "hflip"]

        [[datasets.div2k.fields]]
        name = "hr"
        env = {json.dumps(str(hr_env))}
        codec = "png"
        transforms = [
            {{ random_crop = {{ height = 32, width = 32 }} }},
            "hflip",
            {{ to_f32 = {{ scale = 0.0039215686 }} }},
            "chw",
        ]
        pair = {{ with = "lr", scale = 4 }}
        """
    )
    # Named datasets need no allowed_roots: this daemon serves only its config's datasets.
    d = start_daemon(allowed_roots=[], extra=config)
    listing = d.cli("datasets").stdout
    assert "div2k" in listing and "lmdb" in listing, listing
    with pytest.raises(stoker.AccessDenied):
        stoker.Loader(stoker.lmdb(lr_env, fields={"lr": "png"}), batch_size=2, socket=d.socket)

    loader = stoker.Loader("div2k", batch_size=4, shuffle=False, socket=d.socket)
    assert len(loader) == 3
    assert loader.fields == {"lr": (np.dtype(np.uint8), (8, 8, 3)), "hr": (np.dtype(np.float32), (3, 32, 32))}
    scale = np.float32(0.0039215686)
    served = rows(run_epoch(loader, 0))
    assert len(served) == len(names)
    for name, r in zip(names, served):
        want_hr = (upscale4(r["lr"]).astype(np.float32) * scale).transpose(2, 0, 1)
        assert_exact(f"hr[{name}]", r["hr"], want_hr)
        check_sr_sample(lr_src[name], r["lr"], upscale4(r["lr"]))


# --------------------------------------------------------------------------
# 11. Joined environments must share keys; ad-hoc paths must be allowed
# --------------------------------------------------------------------------


def test_key_missing_from_joined_env(stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path) -> None:
    n = 10
    a = write_env(tmp_path / "a", {key(i): npy_bytes(np.int64(i)) for i in range(n)})
    b = write_env(tmp_path / "b", {key(i): npy_bytes(np.int64(i)) for i in range(n) if i != 4})
    d = start_daemon()
    with pytest.raises(stoker.DatasetError) as exc:
        stoker.Loader(stoker.lmdb({"x": a, "y": b}, fields={"x": "npy", "y": "npy"}), batch_size=2, socket=d.socket)
    assert_names(str(exc.value), realpaths(b), key(4))
    # The first field's environment lists the samples: extra keys elsewhere are fine.
    spec = stoker.lmdb({"y": b, "x": a}, fields={"y": "npy", "x": "npy"})
    loader = stoker.Loader(spec, batch_size=3, shuffle=False, socket=d.socket)
    served = rows(run_epoch(loader, 0))
    assert [int(r["x"]) for r in served] == [i for i in range(n) if i != 4]
    assert all(int(r["x"]) == int(r["y"]) for r in served)
    assert d.alive()


def test_env_outside_allowed_roots_is_refused(stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path) -> None:
    inside = tmp_path / "inside"
    inside.mkdir()
    env = write_env(tmp_path / "outside", {key(0): npy_bytes(np.int64(0))})
    d = start_daemon(allowed_roots=[inside])
    with pytest.raises(stoker.AccessDenied):
        stoker.Loader(stoker.lmdb(env, fields={"x": "npy"}), batch_size=1, socket=d.socket)


def test_jpeg_shrink_decodes_dct_scaled_like_pillow_draft(
    stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path
) -> None:
    """A JPEG field whose first transform shrinks it to at most half its size
    is decoded scaled in the DCT domain (libjpeg-turbo 1/2, 1/4, 1/8: the
    smallest scale still at least the target), then resized the rest of the
    way: what Pillow does after `Image.draft("RGB", size)`. The scaled decode
    equals Pillow's draft exactly, so the result is within the resize's own
    rounding (1) of Pillow's draft + resize; against a full decode + resize it
    differs by the scaled IDCT's lower precision (checked to stay small)."""
    n = 4
    imgs = [photo(256, 200 + 8 * i, 3, seed=i) for i in range(n)]
    jpegs = [jpeg_bytes(image_of(a), quality=90) for a in imgs]
    env = write_env(tmp_path / "img", {key(i): v for i, v in enumerate(jpegs)})
    # 1/4 scale for 64×48 (256→64 rows); 1/2 for 100×90; whole (no draft) for 150×130.
    sizes = {"q": (64, 48), "h": (100, 90), "w": (150, 130)}
    transforms = {f: [{"resize": {"height": s[0], "width": s[1], "filter": "bilinear"}}] for f, s in sizes.items()}
    envs = {f: env for f in sizes} | {"idx": idx_env(tmp_path / "idx", n)}
    d = start_daemon()
    spec = stoker.lmdb(envs, fields={f: "jpeg" for f in sizes} | {"idx": "npy"}, transforms=transforms)
    loader = stoker.Loader(spec, batch_size=2, seed=1, socket=d.socket)
    seen = 0
    for b in run_epoch(loader, 0):
        for f, (h, w) in sizes.items():
            for j, i in enumerate(b["idx"].tolist()):
                got = b[f][j].astype(np.int16)
                drafted = Image.open(io.BytesIO(jpegs[i]))
                drafted.draft("RGB", (w, h))
                want = np.asarray(drafted.convert("RGB").resize((w, h), Image.Resampling.BILINEAR))
                assert np.abs(got - want).max() <= 1, (f, i, np.abs(got - want).max())
                full = np.asarray(Image.open(io.BytesIO(jpegs[i])).convert("RGB").resize((w, h), Image.Resampling.BILINEAR))
                diff = np.abs(got - full.astype(np.int16))
                if f == "w":
                    assert diff.max() <= 1, (f, i, diff.max())
                else:  # a scaled decode is not a full decode + resize, but close to it
                    assert diff.mean() < 2.0 and diff.max() <= 40, (f, i, diff.mean(), diff.max())
                seen += 1
    assert seen == n * len(sizes)


def test_jpeg_leading_crop_decodes_only_the_window_like_pillow_and_numpy(
    stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path
) -> None:
    """A JPEG field whose chain starts with a crop decodes only the crop's
    window (libjpeg-turbo's jpeg_crop_scanline / jpeg_skip_scanlines). The
    served pixels equal Pillow's full decode cropped with numpy (4:4:4,
    4:2:2, 4:2:0 and progressive files), at offsets drawn as the transform
    draws them; the steps after the crop draw what they would after a crop of
    the full decode: a second loader with the same seed, field name and crop
    but more steps serves the same windows, flipped or not, normalized."""
    n = 16
    variants: list[dict[str, Any]] = [{"quality": 90, "subsampling": s} for s in (0, 1, 2)]
    variants.append({"quality": 85, "progressive": True})
    imgs = [noise(72 + 8 * (i % 3), 96 + 4 * (i % 4), 3, seed=i) for i in range(n)]
    jpegs = [jpeg_bytes(image_of(a), **variants[i % len(variants)]) for i, a in enumerate(imgs)]
    full = [pil_jpeg(j) for j in jpegs]
    env = write_env(tmp_path / "img", {key(i): v for i, v in enumerate(jpegs)})
    envs = {"im": env, "cc": env, "idx": idx_env(tmp_path / "idx", n)}
    d = start_daemon()

    def serve(transforms: dict[str, list[Any]]) -> list[dict[str, Any]]:
        spec = stoker.lmdb(envs, fields={"im": "jpeg", "cc": "jpeg", "idx": "npy"}, transforms=transforms)
        return rows(run_epoch(stoker.Loader(spec, batch_size=4, seed=5, socket=d.socket), 3))

    crop = {"random_crop": (24, 40)}
    plain = serve({"im": [crop], "cc": [{"center_crop": 40}]})
    windows: dict[int, np.ndarray] = {}
    offsets = Counter()
    for r in plain:
        i = int(r["idx"])
        found = find_crops(full[i], r["im"])
        assert len(found) == 1, f"sample {i}: the 24×40 crop is {len(found)} windows of Pillow's decode, not one"
        offsets[found[0]] += 1
        windows[i] = r["im"]
        h, w = full[i].shape[:2]
        t, left = (h - 40) // 2, (w - 40) // 2
        assert_exact(f"cc[{i}]", r["cc"], full[i][t : t + 40, left : left + 40])
    assert sorted(windows) == list(range(n))
    assert len(offsets) >= n // 2, f"random crop offsets barely vary: {offsets}"

    aug = serve({"im": [crop, "hflip", {"to_f32": 1 / 255}, {"normalize": {"mean": MEAN, "std": STD}}, "chw"],
                 "cc": [{"center_crop": 40}, "vflip"]})
    mean, std = np.float32(MEAN).astype(np.float64), np.float32(STD).astype(np.float64)
    flips, vflips = Counter(), Counter()
    for r in aug:
        i = int(r["idx"])
        assert r["im"].dtype == np.float32 and r["im"].shape == (3, 24, 40)
        outcomes = []
        for mirrored in (False, True):
            src = windows[i][:, ::-1] if mirrored else windows[i]
            want = ((src.astype(np.float64) * np.float64(np.float32(1 / 255)) - mean) / std).transpose(2, 0, 1)
            outcomes.append(np.allclose(r["im"], want, rtol=1e-6, atol=1e-6))
        assert any(outcomes), f"sample {i}: neither the window nor its mirror, normalized"
        flips[outcomes[1]] += 1
        h, w = full[i].shape[:2]
        t, left = (h - 40) // 2, (w - 40) // 2
        cc = full[i][t : t + 40, left : left + 40]
        up, down = np.array_equal(r["cc"], cc), np.array_equal(r["cc"], cc[::-1])
        assert up or down, f"sample {i}: vflip after center_crop served neither the crop nor its mirror"
        vflips[down] += 1
    assert flips[True] >= 2 and flips[False] >= 2, f"hflips: {flips}"
    assert vflips[True] >= 2 and vflips[False] >= 2, f"vflips: {vflips}"
