"""Training-loop client of the stoker data-serving daemon.

A :class:`Loader` streams batches from a stoker daemon running on this node.
Each batch is a ``dict`` mapping field names to numpy arrays (or, with
``output="torch"``, CPU tensors) that live in shared memory: no copy, no
unpickling. Writes to a batch are copy-on-write and stay in this process. The
slot holding a batch goes back to the daemon when the last of its arrays is
garbage-collected, so copy what you want to hold on to for long.

>>> import stoker
>>> loader = stoker.Loader(stoker.hdf5("/data/*.h5", fields={"x": "images"}), batch_size=64, output="torch")
>>> for epoch in range(2):
...     loader.set_epoch(epoch)
...     for batch in loader:
...         x = batch["x"].to("cuda", non_blocking=True)
"""

# The package's modules, one concept each: `_specs` (hdf5(), lmdb() and their
# specs), `_distributed` (rank and world size), `_loader` (Loader, fork
# handling), `_iterators` (one epoch's batches), `_cuda` (device= uploads),
# `_errors` (exception classes), `_cli` (the wheel's console command) and the
# Rust extension `_native`. This file only re-exports.

from . import _errors
from ._cli import daemon_binary

# The exception classes, each named once: in `_errors.__all__`.
from ._errors import *  # noqa: F403
from ._iterators import Batch as Batch
from ._loader import (
    DEFAULT_BLOCK_WINDOW as DEFAULT_BLOCK_WINDOW,
    MAX_BLOCK_SIZE as MAX_BLOCK_SIZE,
    MAX_BLOCK_WINDOW as MAX_BLOCK_WINDOW,
    Loader,
    # Not public: pickles of `loader.sampler` made before the split name `stoker._EpochSampler`.
    _EpochSampler as _EpochSampler,
)
from ._native import DEFAULT_SOCKET as DEFAULT_SOCKET, SOCKET_ENV as SOCKET_ENV, TRANSFORM_STEPS, __version__
from ._specs import Hdf5Spec, LmdbSpec, hdf5, lmdb

__all__ = [
    "Loader",
    "Hdf5Spec",
    "LmdbSpec",
    "hdf5",
    "lmdb",
    "__version__",
    "daemon_binary",
    "TRANSFORM_STEPS",
]
__all__ += _errors.__all__
