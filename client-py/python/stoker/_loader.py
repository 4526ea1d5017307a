"""The :class:`Loader`: its arguments, stream, position (``state_dict``),
epochs, pickling and fork handling, and the ``sampler`` handle frameworks
call ``set_epoch`` on."""

from __future__ import annotations

import os
import sys
import time
import warnings
import weakref
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple, Union

import numpy as np

from . import _cuda
from ._distributed import _log_rank_choice, _rank_world
from ._errors import DaemonUnavailable, DatasetError, StokerError
from ._iterators import Batch, _CudaEpochIterator, _EpochIterator, _torch_converter
from ._native import DEFAULT_SOCKET, SOCKET_ENV, NativeStream as _NativeStream
from ._specs import Hdf5Spec, LmdbSpec

_OUTPUTS = ("numpy", "torch")

#: Bounds of ``block_size`` and ``block_window`` (the daemon checks them again).
MAX_BLOCK_SIZE = 1 << 32
MAX_BLOCK_WINDOW = 1 << 32
#: ``block_window`` when ``shuffle="block"`` is given without one.
DEFAULT_BLOCK_WINDOW = 8


def _block_order(
    shuffle: Any, block_size: Optional[int], block_window: Optional[int]
) -> Tuple[Union[bool, str], Optional[int], Optional[int]]:
    """Checks ``shuffle``/``block_size``/``block_window``: ``(shuffle, block_size, block_window)``,
    the last two ``None`` unless ``shuffle == "block"``."""
    if isinstance(shuffle, str):
        if shuffle != "block":
            raise ValueError(f"shuffle must be True, False or 'block', not {shuffle!r}")
    else:
        if block_size is not None or block_window is not None:
            raise ValueError(
                "block_size and block_window choose the locality order: pass shuffle='block' with them"
            )
        return bool(shuffle), None, None
    if block_size is None:
        raise ValueError(
            "shuffle='block' needs block_size: consecutive samples per block, e.g. the HDF5 chunk's rows"
        )
    if block_window is None:
        block_window = DEFAULT_BLOCK_WINDOW

    def count(name: str, value: Any, most: int) -> int:
        if isinstance(value, bool) or not hasattr(value, "__index__"):
            raise ValueError(f"{name} must be an integer, not {value!r}")
        value = int(value.__index__())
        if not 1 <= value <= most:
            raise ValueError(f"{name} must be between 1 and {most}, not {value}")
        return value

    return (
        "block",
        count("block_size", block_size, MAX_BLOCK_SIZE),
        count("block_window", block_window, MAX_BLOCK_WINDOW),
    )


#: Every Loader with an open stream in this process (for the fork handler).
_open_loaders: weakref.WeakSet[Loader] = weakref.WeakSet()
#: Streams a forked child inherited from its parent, kept alive for good: the
#: parent's shared memory is not mapped in the child (MADV_DONTFORK), so the
#: child may map its own streams at those addresses, and dropping an inherited
#: stream would unmap them.
_inherited_streams: List[Any] = []


def _after_fork_in_child() -> None:
    for loader in list(_open_loaders):
        if loader._stream is not None:
            _inherited_streams.append(loader._stream)


os.register_at_fork(after_in_child=_after_fork_in_child)


def _torch_data() -> Any:
    """``torch.utils.data`` if this process imported it (never imports torch)."""
    return sys.modules.get("torch.utils.data")


def _as_iterable_dataset() -> None:
    """Makes :class:`Loader` a virtual ``torch.utils.data.IterableDataset``
    (``IterableDataset`` is an ABC), so ``DataLoader(loader, batch_size=None)``
    iterates it instead of failing with "'Loader' object is not subscriptable".
    Only once torch is imported: stoker does not import it."""
    data = _torch_data()
    dataset = getattr(data, "IterableDataset", None)
    if dataset is None or not hasattr(dataset, "register"):
        return
    try:
        if not issubclass(Loader, dataset):
            dataset.register(Loader)
    except TypeError:
        pass


def _refuse_many_dataloader_workers() -> None:
    """In a DataLoader worker process, each of ``num_workers`` workers would
    iterate its own copy of the Loader: every sample ``num_workers`` times.
    One worker is served as is; more are refused, saying what to do."""
    data = _torch_data()
    info = data.get_worker_info() if data is not None and hasattr(data, "get_worker_info") else None
    workers = getattr(info, "num_workers", 1) if info is not None else 1
    if workers > 1:
        raise RuntimeError(
            f"stoker: this Loader is being iterated in each of {workers} DataLoader worker processes, which "
            f"would deliver every sample {workers} times per epoch. stoker reads, decodes and batches in its "
            "daemon, so DataLoader workers add nothing: iterate the Loader directly, or wrap it as "
            "DataLoader(loader, batch_size=None) with num_workers=0 (the default). To run more processes, "
            "give each its own rank (rank=, world_size=) instead."
        )


class _EpochSampler:
    """What ``loader.sampler`` returns: the ``DistributedSampler``-like face of a
    :class:`Loader`, so frameworks that call ``dataloader.sampler.set_epoch(epoch)``
    every epoch (PyTorch Lightning's fit loop does) select the epoch's order."""

    __slots__ = ("_loader",)

    def __init__(self, loader: Loader) -> None:
        self._loader = loader

    def set_epoch(self, epoch: int) -> None:
        self._loader.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        return self._loader.epoch

    @property
    def shuffle(self) -> bool:
        return bool(self._loader.shuffle)

    @property
    def seed(self) -> int:
        return self._loader.seed

    @property
    def drop_last(self) -> bool:
        return self._loader.drop_last

    @property
    def rank(self) -> int:
        return self._loader.rank

    @property
    def num_replicas(self) -> int:
        return self._loader.world_size

    def __repr__(self) -> str:
        return f"<stoker sampler of {self._loader!r}>"


class Loader:
    """Batches of a dataset served by the stoker daemon, sharded like ``DistributedSampler``.

    ``dataset`` is a dataset name from the daemon's config or a spec from
    :func:`hdf5` / :func:`lmdb`. Every rank computes the same permutation from
    ``(seed, epoch)``; rank ``r`` takes positions ``r, r + world_size, ...``,
    padded by wrap-around (or truncated with ``drop_last``) so all ranks get
    ``len(loader)`` batches.

    ``rank``/``world_size``: both given, or neither, in which case they come
    from the first of: ``torch.distributed`` if this program imported it and
    initialised the process group; ``$RANK``/``$WORLD_SIZE`` (both, as torchrun
    sets them); Slurm's ``$SLURM_PROCID``/``$SLURM_NTASKS`` only inside an
    ``srun`` step of several tasks (``$SLURM_STEP_ID`` set); else 0 and 1.
    :attr:`rank_source` says which, and it is logged once at INFO on the
    ``"stoker"`` logger.

    ``shuffle="block"`` chooses the locality order for data bigger than
    memory: blocks of ``block_size`` consecutive samples are permuted, then
    samples are permuted within windows of ``block_window`` consecutive blocks
    (8 by default); still deterministic in ``(seed, epoch)`` and split across
    ranks exactly as above. It trades randomness for locality: see
    ``docs/python.md``. ``block_size`` and ``block_window`` are integers from
    1 to 2**32, given only with ``shuffle="block"`` (else ``ValueError``).

    ``socket`` defaults to ``$STOKER_SOCKET``, else the daemon's default
    socket. ``timeout`` (seconds, like DataLoader's) bounds each wait for the
    daemon and raises :class:`Timeout`; by default a wait lasts as long as it
    must (Ctrl-C always interrupts it). If the daemon goes away mid-epoch,
    iteration reconnects to whatever daemon answers at the socket within
    ``reconnect`` seconds and resumes at the next batch of the same epoch;
    ``reconnect=0`` raises :class:`DaemonUnavailable` instead.

    ``output="numpy"`` (the default) yields dicts of numpy arrays backed by
    shared memory; ``output="torch"`` yields dicts of CPU tensors over the same
    memory (``torch.from_numpy``, no copy). Variable-shape fields come as lists,
    one array or tensor per sample.

    ``device="cuda:N"`` (with ``output="torch"``) yields CUDA tensors: the
    stream's ring is registered once with the driver and each batch is copied
    asynchronously on a side stream, one batch ahead, so the copy of the next
    batch overlaps the use of this one; the current stream waits for the copy
    by itself. Without a usable GPU it raises :class:`DeviceUnavailable`;
    ``device=None`` (the default) or ``"cpu"`` yields host tensors. See
    ``docs/gpu.md``.

    The constructor connects and opens the stream, so a missing daemon
    (:class:`DaemonUnavailable`) or a bad dataset (:class:`DatasetError`)
    raises here. A Loader pickles (its configuration and position, not its
    connection) and reconnects lazily wherever it is used next: in the process
    that unpickles it, or in a child after ``os.fork()``.
    """

    def __init__(
        self,
        dataset: Union[str, Hdf5Spec, LmdbSpec],
        batch_size: int,
        shuffle: Union[bool, str] = True,
        seed: int = 0,
        drop_last: bool = False,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        socket: Optional[Union[str, os.PathLike]] = None,
        timeout: Optional[float] = None,
        reconnect: float = 60.0,
        output: str = "numpy",
        device: Optional[Any] = None,
        block_size: Optional[int] = None,
        block_window: Optional[int] = None,
    ) -> None:
        #: ``True``, ``False`` or ``"block"``; the block parameters are ``None`` unless ``"block"``.
        self.shuffle, self.block_size, self.block_window = _block_order(shuffle, block_size, block_window)
        if isinstance(dataset, str):
            wire = ("name", dataset)
        elif isinstance(dataset, (Hdf5Spec, LmdbSpec)):
            wire = dataset._wire()
        else:
            raise TypeError(
                f"dataset must be a name, stoker.hdf5(...) or stoker.lmdb(...), not {type(dataset).__name__}"
            )
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {batch_size}")
        if output not in _OUTPUTS:
            raise ValueError(f"output must be 'numpy' or 'torch', not {output!r}")
        #: ``"cuda:N"`` or ``None`` (host memory); checked before anything is opened.
        self.device: Optional[str] = _cuda.resolve_device(device, output)
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be positive seconds or None, not {timeout}")
        self.rank, self.world_size, self.rank_source = _rank_world(rank, world_size)
        _log_rank_choice(self.rank, self.world_size, self.rank_source)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.socket = os.fspath(socket) if socket is not None else os.environ.get(SOCKET_ENV, DEFAULT_SOCKET)
        self.timeout = timeout
        self.reconnect = float(reconnect)
        self.output = output
        self._wire = wire
        self._epoch = 0
        self._step = 0
        self._resume: Optional[int] = None
        self._reset_unconnected()
        _as_iterable_dataset()
        self._native()

    def _reset_unconnected(self) -> None:
        """The fields that do not survive pickling or fork."""
        self._stream: Optional[_NativeStream] = None
        self._info: Optional[Dict[str, Any]] = None
        self._pid = -1
        #: Epoch last iterated since the last set_epoch (for the repeated-epoch warning).
        self._iterated: Optional[int] = None
        self._warned_repeat = False
        #: Bumped by every iter(): an older iterator refuses to go on.
        self._generation = 0
        self._convert = _torch_converter() if self.output == "torch" else None
        #: The GPU uploader (``device=``), made at the first iteration in this process.
        self._uploader: Optional[_cuda.Uploader] = None

    def _open(self, epoch: int, step: int) -> _NativeStream:
        block = None
        if self.shuffle == "block":
            # _block_order sets both with shuffle="block" (and a pickle carries them).
            assert self.block_size is not None and self.block_window is not None
            block = (self.block_size, self.block_window)
        return _NativeStream(
            self.socket, self._wire, self.batch_size, bool(self.shuffle), self.seed, self.drop_last,
            self.rank, self.world_size, epoch, step, self.timeout, block,
        )

    def _native(self) -> _NativeStream:
        """The open stream, (re)opened here if this process has none: after
        unpickling, and in a child after ``os.fork()`` (the parent's
        connection belongs to the parent)."""
        stream = self._stream
        if stream is None or self._pid != os.getpid():
            stream = self._open(self._epoch, self._step)
            self._stream, self._pid = stream, os.getpid()
            self._info = stream.info()
            _open_loaders.add(self)
        return stream

    def _reconnect(self, error: DaemonUnavailable) -> None:
        """The daemon went away: reopen the stream at the next undelivered batch
        on whatever daemon answers at the socket within ``reconnect`` seconds."""
        deadline = time.monotonic() + self.reconnect
        while True:
            try:
                self._stream = self._open(self._epoch, self._step)
                self._pid = os.getpid()
                self._info = self._stream.info()
                break
            except DaemonUnavailable:
                if time.monotonic() >= deadline:
                    raise error from None
                time.sleep(0.2)
        warnings.warn(
            f"stoker: reconnected to the daemon at {self.socket} after it went away; "
            f"resuming epoch {self._epoch} at batch {self._step}",
            RuntimeWarning,
            stacklevel=3,
        )

    def _stream_info(self) -> Dict[str, Any]:
        if self._info is None or self._pid != os.getpid():
            self._native()
        assert self._info is not None
        return self._info

    def __len__(self) -> int:
        """Batches per epoch for this rank."""
        return int(self._stream_info()["batches_per_epoch"])

    @property
    def fields(self) -> Dict[str, Tuple[np.dtype, Tuple[int, ...]]]:
        """Field name → (dtype, per-sample shape)."""
        return {n: (np.dtype(d), tuple(s)) for n, d, s in self._stream_info()["fields"]}

    @property
    def epoch(self) -> int:
        """The epoch the next iteration follows (see :meth:`set_epoch`)."""
        return self._epoch

    @property
    def sampler(self) -> _EpochSampler:
        """A ``DistributedSampler``-like handle whose ``set_epoch`` is this loader's.

        PyTorch Lightning calls ``dataloader.sampler.set_epoch(epoch)`` at the
        start of every training epoch; this makes that select the epoch here.
        """
        return _EpochSampler(self)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose permutation the next iteration follows (as ``DistributedSampler.set_epoch``).

        After :meth:`load_state_dict`, setting the saved epoch keeps the saved
        step, so the usual ``for epoch in range(start, n): set_epoch(epoch)``
        loop resumes mid-epoch.

        A dataset opened with ``rescan="epoch"`` is matched again here, when
        the epoch changes, so ``len(loader)`` is the new epoch's right after.
        """
        epoch = int(epoch)
        if epoch < 0:
            raise ValueError(f"epoch must be at least 0, not {epoch}")
        if epoch != self._epoch:
            self._resume = None
        self._epoch = epoch
        self._iterated = None
        info = self._info
        if info is not None and info.get("rescan") and self._stream is not None and self._pid == os.getpid():
            start = self._resume if self._resume is not None else 0
            self._stream.set_epoch(epoch, start, self.timeout)
            self._info = self._stream.info()

    def __iter__(self) -> Iterator[Batch]:
        """One epoch. Like a ``DataLoader``'s, each ``iter()`` starts the epoch
        over from its first batch, except the first one after
        :meth:`load_state_dict`, which starts at the saved step."""
        _refuse_many_dataloader_workers()
        resuming = self._resume is not None
        start = self._resume if self._resume is not None else 0
        if self.shuffle and not resuming and self._iterated == self._epoch and not self._warned_repeat:
            self._warned_repeat = True
            warnings.warn(
                f"stoker: iterating epoch {self._epoch} again in the same order: call "
                f"loader.set_epoch(epoch) before each epoch (as with DistributedSampler) "
                f"to shuffle every epoch differently",
                RuntimeWarning,
                stacklevel=2,
            )
        self._iterated = self._epoch
        self._resume = None
        self._step = start
        self._generation += 1
        stream = self._native()
        try:
            stream.set_epoch(self._epoch, start, self.timeout)
        except DaemonUnavailable as e:
            if self.reconnect <= 0:
                raise
            self._reconnect(e)
        # A rescanned dataset's counts are the new epoch's.
        self._info = self._native().info()
        if getattr(self, "device", None) is not None:
            return _CudaEpochIterator(self)
        return _EpochIterator(self)

    def state_dict(self) -> Dict[str, Any]:
        """Where this loader stands: load it into a new Loader to resume at the next batch.

        Keys: ``epoch`` and ``step`` (the next batch), the sampling
        configuration (``block_size``/``block_window`` ``None`` unless
        ``shuffle="block"``), torchdata ``StatefulDataLoader``'s ``_num_yielded``
        (batches of this epoch already delivered, equal to ``step``) and
        ``_iterator_finished``, and the dataset generation the epoch reads:
        ``dataset_generation`` (a 64-bit fingerprint of the file list with
        each file's identity, or of an LMDB key list), ``dataset_files`` and
        ``dataset_samples`` (see :meth:`load_state_dict`).
        """
        info = self._stream_info()
        return {
            "seed": self.seed,
            "epoch": self._epoch,
            "step": self._step,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "block_size": self.block_size,
            "block_window": self.block_window,
            "drop_last": self.drop_last,
            "rank": self.rank,
            "world_size": self.world_size,
            "_num_yielded": self._step,
            "_iterator_finished": self._step >= len(self),
            "dataset_generation": int(info["generation"]),
            "dataset_files": int(info["files"]),
            "dataset_samples": int(info["samples"]),
        }

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Resume from :meth:`state_dict`: the next iteration starts at its epoch and step.

        Accepts ``_num_yielded`` in place of ``step``.

        The state records the dataset generation (which files, with which
        identity, or which LMDB keys) of the saved epoch. If the dataset is
        another generation now (files added, removed or changed since), the
        saved position does not continue the same order: this raises
        :class:`DatasetError` naming the old and new file and sample counts.
        ``strict=False`` continues anyway, at the saved epoch and step over
        the dataset as it is now (the step capped at the epoch's end), with
        a ``RuntimeWarning``.
        """
        for key in ("seed", "batch_size", "shuffle", "block_size", "block_window", "drop_last", "world_size"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"state has {key}={state[key]!r} but this loader has {getattr(self, key)!r}; "
                    "resuming with a different sampling would repeat or skip samples"
                )
        if "step" in state:
            step = int(state["step"])
        elif "_num_yielded" in state:
            step = int(state["_num_yielded"])
        else:
            raise ValueError("state has neither 'step' nor '_num_yielded': not a stoker.Loader state_dict")
        saved = state.get("dataset_generation")
        info = self._stream_info()
        if saved is not None and int(saved) != int(info["generation"]):
            message = (
                f"stoker: the dataset changed since this state was saved: it had {state.get('dataset_files', '?')} "
                f"files and {state.get('dataset_samples', '?')} samples (generation {int(saved):016x}), it now has "
                f"{info['files']} files and {info['samples']} samples (generation {int(info['generation']):016x}), "
                f"so epoch {state.get('epoch', self._epoch)} from batch {step} would not continue the saved order"
            )
            if strict:
                raise DatasetError(
                    message + "; pass strict=False to load_state_dict to continue over the dataset as it is now"
                )
            warnings.warn(message + "; continuing (strict=False)", RuntimeWarning, stacklevel=2)
            step = min(max(step, 0), len(self))
        if not 0 <= step <= len(self):
            raise ValueError(f"state step {step} is outside this loader's epoch of {len(self)} batches")
        self._epoch = int(state.get("epoch", self._epoch))
        self._resume = step
        self._step = step

    def close(self) -> None:
        """Close the stream; its shared memory is freed once no batch of it is referenced."""
        if getattr(self, "_uploader", None) is not None:
            self._uploader.close()  # type: ignore[union-attr]
            self._uploader = None
        if self._stream is not None and self._pid == os.getpid():
            try:
                self._stream.close()
            except StokerError:
                pass

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> Dict[str, Any]:
        # Configuration and position; the connection, mapping and batches stay behind.
        state = {
            k: v
            for k, v in self.__dict__.items()
            if k not in ("_stream", "_info", "_pid", "_iterated", "_warned_repeat", "_generation", "_convert")
            and k != "_uploader"
        }
        # Pickled mid-epoch, the position travels: the copy goes on where this
        # Loader was (what its state_dict says), as after load_state_dict. An
        # epoch iterated to its end starts over, as iter() does here.
        info = self._info
        batches = int(info["batches_per_epoch"]) if info is not None else None
        if self._resume is None and batches is not None and 0 < self._step < batches:
            state["_resume"] = self._step
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_unconnected()
        _as_iterable_dataset()

    def _mapping_range(self) -> Tuple[int, int]:
        """(address, length) of the stream's shared-memory mapping; for tests."""
        return self._native().mapping_range()

    def __repr__(self) -> str:
        batches = len(self) if self._info is not None else "?"
        return (
            f"Loader(batch_size={self.batch_size}, rank={self.rank}, world_size={self.world_size}, "
            f"epoch={self._epoch}, batches={batches}, output={self.output!r})"
        )


# Pickles, reprs and tracebacks name `stoker.Loader`, the name users import
# (and the one pickles made before this module existed hold); the package
# re-exports it there.
Loader.__module__ = "stoker"
