"""Iteration over one epoch of a :class:`~stoker.Loader`: batches as numpy
arrays, torch tensors (``output="torch"``) or CUDA tensors (``device=``)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, Union

import numpy as np

from . import _cuda
from ._errors import DaemonUnavailable

if TYPE_CHECKING:
    from ._loader import Loader

#: A batch: field name → array ``[b, ...]``, or a list of per-sample arrays for variable-shape fields.
Batch = Dict[str, Union[np.ndarray, List[np.ndarray]]]


def _torch_converter() -> Callable[[Dict[str, Any]], Dict[str, Any]]:
    """The batch → tensors conversion; imports torch (only ``output="torch"`` pays for it)."""
    import torch

    from_numpy = torch.from_numpy

    def convert(batch: Dict[str, Any]) -> Dict[str, Any]:
        for name, value in batch.items():
            if isinstance(value, list):
                batch[name] = [from_numpy(a) for a in value]
            else:
                batch[name] = from_numpy(value)
        return batch

    return convert


class _EpochIterator:
    """One pass over an epoch. Holds no batch between ``next`` calls."""

    __slots__ = ("_loader", "_next", "_timeout", "_generation", "_convert")

    def __init__(self, loader: Loader) -> None:
        self._loader = loader
        self._next = loader._native().next
        self._timeout = loader.timeout
        self._generation = loader._generation
        self._convert = loader._convert

    def __iter__(self) -> _EpochIterator:
        return self

    def __next__(self) -> Batch:
        loader = self._loader
        if self._generation != loader._generation:
            raise RuntimeError(
                "stoker: this iterator was replaced by a newer iter(loader), which restarted the epoch; "
                "use the newest iterator"
            )
        if loader._pid != os.getpid():
            # Forked: the parent's connection is not ours; open our own at the same position.
            self._next = loader._native().next
        try:
            try:
                batch = self._next(self._timeout)
            except DaemonUnavailable as e:
                if loader.reconnect <= 0:
                    raise
                loader._reconnect(e)
                self._next = loader._stream.next  # type: ignore[union-attr]
                batch = self._next(self._timeout)
        finally:
            # The daemon's count, not ours: it also moves past failed batches
            # and past replies that arrived after a timeout.
            epoch, step = loader._stream.position()  # type: ignore[union-attr]
            if epoch == loader._epoch:
                loader._step = step
        if batch is None:
            raise StopIteration
        if self._convert is not None:
            return self._convert(batch)
        return batch


class _CudaEpochIterator:
    """One pass over an epoch with ``device=``: batch k+1 is fetched and its
    copy queued before batch k is handed out, so the copy overlaps the use of
    batch k. A failure fetching batch k+1 is raised at the next call, after
    batch k was delivered; ``state_dict`` counts only delivered batches."""

    __slots__ = ("_loader", "_inner", "_generation", "_ahead")

    def __init__(self, loader: Loader) -> None:
        self._loader = loader
        self._inner = _EpochIterator(loader)
        self._inner._convert = None  # numpy views of the slot; the uploader makes the tensors
        self._generation = loader._generation
        #: ("batch", (tensors, event), step after) | ("error", exc, step) | ("end", None, step), or None.
        self._ahead: Optional[Tuple[str, Any, int]] = None

    def __iter__(self) -> _CudaEpochIterator:
        return self

    def _uploader(self) -> _cuda.Uploader:
        loader = self._loader
        up = loader._uploader
        if up is None or up.pid != os.getpid():
            assert loader.device is not None
            up = loader._uploader = _cuda.Uploader(loader.device)
        return up

    def _fetch(self) -> Tuple[str, Any, int]:
        loader = self._loader
        delivered = loader._step
        up = self._uploader()
        # Keep at most the newest copy in flight while waiting: two slots suffice.
        up.reap(keep=1)
        try:
            batch = next(self._inner)
        except StopIteration:
            return ("end", None, loader._step)
        except Exception as e:  # raised after the batch before it is delivered
            return ("error", e, loader._step)
        finally:
            after, loader._step = loader._step, delivered
        return ("batch", up.upload(loader._stream, batch), after)

    def __next__(self) -> Dict[str, Any]:
        loader = self._loader
        if self._generation != loader._generation:
            raise RuntimeError(
                "stoker: this iterator was replaced by a newer iter(loader), which restarted the epoch; "
                "use the newest iterator"
            )
        current = self._ahead if self._ahead is not None else self._fetch()
        kind, payload, after = current
        if kind == "end":
            # As without device=: the end of the epoch leaves the step past the last batch.
            self._ahead = current
            raise StopIteration
        self._ahead = self._fetch() if kind == "batch" else None
        loader._step = after
        if kind == "error":
            raise payload
        tensors, event = payload
        return self._uploader().hand_over(tensors, event)
