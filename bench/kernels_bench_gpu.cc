// CUDA kernels against cudaMemcpy: on a 64M-element tensor (8192 x 8192), times amax,
// quantize and dequantize for every format, the fused AdamW pass alone, fused AdamW + cast
// (one pass where the scales are known before it, two passes where an amax must be reduced
// first) and gradient stats. Each row reports elements/s, GB/s of the bytes the kernels
// actually read and write, and the ratio to a device-to-device cudaMemcpy moving the same
// number of bytes (half read, half written), measured in the same run.
//
//   kernels_bench_gpu [reps]        (default 10 timed reps after 2 warm-ups)
// Exits 0 with a note when there is no device; non-zero when a kernel call fails.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/format.h"
#include "kernels/kernels.h"

namespace mainstay::kernels {
namespace {

constexpr int64_t kRows = 8192;
constexpr int64_t kCols = 8192;
constexpr int64_t kN = kRows * kCols;
constexpr int kWarmups = 2;

#define BENCH_CUDA(call)                                                                     \
  do {                                                                                       \
    const cudaError_t e = (call);                                                            \
    if (e != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s failed: %s\n", #call, cudaGetErrorString(e));                 \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

void Check(const absl::Status& s, const std::string& what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what.c_str(), s.ToString().c_str());
    std::exit(1);
  }
}

template <typename T>
T* DeviceAlloc(int64_t n) {
  void* p = nullptr;
  BENCH_CUDA(cudaMalloc(&p, static_cast<size_t>(n) * sizeof(T) + 256));
  BENCH_CUDA(cudaMemset(p, 0, static_cast<size_t>(n) * sizeof(T) + 256));
  return static_cast<T*>(p);
}

class Timer {
 public:
  Timer(cudaStream_t stream, int reps) : stream_(stream), reps_(reps) {
    BENCH_CUDA(cudaEventCreate(&start_));
    BENCH_CUDA(cudaEventCreate(&stop_));
  }
  ~Timer() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  // Mean seconds per call of `fn` (which enqueues on the stream).
  double Time(const std::function<void()>& fn) {
    for (int i = 0; i < kWarmups; ++i) fn();
    BENCH_CUDA(cudaStreamSynchronize(stream_));
    BENCH_CUDA(cudaEventRecord(start_, stream_));
    for (int i = 0; i < reps_; ++i) fn();
    BENCH_CUDA(cudaEventRecord(stop_, stream_));
    BENCH_CUDA(cudaEventSynchronize(stop_));
    float ms = 0.0f;
    BENCH_CUDA(cudaEventElapsedTime(&ms, start_, stop_));
    return ms * 1e-3 / reps_;
  }

 private:
  cudaStream_t stream_;
  int reps_;
  cudaEvent_t start_, stop_;
};

struct Row {
  std::string name;
  double seconds;
  double bytes;
};

int Main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 10;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("kernels_bench_gpu: no CUDA device, nothing to measure\n");
    return 0;
  }
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreate(&stream));
  const Device gpu{Device::Kind::kCuda, nullptr, stream};
  const Matrix2D view{kRows, kCols};
  const Fragment whole{view, {0, kN}};

  // Inputs: masters of mixed magnitudes, small gradients, positive second moments.
  std::vector<float> host(static_cast<size_t>(kN));
  uint32_t state = 12345;
  for (float& x : host) {
    state = state * 1664525u + 1013904223u;
    x = (static_cast<float>(state >> 8) / 16777216.0f - 0.5f) * static_cast<float>(1 << (state & 7));
  }
  float* master = DeviceAlloc<float>(kN);
  float* grad = DeviceAlloc<float>(kN);
  float* m = DeviceAlloc<float>(kN);
  float* v = DeviceAlloc<float>(kN);
  BENCH_CUDA(cudaMemcpy(master, host.data(), kN * sizeof(float), cudaMemcpyHostToDevice));
  for (float& x : host) x *= 1e-3f;
  BENCH_CUDA(cudaMemcpy(grad, host.data(), kN * sizeof(float), cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(m, host.data(), kN * sizeof(float), cudaMemcpyHostToDevice));
  for (float& x : host) x = x < 0 ? -x * 1e-3f : x * 1e-3f;
  BENCH_CUDA(cudaMemcpy(v, host.data(), kN * sizeof(float), cudaMemcpyHostToDevice));
  host.clear();
  host.shrink_to_fit();

  uint8_t* data = DeviceAlloc<uint8_t>(2 * kN);
  uint8_t* scales = DeviceAlloc<uint8_t>(kN / 16 * 4);
  float* block_amax = DeviceAlloc<float>(kN / 16);
  uint16_t* model_values = DeviceAlloc<uint16_t>(kN);
  float* dequantized = DeviceAlloc<float>(kN);
  float* tensor_amax = DeviceAlloc<float>(1);
  float* scale_inv = DeviceAlloc<float>(1);
  double* sum = DeviceAlloc<double>(1);
  int64_t* nonfinite = DeviceAlloc<int64_t>(1);

  const auto blocks_of = [&](Format f) { return ScaleBlockRange(f, view, whole.elements).size(); };
  const auto scale_bytes = [&](Format f) {
    const FormatDescriptor& d = Describe(f);
    return d.has_block_scales() ? blocks_of(f) * BitsOf(d.block_scale) / 8 : 0;
  };
  const auto amax_span = [&](Format f) { return std::span<float>(block_amax, static_cast<size_t>(blocks_of(f))); };
  const auto data_span = [&](Format f) { return std::span<uint8_t>(data, static_cast<size_t>(DataBytes(f, kN))); };
  const auto scale_span = [&](Format f) { return std::span<uint8_t>(scales, static_cast<size_t>(scale_bytes(f))); };
  const std::span<const float> master_span(master, static_cast<size_t>(kN));
  const GradView g{grad, ElementType::kFloat32};
  const OptimizerState opt{master, m, v, ElementType::kFloat32};
  const AdamWHyper adam{1e-6f, 0.9f, 0.999f, 1e-8f, 0.0f, 10, 1.0f};
  const double n = static_cast<double>(kN);

  Timer timer(stream, reps);
  std::vector<Row> rows;
  const auto run = [&](const std::string& name, double bytes, const std::function<absl::Status()>& fn) {
    Check(fn(), name);  // fail fast, outside the timed region
    rows.push_back({name, timer.Time([&] { Check(fn(), name); }), bytes});
  };

  // ---- Amax.
  run("amax tensor (fp8 current)", 4 * n, [&] {
    return ComputePartialAmax(gpu, Format::kFP8E4M3Current, Format::kBF16, whole, master_span, {tensor_amax, {}});
  });
  for (Format f : {Format::kMXFP8, Format::kFP8Block, Format::kNVFP4}) {
    run(std::string("amax blocks + tensor ") + std::string(FormatName(f)), 4 * n + 4.0 * blocks_of(f), [&] {
      return ComputePartialAmax(gpu, f, Format::kBF16, whole, master_span, {tensor_amax, amax_span(f)});
    });
  }

  // ---- Quantize / dequantize: scales from the amax of this tensor.
  float host_amax = 0.0f;
  BENCH_CUDA(cudaMemcpy(&host_amax, tensor_amax, sizeof(float), cudaMemcpyDeviceToHost));
  for (const FormatDescriptor& d : AllFormats()) {
    const Format f = d.format;
    if (d.has_block_scales()) {
      Check(ComputePartialAmax(gpu, f, Format::kBF16, whole, master_span, {tensor_amax, amax_span(f)}), "amax");
    }
    const ScaleInputs si{0.5f, host_amax, d.has_block_scales() ? amax_span(f) : std::span<float>(), false};
    const double q_bytes = 4 * n + DataBytes(f, kN) + scale_bytes(f) + (d.has_block_scales() ? 4.0 * blocks_of(f) : 0);
    run(std::string("quantize ") + std::string(d.name), q_bytes, [&] {
      return Quantize(gpu, f, Format::kBF16, whole, master_span, si, {data_span(f), scale_span(f), scale_inv});
    });
    const QuantizedInputs qi{data_span(f), scale_span(f), 0.01f};
    run(std::string("dequantize ") + std::string(d.name), 4 * n + DataBytes(f, kN) + scale_bytes(f), [&] {
      return Dequantize(gpu, f, whole, qi, std::span<float>(dequantized, static_cast<size_t>(kN)));
    });
  }

  // ---- Optimizer. Reads grad + master + m + v (16 B), writes master + m + v (12 B).
  const std::span<uint16_t> model_span(model_values, static_cast<size_t>(kN));
  run("adamw (+bf16 values, amax, stats)", 30 * n, [&] {
    return FusedAdamW(gpu, Format::kFP8E4M3Current, Format::kBF16, whole, g, opt, adam,
                      {model_span, {tensor_amax, {}}, sum, nonfinite});
  });
  run("adamw bare", 28 * n, [&] { return FusedAdamW(gpu, Format::kBF16, Format::kBF16, whole, g, opt, adam, {}); });
  run("grad stats", 4 * n, [&] { return GradStats(gpu, g, kN, 1.0f, sum, nonfinite); });

  // One pass: fp8 delayed (scale from the history) and mxfp8 (block amax inside the pass).
  for (Format f : {Format::kFP8E4M3Delayed, Format::kMXFP8, Format::kBF16}) {
    const ScaleInputs si{0.5f, 0.0f, {}, false};
    run(std::string("adamw+cast 1 pass ") + std::string(FormatName(f)), 28 * n + DataBytes(f, kN) + scale_bytes(f),
        [&] {
          return FusedAdamWQuantize(gpu, f, Format::kBF16, whole, g, opt, adam, si, {{}, {tensor_amax, {}}, sum, nonfinite},
                                    {data_span(f), scale_span(f), scale_inv});
        });
  }
  // Two passes: the update with amax outputs, then the cast (the reduction in between is a
  // no-op on one daemon; the scale comes from the previous amax, as the bytes moved matter).
  for (Format f : {Format::kFP8E4M3Current, Format::kFP8Block, Format::kNVFP4}) {
    const bool blocks = Describe(f).has_block_scales();
    const ScaleInputs si{1.0f, host_amax, blocks ? amax_span(f) : std::span<float>(), false};
    const double bytes = 28 * n + (blocks ? 4.0 * blocks_of(f) : 0) + 4 * n + DataBytes(f, kN) + scale_bytes(f) +
                         (blocks ? 4.0 * blocks_of(f) : 0);
    run(std::string("adamw+cast 2 passes ") + std::string(FormatName(f)), bytes, [&] {
      absl::Status s = FusedAdamW(gpu, f, Format::kBF16, whole, g, opt, adam,
                                  {{}, {tensor_amax, blocks ? amax_span(f) : std::span<float>()}, sum, nonfinite});
      if (!s.ok()) return s;
      return Quantize(gpu, f, Format::kBF16, whole, master_span, si, {data_span(f), scale_span(f), scale_inv});
    });
  }

  // ---- Baseline: device-to-device copies moving the same bytes (bytes / 2 copied).
  double max_bytes = 0;
  for (const Row& r : rows) max_bytes = r.bytes > max_bytes ? r.bytes : max_bytes;
  const size_t copy_cap = static_cast<size_t>(max_bytes / 2) + 256;
  uint8_t* copy_src = DeviceAlloc<uint8_t>(static_cast<int64_t>(copy_cap));
  uint8_t* copy_dst = DeviceAlloc<uint8_t>(static_cast<int64_t>(copy_cap));
  std::map<size_t, double> memcpy_gbps;
  for (const Row& r : rows) {
    const size_t half = static_cast<size_t>(r.bytes / 2);
    if (memcpy_gbps.count(half) != 0) continue;
    const double s = timer.Time([&] { BENCH_CUDA(cudaMemcpyAsync(copy_dst, copy_src, half, cudaMemcpyDeviceToDevice, stream)); });
    memcpy_gbps[half] = 2.0 * half / s * 1e-9;
  }

  std::printf("device: %s (sm_%d%d), %lld elements (%lld x %lld), %d reps\n", prop.name, prop.major, prop.minor,
              static_cast<long long>(kN), static_cast<long long>(kRows), static_cast<long long>(kCols), reps);
  std::printf("%-40s %10s %12s %10s %12s %8s\n", "kernel", "ms", "Gelem/s", "GB/s", "memcpy GB/s", "ratio");
  for (const Row& r : rows) {
    const double gbps = r.bytes / r.seconds * 1e-9;
    const double base = memcpy_gbps[static_cast<size_t>(r.bytes / 2)];
    std::printf("%-40s %10.3f %12.2f %10.1f %12.1f %8.2f\n", r.name.c_str(), r.seconds * 1e3, n / r.seconds * 1e-9,
                gbps, base, gbps / base);
  }
  for (void* p : std::initializer_list<void*>{master, grad, m, v, data, scales, block_amax, model_values, dequantized,
                                              tensor_amax, scale_inv, sum, nonfinite, copy_src, copy_dst}) {
    cudaFree(p);
  }
  cudaStreamDestroy(stream);
  return 0;
}

}  // namespace
}  // namespace mainstay::kernels

int main(int argc, char** argv) { return mainstay::kernels::Main(argc, argv); }
