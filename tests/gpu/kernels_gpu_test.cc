// The CUDA kernels backend against its yardsticks, on a real device (label gpu; every test
// skips without one):
//   - the CPU backend (Device{kCpu}), bit for bit: amax, quantize (data, block scales,
//     tensor scale_inv), dequantize, the fused optimizers (masters, moments, model values,
//     amaxes, cast bytes) and gradient stats (sum within 1e-12 relative, count exact);
//     tests skip while the CPU backend still answers UNIMPLEMENTED;
//   - a scalar reference built here from the shared casts.h / scaling.h / optimizer_math.h
//     over the whole tensor, and the rule that quantizing fragments with MAX-reduced amaxes
//     gives the whole tensor's bytes (these need no CPU backend).
// Fragments start and end mid-row and mid-tile, some pointers are deliberately misaligned
// (scalar paths), and inputs carry NaN, +-inf, -0.0 and subnormals.
// NaN payloads are not compared (the GPU produces the canonical NaN), every other bit is.
#include <cuda_runtime.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/format.h"
#include "kernels/casts.h"
#include "kernels/cuda/device.h"
#include "kernels/kernels.h"
#include "kernels/optimizer_math.h"
#include "kernels/scaling.h"
#include "tests/testing/status_matchers.h"

namespace mainstay::kernels {
namespace {

using ::mainstay::testing::IsOk;

constexpr float kSentinel = -1.2345e-7f;  // marks scalar outputs a backend did not write

// ---- Memory on either backend: host vectors for the CPU, device copies for CUDA.

template <typename T>
class Buffer {
 public:
  // `offset` elements of padding before the data (misaligns device pointers on purpose).
  Buffer(const Device& device, std::vector<T> init, size_t offset = 0)
      : gpu_(device.kind == Device::Kind::kCuda), host_(std::move(init)), offset_(offset) {
    if (!gpu_) return;
    // Exactly the elements used (at least one), so a memory checker sees any overrun.
    EXPECT_EQ(cudaMalloc(&base_, std::max<size_t>(1, host_.size() + offset_) * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(base_ + offset_, host_.data(), host_.size() * sizeof(T), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  Buffer(const Device& device, size_t n, T fill, size_t offset = 0)
      : Buffer(device, std::vector<T>(n, fill), offset) {}
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() {
    if (base_ != nullptr) cudaFree(base_);
  }

  T* data() { return gpu_ ? base_ + offset_ : host_.data(); }
  std::span<T> span() { return {data(), host_.size()}; }
  std::vector<T> Read() {
    if (gpu_) {
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(host_.data(), base_ + offset_, host_.size() * sizeof(T), cudaMemcpyDeviceToHost),
                cudaSuccess);
    }
    return host_;
  }

 private:
  bool gpu_;
  std::vector<T> host_;
  size_t offset_;
  T* base_ = nullptr;
};

// ---- Comparisons.

bool Same(float a, float b) { return FloatBits(a) == FloatBits(b) || (IsNan(a) && IsNan(b)); }
bool Same(double a, double b) {
  return std::memcmp(&a, &b, sizeof(a)) == 0 || (std::isnan(a) && std::isnan(b));
}
template <typename T>
bool Same(T a, T b) {
  return a == b;
}
std::string Show(float x) { return absl::StrCat(x, " (0x", absl::Hex(FloatBits(x)), ")"); }
std::string Show(uint8_t x) { return absl::StrCat("0x", absl::Hex(x)); }
template <typename T>
std::string Show(T x) {
  return absl::StrCat(x);
}

template <typename T>
void ExpectSame(const std::vector<T>& want, const std::vector<T>& got, const std::string& what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  int64_t bad = 0;
  std::string first;
  for (size_t i = 0; i < want.size(); ++i) {
    if (Same(want[i], got[i])) continue;
    if (bad < 5) absl::StrAppend(&first, " [", i, "] want ", Show(want[i]), " got ", Show(got[i]), ";");
    ++bad;
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << want.size() << " differ:" << first;
}

// Moments as stored: bf16 bits exactly (the cast makes NaN canonical on both backends),
// fp32 as values (the GPU's NaNs have the canonical payload, the CPU's keep theirs).
void ExpectSameMoments(const std::vector<uint8_t>& want, const std::vector<uint8_t>& got, ElementType type,
                       const std::string& what) {
  if (type != ElementType::kFloat32 || want.size() != got.size()) return ExpectSame(want, got, what);
  std::vector<float> w(want.size() / 4), g(got.size() / 4);
  std::memcpy(w.data(), want.data(), want.size());
  std::memcpy(g.data(), got.data(), got.size());
  ExpectSame(w, g, what);
}

void ExpectSameSum(double want, double got, const std::string& what) {
  if (Same(want, got)) return;
  EXPECT_LE(std::fabs(want - got), 1e-12 * std::fabs(want)) << what << ": want " << want << " got " << got;
}

// ---- Inputs.

struct Shape {
  const char* name;
  int64_t rows, cols, begin, end;
  bool misaligned;
  Fragment fragment() const { return Fragment{{rows, cols}, {begin, end}}; }
};

// Layout fragments start on multiples of 64 elements, mid-row and mid-tile; the last shapes
// also cover odd ends, columns that are no multiple of any block side, and misaligned pointers.
const Shape kShapes[] = {
    {"whole", 256, 256, 0, 65536, false},
    {"mid_row_mid_tile", 384, 256, 64 * 301, 64 * 1301, false},
    {"inside_one_row", 64, 4096, 64 * 5, 64 * 40, false},
    {"wraps_one_row", 96, 512, 64 * 7, 64 * 9, false},
    {"misaligned_pointers", 128, 160, 64 * 3, 64 * 250, true},
    {"many_ctas", 1024, 2048, 64 * 1000, 1024 * 2048 - 64 * 77, false},
    {"odd_end", 300, 200, 2, 59999, false},
    {"odd_end_16_multiple", 64, 48, 64 * 3, 64 * 40 + 5, true},
    {"odd_cols_misaligned", 77, 131, 6, 10001, true},
    {"one_row", 1, 10000, 0, 10000, false},
};

bool Supports(Format format, const Shape& s) {
  const int m = Describe(format).shape_multiple;
  return s.rows % m == 0 && s.cols % m == 0;
}

int64_t BlockCount(Format format, const Fragment& f) { return ScaleBlockRange(format, f.view, f.elements).size(); }
int64_t ScaleBytes(Format format, const Fragment& f) {
  const FormatDescriptor& d = Describe(format);
  return d.has_block_scales() ? BlockCount(format, f) * BitsOf(d.block_scale) / 8 : 0;
}

float Special(uint32_t k) {
  const float values[] = {std::nanf(""), INFINITY, -INFINITY, FLT_MAX, -FLT_MAX, -0.0f, 1e-45f, -1.2e-38f,
                          65504.0f,      65520.0f, 448.0f,    464.0f,  -57344.0f, 6.0f};
  return values[k % (sizeof(values) / sizeof(values[0]))];
}

// Values of a rows x cols tensor. Each 16x16 region draws from one magnitude class (zeros,
// FP32 subnormals, normal, large, very wide, random bf16 patterns) and each 128x128 tile and
// 1x32 block gets its own power-of-two factor, so neighbouring blocks of every format have
// different scales (a wrong block index changes bytes); `specials` sprinkles NaN,
// infinities and other edge values. Finite values stay below the fp16 overflow.
std::vector<float> MakeValues(int64_t rows, int64_t cols, uint32_t seed, bool specials) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const uint32_t cls = static_cast<uint32_t>((r / 16) * 7919 + (c / 16) * 104729 + seed) % 6;
      const int block_exp = static_cast<int>(((r / 128) * 5 + (c / 128) * 3) % 7) - 3 +  // 128x128
                            static_cast<int>(((r / 16) * 3 + c / 16) % 2) +             // 16x16
                            static_cast<int>((r * 5 + (c / 32) * 3) % 2);                // 1x32
      const float sign = std::ldexp((rng() & 1) ? -1.0f : 1.0f, block_exp);
      float x = 0.0f;
      switch (cls) {
        case 0:
          x = (rng() & 1) ? -0.0f : 0.0f;
          break;
        case 1:
          x = sign * std::ldexp(1.0f + unit(rng), -static_cast<int>(120 + rng() % 30));
          break;
        case 2:
          x = sign * std::ldexp(1.0f + unit(rng), static_cast<int>(rng() % 20) - 10);
          break;
        case 3:
          x = sign * (1e2f + unit(rng) * 1.8e3f);
          break;
        case 4:
          x = sign * std::ldexp(1.0f + unit(rng), static_cast<int>(rng() % 50) - 40);
          break;
        default:  // a random bf16 pattern in [2^-30, 2^10), times the factor
          x = sign * BitsFloat(((rng() % 40 + 97) << 23) | (rng() & 0x7F0000u));
          break;
      }
      if (specials && rng() % 61 == 0) x = Special(rng());
      v[static_cast<size_t>(r * cols + c)] = x;
    }
  }
  return v;
}

std::vector<float> Slice(const std::vector<float>& whole, const Fragment& f) {
  return {whole.begin() + f.elements.begin, whole.begin() + f.elements.end};
}

// ---- One call on a backend, inputs and outputs in host vectors.

struct AmaxResult {
  std::vector<float> tensor;  // one entry
  std::vector<float> blocks;
};

absl::StatusOr<AmaxResult> RunAmax(const Device& dev, Format format, Format model, const Fragment& f,
                                   const std::vector<float>& master, bool misaligned) {
  Buffer<float> m(dev, master, misaligned);
  Buffer<float> tensor(dev, 1, kSentinel);
  Buffer<float> blocks(dev, Describe(format).has_block_scales() ? BlockCount(format, f) : 0, kSentinel, misaligned);
  absl::Status s = ComputePartialAmax(dev, format, model, f, m.span(), {tensor.data(), blocks.span()});
  if (!s.ok()) return s;
  return AmaxResult{tensor.Read(), blocks.Read()};
}

struct HostScales {
  float tensor_scale = 1.0f;
  float tensor_amax = 0.0f;
  std::vector<float> block_amax;
  bool pow2 = false;
};

struct QuantizeResult {
  std::vector<uint8_t> data;
  std::vector<uint8_t> scales;
  std::vector<float> scale_inv;  // one entry
};

absl::StatusOr<QuantizeResult> RunQuantize(const Device& dev, Format format, Format model, const Fragment& f,
                                           const std::vector<float>& master, const HostScales& hs, bool misaligned) {
  Buffer<float> m(dev, master, misaligned);
  Buffer<float> block_amax(dev, hs.block_amax, misaligned);
  Buffer<uint8_t> data(dev, static_cast<size_t>(DataBytes(format, f.size())), 0xEE, misaligned);
  Buffer<uint8_t> scales(dev, static_cast<size_t>(ScaleBytes(format, f)), 0xEE, misaligned);
  Buffer<float> inv(dev, 1, kSentinel);
  const ScaleInputs in{hs.tensor_scale, hs.tensor_amax, block_amax.span(), hs.pow2};
  absl::Status s = Quantize(dev, format, model, f, m.span(), in, {data.span(), scales.span(), inv.data()});
  if (!s.ok()) return s;
  return QuantizeResult{data.Read(), scales.Read(), inv.Read()};
}

absl::StatusOr<std::vector<float>> RunDequantize(const Device& dev, Format format, const Fragment& f,
                                                 const QuantizeResult& q, bool misaligned) {
  Buffer<uint8_t> data(dev, q.data, misaligned);
  Buffer<uint8_t> scales(dev, q.scales, misaligned);
  Buffer<float> out(dev, static_cast<size_t>(f.size()), kSentinel, misaligned);
  const float inv = Describe(format).tensor_scale ? q.scale_inv[0] : 1.0f;
  absl::Status s = Dequantize(dev, format, f, {data.span(), scales.span(), inv}, out.span());
  if (!s.ok()) return s;
  return out.Read();
}

// Raw bytes of values stored as `type` (fp32, bf16 or fp16).
std::vector<uint8_t> Encode(const std::vector<float>& v, ElementType type) {
  const size_t width = type == ElementType::kFloat32 ? 4 : 2;
  std::vector<uint8_t> out(v.size() * width);
  for (size_t i = 0; i < v.size(); ++i) {
    if (type == ElementType::kFloat32) {
      std::memcpy(&out[4 * i], &v[i], 4);
    } else {
      const uint16_t h = type == ElementType::kBFloat16 ? FloatToBf16(v[i]) : FloatToFp16(v[i]);
      std::memcpy(&out[2 * i], &h, 2);
    }
  }
  return out;
}

enum class Pass { kAdamW, kAdamWQuantize, kSgd };

struct OptimizerInputs {
  ElementType grad_type = ElementType::kFloat32;
  ElementType moment_type = ElementType::kFloat32;
  std::vector<uint8_t> grad, m, v;  // raw bytes
  std::vector<float> master;
  AdamWHyper adam;
  SgdHyper sgd;
  HostScales scales;  // kAdamWQuantize: tensor_scale for fp8 delayed
};

struct OptimizerResult {
  std::vector<float> master;
  std::vector<uint8_t> m, v;
  std::vector<uint16_t> model;
  AmaxResult amax;
  std::vector<double> sum;
  std::vector<int64_t> count;
  QuantizeResult quantized;
};

absl::StatusOr<OptimizerResult> RunOptimizer(const Device& dev, Pass pass, Format format, Format model,
                                             const Fragment& f, const OptimizerInputs& in, bool misaligned,
                                             bool want_outputs = true) {
  const size_t n = static_cast<size_t>(f.size());
  const size_t grad_offset = misaligned ? (in.grad_type == ElementType::kFloat32 ? 4 : 2) : 0;
  const size_t moment_offset = misaligned ? (in.moment_type == ElementType::kFloat32 ? 4 : 2) : 0;
  Buffer<uint8_t> grad(dev, in.grad, grad_offset);
  Buffer<uint8_t> m(dev, in.m, moment_offset);
  Buffer<uint8_t> v(dev, in.v, moment_offset);
  Buffer<float> master(dev, in.master, misaligned);
  Buffer<uint16_t> model_values(dev, want_outputs ? n : 0, 0xEEEE, misaligned);
  Buffer<float> tensor_amax(dev, 1, kSentinel);
  const bool blocks = want_outputs && Describe(format).has_block_scales();
  Buffer<float> block_amax(dev, blocks ? BlockCount(format, f) : 0, kSentinel, misaligned);
  Buffer<double> sum(dev, 1, -1.0);
  Buffer<int64_t> count(dev, 1, -1);
  Buffer<uint8_t> data(dev, static_cast<size_t>(DataBytes(format, f.size())), 0xEE, misaligned);
  Buffer<uint8_t> scales(dev, static_cast<size_t>(ScaleBytes(format, f)), 0xEE, misaligned);
  Buffer<float> inv(dev, 1, kSentinel);

  const GradView g{grad.data(), in.grad_type};
  const OptimizerState state{master.data(), m.data(), pass == Pass::kSgd ? nullptr : v.data(), in.moment_type};
  StepOutputs out;
  if (want_outputs) {
    out = StepOutputs{model_values.span(), {tensor_amax.data(), block_amax.span()}, sum.data(), count.data()};
  }
  absl::Status s;
  switch (pass) {
    case Pass::kAdamW:
      s = FusedAdamW(dev, format, model, f, g, state, in.adam, out);
      break;
    case Pass::kAdamWQuantize: {
      const ScaleInputs si{in.scales.tensor_scale, 0.0f, {}, false};
      s = FusedAdamWQuantize(dev, format, model, f, g, state, in.adam, si, out,
                             {data.span(), scales.span(), inv.data()});
      break;
    }
    case Pass::kSgd:
      s = FusedSgd(dev, format, model, f, g, state, in.sgd, out);
      break;
  }
  if (!s.ok()) return s;
  OptimizerResult r;
  r.master = master.Read();
  r.m = m.Read();
  r.v = v.Read();
  r.model = model_values.Read();
  r.amax = {tensor_amax.Read(), block_amax.Read()};
  r.sum = sum.Read();
  r.count = count.Read();
  r.quantized = {data.Read(), scales.Read(), inv.Read()};
  return r;
}

OptimizerInputs MakeOptimizerInputs(const Fragment& f, uint32_t seed, ElementType grad_type,
                                    ElementType moment_type, bool specials) {
  OptimizerInputs in;
  in.grad_type = grad_type;
  in.moment_type = moment_type;
  const auto slice = [&](uint32_t s, bool sp) { return Slice(MakeValues(f.view.rows, f.view.cols, s, sp), f); };
  in.master = slice(seed, false);
  std::vector<float> grad = slice(seed + 1, specials);
  for (float& x : grad) x = x * 1e-3f;
  std::vector<float> m = slice(seed + 2, false), v = slice(seed + 3, false);
  for (float& x : m) x = x * 1e-3f;
  for (float& x : v) x = std::fabs(x) * 1e-6f;
  in.grad = Encode(grad, grad_type);
  in.m = Encode(m, moment_type);
  in.v = Encode(v, moment_type);
  in.adam = AdamWHyper{1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, 7, 0.5f};
  in.sgd = SgdHyper{1e-2f, 0.9f, 1e-4f, static_cast<int64_t>(seed % 2 + 1), 0.5f};
  return in;
}

// ---- The fixture.

class KernelsGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::vector<cuda::DeviceInfo>> devices = cuda::ListDevices();
    ASSERT_THAT(devices, IsOk());
    if (devices->empty()) GTEST_SKIP() << "no CUDA device";
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
    gpu_.kind = Device::Kind::kCuda;
    gpu_.stream = stream_;
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // The CPU backend is written alongside this one: while it says UNIMPLEMENTED, skip.
  template <typename T>
  bool CpuReady(const absl::StatusOr<T>& result) {
    if (absl::IsUnimplemented(result.status())) {
      [&] { GTEST_SKIP() << "CPU backend not implemented yet: " << result.status(); }();
      return false;
    }
    EXPECT_THAT(result, IsOk());
    return result.ok();
  }

  void CompareQuantizePath(Format format, Format model, const Shape& shape, bool specials, uint32_t seed);
  void CompareOptimizer(Pass pass, Format format, Format model, const Shape& shape, const OptimizerInputs& in);

  Device cpu_;
  Device gpu_;
  cudaStream_t stream_ = nullptr;
};

void KernelsGpuTest::CompareQuantizePath(Format format, Format model, const Shape& shape, bool specials,
                                         uint32_t seed) {
  const Fragment f = shape.fragment();
  const std::vector<float> master = Slice(MakeValues(shape.rows, shape.cols, seed, specials), f);
  absl::StatusOr<AmaxResult> cpu_amax = RunAmax(cpu_, format, model, f, master, false);
  if (!CpuReady(cpu_amax)) return;
  absl::StatusOr<AmaxResult> gpu_amax = RunAmax(gpu_, format, model, f, master, shape.misaligned);
  ASSERT_THAT(gpu_amax, IsOk());
  ExpectSame(cpu_amax->tensor, gpu_amax->tensor, "tensor amax");
  ExpectSame(cpu_amax->blocks, gpu_amax->blocks, "block amax");

  HostScales hs;
  hs.tensor_scale = std::vector<float>{1.0f, 0.37f, 300.0f}[seed % 3];
  hs.tensor_amax = cpu_amax->tensor[0];
  hs.block_amax = cpu_amax->blocks;
  hs.pow2 = seed % 2 == 1;
  absl::StatusOr<QuantizeResult> cpu_q = RunQuantize(cpu_, format, model, f, master, hs, false);
  if (!CpuReady(cpu_q)) return;
  absl::StatusOr<QuantizeResult> gpu_q = RunQuantize(gpu_, format, model, f, master, hs, shape.misaligned);
  ASSERT_THAT(gpu_q, IsOk());
  ExpectSame(cpu_q->data, gpu_q->data, "quantized data");
  ExpectSame(cpu_q->scales, gpu_q->scales, "block scales");
  EXPECT_EQ(FloatBits(cpu_q->scale_inv[0]), FloatBits(gpu_q->scale_inv[0]))
      << "tensor scale_inv: cpu " << Show(cpu_q->scale_inv[0]) << " gpu " << Show(gpu_q->scale_inv[0]);

  absl::StatusOr<std::vector<float>> cpu_d = RunDequantize(cpu_, format, f, *cpu_q, false);
  if (!CpuReady(cpu_d)) return;
  absl::StatusOr<std::vector<float>> gpu_d = RunDequantize(gpu_, format, f, *cpu_q, shape.misaligned);
  ASSERT_THAT(gpu_d, IsOk());
  ExpectSame(*cpu_d, *gpu_d, "dequantized");
}

TEST_F(KernelsGpuTest, AmaxQuantizeDequantizeMatchCpuForEveryFormatAndFragment) {
  uint32_t seed = 1;
  for (const FormatDescriptor& d : AllFormats()) {
    for (const Shape& shape : kShapes) {
      if (!Supports(d.format, shape)) continue;
      for (bool specials : {false, true}) {
        const Format model = seed % 2 == 0 ? Format::kBF16 : Format::kFP16;
        SCOPED_TRACE(absl::StrCat(d.name, " ", shape.name, specials ? " specials" : "", " model ", FormatName(model)));
        CompareQuantizePath(d.format, model, shape, specials, seed++);
        if (IsSkipped() || HasFatalFailure()) return;
      }
    }
  }
}

void KernelsGpuTest::CompareOptimizer(Pass pass, Format format, Format model, const Shape& shape,
                                      const OptimizerInputs& in) {
  const Fragment f = shape.fragment();
  absl::StatusOr<OptimizerResult> cpu = RunOptimizer(cpu_, pass, format, model, f, in, false);
  if (!CpuReady(cpu)) return;
  absl::StatusOr<OptimizerResult> gpu = RunOptimizer(gpu_, pass, format, model, f, in, shape.misaligned);
  ASSERT_THAT(gpu, IsOk());
  ExpectSame(cpu->master, gpu->master, "master");
  ExpectSameMoments(cpu->m, gpu->m, in.moment_type, "m");
  if (pass != Pass::kSgd) ExpectSameMoments(cpu->v, gpu->v, in.moment_type, "v");
  ExpectSame(cpu->model, gpu->model, "model values");
  ExpectSame(cpu->amax.tensor, gpu->amax.tensor, "tensor amax");
  ExpectSame(cpu->amax.blocks, gpu->amax.blocks, "block amax");
  ExpectSameSum(cpu->sum[0], gpu->sum[0], "grad sum of squares");
  EXPECT_EQ(cpu->count[0], gpu->count[0]) << "non-finite count";
  if (pass == Pass::kAdamWQuantize) {
    ExpectSame(cpu->quantized.data, gpu->quantized.data, "quantized data");
    ExpectSame(cpu->quantized.scales, gpu->quantized.scales, "block scales");
    EXPECT_EQ(FloatBits(cpu->quantized.scale_inv[0]), FloatBits(gpu->quantized.scale_inv[0])) << "scale_inv";
  }
  // The same pass with no optional outputs updates the state identically.
  absl::StatusOr<OptimizerResult> bare = RunOptimizer(gpu_, pass, format, model, f, in, shape.misaligned, false);
  ASSERT_THAT(bare, IsOk());
  ExpectSame(gpu->master, bare->master, "master without optional outputs");
}

// Formats whose amax outputs take each visitor: none, per tensor, 1x32, 128x128, 16x16.
const Format kAmaxShapes[] = {Format::kBF16, Format::kFP8E4M3Current, Format::kMXFP8, Format::kFP8Block,
                              Format::kNVFP4};

TEST_F(KernelsGpuTest, FusedAdamWAndSgdMatchCpu) {
  uint32_t seed = 100;
  for (Format format : kAmaxShapes) {
    for (const Shape& shape : kShapes) {
      if (!Supports(format, shape)) continue;
      const ElementType grad_type = std::vector<ElementType>{ElementType::kFloat32, ElementType::kBFloat16,
                                                             ElementType::kFloat16}[seed % 3];
      const ElementType moment_type = seed % 2 == 0 ? ElementType::kFloat32 : ElementType::kBFloat16;
      const bool specials = seed % 4 == 3;
      const Format model = seed % 5 == 4 ? Format::kFP16 : Format::kBF16;
      const OptimizerInputs in = MakeOptimizerInputs(shape.fragment(), seed++, grad_type, moment_type, specials);
      for (Pass pass : {Pass::kAdamW, Pass::kSgd}) {
        SCOPED_TRACE(absl::StrCat(pass == Pass::kSgd ? "sgd " : "adamw ", FormatName(format), " ", shape.name,
                                  " grad ", ElementTypeName(grad_type), " moments ", ElementTypeName(moment_type),
                                  specials ? " specials" : ""));
        CompareOptimizer(pass, format, model, shape, in);
        if (IsSkipped() || HasFatalFailure()) return;
      }
    }
  }
}

TEST_F(KernelsGpuTest, FusedAdamWQuantizeMatchesCpu) {
  uint32_t seed = 300;
  for (Format format : {Format::kBF16, Format::kFP16, Format::kFP8E4M3Delayed, Format::kFP8E5M2Delayed,
                        Format::kMXFP8}) {
    for (const Shape& shape : kShapes) {
      if (!Supports(format, shape)) continue;
      const ElementType grad_type = seed % 2 == 0 ? ElementType::kBFloat16 : ElementType::kFloat32;
      OptimizerInputs in = MakeOptimizerInputs(shape.fragment(), seed, grad_type, ElementType::kFloat32, seed % 3 == 2);
      in.scales.tensor_scale = std::vector<float>{1.0f, 250.0f, 3.0e4f}[seed % 3];
      ++seed;
      SCOPED_TRACE(absl::StrCat(FormatName(format), " ", shape.name));
      CompareOptimizer(Pass::kAdamWQuantize, format, Format::kBF16, shape, in);
      if (IsSkipped() || HasFatalFailure()) return;
    }
  }
}

TEST_F(KernelsGpuTest, GradStatsMatchCpuAndRepeatBitForBit) {
  const int64_t n = (1 << 21) + 3;
  uint32_t seed = 500;
  for (ElementType type : {ElementType::kFloat32, ElementType::kBFloat16, ElementType::kFloat16}) {
    for (bool specials : {false, true}) {
      SCOPED_TRACE(absl::StrCat(ElementTypeName(type), specials ? " specials" : ""));
      std::vector<float> values = MakeValues(1, n, seed++, specials);
      for (float& x : values) x *= 1e-2f;
      const std::vector<uint8_t> bytes = Encode(values, type);
      const auto run = [&](const Device& dev, bool misaligned) -> absl::StatusOr<std::pair<double, int64_t>> {
        Buffer<uint8_t> grad(dev, bytes, misaligned ? (type == ElementType::kFloat32 ? 4 : 2) : 0);
        Buffer<double> sum(dev, 1, -1.0);
        Buffer<int64_t> count(dev, 1, -1);
        absl::Status s = GradStats(dev, {grad.data(), type}, n, 0.75f, sum.data(), count.data());
        if (!s.ok()) return s;
        return std::make_pair(sum.Read()[0], count.Read()[0]);
      };
      absl::StatusOr<std::pair<double, int64_t>> gpu = run(gpu_, false);
      ASSERT_THAT(gpu, IsOk());
      absl::StatusOr<std::pair<double, int64_t>> again = run(gpu_, true);
      ASSERT_THAT(again, IsOk());
      EXPECT_TRUE(Same(gpu->first, again->first)) << gpu->first << " vs " << again->first;
      EXPECT_EQ(gpu->second, again->second);
      absl::StatusOr<std::pair<double, int64_t>> cpu = run(cpu_, false);
      if (!CpuReady(cpu)) return;
      ExpectSameSum(cpu->first, gpu->first, "sum of squares");
      EXPECT_EQ(cpu->second, gpu->second) << "non-finite count";
    }
  }
}

// ---- Checks that need no CPU backend.

// Whole-tensor amax and quantize, element by element, from the shared scalar functions.
QuantizeResult ReferenceQuantize(Format format, Format model, Matrix2D view, const std::vector<float>& master,
                                 const HostScales& hs, AmaxResult* amax) {
  const FormatDescriptor& d = Describe(format);
  const Matrix2D grid = ScaleGrid(format, view);
  const int64_t n = view.numel();
  std::vector<float> x(static_cast<size_t>(n));
  float tensor_amax = 0.0f;
  std::vector<float> block_amax(static_cast<size_t>(grid.numel()), 0.0f);
  const auto block_of = [&](int64_t i) {
    return (i / view.cols / d.block_rows) * grid.cols + (i % view.cols) / d.block_cols;
  };
  for (int64_t i = 0; i < n; ++i) {
    x[i] = ModelBitsToFloat(ToModelBits(master[i], model), model);
    tensor_amax = AmaxUpdate(tensor_amax, x[i]);
    if (d.has_block_scales()) block_amax[block_of(i)] = AmaxUpdate(block_amax[block_of(i)], x[i]);
  }
  *amax = {{tensor_amax}, block_amax};

  QuantizeResult q{std::vector<uint8_t>(static_cast<size_t>(DataBytes(format, n)), 0),
                   std::vector<uint8_t>(static_cast<size_t>(grid.numel() * (d.has_block_scales() ? BitsOf(d.block_scale) / 8 : 0))),
                   {kSentinel}};
  const bool e5m2 = d.element == ElementType::kE5M2;
  float scale = hs.tensor_scale;
  if (d.scaling == ScalingMode::kCurrent) scale = CurrentScalingScale(tensor_amax, e5m2 ? kE5M2Max : kE4M3Max, hs.pow2);
  if (d.tensor_scale) q.scale_inv[0] = ScaleInv(scale);
  const float s_enc = Nvfp4GlobalEncodeScale(tensor_amax), s_dec = ScaleInv(s_enc);
  if (format == Format::kNVFP4) q.scale_inv[0] = s_dec;
  std::vector<float> factor(block_amax.size());
  for (size_t b = 0; b < block_amax.size(); ++b) {
    if (format == Format::kMXFP8) {
      q.scales[b] = MxfpBlockScale(block_amax[b], kE4M3Max);
      factor[b] = MxfpMultiplier(q.scales[b]);
    } else if (format == Format::kFP8Block) {
      factor[b] = CurrentScalingScale(block_amax[b], kE4M3Max, true);
      const float inv = ScaleInv(factor[b]);
      std::memcpy(&q.scales[4 * b], &inv, 4);
    } else if (format == Format::kNVFP4) {
      q.scales[b] = Nvfp4TileScaleE4M3(block_amax[b], s_enc);
      factor[b] = Nvfp4TileEncode(q.scales[b], s_dec);
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    if (d.bits_per_element == 16) {
      const uint16_t bits = ToModelBits(x[i], format);
      q.data[2 * i] = static_cast<uint8_t>(bits & 0xFF);
      q.data[2 * i + 1] = static_cast<uint8_t>(bits >> 8);
    } else if (format == Format::kNVFP4) {
      q.data[i / 2] |= static_cast<uint8_t>(FloatToE2M1(x[i] * factor[block_of(i)]) << (4 * (i % 2)));
    } else {
      const float y = x[i] * (d.has_block_scales() ? factor[block_of(i)] : scale);
      q.data[i] = e5m2 ? FloatToE5M2(y) : FloatToE4M3(y);
    }
  }
  return q;
}

TEST_F(KernelsGpuTest, WholeTensorMatchesScalarReference) {
  uint32_t seed = 700;
  for (const FormatDescriptor& d : AllFormats()) {
    for (const Shape& shape : kShapes) {
      if (!Supports(d.format, shape)) continue;
      const bool specials = seed % 2 == 1;
      const Format model = seed % 3 == 0 ? Format::kFP16 : Format::kBF16;
      SCOPED_TRACE(absl::StrCat(d.name, " ", shape.rows, "x", shape.cols, specials ? " specials" : ""));
      const Matrix2D view{shape.rows, shape.cols};
      const Fragment whole{view, {0, view.numel()}};
      const std::vector<float> master = MakeValues(shape.rows, shape.cols, seed++, specials);
      HostScales hs;
      hs.tensor_scale = 0.37f;
      hs.pow2 = seed % 2 == 0;
      AmaxResult want_amax;
      const QuantizeResult want = ReferenceQuantize(d.format, model, view, master, hs, &want_amax);
      absl::StatusOr<AmaxResult> amax = RunAmax(gpu_, d.format, model, whole, master, shape.misaligned);
      ASSERT_THAT(amax, IsOk());
      ExpectSame(want_amax.tensor, amax->tensor, "tensor amax");
      ExpectSame(want_amax.blocks, amax->blocks, "block amax");
      hs.tensor_amax = want_amax.tensor[0];
      hs.block_amax = want_amax.blocks;
      absl::StatusOr<QuantizeResult> got = RunQuantize(gpu_, d.format, model, whole, master, hs, shape.misaligned);
      ASSERT_THAT(got, IsOk());
      ExpectSame(want.data, got->data, "data");
      ExpectSame(want.scales, got->scales, "block scales");
      EXPECT_EQ(FloatBits(want.scale_inv[0]), FloatBits(got->scale_inv[0])) << "scale_inv";
      if (HasFatalFailure()) return;
    }
  }
}

// Quantizing fragments with MAX-reduced amaxes gives the whole tensor's bytes (kernels.h).
TEST_F(KernelsGpuTest, FragmentsWithReducedAmaxQuantizeLikeTheWholeTensor) {
  const Matrix2D view{288, 384};
  const std::vector<int64_t> cuts = {0, 64 * 37, 64 * 700, 64 * 701, 64 * 1500, view.numel()};
  for (Format format : {Format::kMXFP8, Format::kFP8Block, Format::kNVFP4, Format::kFP8E5M2Current}) {
    SCOPED_TRACE(FormatName(format));
    const std::vector<float> master = MakeValues(view.rows, view.cols, 900, true);
    const Fragment whole{view, {0, view.numel()}};
    absl::StatusOr<AmaxResult> whole_amax = RunAmax(gpu_, format, Format::kBF16, whole, master, false);
    ASSERT_THAT(whole_amax, IsOk());
    HostScales hs{1.0f, whole_amax->tensor[0], whole_amax->blocks, false};
    absl::StatusOr<QuantizeResult> want = RunQuantize(gpu_, format, Format::kBF16, whole, master, hs, false);
    ASSERT_THAT(want, IsOk());

    AmaxResult reduced{{0.0f}, std::vector<float>(whole_amax->blocks.size(), 0.0f)};
    for (size_t k = 0; k + 1 < cuts.size(); ++k) {
      const Fragment f{view, {cuts[k], cuts[k + 1]}};
      absl::StatusOr<AmaxResult> a = RunAmax(gpu_, format, Format::kBF16, f, Slice(master, f), k % 2 == 1);
      ASSERT_THAT(a, IsOk());
      reduced.tensor[0] = std::max(reduced.tensor[0], a->tensor[0]);
      const int64_t first = ScaleBlockRange(format, view, f.elements).begin;
      for (size_t i = 0; i < a->blocks.size(); ++i) {
        reduced.blocks[first + i] = std::max(reduced.blocks[first + i], a->blocks[i]);
      }
    }
    ExpectSame(whole_amax->tensor, reduced.tensor, "reduced tensor amax");
    ExpectSame(whole_amax->blocks, reduced.blocks, "reduced block amax");

    std::vector<uint8_t> data;
    for (size_t k = 0; k + 1 < cuts.size(); ++k) {
      const Fragment f{view, {cuts[k], cuts[k + 1]}};
      const IndexRange range = ScaleBlockRange(format, view, f.elements);
      HostScales fs{1.0f, reduced.tensor[0], {}, false};
      fs.block_amax.assign(reduced.blocks.begin() + range.begin, reduced.blocks.begin() + range.end);
      absl::StatusOr<QuantizeResult> got = RunQuantize(gpu_, format, Format::kBF16, f, Slice(master, f), fs, k % 2 == 0);
      ASSERT_THAT(got, IsOk());
      data.insert(data.end(), got->data.begin(), got->data.end());
      const int64_t entry = Describe(format).has_block_scales() ? BitsOf(Describe(format).block_scale) / 8 : 0;
      ExpectSame(std::vector<uint8_t>(want->scales.begin() + range.begin * entry,
                                      want->scales.begin() + range.end * entry),
                 got->scales, absl::StrCat("block scales of fragment ", k));
      EXPECT_EQ(FloatBits(want->scale_inv[0]), FloatBits(got->scale_inv[0]));
    }
    ExpectSame(want->data, data, "concatenated fragment data");
  }
}

// The fused passes agree with the separate kernels and with a per-element loop of
// optimizer_math.h, so the tile-visiting optimizer kernels are checked without the CPU.
TEST_F(KernelsGpuTest, FusedPassesAgreeWithSeparateKernelsAndElementLoop) {
  for (const Shape& shape : kShapes) {
    for (Format format : {Format::kNVFP4, Format::kMXFP8, Format::kFP8Block}) {
      if (!Supports(format, shape)) continue;
      SCOPED_TRACE(absl::StrCat(FormatName(format), " ", shape.name));
      const Fragment f = shape.fragment();
      const OptimizerInputs in = MakeOptimizerInputs(f, 1000, ElementType::kFloat32, ElementType::kFloat32, true);
      const Pass pass = format == Format::kMXFP8 ? Pass::kAdamWQuantize : Pass::kAdamW;
      absl::StatusOr<OptimizerResult> got = RunOptimizer(gpu_, pass, format, Format::kBF16, f, in, shape.misaligned);
      ASSERT_THAT(got, IsOk());

      std::vector<float> master = in.master;
      const AdamWConstants c = MakeAdamWConstants(in.adam);
      std::vector<uint16_t> model(master.size());
      for (size_t i = 0; i < master.size(); ++i) {
        float g, m, v;
        std::memcpy(&g, &in.grad[4 * i], 4);
        std::memcpy(&m, &in.m[4 * i], 4);
        std::memcpy(&v, &in.v[4 * i], 4);
        AdamWElement(in.adam, c, g * in.adam.grad_multiplier, master[i], m, v);
        model[i] = ToModelBits(master[i], Format::kBF16);
      }
      ExpectSame(master, got->master, "master vs element loop");
      ExpectSame(model, got->model, "model values vs element loop");

      absl::StatusOr<AmaxResult> amax = RunAmax(gpu_, format, Format::kBF16, f, got->master, false);
      ASSERT_THAT(amax, IsOk());
      ExpectSame(amax->tensor, got->amax.tensor, "pass tensor amax vs ComputePartialAmax");
      ExpectSame(amax->blocks, got->amax.blocks, "pass block amax vs ComputePartialAmax");
      if (pass == Pass::kAdamWQuantize) {
        HostScales hs{1.0f, amax->tensor[0], amax->blocks, false};
        absl::StatusOr<QuantizeResult> q = RunQuantize(gpu_, format, Format::kBF16, f, got->master, hs, false);
        ASSERT_THAT(q, IsOk());
        ExpectSame(q->data, got->quantized.data, "in-pass mxfp8 data vs Quantize");
        ExpectSame(q->scales, got->quantized.scales, "in-pass mxfp8 scales vs Quantize");
      }
      if (HasFatalFailure()) return;
    }
  }
}

// The FP8 cast on the device (the hardware instruction from sm_89) equals casts.h on every
// bf16 value times scales that put results on ties, subnormals and the saturation edge.
TEST_F(KernelsGpuTest, DeviceFp8CastEqualsSharedCastOnEveryBf16Value) {
  std::vector<float> master(65536);
  for (uint32_t b = 0; b < 65536; ++b) master[b] = Bf16ToFloat(static_cast<uint16_t>(b));
  const Fragment f{{256, 256}, {0, 65536}};
  for (Format format : {Format::kFP8E4M3Delayed, Format::kFP8E5M2Delayed}) {
    for (float scale : {1.0f, 0.75f, 1.0f / 3.0f, 1.3f, 3.0e-3f, 1.7e5f, 2.0f - 1.0f / 64.0f, 1e-30f}) {
      SCOPED_TRACE(absl::StrCat(FormatName(format), " scale ", scale));
      absl::StatusOr<QuantizeResult> q = RunQuantize(gpu_, format, Format::kBF16, f, master, {scale, 0.0f, {}, false},
                                                     false);
      ASSERT_THAT(q, IsOk());
      std::vector<uint8_t> want(master.size());
      for (size_t i = 0; i < master.size(); ++i) {
        const float y = master[i] * scale;
        want[i] = format == Format::kFP8E5M2Delayed ? FloatToE5M2(y) : FloatToE4M3(y);
      }
      ExpectSame(want, q->data, "fp8 bytes");
    }
  }
}

// The 16-bit casts on the device (the branch-free forms of kernels/cpu/vector_casts.h) equal
// casts.h on FP32 patterns of every exponent: subnormals, the fp16 overflow edge, ties, NaNs,
// infinities, for each model dtype and 16-bit format, also from misaligned buffers.
TEST_F(KernelsGpuTest, Device16BitCastsEqualSharedCastsOnEveryExponent) {
  std::mt19937 rng(20);
  std::vector<float> master;
  for (uint32_t e = 0; e < 512; ++e) {  // sign and exponent
    for (uint32_t m : {0u, 1u, 0x1000u, 0x7FFFu, 0x8000u, 0x18000u, 0xFFFu, 0x1FFFu, 0x7FFFFFu}) {
      master.push_back(BitsFloat((e << 23) | m));
    }
    for (int k = 0; k < 64; ++k) master.push_back(BitsFloat((e << 23) | (rng() & 0x7FFFFFu)));
  }
  const int64_t n = static_cast<int64_t>(master.size()) / 64 * 64;
  master.resize(static_cast<size_t>(n));
  const Fragment f{{n / 64, 64}, {0, n}};
  for (Format model : {Format::kBF16, Format::kFP16}) {
    for (Format format : {Format::kBF16, Format::kFP16}) {
      for (bool misaligned : {false, true}) {
        SCOPED_TRACE(
            absl::StrCat(FormatName(format), " from model ", FormatName(model), misaligned ? " misaligned" : ""));
        absl::StatusOr<QuantizeResult> q =
            RunQuantize(gpu_, format, model, f, master, {1.0f, 0.0f, {}, false}, misaligned);
        ASSERT_THAT(q, IsOk());
        std::vector<uint8_t> want(static_cast<size_t>(2 * n));
        for (int64_t i = 0; i < n; ++i) {
          const float x = ModelBitsToFloat(ToModelBits(master[i], model), model);
          const uint16_t b = ToModelBits(x, format);
          want[2 * i] = static_cast<uint8_t>(b & 0xFF);
          want[2 * i + 1] = static_cast<uint8_t>(b >> 8);
        }
        ExpectSame(want, q->data, "16-bit bytes");
      }
    }
  }
}

// Calls from two host threads on one stream share its workspace (stream_call.h): each call's
// kernels are enqueued together, so no call reads the block factors another call wrote there.
TEST_F(KernelsGpuTest, CallsFromTwoThreadsOnOneStreamKeepTheirScratchApart) {
  const Fragment f{{256, 256}, {0, 65536}};
  for (Format format : {Format::kMXFP8, Format::kNVFP4, Format::kFP8Block}) {
    SCOPED_TRACE(FormatName(format));
    std::vector<float> master[2];
    HostScales hs[2];
    QuantizeResult want[2];
    for (int t = 0; t < 2; ++t) {
      master[t] = MakeValues(256, 256, 40 + t, false);
      absl::StatusOr<AmaxResult> amax = RunAmax(cpu_, format, Format::kBF16, f, master[t], false);
      ASSERT_THAT(amax, IsOk());
      hs[t].tensor_amax = amax->tensor[0];
      hs[t].block_amax = amax->blocks;
      absl::StatusOr<QuantizeResult> q = RunQuantize(cpu_, format, Format::kBF16, f, master[t], hs[t], false);
      ASSERT_THAT(q, IsOk());
      want[t] = *std::move(q);
    }
    std::atomic<int> wrong{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 2; ++t) {
      threads.emplace_back([&, t] {
        for (int rep = 0; rep < 20; ++rep) {
          absl::StatusOr<QuantizeResult> got = RunQuantize(gpu_, format, Format::kBF16, f, master[t], hs[t], false);
          if (!got.ok() || got->data != want[t].data || got->scales != want[t].scales) ++wrong;
        }
      });
    }
    for (std::thread& th : threads) th.join();
    EXPECT_EQ(wrong.load(), 0) << "of 40 quantizations from two threads on one stream";
  }
}

// Quantizes from an unmapped address on `stream`, then prints the status of the call (or of
// Synchronize after it) and exits 0 when it failed.
[[noreturn]] void QuantizeFromUnmappedMemory(cudaStream_t stream) {
  Device gpu;
  gpu.kind = Device::Kind::kCuda;
  gpu.stream = stream;
  const Fragment f{{256, 256}, {0, 65536}};
  const auto* unmapped = reinterpret_cast<const float*>(uintptr_t{0x1000});
  uint8_t* data = nullptr;
  float* scale_inv = nullptr;
  if (cudaMalloc(&data, 65536) != cudaSuccess || cudaMalloc(&scale_inv, sizeof(float)) != cudaSuccess) std::exit(3);
  const ScaleInputs scales{1.0f, 0.0f, {}, false};
  const QuantizedOutputs out{{data, 65536}, {}, scale_inv};
  absl::Status s = Quantize(gpu, Format::kFP8E4M3Delayed, Format::kBF16, f, {unmapped, 65536}, scales, out);
  if (s.ok()) s = Synchronize(gpu);
  std::fprintf(stderr, "status: %s\n", s.ToString().c_str());
  std::exit(s.ok() ? 1 : 0);
}

// A kernel that faults is reported, at Synchronize, with the kernels.h call and the kernel.
// In a child process: the fault spoils the CUDA context of the process it happens in.
TEST_F(KernelsGpuTest, KernelFaultNamesTheCallAndTheKernel) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(QuantizeFromUnmappedMemory(stream_), ::testing::ExitedWithCode(0),
              "status: INTERNAL.*Quantize .*FlatKernel<Quantize>");
}

}  // namespace
}  // namespace mainstay::kernels
