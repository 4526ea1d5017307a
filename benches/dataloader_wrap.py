"""A stoker Loader iterated directly and wrapped in torch's DataLoader.

`DataLoader(loader, batch_size=None)` (num_workers=0: more workers would each
iterate their own copy and are refused) turns each of stoker's numpy batches
into tensors with `default_convert` (`torch.as_tensor`, no copy). This
measures what the wrapper costs per batch against iterating the Loader with
`output="torch"` and with numpy output, on one page-cached HDF5 file: the
median of `--epochs` epochs, batches per second and MB/s, in one run.

    python benches/dataloader_wrap.py [--mb 256] [--sample-kb 16] [--batch 256]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import Daemon, stoker_bin  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--sample-kb", type=int, default=16)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--stoker", default=None)
    a = ap.parse_args()
    import stoker
    import torch
    from torch.utils.data import DataLoader

    width = a.sample_kb * 1024 // 4
    rows = a.mb * (1 << 20) // (width * 4)
    with tempfile.TemporaryDirectory(prefix="stk-dlw-") as tmp:
        root = Path(tmp)
        path = root / "x.h5"
        with h5py.File(path, "w") as f:
            f.create_dataset("x", data=np.random.default_rng(0).standard_normal((rows, width), dtype=np.float32))
        with Daemon(stoker_bin(a.stoker), root / "d", root, threads=os.cpu_count() or 2, depth=8) as d:
            spec = stoker.hdf5(str(path), fields={"x": "x"})
            ways = {
                "Loader, numpy": lambda: stoker.Loader(spec, batch_size=a.batch, socket=d.socket),
                "Loader, output='torch'": lambda: stoker.Loader(spec, batch_size=a.batch, socket=d.socket,
                                                                output="torch"),
                "DataLoader(loader, batch_size=None)": lambda: DataLoader(
                    stoker.Loader(spec, batch_size=a.batch, socket=d.socket), batch_size=None),
            }
            results: dict[str, list[float]] = {k: [] for k in ways}
            made = {k: make() for k, make in ways.items()}
            for epoch in range(a.epochs + 1):
                for name, it in made.items():
                    loader = it.dataset if isinstance(it, DataLoader) else it
                    loader.set_epoch(epoch)
                    t0 = time.perf_counter()
                    n = 0
                    for batch in it:
                        x = batch["x"]
                        assert isinstance(x, (np.ndarray, torch.Tensor))
                        n += 1
                    if epoch > 0:  # the first epoch warms the page cache
                        results[name].append(n / (time.perf_counter() - t0))
            batch_mb = a.batch * width * 4 / 1e6
            print(f"{rows} samples of {a.sample_kb} KiB, batch {a.batch}, {os.cpu_count()} worker threads; "
                  f"median of {a.epochs} epochs")
            print("| way | batches/s | MB/s |")
            print("| --- | ---: | ---: |")
            for name, rates in results.items():
                med = statistics.median(rates)
                print(f"| {name} | {med:,.0f} | {med * batch_mb:,.0f} |")


if __name__ == "__main__":
    main()
