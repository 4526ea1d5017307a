#!/usr/bin/env bash
# The main job: generates a small HDF5 dataset, starts the stoker daemon on it,
# runs a training-style loop over two epochs printing throughput, prints
# `stoker status`, and stops the daemon. Installs what it needs first.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
STOKER_BIN="$PWD/target/release/stoker" .venv/bin/python examples/train_loop.py "$@"
