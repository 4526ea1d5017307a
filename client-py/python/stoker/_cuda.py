"""``Loader(..., output="torch", device="cuda:N")``: batches copied to a GPU straight from the ring.

The stream's ring is registered once with the CUDA driver, read-only, through
a second, shared read-only view of the ring (``shared_range()``), and copies
read each array's bytes at the same offset in that view. Batches themselves
are arrays of the copy-on-write (private) mapping, and pinning a private
mapping, even read-only, makes the kernel break copy-on-write first: the GPU
would read private copies of what the slots held at registration, never the
daemon's later batches (every batch from the ring's depth on was stale when
the private mapping was registered on an H100). Each batch is copied with
``tensor.to(device, non_blocking=True)`` on a side stream, an event is
recorded after the copies, and the batch's slot is kept until that event
completed. The caller's current stream waits on the event
(``wait_event``) and each tensor is tied to it (``record_stream``), so no
synchronisation is needed in the training loop. Where the device cannot
register memory read-only, and for the rare extra segments (which are unmapped
as soon as their slot goes back), batches go through a small pinned staging
ring instead: one host copy, then the same asynchronous device copy.

Registration talks to the driver (``libcuda``) through ctypes rather than
through ``torch.cuda.cudart()``: a failed runtime call (an unsupported flag)
would stay behind as the runtime's last error and surface in torch's next
kernel-launch check, and the runtime binding exposes no way to ask whether
read-only registration is supported. Driver calls leave no such state.
"""

from __future__ import annotations

import collections
import ctypes
import os
from typing import Any, Deque, Dict, List, Optional, Tuple

import numpy as np

from ._errors import DeviceUnavailable

CU_MEMHOSTREGISTER_PORTABLE = 0x01
CU_MEMHOSTREGISTER_READ_ONLY = 0x08
CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED = 113

#: Upload paths: straight from the registered ring, or through pinned staging.
MODES = ("auto", "registered", "staging")
#: Pinned staging buffers kept (one being filled while the other is read).
STAGING_BUFFERS = 2


def resolve_device(device: Any, output: str) -> Optional[str]:
    """``None`` for host tensors (``None`` or ``"cpu"``), else the checked ``"cuda:N"``.

    Raises :class:`ValueError` for a device that is not a CUDA or CPU device
    or without ``output="torch"``, :class:`DeviceUnavailable` where torch
    cannot reach that GPU (no torch with CUDA, no driver, no such device).
    """
    if device is None:
        return None
    text = str(device)
    kind, _, index = text.partition(":")
    if kind == "cpu" and index in ("", "0"):
        return None
    if kind != "cuda" or not (index == "" or index.isdigit()):
        raise ValueError(f"device must be None, 'cpu', 'cuda' or 'cuda:N', not {device!r}")
    if output != "torch":
        raise ValueError(f"device={text!r} needs output='torch' (numpy arrays live in host memory)")
    try:
        import torch
    except ImportError as e:
        raise DeviceUnavailable(f"device={text!r} needs PyTorch with CUDA, and torch cannot be imported: {e}") from None
    if torch.version.cuda is None:
        raise DeviceUnavailable(
            f"device={text!r}: this torch ({torch.__version__}) was built without CUDA; install a CUDA build "
            "of torch, or pass device=None for CPU tensors"
        )
    if not torch.cuda.is_available():
        raise DeviceUnavailable(
            f"device={text!r}: torch.cuda.is_available() is False here (torch {torch.__version__} for CUDA "
            f"{torch.version.cuda}; no NVIDIA GPU or driver is visible, see nvidia-smi and "
            "$CUDA_VISIBLE_DEVICES); run on a GPU node, or pass device=None for CPU tensors"
        )
    ordinal = int(index) if index else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if ordinal >= count:
        raise DeviceUnavailable(f"device={text!r}: this process sees {count} CUDA device(s), numbered from 0")
    return f"cuda:{ordinal}"


class _Driver:
    """The few CUDA driver calls registration needs, on the primary context torch uses."""

    def __init__(self, ordinal: int) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise DeviceUnavailable(f"cannot load the NVIDIA driver library libcuda.so.1: {e}") from None
        self.lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self.lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
        self.lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        self.lib.cuCtxPushCurrent_v2.argtypes = [ctypes.c_void_p]
        self.lib.cuCtxPopCurrent_v2.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self._check(self.lib.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self._check(self.lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
        self.dev = dev.value
        ctx = ctypes.c_void_p()
        self._check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), self.dev), "cuDevicePrimaryCtxRetain")
        self.ctx = ctx
        value = ctypes.c_int()
        # A driver too old to know the attribute answers an error: not supported.
        code = self.lib.cuDeviceGetAttribute(
            ctypes.byref(value), CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED, self.dev
        )
        self.read_only_supported = code == 0 and value.value == 1

    @staticmethod
    def _check(code: int, call: str) -> None:
        if code != 0:
            raise DeviceUnavailable(f"CUDA driver call {call} failed with error {code}")

    def _in_context(self, fn: Any, *args: Any) -> int:
        self.lib.cuCtxPushCurrent_v2(self.ctx)
        try:
            return int(fn(*args))
        finally:
            self.lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))

    def register_read_only(self, start: int, length: int) -> int:
        """0 on success, else the driver's error code."""
        flags = CU_MEMHOSTREGISTER_READ_ONLY | CU_MEMHOSTREGISTER_PORTABLE
        return self._in_context(self.lib.cuMemHostRegister_v2, start, length, flags)

    def unregister(self, start: int) -> None:
        self._in_context(self.lib.cuMemHostUnregister, start)

    def release(self) -> None:
        self.lib.cuDevicePrimaryCtxRelease_v2(self.dev)


class Uploader:
    """Copies batches (dicts of ring-backed numpy arrays) to one GPU on a side stream.

    ``mode``: ``"auto"`` registers the ring when the device supports read-only
    registration and stages otherwise; ``"registered"`` refuses to stage the
    ring; ``"staging"`` always stages (for comparisons).
    """

    def __init__(self, device: str, mode: str = "auto") -> None:
        import torch

        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        self.torch = torch
        self.device = torch.device(device)
        self.pid = os.getpid()
        self.stream = torch.cuda.Stream(self.device)
        self.driver = _Driver(self.device.index or 0)
        if mode == "registered" and not self.driver.read_only_supported:
            raise DeviceUnavailable(f"{device} cannot register host memory read-only (mode='registered')")
        self.mode = "staging" if mode == "staging" or not self.driver.read_only_supported else "registered"
        #: ring start (its private mapping) → (length, the native stream that
        #: owns the mapping: kept alive, so the ring cannot be unmapped while
        #: registered, the start of the registered shared read-only view).
        self.registered: Dict[int, Tuple[int, Any, int]] = {}
        #: (event, what must live until it completed: a batch's arrays, i.e. its lease).
        self.inflight: Deque[Tuple[Any, Any]] = collections.deque()
        #: (pinned uint8 buffer, event of the last copy that read it).
        self.staging: Deque[Tuple[Any, Any]] = collections.deque()
        self.last_register_error = 0
        self._closed = False

    # -- registration ------------------------------------------------------

    def _registered_ring(self, native: Any) -> Optional[Tuple[int, int, int]]:
        """``(start, length, view)`` of `native`'s ring: its private mapping's
        range and the start of its registered shared view, registering it now
        if need be."""
        if self.mode != "registered":
            return None
        start, length = native.mapping_range()
        have = self.registered.get(start)
        if have is not None and have[1] is native:
            return start, length, have[2]
        self._drop_stale(keep=native)
        try:
            view, view_length = native.shared_range()
        except OSError:
            view, view_length = 0, 0
        code = self.driver.register_read_only(view, view_length) if view_length == length else -1
        if code != 0:
            # Not supported after all (or refused): stage from now on.
            self.last_register_error = code
            self.mode = "staging"
            return None
        self.registered[start] = (length, native, view)
        return start, length, view

    def _drop_stale(self, keep: Any) -> None:
        """Unregisters rings of streams other than `keep` (a reconnect replaced them)."""
        stale = [s for s, (_, owner, _) in self.registered.items() if owner is not keep]
        if stale:
            self.synchronize()
            for start in stale:
                self.driver.unregister(self.registered.pop(start)[2])

    # -- uploads -----------------------------------------------------------

    def reap(self, keep: int = 0) -> None:
        """Releases the slots whose copies completed; waits for all but the newest `keep`."""
        while len(self.inflight) > keep:
            event, _ = self.inflight[0]
            event.synchronize()
            self.inflight.popleft()
        while self.inflight and self.inflight[0][0].query():
            self.inflight.popleft()

    def upload(self, native: Any, batch: Dict[str, Any]) -> Tuple[Dict[str, Any], Any]:
        """Queues the copies of `batch` and returns ``(tensors, event)`` at once."""
        torch = self.torch
        parts: List[np.ndarray] = []
        for value in batch.values():
            parts.extend(value if isinstance(value, list) else [value])
        ring = self._registered_ring(native)
        direct = ring is not None and all(_inside(a, ring[0], ring[1]) for a in parts)
        with torch.cuda.stream(self.stream):
            if direct and ring is not None:
                start, view = ring[0], ring[2]
                copies = [torch.from_numpy(_in_view(a, start, view)).to(self.device, non_blocking=True) for a in parts]
                hold: Any = batch
            else:
                copies = self._staged(parts)
                hold = None
            event = torch.cuda.Event()
            event.record(self.stream)
        if hold is not None:
            self.inflight.append((event, hold))
        else:
            self.staging[-1] = (self.staging[-1][0], event)
        it = iter(copies)
        out: Dict[str, Any] = {}
        for name, value in batch.items():
            out[name] = [next(it) for _ in value] if isinstance(value, list) else next(it)
        return out, event

    def _staged(self, parts: List[np.ndarray]) -> List[Any]:
        """One host copy into a pinned buffer, then device copies from it (on the side stream)."""
        torch = self.torch
        need = sum(a.nbytes for a in parts)
        buf = None
        if len(self.staging) >= STAGING_BUFFERS:
            old, last = self.staging.popleft()
            if last is not None:
                last.synchronize()
            if old.numel() >= need:
                buf = old
        if buf is None:
            buf = torch.empty(max(need, 1), dtype=torch.uint8, pin_memory=True)
        self.staging.append((buf, None))
        host = buf.numpy()
        copies = []
        at = 0
        for a in parts:
            n = a.nbytes
            host[at : at + n] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
            dev = buf[at : at + n].to(self.device, non_blocking=True)
            copies.append(dev.view(_torch_dtype(torch, a.dtype)).reshape(a.shape))
            at += n
        return copies

    def hand_over(self, tensors: Dict[str, Any], event: Any) -> Dict[str, Any]:
        """Makes the caller's current stream wait for the copies and own the tensors."""
        current = self.torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for value in tensors.values():
            for t in value if isinstance(value, list) else [value]:
                t.record_stream(current)
        return tensors

    def synchronize(self) -> None:
        self.stream.synchronize()
        self.inflight.clear()

    def close(self) -> None:
        """Waits for every copy, releases the slots and unregisters the rings."""
        if self.pid != os.getpid():
            # A forked child: the driver state and the mappings are the parent's.
            self.registered.clear()
            self.inflight.clear()
            return
        if self._closed:
            return
        self.synchronize()
        for _, _, view in self.registered.values():
            self.driver.unregister(view)
        self.registered.clear()
        self.driver.release()
        self._closed = True

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _in_view(a: np.ndarray, start: int, view: int) -> np.ndarray:
    """The same bytes as `a` (a contiguous array in the private mapping at
    `start`) in the shared view at `view`: what the registration pinned."""
    ptr = a.__array_interface__["data"][0]
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * a.nbytes).from_address(view + ptr - start))
    return raw.view(a.dtype).reshape(a.shape)


def _inside(a: np.ndarray, start: int, length: int) -> bool:
    ptr = a.__array_interface__["data"][0]
    return start <= ptr and ptr + a.nbytes <= start + length


def _torch_dtype(torch: Any, dtype: np.dtype) -> Any:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype
