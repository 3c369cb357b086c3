#!/usr/bin/env bash
# The README's test command: installs what is missing (Debian packages), configures,
# builds everything and runs every CTest test (unit, integration, slow; gpu tests are
# reported as skipped without a device).
#
# Environment: MAINSTAY_BUILD_DIR (default build), MAINSTAY_CMAKE_ARGS (extra configure
# flags, e.g. -DMAINSTAY_ENABLE_CUDA=OFF), MAINSTAY_CTEST_ARGS (e.g. "-L unit"),
# MAINSTAY_FUZZ_SECONDS (when set: afterwards, scripts/fuzz.sh runs each libFuzzer target that
# long in a clang build of its own, docs/fuzzing.md; off by default, the build takes minutes).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install_deps.sh
build_dir=${MAINSTAY_BUILD_DIR:-build}
jobs=$(nproc)

echo "== configure ($build_dir)"
# shellcheck disable=SC2086
cmake -S . -B "$build_dir" -G Ninja ${MAINSTAY_CMAKE_ARGS:-} > "$build_dir.configure.log" 2>&1 ||
  { cat "$build_dir.configure.log"; exit 1; }
grep -E "^-- Mainstay:" "$build_dir.configure.log" || true

echo "== build (-j$jobs)"
start=$(date +%s)
cmake --build "$build_dir" -j"$jobs"
echo "build took $(( $(date +%s) - start ))s"

echo "== test"
# shellcheck disable=SC2086
ctest --test-dir "$build_dir" --output-on-failure -j"$jobs" ${MAINSTAY_CTEST_ARGS:-}

if [ -n "${MAINSTAY_FUZZ_SECONDS:-}" ]; then
  echo "== fuzz (${MAINSTAY_FUZZ_SECONDS}s per target)"
  bash scripts/fuzz.sh "$MAINSTAY_FUZZ_SECONDS"
fi
