#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz, docs/fuzzing.md) with clang, ASan and UBSan in a
# build folder of their own, then runs each for SECONDS (default 30) on a copy of its checked-in
# corpus. Exits non-zero when a target finds a crash, leak, UB or a broken invariant; the input
# is left in $MAINSTAY_FUZZ_BUILD_DIR/artifacts/ (rerun: BUILD/tests/fuzz/TARGET FILE). The
# targets' own stderr is closed while fuzzing (the daemon logs a line per input); libFuzzer's
# and the sanitizers' reports still reach the log.
#
#   scripts/fuzz.sh [SECONDS]
# Environment: MAINSTAY_FUZZ_BUILD_DIR (default build-fuzz), MAINSTAY_FUZZ_TARGETS (default:
# every target), MAINSTAY_FUZZ_JOBS (parallel fuzzing processes per target, default 1),
# MAINSTAY_FUZZ_ARGS (extra libFuzzer flags, e.g. "-max_len=4096").
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:-30}
build_dir=${MAINSTAY_FUZZ_BUILD_DIR:-build-fuzz}
targets=${MAINSTAY_FUZZ_TARGETS:-"push_stream_fuzzer job_spec_fuzzer state_store_fuzzer assign_shard_fuzzer pull_stream_fuzzer grpc_chunk_fuzzer"}
jobs=${MAINSTAY_FUZZ_JOBS:-1}
sanitizers="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"

command -v clang++ > /dev/null || { echo "fuzz.sh: clang++ not found (apt-get install clang)"; exit 1; }

echo "== configure ($build_dir, clang, ASan + UBSan)"
CC=clang CXX=clang++ cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DMAINSTAY_BUILD_FUZZERS=ON -DMAINSTAY_ENABLE_CUDA=OFF -DMAINSTAY_ENABLE_UCX=OFF -DMAINSTAY_BUILD_BENCH=OFF \
  "-DCMAKE_C_FLAGS=$sanitizers" "-DCMAKE_CXX_FLAGS=$sanitizers" > "$build_dir.configure.log" 2>&1 ||
  { cat "$build_dir.configure.log"; exit 1; }

echo "== build ($targets)"
start=$(date +%s)
# shellcheck disable=SC2086
cmake --build "$build_dir" -j"$(nproc)" --target $targets
echo "build took $(( $(date +%s) - start ))s"

mkdir -p "$build_dir/artifacts"
parallel=""
if [ "$jobs" -gt 1 ]; then parallel="-fork=$jobs"; fi
status=0
for target in $targets; do
  # New inputs go to the working copy; the checked-in seeds stay as they are.
  work="$build_dir/fuzz-corpus/$target"
  mkdir -p "$work"
  echo "== $target: ${seconds}s"
  # shellcheck disable=SC2086
  if ! "$build_dir/tests/fuzz/$target" -max_total_time="$seconds" -timeout=25 -rss_limit_mb=4096 -close_fd_mask=2 \
       $parallel -print_final_stats=1 -artifact_prefix="$build_dir/artifacts/$target-" \
       ${MAINSTAY_FUZZ_ARGS:-} "$work" "tests/fuzz/corpus/$target" > "$build_dir/$target.log" 2>&1; then
    tail -n 60 "$build_dir/$target.log"
    echo "fuzz.sh: $target FAILED; input in $build_dir/artifacts/"
    status=1
  else
    grep -E "stat::number_of_executed_units|stat::peak_rss_mb|Done [0-9]+ runs" "$build_dir/$target.log" || true
  fi
done
exit $status
