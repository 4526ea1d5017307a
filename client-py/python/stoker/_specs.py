"""Dataset specs: :func:`hdf5` and :func:`lmdb` check their arguments and
describe an ad-hoc dataset (:class:`Hdf5Spec`, :class:`LmdbSpec`) in the form
the daemon reads; a :class:`~stoker.Loader` sends that description when it
opens its stream (``_wire``)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ._native import check_hdf5 as _check_hdf5, parse_steps as _parse_steps

__all__ = ["Hdf5Spec", "LmdbSpec", "hdf5", "lmdb"]


@dataclass(frozen=True)
class Hdf5Spec:
    """An ad-hoc HDF5 dataset (see :func:`hdf5`); ``definition`` is the daemon's dataset description
    (``stoker_proto::Hdf5Dataset``, the shape of a ``[datasets.NAME]`` table of ``format = "hdf5"``)."""

    definition: Mapping[str, Any]

    def _wire(self) -> tuple:
        return ("hdf5", json.dumps(self.definition))


def _rescan(rescan: Optional[str]) -> Optional[str]:
    if rescan not in (None, "never", "epoch"):
        raise ValueError(f"rescan must be 'epoch', 'never' or None, not {rescan!r}")
    return None if rescan == "never" else rescan


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
    pairs = {str(name): str(path) for name, path in fields.items()}
    definition: Dict[str, Any] = {
        "files": os.path.abspath(os.fspath(files)),
        "fields": pairs,
        "window": None if window is None else {str(k): _integer("window", k, v) for k, v in window.items()},
        "per_item": [str(f) for f in per_item],
        "input": [str(f) for f in input],
        "output": [str(f) for f in output],
        "constant": [str(f) for f in constant],
        "time_only": [str(f) for f in time_only],
        "transforms": {str(name): _steps(name, steps) for name, steps in (transforms or {}).items()},
        "pair": {str(name): {"with": str(p[0]), "scale": int(p[1])} for name, p in (pair or {}).items()},
        "spatial_axes": {str(name): [int(a) for a in axes] for name, axes in (spatial_axes or {}).items()},
        "rescan": _rescan(rescan) or "never",
    }
    # The daemon's own check of the description (the config and the wire run
    # the same one): raises ValueError naming the problem.
    return Hdf5Spec(json.loads(_check_hdf5(json.dumps(definition))))


def _integer(what: str, key: Any, value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} {key!r} must be an integer, not {value!r}") from None


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
