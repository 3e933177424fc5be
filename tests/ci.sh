#!/usr/bin/env bash
# The whole test suite, as CI runs it (README: "set up and run the test suite").
#   1. set up: Debian's chromium for the docs site's browser test (as root; where it cannot be installed,
#      tests/docs/test_docs_site.py skips its browser checks with a message), then .venv (CPU build of torch,
#      the package editable, the test extras, the docs requirements).  Beside pip (which keeps one core
#      busy) a chain of kernel jobs starts at the lowest priority and runs through the whole script, taking
#      only the CPU the rest leaves idle: the native libraries of the default run (tests/native/build_kernels.py,
#      into the kernel cache; the default run waits for them), then the x86-64-v3 and v2 libraries the slow
#      tests rebuild the engine for (skipped where the CPU cannot run them) (a slow test that needs one first waits for it, or compiles it), then the
#      AArch64 check of step 4
#   2. the default run: everything but the slow tests (two pytest-xdist workers, one torch thread
#      each: most tests are small, so two workers keep both cores busy where one test would not)
#   3. the slow tests: large sizes, and the engine suites rebuilt for x86-64-v3 and x86-64-v2
#   4. AArch64: the kernels cross-compiled and checked under qemu-user (skipped, with a message, where the
#      Debian packages cannot be installed); its output is shown at the end, and its failure fails the run
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v chromium >/dev/null 2>&1; then  # before run_arm64.sh below: one apt-get at a time
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "== installing chromium (apt-get) for tests/docs/test_docs_site.py"
    t0=$(date +%s)
    { DEBIAN_FRONTEND=noninteractive apt-get update -q && \
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium; } \
      >/tmp/flashot-ci-chromium.log 2>&1 \
      && echo "   chromium installed in $(( $(date +%s) - t0 )) s" \
      || echo "   chromium could not be installed ($(tail -n 1 /tmp/flashot-ci-chromium.log)): the docs browser test will skip"
  else
    echo "== chromium missing and not root: the docs browser test will skip"
  fi
fi
start=$(date +%s)
echo "== set-up: .venv (pip); the kernel jobs start beside it at the lowest priority (nice 19)"
logs=$(mktemp -d)
# (a failed native build is the default run's to report: its first-use compile tries again and says why)
# (monitor mode gives them their own process group, to stop them as one; not setsid: a new session is
# a new scheduler autogroup where the kernel enables those, and an autogroup gets its own share of the
# CPU whatever its processes' nice values)
set -m
bash -c '
  nice -n 19 python3 tests/native/build_kernels.py >"$1/native" 2>&1 || true
  touch "$1/native.done"
  nice -n 19 python3 tests/native/build_kernels.py x86-64-v3 x86-64-v2 >"$1/levels" 2>&1 || true
  rc=0
  nice -n 19 bash tests/native/run_arm64.sh >"$1/arm64" 2>&1 || rc=$?
  echo "$rc" >"$1/arm64.rc"' kernel-jobs "$logs" &
kernels_pid=$!
set +m
# a failed step stops the kernel jobs, compilers included (their own process group)
trap 'kill -- -"$kernels_pid" 2>/dev/null || kill "$kernels_pid" 2>/dev/null; rm -rf "$logs"' EXIT
python3 -m venv .venv
.venv/bin/pip install -q torch==2.13.0 -e ".[test]" -r docs/requirements.txt
echo "   pip done after $(( $(date +%s) - start )) s"
while [ ! -e "$logs/native.done" ] && kill -0 "$kernels_pid" 2>/dev/null; do sleep 1; done
[ ! -s "$logs/native" ] || sed 's/^/   /' "$logs/native"
echo "== default run: pytest -q -n 2 (after $(( $(date +%s) - start )) s; two pytest-xdist workers; the 20 slowest tests listed at the end)"
.venv/bin/python -m pytest -q -n 2 --durations=20
echo "== slow tests: pytest -q -m slow (after $(( $(date +%s) - start )) s)"
# (the pytest cross-build of the AArch64 driver is left out: the kernel jobs run the full AArch64 check)
.venv/bin/python -m pytest -q -n 2 -m slow --durations=10 \
  --deselect tests/ops/test_native_driver.py::test_kernel_driver_aarch64_cross
wait "$kernels_pid" || true
trap - EXIT
[ ! -s "$logs/levels" ] || sed 's/^/   /' "$logs/levels"
arm_rc=$(cat "$logs/arm64.rc" 2>/dev/null || echo 1)
echo "== AArch64 kernels under qemu-user (compiled and run beside the steps above)"
cat "$logs/arm64"
rm -rf "$logs"
echo "== done after $(( $(date +%s) - start )) s"
[ "$arm_rc" -eq 0 ] || { echo "== FAILED: the AArch64 check (exit status $arm_rc, its output above)"; exit "$arm_rc"; }
