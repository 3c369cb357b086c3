#!/usr/bin/env bash
# The GPU check, on a machine with an NVIDIA GPU, from a bundle built on the development machine
# (scripts/device_bundle.sh): no compiler, CMake or package registry is needed there.
#
#   here:   bash scripts/device_bundle.sh                  (builds and packs build-device/ and
#                                                           build-device.tar.gz, what is carried)
#   there:  bash tests/gpu/run_on_device.sh [BUNDLE_DIR]   (default build-device; unpacked from
#                                                           BUNDLE_DIR.tar.gz when only that is there)
#
# Runs the bundle's test binaries directly (not through CTest), with LD_LIBRARY_PATH = the
# bundle's libraries plus the folder of NCCL: the system's, or the one inside PyTorch's
# nvidia-nccl wheel. Every step has a time limit and the whole run stays under 6 minutes.
# Prints one summary table: each test binary's result (pass / FAIL / skip, with googletest's
# counts) and each kernel's fraction of the device's copy bandwidth (kernels_bench_gpu, same
# run). A binary is "skip" only when it exits 77, which it does only when every case skipped
# (tests/testing/gtest_skip_main.cc): a skipped case never hides a failed one. Where nvidia-smi
# lists a GPU, "no CUDA device" is a FAIL (e.g. a driver older than the bundle's libcudart).
# Logs go to $OUT when set (the folder the device tool brings back), else BUNDLE_DIR/logs.
# Exit status: 0 when nothing failed (skips allowed), 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
bundle_arg=${1:-build-device}
if [ ! -d "$bundle_arg" ] && [ -f "$bundle_arg.tar.gz" ]; then
  echo "== unpacking $bundle_arg.tar.gz"
  tar -C "$(dirname "$bundle_arg")" -xzf "$bundle_arg.tar.gz" || exit 1
fi
bundle=$(readlink -f "$bundle_arg")
logs=${OUT:-$bundle/logs}
budget_s=${MAINSTAY_DEVICE_CHECK_SECONDS:-330}
start=$(date +%s)
mkdir -p "$logs"

[ -x "$bundle/bin/kernels_gpu_test" ] || {
  echo "no bundle at $bundle: run 'bash scripts/device_bundle.sh' on the build machine and carry the folder" >&2
  exit 1
}
echo "== bundle $bundle"
cat "$bundle/MANIFEST"

# ---- Libraries: the bundle's, its libstdc++ only when this glibc is new enough for it, NCCL.
version_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -1)" = "$2" ]; }
glibc=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')
needed=$(awk '/^glibc_needed / {print $2}' "$bundle/MANIFEST")
libpath=$bundle/lib
if [ -n "$glibc" ] && version_ge "$glibc" "$needed"; then
  libpath=$libpath:$bundle/lib/cxx
  echo "glibc $glibc: using the bundle's libstdc++"
else
  echo "glibc ${glibc:-unknown} is older than $needed: using this machine's libstdc++"
fi
nccl_dir=""
if ldconfig -p 2>/dev/null | grep -q 'libnccl\.so\.2 '; then
  nccl_dir=system
else
  for py in python3 python; do
    command -v "$py" > /dev/null || continue
    nccl_dir=$(timeout 30 "$py" -c 'import os, nvidia.nccl as n; print(os.path.join(list(n.__path__)[0], "lib"))' 2>/dev/null)
    [ -n "$nccl_dir" ] && [ -e "$nccl_dir/libnccl.so.2" ] && break
    nccl_dir=""
  done
  if [ -z "$nccl_dir" ]; then
    found=$(timeout 30 find / -xdev -name 'libnccl.so.2' -not -path "$bundle/*" 2>/dev/null | head -1)
    [ -n "$found" ] && nccl_dir=$(dirname "$found")
  fi
  [ -n "$nccl_dir" ] && libpath=$libpath:$nccl_dir
fi
echo "NCCL: ${nccl_dir:-not found}"
export LD_LIBRARY_PATH=$libpath${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
missing=$(ldd "$bundle"/bin/* 2>/dev/null | grep 'not found' | sort -u | awk '{print $1}' | tr '\n' ' ')
[ -n "$missing" ] && echo "libraries not found: $missing"
gpus=0
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
else
  echo "gpu: nvidia-smi not found"
fi

# ---- Steps. Each row: name, result, detail.
rows=()
row() { rows+=("$(printf '%-34s %-6s %s' "$1" "$2" "$3")"); }
remaining() { echo $(( budget_s - ($(date +%s) - start) )); }
# gtest NAME LIMIT_S [ENV=VALUE...] -- COMMAND...: runs a googletest binary and records its row.
gtest() {
  local name=$1 limit=$2
  shift 2
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  local left
  left=$(remaining)
  if [ "$left" -lt 10 ]; then row "$name" "FAIL" "not run: the check's ${budget_s}s budget is spent"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (limit ${limit}s)"
  local log=$logs/$name.log t0 rc
  t0=$(date +%s)
  env "${envs[@]}" timeout "$limit" "$@" > "$log" 2>&1
  rc=$?
  local counts
  counts=$(grep -E '^\[  (PASSED|FAILED|SKIPPED) +\] [0-9]+ test' "$log" | sed -E 's/^\[  ([A-Z]+) +\] ([0-9]+) tests?.*/\2 \1/' |
    tr '[:upper:]' '[:lower:]' | paste -sd, - | sed 's/,/, /g')
  local detail="${counts:-no googletest summary}, $(( $(date +%s) - t0 ))s"
  # A filter that matched nothing exits 0 with "0 tests": that is not a pass.
  if [ "$rc" = 0 ] && ! grep -qE '^\[  (PASSED|SKIPPED) +\] [1-9][0-9]* test' "$log"; then
    row "$name" "FAIL" "no test ran; $detail"
    return
  fi
  case $rc in
    0) row "$name" "pass" "$detail" ;;
    77)
      local why
      why=$(grep -m1 -A1 ': Skipped' "$log" | tail -1)
      if [ "$gpus" -gt 0 ] && [ "$why" = "no CUDA device" ]; then
        # CUDA found nothing where the driver lists GPUs: e.g. a driver older than the bundle's
        # libcudart. Not a skip: the check did not run.
        row "$name" "FAIL" "$detail: CUDA sees no device but nvidia-smi lists $gpus (driver too old for $(awk '/^cudart / {print $2}' "$bundle/MANIFEST")?)"
      else
        row "$name" "skip" "$detail: $why"
      fi ;;
    124) row "$name" "FAIL" "timed out after ${limit}s; $detail"; tail -20 "$log" ;;
    *) row "$name" "FAIL" "exit $rc; $detail"; grep -E 'Failure|FAILED|Error|error' "$log" | head -20 ;;
  esac
}

gtest cuda_device_test 60 -- "$bundle/bin/cuda_device_test"
gtest kernels_gpu_test 150 -- "$bundle/bin/kernels_gpu_test"
# The daemon's step with its state on the GPU (mainstayd --device cuda:0), against the CPU.
gtest daemon_gpu_test 90 -- "$bundle/bin/daemon_gpu_test"
# The same through real processes: coordinator and two `mainstayd --device cuda:0` on the one GPU,
# trainers over gRPC, every recipe and cluster shape of the slice, bit for bit.
if [ "$gpus" -gt 0 ]; then
  gtest slice_test_device_cuda 120 "MAINSTAY_COORDINATOR_BIN=$bundle/bin/mainstay-coordinator" \
    "MAINSTAYD_BIN=$bundle/bin/mainstayd" "MAINSTAY_TRANSPORT=grpc" "MAINSTAY_TEST_DAEMON_FLAGS=--device cuda:0" \
    -- "$bundle/bin/slice_test" --gtest_filter='Slice/EveryRecipeTest.*:Slice/ClusterShapeTest.*'
else
  row slice_test_device_cuda "skip" "no GPU listed by nvidia-smi"
fi
# The nccl and cuda_ipc transports, each against grpc, through trainer processes (the client
# library links NCCL, so both need it). cuda_ipc with the daemon on the trainer's GPU.
if [ -x "$bundle/bin/nccl_transport_gpu_test" ]; then
  for case in nccl_transport_gpu_test:'*PushFromDevicePull*' cuda_ipc_gpu_test:'*CudaIpc*'; do
    name=${case%%:*}
    if [ -z "$nccl_dir" ]; then
      row "$name" "FAIL" "no libnccl.so.2 on this machine (system or nvidia-nccl wheel)"
    else
      gtest "$name" 150 "MAINSTAY_COORDINATOR_BIN=$bundle/bin/mainstay-coordinator" \
        "MAINSTAYD_BIN=$bundle/bin/mainstayd" "MAINSTAY_NCCL_TRAINER_BIN=$bundle/bin/nccl_trainer" \
        -- "$bundle/bin/nccl_transport_gpu_test" --gtest_filter="${case#*:}"
    fi
  done
fi

# compute-sanitizer on the tests that run the tile kernels (block amaxes, mxfp8 in the pass).
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
tile_tests='*AmaxQuantizeDequantizeMatchCpuForEveryFormatAndFragment*:*FusedAdamWQuantizeMatchesCpu*'
for tool in memcheck racecheck; do
  if [ -z "$sanitizer" ]; then
    row "sanitizer_$tool" "skip" "compute-sanitizer not on this machine"
  else
    gtest "sanitizer_$tool" 60 -- "$sanitizer" --tool "$tool" --error-exitcode 3 \
      "$bundle/bin/kernels_gpu_test" --gtest_filter="$tile_tests"
  fi
done

# ---- Kernels against the device's copy bandwidth.
bench_rows=()
left=$(remaining)
if [ "$left" -ge 20 ]; then
  limit=$(( left < 90 ? left : 90 ))
  echo "== kernels_bench_gpu (limit ${limit}s)"
  timeout "$limit" "$bundle/bin/kernels_bench_gpu" 5 > "$logs/kernels_bench_gpu.log" 2>&1
  rc=$?
  cat "$logs/kernels_bench_gpu.log"
  # Rows: name (may hold spaces), ms, Gelem/s, GB/s, memcpy GB/s, ratio.
  while read -r line; do bench_rows+=("$line"); done < <(awk 'NF >= 6 && $NF ~ /^[0-9.]+$/ && $(NF-4) ~ /^[0-9.]+$/ {
      name = $1; for (i = 2; i <= NF - 5; ++i) name = name " " $i;
      printf "%-40s %6s of copy bandwidth (%s GB/s)\n", name, $NF, $(NF-2) }' "$logs/kernels_bench_gpu.log")
  case $rc in
    0) if [ ${#bench_rows[@]} -gt 0 ]; then row kernels_bench_gpu "pass" "${#bench_rows[@]} kernels measured"
       elif [ "$gpus" -gt 0 ]; then row kernels_bench_gpu "FAIL" "measured nothing although nvidia-smi lists $gpus GPU(s)"
       else row kernels_bench_gpu "skip" "$(head -1 "$logs/kernels_bench_gpu.log")"; fi ;;
    124) row kernels_bench_gpu "FAIL" "timed out after ${limit}s" ;;
    *) row kernels_bench_gpu "FAIL" "exit $rc: $(tail -1 "$logs/kernels_bench_gpu.log")" ;;
  esac
else
  row kernels_bench_gpu "FAIL" "not run: the check's ${budget_s}s budget is spent"
fi

# ---- The daemon's step on the GPU against the CPU daemon: step_bench (64M parameters, two
# daemons and two trainers) with the daemons on --device cuda:0 and on the CPU over gRPC, and on
# cuda:0 with the trainers' gradients on the GPU pushed over cuda_ipc (which also reports the
# push phase against a cudaMemcpy device to device of as many bytes, and the trainers' pulls into
# device memory against a cudaMemcpy from pageable host memory), in the same run. Each log
# holds the per-phase table (update, quantize, ...).
step_rows=()
if [ "$gpus" -gt 0 ] && [ -x "$bundle/bin/step_bench" ]; then
  for config in "cuda:0|--daemon-device cuda:0 --transport grpc" "cpu|--daemon-device cpu --transport grpc" \
      "cuda:0-ipc|--daemon-device cuda:0 --transport cuda_ipc --grads-on cuda:0"; do
    name=${config%%|*}
    read -r -a flags <<< "${config#*|}"
    left=$(remaining)
    if [ "$left" -lt 45 ]; then row "step_bench_$name" "FAIL" "not run: the check's ${budget_s}s budget is spent"; continue; fi
    limit=$(( left < 120 ? left : 120 ))
    log=$logs/step_bench_${name/:/}.log
    echo "== step_bench ${flags[*]} (limit ${limit}s)"
    timeout "$limit" "$bundle/bin/step_bench" --coordinator-bin "$bundle/bin/mainstay-coordinator" \
      --daemon-bin "$bundle/bin/mainstayd" --params 64e6 --steps 3 --daemon-threads 4 "${flags[@]}" > "$log" 2>&1
    rc=$?
    step=$(grep -m1 '^slice step (median' "$log")
    if [ "$rc" -eq 0 ] && [ -n "$step" ]; then
      row "step_bench_$name" "pass" "see below"
      step_rows+=("$(printf '%-10s %s' "$name" "$step")")
      pushes=$(grep -m1 '^pushes from cuda' "$log")
      [ -n "$pushes" ] && step_rows+=("$(printf '%-10s %s' "" "$pushes")")
      pulls=$(grep -m1 '^pulls into cuda' "$log")
      [ -n "$pulls" ] && step_rows+=("$(printf '%-10s %s' "" "$pulls")")
    else
      row "step_bench_$name" "FAIL" "exit $rc: $(grep -v '^20[0-9][0-9]-' "$log" | tail -1)"
    fi
  done
else
  row step_bench "skip" "no GPU listed by nvidia-smi"
fi

echo
echo "== summary ($(( $(date +%s) - start ))s)"
printf '%-34s %-6s %s\n' "step" "result" "detail"
printf '%s\n' "${rows[@]}"
if [ ${#bench_rows[@]} -gt 0 ]; then
  echo
  printf '%-40s %s\n' "kernel" "fraction of device copy bandwidth (cudaMemcpy D2D, same bytes, same run)"
  printf '%s\n' "${bench_rows[@]}"
fi
if [ ${#step_rows[@]} -gt 0 ]; then
  echo
  echo "daemons    step_bench, 64M parameters, 2 daemons x 4 threads, 2 trainers (logs: step_bench_*.log)"
  printf '%s\n' "${step_rows[@]}"
fi
printf '%s\n' "${rows[@]}" | grep -q ' FAIL ' && exit 1
exit 0
