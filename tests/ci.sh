#!/usr/bin/env bash
# The whole test suite, as CI runs it (README: "set up and run the test suite").
#   1. set up, three jobs side by side:
#      - as root, Debian's packages the tests use (one apt-get in the background: chromium for the docs site's
#        browser test, g++-aarch64-linux-gnu and qemu-user for the AArch64 check); where they cannot be
#        installed, those tests skip with a message
#      - .venv: the CPU build of torch, the package editable, the test extras and the docs requirements, with
#        uv (installed by pip; it fetches and unpacks in parallel, several times faster than pip here) given
#        pip's own index settings, so it takes the packages pip would; pip itself where uv cannot be had or fails
#      - at the lowest priority, a chain of kernel jobs that runs through the whole script: the native
#        libraries of the default run (tests/native/build_kernels.py, into the kernel cache; the default run
#        waits for them), the x86-64-v2 and v3 libraries the slow tests rebuild the engine for (v2 first: its
#        engine suite is the longest slow test; skipped where the CPU cannot run them; a slow test that needs
#        one first waits for it, or compiles it), then the
#        AArch64 check of step 4.  The chain returns to normal priority when the slow tests start: all
#        that is left then is needed before the end
#   2. the default run: everything but the slow tests (two pytest-xdist workers, one torch thread
#      each: most tests are small, so two workers keep both cores busy where one test would not)
#   3. the slow tests: large sizes, and the engine suites rebuilt for x86-64-v3 and x86-64-v2 (v3's skipped where
#      the native build compiles the same kernel paths: AVX2 without AVX-512)
#   4. AArch64: the kernels cross-compiled and checked under qemu-user (skipped, with a message, where the
#      Debian packages cannot be installed); its output is shown at the end, and its failure fails the run
set -euo pipefail
cd "$(dirname "$0")/.."
# Python's default: bytecode cached at first import.  Where PYTHONDONTWRITEBYTECODE is set, every process
# of the run (pytest's workers, the subprocess tests, the distributed ranks) would compile torch's sources
# anew: several seconds of CPU each.
unset PYTHONDONTWRITEBYTECODE
start=$(date +%s)
logs=$(mktemp -d)
since() { echo "$(( $(date +%s) - start )) s"; }

# ---- 1a. Debian's packages (background; the default run and the AArch64 check wait for it) ----------------
apt_pkgs=()
command -v chromium >/dev/null 2>&1 || apt_pkgs+=(chromium)
command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 || apt_pkgs+=(g++-aarch64-linux-gnu)
{ command -v qemu-aarch64 || command -v qemu-aarch64-static; } >/dev/null 2>&1 || apt_pkgs+=(qemu-user)
apt_job() {  # one apt-get for all; where that fails (one package unknown here), each on its own
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q || return 0
  apt-get install -y -q --no-install-recommends "${apt_pkgs[@]}" && return 0
  for p in "${apt_pkgs[@]}"; do apt-get install -y -q --no-install-recommends "$p" || true; done
}
if [ ${#apt_pkgs[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "== set-up: apt-get install ${apt_pkgs[*]} (in the background)"
  ( apt_job >"$logs/apt" 2>&1
    echo "   apt-get (${apt_pkgs[*]}) done after $(since); its log's last line: $(tail -n 1 "$logs/apt")" >"$logs/apt.msg"
    touch "$logs/apt.done" ) &
else
  [ ${#apt_pkgs[@]} -eq 0 ] || echo "== ${apt_pkgs[*]} missing, and not root or no apt-get: the tests that need them skip"
  touch "$logs/apt.done"
fi
wait_apt() { while [ ! -e "$logs/apt.done" ]; do sleep 1; done; }

# ---- 1b. the kernel jobs, at nice 19 until the slow tests start ---------------------------------------------
echo "== set-up: .venv (uv); the kernel jobs start beside it at the lowest priority (nice 19)"
# (a failed native build is the default run's to report: its first-use compile tries again and says why)
# (monitor mode gives them their own process group, to stop them as one, and to renice them as one; not
# setsid: a new session is a new scheduler autogroup where the kernel enables those, and an autogroup gets
# its own share of the CPU whatever its processes' nice values)
set -m
nice -n 19 bash -c '
  python3 tests/native/build_kernels.py >"$1/native" 2>&1 || true
  touch "$1/native.done"
  python3 tests/native/build_kernels.py x86-64-v2 x86-64-v3 >"$1/levels" 2>&1 || true
  while [ ! -e "$1/apt.done" ]; do sleep 1; done  # run_arm64.sh would install what is missing: one apt-get at a time
  rc=0
  bash tests/native/run_arm64.sh >"$1/arm64" 2>&1 || rc=$?
  echo "$rc" >"$1/arm64.rc"' kernel-jobs "$logs" &
kernels_pid=$!
set +m
# a failed step stops the kernel jobs, compilers included (their own process group)
trap 'kill -- -"$kernels_pid" 2>/dev/null || kill "$kernels_pid" 2>/dev/null; rm -rf "$logs"' EXIT

# ---- 1c. the environment -----------------------------------------------------------------------------------
python3 -m venv .venv
pip_cfg() {  # pip's setting $1 as pip applies it (its environment variable over its configuration files)
  .venv/bin/pip config list 2>/dev/null | sed -n "s/^\(:env:\|global\|install\)\.$1='\(.*\)'\$/\2/p" | head -n 1
}
reqs=(torch==2.13.0 -e ".[test]" -r docs/requirements.txt)
installed=
if .venv/bin/pip install -q uv >"$logs/uv" 2>&1; then
  # pip's rule: the best version of any index.  (Unlike pip, uv compiles no bytecode at install: Python
  # writes it at first import instead, for the modules the run imports; see PYTHONDONTWRITEBYTECODE above)
  uv_args=(--python .venv/bin/python --index-strategy unsafe-best-match)
  v=$(pip_cfg index-url); [ -z "$v" ] || uv_args+=(--index-url "$v")
  for v in $(pip_cfg extra-index-url); do uv_args+=(--extra-index-url "$v"); done
  for v in $(pip_cfg find-links); do uv_args+=(--find-links "$v"); done
  v=$(pip_cfg constraint); [ -z "$v" ] || uv_args+=(--constraint "$v")
  cert=$(pip_cfg cert) uv_env=()
  [ -z "$cert" ] || uv_env=(SSL_CERT_FILE="$cert")  # pip's certificate bundle, where it has one
  if env "${uv_env[@]}" .venv/bin/uv pip install -q "${uv_args[@]}" "${reqs[@]}" >>"$logs/uv" 2>&1; then
    installed=uv
  else
    echo "   uv failed ($(tail -n 1 "$logs/uv")): pip installs instead"
  fi
else
  echo "   uv could not be installed ($(tail -n 1 "$logs/uv")): pip installs instead"
fi
[ -n "$installed" ] || { .venv/bin/pip install -q "${reqs[@]}"; installed=pip; }
echo "   $installed done after $(since)"
while [ ! -e "$logs/native.done" ] && kill -0 "$kernels_pid" 2>/dev/null; do sleep 1; done
[ ! -s "$logs/native" ] || sed 's/^/   /' "$logs/native"
wait_apt
[ ! -s "$logs/apt.msg" ] || cat "$logs/apt.msg"

# ---- 2. the default run ----------------------------------------------------------------------------------------
echo "== default run: pytest -q -n 2 (after $(since); two pytest-xdist workers; the 20 slowest tests listed at the end)"
.venv/bin/python -m pytest -q -n 2 --durations=20

# ---- 3. the slow tests -----------------------------------------------------------------------------------------
# the kernel jobs back to normal priority (where allowed: lowering a nice value needs root); their processes
# started from now on inherit it
renice -n 0 -g "$kernels_pid" >/dev/null 2>&1 || true
echo "== slow tests: pytest -q -m slow (after $(since))"
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
echo "== done after $(since)"
[ "$arm_rc" -eq 0 ] || { echo "== FAILED: the AArch64 check (exit status $arm_rc, its output above)"; exit "$arm_rc"; }
