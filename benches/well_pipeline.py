#!/usr/bin/env python3
"""A Well-style pipeline: windows of n_steps_input + n_steps_output steps,
split into input and output, normalized per channel and made channels-first,
from stoker against the_well-style h5py code in DataLoader workers, on the
same cores.

The data: one file in The Well's layout, ``t1_fields/velocity`` shaped
``[trajectories, T, x, y, 2]`` float32 (about --mb MB), page cache warmed.
Each sample: ``x = velocity[traj, t:t+4]`` and ``y = velocity[traj, t+4:t+5]``,
``(v - mean) / std`` per component, then ``[t, x, y, c] -> [t, c, x, y]``.

Baseline: a ``torch.utils.data.Dataset`` that opens the file once per worker
(h5py), slices the window, normalizes and transposes in numpy, in a
DataLoader with persistent workers (the best of 0, 1 and 2 workers is
reported), shuffle on, default collate.

    python benches/well_pipeline.py            # prints a table (medians of --passes epochs)
    python benches/well_pipeline.py --quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import h5py
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import Daemon, machine_info, stoker_bin, warm_page_cache  # noqa: E402

N_IN, N_OUT = 4, 1
MEAN = [0.1, -0.2]
STD = [1.5, 0.5]


def ensure_file(path: Path, traj: int, steps: int, side: int) -> None:
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f.attrs["n_trajectories"] = traj
        v = f.create_dataset("t1_fields/velocity", shape=(traj, steps, side, side, 2), dtype="f4")
        for i in range(traj):
            v[i] = rng.standard_normal((steps, side, side, 2), dtype=np.float32)
        f["t1_fields/velocity"].attrs["time_varying"] = True
        f["t1_fields/velocity"].attrs["sample_varying"] = True


class WellLike:
    """What the_well's WellDataset does per item, reduced to this pipeline."""

    def __init__(self, path: str, traj: int, steps: int) -> None:
        self.path, self.per = path, steps - (N_IN + N_OUT) + 1
        self.n = traj * self.per
        self.file = None
        self.mean = np.array(MEAN, np.float32)
        self.std = np.array(STD, np.float32)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if self.file is None:
            self.file = h5py.File(self.path, "r")
        traj, t = divmod(i, self.per)
        w = self.file["t1_fields/velocity"][traj, t : t + N_IN + N_OUT]
        w = ((w - self.mean) / self.std).transpose(0, 3, 1, 2)
        return {"x": np.ascontiguousarray(w[:N_IN]), "y": np.ascontiguousarray(w[N_IN:])}


def epoch_time(loader, limit: int) -> float:
    t0 = time.perf_counter()
    for k, b in enumerate(loader):
        if k + 1 >= limit:
            break
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="/tmp/stoker-bench-well")
    p.add_argument("--traj", type=int, default=8)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--side", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--batches", type=int, default=40, help="batches timed per pass")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--stoker", default=None)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    if a.quick:
        a.traj, a.steps, a.side, a.batches, a.passes = 2, 20, 32, 5, 1
    import stoker
    import torch

    path = Path(a.dir) / f"well_{a.traj}x{a.steps}x{a.side}.hdf5"
    ensure_file(path, a.traj, a.steps, a.side)
    warm_page_cache(path)
    info = machine_info()
    rows = []
    norm = {"normalize": {"mean": MEAN, "std": STD}}
    with Daemon(stoker_bin(a.stoker), Path(a.dir) / "daemon", Path(a.dir), threads=a.threads, depth=4) as d:
        spec = stoker.hdf5(
            str(path),
            fields={"x": "t1_fields/velocity", "y": "t1_fields/velocity"},
            window={"n_steps_input": N_IN, "n_steps_output": N_OUT},
            input=["x"],
            output=["y"],
            transforms={"x": [norm, "chw"], "y": [norm, "chw"]},
        )
        loader = stoker.Loader(spec, batch_size=a.batch_size, shuffle=True, seed=0, socket=d.socket)
        b = next(iter(loader))
        ref = WellLike(str(path), a.traj, a.steps)
        assert b["x"].shape[1:] == ref[0]["x"].shape, (b["x"].shape, ref[0]["x"].shape)
        times = []
        for e in range(a.passes + 1):
            loader.set_epoch(e)
            times.append(epoch_time(loader, a.batches))
        rows.append(("stoker", statistics.median(times[1:])))
        loader.close()
    best = None
    for workers in (0, 1, 2):
        ds = WellLike(str(path), a.traj, a.steps)
        dl = torch.utils.data.DataLoader(
            ds, batch_size=a.batch_size, shuffle=True, num_workers=workers, persistent_workers=workers > 0
        )
        times = [epoch_time(dl, a.batches) for _ in range(a.passes + 1)][1:]
        t = statistics.median(times)
        rows.append((f"DataLoader + h5py, {workers} workers", t))
        best = t if best is None else min(best, t)
    samples = a.batches * a.batch_size
    print(f"machine: {info['nproc']} cores, {info['cpu']}; {path.name}, batch {a.batch_size}, {a.batches} batches/pass")
    print("| pipeline | s per pass (median) | samples/s | vs best DataLoader |")
    print("| --- | ---: | ---: | ---: |")
    for name, t in rows:
        print(f"| {name} | {t:.3f} | {samples / t:,.0f} | {best / t:.1f}× |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
