#!/usr/bin/env bash
# Installs everything stoker needs on a fresh Debian machine and builds it:
# libhdf5-dev, libjpeg62-turbo-dev and systemd (apt; `systemd-analyze verify` checks the unit in
# config/systemd/), a virtualenv at .venv with maturin/numpy/h5py/pytest,
# (and torch, for the torch-output tests), the release `stoker` binary, and the Python client (`stoker` package).
# Idempotent: quick when everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
dpkg -s libhdf5-dev >/dev/null 2>&1 || need_apt+=(libhdf5-dev)
dpkg -s pkg-config >/dev/null 2>&1 || need_apt+=(pkg-config)
# libjpeg-turbo, the JPEG decoder (crates/decode/csrc/jpeg_turbo.c uses its libjpeg API).
dpkg -s libjpeg62-turbo-dev >/dev/null 2>&1 || need_apt+=(libjpeg62-turbo-dev)
# systemd-analyze/-sysusers/-tmpfiles for the deploy tests (client-py/tests/test_deploy.py).
command -v systemd-analyze >/dev/null 2>&1 || need_apt+=(systemd)
# Debian's own python3 needs python3-venv for `python3 -m venv` (pyenv/conda builds have it).
python3 -c "import ensurepip, venv" >/dev/null 2>&1 || need_apt+=(python3-venv)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "==> apt-get install ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# promtool checks the shipped Prometheus alerting rules (client-py/tests/test_metrics.py);
# Debian ships it in the prometheus package (the server is installed, not started).
if ! command -v promtool >/dev/null 2>&1; then
  echo "==> apt-get install prometheus (for promtool)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  if ! DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null; then
    echo "warning: could not install prometheus (promtool); the rules check will be skipped" >&2
  fi
fi

if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv"
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -r scripts/requirements.txt

echo "==> cargo build --release (stoker binary)"
cargo build --release --locked -p stoker-daemon

echo "==> building the Python client into .venv"
VIRTUAL_ENV="$PWD/.venv" .venv/bin/maturin develop --release --locked -q -m client-py/Cargo.toml
