// Throughput of the CPU kernels (kernels/kernels.h) against memcpy measured in the same run.
//
//   kernels_bench [--elements N] [--cols N] [--threads N] [--reps N] [--warmup N]
//
// Every kernel runs on one fragment covering a whole 2D weight (default 8192 x 8192 = 64M
// elements, FP32 masters, bf16 model dtype). For each row the program counts the bytes the
// kernel must move (read + written, exactly as the formats define them), and measures
// std::memcpy of half that many bytes (a copy of B bytes moves 2B), split over the same
// threads (one large piece each); the ratio kernel GB/s / memcpy GB/s is the row's result.
// memcpy is the honest ceiling: unlike a STREAM triad count, it is a real copy at the
// library's best speed (non-temporal stores for large copies, so no write-allocate reads).
// A call that fails (for example a backend still answering UNIMPLEMENTED) prints
// "n/a (CODE)" instead of numbers.
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "common/format.h"
#include "kernels/casts.h"
#include "kernels/cpu/executor.h"
#include "kernels/kernels.h"
#include "kernels/scaling.h"

namespace mainstay::kernels {
namespace {

struct Options {
  int64_t elements = int64_t{64} << 20;
  int64_t cols = 8192;
  int threads = 0;  // 0 = all hardware threads
  int reps = 5;
  int warmup = 1;
};

bool ParseInt(const char* text, int64_t min, int64_t& out) {
  char* end = nullptr;
  const long long v = std::strtoll(text, &end, 10);
  if (end == text || *end != '\0' || v < min) return false;
  out = v;
  return true;
}

bool ParseArgs(int argc, char** argv, Options& o) {
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") return false;
    if (i + 1 >= argc) {
      std::fprintf(stderr, "%s needs a value\n", flag.c_str());
      return false;
    }
    int64_t v = 0;
    const char* value = argv[++i];
    const bool ok = flag == "--threads" ? ParseInt(value, 0, v) : ParseInt(value, 1, v);
    if (!ok) {
      std::fprintf(stderr, "bad value for %s: %s\n", flag.c_str(), value);
      return false;
    }
    if (flag == "--elements") {
      o.elements = v;
    } else if (flag == "--cols") {
      o.cols = v;
    } else if (flag == "--threads") {
      o.threads = static_cast<int>(v);
    } else if (flag == "--reps") {
      o.reps = static_cast<int>(v);
    } else if (flag == "--warmup") {
      o.warmup = static_cast<int>(v);
    } else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return false;
    }
  }
  return true;
}

// A buffer of trivially-copyable T without value-initialization (the first touch happens in
// the fill or the warm-up, not in the allocator).
template <typename T>
class Buffer {
 public:
  explicit Buffer(int64_t n) : n_(n), p_(new T[static_cast<size_t>(std::max<int64_t>(n, 1))]) {}
  T* data() { return p_.get(); }
  T& operator[](int64_t i) { return p_[static_cast<size_t>(i)]; }
  int64_t size() const { return n_; }
  std::span<T> span() { return {p_.get(), static_cast<size_t>(n_)}; }
  std::span<const T> cspan() const { return {p_.get(), static_cast<size_t>(n_)}; }

 private:
  int64_t n_;
  std::unique_ptr<T[]> p_;
};

// Deterministic weight-like values (|x| < ~0.1, a few larger outliers), filled in parallel.
void FillValues(CpuExecutor* ex, float* x, int64_t n, uint64_t seed, float scale) {
  constexpr int64_t kChunk = 1 << 20;
  ParallelFor(ex, (n + kChunk - 1) / kChunk, [&](int64_t c) {
    uint64_t s = seed ^ (static_cast<uint64_t>(c) * 0x9E3779B97F4A7C15ull);
    const int64_t end = std::min(n, (c + 1) * kChunk);
    for (int64_t i = c * kChunk; i < end; ++i) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      const float u = static_cast<float>(static_cast<int64_t>(s >> 40) - (int64_t{1} << 23)) / 8388608.0f;
      x[i] = scale * u * u * u * (((s >> 20) & 1023) == 0 ? 8.0f : 1.0f);
    }
  });
}

// Host-side amax of the bf16 model values, per block of `format` over the whole tensor
// (the Quantize inputs; computed here so the Quantize rows do not depend on ComputePartialAmax).
std::vector<float> BlockAmax(Format format, Matrix2D view, const float* x) {
  const FormatDescriptor& d = Describe(format);
  const Matrix2D grid = ScaleGrid(format, view);
  std::vector<float> amax(static_cast<size_t>(grid.numel()), 0.0f);
  for (int64_t r = 0; r < view.rows; ++r) {
    float* row_amax = amax.data() + (r / d.block_rows) * grid.cols;
    for (int64_t c = 0; c < view.cols; ++c) {
      const float v = Bf16ToFloat(FloatToBf16(x[r * view.cols + c]));
      float& a = row_amax[c / d.block_cols];
      a = AmaxUpdate(a, v);
    }
  }
  return amax;
}

float TensorAmax(const std::vector<float>& block_amax) {
  float a = 0.0f;
  for (float b : block_amax) a = AmaxUpdate(a, b);
  return a;
}

// ComputePartialAmax of a block format (BlockPartialAmax) into `block_amax`, sized for it.
absl::Status BlockAmaxRow(const Device& device, Format format, Format model, const Fragment& whole,
                          std::span<const float> master, std::vector<float>& block_amax, float* tensor_amax) {
  block_amax.resize(static_cast<size_t>(ScaleBlockRange(format, whole.view, whole.elements).size()));
  AmaxOutputs out;
  out.tensor_amax = tensor_amax;
  out.block_amax = std::span<float>(block_amax);
  return ComputePartialAmax(device, format, model, whole, master, out);
}

using Clock = std::chrono::steady_clock;

// Median seconds of `reps` runs after `warmup` runs; the first failing status is returned.
absl::Status TimeMedian(const Options& o, const std::function<absl::Status()>& fn, double& seconds) {
  for (int i = 0; i < o.warmup; ++i) {
    absl::Status s = fn();
    if (!s.ok()) return s;
  }
  std::vector<double> t;
  for (int i = 0; i < o.reps; ++i) {
    const auto start = Clock::now();
    absl::Status s = fn();
    const auto stop = Clock::now();
    if (!s.ok()) return s;
    t.push_back(std::chrono::duration<double>(stop - start).count());
  }
  std::sort(t.begin(), t.end());
  seconds = t.size() % 2 ? t[t.size() / 2] : 0.5 * (t[t.size() / 2 - 1] + t[t.size() / 2]);
  return absl::OkStatus();
}

// memcpy of `bytes` bytes, split over the executor's threads.
class MemcpyBaseline {
 public:
  MemcpyBaseline(CpuExecutor* ex, int64_t max_bytes) : ex_(ex), src_(max_bytes), dst_(max_bytes) {
    std::memset(src_.data(), 1, static_cast<size_t>(max_bytes));
    std::memset(dst_.data(), 2, static_cast<size_t>(max_bytes));
  }

  // GB/s counting read + written bytes (2 x bytes); measured once per byte count.
  double GBps(const Options& o, int64_t bytes) {
    auto it = cache_.find(bytes);
    if (it != cache_.end()) return it->second;
    // One large contiguous piece per thread, as a caller copying big buffers would do: glibc
    // then uses non-temporal stores (no write-allocate), its fastest path. Small chunks
    // (a few MiB) would fall below its threshold and run ~30% slower on this kind of machine.
    const int64_t pieces = ex_ == nullptr ? 1 : ex_->threads();
    const int64_t piece = (bytes / pieces + 4095) / 4096 * 4096;
    double seconds = 0;
    absl::Status s = TimeMedian(o, [&] {
      ParallelFor(ex_, pieces, [&](int64_t c) {
        const int64_t begin = std::min(bytes, c * piece);
        const int64_t n = std::min(piece, bytes - begin);
        std::memcpy(dst_.data() + begin, src_.data() + begin, static_cast<size_t>(n));
      });
      return absl::OkStatus();
    }, seconds);
    const double gbps = 2.0 * static_cast<double>(bytes) / seconds / 1e9;
    cache_[bytes] = gbps;
    return gbps;
  }

 private:
  CpuExecutor* ex_;
  Buffer<uint8_t> src_;
  Buffer<uint8_t> dst_;
  std::map<int64_t, double> cache_;
};

struct Row {
  std::string name;
  double bytes_per_element;  // read + written, averaged over the tensor
  std::function<absl::Status()> run;
};

}  // namespace

int Main(int argc, char** argv) {
  Options o;
  if (!ParseArgs(argc, argv, o)) {
    std::fprintf(stderr,
                 "usage: %s [--elements N (default 64M)] [--cols N (default 8192)] [--threads N (0 = all)]\n"
                 "          [--reps N (default 5)] [--warmup N (default 1)]\n",
                 argv[0]);
    return 2;
  }
  // A 2D weight: rows a multiple of 128 so that every block format tiles it exactly.
  const int64_t cols = (o.cols + 127) / 128 * 128;
  const int64_t rows = std::max<int64_t>(128, ((o.elements + cols - 1) / cols + 127) / 128 * 128);
  const Matrix2D view{rows, cols};
  const int64_t n = view.numel();
  const Fragment whole{view, {0, n}};

  CpuExecutor executor(o.threads);
  Device device;
  device.kind = Device::Kind::kCpu;
  device.executor = &executor;

  std::printf("command:");
  for (int i = 0; i < argc; ++i) std::printf(" %s", argv[i]);
  std::printf("\ntensor: %" PRId64 " x %" PRId64 " = %" PRId64 " elements (one fragment), fp32 master, "
              "bf16 model dtype\nthreads: %d (hardware: %u), reps: %d (median), warmup: %d\n\n",
              rows, cols, n, executor.threads(), std::thread::hardware_concurrency(), o.reps, o.warmup);

  // ---- Tensors.
  Buffer<float> master(n), grad(n), m(n), v(n), deq(n);
  Buffer<uint8_t> q8(n), q4(DataBytes(Format::kNVFP4, n));
  Buffer<uint16_t> q16(n);
  FillValues(&executor, master.data(), n, 1, 0.05f);
  FillValues(&executor, grad.data(), n, 2, 1e-3f);
  FillValues(&executor, m.data(), n, 3, 1e-4f);
  ParallelFor(&executor, n / 4096, [&](int64_t c) {
    for (int64_t i = c * 4096; i < (c + 1) * 4096; ++i) v[i] = m[i] * m[i] + 1e-12f;
  });
  std::memset(deq.data(), 0, static_cast<size_t>(n) * 4);
  std::memset(q8.data(), 0, static_cast<size_t>(n));
  std::memset(q4.data(), 0, static_cast<size_t>(q4.size()));
  std::memset(q16.data(), 0, static_cast<size_t>(n) * 2);

  // Block amaxes and scale outputs per block format.
  struct Blocks {
    std::vector<float> amax;
    std::vector<uint8_t> scales;
  };
  std::map<Format, Blocks> blocks;
  for (Format f : {Format::kMXFP8, Format::kFP8Block, Format::kNVFP4}) {
    Blocks& b = blocks[f];
    b.amax = BlockAmax(f, view, master.data());
    const int entry = BitsOf(Describe(f).block_scale) / 8;
    b.scales.assign(static_cast<size_t>(ScaleBlockRange(f, view, whole.elements).size() * entry), 0);
  }
  const float tensor_amax = TensorAmax(blocks[Format::kFP8Block].amax);
  const float delayed_scale = kE4M3Max / tensor_amax;  // as if the history held this step's amax
  std::printf("tensor amax (bf16 values): %g\n\n", tensor_amax);

  float amax_out = 0, scale_inv_out = 0;
  ScaleInputs current;
  current.tensor_amax = tensor_amax;
  ScaleInputs delayed;
  delayed.tensor_scale = delayed_scale;
  auto block_inputs = [&](Format f) {
    ScaleInputs s;
    s.tensor_amax = tensor_amax;
    s.block_amax = blocks[f].amax;
    return s;
  };
  auto outputs = [&](Format f, std::span<uint8_t> data) {
    QuantizedOutputs out;
    out.data = data;
    if (Describe(f).has_block_scales()) out.block_scales = blocks[f].scales;
    out.tensor_scale_inv = &scale_inv_out;
    return out;
  };
  std::span<uint8_t> q16_bytes(reinterpret_cast<uint8_t*>(q16.data()), static_cast<size_t>(n) * 2);

  const GradView g{grad.data(), ElementType::kFloat32};
  const OptimizerState state{master.data(), m.data(), v.data(), ElementType::kFloat32};
  AdamWHyper hyper;
  hyper.lr = 1e-6f;
  hyper.weight_decay = 0.01f;
  hyper.step = 10;

  const Format bf16 = Format::kBF16;
  const double nd = static_cast<double>(n);
  auto block_bytes = [&](Format f, int in_bytes, int out_bytes) {  // amax in, scale out
    return static_cast<double>(blocks[f].amax.size()) * (in_bytes + out_bytes) / nd;
  };

  // The block amaxes the quantize rows are given, computed (BlockPartialAmax, via
  // ComputePartialAmax): the pass that precedes each block format's cast.
  std::vector<float> scratch_amax(blocks[Format::kMXFP8].amax.size());
  std::vector<Row> table = {
      {"amax (ComputePartialAmax, fp8 current)", 4.0,
       [&] {
         AmaxOutputs out;
         out.tensor_amax = &amax_out;
         return ComputePartialAmax(device, Format::kFP8E4M3Current, bf16, whole, master.cspan(), out);
       }},
      {"block amax mxfp8 (1x32 blocks)", 4.0 + block_bytes(Format::kMXFP8, 0, 4),
       [&] { return BlockAmaxRow(device, Format::kMXFP8, bf16, whole, master.cspan(), scratch_amax, &amax_out); }},
      {"block amax nvfp4 (16x16 tiles)", 4.0 + block_bytes(Format::kNVFP4, 0, 4),
       [&] { return BlockAmaxRow(device, Format::kNVFP4, bf16, whole, master.cspan(), scratch_amax, &amax_out); }},
      {"block amax fp8_block (128x128 tiles)", 4.0 + block_bytes(Format::kFP8Block, 0, 4),
       [&] { return BlockAmaxRow(device, Format::kFP8Block, bf16, whole, master.cspan(), scratch_amax, &amax_out); }},
      {"quantize fp8_e4m3_current", 5.0,
       [&] {
         return Quantize(device, Format::kFP8E4M3Current, bf16, whole, master.cspan(), current,
                         outputs(Format::kFP8E4M3Current, q8.span()));
       }},
      {"quantize fp8_e4m3_delayed", 5.0,
       [&] {
         return Quantize(device, Format::kFP8E4M3Delayed, bf16, whole, master.cspan(), delayed,
                         outputs(Format::kFP8E4M3Delayed, q8.span()));
       }},
      {"quantize mxfp8", 5.0 + block_bytes(Format::kMXFP8, 4, 1),
       [&] {
         return Quantize(device, Format::kMXFP8, bf16, whole, master.cspan(), block_inputs(Format::kMXFP8),
                         outputs(Format::kMXFP8, q8.span()));
       }},
      {"quantize fp8_block", 5.0 + block_bytes(Format::kFP8Block, 4, 4),
       [&] {
         return Quantize(device, Format::kFP8Block, bf16, whole, master.cspan(), block_inputs(Format::kFP8Block),
                         outputs(Format::kFP8Block, q8.span()));
       }},
      {"quantize nvfp4", 4.5 + block_bytes(Format::kNVFP4, 4, 1),
       [&] {
         return Quantize(device, Format::kNVFP4, bf16, whole, master.cspan(), block_inputs(Format::kNVFP4),
                         outputs(Format::kNVFP4, q4.span()));
       }},
      {"quantize bf16", 6.0,
       [&] {
         return Quantize(device, Format::kBF16, bf16, whole, master.cspan(), ScaleInputs{},
                         outputs(Format::kBF16, q16_bytes));
       }},
      {"dequantize bf16", 6.0,
       [&] {
         QuantizedInputs in;
         in.data = std::span<const uint8_t>(q16_bytes.data(), q16_bytes.size());
         return Dequantize(device, Format::kBF16, whole, in, deq.span());
       }},
      {"dequantize fp8_e4m3_current", 5.0,
       [&] {
         QuantizedInputs in;
         in.data = q8.cspan();
         in.tensor_scale_inv = 1.0f / CurrentScalingScale(tensor_amax, kE4M3Max, false);
         return Dequantize(device, Format::kFP8E4M3Current, whole, in, deq.span());
       }},
      {"dequantize nvfp4", 4.5 + block_bytes(Format::kNVFP4, 0, 1),
       [&] {
         QuantizedInputs in;
         in.data = q4.cspan();
         in.block_scales = blocks[Format::kNVFP4].scales;
         in.tensor_scale_inv = 1.0f / Nvfp4GlobalEncodeScale(tensor_amax);
         return Dequantize(device, Format::kNVFP4, whole, in, deq.span());
       }},
      {"grad stats (fp32: sum of squares, non-finite count)", 4.0,
       [&] {
         double sum = 0;
         int64_t bad = 0;
         return GradStats(device, g, n, 1.0f, &sum, &bad);
       }},
      {"fused adamw (fp32 grad/master/m/v)", 28.0,
       [&] { return FusedAdamW(device, Format::kFP8E4M3Current, bf16, whole, g, state, hyper, StepOutputs{}); }},
      {"adamw + fp8 delayed quantize (1 pass)", 29.0,
       [&] {
         StepOutputs out;
         out.amax.tensor_amax = &amax_out;  // recorded into the amax history
         return FusedAdamWQuantize(device, Format::kFP8E4M3Delayed, bf16, whole, g, state, hyper, delayed, out,
                                   outputs(Format::kFP8E4M3Delayed, q8.span()));
       }},
      {"adamw + fp8 cast in one loop (no amax output: the daemon's apply)", 29.0,
       [&] {
         return FusedAdamWQuantize(device, Format::kFP8E4M3Delayed, bf16, whole, g, state, hyper, delayed,
                                   StepOutputs{}, outputs(Format::kFP8E4M3Delayed, q8.span()));
       }},
      {"adamw + bf16 cast in one loop (no amax output: the daemon's apply)", 30.0,
       [&] {
         return FusedAdamWQuantize(device, Format::kBF16, bf16, whole, g, state, hyper, ScaleInputs{}, StepOutputs{},
                                   outputs(Format::kBF16, q16_bytes));
       }},
      {"adamw + fp8 current quantize (2 passes)", 33.0,
       [&] {
         StepOutputs out;
         out.amax.tensor_amax = &amax_out;
         absl::Status s = FusedAdamW(device, Format::kFP8E4M3Current, bf16, whole, g, state, hyper, out);
         if (!s.ok()) return s;
         ScaleInputs scales;
         scales.tensor_amax = amax_out;
         return Quantize(device, Format::kFP8E4M3Current, bf16, whole, master.cspan(), scales,
                         outputs(Format::kFP8E4M3Current, q8.span()));
       }},
      {"fused adamw + amax (in place)", 28.0,
       [&] {
         StepOutputs out;
         out.amax.tensor_amax = &amax_out;
         return FusedAdamW(device, Format::kFP8E4M3Current, bf16, whole, g, state, hyper, out);
       }},
      {"adamw dry run, amax only (reads state, writes nothing)", 16.0,
       [&] {
         StepOutputs out;
         out.amax.tensor_amax = &amax_out;
         out.dry_run = true;
         return FusedAdamW(device, Format::kFP8E4M3Current, bf16, whole, g, state, hyper, out);
       }},
      {"adamw dry run + fp8 current quantize in one pass (the daemon's step)", 16.0 + 29.0,
       [&] {
         StepOutputs out;
         out.amax.tensor_amax = &amax_out;
         out.dry_run = true;
         absl::Status s = FusedAdamW(device, Format::kFP8E4M3Current, bf16, whole, g, state, hyper, out);
         if (!s.ok()) return s;
         ScaleInputs scales;
         scales.tensor_amax = amax_out;
         return FusedAdamWQuantize(device, Format::kFP8E4M3Current, bf16, whole, g, state, hyper, scales,
                                   StepOutputs{}, outputs(Format::kFP8E4M3Current, q8.span()));
       }},
      {"adamw + mxfp8 quantize (1 pass)", 29.0 + block_bytes(Format::kMXFP8, 0, 1),
       [&] {
         return FusedAdamWQuantize(device, Format::kMXFP8, bf16, whole, g, state, hyper, ScaleInputs{},
                                   StepOutputs{}, outputs(Format::kMXFP8, q8.span()));
       }},
  };

  double max_bytes = 0;
  for (const Row& r : table) max_bytes = std::max(max_bytes, r.bytes_per_element);
  MemcpyBaseline baseline(&executor, static_cast<int64_t>(std::ceil(max_bytes * nd / 2)));

  // Measure everything first, then print: the last column needs the best memcpy of the run.
  struct Result {
    const Row* row;
    absl::Status status;
    double seconds = 0;
    double memcpy_gbps = 0;
  };
  const double tensor_copy_gbps = baseline.GBps(o, n * 4);  // the baseline alone: copy the fp32 tensor
  double best_memcpy = tensor_copy_gbps;
  std::vector<Result> results;
  for (const Row& r : table) {
    std::fprintf(stderr, "running %s\n", r.name.c_str());
    Result res{&r, absl::OkStatus()};
    res.status = TimeMedian(o, r.run, res.seconds);
    if (res.status.ok()) {
      res.memcpy_gbps = baseline.GBps(o, static_cast<int64_t>(std::llround(r.bytes_per_element * nd / 2)));
      best_memcpy = std::max(best_memcpy, res.memcpy_gbps);
    }
    results.push_back(res);
  }

  std::printf("| kernel | B/elem | Gelem/s | GB/s | memcpy GB/s (same bytes) | ratio | ratio to best memcpy |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---:|\n");
  std::printf("| memcpy of the fp32 tensor (baseline) | 8.00 | %.3f | %.2f | %.2f | 1.00 | %.2f |\n",
              tensor_copy_gbps / 8, tensor_copy_gbps, tensor_copy_gbps, tensor_copy_gbps / best_memcpy);
  for (const Result& res : results) {
    const Row& r = *res.row;
    if (!res.status.ok()) {
      std::printf("| %s | %.2f | n/a (%s) | | | | |\n", r.name.c_str(), r.bytes_per_element,
                  absl::StatusCodeToString(res.status.code()).c_str());
      continue;
    }
    const double gbps = r.bytes_per_element * nd / res.seconds / 1e9;
    std::printf("| %s | %.2f | %.3f | %.2f | %.2f | %.2f | %.2f |\n", r.name.c_str(), r.bytes_per_element,
                nd / res.seconds / 1e9, gbps, res.memcpy_gbps, gbps / res.memcpy_gbps, gbps / best_memcpy);
  }
  std::printf("\nratio = kernel GB/s / memcpy GB/s of the same byte count; best memcpy of this run: %.2f GB/s\n",
              best_memcpy);
  return 0;
}

}  // namespace mainstay::kernels

int main(int argc, char** argv) { return mainstay::kernels::Main(argc, argv); }
