"""Transforms on HDF5 fields (and the new LMDB steps): served values equal
numpy applied to h5py's arrays (exact for cast, permute, crops, flips, rot90
and downsample; within float tolerance for normalize), random steps are keyed
by (seed, epoch, index), paired fields draw alike, and bad steps are refused
when the stream opens, naming the field and the step."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import h5py
import numpy as np
import pytest

from conftest import assert_names
from lmdb_data import key, noise, png_of, write_env
from test_lmdb import idx_env, rows, run_epoch, upscale4


def _write(path: Path, **arrays: np.ndarray) -> None:
    with h5py.File(path, "w") as f:
        for name, a in arrays.items():
            f.create_dataset(name, data=a)


def _by_index(loader: Any, epoch: int = 0) -> dict[int, dict[str, Any]]:
    return {int(r["idx"]): r for r in rows(run_epoch(loader, epoch))}


def _dihedral(a: np.ndarray, axes: tuple[int, int] = (0, 1)) -> list[np.ndarray]:
    """The images hflip/vflip/rot90 can make of `a` over `axes` (in any order)."""
    out = []
    for k in range(4):
        r = np.rot90(a, k, axes=axes)
        out += [r, np.flip(r, axes[1])]
    return out


def _crops(a: np.ndarray, h: int, w: int) -> list[np.ndarray]:
    return [a[y : y + h, x : x + w] for y in range(a.shape[0] - h + 1) for x in range(a.shape[1] - w + 1)]


def _which(candidates: list[np.ndarray], served: np.ndarray) -> int:
    hits = [i for i, c in enumerate(candidates) if c.shape == served.shape and np.array_equal(c, served)]
    assert hits, "the served value is none of the crops/flips/rotations of its source"
    return hits[0]


def test_deterministic_steps_equal_numpy(stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    n = 9
    src = {
        "img": rng.integers(0, 60000, size=(n, 12, 10, 3), dtype=np.uint16),
        "vol": rng.integers(-100, 100, size=(n, 5, 12, 10)).astype(np.float64),
        "sub": rng.integers(-3000, 3000, size=(n, 9, 7), dtype=np.int16),
        "vel": rng.standard_normal((n, 3, 6, 4, 2), dtype=np.float32) * 3 + 1,
        "rho": rng.standard_normal((n, 3, 6, 4), dtype=np.float32) * 2 + 5,
        "cube": rng.integers(0, 255, size=(n, 4, 5, 6), dtype=np.uint8),
        "flt": (rng.standard_normal((n, 4, 4)) * 300).astype(np.float32),
        "half": rng.standard_normal((n, 6, 4)) * np.logspace(-9, 6, 24).reshape(6, 4),
        "feat": rng.standard_normal((n, 5)).astype(np.float32) * 10,
        "label": rng.integers(0, 1000, size=n, dtype=np.int64),
        "idx": np.arange(n, dtype=np.int64),
    }
    _write(tmp_path / "a.h5", **src)
    stats = tmp_path / "stats.yaml"
    # The Well's stats.yaml layout (yaml.dump of {mean: {field: value}, std: {...}}).
    stats.write_text(
        "mean:\n  density: 5.0E+00\n  velocity:\n  - 1.0E+00\n  - 0.5E+00\nstd:\n  density: 2.0E+00\n"
        "  velocity:\n  - 3.0E+00\n  - 2.5E+00\n"
    )
    transforms = {
        "img": [{"center_crop": (8, 6)}, {"cast": "float32"}, "chw"],
        "vol": [{"downsample": 2}, {"cast": "int32"}],
        "sub": [{"downsample": {"factor": 2, "mode": "stride"}}],
        "vel": [{"normalize": {"stats": str(stats), "key": "velocity"}}, {"permute": [0, 3, 1, 2]}],
        "rho": [{"normalize": {"stats": str(stats), "key": "density"}}],
        "cube": [{"permute": [2, 0, 1]}],
        "flt": [{"cast": "int16"}, {"normalize": {"mean": [1.0], "std": [4.0]}}],
        "half": [{"cast": "float16"}, {"permute": [1, 0]}],
        # Fewer than 2 dimensions: element steps only.
        "feat": [{"normalize": {"mean": [1, 2, 3, 4, 5], "std": [2, 2, 2, 2, 4]}}],
        "label": [{"cast": "int32"}],
    }
    spec = stoker.hdf5(
        str(tmp_path / "a.h5"),
        fields={k: k for k in src},
        transforms=transforms,
        spatial_axes={"vol": (-2, -1), "rho": (1, 2)},
    )
    d = start_daemon()
    loader = stoker.Loader(spec, batch_size=4, socket=d.socket)
    assert loader.fields["img"] == ("float32", (3, 8, 6))
    assert loader.fields["vol"] == ("int32", (5, 6, 5))
    assert loader.fields["vel"] == ("float32", (3, 2, 6, 4))
    served = _by_index(loader)
    assert sorted(served) == list(range(n))
    for i, r in served.items():
        np.testing.assert_array_equal(r["img"], src["img"][i][2:10, 2:8].astype(np.float32).transpose(2, 0, 1))
        v = src["vol"][i].reshape(5, 6, 2, 5, 2).mean(axis=(2, 4))
        np.testing.assert_array_equal(r["vol"], v.astype(np.int32))
        np.testing.assert_array_equal(r["sub"], src["sub"][i][0:8:2, 0:6:2])
        vel = (src["vel"][i] - np.array([1.0, 0.5])) / np.array([3.0, 2.5])
        np.testing.assert_allclose(r["vel"], vel.transpose(0, 3, 1, 2), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(r["rho"], (src["rho"][i] - 5.0) / 2.0, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(r["cube"], src["cube"][i].transpose(2, 0, 1))
        np.testing.assert_allclose(r["flt"], (src["flt"][i].astype(np.int16) - 1.0) / 4.0, rtol=1e-6)
        assert r["flt"].dtype == np.float32
        # float64 → float16 rounds to nearest even, tiny values to subnormals or zero, huge ones to inf.
        with np.errstate(over="ignore"):
            half = src["half"][i].astype(np.float16)
        assert r["half"].dtype == np.float16
        np.testing.assert_array_equal(r["half"].view(np.uint16), half.T.view(np.uint16))
        feat = (src["feat"][i] - np.array([1, 2, 3, 4, 5], np.float32)) / np.array([2, 2, 2, 2, 4], np.float32)
        np.testing.assert_allclose(r["feat"], feat, rtol=1e-6, atol=1e-6)
        assert r["label"].dtype == np.int32 and r["label"] == src["label"][i]


def test_random_steps_are_keyed_and_paired(stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path) -> None:
    """`b` (the same data as `a`) pairs with `a` and must come out identical;
    `c` has the same steps unpaired and must not always match."""
    rng = np.random.default_rng(9)
    n = 16
    u = rng.integers(0, 1000, size=(n, 2, 8, 8, 2)).astype(np.float32)  # [item, time, x, y, component]
    _write(tmp_path / "w.h5", u=u, u2=u.copy(), u3=u.copy(), idx=np.arange(n))
    steps = [{"random_crop": 6}, "hflip", "vflip", "rot90"]
    spec = stoker.hdf5(
        str(tmp_path / "w.h5"),
        fields={"a": "u", "b": "u2", "c": "u3", "idx": "idx"},
        transforms={"a": steps, "b": steps, "c": steps},
        pair={"b": ("a", 1)},
    )
    d = start_daemon()
    loader = stoker.Loader(spec, batch_size=5, seed=3, socket=d.socket)
    assert loader.fields["a"] == ("float32", (2, 6, 6, 2))
    first = _by_index(loader, 0)
    again = _by_index(stoker.Loader(spec, batch_size=3, seed=3, socket=d.socket), 0)
    later = _by_index(loader, 1)
    seen, unpaired_differs, epochs_differ = set(), 0, 0
    for i in range(n):
        r = first[i]
        np.testing.assert_array_equal(r["b"], r["a"], err_msg="paired fields drew differently")
        unpaired_differs += not np.array_equal(r["c"], r["a"])
        np.testing.assert_array_equal(again[i]["a"], r["a"], err_msg="not deterministic in (seed, epoch, index)")
        epochs_differ += not np.array_equal(later[i]["a"], r["a"])
        # Spatial axes of [time, x, y, component] are x and y (the two before the last).
        cands = [t for c in _crops(u[i].transpose(1, 2, 0, 3), 6, 6) for t in _dihedral(c)]
        k = _which(cands, r["a"].transpose(1, 2, 0, 3))
        seen.add(k % 8)  # which of the 8 flips/rotations
    assert unpaired_differs > 0, "an unpaired field drew exactly what its neighbour drew for every sample"
    assert epochs_differ > 0, "every sample drew the same in epoch 1 as in epoch 0"
    assert len(seen) >= 4, f"flips and rotations hardly vary: {seen}"


def test_lmdb_lr_hr_vflip_rot90_pairing_like_basicsr(
    stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path
) -> None:
    """BasicSR's augment(hflip, rot): the HR crop, flips and rotation line up with the LR's."""
    n = 12
    names = [key(i) for i in range(n)]
    lr_src = {k: noise(12, 12, 3, seed=i) for i, k in enumerate(names)}
    lr_env = write_env(tmp_path / "lr", {k: png_of(a) for k, a in lr_src.items()})
    hr_env = write_env(tmp_path / "hr", {k: png_of(upscale4(a)) for k, a in lr_src.items()})
    idx = idx_env(tmp_path / "idx", n)
    spec = stoker.lmdb(
        {"lr": lr_env, "hr": hr_env, "idx": idx},
        fields={"lr": "png", "hr": "png", "idx": "npy"},
        transforms={
            "lr": [{"random_crop": 8}, "hflip", "vflip", "rot90"],
            "hr": [{"random_crop": 32}, "hflip", "vflip", "rot90"],
        },
        pair={"hr": ("lr", 4)},
    )
    d = start_daemon()
    loader = stoker.Loader(spec, batch_size=5, seed=2, socket=d.socket)
    kinds = set()
    for epoch in (0, 1):
        for r in rows(run_epoch(loader, epoch)):
            lr, hr = r["lr"], r["hr"]
            assert np.array_equal(hr, upscale4(lr)), "HR is not the LR crop repeated 4×: pairing is misaligned"
            cands = [t for c in _crops(lr_src[key(int(r["idx"]))], 8, 8) for t in _dihedral(c)]
            kinds.add(_which(cands, lr) % 8)
    assert len(kinds) >= 4, f"flips and rotations hardly vary: {kinds}"


def test_bad_steps_are_refused_naming_field_and_step(
    stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path
) -> None:
    _write(
        tmp_path / "b.h5",
        x=np.zeros((4, 6, 5), np.uint8),
        y=np.zeros((4, 6, 6), np.uint8),
        v=np.zeros((4, 3)),
        s=np.zeros(4),
    )
    glob = str(tmp_path / "b.h5")
    fields = {"x": "x", "y": "y", "v": "v", "s": "s"}
    with pytest.raises(ValueError) as exc:
        stoker.hdf5(glob, fields=fields, transforms={"x": ["twirl"]})
    assert_names(str(exc.value), "'x'", "twirl", "rot90")
    with pytest.raises(ValueError, match="unknown fields"):
        stoker.hdf5(glob, fields=fields, transforms={"z": ["hflip"]})
    d = start_daemon()
    cases = [
        ({"x": ["rot90"]}, "rot90"),
        ({"y": [{"random_crop": 7}]}, "random_crop 7×7"),
        ({"x": [{"permute": [1, 0, 2]}]}, "permute"),
        ({"x": [{"cast": "complex64"}]}, "complex64"),
        ({"y": [{"normalize": {"mean": [1, 2], "std": [1, 1]}}]}, "normalize"),
        ({"y": [{"normalize": {"stats": str(tmp_path / "none.yaml")}}]}, "none.yaml"),
        ({"y": [{"downsample": 7}]}, "downsample by 7"),
        ({"v": ["hflip"]}, "takes only cast, normalize and permute"),
        ({"y": [{"random_crop": 0}]}, "random_crop 0×0 has a zero size"),
        ({"v": [{"normalize": {"mean": [1, 2], "std": [1, 1]}}]}, "normalize has 2 means"),
        # A 0-d field has no axis for per-channel statistics (it reached an index panic).
        ({"s": [{"normalize": {"mean": [1, 2], "std": [1, 1]}}]}, "normalize has 2 means"),
    ]
    for transforms, step in cases:
        field = next(iter(transforms))
        spec = stoker.hdf5(glob, fields=fields, transforms=transforms)
        with pytest.raises(stoker.DatasetError) as exc:
            stoker.Loader(spec, batch_size=2, socket=d.socket)
        assert_names(str(exc.value), step)
        if "none.yaml" not in step:
            assert_names(str(exc.value), f'"{field}"')
    # Paired fields must have the same random steps.
    spec = stoker.hdf5(glob, fields=fields, transforms={"x": ["hflip"], "y": ["vflip"]}, pair={"y": ("x", 1)})
    with pytest.raises(stoker.DatasetError) as exc:
        stoker.Loader(spec, batch_size=2, socket=d.socket)
    assert_names(str(exc.value), '"y"', "pairs with")
    assert d.alive()


def test_transform_output_is_checked_against_the_sample_limit(
    stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path
) -> None:
    _write(tmp_path / "l.h5", x=np.zeros((4, 20, 20), np.uint8))
    d = start_daemon(extra="\n[limits]\nmax_sample_bytes = 1000\n")
    spec = stoker.hdf5(str(tmp_path / "l.h5"), fields={"x": "x"}, transforms={"x": [{"cast": "float64"}]})
    with pytest.raises(stoker.LimitError) as exc:
        stoker.Loader(spec, batch_size=2, socket=d.socket)
    assert_names(str(exc.value), '"x"', "cast to float64", "max_sample_bytes")


def test_config_transforms_for_a_named_hdf5_dataset(
    stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path
) -> None:
    rng = np.random.default_rng(1)
    x = rng.integers(0, 255, size=(6, 8, 8, 3), dtype=np.uint8)
    y = rng.standard_normal((6, 4, 3)).astype(np.float32)
    _write(tmp_path / "c.h5", x=x, y=y, idx=np.arange(6))
    # `normalize` with one number for mean and std, as torchvision's Normalize(0.5, 0.25).
    extra = f"""
[datasets.c]
format = "hdf5"
files = "{tmp_path / 'c.h5'}"
fields = {{ x = "x", y = "y", idx = "idx" }}
transforms.x = [{{ center_crop = {{ height = 4, width = 6 }} }}, {{ to_f32 = {{ scale = 0.5 }} }}, "chw"]
transforms.y = [{{ normalize = {{ mean = 0.5, std = 0.25 }} }}]
"""
    d = start_daemon(extra=extra)
    loader = stoker.Loader("c", batch_size=3, socket=d.socket)
    for i, r in _by_index(loader).items():
        np.testing.assert_array_equal(r["x"], (x[i][2:6, 1:7].astype(np.float32) * 0.5).transpose(2, 0, 1))
        np.testing.assert_allclose(r["y"], (y[i] - 0.5) / 0.25, rtol=1e-6)


def test_the_config_speaks_pythons_transform_language(
    stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path
) -> None:
    """Issue 24, item 4: `{ random_crop = 48 }`, `"to_f32"`, `{ cast =
    "float32" }` and `{ downsample = 2 }` worked from Python and, in a
    config, failed with "invalid type: integer `48`, expected struct
    variant". The config now takes every form Python takes (one parser), and
    serves what Python's spelling serves."""
    rng = np.random.default_rng(2)
    x = rng.integers(0, 255, size=(6, 8, 8, 3), dtype=np.uint8)
    _write(tmp_path / "c.h5", x=x, idx=np.arange(6))
    steps = '[{ random_crop = 6 }, { downsample = 2 }, "to_f32", { cast = "float32" }, "chw"]'
    extra = f"""
[datasets.c]
format = "hdf5"
files = "{tmp_path / 'c.h5'}"
fields = {{ x = "x", idx = "idx" }}
transforms.x = {steps}
"""
    config = tmp_path / "c.toml"
    config.write_text(f"[server]\nallowed_roots = []\n{extra}")
    import subprocess

    from conftest import stoker_bin

    res = subprocess.run([str(stoker_bin()), "validate", str(config)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    d = start_daemon(extra=extra)
    named = stoker.Loader("c", batch_size=3, seed=5, socket=d.socket)
    python_steps = [{"random_crop": 6}, {"downsample": 2}, "to_f32", {"cast": "float32"}, "chw"]
    spec = stoker.hdf5(str(tmp_path / "c.h5"), fields={"x": "x", "idx": "idx"}, transforms={"x": python_steps})
    adhoc = stoker.Loader(spec, batch_size=3, seed=5, socket=d.socket)
    got, want = _by_index(named), _by_index(adhoc)
    assert sorted(got) == list(range(6))
    for i in got:
        assert got[i]["x"].shape == (3, 3, 3)
        np.testing.assert_array_equal(got[i]["x"], want[i]["x"])
    # A misspelt step is named with the steps there are, and its line.
    config.write_text(f"[server]\nallowed_roots = []\n{extra.replace('random_crop', 'random_crap')}")
    res = subprocess.run([str(stoker_bin()), "validate", str(config)], capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "random_crap" in res.stderr and "random_crop" in res.stderr, res.stderr


def test_normalize_takes_one_number_for_mean_and_std(
    stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path
) -> None:
    """`Normalize(0.5, 0.25)` as torchvision users write it: one number for
    the whole field (a list was required; the config form is checked above)."""
    x = np.random.default_rng(2).standard_normal((5, 4, 3)).astype(np.float32)
    _write(tmp_path / "n.h5", x=x, idx=np.arange(5))
    d = start_daemon()
    glob, fields = str(tmp_path / "n.h5"), {"x": "x", "idx": "idx"}
    spec = stoker.hdf5(glob, fields=fields, transforms={"x": [{"normalize": {"mean": 0.5, "std": 0.25}}]})
    for i, r in _by_index(stoker.Loader(spec, batch_size=2, socket=d.socket)).items():
        np.testing.assert_allclose(r["x"], (x[i] - 0.5) / 0.25, rtol=1e-6)
    with pytest.raises(ValueError, match="a number or a list of numbers"):
        stoker.hdf5(glob, fields=fields, transforms={"x": [{"normalize": {"mean": "0", "std": 1}}]})


def test_step_names_come_from_the_daemon_definition(stoker: Any) -> None:
    assert {"hflip", "vflip", "rot90", "cast", "normalize", "permute", "downsample", "chw"} <= set(stoker.TRANSFORM_STEPS)


def test_hostile_statistics_files_are_refused_and_the_daemon_serves_on(
    stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path
) -> None:
    """A statistics file is the user's: deep indentation aborted the daemon
    (stack overflow while the YAML tree was built and dropped); deep flow
    lists, alias bombs, binary, NaN/zero std and wrong lengths are refused
    naming the file or the step, and the daemon serves the next stream."""
    _write(tmp_path / "p.h5", x=np.arange(12, dtype=np.float32).reshape(4, 3))
    bomb = "".join(f"{c}: &{c} [{','.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcde", "bcdef"))
    texts = {
        "block.yaml": ("mean:\n" + "".join(" " * i + "a:\n" for i in range(1, 5000)), "more than 16 deep"),
        "flow.yaml": ("mean:\n  x: " + "[" * 100_000 + "]" * 100_000 + "\nstd:\n  x: 1\n", "flow.yaml"),
        "bomb.yaml": ("a: &a [1,1,1,1,1,1,1,1,1]\n" + bomb + "mean: {x: *f}\nstd: {x: *f}\n", "bomb.yaml"),
        "binary.yaml": ("\x00\xff" * 1000, "binary.yaml"),
        "zero.yaml": ("mean: {x: .nan}\nstd: {x: 0}\n", "finite"),
        "long.yaml": ("mean: {x: [" + ",".join(["1"] * 100_000) + "]}\nstd: {x: [" + ",".join(["1"] * 100_000) + "]}\n", "100000 means"),
    }
    d = start_daemon()
    for name, (text, expect) in texts.items():
        (tmp_path / name).write_text(text, encoding="latin-1")
        spec = stoker.hdf5(
            str(tmp_path / "p.h5"), fields={"x": "x"}, transforms={"x": [{"normalize": {"stats": str(tmp_path / name)}}]}
        )
        with pytest.raises(stoker.DatasetError) as exc:
            stoker.Loader(spec, batch_size=2, socket=d.socket)
        assert_names(str(exc.value), expect)
        assert d.alive(), name
    (tmp_path / "ok.yaml").write_text("mean: {x: [1, 2, 3]}\nstd: {x: [2, 2, 2]}\n")
    spec = stoker.hdf5(
        str(tmp_path / "p.h5"), fields={"x": "x"}, transforms={"x": [{"normalize": {"stats": str(tmp_path / "ok.yaml")}}]}
    )
    with stoker.Loader(spec, batch_size=4, shuffle=False, socket=d.socket) as loader:
        (batch,) = list(loader)
    want = (np.arange(12, dtype=np.float32).reshape(4, 3) - np.array([1, 2, 3], np.float32)) / 2
    np.testing.assert_allclose(np.asarray(batch["x"]), want, rtol=1e-6)
