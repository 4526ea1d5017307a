"""Training-loop client of the stoker data-serving daemon.

A :class:`Loader` streams batches from a stoker daemon running on this node.
Each batch is a ``dict`` mapping field names to read-only numpy arrays that
live in shared memory: no copy, no unpickling. The slot holding a batch goes
back to the daemon when the last of its arrays is garbage-collected, so keep
copies (``arr.copy()``) of anything you want to hold on to for long.

>>> import stoker
>>> loader = stoker.Loader(stoker.hdf5("/data/*.h5", fields={"x": "images"}), batch_size=64)
>>> for epoch in range(2):
...     loader.set_epoch(epoch)
...     for batch in loader:
...         x = torch.from_numpy(batch["x"])
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ._native import (
    DEFAULT_SOCKET,
    SOCKET_ENV,
    AccessDenied,
    DaemonUnavailable,
    DatasetError,
    LimitError,
    NativeStream as _NativeStream,
    ProtocolError,
    StokerError,
    __version__,
)

__all__ = [
    "Loader",
    "Hdf5Spec",
    "hdf5",
    "StokerError",
    "DaemonUnavailable",
    "DatasetError",
    "ProtocolError",
    "LimitError",
    "AccessDenied",
    "__version__",
]

Batch = Dict[str, np.ndarray]


@dataclass(frozen=True)
class Hdf5Spec:
    """An ad-hoc HDF5 dataset: files matching ``files`` (sorted), one HDF5 path per field."""

    files: str
    fields: Mapping[str, str] = field(default_factory=dict)
    window: Optional[Tuple[int, int]] = None
    per_item: Tuple[str, ...] = ()

    def _wire(self) -> tuple:
        fields = [(str(k), str(v)) for k, v in self.fields.items()]
        return ("hdf5", self.files, fields, self.window, list(self.per_item))


def hdf5(
    files: Union[str, os.PathLike],
    fields: Mapping[str, str],
    window: Optional[Mapping[str, int]] = None,
    per_item: Sequence[str] = (),
) -> Hdf5Spec:
    """Describe an HDF5 dataset for :class:`Loader`.

    ``files`` is an absolute path or glob (files are concatenated in sorted
    order); ``fields`` maps each field name to an HDF5 dataset path. Sample
    ``i`` is row ``i`` along the first axis of every field.

    With ``window={"size": s, "stride": k}`` samples are windows along axis 1
    (time): every item (row) of a file shaped ``[items, T, ...]`` yields
    ``(T - s) // k + 1`` samples, and sample ``(item, start)`` delivers
    ``field[item, start:start + s]``; fields named in ``per_item`` are
    delivered whole, ``field[item]`` (per-trajectory constants, say).

    The daemon only serves ad-hoc datasets under its configured ``allowed_roots``.
    """
    files = os.path.abspath(os.fspath(files))
    if not fields:
        raise ValueError("fields must map at least one field name to an HDF5 dataset path")
    win = None
    if window is not None:
        unknown = set(window) - {"size", "stride"}
        if unknown or "size" not in window:
            raise ValueError(f"window takes 'size' and optionally 'stride', got {dict(window)!r}")
        win = (int(window["size"]), int(window.get("stride", 1)))
        if win[0] < 1 or win[1] < 1:
            raise ValueError(f"window size and stride must be at least 1, got {win}")
    elif per_item:
        raise ValueError("per_item needs a window: without one every field is delivered per item")
    missing = [f for f in per_item if f not in fields]
    if missing:
        raise ValueError(f"per_item names {missing}, which are not in fields")
    return Hdf5Spec(files, dict(fields), win, tuple(per_item))


def _env_int(*names: str) -> Optional[int]:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return int(value)
    return None


def _rank_world(rank: Optional[int], world_size: Optional[int]) -> Tuple[int, int]:
    if rank is None:
        rank = _env_int("RANK") if os.environ.get("RANK") else _env_int("SLURM_PROCID")
    if world_size is None:
        world_size = _env_int("WORLD_SIZE") if os.environ.get("WORLD_SIZE") else _env_int("SLURM_NTASKS")
    rank = 0 if rank is None else rank
    world_size = 1 if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} must be in [0, world_size) and world_size {world_size} at least 1")
    return rank, world_size


class Loader:
    """Batches of a dataset served by the stoker daemon, sharded like ``DistributedSampler``.

    ``dataset`` is a dataset name from the daemon's config or a spec from
    :func:`hdf5`. Every rank computes the same permutation from
    ``(seed, epoch)``; rank ``r`` takes positions ``r, r + world_size, ...``,
    padded by wrap-around (or truncated with ``drop_last``) so all ranks get
    ``len(loader)`` batches. ``rank``/``world_size`` default to ``RANK``/
    ``WORLD_SIZE``, else ``SLURM_PROCID``/``SLURM_NTASKS``, else 0/1; ``socket``
    to ``$STOKER_SOCKET``, else the daemon's default socket.

    The constructor connects and opens the stream, so a missing daemon
    (:class:`DaemonUnavailable`) or a bad dataset (:class:`DatasetError`)
    raises here. Iterating yields dicts of read-only numpy arrays backed by
    shared memory.
    """

    def __init__(
        self,
        dataset: Union[str, Hdf5Spec],
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        socket: Optional[Union[str, os.PathLike]] = None,
    ) -> None:
        if isinstance(dataset, str):
            wire = ("name", dataset)
        elif isinstance(dataset, Hdf5Spec):
            wire = dataset._wire()
        else:
            raise TypeError(f"dataset must be a name or stoker.hdf5(...), not {type(dataset).__name__}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {batch_size}")
        self.rank, self.world_size = _rank_world(rank, world_size)
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.socket = os.fspath(socket) if socket is not None else os.environ.get(SOCKET_ENV, DEFAULT_SOCKET)
        self._epoch = 0
        self._step = 0
        self._resume: Optional[int] = None
        self._stream = _NativeStream(
            self.socket, wire, self.batch_size, self.shuffle, self.seed, self.drop_last,
            self.rank, self.world_size, 0, 0,
        )
        self._info = self._stream.info()

    def __len__(self) -> int:
        """Batches per epoch for this rank."""
        return int(self._info["batches_per_epoch"])

    @property
    def fields(self) -> Dict[str, Tuple[np.dtype, Tuple[int, ...]]]:
        """Field name → (dtype, per-sample shape)."""
        return {n: (np.dtype(d), tuple(s)) for n, d, s in self._info["fields"]}

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose permutation the next iteration follows (as ``DistributedSampler.set_epoch``).

        After :meth:`load_state_dict`, setting the saved epoch keeps the saved
        step, so the usual ``for epoch in range(start, n): set_epoch(epoch)``
        loop resumes mid-epoch.
        """
        epoch = int(epoch)
        if epoch != self._epoch:
            self._resume = None
        self._epoch = epoch

    def __iter__(self) -> Iterator[Batch]:
        start = self._resume if self._resume is not None else 0
        self._resume = None
        self._stream.set_epoch(self._epoch, start)
        self._step = start
        return _EpochIterator(self)

    def state_dict(self) -> Dict[str, Any]:
        """Where this loader stands: load it into a new Loader to resume at the next batch."""
        return {
            "seed": self.seed,
            "epoch": self._epoch,
            "step": self._step,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "rank": self.rank,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next iteration starts at its epoch and step."""
        for key in ("seed", "batch_size", "shuffle", "drop_last", "world_size"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"state has {key}={state[key]!r} but this loader has {getattr(self, key)!r}; "
                    "resuming with a different sampling would repeat or skip samples"
                )
        step = int(state["step"])
        if not 0 <= step <= len(self):
            raise ValueError(f"state step {step} is outside this loader's epoch of {len(self)} batches")
        self._epoch = int(state["epoch"])
        self._resume = step

    def close(self) -> None:
        """Close the stream; its shared memory is freed once no batch of it is referenced."""
        if self._stream is not None:
            try:
                self._stream.close()
            except StokerError:
                pass

    def __enter__(self) -> "Loader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _mapping_range(self) -> Tuple[int, int]:
        """(address, length) of the stream's shared-memory mapping; for tests."""
        return self._stream.mapping_range()

    def __repr__(self) -> str:
        return (
            f"Loader(batch_size={self.batch_size}, rank={self.rank}, world_size={self.world_size}, "
            f"epoch={self._epoch}, batches={len(self)})"
        )


class _EpochIterator:
    """One pass over an epoch. Holds no batch between ``next`` calls."""

    __slots__ = ("_loader", "_next")

    def __init__(self, loader: Loader) -> None:
        self._loader = loader
        self._next = loader._stream.next

    def __iter__(self) -> "_EpochIterator":
        return self

    def __next__(self) -> Batch:
        batch = self._next()
        if batch is None:
            raise StopIteration
        self._loader._step += 1
        return batch
