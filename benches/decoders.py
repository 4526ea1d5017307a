#!/usr/bin/env python3
"""Single-threaded decode time per image: libjpeg-turbo vs zune-jpeg, zune-png vs png.

Writes 64 synthetic photo-like 256×256 images (the generator of
benches/lmdb_jpeg.py) as quality-90 JPEGs (Pillow, 4:2:0) and as PNGs
(Pillow, default compression): 8-bit RGB, 16-bit RGB and 8-bit palette
(256 colours), then runs `cargo run --release --example decode_bench` over
them (20 passes; median and mean µs per image, one thread) and times Pillow
decoding the same files (`np.asarray(Image.open(...))`) for reference.

    python benches/decoders.py            # prints a markdown table
"""

from __future__ import annotations

import io
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import REPO  # noqa: E402
from lmdb_jpeg import synthetic_photo  # noqa: E402

N = 64
ROUNDS = 20


def write_images(d: Path) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(N):
        rgb = synthetic_photo(rng)
        Image.fromarray(rgb).save(d / f"jpeg_{i:03d}.jpg", quality=90)
        Image.fromarray(rgb).save(d / f"png_rgb8_{i:03d}.png")
        # 16-bit: the 8-bit photo widened with fine detail in the low byte.
        rgb16 = rgb.astype(np.uint16) * 257 + rng.integers(0, 64, rgb.shape, dtype=np.uint16)
        write_png16(d / f"png_rgb16_{i:03d}.png", rgb16)
        Image.fromarray(rgb).quantize(256).save(d / f"png_palette_{i:03d}.png")


def write_png16(path: Path, a: np.ndarray) -> None:
    """A 16-bit RGB PNG by hand (Pillow writes no 16-bit RGB), zlib level 6 like Pillow."""
    import struct
    import zlib

    h, w, _ = a.shape
    rows = b"".join(b"\0" + a[y].astype(">u2").tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(rows, 6)) + chunk(b"IEND", b""))


def pillow_us(files: list[Path]) -> float:
    from PIL import Image

    data = [f.read_bytes() for f in files]
    for v in data:
        np.asarray(Image.open(io.BytesIO(v)).convert("RGB") if v[:2] == b"\xff\xd8" else Image.open(io.BytesIO(v)))
    times = []
    for _ in range(ROUNDS):
        for v in data:
            t = time.perf_counter()
            im = Image.open(io.BytesIO(v))
            if im.mode == "P":
                im = im.convert("RGB")
            np.asarray(im)
            times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def main() -> int:
    subprocess.run(
        ["cargo", "build", "--release", "-q", "-p", "stoker-daemon", "--example", "decode_bench"], cwd=REPO, check=True
    )
    with tempfile.TemporaryDirectory(prefix="stk-decoders-") as tmp:
        d = Path(tmp)
        write_images(d)
        out = subprocess.run(
            [str(REPO / "target/release/examples/decode_bench"), str(d), str(ROUNDS)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        rows = [line.split("\t") for line in out.strip().splitlines()[1:]]
        sizes = {g: statistics.mean(f.stat().st_size for f in d.glob(f"{g}_*")) for g in ("jpeg", "png_rgb8", "png_rgb16", "png_palette")}
        pil = {g: pillow_us(sorted(d.glob(f"{g}_*"))) for g in sizes}
    print("| images (256×256) | avg file | decoder | median µs/image | mean µs/image |")
    print("| --- | ---: | --- | ---: | ---: |")
    for group, decoder, median, mean, _ in rows:
        print(f"| {group} | {sizes[group] / 1e3:.1f} KB | {decoder} | {float(median):.0f} | {float(mean):.0f} |")
    for group, us in pil.items():
        print(f"| {group} | {sizes[group] / 1e3:.1f} KB | Pillow (reference, incl. Python overhead) | {us:.0f} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
