"""The self-contained wheel, installed where neither Rust nor the build's
libraries are reachable.

`scripts/build-wheel.sh` bundles the release binary the rest of the suite
uses (`$STOKER_BIN`, else target/release/stoker) into a wheel; the wheel goes
into a fresh venv (no `--system-site-packages`) with `cargo`/`rustc` stripped
from PATH and `LD_LIBRARY_PATH` unset. Then, through that venv only: the
bundled binary's libraries resolve from the wheel or glibc's base set, the
`stoker` console entry point runs the daemon, and `stoker.Loader` from the
venv's python reads an HDF5 file written by h5py, byte for byte.

Building and installing take a few seconds when the release build is warm
(pip fetches numpy from its cache or index). Skip with STOKER_SKIP_WHEEL_TEST=1;
test a wheel built elsewhere with STOKER_WHEEL=path/to/stoker-*.whl.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, SUBPROCESS_TIMEOUT_S, Daemon, make_config, stoker_bin, write_h5

pytestmark = pytest.mark.skipif(
    os.environ.get("STOKER_SKIP_WHEEL_TEST") == "1", reason="STOKER_SKIP_WHEEL_TEST=1"
)

#: Libraries every glibc Linux has (the manylinux base set): the only ones the
#: installed daemon may take from the system.
BASE_LIBS = re.compile(
    r"^(linux-vdso|ld-linux[-\w]*|libc|libm|libpthread|libdl|librt|libresolv|libutil|libnsl|libgcc_s|libstdc\+\+)\.so"
)

#: Longer than a subprocess normally takes: pip may build nothing but does download numpy.
INSTALL_TIMEOUT_S = 300.0


def run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = SUBPROCESS_TIMEOUT_S, **kw) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, **kw)
    if res.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))} exited {res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}")
    return res


def no_rust_path() -> str:
    """PATH without any directory that holds cargo or rustc."""
    dirs = [
        d
        for d in os.environ.get("PATH", "").split(os.pathsep)
        if d and not any(os.path.exists(os.path.join(d, tool)) for tool in ("cargo", "rustc", "rustup"))
    ]
    return os.pathsep.join(dirs)


class Venv:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.bin = root / "bin"
        self.python = self.bin / "python"
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("LD_LIBRARY_PATH", "LD_PRELOAD", "STOKER_BIN", "STOKER_SOCKET", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
            and not k.startswith(("CARGO", "RUSTUP", "MATURIN"))
        }
        env["PATH"] = os.pathsep.join([str(self.bin), no_rust_path()])
        env["VIRTUAL_ENV"] = str(root)
        env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
        self.env = env

    def site_stoker(self) -> Path:
        res = run([str(self.python), "-c", "import stoker, os; print(os.path.dirname(stoker.__file__))"], env=self.env)
        return Path(res.stdout.strip())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    prebuilt = os.environ.get("STOKER_WHEEL")
    if prebuilt:
        # A wheel built elsewhere (CI artifact, another machine): test it as is.
        return Path(prebuilt)
    binary = stoker_bin()
    if not binary.is_file():
        pytest.fail(f"stoker binary not found at {binary} (build it or set STOKER_BIN)")
    out = tmp_path_factory.mktemp("dist")
    env = dict(os.environ, STOKER_WHEEL_OUT=str(out), PYTHON=sys.executable)
    res = run(["bash", str(REPO / "scripts" / "build-wheel.sh"), str(binary)], env=env, timeout=INSTALL_TIMEOUT_S)
    wheel = Path(res.stdout.strip().splitlines()[-1])
    assert wheel.is_file() and wheel.parent == out, res.stdout
    # One abi3 wheel for every CPython from 3.9 on (issue 24, item 10).
    assert re.fullmatch(r"stoker-[\w.]+-cp39-abi3-manylinux_2_\d+_x86_64\.whl", wheel.name), wheel.name
    print(f"\nwheel {wheel.name}: {wheel.stat().st_size / 2**20:.1f} MiB ({wheel.stat().st_size} bytes)")
    return wheel


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Venv:
    v = Venv(tmp_path_factory.mktemp("venv") / "env")
    # No Rust anywhere the install or the tools could look.
    for tool in ("cargo", "rustc"):
        assert shutil.which(tool, path=v.env["PATH"]) is None, f"{tool} still reachable"
    base = getattr(sys, "_base_executable", sys.executable)
    run([base, "-m", "venv", str(v.root)], env=v.env)
    started = time.monotonic()
    run([str(v.python), "-m", "pip", "install", "-q", str(wheel)], env=v.env, timeout=INSTALL_TIMEOUT_S)
    print(f"\npip install of the wheel into a fresh venv: {time.monotonic() - started:.1f} s")
    return v


def test_fresh_venv_sees_nothing_of_the_build(venv: Venv) -> None:
    # The venv's python is isolated: no h5py or maturin from the dev .venv.
    res = run(
        [str(venv.python), "-c", "import importlib.util as u, json; print(json.dumps([u.find_spec(m) is not None for m in ('h5py', 'maturin')]))"],
        env=venv.env,
    )
    assert json.loads(res.stdout) == [False, False]
    assert "LD_LIBRARY_PATH" not in venv.env
    assert shutil.which("cargo", path=venv.env["PATH"]) is None


def test_bundled_daemon_resolves_its_libraries_from_the_wheel(venv: Venv) -> None:
    pkg = venv.site_stoker()
    binary = pkg / "bin" / "stoker"
    libs = pkg / ".libs"
    assert binary.is_file() and os.access(binary, os.X_OK)
    res = run([str(venv.python), "-c", "import stoker; print(stoker.daemon_binary())"], env=venv.env)
    assert Path(res.stdout.strip()) == binary

    ldd = run(["ldd", str(binary)], env=venv.env).stdout
    assert "not found" not in ldd, ldd
    from_wheel = []
    for line in ldd.splitlines():
        m = re.match(r"\s*(\S+)\s+=>\s+(\S+)", line)
        if not m:
            continue
        name, path = m.groups()
        if BASE_LIBS.match(name):
            continue
        assert Path(os.path.realpath(path)).parent == libs.resolve(), f"{name} resolves to {path}, not from the wheel's {libs}:\n{ldd}"
        from_wheel.append(name)
    assert any(n.startswith("libhdf5") for n in from_wheel), ldd
    # Each bundled library finds its own needs too.
    for lib in libs.iterdir():
        out = run(["ldd", str(lib)], env=venv.env).stdout
        assert "not found" not in out, f"{lib.name}:\n{out}"


def test_console_entry_point_runs_the_daemon(venv: Venv) -> None:
    assert shutil.which("stoker", path=venv.env["PATH"]) == str(venv.bin / "stoker")
    version = run([str(venv.python), "-c", "import stoker; print(stoker.__version__)"], env=venv.env).stdout.strip()
    res = run(["stoker", "--version"], env=venv.env)
    assert res.stdout.split() == ["stoker", version], res.stdout


@pytest.fixture
def served(venv: Venv, tmp_path: Path, short_tmp: Path) -> Iterator[tuple[object, str]]:
    """An HDF5 dataset written by h5py (this process), served by `stoker serve`
    started through the venv's console entry point."""
    data = write_h5(tmp_path / "data")
    config = make_config(str(short_tmp / "unused.sock"), allowed_roots=[tmp_path], datasets={"train": data})
    daemon = Daemon(short_tmp, config, command=["stoker"], env=venv.env)
    try:
        # The entry point exec'd the bundled binary: same process, no Python wrapper left.
        assert os.readlink(f"/proc/{daemon.proc.pid}/exe") == str(venv.site_stoker() / "bin" / "stoker")
        yield data, daemon.socket
    finally:
        daemon.stop()


def test_loader_from_the_wheel_reads_hdf5_byte_for_byte(venv: Venv, served: tuple, tmp_path: Path) -> None:
    data, sock = served
    dump = tmp_path / "batches"
    script = textwrap.dedent(
        f"""
        import os, sys, numpy as np, stoker
        assert "site-packages" in stoker.__file__, stoker.__file__
        loader = stoker.Loader("train", batch_size=16, shuffle=True, seed=3, socket={sock!r}, timeout=60)
        n = 0
        for i, batch in enumerate(loader):
            for name, arr in batch.items():
                np.save(os.path.join({str(dump)!r}, f"{{i:04d}}-{{name}}.npy"), arr)
            n += 1
        print(n)
        """
    )
    dump.mkdir()
    res = run([str(venv.python), "-c", script], env=venv.env, cwd=str(tmp_path))
    n_batches = int(res.stdout.strip())
    assert n_batches == -(-data.n // 16)
    seen: list[int] = []
    for i in range(n_batches):
        batch = {name: np.load(dump / f"{i:04d}-{name}.npy") for name in data.fields}
        seen += data.check_batch(batch)
    assert sorted(seen) == list(range(data.n))


def other_pythons() -> list[Path]:
    """CPython interpreters of other versions than this one (pyenv's, the
    system's), the oldest and the newest from 3.9 on."""
    found: dict[tuple[int, int], Path] = {}
    candidates = list(Path.home().glob(".pyenv/versions/3.*/bin/python3")) + list(Path("/usr/bin").glob("python3.*"))
    for exe in candidates:
        m = re.search(r"3\.(\d+)", str(exe.parent.parent.name if ".pyenv" in str(exe) else exe.name))
        if not m or not os.access(exe, os.X_OK):
            continue
        version = (3, int(m.group(1)))
        if version >= (3, 9) and version != sys.version_info[:2]:
            found.setdefault(version, exe)
    if not found:
        return []
    versions = sorted(found)
    return [found[v] for v in sorted({versions[0], versions[-1]})]


@pytest.mark.parametrize("python", other_pythons(), ids=lambda p: p.name if "pyenv" not in str(p) else p.parent.parent.name)
def test_the_abi3_wheel_serves_other_pythons(wheel: Path, served: tuple, python: Path, tmp_path: Path) -> None:
    """The same wheel installs and reads byte for byte under the oldest and
    the newest other CPython on this machine (3.9 and 3.13 here)."""
    data, sock = served
    v = Venv(tmp_path / "env")
    run([str(python), "-m", "venv", str(v.root)], env=v.env)
    started = time.monotonic()
    run([str(v.python), "-m", "pip", "install", "-q", str(wheel)], env=v.env, timeout=INSTALL_TIMEOUT_S)
    print(f"\npip install of the wheel under {python}: {time.monotonic() - started:.1f} s")
    dump = tmp_path / "batches"
    dump.mkdir()
    script = textwrap.dedent(
        f"""
        import os, sys, numpy as np, stoker
        assert "site-packages" in stoker.__file__, stoker.__file__
        loader = stoker.Loader("train", batch_size=16, shuffle=False, socket={sock!r}, timeout=60)
        for i, batch in enumerate(loader):
            for name, arr in batch.items():
                np.save(os.path.join({str(dump)!r}, f"{{i:04d}}-{{name}}.npy"), arr)
        print(i + 1, sys.version_info[:2])
        """
    )
    res = run([str(v.python), "-c", script], env=v.env, cwd=str(tmp_path))
    n_batches = int(res.stdout.split()[0])
    seen: list[int] = []
    for i in range(n_batches):
        batch = {name: np.load(dump / f"{i:04d}-{name}.npy") for name in data.fields}
        seen += data.check_batch(batch)
    assert sorted(seen) == list(range(data.n))
