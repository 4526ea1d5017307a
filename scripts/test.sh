#!/usr/bin/env bash
# Runs every test: Rust unit and end-to-end tests (the real `stoker` binary on
# HDF5 files written by h5py) and the Python suite (real daemons, real
# processes, real shared memory). Installs what it needs first.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh

echo "==> cargo test"
STOKER_PYTHON="$PWD/.venv/bin/python" STOKER_REQUIRE_PYTHON=1 cargo test --release --locked --workspace --exclude stoker-py

echo "==> cargo test -p stoker-client --features cuda (builds without CUDA; GPU work needs a GPU)"
cargo clippy --release --locked -p stoker-client --features cuda --all-targets -- -D warnings
cargo test --release --locked -p stoker-client --features cuda --lib cuda

echo "==> pytest"
set +e
STOKER_BIN="$PWD/target/release/stoker" .venv/bin/python -m pytest -q --durations=25 client-py/tests "$@"
rc=$?
set -e
# pytest exits 5 when it collected no tests: that is a broken suite, not a pass.
if [ $rc -eq 5 ]; then
  echo "pytest collected no tests" >&2
fi
exit $rc
