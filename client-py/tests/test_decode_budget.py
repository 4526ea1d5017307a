"""Decode buffers are bounded daemon-wide (issue 22, finding 7).

A small file of compressed chunks that decode to zeros made every worker
hold a whole decoded chunk (and its stored bytes) at once: 9.4 MB of file
took the daemon to 2 GiB under `max_memory_bytes = 1 GiB`, 1 GiB per
worker. Workers now reserve their decode buffers from one budget of
2 × `max_sample_bytes` + 64 MiB before allocating, whatever their number.
"""

from __future__ import annotations

import threading
from pathlib import Path

import h5py
import numpy as np

MIB = 1 << 20


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_many_workers_decoding_big_chunks_stay_within_the_decode_budget(start_daemon, stoker, tmp_path) -> None:
    rows_per_chunk, row_bytes, chunks = 16, 4 * MIB, 8  # 64 MiB per decoded chunk
    path = tmp_path / "zeros.h5"
    with h5py.File(path, "w") as f:
        d = f.create_dataset("x", shape=(rows_per_chunk * chunks, row_bytes), dtype=np.uint8,
                             chunks=(rows_per_chunk, row_bytes), compression="gzip")
        for c in range(chunks):
            block = np.zeros((rows_per_chunk, row_bytes), dtype=np.uint8)
            block[:, 0] = c
            d[c * rows_per_chunk:(c + 1) * rows_per_chunk] = block
    assert path.stat().st_size < 4 * MIB
    # 8 workers, no chunk cache: each read decodes its chunk anew.
    extra = "[cache]\nchunk_bytes = 0\n[limits]\nmax_sample_bytes = 67108864\n"
    d = start_daemon(threads=8, depth=2, extra=extra)
    base = peak_rss(d.proc.pid)
    # Four streams at once keep all workers decoding different chunks.
    seen: list[set[int]] = [set() for _ in range(4)]

    def read(k: int) -> None:
        loader = stoker.Loader(stoker.hdf5(str(path), fields={"x": "x"}), batch_size=2, shuffle=True, seed=k,
                               socket=d.socket, timeout=120)
        for b in loader:
            seen[k].update(int(v) for v in b["x"][:, 0])
        loader.close()

    threads = [threading.Thread(target=read, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(s == set(range(chunks)) for s in seen), seen
    grew = peak_rss(d.proc.pid) - base
    # Budget 2 × 64 + 64 = 192 MiB of decode buffers, plus four rings (2
    # slots of 8 MiB) and slack; 8 workers each holding a chunk would be 512+ MiB.
    assert grew < 360 * MIB, f"daemon grew by {grew / MIB:.0f} MiB"
    assert d.alive(), d.stderr()
