"""The ``stoker`` console command of the wheel: runs the bundled daemon binary.

``pip install stoker-*.whl`` puts a ``stoker`` script on PATH that calls
:func:`main`, which replaces the Python process with the ``stoker`` binary
shipped inside the package (``stoker/bin/stoker``, its shared libraries in
``stoker/.libs``). ``os.execv`` keeps the process id, so systemd's
``Type=notify``, signals and Slurm see the daemon itself, not a wrapper.

This module imports nothing but the standard library so that it stays cheap.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

#: Environment variable naming a daemon binary to use when the package has
#: none bundled (a source checkout installed with ``maturin develop``).
BIN_ENV = "STOKER_BIN"


def bundled_binary() -> Path:
    """Where the wheel puts the daemon binary (it may not exist in a source install)."""
    return Path(__file__).resolve().parent / "bin" / "stoker"


def daemon_binary() -> Path:
    """The ``stoker`` daemon binary the client tools run.

    The one bundled in the wheel; in a source install, which bundles none,
    ``$STOKER_BIN``.  Raises :class:`FileNotFoundError` saying what to do if
    there is neither.
    """
    bundled = bundled_binary()
    if bundled.is_file():
        return bundled
    env = os.environ.get(BIN_ENV)
    if env:
        path = Path(env)
        if path.is_file():
            return path
        raise FileNotFoundError(f"${BIN_ENV} is {env}, which is not a file: point it at a built `stoker` binary")
    raise FileNotFoundError(
        f"this stoker package bundles no daemon binary (no {bundled}): it was installed from source. "
        f"Install the wheel built by scripts/build-wheel.sh, or build the daemon with "
        f"`cargo build --release -p stoker-daemon` and set ${BIN_ENV}=<repo>/target/release/stoker"
    )


def main() -> None:
    try:
        binary = daemon_binary()
    except FileNotFoundError as e:
        sys.stderr.write(f"stoker: {e}\n")
        sys.exit(127)
    if not os.access(binary, os.X_OK):
        sys.stderr.write(f"stoker: {binary} is not executable: reinstall the stoker wheel, or `chmod +x` it\n")
        sys.exit(126)
    try:
        os.execv(binary, [sys.argv[0], *sys.argv[1:]])
    except OSError as e:
        sys.stderr.write(f"stoker: cannot run {binary}: {e}\n")
        sys.exit(126)


if __name__ == "__main__":
    main()
