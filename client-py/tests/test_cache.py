"""The node-wide caches end to end: decoded LMDB images and decompressed HDF5
chunks, kept by a real daemon under `[cache] policy = "belady"` or `"lru"`,
shared by clients and jobs, bounded in bytes, observable and controllable
with `stoker cache ls | warm | drop`.

Every test compares served values with the reference readers (Pillow for
PNGs, h5py for HDF5) or with a daemon whose caches are off, byte for byte:
a cache may change speed, never values.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import h5py
import numpy as np
import pytest

from conftest import stoker_bin
from lmdb_data import key, npy_bytes, photo, png_of, write_env

N_IMAGES = 96
IMAGE_BYTES = 24 * 20 * 3


def png_env(tmp_path: Path, n: int = N_IMAGES) -> tuple[Path, Path, list[np.ndarray]]:
    """An environment of `n` RGB PNGs (24×20) and one of their indices."""
    images = [photo(24, 20, 3, seed=i) for i in range(n)]
    imgs = write_env(tmp_path / "img.lmdb", {key(i): png_of(im) for i, im in enumerate(images)})
    idx = write_env(tmp_path / "idx.lmdb", {key(i): npy_bytes(np.int64(i)) for i in range(n)})
    return imgs, idx, images


def cache_config(sample_bytes: int, chunk_bytes: int = 1 << 20, policy: str = "belady") -> str:
    return f"\n[cache]\nsample_bytes = {sample_bytes}\nchunk_bytes = {chunk_bytes}\npolicy = {json.dumps(policy)}\n"


def cache_ls(d: Any) -> dict[str, Any]:
    return json.loads(d.cli("cache", "ls", "--json").stdout)


def sample_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in report["datasets"] if r["cache"] == "samples"]


def epoch_rows(loader: Any, epoch: int, fields: tuple[str, ...]) -> dict[int, dict[str, np.ndarray]]:
    """`{index: {field: value}}` of one epoch, copied out of shared memory."""
    loader.set_epoch(epoch)
    out: dict[int, dict[str, np.ndarray]] = {}
    for batch in loader:
        for j, i in enumerate(np.asarray(batch["idx"]).tolist()):
            assert i not in out, f"epoch {epoch}: sample {i} served twice"
            out[i] = {f: np.array(batch[f][j]) for f in fields}
    return out


@pytest.mark.parametrize("policy", ["belady", "lru"])
def test_cached_images_equal_pillow_across_epochs_and_ranks_within_the_bound(
    stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path, policy: str
) -> None:
    imgs, idx, images = png_env(tmp_path)
    bound = IMAGE_BYTES * N_IMAGES // 3  # a third of the decoded data
    d = start_daemon(extra=cache_config(bound, policy=policy))
    spec = stoker.lmdb({"img": imgs, "idx": idx}, fields={"img": "png", "idx": "npy"})
    loaders = [
        stoker.Loader(spec, batch_size=8, seed=5, rank=r, world_size=2, socket=d.socket) for r in range(2)
    ]
    for epoch in range(3):
        seen: dict[int, int] = {}
        for loader in loaders:
            for i, row in epoch_rows(loader, epoch, ("img",)).items():
                np.testing.assert_array_equal(row["img"], images[i], err_msg=f"{policy} epoch {epoch} sample {i}")
                seen[i] = seen.get(i, 0) + 1
        assert sorted(seen) == list(range(N_IMAGES)) and set(seen.values()) == {1}
        report = cache_ls(d)
        assert report["policy"] == policy
        assert 0 < report["samples"]["bytes"] <= bound, report["samples"]
    rows = sample_rows(cache_ls(d))
    assert len(rows) == 1 and rows[0]["hits"] > 0, rows
    # The npy index field is cheap to read again: never cached.
    assert rows[0]["entries"] <= bound // IMAGE_BYTES


def test_random_crops_from_cached_images_equal_an_uncached_daemon(
    stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path
) -> None:
    """Images are cached decoded, before random steps: each epoch still crops and flips afresh."""
    imgs, idx, _ = png_env(tmp_path)
    transforms = {"img": [{"random_crop": (16, 12)}, "hflip"]}
    spec = stoker.lmdb({"img": imgs, "idx": idx}, fields={"img": "png", "idx": "npy"}, transforms=transforms)
    cached = start_daemon(extra=cache_config(IMAGE_BYTES * N_IMAGES // 2))
    plain = start_daemon(extra=cache_config(0))
    a = stoker.Loader(spec, batch_size=16, seed=3, socket=cached.socket)
    b = stoker.Loader(spec, batch_size=16, seed=3, socket=plain.socket)
    crops = []
    for epoch in range(3):
        got, want = epoch_rows(a, epoch, ("img",)), epoch_rows(b, epoch, ("img",))
        assert got.keys() == want.keys()
        for i in got:
            np.testing.assert_array_equal(got[i]["img"], want[i]["img"], err_msg=f"epoch {epoch} sample {i}")
        crops.append(got[0]["img"])
    assert any(not np.array_equal(crops[0], c) for c in crops[1:]), "random crops must differ across epochs"
    assert sample_rows(cache_ls(cached))[0]["hits"] > 0
    assert cache_ls(plain)["samples"]["entries"] == 0


def test_a_second_job_starts_warm_and_warm_drop_work(
    stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path
) -> None:
    imgs, idx, images = png_env(tmp_path)
    toml = (
        "\n[datasets.photos]\nformat = \"lmdb\"\n"
        f"fields = [{{ name = \"img\", env = {json.dumps(str(imgs))}, codec = \"png\" }}, "
        f"{{ name = \"idx\", env = {json.dumps(str(idx))}, codec = \"npy\" }}]\n"
    )
    d = start_daemon(extra=cache_config(IMAGE_BYTES * N_IMAGES * 2) + toml)
    # `stoker cache warm` fills the cache ahead of any job.
    res = d.cli("cache", "warm", "photos", "--json")
    warm = json.loads(res.stdout)
    assert warm["samples"] == N_IMAGES and warm["entries"] == N_IMAGES, warm
    before = sample_rows(cache_ls(d))[0]
    # A job (its own client, its own seed) then finds every image cached in its first epoch.
    loader = stoker.Loader("photos", batch_size=8, seed=11, socket=d.socket)
    for i, row in epoch_rows(loader, 0, ("img",)).items():
        np.testing.assert_array_equal(row["img"], images[i])
    loader.close()
    after = sample_rows(cache_ls(d))[0]
    # (At least: the stream reads ahead into the next epoch before it closes.)
    assert after["hits"] - before["hits"] >= N_IMAGES, (before, after)
    assert after["misses"] == before["misses"], (before, after)
    # A second job with another seed: hits again, still exact.
    second = stoker.Loader("photos", batch_size=8, seed=12, socket=d.socket)
    for i, row in epoch_rows(second, 0, ("img",)).items():
        np.testing.assert_array_equal(row["img"], images[i])
    assert sample_rows(cache_ls(d))[0]["hits"] - after["hits"] >= N_IMAGES
    assert sample_rows(cache_ls(d))[0]["misses"] == before["misses"]
    second.close()
    # `stoker cache ls` (table) names the dataset; `drop` empties it.
    table = d.cli("cache", "ls").stdout
    assert "photos" in table and "belady" in table, table
    dropped = json.loads(d.cli("cache", "drop", "photos", "--json").stdout)
    assert dropped["entries"] == N_IMAGES and dropped["bytes"] == N_IMAGES * IMAGE_BYTES, dropped
    assert cache_ls(d)["samples"]["bytes"] == 0
    # Issue 24, item 9: after a drop the dataset's hit rate starts over (it
    # showed its old 100%) and the drop is not counted as evictions.
    rows = sample_rows(cache_ls(d))
    assert all(r["hits"] == 0 and r["evictions"] == 0 for r in rows), rows
    unknown = d.cli("cache", "drop", "no-such-dataset", check=False)
    assert unknown.returncode != 0 and "stoker cache ls" in unknown.stderr, unknown.stderr
    d.cli("cache", "warm", "photos")
    assert cache_ls(d)["samples"]["entries"] == N_IMAGES
    everything = json.loads(d.cli("cache", "drop", "--all", "--json").stdout)
    assert everything["entries"] == N_IMAGES
    status = d.status()
    assert status["sample_cache"]["entries"] == 0 and status["sample_cache"]["capacity"] == IMAGE_BYTES * N_IMAGES * 2


def gzip_h5(path: Path, rows: int, seed: int) -> np.ndarray:
    data = np.random.default_rng(seed).integers(0, 1000, size=(rows, 32), dtype=np.int32)
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=data, chunks=(16, 32), compression="gzip")
        f.create_dataset("idx", data=np.arange(rows, dtype=np.int64))
    return data


@pytest.mark.parametrize("policy", ["belady", "lru"])
def test_chunk_cache_policies_serve_h5py_exactly_within_the_bound(
    stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path, policy: str
) -> None:
    data = gzip_h5(tmp_path / "a.h5", 512, 1)
    chunk = 16 * 32 * 4
    bound = chunk * 8  # a quarter of the chunks
    d = start_daemon(extra=cache_config(0, chunk_bytes=bound, policy=policy))
    spec = stoker.hdf5(str(tmp_path / "a.h5"), fields={"x": "/x", "idx": "/idx"})
    loaders = [stoker.Loader(spec, batch_size=16, seed=2, rank=r, world_size=2, socket=d.socket) for r in range(2)]
    for epoch in range(2):
        covered = set()
        for loader in loaders:
            for i, row in epoch_rows(loader, epoch, ("x",)).items():
                np.testing.assert_array_equal(row["x"], data[i])
                covered.add(i)
        assert covered == set(range(512))
        chunks = cache_ls(d)["chunks"]
        assert 0 < chunks["bytes"] <= bound and chunks["evictions"] > 0, chunks


@pytest.mark.parametrize("threads", [1, 2])
def test_a_file_order_epoch_over_a_full_chunk_cache_decodes_each_chunk_about_once(
    stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path, threads: int
) -> None:
    """Fills run concurrently, up to a ring's depth of batches behind the newest
    one started: the chunks they read are needed now. A Belady cache that
    took them for "read next epoch" refused them, and each part of a batch
    decompressed its chunks again (203 and 407 misses where 71 suffice);
    two workers reaching one chunk together decompress it once."""
    rows = 1024
    data = gzip_h5(tmp_path / "a.h5", rows, 3)
    chunks = rows // 16
    # 16 rows of 32 int32 per chunk.
    bound = 16 * 32 * 4 * 16  # 16 of the 64 chunks (more than the 12 a full ring of fills reads)
    d = start_daemon(threads=threads, depth=8, extra=cache_config(0, chunk_bytes=bound, policy="belady"))
    spec = stoker.hdf5(str(tmp_path / "a.h5"), fields={"x": "/x", "idx": "/idx"})
    loader = stoker.Loader(spec, batch_size=24, shuffle=False, socket=d.socket)
    got = epoch_rows(loader, 0, ("x",))
    assert sorted(got) == list(range(rows))
    for i, row in got.items():
        np.testing.assert_array_equal(row["x"], data[i])
    report = cache_ls(d)["chunks"]
    # Every row is one lookup; the ring also reads ahead into epoch 1.
    lookups = report["hits"] + report["misses"]
    assert rows <= lookups <= rows + 8 * 24 and report["bytes"] <= bound, report
    # Each chunk is missed once per pass (epoch 0, then epoch 1's first batches).
    assert chunks <= report["misses"] <= -(-lookups // 16) * 9 // 8, report
    assert report["misses"] >= chunks, report


def test_a_rewritten_file_is_never_served_from_the_cache(
    stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path
) -> None:
    """Cache entries are keyed by file identity (device, inode, size, mtime): new bytes, new entries."""
    path = tmp_path / "a.h5"
    old = gzip_h5(path, 64, 1)
    d = start_daemon(extra=cache_config(1 << 20, chunk_bytes=1 << 20))
    spec = stoker.hdf5(str(path), fields={"x": "/x", "idx": "/idx"})
    first = stoker.Loader(spec, batch_size=16, shuffle=False, socket=d.socket)
    for i, row in epoch_rows(first, 0, ("x",)).items():
        np.testing.assert_array_equal(row["x"], old[i])
    first.close()
    assert cache_ls(d)["chunks"]["entries"] == 4
    # Rewritten in place (same inode; the daemon still holds it open): new values, a new mtime.
    st = os.stat(path)
    new = gzip_h5(tmp_path / "b.h5", 64, 2)
    path.write_bytes((tmp_path / "b.h5").read_bytes())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert os.stat(path).st_ino == st.st_ino
    second = stoker.Loader(spec, batch_size=16, shuffle=False, socket=d.socket)
    for i, row in epoch_rows(second, 0, ("x",)).items():
        np.testing.assert_array_equal(row["x"], new[i], err_msg=f"row {i} served from the old file")
    second.close()


def test_config_refuses_caches_that_leave_no_memory(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(
        "[limits]\nmax_memory_bytes = 1000000\n[cache]\nchunk_bytes = 400000\nsample_bytes = 700000\n"
        "policy = \"belady\"\n"
    )
    res = subprocess.run([str(stoker_bin()), "validate", "--skip-files", str(config)], capture_output=True, text=True)
    assert res.returncode != 0 and "sample_bytes" in res.stdout + res.stderr, res
    config.write_text("[cache]\npolicy = \"fifo\"\n")
    res = subprocess.run([str(stoker_bin()), "validate", "--skip-files", str(config)], capture_output=True, text=True)
    assert res.returncode != 0 and "belady" in res.stdout + res.stderr, res


def recv_notifications(sock: Any) -> list[tuple[str, list[int]]]:
    """Every sd_notify datagram waiting on `sock`: its text and the fds it carried."""
    import array
    import socket as socketlib

    out = []
    while True:
        try:
            msg, anc, _, _ = sock.recvmsg(4096, socketlib.CMSG_SPACE(16 * 4), socketlib.MSG_DONTWAIT)
        except BlockingIOError:
            return out
        fds = array.array("i")
        for level, kind, data in anc:
            if level == socketlib.SOL_SOCKET and kind == socketlib.SCM_RIGHTS:
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
        out.append((msg.decode(), list(fds)))


@pytest.mark.parametrize("changed", [False, True], ids=["same-files", "file-changed"])
def test_caches_survive_a_restart_through_systemds_fd_store(
    stoker: Any, tmp_path: Path, short_tmp: Path, changed: bool
) -> None:
    """systemd's protocol, played by the test: `$NOTIFY_SOCKET` receives
    FDSTORE=1 with the memfd at a clean stop; the next daemon gets it as
    `LISTEN_FDS` named `stoker-cache`, restores the caches and says FDSTOREREMOVE=1.

    `file-changed` (issue 22, item 2): the environment's data file is touched
    between the two daemons, its mtime put back to the nanosecond (only its
    ctime tells). Its entries are not restored: they are stale, and could
    never be hit."""
    import socket as socketlib

    from conftest import Daemon, make_config

    imgs, idx, images = png_env(tmp_path)
    notify_path = str(short_tmp / "notify")
    listener = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_DGRAM)
    listener.bind(notify_path)
    env = {**os.environ, "NOTIFY_SOCKET": notify_path, "FDSTORE": "4"}
    config = make_config("unused", allowed_roots=[tmp_path], extra=cache_config(IMAGE_BYTES * N_IMAGES * 2))
    spec = stoker.lmdb({"img": imgs, "idx": idx}, fields={"img": "png", "idx": "npy"})
    (short_tmp / "a").mkdir()
    first = Daemon(short_tmp / "a", config, env=env)
    try:
        loader = stoker.Loader(spec, batch_size=8, seed=1, socket=first.socket)
        epoch_rows(loader, 0, ("img",))
        loader.close()
        held = cache_ls(first)["samples"]
        assert held["entries"] == N_IMAGES
        assert first.terminate() == 0
    finally:
        first.stop()
    notes = recv_notifications(listener)
    stored = [fds for text, fds in notes if "FDSTORE=1" in text and "FDNAME=stoker-cache" in text]
    assert len(stored) == 1 and len(stored[0]) == 1, notes
    (fd,) = stored[0]
    assert "caches handed to systemd's fd store" in first.stderr()
    if changed:
        data_file = Path(imgs) / "data.mdb"
        before = os.stat(data_file)
        time.sleep(0.01)
        os.utime(data_file, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert os.stat(data_file).st_ctime_ns != before.st_ctime_ns

    # The next start of the unit: the stored fd comes back as fd 3.
    wrapper = [
        sys.executable,
        "-c",
        "import os, sys\n"
        f"os.dup2({fd}, 3)\n"
        f"os.close({fd})\n"
        "os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS='1', LISTEN_FDNAMES='stoker-cache')\n"
        "os.execv(sys.argv[1], sys.argv[1:])\n",
        str(stoker_bin()),
    ]
    (short_tmp / "b").mkdir()
    second = Daemon(short_tmp / "b", config, env=env, command=wrapper, pass_fds=(fd,))
    os.close(fd)
    try:
        assert "caches restored from systemd's fd store" in second.stderr()
        report = cache_ls(second)
        if changed:
            assert report["samples"]["entries"] == 0, report
            assert f"stale={N_IMAGES}" in second.stderr(), second.stderr()
            return
        assert report["samples"]["entries"] == N_IMAGES and report["samples"]["bytes"] == held["bytes"], report
        assert len(sample_rows(report)) == 1, report  # labels come back too
        # A job on the restarted daemon starts warm, and exact.
        again = stoker.Loader(spec, batch_size=8, seed=2, socket=second.socket)
        for i, row in epoch_rows(again, 0, ("img",)).items():
            np.testing.assert_array_equal(row["img"], images[i])
        again.close()
        rows = sample_rows(cache_ls(second))
        assert rows[0]["misses"] == 0 and rows[0]["hits"] >= N_IMAGES, rows
        removed = [t for t, _ in recv_notifications(listener) if "FDSTOREREMOVE=1" in t]
        assert removed and "FDNAME=stoker-cache" in removed[0], removed
    finally:
        second.stop()
        listener.close()
