// Private to kernels/cuda: launch geometry, vector load/store helpers and the two ways the
// CUDA kernels walk a fragment, shared by quantize.cu and optimizer.cu.
//
//   FlatKernel: grid-stride over runs of 4 consecutive fragment elements (float4 loads when
//     the run and every pointer are aligned). Used when no per-block amax is produced.
//   TileKernel: one thread group per block of the fragment's block range (8 lanes per 1x32
//     mxfp8 block, a warp per 16x16 nvfp4 tile, a CTA per 128x128 fp8_block tile). Each group
//     visits the block's elements that lie in the fragment, reduces the block amax in
//     registers/shared memory and writes it once: no atomics, and blocks of the range that
//     the fragment does not touch get 0.
// Both call an element operation `op(j, cnt, vec, x, acc)` on local elements [j, j + cnt)
// (cnt in 1..4, `vec`: j % 4 == 0 and cnt == 4), which reads/writes its own arrays and
// returns the model-dtype values in x[] (for amax) and gradient stats in `acc`.
// Per-CTA results: tensor amax via one atomicMax on the FP32 bits (amaxes are >= +0, so the
// unsigned order is the float order), gradient sums as one partial per CTA (fixed order).
// Grid sizes depend only on the element / block count, so sums are deterministic.
//
// Thread safety: stateless device code.
#ifndef MAINSTAY_KERNELS_CUDA_FRAGMENT_VISIT_CUH_
#define MAINSTAY_KERNELS_CUDA_FRAGMENT_VISIT_CUH_

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/format.h"
#include "common/status.h"
#include "kernels/casts.h"
#include "kernels/cpu/vector_casts.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/stream_call.h"
#include "kernels/kernels.h"
#include "kernels/optimizer_math.h"
#include "kernels/scaling.h"

namespace mainstay::kernels::cuda {

inline constexpr int kThreads = 256;
// 2048 CTAs of 256 threads fill an H200 (132 SMs x 2048 threads) about twice over; a fixed
// cap (never the device's SM count) keeps per-CTA partial sums independent of the device.
inline constexpr int64_t kMaxGrid = 2048;

inline int GridFor(int64_t items, int64_t items_per_cta) {
  const int64_t g = (items + items_per_cta - 1) / items_per_cta;
  return static_cast<int>(g < 1 ? 1 : (g > kMaxGrid ? kMaxGrid : g));
}

// The call's stream, with its device made current on the calling thread (a launch on another
// device's stream fails; the daemon's step threads never chose a device themselves).
inline cudaStream_t StreamOf(const Device& device) {
  if (device.ordinal >= 0) (void)cudaSetDevice(device.ordinal);  // a bad one fails the launch that follows
  return static_cast<cudaStream_t>(device.stream);
}

inline bool Aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// ---- Index math.

// floor(a / b) for 0 <= a < 2^52, b >= 1, from a precomputed 1/b: the double estimate is off
// by at most one, which the remainder check corrects. Much cheaper than a 64-bit division.
__device__ __forceinline__ int64_t DivFloor(int64_t a, int64_t b, double inv_b, int64_t& rem) {
  int64_t q = static_cast<int64_t>(static_cast<double>(a) * inv_b);
  int64_t r = a - q * b;
  if (r < 0) {
    --q;
    r += b;
  } else if (r >= b) {
    ++q;
    r -= b;
  }
  rem = r;
  return q;
}

inline int Log2Exact(int v) {
  int s = 0;
  while ((1 << s) < v) ++s;
  return s;
}

// Maps a flattened element to its local block index (kernels.h): global block =
// (r / br) * ceil(cols / bc) + c / bc; local = global - ScaleBlockRange(...).begin.
// Block sides are powers of two (1, 16, 32, 128).
struct BlockGeometry {
  int64_t cols = 1;
  int64_t begin = 0;  // the fragment's first flattened element
  int64_t tile_cols = 1;
  int64_t range_begin = 0;
  double inv_cols = 1.0;
  int log2_rows = 0;
  int log2_cols = 0;

  // Row and column of local element j.
  __device__ __forceinline__ void RowCol(int64_t j, int64_t& r, int64_t& c) const {
    r = DivFloor(begin + j, cols, inv_cols, c);
  }
  __device__ __forceinline__ int64_t LocalBlock(int64_t r, int64_t c) const {
    return (r >> log2_rows) * tile_cols + (c >> log2_cols) - range_begin;
  }
  // Local block of the elements j .. j + 3 (those past the fragment are ignored by callers).
  __device__ __forceinline__ void LocalBlocks4(int64_t j, int64_t (&lb)[4]) const {
    int64_t r, c;
    RowCol(j, r, c);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      lb[k] = LocalBlock(r, c);
      if (++c == cols) {
        c = 0;
        ++r;
      }
    }
  }
};

inline BlockGeometry MakeBlockGeometry(Format format, const Fragment& f) {
  const FormatDescriptor& d = Describe(format);
  BlockGeometry g;
  g.cols = f.view.cols;
  g.begin = f.elements.begin;
  g.inv_cols = 1.0 / static_cast<double>(f.view.cols);
  if (d.has_block_scales()) {
    g.tile_cols = (f.view.cols + d.block_cols - 1) / d.block_cols;
    g.range_begin = ScaleBlockRange(format, f.view, f.elements).begin;
    g.log2_rows = Log2Exact(d.block_rows);
    g.log2_cols = Log2Exact(d.block_cols);
  }
  return g;
}

// What a TileKernel needs to enumerate the blocks of a fragment's block range.
struct TileGeometry {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t begin = 0;
  int64_t end = 0;
  int64_t tile_cols = 1;
  double inv_tile_cols = 1.0;
  int64_t range_begin = 0;
  int64_t nblocks = 0;
};

inline TileGeometry MakeTileGeometry(Format format, const Fragment& f) {
  const FormatDescriptor& d = Describe(format);
  const IndexRange range = ScaleBlockRange(format, f.view, f.elements);
  TileGeometry t;
  t.rows = f.view.rows;
  t.cols = f.view.cols;
  t.begin = f.elements.begin;
  t.end = f.elements.end;
  t.tile_cols = (f.view.cols + d.block_cols - 1) / d.block_cols;
  t.inv_tile_cols = 1.0 / static_cast<double>(t.tile_cols);
  t.range_begin = range.begin;
  t.nblocks = range.size();
  return t;
}

// ---- Loads and stores of runs of up to 4 elements. `vec` promises j % 4 == 0, cnt == 4 and
// an aligned base; otherwise element accesses. Entries past cnt read as 0.

__device__ __forceinline__ void LoadF32x4(const float* p, int64_t j, int cnt, bool vec, float (&v)[4]) {
  if (vec) {
    const float4 t = *reinterpret_cast<const float4*>(p + j);
    v[0] = t.x;
    v[1] = t.y;
    v[2] = t.z;
    v[3] = t.w;
    return;
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) v[k] = k < cnt ? p[j + k] : 0.0f;
}

__device__ __forceinline__ void StoreF32x4(float* p, int64_t j, int cnt, bool vec, const float (&v)[4]) {
  if (vec) {
    *reinterpret_cast<float4*>(p + j) = make_float4(v[0], v[1], v[2], v[3]);
    return;
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (k < cnt) p[j + k] = v[k];
  }
}

// vec needs 8-byte alignment of p.
__device__ __forceinline__ void LoadU16x4(const uint16_t* p, int64_t j, int cnt, bool vec, uint16_t (&v)[4]) {
  if (vec) {
    const uint2 t = *reinterpret_cast<const uint2*>(p + j);
    v[0] = static_cast<uint16_t>(t.x & 0xFFFFu);
    v[1] = static_cast<uint16_t>(t.x >> 16);
    v[2] = static_cast<uint16_t>(t.y & 0xFFFFu);
    v[3] = static_cast<uint16_t>(t.y >> 16);
    return;
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) v[k] = k < cnt ? p[j + k] : uint16_t{0};
}

__device__ __forceinline__ void StoreU16x4(uint16_t* p, int64_t j, int cnt, bool vec, const uint16_t (&v)[4]) {
  if (vec) {
    *reinterpret_cast<uint2*>(p + j) = make_uint2(v[0] | (static_cast<uint32_t>(v[1]) << 16),
                                                  v[2] | (static_cast<uint32_t>(v[3]) << 16));
    return;
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (k < cnt) p[j + k] = v[k];
  }
}

// 16-bit values into a byte array (little-endian), which may have any alignment; vec needs
// 8-byte alignment of p.
__device__ __forceinline__ void StoreU16x4Bytes(uint8_t* p, int64_t j, int cnt, bool vec, const uint16_t (&v)[4]) {
  if (vec) {
    StoreU16x4(reinterpret_cast<uint16_t*>(p), j, cnt, true, v);
    return;
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (k < cnt) {
      p[2 * (j + k)] = static_cast<uint8_t>(v[k] & 0xFF);
      p[2 * (j + k) + 1] = static_cast<uint8_t>(v[k] >> 8);
    }
  }
}

__device__ __forceinline__ void LoadU16x4Bytes(const uint8_t* p, int64_t j, int cnt, bool vec, uint16_t (&v)[4]) {
  if (vec) {
    LoadU16x4(reinterpret_cast<const uint16_t*>(p), j, cnt, true, v);
    return;
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    v[k] = k < cnt ? static_cast<uint16_t>(p[2 * (j + k)] | (p[2 * (j + k) + 1] << 8)) : uint16_t{0};
  }
}

// One byte per element; vec needs 4-byte alignment of p.
__device__ __forceinline__ void StoreU8x4(uint8_t* p, int64_t j, int cnt, bool vec, const uint8_t (&q)[4]) {
  if (vec) {
    *reinterpret_cast<uint32_t*>(p + j) = q[0] | (static_cast<uint32_t>(q[1]) << 8) |
                                          (static_cast<uint32_t>(q[2]) << 16) | (static_cast<uint32_t>(q[3]) << 24);
    return;
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (k < cnt) p[j + k] = q[k];
  }
}

__device__ __forceinline__ void LoadU8x4(const uint8_t* p, int64_t j, int cnt, bool vec, uint8_t (&q)[4]) {
  if (vec) {
    const uint32_t t = *reinterpret_cast<const uint32_t*>(p + j);
#pragma unroll
    for (int k = 0; k < 4; ++k) q[k] = static_cast<uint8_t>(t >> (8 * k));
    return;
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) q[k] = k < cnt ? p[j + k] : uint8_t{0};
}

// Two 4-bit codes per byte, even element in the low nibble; j % 4 == 0 (FlatKernel runs). A
// run ending on an odd count leaves the last high nibble 0. vec needs 2-byte alignment of p.
__device__ __forceinline__ void StoreNibbles4(uint8_t* p, int64_t j, int cnt, bool vec, const uint8_t (&q)[4]) {
  const uint8_t b0 = static_cast<uint8_t>(q[0] | (cnt > 1 ? q[1] << 4 : 0));
  const uint8_t b1 = static_cast<uint8_t>(q[2] | (cnt > 3 ? q[3] << 4 : 0));
  if (vec) {
    *reinterpret_cast<uint16_t*>(p + j / 2) = static_cast<uint16_t>(b0 | (b1 << 8));
    return;
  }
  p[j / 2] = b0;
  if (cnt > 2) p[j / 2 + 1] = b1;
}

// ---- FP8 cast of four values, saturating to finite (FORMATS.md). From sm_89 the hardware
// instruction (what Transformer Engine uses there; casts.h is checked against the same
// conversions); define MAINSTAY_CUDA_SOFTWARE_FP8 to force the shared software cast.
__device__ __forceinline__ void CastFp8x4(const float (&y)[4], bool e5m2, uint8_t (&q)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && !defined(MAINSTAY_CUDA_SOFTWARE_FP8)
  const __nv_fp8_interpretation_t kind = e5m2 ? __NV_E5M2 : __NV_E4M3;
  const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(make_float2(y[0], y[1]), __NV_SATFINITE, kind);
  const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(make_float2(y[2], y[3]), __NV_SATFINITE, kind);
  q[0] = static_cast<uint8_t>(lo & 0xFF);
  q[1] = static_cast<uint8_t>(lo >> 8);
  q[2] = static_cast<uint8_t>(hi & 0xFF);
  q[3] = static_cast<uint8_t>(hi >> 8);
#else
#pragma unroll
  for (int k = 0; k < 4; ++k) q[k] = e5m2 ? cpu::E5M2Bits(y[k]) : cpu::E4M3Bits(y[k]);
#endif
}

// ---- Encoders on the device: the branch-free forms of kernels/cpu/vector_casts.h, equal bit
// for bit to casts.h's (tests/unit/cast_oracle_test.cc checks both against CUDA's conversions on
// every FP32 pattern). casts.h's forms branch on the value's range, so the lanes of a warp
// whose values straddle a boundary (E2M1's subnormals are |y| < 1) would run both paths.

// ToModelBits(x, model_dtype) (bf16 or fp16 bits); model_dtype is the same on every lane.
__device__ __forceinline__ uint16_t DeviceModelBits(float x, Format model_dtype) {
  const uint32_t u = FloatBits(x);
  return model_dtype == Format::kFP16 ? cpu::Fp16Bits(u) : cpu::Bf16Bits(u);
}

// Model-dtype value of a master: float(bf16_rne(master)) or float(fp16(master)).
__device__ __forceinline__ float ModelValue(float master, Format model_dtype) {
  return ModelBitsToFloat(DeviceModelBits(master, model_dtype), model_dtype);
}

// ---- Reductions.

// Gradient statistics of one thread / CTA: sum of squares in FP64 and non-finite count.
struct GradAccum {
  double sum_squares = 0.0;
  long long nonfinite = 0;
  __device__ __forceinline__ void Add(float g) {
    const double d = g;
    sum_squares += d * d;
    nonfinite += IsFinite(g) ? 0 : 1;
  }
};

// Where a CTA puts its results. Every field may be null.
struct ReduceOutputs {
  float* tensor_amax = nullptr;          // atomicMax target, zeroed before the launch
  double* part_sum_squares = nullptr;    // [gridDim.x]
  long long* part_nonfinite = nullptr;   // [gridDim.x]
  float* scalar_out = nullptr;           // written with scalar_value by CTA 0 (a scale_inv)
  float scalar_value = 0.0f;
};

__device__ __forceinline__ float MaxF(float a, float b) { return a > b ? a : b; }

// Reduces over the CTA and writes the CTA's results. Every thread of the CTA must call it.
__device__ __forceinline__ void FinishCta(float amax, const GradAccum& acc, const ReduceOutputs& out) {
  constexpr int kWarps = kThreads / 32;
  __shared__ float s_amax[kWarps];
  __shared__ double s_sum[kWarps];
  __shared__ long long s_count[kWarps];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  double sum = acc.sum_squares;
  long long count = acc.nonfinite;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    amax = MaxF(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
    sum += __shfl_down_sync(0xFFFFFFFFu, sum, off);
    count += __shfl_down_sync(0xFFFFFFFFu, count, off);
  }
  if (lane == 0) {
    s_amax[warp] = amax;
    s_sum[warp] = sum;
    s_count[warp] = count;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float a = s_amax[0];
    double s = s_sum[0];
    long long c = s_count[0];
    for (int w = 1; w < kWarps; ++w) {
      a = MaxF(a, s_amax[w]);
      s += s_sum[w];
      c += s_count[w];
    }
    if (out.tensor_amax != nullptr && a > 0.0f) {
      atomicMax(reinterpret_cast<unsigned int*>(out.tensor_amax), __float_as_uint(a));
    }
    if (out.part_sum_squares != nullptr) out.part_sum_squares[blockIdx.x] = s;
    if (out.part_nonfinite != nullptr) out.part_nonfinite[blockIdx.x] = c;
    if (out.scalar_out != nullptr && blockIdx.x == 0) *out.scalar_out = out.scalar_value;
  }
}

// Max over a group of G consecutive threads (G a power of two up to 32, or the whole CTA).
// Every thread of the warp (G <= 32) or CTA (G == kThreads) must call it.
template <int G>
__device__ __forceinline__ float GroupMax(float v) {
  if constexpr (G <= 32) {
#pragma unroll
    for (int off = G / 2; off > 0; off >>= 1) v = MaxF(v, __shfl_xor_sync(0xFFFFFFFFu, v, off));
    return v;
  } else {
    static_assert(G == kThreads, "a group is at most a warp, or the whole CTA");
    __shared__ float s[kThreads / 32];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = MaxF(v, __shfl_xor_sync(0xFFFFFFFFu, v, off));
    if ((threadIdx.x & 31) == 0) s[threadIdx.x >> 5] = v;
    __syncthreads();
    float a = s[0];
#pragma unroll
    for (int w = 1; w < kThreads / 32; ++w) a = MaxF(a, s[w]);
    __syncthreads();  // s is reused by the next call
    return a;
  }
}

// ---- The two visitors.

template <class Op>
__global__ void __launch_bounds__(kThreads) FlatKernel(Op op, int64_t n, ReduceOutputs red) {
  float amax = 0.0f;
  GradAccum acc;
  const int64_t groups = (n + 3) / 4;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t gi = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; gi < groups; gi += stride) {
    const int64_t j = gi * 4;
    const int cnt = n - j < 4 ? static_cast<int>(n - j) : 4;
    float x[4];
    op(j, cnt, cnt == 4, x, acc);
    if (red.tensor_amax != nullptr) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if (k < cnt) amax = AmaxUpdate(amax, x[k]);
      }
    }
  }
  FinishCta(amax, acc, red);
}

// Optional cast done by a TileKernel once the block amax is known (mxfp8 in FusedAdamWQuantize):
// e = MxfpBlockScale(block amax, 448), q = E4M3(fl(x * MxfpMultiplier(e))).
struct MxfpCast {
  uint8_t* data = nullptr;    // one byte per fragment element
  uint8_t* scales = nullptr;  // one E8M0 per block of the range
  bool data_aligned = false;  // 4-byte aligned
};

// Block shape BR x BC, G threads per block (BC / 4 threads per row, 4 columns each).
template <int BR, int BC, int G>
struct TileShape {
  static constexpr int kLanesPerRow = BC / 4;
  static constexpr int kRowsPerStep = G / kLanesPerRow;
  static constexpr int kSteps = (BR + kRowsPerStep - 1) / kRowsPerStep;
  static constexpr int kGroupsPerCta = kThreads / G;
  static_assert(G % kLanesPerRow == 0 && kThreads % G == 0, "bad tile shape");
};

template <int BR, int BC, int G>
int TileGrid(int64_t nblocks) {
  return GridFor(nblocks, TileShape<BR, BC, G>::kGroupsPerCta);
}

template <int BR, int BC, int G, bool kCast, class Op>
__global__ void __launch_bounds__(kThreads)
    TileKernel(Op op, TileGeometry t, float* block_amax, ReduceOutputs red, MxfpCast cast) {
  using S = TileShape<BR, BC, G>;
  static_assert(!kCast || S::kSteps == 1, "the in-pass cast keeps one run per thread");
  const int lane = threadIdx.x % G;
  const int row_in_step = lane / S::kLanesPerRow;
  const int col_off = (lane % S::kLanesPerRow) * 4;
  const int64_t my_group = static_cast<int64_t>(blockIdx.x) * S::kGroupsPerCta + threadIdx.x / G;
  // Groups of one warp (or the CTA) iterate together so the collective reduction is uniform.
  const int64_t first_group = G >= 32 ? my_group : my_group - (threadIdx.x % 32) / G;
  const int64_t total_groups = static_cast<int64_t>(gridDim.x) * S::kGroupsPerCta;
  float tensor_amax = 0.0f;
  GradAccum acc;
  for (int64_t base = first_group; base < t.nblocks; base += total_groups) {
    const int64_t i = base + (my_group - first_group);
    const bool valid = i < t.nblocks;
    float amax = 0.0f;
    float held[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int64_t held_j = 0;
    int held_cnt = 0;
    if (valid) {
      int64_t tc;
      const int64_t tr = DivFloor(t.range_begin + i, t.tile_cols, t.inv_tile_cols, tc);
      const int64_t col = tc * BC + col_off;
      if (col < t.cols) {
        const int64_t ncols = t.cols - col < 4 ? t.cols - col : 4;
#pragma unroll(S::kSteps <= 2 ? S::kSteps : 4)
        for (int step = 0; step < S::kSteps; ++step) {
          const int r_in_tile = step * S::kRowsPerStep + row_in_step;
          const int64_t row = tr * BR + r_in_tile;
          if (r_in_tile < BR && row < t.rows) {
            const int64_t flat = row * t.cols + col;
            const int64_t lo = flat > t.begin ? flat : t.begin;
            const int64_t hi = flat + ncols < t.end ? flat + ncols : t.end;
            if (lo < hi) {
              const int64_t j = lo - t.begin;
              const int cnt = static_cast<int>(hi - lo);
              float x[4];
              op(j, cnt, cnt == 4 && (j & 3) == 0, x, acc);
#pragma unroll
              for (int k = 0; k < 4; ++k) {
                if (k < cnt) amax = AmaxUpdate(amax, x[k]);
              }
              if constexpr (kCast) {
#pragma unroll
                for (int k = 0; k < 4; ++k) held[k] = x[k];
                held_j = j;
                held_cnt = cnt;
              }
            }
          }
        }
      }
    }
    amax = GroupMax<G>(amax);
    tensor_amax = MaxF(tensor_amax, amax);
    if (valid && lane == 0 && block_amax != nullptr) block_amax[i] = amax;
    if constexpr (kCast) {
      if (valid) {
        const uint8_t e = MxfpBlockScale(amax, kE4M3Max);
        if (lane == 0) cast.scales[i] = e;
        if (held_cnt > 0) {
          const float mult = MxfpMultiplier(e);
          float y[4];
#pragma unroll
          for (int k = 0; k < 4; ++k) y[k] = held[k] * mult;
          uint8_t q[4];
          CastFp8x4(y, /*e5m2=*/false, q);
          const bool vec = held_cnt == 4 && (held_j & 3) == 0 && cast.data_aligned;
          StoreU8x4(cast.data, held_j, held_cnt, vec, q);
        }
      }
    }
  }
  FinishCta(tensor_amax, acc, red);
}

// Launches the TileKernel for `format`'s block shape. `cast` only for mxfp8.
template <bool kCast, class Op>
absl::Status LaunchTiles(Format format, const TileGeometry& t, Op op, float* block_amax, const ReduceOutputs& red,
                         const MxfpCast& cast, StreamCall& call, int* grid_out) {
  const cudaStream_t stream = call.stream();
  const char* kernel = "TileKernel";
  int grid = 1;
  switch (format) {
    case Format::kMXFP8:
      grid = TileGrid<1, 32, 8>(t.nblocks);
      TileKernel<1, 32, 8, kCast, Op><<<grid, kThreads, 0, stream>>>(op, t, block_amax, red, cast);
      kernel = kCast ? "TileKernel<1x32, mxfp8 cast>" : "TileKernel<1x32>";
      break;
    case Format::kNVFP4:
      if constexpr (kCast) {
        return absl::InternalError("the in-pass cast is only for mxfp8");
      } else {
        grid = TileGrid<16, 16, 32>(t.nblocks);
        TileKernel<16, 16, 32, false, Op><<<grid, kThreads, 0, stream>>>(op, t, block_amax, red, cast);
        kernel = "TileKernel<16x16>";
      }
      break;
    case Format::kFP8Block:
      if constexpr (kCast) {
        return absl::InternalError("the in-pass cast is only for mxfp8");
      } else {
        grid = TileGrid<128, 128, kThreads>(t.nblocks);
        TileKernel<128, 128, kThreads, false, Op><<<grid, kThreads, 0, stream>>>(op, t, block_amax, red, cast);
        kernel = "TileKernel<128x128>";
      }
      break;
    default:
      return absl::InternalError("format has no blocks");
  }
  MAINSTAY_RETURN_IF_ERROR(call.Launched(kernel));
  if (grid_out != nullptr) *grid_out = grid;
  return absl::OkStatus();
}

// The grid LaunchTiles will use (to size per-CTA partials before the launch).
inline int TileGridFor(Format format, int64_t nblocks) {
  switch (format) {
    case Format::kMXFP8:
      return TileGrid<1, 32, 8>(nblocks);
    case Format::kNVFP4:
      return TileGrid<16, 16, 32>(nblocks);
    default:
      return TileGrid<128, 128, kThreads>(nblocks);
  }
}

inline int FlatGridFor(int64_t n) { return GridFor((n + 3) / 4, kThreads); }

}  // namespace mainstay::kernels::cuda

#endif  // MAINSTAY_KERNELS_CUDA_FRAGMENT_VISIT_CUH_
