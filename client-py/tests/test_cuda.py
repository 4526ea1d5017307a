"""device="cuda": CUDA tensors copied from the ring.

The CPU-side behaviour (device=None unchanged, device="cpu", the clear error
where no GPU is usable, argument checks) runs everywhere. The GPU tests need
torch with a visible CUDA device and skip with a message elsewhere; run them on
a GPU node with `pytest client-py/tests/test_cuda.py` (see docs/gpu.md).
"""

from __future__ import annotations

import gc
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")

BATCH = 8
HAS_GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(
    not HAS_GPU,
    reason="needs a CUDA GPU: torch.cuda.is_available() is False on this machine (run on a GPU node, docs/gpu.md)",
)


def cpu_batches(stoker, data, socket, **kw):
    loader = stoker.Loader(data.spec(stoker), batch_size=BATCH, shuffle=False, socket=socket, **kw)
    return [{k: v.copy() for k, v in b.items()} for b in loader]


# --------------------------------------------------------------------------
# Everywhere
# --------------------------------------------------------------------------


def test_device_none_and_cpu_yield_the_same_host_tensors(start_daemon, stoker, data) -> None:
    d = start_daemon()
    ref = cpu_batches(stoker, data, d.socket)
    for device in (None, "cpu", torch.device("cpu")):
        loader = stoker.Loader(data.spec(stoker), batch_size=BATCH, shuffle=False, socket=d.socket,
                               output="torch", device=device)
        assert loader.device is None
        start, length = loader._mapping_range()
        n = 0
        for b, r in zip(loader, ref):  # one batch at a time: each lies in the ring proper
            for name, t in b.items():
                assert t.device.type == "cpu"
                # Still a view of the slot, not a copy.
                assert start <= t.data_ptr() < start + length, name
                assert np.array_equal(t.numpy(), r[name])
            n += 1
            # Hold one batch at a time for real: a lease kept alive until the
            # garbage collector runs would make the client hold every slot,
            # and the ring would grow into an extra segment.
            del b, t
            gc.collect()
        assert n == len(ref) == len(loader)


@pytest.mark.skipif(HAS_GPU, reason="a GPU is usable here, so the no-GPU error cannot be provoked")
def test_cuda_without_a_gpu_raises_a_clear_error_before_connecting(stoker, data, tmp_path) -> None:
    # No daemon at this socket: the device check comes first, so the error is about the GPU.
    for device in ("cuda", "cuda:0", torch.device("cuda", 0)):
        with pytest.raises(stoker.DeviceUnavailable) as err:
            stoker.Loader(data.spec(stoker), batch_size=BATCH, socket=tmp_path / "none.sock", output="torch",
                          device=device)
        msg = str(err.value)
        assert "device=" in msg and ("is_available() is False" in msg or "without CUDA" in msg), msg
        assert "device=None" in msg, msg
        assert isinstance(err.value, RuntimeError) and isinstance(err.value, stoker.StokerError)
        again = pickle.loads(pickle.dumps(err.value))
        assert type(again) is stoker.DeviceUnavailable and str(again) == msg
    assert stoker.DeviceUnavailable.__module__ == "stoker"


def test_device_needs_torch_output_and_a_known_device(stoker, data, tmp_path) -> None:
    sock = tmp_path / "none.sock"
    with pytest.raises(ValueError, match="output='torch'"):
        stoker.Loader(data.spec(stoker), batch_size=BATCH, socket=sock, device="cuda")
    for bad in ("mps", "cuda:x", "tpu:0", "cpu:1"):
        with pytest.raises(ValueError, match="device must be"):
            stoker.Loader(data.spec(stoker), batch_size=BATCH, socket=sock, output="torch", device=bad)


# --------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------


@needs_gpu
@pytest.mark.parametrize("mode", ["auto", "staging"])
def test_cuda_batches_equal_the_cpu_batches_byte_for_byte(start_daemon, stoker, data, mode) -> None:
    d = start_daemon(depth=4)
    ref = cpu_batches(stoker, data, d.socket)
    loader = stoker.Loader(data.spec(stoker), batch_size=BATCH, shuffle=False, socket=d.socket, output="torch",
                           device="cuda:0")
    from stoker import _cuda

    loader._uploader = _cuda.Uploader("cuda:0", mode=mode)
    for epoch in range(2):
        loader.set_epoch(epoch)
        got = list(loader)
        assert len(got) == len(ref)
        for b, r in zip(got, ref):
            for name, t in b.items():
                assert t.device == torch.device("cuda", 0)
                host = t.cpu().numpy()
                assert host.dtype == r[name].dtype and host.shape == r[name].shape
                assert host.tobytes() == r[name].tobytes(), name
    if mode == "staging":
        assert loader._uploader.mode == "staging"
    loader.close()


def _private_pages(start: int, length: int) -> int:
    """Present pages of `[start, start + length)` that are this process's
    private copies (/proc/self/pagemap: bit 63 present, bit 61 file/shared)."""
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(8 * (start // 4096))
        entries = np.frombuffer(f.read(8 * ((length + 4095) // 4096)), dtype=np.uint64)
    present = (entries >> np.uint64(63)) & np.uint64(1)
    shared = (entries >> np.uint64(61)) & np.uint64(1)
    return int((present & (np.uint64(1) - shared)).sum())


@needs_gpu
def test_registered_uploads_see_every_batch_of_a_reused_slot(start_daemon, stoker, tmp_path) -> None:
    """Slots of many pages, reused many times: the registered upload must read
    the daemon's current pages. (Registering the private mapping pinned
    private copies of the first batches: every batch from the ring's depth on
    came out stale, on an H100, while the tiny default dataset passed.)"""
    import h5py

    rows, row_bytes, batch, depth = 96, 16384, 8, 4
    ref = np.random.default_rng(5).integers(0, 255, (rows, row_bytes), dtype=np.uint8)
    with h5py.File(tmp_path / "big.h5", "w") as h:
        h["x"] = ref
    d = start_daemon(depth=depth)
    loader = stoker.Loader(stoker.hdf5(str(tmp_path / "big.h5"), fields={"x": "x"}), batch_size=batch,
                           shuffle=False, socket=d.socket, output="torch", device="cuda:0")
    from stoker import _cuda

    loader._uploader = _cuda.Uploader("cuda:0", mode="registered")
    for epoch in range(2):
        loader.set_epoch(epoch)
        stale = []
        for i, b in enumerate(loader):
            if not np.array_equal(b["x"].cpu().numpy(), ref[i * batch:(i + 1) * batch]):
                stale.append(i)
            del b
        assert not stale, f"epoch {epoch}: batches {stale} differ from the file (of {rows // batch})"
    assert loader._uploader.mode == "registered"
    # Registration left the copy-on-write mapping alone: no page of it became private.
    assert _private_pages(*loader._mapping_range()) == 0
    loader.close()


@needs_gpu
def test_the_ring_is_registered_once_and_unregistered_at_close(start_daemon, stoker, data) -> None:
    d = start_daemon(depth=4)
    loader = stoker.Loader(data.spec(stoker), batch_size=BATCH, shuffle=False, socket=d.socket, output="torch",
                           device="cuda")
    list(loader)
    up = loader._uploader
    if up.mode != "registered":
        pytest.skip(f"this device cannot register host memory read-only (error {up.last_register_error})")
    start, _ = loader._mapping_range()
    assert list(up.registered) == [start]
    list(loader)
    assert list(up.registered) == [start]
    loader.close()
    assert not up.registered


@needs_gpu
def test_slots_are_released_only_after_their_copy_completed(start_daemon, stoker, data) -> None:
    """A batch whose copy is queued behind a long GPU job keeps its slot."""
    d = start_daemon(depth=4)
    loader = stoker.Loader(data.spec(stoker), batch_size=BATCH, shuffle=False, socket=d.socket, output="torch",
                           device="cuda:0")
    it = iter(loader)
    first = next(it)
    up = loader._uploader
    # Queue a long job on the side stream, then a copy behind it: it cannot have completed.
    with torch.cuda.stream(up.stream):
        torch.cuda._sleep(int(2e9))
    second = next(it)
    assert up.inflight, "the copy queued behind the sleep was released already"
    event, held = up.inflight[-1]
    assert not event.query()
    # The uploader still holds that batch's slot arrays (their base is the lease).
    assert all(isinstance(v, (np.ndarray, list)) for v in held.values())
    up.reap(keep=0)
    assert not up.inflight
    assert torch.equal(second["label"].cpu(), torch.arange(BATCH, 2 * BATCH, dtype=second["label"].dtype))
    del first
    loader.close()


@needs_gpu
def test_the_current_stream_waits_for_the_copy(start_daemon, stoker, data) -> None:
    """No explicit synchronisation: work on the current stream sees the data even
    when the copy stream was held up."""
    d = start_daemon(depth=4)
    ref = cpu_batches(stoker, data, d.socket)
    loader = stoker.Loader(data.spec(stoker), batch_size=BATCH, shuffle=False, socket=d.socket, output="torch",
                           device="cuda:0")
    it = iter(loader)
    next(it)
    up = loader._uploader
    with torch.cuda.stream(up.stream):
        torch.cuda._sleep(int(1e9))  # the copy of the next-but-one batch queues behind this
    sums = []
    for b in it:
        sums.append(b["x"].double().sum())  # runs on the current stream
    expect = [float(np.asarray(r["x"], dtype=np.float64).sum()) for r in ref[1:]]
    assert [float(s) for s in sums] == pytest.approx(expect)


@needs_gpu
def test_state_dict_counts_delivered_batches_not_the_prefetched_one(start_daemon, stoker, data) -> None:
    d = start_daemon(depth=4)
    loader = stoker.Loader(data.spec(stoker), batch_size=BATCH, shuffle=False, socket=d.socket, output="torch",
                           device="cuda:0")
    it = iter(loader)
    next(it)
    next(it)
    state = loader.state_dict()
    assert state["step"] == 2
    again = pickle.loads(pickle.dumps(loader))
    again.load_state_dict(state)
    b = next(iter(again))
    assert b["label"].cpu().tolist() == list(range(2 * BATCH, 3 * BATCH))
