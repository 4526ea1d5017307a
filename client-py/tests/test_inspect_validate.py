"""`stoker inspect` and `stoker validate` agree: the config table inspect
suggests for files written by h5py and environments written by `lmdb` passes
`stoker validate` as printed, and a real daemon started with it serves the
suggested dataset byte for byte as h5py, Pillow and numpy read the same data.
`validate` also opens what a config names (globs, environments) and reports
every problem with its line.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any, Callable

import h5py
import lmdb
import numpy as np
import pytest
import tomllib

from conftest import SUBPROCESS_TIMEOUT_S, make_config, stoker_bin
from lmdb_data import noise, npy_bytes, pil_decode, png_of, write_env

# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def run_stoker(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(stoker_bin()), *map(str, args)], capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S
    )


def suggestion(*paths: Path) -> tuple[str, dict[str, Any]]:
    """`stoker inspect PATHS`: the suggested TOML table (everything after the
    "suggested config" line, as printed) and its one dataset, parsed."""
    res = run_stoker("inspect", *paths)
    assert res.returncode == 0, res.stderr
    head, sep, tail = res.stdout.partition("\nsuggested config")
    assert sep, f"no suggested config in:\n{res.stdout}"
    table = tail.split("\n", 1)[1]
    datasets = tomllib.loads(table)["datasets"]
    assert len(datasets) == 1, table
    return table, next(iter(datasets.items()))


def validate(config: Path) -> subprocess.CompletedProcess[str]:
    return run_stoker("validate", config)


def validated_daemon(start_daemon: Callable[..., Any], tmp_path: Path, table: str) -> Any:
    """Writes a config holding `table` as printed, checks `stoker validate`
    accepts it, then starts a daemon with that very table."""
    config = tmp_path / "suggested.toml"
    config.write_text(make_config(str(tmp_path / "unused.sock"), extra="\n" + table))
    res = validate(config)
    assert res.returncode == 0, f"validate refused inspect's suggestion:\n{table}\n{res.stderr}"
    assert "is valid" in res.stdout
    return start_daemon(extra="\n" + table)


def served_rows(stoker: Any, daemon: Any, name: str, batch_size: int) -> list[dict[str, np.ndarray]]:
    """Every sample of one epoch, in order, copied out of shared memory."""
    loader = stoker.Loader(name, batch_size=batch_size, shuffle=False, socket=daemon.socket)
    out = []
    for b in loader:
        n = len(next(iter(b.values())))
        out.extend({k: np.array(v[j]) for k, v in b.items()} for j in range(n))
    loader.close()
    return out


def assert_same(served: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert served.dtype == expected.dtype.newbyteorder("="), (what, served.dtype, expected.dtype)
    assert served.shape == expected.shape, (what, served.shape, expected.shape)
    assert served.tobytes() == expected.astype(served.dtype).tobytes(), f"{what}: bytes differ"


# --------------------------------------------------------------------------
# HDF5
# --------------------------------------------------------------------------


def test_plain_h5_suggestion_validates_and_serves(stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path) -> None:
    root = tmp_path / "plain"
    root.mkdir()
    rng = np.random.default_rng(1)
    lengths = (7, 12, 5)
    for k, n in enumerate(lengths):
        with h5py.File(root / f"part_{k}.h5", "w") as f:
            f.create_dataset("images", data=rng.integers(0, 255, size=(n, 4, 5), dtype=np.uint8), chunks=(2, 4, 5), compression="gzip")
            f.create_dataset("meta/label", data=np.arange(n, dtype=np.int64) + 100 * k)
            f.create_dataset("note", data=np.float32(3.5))  # a scalar: not a field
    (root / "README.txt").write_text("not data")

    # Inspect from a relative path: the suggestion still names absolute files.
    res = subprocess.run(
        [str(stoker_bin()), "inspect", "plain/part_1.h5"], cwd=tmp_path, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S
    )
    assert res.returncode == 0, res.stderr
    table = res.stdout.partition("\nsuggested config")[2].split("\n", 1)[1]
    name, ds = next(iter(tomllib.loads(table)["datasets"].items()))
    assert name == "part_1"
    # The shards of the inspected file's name (issue 24, item 6: not every
    # .h5 beside it), and a comment naming the files it leaves out.
    assert ds["files"] == f"{root.resolve()}/part_*.h5"
    assert "# matches 3 files in" in table
    assert ds["fields"] == {"images": "images", "label": "meta/label"}
    assert "window" not in ds

    daemon = validated_daemon(start_daemon, tmp_path, table)
    rows = served_rows(stoker, daemon, name, batch_size=5)
    expected = []
    for k in range(len(lengths)):
        with h5py.File(root / f"part_{k}.h5") as f:
            expected += [(f["images"][i], f["meta/label"][i]) for i in range(lengths[k])]
    assert len(rows) == sum(lengths)
    for i, (r, (img, label)) in enumerate(zip(rows, expected)):
        assert_same(r["images"], img, f"images[{i}]")
        assert_same(r["label"], np.asarray(label), f"label[{i}]")


def write_well_file(path: Path, traj: int, time: int, seed: int) -> None:
    """A file in The Well's layout: fields under t0_fields/t1_fields, a
    per-trajectory constant without the time axis, and the groups that
    describe the fields (dimensions, boundary_conditions, scalars)."""
    rng = np.random.default_rng(seed)
    nx, ny = 8, 6
    with h5py.File(path, "w") as f:
        f.attrs["dataset_name"] = "shear_flow"
        f.attrs["n_spatial_dims"] = 2
        f.attrs["n_trajectories"] = traj
        f.create_dataset("t0_fields/density", data=rng.standard_normal((traj, time, nx, ny), dtype=np.float32), chunks=(1, 2, nx, ny), compression="gzip")
        f.create_dataset("t0_fields/mask", data=rng.integers(0, 2, size=(traj, nx, ny)).astype(np.float32))
        f.create_dataset("t1_fields/velocity", data=rng.standard_normal((traj, time, nx, ny, 2), dtype=np.float32))
        f["t0_fields"].attrs["field_names"] = ["density", "mask"]
        f.create_dataset("dimensions/time", data=np.linspace(0, 1, time, dtype=np.float32))
        f.create_dataset("dimensions/x", data=np.linspace(0, 1, nx, dtype=np.float32))
        f.create_dataset("dimensions/y", data=np.linspace(0, 1, ny, dtype=np.float32))
        f.create_dataset("boundary_conditions/x_periodic/mask", data=np.ones(nx, dtype=bool))
        f.create_dataset("boundary_conditions/x_periodic/values", data=np.zeros(traj, dtype=np.float32))
        f.create_dataset("scalars/Reynolds", data=np.float64(1e4))
        f.create_dataset("scalars/Schmidt", data=np.full(traj, 0.5))


def test_the_well_suggestion_windows_with_per_item_constants(stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path) -> None:
    root = tmp_path / "shear_flow" / "data" / "train"
    root.mkdir(parents=True)
    time = 7
    trajs = (3, 2)
    files = [root / f"shear_flow_Reynolds_{k}.hdf5" for k in range(len(trajs))]
    for k, (path, traj) in enumerate(zip(files, trajs)):
        write_well_file(path, traj, time, seed=k)

    table, (name, ds) = suggestion(files[0])
    assert ds["files"] == f"{root.resolve()}/*.hdf5", "the files' real extension"
    # The Well's split: each time-varying field as input and output, WellDataset-style.
    assert ds["fields"] == {
        "density_in": "t0_fields/density", "density_out": "t0_fields/density", "mask": "t0_fields/mask",
        "velocity_in": "t1_fields/velocity", "velocity_out": "t1_fields/velocity",
        "time": "dimensions/time", "Reynolds": "scalars/Reynolds",
    }, table
    n_in, n_out = ds["window"]["n_steps_input"], ds["window"]["n_steps_output"]
    assert (n_in, n_out) == (4, 1), table
    size = n_in + n_out
    assert ds["input"] == ["density_in", "velocity_in"] and ds["output"] == ["density_out", "velocity_out"]
    assert ds["per_item"] == ["mask"]
    assert ds["constant"] == ["Reynolds"] and ds["time_only"] == ["time"], table

    daemon = validated_daemon(start_daemon, tmp_path, table)
    rows = served_rows(stoker, daemon, name, batch_size=4)
    expected = []
    for path, traj in zip(files, trajs):
        with h5py.File(path) as f:
            for item in range(traj):
                for t0 in range(time - size + 1):
                    density = f["t0_fields/density"][item, t0 : t0 + size]
                    velocity = f["t1_fields/velocity"][item, t0 : t0 + size]
                    expected.append(
                        {
                            "density_in": density[:n_in],
                            "density_out": density[n_in:],
                            "velocity_in": velocity[:n_in],
                            "velocity_out": velocity[n_in:],
                            "mask": f["t0_fields/mask"][item],
                            "time": f["dimensions/time"][t0 : t0 + size],
                            "Reynolds": np.asarray(f["scalars/Reynolds"][()]),
                        }
                    )
    assert len(rows) == len(expected)
    for i, (r, e) in enumerate(zip(rows, expected)):
        for field in e:
            assert_same(r[field], e[field], f"{field}[{i}]")


# --------------------------------------------------------------------------
# LMDB
# --------------------------------------------------------------------------


def basicsr_keys(n_images: int, subs: int) -> list[str]:
    """BasicSR's sub-image keys: 0001_s001, 0001_s002, ..."""
    return [f"{i:04d}_s{s:03d}" for i in range(1, n_images + 1) for s in range(1, subs + 1)]


def write_meta_info(env: Path, keys: list[str], shapes: dict[str, tuple[int, ...]]) -> None:
    """BasicSR's meta_info.txt, written into the environment's directory."""
    (env / "meta_info.txt").write_text("".join(f"{k}.png ({','.join(map(str, shapes[k]))}) 1\n" for k in keys))


def test_basicsr_lmdb_suggests_its_meta_info_as_key_file(stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path) -> None:
    keys = basicsr_keys(3, 2)
    images = {k: noise(10, 12, 3, seed=i) for i, k in enumerate(keys)}
    env = write_env(tmp_path / "DIV2K_train_HR_sub.lmdb", {k: png_of(a) for k, a in images.items()})
    # The listing, not the key order, is the sample order.
    listed = keys[::-1]
    write_meta_info(env, listed, {k: a.shape for k, a in images.items()})

    table, (name, ds) = suggestion(env)
    assert ds["key_file"] == str(env.resolve() / "meta_info.txt")
    assert [f["name"] for f in ds["fields"]] == ["x"]
    assert ds["fields"][0]["env"] == str(env.resolve())
    assert ds["fields"][0]["codec"] == "png"

    daemon = validated_daemon(start_daemon, tmp_path, table)
    rows = served_rows(stoker, daemon, name, batch_size=4)
    assert len(rows) == len(listed)
    with lmdb.open(str(env), readonly=True, lock=False) as db, db.begin() as txn:
        for i, (r, k) in enumerate(zip(rows, listed)):
            assert_same(r["x"], pil_decode(txn.get(k.encode())), f"x[{i}] ({k})")


def write_sr_pair(root: Path, keys: list[str]) -> tuple[Path, Path, dict[str, np.ndarray]]:
    """DIV2K-style LR and HR environments side by side: LR images of varying
    size, HR = LR repeated 4× (nearest), each with its meta_info.txt."""
    lr = {k: noise(6 + i % 3, 7 + (2 * i) % 5, 3, seed=50 + i) for i, k in enumerate(keys)}
    hr = {k: np.repeat(np.repeat(a, 4, axis=0), 4, axis=1) for k, a in lr.items()}
    hr_env = write_env(root / "DIV2K_train_HR_sub.lmdb", {k: png_of(a) for k, a in hr.items()})
    lr_env = write_env(root / "DIV2K_train_LR_bicubic_X4_sub.lmdb", {k: png_of(a) for k, a in lr.items()})
    write_meta_info(hr_env, keys, {k: a.shape for k, a in hr.items()})
    write_meta_info(lr_env, keys, {k: a.shape for k, a in lr.items()})
    # An unrelated environment beside them is not taken for a partner.
    write_env(root / "labels.lmdb", {k: npy_bytes(np.int64(i)) for i, k in enumerate(keys)})
    return lr_env, hr_env, lr


@pytest.mark.parametrize("given", ["hr", "lr", "both"])
def test_lr_hr_environments_are_suggested_as_a_pair(
    stoker: Any, start_daemon: Callable[..., Any], tmp_path: Path, given: str
) -> None:
    keys = basicsr_keys(3, 3)
    lr_env, hr_env, lr = write_sr_pair(tmp_path, keys)
    paths = {"hr": [hr_env], "lr": [lr_env], "both": [hr_env, lr_env]}[given]

    table, (name, ds) = suggestion(*paths)
    assert name == "DIV2K_train_HR_sub"
    fields = {f["name"]: f for f in ds["fields"]}
    assert list(fields) == ["lr", "hr"], "the pair's leader (LR) first"
    assert fields["lr"]["env"] == str(lr_env.resolve())
    assert fields["hr"]["env"] == str(hr_env.resolve())
    assert fields["hr"]["pair"] == {"with": "lr", "scale": 4}, "scale from the images' sizes"
    assert "pair" not in fields["lr"]
    assert ds["key_file"] == str(hr_env.resolve() / "meta_info.txt")

    daemon = validated_daemon(start_daemon, tmp_path, table)
    rows = served_rows(stoker, daemon, name, batch_size=4)
    assert len(rows) == len(keys)
    with (
        lmdb.open(str(lr_env), readonly=True, lock=False) as le,
        lmdb.open(str(hr_env), readonly=True, lock=False) as he,
        le.begin() as lt,
        he.begin() as ht,
    ):
        for i, (r, k) in enumerate(zip(rows, keys)):
            assert_same(r["lr"], pil_decode(lt.get(k.encode())), f"lr[{i}] ({k})")
            assert_same(r["hr"], pil_decode(ht.get(k.encode())), f"hr[{i}] ({k})")
            assert_same(r["lr"], lr[k], f"lr[{i}] vs the array written")


# --------------------------------------------------------------------------
# validate: every problem, each with its line
# --------------------------------------------------------------------------


def line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def test_validate_reports_every_bad_dataset_with_its_line(tmp_path: Path) -> None:
    good_root = tmp_path / "good"
    good_root.mkdir()
    with h5py.File(good_root / "a.h5", "w") as f:
        f.create_dataset("x", data=np.arange(10))
    not_env = tmp_path / "not_an_env"
    not_env.mkdir()
    (not_env / "data.mdb").write_bytes(b"\0" * 100)  # truncated: does not open
    missing = tmp_path / "nothing_here"
    text = make_config(str(tmp_path / "s.sock")) + (
        "\n[datasets.good]\n"
        'format = "hdf5"\n'
        f'files = "{good_root}/*.h5"\n'
        'fields = { x = "x" }\n'
        "\n[datasets.no_files]\n"
        'format = "hdf5"\n'
        f'files = "{missing}/*.hdf5"\n'
        'fields = { x = "x" }\n'
        "\n[datasets.broken_env]\n"
        'format = "lmdb"\n'
        "\n[[datasets.broken_env.fields]]\n"
        'name = "img"\n'
        f'env = "{not_env}"\n'
        'codec = "png"\n'
    )
    config = tmp_path / "bad.toml"
    config.write_text(text)
    res = validate(config)
    assert res.returncode != 0
    err = res.stderr
    assert "2 errors" in err, err
    glob_line = line_of(text, f'files = "{missing}')
    env_line = line_of(text, f'env = "{not_env}"')
    assert re.search(rf"{re.escape(str(config))}:{glob_line}: \[datasets\.no_files\].*{re.escape(str(missing))}", err), err
    assert re.search(rf"{re.escape(str(config))}:{env_line}: \[datasets\.broken_env\].*{re.escape(str(not_env))}", err), err
    assert "datasets.good" not in err

    # Values only (for systemd's ExecStartPre, before data is mounted): the files are not opened.
    res = run_stoker("validate", "--skip-files", config)
    assert res.returncode == 0, res.stderr


def test_validate_reports_every_bad_value_with_its_line(tmp_path: Path) -> None:
    text = (
        "[ring]\n"
        "depth = 0\n"
        "\n[limits]\n"
        "max_batch_size = 0\n"
        "\n[datasets.rel]\n"
        'format = "hdf5"\n'
        'files = "relative/*.h5"\n'
        'fields = { x = "x" }\n'
        'per_item = ["y"]\n'
    )
    config = tmp_path / "values.toml"
    config.write_text(text)
    res = validate(config)
    assert res.returncode != 0
    err = res.stderr
    assert "4 errors" in err, err
    for needle, what in [("depth = 0", "depth"), ("max_batch_size = 0", "max_batch_size"), ("files =", "must be an absolute"), ("per_item =", "per_item")]:
        assert re.search(rf":{line_of(text, needle)}: .*{what}", err), (needle, err)


def test_validate_toml_error_names_its_line(tmp_path: Path) -> None:
    config = tmp_path / "syntax.toml"
    config.write_text("[ring]\ndepth = 4\n\n[limits\nmax_batch_size = 2\n")
    res = validate(config)
    assert res.returncode != 0
    assert "syntax.toml:4:" in res.stderr or "line 4" in res.stderr, res.stderr


def test_inspect_walks_each_group_once_through_hard_link_cycles(tmp_path: Path) -> None:
    """Hard links can make a group its own descendant: inspect recursed
    until the stack overflowed. Each group is now walked once (as h5py's
    visititems does), so every dataset is listed under its first path."""
    path = tmp_path / "cycle.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("a/x", data=np.arange(6, dtype=np.float32).reshape(3, 2))
        f.create_dataset("b/y", data=np.arange(4, dtype=np.int16))
        f["a/up"] = f  # a hard link to the root: / → a → up → / …
        f["b/a_again"] = f["a"]
        f["b/self"] = f["b"]
        seen = []
        f.visititems(lambda name, obj: seen.append(name) if isinstance(obj, h5py.Dataset) else None)
    res = subprocess.run(
        [str(stoker_bin()), "inspect", "--json", str(path)], capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S
    )
    assert res.returncode == 0, res.stderr[-2000:]
    listed = sorted(d["path"] for d in json.loads(res.stdout))
    assert listed == sorted(seen) == ["a/x", "b/y"], listed


def test_the_cli_ends_quietly_when_its_reader_has_gone(start_daemon: Callable[..., Any], data: Any) -> None:
    """Issue 24, item 8: `stoker datasets | head -1` panicked ("failed
    printing to stdout: Broken pipe", exit 101). Every report now ends
    quietly with status 0 when stdout's reader has gone."""
    d = start_daemon(datasets={f"set{i}": data for i in range(40)})
    for args in (["datasets", "--socket", d.socket], ["status", "--socket", d.socket], ["datasets", "--json",
                                                                                         "--socket", d.socket]):
        for _ in range(3):
            proc = subprocess.Popen([str(stoker_bin()), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            assert proc.stdout is not None and proc.stderr is not None
            proc.stdout.close()  # the reader goes before the report is written
            err = proc.stderr.read().decode()
            assert proc.wait(timeout=SUBPROCESS_TIMEOUT_S) == 0, (args, err)
            assert "panicked" not in err and "Broken pipe" not in err, (args, err)


def _readme_block() -> str:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Your own data in four lines", 1)[1]
    return section.split("```sh\n", 1)[1].split("```", 1)[0]


def test_the_readme_lines_work_pasted_as_one_block(tmp_path: Path) -> None:
    """Issue 24, item 3: the README's lines, pasted as a block, ran the Python
    line before the daemon listened (`DaemonUnavailable` 5 times of 5). They
    now end in `stoker run`, which waits for its daemon; run here as one
    script, with the README's path replaced by a real file."""
    import sys

    data = tmp_path / "data"
    data.mkdir()
    with h5py.File(data / "train-000.h5", "w") as f:
        f.create_dataset("image", data=np.zeros((100, 4, 4), dtype=np.float32))
        f.create_dataset("label", data=np.arange(100, dtype=np.int64))
    block = _readme_block().replace("/data/", f"{data}/")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "stoker").symlink_to(stoker_bin())
    (bindir / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (bindir / "python").chmod(0o755)
    env = {**__import__("os").environ, "PATH": f"{bindir}:{__import__('os').environ['PATH']}", "TMPDIR": "/tmp"}
    env.pop("STOKER_SOCKET", None)
    for _ in range(3):
        res = subprocess.run(["bash", "-e", "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=SUBPROCESS_TIMEOUT_S)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "dict_keys(['image', 'label'])" in res.stdout, res.stdout + res.stderr


def test_stoker_run_passes_status_and_signals_and_stops_its_daemon(tmp_path: Path) -> None:
    """`stoker run -- CMD`: the command's exit status comes back, a signal
    sent to `stoker run` reaches the command (which dies of it: 128 + 15),
    and the daemon is gone afterwards (its socket removed)."""
    import os
    import signal
    import time

    sock = Path("/tmp") / f"stk-run-{os.getpid()}.sock"
    res = subprocess.run([str(stoker_bin()), "run", "--socket", str(sock), "--", "sh", "-c",
                          'test "$STOKER_SOCKET" = "$0" && test -S "$0" && exit 7', str(sock)],
                         capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert res.returncode == 7, res.stderr
    assert not sock.exists(), "the daemon's socket is left behind"
    proc = subprocess.Popen([str(stoker_bin()), "run", "--socket", str(sock), "--", "sleep", "60"],
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not sock.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # the command has started once the daemon answers
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=SUBPROCESS_TIMEOUT_S) == 128 + signal.SIGTERM
    assert not sock.exists()
    # A daemon that cannot start is reported at once, not after --wait.
    bad = tmp_path / "bad.toml"
    bad.write_text("[ring]\ndepht = 4\n")
    started = time.monotonic()
    res = subprocess.run([str(stoker_bin()), "run", "--config", str(bad), "--socket", str(sock), "--", "true"],
                         capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert res.returncode != 0 and "exited" in res.stderr and "depht" in res.stderr, res.stderr
    assert time.monotonic() - started < 30


def test_inspect_suggests_the_shards_of_the_inspected_name_only(tmp_path: Path) -> None:
    """Issue 24, item 6: `stoker inspect train-000.h5` suggested `<dir>/*.h5`,
    so `val-000.h5` beside it joined training silently. The suggestion is
    now `train-*.h5`, and a comment names the files it leaves out."""
    for name in ("train-000.h5", "train-001.h5", "val-000.h5"):
        with h5py.File(tmp_path / name, "w") as f:
            f.create_dataset("x", data=np.zeros((4, 2), dtype=np.float32))
    res = subprocess.run([str(stoker_bin()), "inspect", str(tmp_path / "train-000.h5")], capture_output=True,
                         text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert res.returncode == 0, res.stderr
    table = res.stdout.partition("\nsuggested config")[2].split("\n", 1)[1]
    ds = next(iter(tomllib.loads(table)["datasets"].values()))
    assert ds["files"] == f"{tmp_path}/train-*.h5"
    assert "matches 2 files" in table and "leaves out val-000.h5" in table, table
    # And `validate` says what the dataset holds: its files and samples.
    config = tmp_path / "my.toml"
    config.write_text(table)
    res = subprocess.run([str(stoker_bin()), "validate", str(config)], capture_output=True, text=True,
                         timeout=SUBPROCESS_TIMEOUT_S)
    assert res.returncode == 0, res.stderr
    assert "train_000: hdf5, 2 files, 8 samples" in res.stdout, res.stdout


def test_validate_lists_every_bad_table_with_did_you_mean(tmp_path: Path) -> None:
    """Issue 24, item 4: `validate` stopped at the first table serde could
    not read, and a misspelt `formt =` said "missing field `format`" without
    naming `formt`. Every section and dataset table is now read on its own."""
    config = tmp_path / "bad.toml"
    config.write_text(
        "[ring]\ndepht = 4\n\n"
        '[datasets.a]\nformt = "hdf5"\nfiles = "/x/*.h5"\n\n'
        '[datasets.b]\nformat = "hdf5"\nfiles = "/y/*.h5"\nfields = { x = "x" }\ntransforms.x = [{ random_crap = 4 }]\n'
    )
    res = validate(config)
    assert res.returncode != 0
    assert "3 errors" in res.stderr, res.stderr
    assert "bad.toml:2:" in res.stderr and "did you mean `depth`" in res.stderr, res.stderr
    assert "bad.toml:4:" in res.stderr and "the table has `formt`: did you mean `format`" in res.stderr, res.stderr
    assert "bad.toml:12:" in res.stderr and "random_crap" in res.stderr, res.stderr
