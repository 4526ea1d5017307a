"""The Well's sampling: windows split into input and output steps, a step
spacing inside a window (fixed, or drawn per sample within a range), constant
fields without the item axis, and the refusal of a window longer than the
time axis. Files follow the layout of the_well's dummy-data writer
(`the_well/utils/dummy_data.py`); served samples are compared byte for byte
with h5py slicing as `WellDataset` does it (the_well is not installed: its
index math is transcribed in `well_windows` / `well_max_dt`)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from conftest import check_field

REPO = Path(__file__).resolve().parents[2]


def well_windows(steps: int, n_in: int, n_out: int, dt: int) -> int:
    """the_well.data.utils.raw_steps_to_possible_sample_t0s."""
    return max(0, steps - (1 + dt * (n_in + n_out - 1)) + 1)


def well_max_dt(t0: int, steps: int, n_in: int, n_out: int) -> int:
    """the_well.data.utils.maximum_stride_for_initial_index."""
    return max(0, (steps - t0 - 1) // (n_in + n_out - 1))


def write_well_file(path: Path, rng: np.random.Generator, n_traj: int, n_t: int, k: int, nx: int = 6, ny: int = 5) -> None:
    """One file in The Well's layout (dummy_data.py's groups and attributes),
    plus `t0_fields/tracer`, a `tag` field (file·10⁶ + trajectory·10³ + step)
    that tells samples apart, a sample-invariant `t0_fields/mask` and the
    scalar `Reynolds`."""
    with h5py.File(path, "w") as f:
        f.attrs.update(
            {"a": 0.25, "b": 0.75, "dataset_name": "shear_flow", "grid_type": "cartesian", "n_spatial_dims": 2,
             "n_trajectories": n_traj, "simulation_parameters": ["a", "b"]}
        )
        bcs = f.create_group("boundary_conditions")
        for key in ("x_periodic", "y_periodic"):
            g = bcs.create_group(key)
            g.attrs.update({"associated_dims": key[0], "bc_type": "PERIODIC", "sample_varying": False, "time_varying": False})
            g.create_dataset("mask", data=np.zeros(nx if key[0] == "x" else ny, dtype=bool))
        dims = f.create_group("dimensions")
        dims.attrs["spatial_dims"] = ["x", "y"]
        for key, n in (("time", n_t), ("x", nx), ("y", ny)):
            dims.create_dataset(key, data=np.linspace(0, 1, n, dtype=np.float32))
            dims[key].attrs["sample_varying"] = False
        scalars = f.create_group("scalars")
        scalars.attrs["field_names"] = ["a", "b", "Reynolds", "time_varying_scalar"]
        for key, val in (("a", 0.25), ("b", 0.75), ("Reynolds", 1000.0 + k)):
            scalars.create_dataset(key, data=np.array(val))
            scalars[key].attrs.update({"time_varying": False, "sample_varying": False})
        scalars.create_dataset("time_varying_scalar", data=rng.random(n_t))
        scalars["time_varying_scalar"].attrs.update({"time_varying": True, "sample_varying": False})
        t0 = f.create_group("t0_fields")
        t0.attrs["field_names"] = ["constant_field", "tracer", "mask"]
        for name, data, sample_varying, time_varying, kw in (
            ("constant_field", rng.random((n_traj, nx, ny), dtype=np.float32), True, False, {}),
            ("tracer", rng.random((n_traj, n_t, nx, ny), dtype=np.float32), True, True,
             {"chunks": (1, 2, nx, ny), "compression": "gzip"}),
            ("mask", rng.integers(0, 9, (nx, ny)).astype(">i2"), False, False, {}),
        ):
            d = t0.create_dataset(name, data=data, **kw)
            d.attrs.update({"dim_varying": [True, True], "sample_varying": sample_varying, "time_varying": time_varying})
        t1 = f.create_group("t1_fields")
        t1.attrs["field_names"] = ["velocity"]
        d = t1.create_dataset("velocity", data=rng.random((n_traj, n_t, nx, ny, 2), dtype=np.float32))
        d.attrs.update({"dim_varying": [True, True], "sample_varying": True, "time_varying": True})
        f.create_group("t2_fields").attrs["field_names"] = []
        tag = 10**6 * k + 10**3 * np.arange(n_traj)[:, None] + np.arange(n_t)[None, :]
        f.create_dataset("tag", data=tag.astype(np.int64))


def write_well(root: Path, shapes: list[tuple[int, int]], seed: int = 0) -> list[Path]:
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    files = []
    for k, (n_traj, n_t) in enumerate(shapes):
        path = root / f"shear_flow_{k:02d}.hdf5"
        write_well_file(path, rng, n_traj, n_t, k)
        files.append(path)
    return files


FIELDS = {
    "x": "t1_fields/velocity",
    "y": "t1_fields/velocity",
    "p_in": "t0_fields/tracer",
    "p_out": "t0_fields/tracer",
    "tag": "tag",
    "cf": "t0_fields/constant_field",
    "mask": "t0_fields/mask",
    "re": "scalars/Reynolds",
}


def split_spec(stoker: Any, root: Path, window: dict[str, int]) -> Any:
    return stoker.hdf5(
        str(root / "*.hdf5"), fields=FIELDS, window=window, per_item=["cf"],
        input=["x", "p_in"], output=["y", "p_out"], constant=["mask", "re"],
    )


def check_sample(b: dict[str, np.ndarray], r: int, files: list[Path], n_in: int, n_out: int) -> tuple[int, int, int, int]:
    """Checks row `r` against h5py; returns (file, trajectory, t0, dt) read from its tag."""
    tag = b["tag"][r]
    k, rest = divmod(int(tag[0]), 10**6)
    traj, t0 = divmod(rest, 10**3)
    dt = int(tag[1] - tag[0]) if len(tag) > 1 else 1
    assert dt >= 1
    with h5py.File(files[k]) as f:
        window = slice(t0, t0 + (n_in + n_out - 1) * dt + 1, dt)
        check_field("tag", tag, f["tag"][traj, window])
        vel, tracer = f["t1_fields/velocity"][traj, window], f["t0_fields/tracer"][traj, window]
        check_field("x", b["x"][r], vel[:n_in])
        check_field("y", b["y"][r], vel[n_in:])
        check_field("p_in", b["p_in"][r], tracer[:n_in])
        check_field("p_out", b["p_out"][r], tracer[n_in:])
        check_field("cf", b["cf"][r], f["t0_fields/constant_field"][traj])
        check_field("mask", b["mask"][r], f["t0_fields/mask"][()])
        check_field("re", b["re"][r, ...], np.asarray(f["scalars/Reynolds"][()]))
    return k, traj, t0, dt


def check_cover(order: list[int | None], n: int) -> None:
    """DistributedSampler's global order: a permutation of 0..n, then the padding repeating its start."""
    assert None not in order
    assert sorted(order[:n]) == list(range(n)), "each window exactly once per epoch"
    assert order[n:] == order[: len(order) - n], "padding repeats the start of the order"


def test_split_windows_with_dt_stride_equal_h5py_across_epochs_and_ranks(start_daemon, stoker, tmp_path: Path) -> None:
    shapes = [(3, 11), (2, 9)]
    files = write_well(tmp_path / "well", shapes)
    n_in, n_out, dt = 2, 1, 2
    spec = split_spec(stoker, tmp_path / "well", {"n_steps_input": n_in, "n_steps_output": n_out, "dt_stride": dt})
    windows = [well_windows(t, n_in, n_out, dt) for _, t in shapes]
    assert windows == [7, 5]
    offsets = np.cumsum([0] + [n * w for (n, _), w in zip(shapes, windows)])
    n = int(offsets[-1])
    daemon = start_daemon(allowed_roots=[tmp_path])
    world = 3
    for epoch in range(2):
        per_rank = -(-n // world)
        order: list[int | None] = [None] * (per_rank * world)
        for rank in range(world):
            loader = stoker.Loader(spec, batch_size=4, seed=11, rank=rank, world_size=world, socket=daemon.socket)
            assert loader.fields["x"][1] == (n_in, 6, 5, 2)
            assert loader.fields["y"][1] == (n_out, 6, 5, 2)
            assert loader.fields["p_in"][1] == (n_in, 6, 5)
            assert loader.fields["mask"][1] == (6, 5)
            assert loader.fields["re"][1] == ()
            loader.set_epoch(epoch)
            pos = 0
            for b in loader:
                for r in range(len(b["tag"])):
                    k, traj, t0, got_dt = check_sample(b, r, files, n_in, n_out)
                    assert got_dt == dt
                    assert 0 <= t0 < windows[k]
                    order[rank + world * pos] = int(offsets[k]) + traj * windows[k] + t0
                    pos += 1
            assert pos == per_rank
            loader.close()
        check_cover(order, n)


def dt_draws(stoker: Any, spec: Any, socket: str, seed: int, epoch: int, files: list[Path], n_in: int, n_out: int) -> dict[tuple[int, int, int], int]:
    loader = stoker.Loader(spec, batch_size=5, seed=seed, socket=socket)
    loader.set_epoch(epoch)
    draws = {}
    for b in loader:
        for r in range(len(b["tag"])):
            k, traj, t0, dt = check_sample(b, r, files, n_in, n_out)
            assert (k, traj, t0) not in draws, "each window once per epoch"
            draws[(k, traj, t0)] = dt
    loader.close()
    return draws


def test_random_dt_stride_is_deterministic_per_seed_epoch_and_index(start_daemon, stoker, tmp_path: Path) -> None:
    shapes = [(3, 20), (2, 16)]
    files = write_well(tmp_path / "well", shapes, seed=1)
    n_in, n_out, lo, hi = 2, 2, 1, 4
    spec = split_spec(stoker, tmp_path / "well", {"n_steps_input": n_in, "n_steps_output": n_out, "min_dt_stride": lo, "max_dt_stride": hi})
    daemon = start_daemon(allowed_roots=[tmp_path])
    first = dt_draws(stoker, spec, daemon.socket, 3, 0, files, n_in, n_out)
    # Windows per trajectory are counted at min_dt_stride, as WellDataset counts them.
    assert len(first) == sum(n * well_windows(t, n_in, n_out, lo) for n, t in shapes)
    for (k, _, t0), dt in first.items():
        top = min(hi, well_max_dt(t0, shapes[k][1], n_in, n_out))
        assert lo <= dt <= max(lo, top), f"window at {t0}: dt {dt} outside [{lo}, {top}]"
    assert len(set(first.values())) > 2, f"draws do not vary: {Counter(first.values())}"
    assert dt_draws(stoker, spec, daemon.socket, 3, 0, files, n_in, n_out) == first, "same (seed, epoch, index), same dt"
    assert dt_draws(stoker, spec, daemon.socket, 3, 1, files, n_in, n_out) != first, "another epoch draws anew"
    assert dt_draws(stoker, spec, daemon.socket, 4, 0, files, n_in, n_out) != first, "another seed draws anew"


def test_constant_fields_broadcast_without_a_window(start_daemon, stoker, tmp_path: Path) -> None:
    files = write_well(tmp_path / "well", [(3, 5), (4, 5)], seed=2)
    spec = stoker.hdf5(
        str(tmp_path / "well" / "*.hdf5"),
        fields={"cf": "t0_fields/constant_field", "mask": "t0_fields/mask", "a": "scalars/a", "re": "scalars/Reynolds"},
        constant=["mask", "a", "re"],
    )
    daemon = start_daemon(allowed_roots=[tmp_path])
    loader = stoker.Loader(spec, batch_size=3, shuffle=False, socket=daemon.socket)
    rows = []
    for b in loader:
        rows += [(b["cf"][r], b["mask"][r], b["a"][r, ...], b["re"][r, ...]) for r in range(len(b["cf"]))]
    assert len(rows) == 7
    for i, (cf, mask, a, re_) in enumerate(rows):
        k, item = (0, i) if i < 3 else (1, i - 3)
        with h5py.File(files[k]) as f:
            check_field("cf", cf, f["t0_fields/constant_field"][item])
            check_field("mask", mask, f["t0_fields/mask"][()])
            check_field("a", a, np.asarray(f["scalars/a"][()]))
            check_field("re", re_, np.asarray(f["scalars/Reynolds"][()]))


def test_window_longer_than_the_time_axis_says_so(start_daemon, stoker, tmp_path: Path) -> None:
    files = write_well(tmp_path / "well", [(2, 12), (2, 7)], seed=3)
    daemon = start_daemon(allowed_roots=[tmp_path])
    spec = split_spec(stoker, tmp_path / "well", {"n_steps_input": 3, "n_steps_output": 2, "dt_stride": 2})
    with pytest.raises(stoker.DatasetError) as e:
        stoker.Loader(spec, batch_size=2, socket=daemon.socket)
    msg = str(e.value)
    for needle in (files[1].name, "t1_fields/velocity", "7 time steps", "5 steps", "n_steps_input 3", "2 apart", "span 9"):
        assert needle in msg, f"{needle!r} not in {msg!r}"
    assert "holds no samples" not in msg


@pytest.mark.parametrize(
    "window, extra, needle",
    [
        ({"n_steps_input": 2, "n_steps_output": 1, "dt_stride": 2**63}, {}, "2^64"),
        ({"n_steps_input": 2, "n_steps_output": 1, "min_dt_stride": 2**62, "max_dt_stride": 2**64 - 1}, {}, "no sample fits"),
        ({"n_steps_input": 2**63, "n_steps_output": 2**63 - 1}, {}, "no sample fits"),
        ({"n_steps_input": 2, "n_steps_output": 0}, {}, "n_steps_output is 0"),
        ({"size": 3}, {}, "no split"),
    ],
)
def test_hostile_windows_are_refused_at_open(start_daemon, stoker, tmp_path: Path, window, extra, needle) -> None:
    write_well(tmp_path / "well", [(2, 12)], seed=4)
    daemon = start_daemon(allowed_roots=[tmp_path])
    with pytest.raises((stoker.DatasetError, stoker.LimitError)) as e:
        stoker.Loader(split_spec(stoker, tmp_path / "well", window), batch_size=2, socket=daemon.socket)
    assert needle in str(e.value)
    with pytest.raises(ValueError, match="64 bits"):
        split_spec(stoker, tmp_path / "well", {"n_steps_input": 2**63, "n_steps_output": 2**63})
    # the daemon keeps serving
    loader = stoker.Loader(split_spec(stoker, tmp_path / "well", {"n_steps_input": 2, "n_steps_output": 1}), batch_size=2, socket=daemon.socket)
    assert len(next(iter(loader))["tag"]) == 2


def doc_blocks() -> tuple[str, str]:
    text = (REPO / "docs" / "the-well.md").read_text()
    toml = re.search(r"```toml\n(.*?)```", text, re.S).group(1)
    python = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "stoker.hdf5" in b][0]
    return toml, python


def test_the_well_guide_config_and_python_match_welldataset(start_daemon, stoker, tmp_path: Path, monkeypatch) -> None:
    """docs/the-well.md's TOML table and stoker.hdf5 call, on files in The
    Well's layout, give WellDataset's windows: every window once per epoch,
    its input and output steps, its dt within WellDataset's range."""
    base = tmp_path / "shear_flow"
    shapes = [(2, 14), (3, 10)]
    files = write_well(base / "data" / "train", shapes, seed=5)
    toml, python = doc_blocks()
    toml = toml.replace("/data/shear_flow", str(base))
    python = python.replace("/data/shear_flow", str(base))
    n_in, n_out, lo, hi = 4, 1, 1, 2
    assert f"n_steps_input = {n_in}, n_steps_output = {n_out}, min_dt_stride = {lo}, max_dt_stride = {hi}" in toml
    windows = [well_windows(t, n_in, n_out, lo) for _, t in shapes]
    n = sum(k * w for (k, _), w in zip(shapes, windows))

    # Every (file, trajectory, t0, dt) WellDataset may produce, by its tracer input.
    candidates = {}
    for k, (path, (n_traj, n_t)) in enumerate(zip(files, shapes)):
        with h5py.File(path) as f:
            tracer = f["t0_fields/tracer"][()]
        for traj in range(n_traj):
            for t0 in range(windows[k]):
                for dt in range(lo, max(lo, min(hi, well_max_dt(t0, n_t, n_in, n_out))) + 1):
                    candidates[tracer[traj, t0 : t0 + n_in * dt : dt].tobytes()] = (k, traj, t0, dt)

    def check(loader: Any) -> None:
        seen = Counter()
        for b in loader:
            for r in range(len(b["tracer_in"])):
                k, traj, t0, dt = candidates[b["tracer_in"][r].tobytes()]
                seen[(k, traj, t0)] += 1
                with h5py.File(files[k]) as f:
                    window = slice(t0, t0 + (n_in + n_out - 1) * dt + 1, dt)
                    vel, tracer = f["t1_fields/velocity"][traj, window], f["t0_fields/tracer"][traj, window]
                    check_field("velocity_in", b["velocity_in"][r], vel[:n_in])
                    check_field("velocity_out", b["velocity_out"][r], vel[n_in:])
                    check_field("tracer_out", b["tracer_out"][r], tracer[n_in:])
                    check_field("mask", b["mask"][r], f["t0_fields/mask"][()])
                    check_field("reynolds", b["reynolds"][r, ...], np.asarray(f["scalars/Reynolds"][()]))
        assert len(seen) == n and set(seen.values()) == {1}, "every WellDataset window once"

    daemon = start_daemon(allowed_roots=[tmp_path], extra="\n" + toml)
    named = stoker.Loader("shear_flow", batch_size=4, shuffle=True, seed=0, socket=daemon.socket)
    check(named)
    monkeypatch.setenv("STOKER_SOCKET", daemon.socket)
    scope: dict[str, Any] = {"stoker": stoker}
    exec(python, scope)
    check(scope["loader"])
    assert scope["loader"].fields["velocity_in"][1] == (n_in, 6, 5, 2)


def test_split_windows_normalized_and_channels_first_equal_numpy(start_daemon, stoker, tmp_path: Path) -> None:
    """The whole Well pipeline in the daemon: a split window, per-component
    normalization and channels-first, equal to numpy on h5py's arrays."""
    path = tmp_path / "w.hdf5"
    rng = np.random.default_rng(4)
    vel = rng.standard_normal((3, 9, 6, 5, 2)).astype(np.float32)
    with h5py.File(path, "w") as f:
        f["t1_fields/velocity"] = vel
    mean, std = [0.25, -1.0], [2.0, 0.5]
    norm = {"normalize": {"mean": mean, "std": std}}
    spec = stoker.hdf5(
        str(path),
        fields={"x": "t1_fields/velocity", "y": "t1_fields/velocity"},
        window={"n_steps_input": 3, "n_steps_output": 2},
        input=["x"],
        output=["y"],
        transforms={"x": [norm, "chw"], "y": [norm, "chw"]},
    )
    d = start_daemon()
    loader = stoker.Loader(spec, batch_size=4, shuffle=False, socket=d.socket)
    per = 9 - 5 + 1
    got = [(x, y) for b in loader for x, y in zip(b["x"], b["y"])]
    assert len(got) == 3 * per
    for i, (x, y) in enumerate(got):
        traj, t = divmod(i, per)
        w = ((vel[traj, t : t + 5] - np.float32(mean)) / np.float32(std)).transpose(0, 3, 1, 2)
        assert x.shape == (3, 2, 6, 5) and y.shape == (2, 2, 6, 5)
        # Bit for bit: (x - mean) / std in float32, as WellDataset computes it (issue 24, item 7).
        np.testing.assert_array_equal(x, w[:3])
        np.testing.assert_array_equal(y, w[3:])
    loader.close()


def test_stats_file_normalization_is_welldatasets_bit_for_bit(start_daemon, stoker, tmp_path: Path) -> None:
    """Issue 24, item 7: normalization from a stats.yaml was computed in
    float64 (about 30% of elements 1 ulp off WellDataset's float32) and did
    not apply WellDataset's clip of std to at least 1e-4 (a std of 1e-6 gave
    values 100 times larger). Reproduced here as ZScoreNormalization does it:
    torch tensors of the YAML values, std clipped at 1e-4, (x - mean) / std
    in float32."""
    torch = pytest.importorskip("torch")
    path = tmp_path / "w.hdf5"
    rng = np.random.default_rng(9)
    vel = (rng.standard_normal((2, 6, 5, 4, 2)) * 3.7 + 0.3).astype(np.float32)
    dens = (rng.standard_normal((2, 6, 5, 4)) * 1e-5 + 0.1).astype(np.float32)
    with h5py.File(path, "w") as f:
        f["t1_fields/velocity"] = vel
        f["t0_fields/density"] = dens
    means = {"velocity": [0.3123456789, -0.1987654321], "density": 0.1000000123}
    stds = {"velocity": [3.7123456789, 2.9], "density": 0.000001}
    stats = tmp_path / "stats.yaml"
    stats.write_text("mean:\n" + "".join(f"  {k}: {v}\n" for k, v in means.items())
                     + "std:\n" + "".join(f"  {k}: {v}\n" for k, v in stds.items()))
    spec = stoker.hdf5(
        str(path),
        fields={"v": "t1_fields/velocity", "d": "t0_fields/density"},
        transforms={"v": [{"normalize": {"stats": str(stats), "key": "velocity"}}],
                    "d": [{"normalize": {"stats": str(stats), "key": "density"}}]},
    )
    d = start_daemon()
    loader = stoker.Loader(spec, batch_size=2, shuffle=False, socket=d.socket)
    batch = next(iter(loader))
    got_v, got_d = batch["v"].copy(), batch["d"].copy()
    loader.close()

    def well(x: np.ndarray, field: str) -> np.ndarray:
        mean = torch.as_tensor(means[field])
        std = torch.clip(torch.as_tensor(stds[field]), min=1e-4)
        return ((torch.from_numpy(x) - mean) / std).numpy()

    np.testing.assert_array_equal(got_v, well(vel, "velocity"))
    np.testing.assert_array_equal(got_d, well(dens, "density"))
    assert np.abs(got_d).max() < 1.0, "std 1e-6 raised to 1e-4, not dividing by 1e-6"


def test_time_only_fields_deliver_the_window_steps_like_h5py(start_daemon, stoker, tmp_path: Path) -> None:
    """Fields that vary in time but not by trajectory (The Well's
    `sample_varying = False`, `time_varying = True`: `dimensions/time`, the
    time-varying scalars, shaped `[T]`), listed in `time_only`, give every
    sample its window's steps at its dt (split into input and output when
    also listed there), equal to h5py slicing; from Python and from a
    `[datasets.NAME]` table."""
    shapes = [(3, 14), (2, 11)]
    files = write_well(tmp_path / "well", shapes, seed=6)
    n_in, n_out, lo, hi = 2, 2, 1, 3
    fields = {
        "tag": "tag",
        "t_in": "dimensions/time",
        "t_out": "dimensions/time",
        "tvs": "scalars/time_varying_scalar",
        "p_in": "t0_fields/tracer",
    }
    window = {"n_steps_input": n_in, "n_steps_output": n_out, "min_dt_stride": lo, "max_dt_stride": hi}
    spec = stoker.hdf5(
        str(tmp_path / "well" / "*.hdf5"), fields=fields, window=window,
        input=["t_in", "p_in"], output=["t_out"], time_only=["t_in", "t_out", "tvs"],
    )
    toml = f"""
[datasets.well]
format = "hdf5"
files = "{tmp_path / 'well' / '*.hdf5'}"
window = {{ n_steps_input = {n_in}, n_steps_output = {n_out}, min_dt_stride = {lo}, max_dt_stride = {hi} }}
input = ["t_in", "p_in"]
output = ["t_out"]
time_only = ["t_in", "t_out", "tvs"]
[datasets.well.fields]
""" + "".join(f'{k} = "{v}"\n' for k, v in fields.items())
    daemon = start_daemon(allowed_roots=[tmp_path], extra=toml)
    n = sum(k * well_windows(t, n_in, n_out, lo) for k, t in shapes)
    for source in (spec, "well"):
        loader = stoker.Loader(source, batch_size=4, shuffle=True, seed=2, socket=daemon.socket)
        assert loader.fields["t_in"] == (np.dtype(np.float32), (n_in,))
        assert loader.fields["tvs"] == (np.dtype(np.float64), (n_in + n_out,))
        seen, dts = set(), Counter()
        for b in loader:
            for r in range(len(b["tag"])):
                tag = b["tag"][r]
                k, rest = divmod(int(tag[0]), 10**6)
                traj, t0 = divmod(rest, 10**3)
                dt = int(tag[1] - tag[0])
                seen.add((k, traj, t0))
                dts[dt] += 1
                with h5py.File(files[k]) as f:
                    steps = slice(t0, t0 + (n_in + n_out - 1) * dt + 1, dt)
                    check_field("tag", tag, f["tag"][traj, steps])
                    check_field("p_in", b["p_in"][r], f["t0_fields/tracer"][traj, steps][:n_in])
                    time = f["dimensions/time"][steps]
                    check_field("t_in", b["t_in"][r], time[:n_in])
                    check_field("t_out", b["t_out"][r], time[n_in:])
                    check_field("tvs", b["tvs"][r], f["scalars/time_varying_scalar"][steps])
        assert len(seen) == n, "every window once"
        assert len(dts) > 1, f"dt draws do not vary: {dts}"
        loader.close()
    # A time_only field whose length is not the time axis is refused at open, by name.
    bad = stoker.hdf5(
        str(tmp_path / "well" / "*.hdf5"), fields={"tag": "tag", "x": "dimensions/x"},
        window={"size": 2}, time_only=["x"],
    )
    with pytest.raises(stoker.DatasetError, match="dimensions/x"):
        stoker.Loader(bad, batch_size=2, socket=daemon.socket)
    with pytest.raises(ValueError, match="window"):
        stoker.hdf5(str(tmp_path / "well" / "*.hdf5"), fields={"tag": "tag", "x": "dimensions/x"}, time_only=["x"])


def test_inspect_suggests_the_split_constants_and_time_only_fields(start_daemon, stoker, tmp_path: Path) -> None:
    """`stoker inspect` on a file in The Well's layout suggests a split window
    (each time-varying field as `_in`/`_out`), its per-trajectory, constant
    and time-only fields; the table as printed serves WellDataset's samples."""
    import subprocess

    import tomllib

    from conftest import SUBPROCESS_TIMEOUT_S, stoker_bin

    files = write_well(tmp_path / "well", [(2, 9)], seed=7)
    res = subprocess.run([str(stoker_bin()), "inspect", str(files[0])], capture_output=True, text=True,
                         timeout=SUBPROCESS_TIMEOUT_S)
    assert res.returncode == 0, res.stderr
    head, sep, tail = res.stdout.partition("\nsuggested config")
    assert sep and "WellDataset(n_steps_input=4, n_steps_output=1)" in tail, res.stdout
    table = tail.split("\n", 1)[1]
    (name, ds), = tomllib.loads(table)["datasets"].items()
    assert ds["window"] == {"n_steps_input": 4, "n_steps_output": 1}, table
    assert sorted(ds["input"]) == ["tracer_in", "velocity_in"], table
    assert sorted(ds["output"]) == ["tracer_out", "velocity_out"], table
    assert ds["per_item"] == ["constant_field"], table
    assert sorted(ds["constant"]) == ["Reynolds", "a", "b", "mask"], table
    assert sorted(ds["time_only"]) == ["time", "time_varying_scalar"], table
    daemon = start_daemon(allowed_roots=[tmp_path], extra="\n" + table)
    loader = stoker.Loader(name, batch_size=3, shuffle=False, socket=daemon.socket)
    rows = [{k: np.array(v[j]) for k, v in b.items()} for b in loader for j in range(len(b["velocity_in"]))]
    per = well_windows(9, 4, 1, 1)
    assert len(rows) == 2 * per
    with h5py.File(files[0]) as f:
        for i, r in enumerate(rows):
            traj, t0 = divmod(i, per)
            steps = slice(t0, t0 + 5)
            vel = f["t1_fields/velocity"][traj, steps]
            check_field("velocity_in", r["velocity_in"], vel[:4])
            check_field("velocity_out", r["velocity_out"], vel[4:])
            check_field("tracer_out", r["tracer_out"], f["t0_fields/tracer"][traj, steps][4:])
            check_field("constant_field", r["constant_field"], f["t0_fields/constant_field"][traj])
            check_field("mask", r["mask"], f["t0_fields/mask"][()])
            check_field("Reynolds", r["Reynolds"], np.asarray(f["scalars/Reynolds"][()]))
            check_field("time", r["time"], f["dimensions/time"][steps])
            check_field("time_varying_scalar", r["time_varying_scalar"], f["scalars/time_varying_scalar"][steps])
    loader.close()
