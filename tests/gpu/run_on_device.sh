#!/usr/bin/env bash
# Builds and runs every GPU test and GPU benchmark in one call, then prints a summary.
# Meant for a machine with an NVIDIA GPU (H200 / B200); run from anywhere:
#   bash tests/gpu/run_on_device.sh
# Builds only for the architecture of GPU 0 to keep the build short. Logs go to $OUT when
# set (the device runner collects that folder), else to build-gpu/logs.
set -uo pipefail
cd "$(dirname "$0")/../.."
start=$(date +%s)
build=build-gpu
logs=${OUT:-$build/logs}
mkdir -p "$logs"

bash scripts/install_deps.sh > "$logs/deps.log" 2>&1 || echo "install_deps failed (offline?); building with what is installed"
nvidia-smi -L || { echo "no NVIDIA GPU visible"; exit 1; }
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '.')
echo "== configure for sm_$arch"
cmake -S . -B "$build" -G Ninja -DMAINSTAY_ENABLE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" > "$logs/configure.log" 2>&1 ||
  { tail -30 "$logs/configure.log"; exit 1; }
echo "== build"
cmake --build "$build" -j"$(nproc)" > "$logs/build.log" 2>&1 || { grep -E "error|FAILED" "$logs/build.log" | head -40; exit 1; }
echo "build done in $(( $(date +%s) - start ))s"

echo "== gpu tests"
ctest --test-dir "$build" -L gpu -E nccl_transport_gpu_test --output-on-failure --timeout 300 2>&1 |
  tee "$logs/ctest-gpu.log"
test_rc=${PIPESTATUS[0]}
# The nccl transport end to end, verbose: a skip (NCCL refusing a trainer and a daemon on one GPU)
# shows NCCL's reason; its daemon and trainer logs are printed on failure.
echo "== nccl transport (coordinator + mainstayd --transports nccl + trainer processes)"
ctest --test-dir "$build" -R nccl_transport_gpu_test -V --timeout 900 2>&1 | tee "$logs/ctest-nccl.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || test_rc=1

echo "== gpu benchmarks"
bench_rc=0
shopt -s nullglob
benches=("$build"/bench/*_gpu)
for b in "${benches[@]}"; do
  echo "-- $b"
  timeout 300 "$b" 2>&1 | tee "$logs/$(basename "$b").log" || bench_rc=1
done

echo
echo "== summary ($(( $(date +%s) - start ))s)"
grep -E "tests passed|tests failed|Skipped|Failed" "$logs/ctest-gpu.log" | tail -5
grep -E "tests passed|tests failed|\(Skipped\)|SKIPPED \]|NCCL refused" "$logs/ctest-nccl.log" | tail -5
echo "benchmarks run: ${#benches[@]} (rc $bench_rc)"
[ "$test_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
