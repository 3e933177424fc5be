#!/usr/bin/env bash
# ARM64 check of the CPU kernels: cross-compile src/flashot/ops/cpu/*.cpp for aarch64


# under qemu-user with a team of two threads.
#
# Needs Debian's g++-aarch64-linux-gnu and qemu-user; installs them (apt-get update first) when
# they are missing and this runs as root.  Where they cannot be had (not root, no apt-get, no
# network, an apt failure) it prints one line "SKIPPED: ..." naming what is missing and exits 0.
# Otherwise it exits with the driver's status (0: every check passed).
#
# The cross-compiled driver is cached in ~/.cache/flashot/arm64-<key> (FLASHOT_CACHE_DIR when set), the key
# a hash of the kernel sources, the driver, the flags and the cross compiler's version: the cross-compile
# runs once per change of any of them, and a run with the same key only runs the checks under qemu.
#
# Environment: FLASHOT_ARM64_KEEP=DIR keeps the build in DIR (default: a temporary directory,
# removed at exit); FLASHOT_ARM64_TIMEOUT (seconds, default 600) bounds the emulated run;
# FLASHOT_ARM64_FRESH=1 compiles even when the cache holds the build.
set -uo pipefail

cd "$(dirname "$0")/../.." || exit 2
SRC=src/flashot/ops/cpu
DRIVER=tests/native/kernel_check.cpp
CXX=aarch64-linux-gnu-g++
SYSROOT=/usr/aarch64-linux-gnu
# the flags of build.py cxxflags("armv8-a") (BASE_FLAGS, -march, the ABI version: abi.py abi_version, the first
# 28 bits of abi.h's SHA-256)
ABI_VERSION=$((16#$(sha256sum "$SRC/abi.h" | cut -c1-7)))
FLAGS=(-O3 -fPIC -std=c++17 -fno-math-errno -pthread -march=armv8-a "-DFLASHOT_ABI_VERSION=$ABI_VERSION")
# build.py UNIT_FLAGS: the ABI units (no kernel in them) at -O1
O1_UNITS="core_abi bs_abi"

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
skip() { echo "SKIPPED: arm64 kernel check: $*"; exit 0; }
find_qemu() { command -v qemu-aarch64 || command -v qemu-aarch64-static || true; }

# ---- 1. toolchain and emulator ------------------------------------------------------------
missing=()
command -v "$CXX" >/dev/null 2>&1 || missing+=(g++-aarch64-linux-gnu)
[ -n "$(find_qemu)" ] || missing+=(qemu-user)
if [ ${#missing[@]} -gt 0 ]; then
  what="${missing[*]} not installed"
  [ "$(id -u)" = 0 ] || skip "$what, and not root (cannot apt-get install them)"
  command -v apt-get >/dev/null 2>&1 || skip "$what, and no apt-get on this machine"
  t0=$(now)
  log=$(mktemp)
  echo "arm64: installing ${missing[*]} (apt-get) ..."
  if ! DEBIAN_FRONTEND=noninteractive apt-get update -q >"$log" 2>&1; then
    skip "$what; apt-get update failed (no network?): $(tail -n 1 "$log")"
  fi
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >>"$log" 2>&1; then
    skip "$what; apt-get install failed: $(tail -n 1 "$log")"
  fi
  rm -f "$log"
  command -v "$CXX" >/dev/null 2>&1 || skip "$CXX still missing after installing g++-aarch64-linux-gnu"
  [ -n "$(find_qemu)" ] || skip "qemu-aarch64 still missing after installing qemu-user"
  echo "arm64: installed in $(since "$t0") s"
fi
QEMU=$(find_qemu)
echo "arm64: $("$CXX" --version | head -n 1); $("$QEMU" --version | head -n 1)"

# ---- the checks under qemu (a function: a cached driver runs the same way) -------------------
run_checks() {
  local t0 rc
  t0=$(now)
  OMP_NUM_THREADS=2 timeout "${FLASHOT_ARM64_TIMEOUT:-600}" "$QEMU" "${QEMU_ARGS[@]}" "$1"
  rc=$?
  echo "arm64: qemu run took $(since "$t0") s (exit status $rc)"
  [ $rc -eq 124 ] && echo "arm64: the emulated run timed out"
  exit $rc
}

# ---- 2. cross-compile ---------------------------------------------------------------------
if [ -n "${FLASHOT_ARM64_KEEP:-}" ]; then
  WORK=$FLASHOT_ARM64_KEEP
  mkdir -p "$WORK" || exit 2
else
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/flashot-arm64.XXXXXX") || exit 2
  trap 'rm -rf "$WORK"' EXIT
fi

KEY=$( { cat "$SRC"/*.h "$SRC"/*.cpp "$DRIVER"; echo "${FLAGS[*]} / -O1: $O1_UNITS"; "$CXX" --version; } | sha256sum | cut -c1-16)
CACHE="${FLASHOT_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/flashot}/arm64-$KEY"
if [ -z "${FLASHOT_ARM64_FRESH:-}" ] && [ -x "$CACHE/kernel_check" ]; then
  QEMU_ARGS=()
  [ -f "$CACHE/dynamic" ] && QEMU_ARGS=(-L "$SYSROOT")
  echo "arm64: the cross-compiled driver of these sources is cached: $CACHE"
  run_checks "$CACHE/kernel_check"
fi

t0=$(now)
# the real build's translation units (build.py: LIBRARIES, core_*.cpp and bs_*.cpp) and the driver, one compiler
# per core (as build.py), the largest units (the pair steps, the streamed softmin) first: started all at once,
# a dozen compilers on two cores would share the caches and the memory for no gain
PARTS=()
for f in "$SRC"/bs_pair_*.cpp "$SRC"/core_lse_*.cpp "$SRC"/core_*.cpp "$SRC"/bs_*.cpp; do
  k=$(basename "$f" .cpp)
  [[ " ${PARTS[*]} " == *" $k "* ]] || PARTS+=("$k")
done
compile_one() {  # unit name, or "driver"; its exit status into $WORK/<name>.rc
  local k=$1 extra=()
  if [ "$k" = driver ]; then
    "$CXX" "${FLAGS[@]}" -Wall -Wextra -I "$SRC" -c "$DRIVER" -o "$WORK/kernel_check.o" 2>"$WORK/driver.err"
  else
    [[ " $O1_UNITS " == *" $k "* ]] && extra=(-O1)
    "$CXX" "${FLAGS[@]}" "${extra[@]}" -c "$SRC/$k.cpp" -o "$WORK/$k.o" 2>"$WORK/$k.err"
  fi
  echo $? >"$WORK/$k.rc"
}
JOBS=$(nproc 2>/dev/null || echo 2)
running=0
for k in "${PARTS[@]}" driver; do
  if [ "$running" -ge "$JOBS" ]; then
    wait -n
    running=$((running - 1))
  fi
  compile_one "$k" &
  running=$((running + 1))
done
wait
failed=0
for k in "${PARTS[@]}"; do
  if [ "$(cat "$WORK/$k.rc" 2>/dev/null)" != 0 ]; then
    echo "arm64: FAILED to compile $SRC/$k.cpp:"
    tail -n 30 "$WORK/$k.err"
    failed=1
  fi
done
if [ "$(cat "$WORK/driver.rc" 2>/dev/null)" != 0 ]; then
  echo "arm64: FAILED to compile $DRIVER:"; tail -n 30 "$WORK/driver.err"; failed=1
fi
[ $failed -eq 0 ] || exit 1
cat "$WORK"/core_*.err "$WORK"/bs_*.err "$WORK/driver.err"  # warnings, if any

# the four shared libraries as build.py links them (LIBRARIES: per family and dtype, the dtype's kernel units
# and the family's dtype-free ones), with -z defs so that a unit missing from a library fails here
link_failed=0
for t in f32 f64; do
  "$CXX" -shared -fPIC -pthread -Wl,-z,defs -o "$WORK/libflashot_cpu_$t.so" "$WORK"/core_*_"$t".o \
    "$WORK/core_vexp.o" "$WORK/core_abi.o" 2>>"$WORK/link.err" || link_failed=1
  "$CXX" -shared -fPIC -pthread -Wl,-z,defs -o "$WORK/libflashot_cpu_bs_$t.so" "$WORK"/bs_*_"$t".o \
    "$WORK/bs_prune.o" "$WORK/bs_abi.o" 2>>"$WORK/link.err" || link_failed=1
done
if [ $link_failed -ne 0 ]; then
  echo "arm64: FAILED to link the shared libraries:"; cat "$WORK/link.err"; exit 1
fi
# the driver: static when the cross toolchain has static libgomp / libc, else dynamic with the sysroot
QEMU_ARGS=()
if ! "$CXX" -static -pthread -o "$WORK/kernel_check" "$WORK/kernel_check.o" "$WORK"/core_*.o "$WORK"/bs_*.o 2>"$WORK/link.err"; then
  if ! "$CXX" -pthread -o "$WORK/kernel_check" "$WORK/kernel_check.o" "$WORK"/core_*.o "$WORK"/bs_*.o \
      2>"$WORK/link.err"; then
    echo "arm64: FAILED to link the driver:"; cat "$WORK/link.err"; exit 1
  fi
  QEMU_ARGS=(-L "$SYSROOT")
  echo "arm64: driver linked dynamically (no static libraries); running with -L $SYSROOT"
fi
echo "arm64: cross-compiled (${#PARTS[@]} units + driver, -march=armv8-a, threads) in $(since "$t0") s"

# keep the driver for later runs (written beside, then renamed: a concurrent run never sees half of it)
mkdir -p "$(dirname "$CACHE")" && tmp=$(mktemp -d "$CACHE.XXXXXX") &&
  cp "$WORK/kernel_check" "$tmp/" && { [ ${#QEMU_ARGS[@]} -eq 0 ] || touch "$tmp/dynamic"; } &&
  { mv -T "$tmp" "$CACHE" 2>/dev/null || rm -rf "$tmp"; }
run_checks "$WORK/kernel_check"
