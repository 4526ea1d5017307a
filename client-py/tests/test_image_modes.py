"""Image modes and dtypes: a folder (LMDB environment) of PNGs mixing 1-bit,
gray, gray + alpha, palette (with and without transparency), RGB (with and
without a tRNS colour), RGBA and 16-bit images comes out uniform with
`{"codec": "png", "mode": ...}`, byte-exact to
`np.asarray(Image.open(f).convert(mode))`, and so does a folder of JPEGs
mixing gray, subsampled, progressive and CMYK ones; `dtype` rescales as documented in
`crates/decode/src/codec/mode.rs` (uint16: × 257 for 8-bit sources, full precision
for 16-bit ones; float32: / 255 or / 65535).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from PIL import Image

from conftest import assert_names
from lmdb_data import hand_png, key, noise, png_bytes, write_env

H, W = 9, 11


def mixed_pngs() -> list[bytes]:
    """One PNG of each kind Pillow opens differently, all H × W."""
    rgb = noise(H, W, 3, seed=1)
    rgba = noise(H, W, 4, seed=2)
    gray = noise(H, W, 1, seed=3)[..., 0]
    la = noise(H, W, 2, seed=4)
    pal = Image.fromarray(rgb).quantize(colors=16)
    pal_t = pal.copy()
    pal_t.info["transparency"] = 3
    rgb_key = rgb.copy()
    rgb_key[1, 1] = rgb_key[0, 0]
    gray16 = noise(H, W, 1, seed=5, dtype=np.uint16)
    gray16[0, :4, 0] = [0, 255, 256, 65535]
    out = [
        png_bytes(Image.fromarray(gray)),
        png_bytes(Image.fromarray(gray > 128)),  # mode "1"
        png_bytes(Image.fromarray(la, "LA")),
        png_bytes(Image.fromarray(rgb)),
        png_bytes(Image.fromarray(rgb_key), transparency=tuple(int(v) for v in rgb_key[0, 0])),
        png_bytes(Image.fromarray(rgba)),
        png_bytes(pal),
        png_bytes(pal_t, transparency=3),
        hand_png(gray16, depth=16),  # Pillow: "I;16"
        hand_png(noise(H, W, 3, seed=6, dtype=np.uint16), depth=16),
        hand_png(noise(H, W, 4, seed=7, dtype=np.uint16), depth=16),
        hand_png(noise(H, W, 2, seed=8, dtype=np.uint16), depth=16),
    ]
    modes = [Image.open(io.BytesIO(p)).mode for p in out]
    assert {"1", "L", "LA", "RGB", "RGBA", "P", "I;16"} <= set(modes), modes
    return out


def serve(stoker: Any, d: Any, env: Path, field: Any) -> np.ndarray:
    loader = stoker.Loader(stoker.lmdb(env, fields={"img": field}), batch_size=64, shuffle=False, socket=d.socket)
    loader.set_epoch(0)
    (batch,) = [np.array(b["img"]) for b in loader]
    return batch


def test_mixed_folder_without_mode_is_refused_with_the_remedy(
    stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path
) -> None:
    env = write_env(tmp_path / "mixed", {key(i): p for i, p in enumerate(mixed_pngs())})
    d = start_daemon()
    with pytest.raises(stoker.StokerError) as e:
        serve(stoker, d, env, "png")
    assert_names(str(e.value), "dtype")


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "float32"])
def test_dtype_of_8bit_images(stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path, dtype: str) -> None:
    pngs = [p for p in mixed_pngs() if Image.open(io.BytesIO(p)).mode != "I;16"][:8]
    env = write_env(tmp_path / "mixed", {key(i): p for i, p in enumerate(pngs)})
    d = start_daemon()
    got = serve(stoker, d, env, {"codec": "png", "mode": "RGB", "dtype": dtype})
    rgb = np.stack([np.asarray(Image.open(io.BytesIO(p)).convert("RGB")) for p in pngs])
    want = {
        "uint8": rgb,
        "uint16": rgb.astype(np.uint16) * 257,
        # torchvision's ToTensor(): x / 255 in float32.
        "float32": rgb.astype(np.float32) / np.float32(255),
    }[dtype]
    assert got.dtype == want.dtype and np.array_equal(got, want)


def test_16bit_keeps_full_precision_for_uint16_and_float32(
    stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path
) -> None:
    gray = noise(H, W, 1, seed=11, dtype=np.uint16)
    rgb = noise(H, W, 3, seed=12, dtype=np.uint16)
    env_g = write_env(tmp_path / "g16", {key(0): hand_png(gray, depth=16)})
    env_c = write_env(tmp_path / "c16", {key(0): hand_png(rgb, depth=16)})
    d = start_daemon()
    assert np.array_equal(serve(stoker, d, env_g, {"codec": "png", "mode": "RGB", "dtype": "uint16"})[0],
                          np.repeat(gray, 3, axis=-1))
    got = serve(stoker, d, env_g, {"codec": "png", "dtype": "float32"})[0]
    assert got.dtype == np.float32 and np.array_equal(got, gray.astype(np.float32) / np.float32(65535))
    # 16-bit RGB to L in 16 bits: Pillow's luma weights and rounding on 16-bit samples.
    r, g, b = (rgb[..., k].astype(np.uint64) for k in range(3))
    luma = ((r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16).astype(np.uint16)[..., None]
    assert np.array_equal(serve(stoker, d, env_c, {"codec": "png", "mode": "L", "dtype": "uint16"})[0], luma)
    # uint8 from 16-bit RGB keeps the high byte, as Pillow opens it.
    assert np.array_equal(serve(stoker, d, env_c, {"codec": "png", "mode": "RGB"})[0], (rgb >> 8).astype(np.uint8))


def test_mode_in_config_table(stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path) -> None:
    pngs = mixed_pngs()
    env = write_env(tmp_path / "mixed", {key(i): p for i, p in enumerate(pngs)})
    extra = f"""
[datasets.photos]
format = "lmdb"
fields = [{{ name = "img", env = "{env}", codec = "png", mode = "RGBA", dtype = "uint8" }}]
"""
    d = start_daemon(extra=extra)
    loader = stoker.Loader("photos", batch_size=64, shuffle=False, socket=d.socket)
    loader.set_epoch(0)
    (got,) = [np.array(b["img"]) for b in loader]
    want = np.stack([np.asarray(Image.open(io.BytesIO(p)).convert("RGBA")) for p in pngs])
    assert np.array_equal(got, want)


@pytest.mark.parametrize(
    "field, needles",
    [
        ({"codec": "png", "mode": "rgb"}, ("rgb", '"RGB"')),
        ({"codec": "png", "dtype": "int8"}, ("int8", "float32")),
        ({"codec": "npy", "mode": "RGB"}, ("mode", "png")),
    ],
)
def test_bad_modes_are_refused_naming_the_choices(
    stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path, field: Any, needles: tuple[str, ...]
) -> None:
    env = write_env(tmp_path / "one", {key(0): png_bytes(Image.new("RGB", (4, 4)))})
    d = start_daemon()
    with pytest.raises(stoker.StokerError) as e:
        serve(stoker, d, env, field)
    assert_names(str(e.value), *needles)


def mixed_jpegs() -> list[bytes]:
    """JPEGs of each kind libjpeg decodes differently, all H × W: gray, RGB at
    4:4:4, 4:2:2 and 4:2:0, progressive, and CMYK (Pillow writes Adobe's
    inverted CMYK)."""
    rgb = Image.fromarray(noise(H, W, 3, seed=11))

    def jpeg(im: Image.Image, **kw: Any) -> bytes:
        out = io.BytesIO()
        im.save(out, "JPEG", quality=90, **kw)
        return out.getvalue()

    out = [
        jpeg(rgb.convert("L")),
        jpeg(rgb, subsampling=0),
        jpeg(rgb, subsampling=1),
        jpeg(rgb, subsampling=2),
        jpeg(rgb, progressive=True),
        jpeg(rgb.convert("CMYK")),
    ]
    modes = [Image.open(io.BytesIO(j)).mode for j in out]
    assert {"L", "RGB", "CMYK"} <= set(modes), modes
    return out


@pytest.mark.parametrize("mode", ["L", "RGB", "RGBA"])
@pytest.mark.parametrize("codec", ["png", "jpeg"])
def test_mixed_folder_equals_pillow_convert(
    stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path, codec: str, mode: str
) -> None:
    images = mixed_pngs() if codec == "png" else mixed_jpegs()
    env = write_env(tmp_path / "mixed", {key(i): p for i, p in enumerate(images)})
    d = start_daemon()
    got = serve(stoker, d, env, {"codec": codec, "mode": mode})
    want = np.stack([np.asarray(Image.open(io.BytesIO(p)).convert(mode)) for p in images])
    if mode == "L":
        want = want[..., None]
    assert got.dtype == np.uint8 and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    for i, (g, w) in enumerate(zip(got, want)):
        assert np.array_equal(g, w), f"image {i} ({Image.open(io.BytesIO(images[i])).mode}) differs from Pillow"
    if codec == "png":
        return
    # A CMYK JPEG alone, unchanged, is RGB as Pillow converts it.
    env = write_env(tmp_path / "cmyk", {key(0): images[-1]})
    got = serve(stoker, d, env, {"codec": "jpeg", "mode": "unchanged"})
    assert np.array_equal(got[0], np.asarray(Image.open(io.BytesIO(images[-1])).convert("RGB")))
