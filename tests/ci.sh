#!/usr/bin/env bash
# The whole test suite, as CI runs it (README: "set up and run the test suite").
#   1. set up: Debian's chromium for the docs site's browser test (as root; where it cannot be installed,
#      tests/docs/test_docs_site.py skips its browser checks with a message), then .venv (CPU build of torch,
#      the package editable, the test extras, the docs requirements).  While pip installs (it keeps one core
#      busy), the kernels compile on the other: the native libraries of the default run
#      (tests/native/build_kernels.py, into the kernel cache; cached ones are reused), then the AArch64
#      cross-compile of step 2
#   2. AArch64: the kernels cross-compiled and checked under qemu-user (skipped, with a message,
#      where the Debian packages cannot be installed); its output is shown once pip is done
#   3. the default run: everything but the slow tests (two pytest-xdist workers, one torch thread
#      each: most tests are small, so two workers keep both cores busy where one test would not)
#   4. the slow tests: large sizes, and the engine suites rebuilt for x86-64-v3 and x86-64-v2
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
echo "== set-up: .venv (pip), with the native kernels and the AArch64 cross-compile compiling beside it"
logs=$(mktemp -d)
# one job after the other, niced: pip keeps its core, the compilers take the rest (one per core each)
# (a failed native build is the default run's to report: its first-use compile tries again and says why)
{ nice -n 10 python3 tests/native/build_kernels.py >"$logs/native" 2>&1 || true
  rc=0
  nice -n 10 bash tests/native/run_arm64.sh >"$logs/arm64" 2>&1 || rc=$?
  echo "$rc" >"$logs/arm64.rc"; } &
kernels_pid=$!
trap 'kill "$kernels_pid" 2>/dev/null; rm -rf "$logs"' EXIT  # a failed pip install stops them
python3 -m venv .venv
.venv/bin/pip install -q torch==2.13.0 -e ".[test]" -r docs/requirements.txt
echo "   pip done after $(( $(date +%s) - start )) s"
wait "$kernels_pid"
trap - EXIT
sed 's/^/   /' "$logs/native"
arm_rc=$(cat "$logs/arm64.rc" 2>/dev/null || echo 1)
echo "== AArch64 kernels under qemu-user (after $(( $(date +%s) - start )) s)"
cat "$logs/arm64"
rm -rf "$logs"
[ "$arm_rc" -eq 0 ] || echo "== the AArch64 check FAILED (exit status $arm_rc): the run goes on, and fails at the end"
echo "== default run: pytest -q -n 2 (after $(( $(date +%s) - start )) s; two pytest-xdist workers; the 20 slowest tests listed at the end)"
.venv/bin/python -m pytest -q -n 2 --durations=20
echo "== slow tests: pytest -q -m slow (after $(( $(date +%s) - start )) s)"
# (the pytest cross-build of the AArch64 driver is left out: step 2 ran the full ARM64 check)
.venv/bin/python -m pytest -q -n 2 -m slow --durations=10 \
  --deselect tests/ops/test_native_driver.py::test_kernel_driver_aarch64_cross
echo "== done after $(( $(date +%s) - start )) s"
[ "$arm_rc" -eq 0 ] || { echo "== FAILED: the AArch64 check (exit status $arm_rc, its output above)"; exit "$arm_rc"; }
