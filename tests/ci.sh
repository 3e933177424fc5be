#!/usr/bin/env bash
# The whole test suite, as CI runs it (README: "set up and run the test suite").
#   1. set up .venv (CPU build of torch, the package editable, the test extras, the docs
#      requirements) and Debian's chromium for the docs site's browser test (as root; where it
#      cannot be installed, tests/docs/test_docs_site.py skips its browser checks with a message)
#   2. the default run: everything but the slow tests (two pytest-xdist workers, one torch thread
#      each: most tests are small, so two workers keep both cores busy where one test would not)
#   3. AArch64: the kernels cross-compiled and checked under qemu-user (skipped, with a message,
#      where the Debian packages cannot be installed)
#   4. the slow tests: large sizes, and the engine suites rebuilt for x86-64-v3 and x86-64-v2
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q torch==2.13.0 -e ".[test]" -r docs/requirements.txt
if ! command -v chromium >/dev/null 2>&1; then
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
echo "== default run (pytest -q -n 2: two pytest-xdist workers; the 20 slowest tests listed at the end)"
.venv/bin/python -m pytest -q -n 2 --durations=20
echo "== AArch64 kernels under qemu-user (after $(( $(date +%s) - start )) s)"
bash tests/native/run_arm64.sh
echo "== slow tests: pytest -q -m slow (after $(( $(date +%s) - start )) s)"
# (the pytest cross-build of the AArch64 driver is left out: the step above ran the full ARM64 check)
.venv/bin/python -m pytest -q -n 2 -m slow --durations=10 \
  --deselect tests/ops/test_native_driver.py::test_kernel_driver_aarch64_cross
