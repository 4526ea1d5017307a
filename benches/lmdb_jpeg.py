#!/usr/bin/env python3
"""Images/s of an ImageNet-style JPEG pipeline from an LMDB environment.

Pipeline per image: decode a 256×256 JPEG (quality 90) → random crop 224×224
→ random horizontal flip → float32 × 1/255 → normalize (ImageNet mean/std) →
CHW; batches of 64, one shuffled epoch per pass. Compared in one run, on the
same page-cached environment:

* stoker with 1 and with 2 worker threads (a fresh daemon per setting,
  ``[workers] threads = N``), the whole pipeline in the daemon, batches read
  zero-copy from shared memory;
* Pillow + numpy in a 2-process ``multiprocessing`` pool, as PyTorch
  DataLoader workers would run it: each worker opens the LMDB once, and per
  batch reads each value, ``Image.open`` → ``np.asarray`` → crop → flip →
  float32/normalize → transpose, stacks the batch (collate) and returns it,
  pickled back to the parent through a pipe;
* the same pool returning nothing (decode and transform cost alone, the
  ceiling for any way of moving the batches back);
* a torch ``DataLoader`` with 1, 2 and 3 persistent workers running the same
  Pillow + numpy pipeline per image (default collate, tensors through
  shared memory).

Reported: median of --passes epochs per setting, images/s, and the ratio to
the Pillow pool.

    python benches/lmdb_jpeg.py           # 2000 images, writes docs/performance-lmdb.md
    python benches/lmdb_jpeg.py --quick   # 256 images, one pass, prints only
"""

from __future__ import annotations

import argparse
import io
import multiprocessing as mp
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import REPO, Daemon, machine_info, stoker_bin, warm_page_cache  # noqa: E402

SIDE = 256
CROP = 224
QUALITY = 90
BATCH = 64
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
DEFAULT_N = 2000
DEFAULT_PASSES = 3


# --------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------


def synthetic_photo(rng: np.random.Generator) -> np.ndarray:
    """256×256 RGB with photo-like statistics: smooth colour gradients, a few
    soft-edged blobs and stripes, fine texture and sensor-like noise (about
    25 KB as a quality-90 JPEG, like a photo resized to this size), not
    uniform noise, which no JPEG pipeline sees."""
    y, x = np.mgrid[0:SIDE, 0:SIDE].astype(np.float32) / SIDE
    img = np.empty((SIDE, SIDE, 3), np.float32)
    base = rng.uniform(0.2, 0.8, 3)
    gx, gy = rng.uniform(-0.4, 0.4, (2, 3))
    for c in range(3):
        img[..., c] = base[c] + gx[c] * x + gy[c] * y
    for _ in range(rng.integers(3, 7)):
        cy, cx, r = rng.uniform(0, 1, 2).tolist() + [rng.uniform(0.05, 0.3)]
        mask = np.clip((r - np.hypot(y - cy, x - cx)) * 40, 0, 1)
        img += mask[..., None] * (rng.uniform(0, 1, 3) - img) * 0.8
    for _ in range(rng.integers(1, 4)):
        angle, freq = rng.uniform(0, np.pi), rng.uniform(8, 40)
        stripes = np.sin((x * np.cos(angle) + y * np.sin(angle)) * freq) > 0.6
        img += stripes[..., None] * rng.uniform(-0.15, 0.15, 3)
    img += rng.normal(0, 0.03, (SIDE, SIDE, 1)) * np.sin(x * 90 + y * 60)[..., None]  # texture
    img += rng.normal(0, 0.015, img.shape)  # noise
    return (np.clip(img, 0, 1) * 255 + 0.5).astype(np.uint8)


def ensure_env(path: Path, n: int) -> int:
    """Writes (or reuses) an environment of `n` JPEGs under keys 00000000...; returns its data bytes."""
    import lmdb
    from PIL import Image

    marker = b"__len__"
    if (path / "data.mdb").is_file():
        env = lmdb.open(str(path), readonly=True, lock=False)
        with env.begin() as txn:
            ok = txn.get(marker) == str(n).encode()
        env.close()
        if ok:
            return (path / "data.mdb").stat().st_size
    print(f"writing {n} JPEGs to {path}", file=sys.stderr)
    path.mkdir(parents=True, exist_ok=True)
    for f in path.iterdir():
        f.unlink()
    rng = np.random.default_rng(0)
    env = lmdb.open(str(path), map_size=max(1 << 30, n * 200_000))
    with env.begin(write=True) as txn:
        for i in range(n):
            buf = io.BytesIO()
            Image.fromarray(synthetic_photo(rng)).save(buf, format="JPEG", quality=QUALITY)
            txn.put(f"{i:08d}".encode(), buf.getvalue())
        txn.put(marker, str(n).encode())  # a metadata key: skipped by stoker, checked above
    env.close()
    return (path / "data.mdb").stat().st_size


# --------------------------------------------------------------------------
# stoker
# --------------------------------------------------------------------------


def run_stoker(binary: str, env: Path, threads: int, n: int, passes: int, whole: bool = False) -> list[float]:
    """`whole`: decode the whole image, as before cropped decoding (a leading
    no-op `center_crop` of the full size makes the decoder's window the whole
    image; the random crop that follows then draws what it draws first)."""
    import stoker

    spec = stoker.lmdb(
        env,
        fields={"image": "jpeg"},
        transforms={
            "image": [
                *([{"center_crop": SIDE}] if whole else []),
                {"random_crop": CROP},
                "hflip",
                {"to_f32": 1 / 255},
                {"normalize": {"mean": list(MEAN), "std": list(STD)}},
                "chw",
            ]
        },
    )
    times = []
    with tempfile.TemporaryDirectory(prefix="stk-bench-") as tmp:
        # The sample cache off: every epoch decodes every JPEG, as DataLoader does
        # (benches/lmdb_png_pairs.py shows what the cache adds).
        with Daemon(binary, Path(tmp), env.parent, threads=threads, depth=4, extra="[cache]\nsample_bytes = 0\n") as d:
            loader = stoker.Loader(spec, batch_size=BATCH, shuffle=True, seed=0, socket=d.socket)
            assert loader.fields["image"] == (np.dtype(np.float32), (3, CROP, CROP)), loader.fields
            for epoch in range(passes):
                loader.set_epoch(epoch)
                t0 = time.perf_counter()
                images = 0
                for b in loader:
                    images += len(b["image"])
                times.append(time.perf_counter() - t0)
                assert images == n, (images, n)
            loader.close()
    return times


# --------------------------------------------------------------------------
# Pillow + numpy in a process pool (DataLoader-style workers)
# --------------------------------------------------------------------------

_ENV = None
_TXN = None


def _open_env(path: str) -> None:
    import lmdb

    global _ENV, _TXN
    _ENV = lmdb.open(path, readonly=True, lock=False, readahead=False)
    _TXN = _ENV.begin(buffers=False)


def _load(i: int, epoch: int) -> np.ndarray:
    from PIL import Image

    rng = np.random.default_rng((epoch, i))
    arr = np.asarray(Image.open(io.BytesIO(_TXN.get(f"{i:08d}".encode()))).convert("RGB"))
    top, left = rng.integers(0, arr.shape[0] - CROP + 1), rng.integers(0, arr.shape[1] - CROP + 1)
    crop = arr[top : top + CROP, left : left + CROP]
    if rng.random() < 0.5:
        crop = crop[:, ::-1]
    x = crop.astype(np.float32)
    x *= np.float32(1 / 255)
    x -= np.asarray(MEAN, np.float32)
    x /= np.asarray(STD, np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1))


def _batch(task: tuple[list[int], int, bool]) -> np.ndarray | int:
    indices, epoch, send = task
    batch = np.stack([_load(i, epoch) for i in indices])  # collate, in the worker
    return batch if send else len(batch)


def run_pool(env: Path, n: int, passes: int, procs: int, send: bool) -> list[float]:
    times = []
    with mp.get_context("fork").Pool(procs, initializer=_open_env, initargs=(str(env),)) as pool:
        pool.map(_batch, [([0], 0, False)] * (procs * 2))  # workers up and environments open first
        for epoch in range(passes):
            order = np.random.default_rng(epoch).permutation(n).tolist()
            tasks = [(order[k : k + BATCH], epoch, send) for k in range(0, n, BATCH)]
            t0 = time.perf_counter()
            images = 0
            for b in pool.imap(_batch, tasks, chunksize=1):
                images += len(b) if send else b
            times.append(time.perf_counter() - t0)
            assert images == n, (images, n)
    return times


# --------------------------------------------------------------------------
# torch DataLoader + Pillow (persistent workers, default collate)
# --------------------------------------------------------------------------


class _LmdbDataset:
    """A map-style dataset: the same per-image pipeline as `_load`, each worker
    opening the environment lazily (once, persistent workers)."""

    def __init__(self, path: str, n: int, load) -> None:
        self.path, self.n, self.load, self.epoch = path, n, load, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        import torch

        if _TXN is None:
            _open_env(self.path)
        out = self.load(i, self.epoch)
        return tuple(torch.from_numpy(a) for a in out) if isinstance(out, tuple) else torch.from_numpy(out)


def run_dataloader(env: Path, n: int, passes: int, workers: int, batch: int = BATCH, load=None) -> list[float]:
    """Epoch times of `torch.utils.data.DataLoader(shuffle=True, num_workers=workers,
    persistent_workers=True)` over the Pillow + numpy pipeline (`load`, default `_load`)."""
    import torch
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    ds = _LmdbDataset(str(env), n, load or _load)
    loader = DataLoader(
        ds, batch_size=batch, shuffle=True, num_workers=workers, persistent_workers=workers > 0, prefetch_factor=4 if workers else None
    )
    for _ in loader:  # workers up, environments open
        break
    times = []
    for _ in range(passes):
        t0 = time.perf_counter()
        images = 0
        for b in loader:
            images += len(b[0] if isinstance(b, (list, tuple)) else b)
        times.append(time.perf_counter() - t0)
        assert images == n, (images, n)
    del loader
    return times


# --------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=DEFAULT_N, help=f"images in the environment (default {DEFAULT_N})")
    p.add_argument("--passes", type=int, default=DEFAULT_PASSES, help="epochs timed per setting; the median is reported")
    p.add_argument("--dir", default="/tmp/stoker-bench", help="where the environment is written (and reused)")
    p.add_argument("--stoker", default=None, help="stoker binary (default: target/release/stoker)")
    p.add_argument("--out", default=str(REPO / "docs" / "performance-lmdb.md"), help="markdown file, or - to only print")
    p.add_argument("--quick", action="store_true", help="smoke test: 256 images, one pass, prints only")
    a = p.parse_args()
    if a.quick:
        a.n, a.passes, a.out = 256, 1, "-"
    binary = stoker_bin(a.stoker)
    env = Path(a.dir) / f"lmdb-jpeg-{a.n}"
    stored = ensure_env(env, a.n)
    warm_page_cache(env / "data.mdb")

    settings = {
        "stoker, 1 worker thread": lambda: run_stoker(binary, env, 1, a.n, a.passes),
        "stoker, 2 worker threads": lambda: run_stoker(binary, env, 2, a.n, a.passes),
        "Pillow + numpy, 2-process pool (batches pickled back)": lambda: run_pool(env, a.n, a.passes, 2, True),
        "Pillow + numpy, 2-process pool (nothing sent back)": lambda: run_pool(env, a.n, a.passes, 2, False),
        "DataLoader + Pillow, 1 worker (persistent)": lambda: run_dataloader(env, a.n, a.passes, 1),
        "DataLoader + Pillow, 2 workers (persistent)": lambda: run_dataloader(env, a.n, a.passes, 2),
        "DataLoader + Pillow, 3 workers (persistent)": lambda: run_dataloader(env, a.n, a.passes, 3),
    }
    results = {}
    for name, fn in settings.items():
        times = fn()
        results[name] = statistics.median(times)
        print(f"{name:<56} {a.n / results[name]:8.0f} images/s  ({[round(t, 3) for t in times]} s)", file=sys.stderr)

    baseline = results["Pillow + numpy, 2-process pool (batches pickled back)"]
    one, two = results["stoker, 1 worker thread"], results["stoker, 2 worker threads"]
    best_dl_name = min((k for k in results if k.startswith("DataLoader")), key=results.__getitem__)
    best_dl = results[best_dl_name]
    import lmdb
    import PIL

    info = machine_info()
    lines = [
        "# LMDB JPEG pipeline throughput",
        "",
        f"Command: `python {shlex.join(['benches/lmdb_jpeg.py', *sys.argv[1:]])}`",
        "",
        f"Dataset: one LMDB environment of {a.n} synthetic photo-like {SIDE}×{SIDE} RGB JPEGs "
        f"(quality {QUALITY}, 4:2:0; smooth gradients, blobs, stripes, texture and noise), "
        f"{stored / a.n / 1e3:.0f} KB per image on average, page-cached.",
        "",
        f"Pipeline: decode → random crop {CROP}×{CROP} → random horizontal flip → float32 × 1/255 → "
        f"normalize (ImageNet mean/std) → CHW; batch {BATCH} ({BATCH * 3 * CROP * CROP * 4 / 2**20:.1f} MiB "
        f"of float32), one shuffled epoch per pass, median of {a.passes} passes.",
        "",
        "* stoker: a fresh daemon per setting (`[workers] threads = N`, `[ring] depth = 4`); the client "
        "iterates `stoker.Loader(stoker.lmdb(...), batch_size=64)`, batches zero-copy in shared memory.",
        "* Pillow pool: `multiprocessing` pool of 2 forked workers, as DataLoader workers: each opens the "
        "environment once; per batch it reads each value, `Image.open` → `np.asarray` → crop → flip → "
        "float32/normalize → transpose, stacks the batch and returns it pickled through a pipe. "
        "(PyTorch passes tensors through shared memory instead of pickling the bytes; the second pool "
        "row, whose workers return nothing, bounds what any transport can reach.)",
        "",
        f"Machine: {info['nproc']} CPUs ({info['cpu']}), {info['memory']}, Linux {info['kernel']}, "
        f"Python {info['python']}, numpy {info['numpy']}, Pillow {PIL.__version__}, lmdb {lmdb.__version__}.",
        "",
        "| reader | images/s | epoch (s) | vs. Pillow pool |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, t in results.items():
        lines.append(f"| {name} | {a.n / t:.0f} | {t:.2f} | {baseline / t:.2f}× |")
    ceiling = results["Pillow + numpy, 2-process pool (nothing sent back)"]
    lines += [
        "",
        f"stoker from 1 to 2 worker threads: **{one / two:.2f}×**. stoker with 2 threads against the pool "
        f"whose workers send nothing back (decode and transforms alone): **{ceiling / two:.2f}×**. "
        f"stoker with 2 threads against the best DataLoader setting ({best_dl_name}): "
        f"**{best_dl / two:.2f}×** (target ≥ 3×).",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if a.out != "-" and a.n == DEFAULT_N:
        Path(a.out).write_text(text)
        print(f"wrote {a.out}", file=sys.stderr)
    elif a.out != "-":
        print(f"not writing {a.out}: only runs with the default --n {DEFAULT_N} are recorded", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
