#!/usr/bin/env python3
"""Pairs/s of a BasicSR-style LR/HR PNG pipeline from two LMDB environments.

HR: 256×256 RGB PNG (synthetic photo of benches/lmdb_jpeg.py, Pillow's
default compression); LR: the same image shrunk 4× (64×64, bicubic), under
the same keys. Per pair: decode both → paired random crop (LR 32×32 at a
random offset, HR 128×128 at 4× that offset) → paired random horizontal
flip → float32 × 1/255 → CHW; batches of 16 pairs. Compared on the same
page-cached environments: stoker with 2 worker threads, and a torch
DataLoader (persistent workers, 1–3 of them) running the same pipeline with
Pillow + numpy. Medians of --passes epochs.

    python benches/lmdb_png_pairs.py           # 800 pairs, 3 passes
    python benches/lmdb_png_pairs.py --quick   # 128 pairs, one pass
    python benches/lmdb_png_pairs.py --rot     # BasicSR's use_rot too: + vflip, rot90
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lmdb_jpeg  # noqa: E402
from benchlib import Daemon, machine_info, stoker_bin, warm_page_cache  # noqa: E402
from lmdb_jpeg import synthetic_photo  # noqa: E402

SCALE = 4
LR_CROP = 32
BATCH = 16
# --rot: BasicSR's `augment(hflip=True, rotation=True)`, random vflip and
# transpose as well (stoker: `vflip`, `rot90`, the n-dimensional engine).
ROT = False


def ensure_envs(root: Path, n: int) -> tuple[Path, Path]:
    import lmdb
    from PIL import Image

    lr_path, hr_path = root / f"png-lr-{n}", root / f"png-hr-{n}"
    if (hr_path / "data.mdb").is_file() and (lr_path / "data.mdb").is_file():
        return lr_path, hr_path
    print(f"writing {n} LR/HR PNG pairs to {root}", file=sys.stderr)
    rng = np.random.default_rng(0)
    envs = {p: lmdb.open(str(p), map_size=1 << 31) for p in (lr_path, hr_path)}
    txns = {p: e.begin(write=True) for p, e in envs.items()}
    for i in range(n):
        hr = Image.fromarray(synthetic_photo(rng))
        lr = hr.resize((hr.width // SCALE, hr.height // SCALE), Image.Resampling.BICUBIC)
        for p, im in ((hr_path, hr), (lr_path, lr)):
            buf = io.BytesIO()
            im.save(buf, format="PNG")
            txns[p].put(f"{i:08d}".encode(), buf.getvalue())
    for p, e in envs.items():
        txns[p].commit()
        e.close()
    return lr_path, hr_path


def run_stoker(binary: str, lr: Path, hr: Path, threads: int, n: int, passes: int, cache: bool) -> list[float]:
    import stoker

    flips = ["hflip", "vflip", "rot90"] if ROT else ["hflip"]
    steps = lambda side: [{"random_crop": side}, *flips, {"to_f32": 1 / 255}, "chw"]  # noqa: E731
    spec = stoker.lmdb(
        {"lr": lr, "hr": hr},
        fields={"lr": "png", "hr": "png"},
        transforms={"lr": steps(LR_CROP), "hr": steps(LR_CROP * SCALE)},
        pair={"hr": ("lr", SCALE)},
    )
    times = []
    with tempfile.TemporaryDirectory(prefix="stk-bench-") as tmp:
        # Without the sample cache, every epoch decodes every PNG (what DataLoader does);
        # with it, decoded images are kept (before the random crop and flip).
        extra = "[cache]\nsample_bytes = " + ("536870912" if cache else "0") + "\n"
        with Daemon(binary, Path(tmp), lr.parent, threads=threads, depth=8, extra=extra) as d:
            loader = stoker.Loader(spec, batch_size=BATCH, shuffle=True, seed=0, socket=d.socket)
            for epoch in range(passes):
                loader.set_epoch(epoch)
                t0 = time.perf_counter()
                pairs = 0
                for b in loader:
                    pairs += len(b["hr"])
                times.append(time.perf_counter() - t0)
                assert pairs == n, (pairs, n)
            loader.close()
    return times


_LR_TXN = None


def _load_pair(i: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """The pair pipeline in Pillow + numpy (`lmdb_jpeg._TXN` is the HR environment)."""
    import lmdb
    from PIL import Image

    global _LR_TXN
    if _LR_TXN is None:
        _LR_TXN = lmdb.open(_LR_PATH, readonly=True, lock=False, readahead=False).begin(buffers=False)
    k = f"{i:08d}".encode()
    lr = np.asarray(Image.open(io.BytesIO(_LR_TXN.get(k))).convert("RGB"))
    hr = np.asarray(Image.open(io.BytesIO(lmdb_jpeg._TXN.get(k))).convert("RGB"))
    rng = np.random.default_rng((epoch, i))
    top, left = rng.integers(0, lr.shape[0] - LR_CROP + 1), rng.integers(0, lr.shape[1] - LR_CROP + 1)
    lr = lr[top : top + LR_CROP, left : left + LR_CROP]
    s = LR_CROP * SCALE
    hr = hr[top * SCALE : top * SCALE + s, left * SCALE : left * SCALE + s]
    if rng.random() < 0.5:
        lr, hr = lr[:, ::-1], hr[:, ::-1]
    if ROT:
        if rng.random() < 0.5:
            lr, hr = lr[::-1], hr[::-1]
        k = int(rng.integers(0, 4))
        lr, hr = np.rot90(lr, k), np.rot90(hr, k)
    out = []
    for a in (lr, hr):
        x = a.astype(np.float32)
        x *= np.float32(1 / 255)
        out.append(np.ascontiguousarray(x.transpose(2, 0, 1)))
    return out[0], out[1]


_LR_PATH = ""


def main() -> int:
    global _LR_PATH, ROT
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=800)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--dir", default="/tmp/stoker-bench")
    p.add_argument("--stoker", default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rot", action="store_true", help="also random vflip and rot90 (BasicSR's use_rot)")
    a = p.parse_args()
    ROT = a.rot
    if a.quick:
        a.n, a.passes = 128, 1
    binary = stoker_bin(a.stoker)
    lr, hr = ensure_envs(Path(a.dir), a.n)
    for env in (lr, hr):
        warm_page_cache(env / "data.mdb")
    _LR_PATH = str(lr)
    settings = {
        "stoker, 2 worker threads, sample cache off": lambda: run_stoker(binary, lr, hr, 2, a.n, a.passes, False),
        "stoker, 2 worker threads, sample cache on (epochs 2+ hit)": lambda: run_stoker(
            binary, lr, hr, 2, a.n, a.passes + 1, True
        )[1:],
        **{
            f"DataLoader + Pillow, {w} worker{'s' if w > 1 else ''} (persistent)": (
                lambda w=w: lmdb_jpeg.run_dataloader(hr, a.n, a.passes, w, BATCH, _load_pair)
            )
            for w in (1, 2, 3)
        },
    }
    results = {}
    for name, fn in settings.items():
        times = fn()
        results[name] = statistics.median(times)
        print(f"{name:<48} {a.n / results[name]:8.0f} pairs/s  ({[round(t, 3) for t in times]} s)", file=sys.stderr)
    best = min((k for k in results if k.startswith("DataLoader")), key=results.__getitem__)
    info = machine_info()
    print(f"\nMachine: {info['nproc']} CPUs ({info['cpu']}); {a.n} pairs, batch {BATCH}, median of {a.passes} passes.\n")
    print("| reader | pairs/s | epoch (s) | vs. best DataLoader |")
    print("| --- | ---: | ---: | ---: |")
    for name, t in results.items():
        print(f"| {name} | {a.n / t:.0f} | {t:.2f} | {results[best] / t:.2f}× |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
