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

from __future__ import annotations

import json
import logging
import os
import sys
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from . import _errors
from ._errors import (
    AccessDenied,
    DaemonUnavailable,
    DatasetError,
    DeviceUnavailable,
    LimitError,
    ProtocolError,
    StokerError,
    Timeout,
)
from ._native import DEFAULT_SOCKET, SOCKET_ENV, NativeStream as _NativeStream, __version__
from ._native import TRANSFORM_STEPS, parse_steps as _parse_steps
from ._cli import daemon_binary
from . import _cuda

__all__ = [
    "Loader",
    "Hdf5Spec",
    "LmdbSpec",
    "hdf5",
    "lmdb",
    *_errors.__all__,
    "__version__",
    "daemon_binary",
    "TRANSFORM_STEPS",
]

#: A batch: field name → array ``[b, ...]``, or a list of per-sample arrays for variable-shape fields.
Batch = Dict[str, Union[np.ndarray, List[np.ndarray]]]


@dataclass(frozen=True)
class Hdf5Spec:
    """An ad-hoc HDF5 dataset: files matching ``files`` (sorted), one HDF5 path per field."""

    files: str
    fields: Mapping[str, str] = field(default_factory=dict)
    window: Optional[Tuple[int, int]] = None
    per_item: Tuple[str, ...] = ()
    #: The Well's sampling (``stoker_proto::Hdf5Sampling`` as JSON), or None.
    sampling: Optional[str] = None
    #: JSON list of ``FieldTransforms`` (field, steps, pair, spatial_axes), checked by :func:`hdf5`.
    transforms: str = "[]"
    #: ``"epoch"``: match the glob again at each new epoch; ``None``: once (see :func:`hdf5`).
    rescan: Optional[str] = None

    def _wire(self) -> tuple:
        fields = [(str(k), str(v)) for k, v in self.fields.items()]
        return (
            "hdf5", self.files, fields, self.window, list(self.per_item), self.sampling, self.transforms, self.rescan,
        )


def _rescan(rescan: Optional[str]) -> Optional[str]:
    if rescan not in (None, "never", "epoch"):
        raise ValueError(f"rescan must be 'epoch', 'never' or None, not {rescan!r}")
    return None if rescan == "never" else rescan


_WINDOW_KEYS = {"size", "stride", "n_steps_input", "n_steps_output", "dt_stride", "min_dt_stride", "max_dt_stride"}


def _window(window: Mapping[str, int]) -> Tuple[Tuple[int, int], Optional[int], Tuple[int, int]]:
    """``(size, stride)``, ``n_steps_input`` (None without a split) and ``(min_dt_stride, max_dt_stride)``."""
    w = {k: int(v) for k, v in window.items()}
    unknown = set(w) - _WINDOW_KEYS
    split = "n_steps_input" in w or "n_steps_output" in w
    if unknown or ("size" in w) == split or (split and not {"n_steps_input", "n_steps_output"} <= set(w)):
        raise ValueError(
            "window takes 'size' or both 'n_steps_input' and 'n_steps_output', optionally 'stride' and "
            f"'dt_stride' or 'min_dt_stride'/'max_dt_stride'; got {dict(window)!r}"
        )
    if "dt_stride" in w and ("min_dt_stride" in w or "max_dt_stride" in w):
        raise ValueError(f"give either dt_stride or min_dt_stride/max_dt_stride, not both; got {dict(window)!r}")
    size = w["size"] if "size" in w else w["n_steps_input"] + w["n_steps_output"]
    if max(size, *w.values()) >= 2**64:
        raise ValueError(f"window values (and n_steps_input + n_steps_output) must fit in 64 bits, got {dict(window)!r}")
    if min(w.values()) < 0 or size < 1 or w.get("stride", 1) < 1:
        raise ValueError(f"window size and stride must be at least 1 (and no value negative), got {dict(window)!r}")
    dt_min = w.get("dt_stride", w.get("min_dt_stride", 1))
    dt_max = w.get("dt_stride", w.get("max_dt_stride", dt_min))
    if dt_min < 1 or dt_max < dt_min:
        raise ValueError(f"the step spacing must be at least 1 and max_dt_stride at least min_dt_stride, got {dict(window)!r}")
    return (size, w.get("stride", 1)), w.get("n_steps_input"), (dt_min, dt_max)


def hdf5(
    files: Union[str, os.PathLike],
    fields: Mapping[str, str],
    window: Optional[Mapping[str, int]] = None,
    per_item: Sequence[str] = (),
    transforms: Optional[Mapping[str, Sequence[Any]]] = None,
    pair: Optional[Mapping[str, Tuple[str, int]]] = None,
    spatial_axes: Optional[Mapping[str, Tuple[int, int]]] = None,
    *,
    input: Sequence[str] = (),
    output: Sequence[str] = (),
    constant: Sequence[str] = (),
    time_only: Sequence[str] = (),
    rescan: Optional[str] = None,
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

    The Well's sampling (see ``docs/the-well.md``): ``window={"n_steps_input":
    a, "n_steps_output": b}`` takes windows of ``a + b`` steps; fields named in
    ``input`` get the first ``a`` steps, fields in ``output`` the next ``b``
    (map one HDF5 path to two field names to get both). ``"dt_stride": k``
    spaces a window's steps ``k`` apart; ``"min_dt_stride"``/``"max_dt_stride"``
    draw the spacing per sample (deterministic in seed, epoch and index), with
    windows per item counted at ``min_dt_stride`` as ``WellDataset`` counts
    them. ``constant`` fields have no item axis (``t0_fields/x`` shaped
    ``[x, y]``, a scalar): every sample gets the whole dataset of its file.
    ``time_only`` fields have a time axis but no item axis (``dimensions/time``
    shaped ``[T]``): every sample gets its window's steps of them (its input
    or output part when also listed in ``input`` or ``output``).

    ``transforms`` maps fields to steps run in the daemon (the list in
    docs/python.md: ``cast``, ``normalize``, ``permute``, ``chw``, crops,
    ``hflip``/``vflip``/``rot90``, ``downsample``, ...). Spatial steps act on
    the sample's axes 0 and 1 when it is 2-d, else on the two before the last
    (``[..., height, width, channels]``); ``spatial_axes={"p": (-2, -1)}``
    says otherwise. ``pair={"y": ("x", 1)}`` makes ``y``'s random steps draw
    what ``x``'s draw (input/output windows, LR/HR at scale 4).

    ``rescan="epoch"`` is for datasets that grow while training runs: at each
    new epoch (:meth:`Loader.set_epoch` to another epoch) the daemon matches
    the glob again, so files added since join, removed ones leave, changed
    ones are read afresh, the epoch's permutation is over the new sample count
    and ``len(loader)`` follows. The files matched must hold the same fields
    (dtype and sample shape). See ``docs/python.md`` ("Datasets that grow").

    The daemon only serves ad-hoc datasets under its configured ``allowed_roots``.
    """
    files = os.path.abspath(os.fspath(files))
    rescan = _rescan(rescan)
    if not fields:
        raise ValueError("fields must map at least one field name to an HDF5 dataset path")
    win, n_in, (dt_min, dt_max) = None, None, (1, 1)
    if window is not None:
        win, n_in, (dt_min, dt_max) = _window(window)
    elif per_item or input or output:
        raise ValueError("per_item, input and output need a window: without one every field is delivered per item")
    if time_only and window is None:
        raise ValueError("time_only fields take a window's steps; give a window")
    for name, names in (
        ("per_item", per_item),
        ("input", input),
        ("output", output),
        ("constant", constant),
        ("time_only", time_only),
    ):
        missing = [f for f in names if f not in fields]
        if missing:
            raise ValueError(f"{name} names {missing}, which are not in fields")
    sampling = None
    if n_in is not None or (dt_min, dt_max) != (1, 1) or input or output or constant or time_only:
        sampling = json.dumps(
            {
                "n_steps_input": n_in,
                "min_dt_stride": dt_min,
                "max_dt_stride": dt_max,
                "input": [str(f) for f in input],
                "output": [str(f) for f in output],
                "constant": [str(f) for f in constant],
                "time_only": [str(f) for f in time_only],
            }
        )
    named = set(transforms or {}) | set(pair or {}) | set(spatial_axes or {})
    unknown = named - set(fields)
    if unknown:
        raise ValueError(f"transforms/pair/spatial_axes name unknown fields {sorted(unknown)}")
    defs = []
    for name in fields:
        if name not in named:
            continue
        p = (pair or {}).get(name)
        axes = (spatial_axes or {}).get(name)
        defs.append(
            {
                "field": name,
                "steps": _steps(name, (transforms or {}).get(name, [])),
                "pair": None if p is None else {"with": p[0], "scale": int(p[1])},
                "spatial_axes": None if axes is None else [int(a) for a in axes],
            }
        )
    return Hdf5Spec(files, dict(fields), win, tuple(per_item), sampling, json.dumps(defs), rescan)


@dataclass(frozen=True)
class LmdbSpec:
    """An ad-hoc LMDB dataset (see :func:`lmdb`); ``definition`` is the daemon's dataset description."""

    definition: Mapping[str, Any]

    def _wire(self) -> tuple:
        return ("lmdb", json.dumps(self.definition))


def _plain(value: Any) -> Any:
    """JSON for numpy scalars and arrays in steps (``np.float32(0.5)``, ``np.array(mean)``)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"{value!r} is not a number, string, list or dict")


def _steps(field: str, steps: Sequence[Any]) -> List[Any]:
    """Checks one field's transform steps and expands their short forms, in Rust.

    The step set is the daemon's (``stoker_proto::TransformDef``; names in
    :data:`TRANSFORM_STEPS`), so this package keeps no copy of it. Accepted:
    ``"hflip"``, ``"vflip"``, ``"rot90"``, ``"chw"``, ``"to_f32"``;
    ``{"random_crop": 48}``, ``{"random_crop": (h, w)}``, ``{"center_crop": ...}``,
    ``{"resize": (h, w)}`` or ``{"resize": {"height": h, "width": w, "filter": "bicubic"}}``;
    ``{"to_f32": 1/255}``; ``{"cast": "float32"}``; ``{"permute": [2, 0, 1]}``;
    ``{"downsample": 2}`` or ``{"downsample": {"factor": 2, "mode": "stride"}}``;
    ``{"normalize": {"mean": [...], "std": [...]}}`` or
    ``{"normalize": {"stats": "/abs/stats.yaml", "key": "velocity"}}``.
    """
    if isinstance(steps, (str, Mapping)):
        raise ValueError(f"field {field!r}: transforms are a list of steps, not {steps!r}")
    try:
        text = json.dumps(list(steps), default=_plain)
    except TypeError as e:
        raise ValueError(f"field {field!r}: {e}") from None
    try:
        return json.loads(_parse_steps(text))
    except ValueError as e:
        raise ValueError(f"field {field!r}: {e}") from None


def lmdb(
    env: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]], Mapping[str, Union[str, os.PathLike]]],
    fields: Mapping[str, Union[str, Mapping[str, Any]]],
    transforms: Optional[Mapping[str, Sequence[Any]]] = None,
    pair: Optional[Mapping[str, Tuple[str, int]]] = None,
    key_file: Optional[Union[str, os.PathLike]] = None,
    key_prefix: Optional[str] = None,
    key_regex: Optional[str] = None,
    on_error: str = "fail",
    max_sample_bytes: Optional[Mapping[str, int]] = None,
    rescan: Optional[str] = None,
) -> LmdbSpec:
    """Describe an LMDB dataset for :class:`Loader`.

    ``env`` is one environment for every field, a list of environments (one
    per field, in ``fields`` order), or a dict field → environment; the
    environments share keys (paired low/high-resolution images, say). Samples
    are the keys in key order, without metadata keys such as ``__len__`` (or
    those starting with ``key_prefix``, matching ``key_regex``, or listed in
    ``key_file``, which may be a BasicSR ``meta_info.txt``).

    ``fields`` maps each field to its codec: ``"png"``, ``"jpeg"``, ``"npy"``,
    optionally ``"lz4+npy"``/``"zstd+png"`` and so on, or
    ``{"codec": "raw", "dtype": "uint8", "shape": [32, 32, 3]}``. Images come
    out ``[h, w, c]``; ``{"codec": "png", "mode": "RGB"}`` converts each image
    as Pillow's ``Image.open(f).convert("RGB")`` does (modes ``"L"``,
    ``"RGB"``, ``"RGBA"``; ``"unchanged"`` is the default), so mixed gray,
    RGB, RGBA, palette and 16-bit images come out alike, and ``"dtype"``
    (``"uint8"``, ``"uint16"``, ``"float32"`` in ``[0, 1]``) sets the pixel
    type. ``transforms`` maps fields to steps run in the daemon
    (see :func:`_steps` for the forms): crops, resize, random flips and
    ``rot90``, ``to_f32``, ``normalize``, ``chw``, ``cast``; random steps are deterministic in
    (seed, epoch, index). ``pair={"hr": ("lr", 4)}`` makes ``hr``'s random
    crops and flips follow ``lr``'s at 4× the size. Fields whose shape varies
    (and no transform fixes) come as lists of arrays, one per sample.

    ``on_error="skip"`` replaces a bad value by the next good sample (counted
    in ``stoker status``); ``"fail"`` raises :class:`DatasetError` naming the
    environment, key and codec.

    ``rescan="epoch"`` lists the keys (through the key filter or key file)
    again at each new epoch, so keys added between epochs appear, as
    :func:`hdf5`'s ``rescan`` does for files. Write the environment only
    between epochs: a read that finds it changed fails.
    """
    rescan = _rescan(rescan)
    names = list(fields)
    if not names:
        raise ValueError("fields must name at least one field and its codec")
    if isinstance(env, Mapping):
        envs = {k: env[k] for k in names}
    elif isinstance(env, (str, os.PathLike)):
        envs = {k: env for k in names}
    else:
        env = list(env)
        if len(env) != len(names):
            raise ValueError(f"{len(env)} environments for {len(names)} fields")
        envs = dict(zip(names, env))
    unknown = set(transforms or {}) | set(pair or {}) | set(max_sample_bytes or {})
    unknown -= set(names)
    if unknown:
        raise ValueError(f"transforms/pair/max_sample_bytes name unknown fields {sorted(unknown)}")
    defs = []
    for name in names:
        codec = fields[name]
        d: Dict[str, Any] = {"name": name, "env": os.path.abspath(os.fspath(envs[name]))}
        if isinstance(codec, str):
            d.update(codec=codec, dtype=None, shape=None)
        else:
            d.update(codec=codec["codec"], dtype=codec.get("dtype"), shape=codec.get("shape"))
            if codec.get("mode") is not None:
                d["mode"] = codec["mode"]
            if d["shape"] is not None:
                d["shape"] = [int(x) for x in d["shape"]]
        d["transforms"] = _steps(name, (transforms or {}).get(name, []))
        p = (pair or {}).get(name)
        d["pair"] = None if p is None else {"with": p[0], "scale": int(p[1])}
        d["max_sample_bytes"] = (max_sample_bytes or {}).get(name)
        defs.append(d)
    if on_error not in ("fail", "skip"):
        raise ValueError(f"on_error must be 'fail' or 'skip', not {on_error!r}")
    definition = {
        "fields": defs,
        "key_file": None if key_file is None else os.path.abspath(os.fspath(key_file)),
        "key_prefix": key_prefix,
        "key_regex": key_regex,
        "on_error": on_error,
        "probe": None,
        "rescan": rescan or "never",
    }
    return LmdbSpec(definition)


def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"${name}={value!r} is not an integer") from None


def _rank_world(rank: Optional[int], world_size: Optional[int]) -> Tuple[int, int, str]:
    """(rank, world_size, source) by the documented rules; see :class:`Loader`."""
    if rank is not None or world_size is not None:
        if rank is None or world_size is None:
            raise ValueError(
                f"pass both rank and world_size, or neither (got rank={rank!r}, world_size={world_size!r})"
            )
        found: Tuple[int, int, str] = (int(rank), int(world_size), "argument")
    else:
        found = _detect_rank_world()
    r, w, source = found
    if w < 1 or not 0 <= r < w:
        raise ValueError(f"rank {r} must be in [0, world_size) and world_size {w} at least 1 (from {source})")
    return found


def _detect_rank_world() -> Tuple[int, int, str]:
    # torch.distributed only if the program already imported it: importing
    # torch costs seconds and would be a surprise of its own.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size()), "torch.distributed"
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    if (rank is None) != (world is None):
        have, missing = ("RANK", "WORLD_SIZE") if rank is not None else ("WORLD_SIZE", "RANK")
        raise ValueError(
            f"${have} is set but ${missing} is not: set both (torchrun does), unset both, "
            "or pass rank= and world_size= to the Loader"
        )
    if rank is not None and world is not None:
        return rank, world, "env RANK/WORLD_SIZE"
    # Slurm sets SLURM_NTASKS in the batch script too (`sbatch --ntasks=4`),
    # where one process runs; only a task of a step launched by srun is one of
    # several ranks.
    if os.environ.get("SLURM_STEP_ID", "").strip():
        tasks = _env_int("SLURM_STEP_NUM_TASKS") or _env_int("SLURM_NTASKS")
        procid = _env_int("SLURM_PROCID")
        if tasks is not None and tasks > 1 and procid is not None:
            return procid, tasks, "slurm"
    return 0, 1, "default"


_logger = logging.getLogger("stoker")
_logged_choices: set = set()


def _log_rank_choice(rank: int, world: int, source: str) -> None:
    if (rank, world, source) not in _logged_choices:
        _logged_choices.add((rank, world, source))
        _logger.info("stoker: rank %d of world_size %d (from %s)", rank, world, source)


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

    return "block", count("block_size", block_size, MAX_BLOCK_SIZE), count("block_window", block_window, MAX_BLOCK_WINDOW)

#: Every Loader with an open stream in this process (for the fork handler).
_open_loaders: "weakref.WeakSet[Loader]" = weakref.WeakSet()
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


class _EpochSampler:
    """What ``loader.sampler`` returns: the ``DistributedSampler``-like face of a
    :class:`Loader`, so frameworks that call ``dataloader.sampler.set_epoch(epoch)``
    every epoch (PyTorch Lightning's fit loop does) select the epoch's order."""

    __slots__ = ("_loader",)

    def __init__(self, loader: "Loader") -> None:
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
            raise TypeError(f"dataset must be a name, stoker.hdf5(...) or stoker.lmdb(...), not {type(dataset).__name__}")
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
            block = (getattr(self, "block_size", None), getattr(self, "block_window", None))
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
            return _CudaEpochIterator(self)  # type: ignore[return-value]
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

    def __enter__(self) -> "Loader":
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
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_unconnected()

    def _mapping_range(self) -> Tuple[int, int]:
        """(address, length) of the stream's shared-memory mapping; for tests."""
        return self._native().mapping_range()

    def __repr__(self) -> str:
        batches = len(self) if self._info is not None else "?"
        return (
            f"Loader(batch_size={self.batch_size}, rank={self.rank}, world_size={self.world_size}, "
            f"epoch={self._epoch}, batches={batches}, output={self.output!r})"
        )


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

    def __iter__(self) -> "_EpochIterator":
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

    def __iter__(self) -> "_CudaEpochIterator":
        return self

    def _uploader(self) -> "_cuda.Uploader":
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
