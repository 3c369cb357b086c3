#!/usr/bin/env bash
# Builds, here, everything the GPU check runs, and packs it into one folder that a machine with a
# GPU but no compiler and no package registry can run (tests/gpu/run_on_device.sh):
#
#   bash scripts/device_bundle.sh [BUNDLE_DIR]        (default build-device)
#
#   BUNDLE_DIR/bin/     the GPU test binaries, slice_test, nccl_trainer, mainstayd,
#                       mainstay-coordinator, step_bench and the GPU benchmarks, stripped
#   BUNDLE_DIR/lib/     libmainstay_client and every shared library they load that is not glibc's,
#                       the CUDA driver's or NCCL's (the device has its own of those: NCCL possibly
#                       only inside PyTorch's nvidia-nccl wheel, which the runner finds)
#   BUNDLE_DIR/lib/cxx/ libstdc++ and libgcc_s, used there only when that glibc is new enough
#   BUNDLE_DIR/MANIFEST what was packed, the glibc it needs, the CUDA architectures
#   BUNDLE_DIR.tar.gz   all of it packed: the file to carry to the GPU machine
#
# The build is MAINSTAY_BUILD_DIR (default build), configured with CUDA (and NCCL when found);
# the CUDA architectures are that build's (CMAKE_CUDA_ARCHITECTURES, 90 and 100 by default).
# Fails when CUDA is not built, or when the packed bundle exceeds 56 MiB (the device tool carries
# 64 with the working tree).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${MAINSTAY_BUILD_DIR:-build}
bundle=${1:-build-device}
limit_mib=56  # of the packed bundle: the device tool carries 64 MiB, the working tree included

[ -f "$build/CMakeCache.txt" ] || { echo "no configured build in $build (run scripts/test.sh or cmake first)" >&2; exit 1; }
grep -q "kernels_gpu_test" "$build/build.ninja" 2>/dev/null ||
  { echo "$build was configured without CUDA: the GPU tests are not built (nvcc in /usr/local/cuda?)" >&2; exit 1; }

targets=(mainstayd mainstay-coordinator mainstay_client cuda_device_test kernels_gpu_test daemon_gpu_test
         slice_test step_bench kernels_bench_gpu)
have_nccl=0
if grep -q "nccl_transport_gpu_test" "$build/build.ninja" 2>/dev/null; then
  have_nccl=1
  targets+=(nccl_transport_gpu_test nccl_trainer)
fi
echo "== build ${targets[*]}"
cmake --build "$build" -j"$(nproc)" --target "${targets[@]}"

rm -rf "$bundle"
mkdir -p "$bundle/bin" "$bundle/lib/cxx"
programs=(server/grpc/mainstayd server/grpc/mainstay-coordinator tests/gpu/cuda_device_test
          tests/gpu/kernels_gpu_test tests/gpu/daemon_gpu_test tests/integration/slice_test bench/step_bench
          bench/kernels_bench_gpu)
[ "$have_nccl" = 1 ] && programs+=(tests/gpu/nccl_transport_gpu_test tests/gpu/nccl_trainer)
for p in "${programs[@]}"; do
  strip -o "$bundle/bin/$(basename "$p")" "$build/$p"
done
client=$(readlink -f "$build/client/libmainstay_client.so")
strip --strip-debug -o "$bundle/lib/$(basename "$client")" "$client"
(cd "$bundle/lib" && ln -sf "$(basename "$client")" libmainstay_client.so.0)

# The shared-library closure, less what the device brings: glibc, the driver, NCCL.
skip='/(libc|libm|libdl|libpthread|librt|libresolv|libutil|ld-linux-x86-64)\.so|/libcuda\.so|/libnccl\.so'
LD_LIBRARY_PATH="$bundle/lib" ldd "$bundle"/bin/* "$bundle/lib/$(basename "$client")" 2>/dev/null |
  awk '/=> \// {print $3}' | sort -u | grep -v -E "$skip" | grep -v "^$(readlink -f "$bundle")/" |
  while read -r lib; do
    case "$(basename "$lib")" in
      libstdc++.so.*|libgcc_s.so.*) cp -L "$lib" "$bundle/lib/cxx/" ;;
      *) cp -L "$lib" "$bundle/lib/" ;;
    esac
  done

glibc_needed=$(for f in "$bundle"/bin/* "$bundle"/lib/*.so* "$bundle"/lib/cxx/*; do objdump -T "$f" 2>/dev/null; done |
  grep -o 'GLIBC_2\.[0-9]*' | sort -uV | tail -1)
glibc_without_cxx=$(for f in "$bundle"/bin/* "$bundle"/lib/*.so*; do objdump -T "$f" 2>/dev/null; done |
  grep -o 'GLIBC_2\.[0-9]*' | sort -uV | tail -1)
archs=$(grep -o -- '--generate-code=arch=compute_[0-9]*,code=[^ ]*' "$build/build.ninja" | grep -o 'sm_[0-9]*' |
  sort -uV | tr '\n' ' ')
{
  echo "built $(date -u +%FT%TZ) from $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo '+changes')"
  echo "cuda_architectures ${archs:-unknown}"
  echo "nccl_tests $have_nccl"
  echo "glibc_needed ${glibc_needed#GLIBC_}"
  echo "glibc_needed_without_cxx ${glibc_without_cxx#GLIBC_}"
  echo "cudart $(basename "$(ls "$bundle"/lib/libcudart.so.* 2>/dev/null | head -1)")"
} > "$bundle/MANIFEST"

# What travels: one compressed file (about a third of the folder), unpacked by run_on_device.sh.
tarball=$bundle.tar.gz
tar -C "$(dirname "$bundle")" -czf "$tarball" "$(basename "$bundle")"
size_kib=$(du -sk "$bundle" | cut -f1)
tar_kib=$(du -sk "$tarball" | cut -f1)
cat "$bundle/MANIFEST"
echo "bundle: $bundle, $(ls "$bundle/bin" | wc -l) programs, $(ls "$bundle/lib" | wc -l) libraries, $((size_kib / 1024)) MiB;" \
  "packed: $tarball, $((tar_kib / 1024)) MiB"
if [ "$tar_kib" -gt $((limit_mib * 1024)) ]; then
  echo "$tarball is larger than $limit_mib MiB: the device tool carries at most 64 MiB with the working tree" >&2
  exit 1
fi
echo "carry it: run(carry=[\"$tarball\"], command=\"bash tests/gpu/run_on_device.sh\")"
