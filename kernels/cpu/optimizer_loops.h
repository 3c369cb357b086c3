// Internal to the CPU backend: the inner loops of the fused optimizer pass and GradStats.
//
// Each loop runs over a short span that is resident in L1 (a sub-block of at most
// kSubBlockElements) and is a plain loop the compiler vectorizes (kernels build with -O3
// -fno-math-errno -ffp-contract=off; optimizer.cc also with -fno-trapping-math, which lets
// GCC if-convert selects that follow FP operations). The arithmetic is the shared per-element
// functions of optimizer_math.h / casts.h / scaling.h, so its bits equal the CUDA backend's;
// the FP16 and FP8 conversions, whose casts.h forms branch, use vector_casts.h's branch-free
// forms, which give the same bits for every input. Element types and the model dtype are
// template parameters: with them fixed, LoadGrad / LoadMoment / ToModelBits fold to one
// branch-free expression.
//
// Thread safety: pure functions of their arguments, except that the block-amax walker
// merges into caller-owned slots (atomically where two chunks may share a block).
#ifndef MAINSTAY_KERNELS_CPU_OPTIMIZER_LOOPS_H_
#define MAINSTAY_KERNELS_CPU_OPTIMIZER_LOOPS_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "kernels/casts.h"
#include "kernels/cpu/avx512_loops.h"
#include "kernels/cpu/vector_casts.h"
#include "kernels/kernels.h"
#include "kernels/optimizer_math.h"
#include "kernels/scaling.h"

namespace mainstay::kernels::cpu {

// Work split, independent of the thread count: a chunk is one ParallelFor task and the unit
// of every reduction (combined in chunk order); a sub-block is the L1-resident span the
// loops below run over. Both multiples of 32 (so MXFP8 blocks never straddle them when the
// fragment starts on a multiple of 32) and of kSumLanes.
inline constexpr int64_t kChunkElements = int64_t{1} << 15;
inline constexpr int64_t kSubBlockElements = 1024;
// Sums of squares use this many FP64 accumulators per chunk; element i of the chunk goes to
// lane i % kSumLanes, and the lanes are added in a fixed tree at the end of the chunk.
inline constexpr int kSumLanes = 8;

inline int64_t ChunkCount(int64_t n) { return (n + kChunkElements - 1) / kChunkElements; }

// The streaming loops below prefetch with PrefetchSlice (vector_casts.h): in the AdamW loops
// that also cast, the cast's arithmetic fills the core's out-of-order window, and without it
// the loads of the next elements issue late: AdamW + fp8 cast at 1.25-1.33 G elements/s
// against 1.45-1.50 with it, on 2 threads, AdamW alone 1.5-1.6 (docs/benchmarks.md,
// "Hand-written AVX-512 casts").

// ---- Gradient statistics.

// Adds (g * g) of g = grad[i] * multiplier, i in [0, n), to lanes[i % kSumLanes] and returns
// how many g are not finite. `grad` starts at a chunk offset that is a multiple of kSumLanes
// (the lane of an element depends only on its chunk offset). n <= kChunkElements.
// The lanes are independent accumulators, so a vector of them (any width) adds in the same
// order as one lane at a time: the clones give the same bits.
template <ElementType kGrad>
MAINSTAY_VECTOR_CLONES int64_t AccumulateGradStats(const void* grad, int64_t n, float multiplier, double* lanes) {
  double acc[kSumLanes];
  for (int l = 0; l < kSumLanes; ++l) acc[l] = lanes[l];
  int32_t bad = 0;
  int64_t i = 0;
  for (; i + kSumLanes <= n;) {
    // Slices of kPrefetchSlice (a multiple of kSumLanes: lanes keep their elements), each
    // asking for the gradients kPrefetchAhead elements on (see PrefetchSlice).
    PrefetchSlice<kGrad == ElementType::kBFloat16 ? 2 : 4, false>(grad, i + kPrefetchAhead);
    const int64_t end = std::min(n - n % kSumLanes, i + kPrefetchSlice);
    for (; i < end; i += kSumLanes) {
      for (int l = 0; l < kSumLanes; ++l) {
        const float g = LoadGrad(grad, kGrad, i + l) * multiplier;
        const double gd = static_cast<double>(g);
        acc[l] += gd * gd;  // the square is exact in FP64; only the sum rounds
        bad += IsFinite(g) ? 0 : 1;
      }
    }
  }
  for (int l = 0; i + l < n; ++l) {
    const float g = LoadGrad(grad, kGrad, i + l) * multiplier;
    const double gd = static_cast<double>(g);
    acc[l] += gd * gd;
    bad += IsFinite(g) ? 0 : 1;
  }
  for (int l = 0; l < kSumLanes; ++l) lanes[l] = acc[l];
  return bad;
}

inline double CombineLanes(const double* lanes) {
  static_assert(kSumLanes == 8, "the combination tree below is written for 8 lanes");
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

// ---- Optimizer updates.
//
// The statistics, the update and the model-dtype cast are separate loops over the same
// L1-resident sub-block rather than one loop: on the x86-64 baseline (SSE2) the update is
// bound by the divide/sqrt unit, and folding the FP64 lanes or the bf16 packing into it
// costs more (register pressure) than re-reading the sub-block from L1.

// Optimizer state of the fragment; a span [begin, begin + n) of it is read per call, with
// `grad` pointing at the span's first gradient, and the span's updated values are written
// to the state itself (kInPlace) or to `out` (L1 scratch, for a dry run). In place, the
// loops read and write through the same pointers, so the vectorizer sees a distance of 0
// (distinct pointers to the same memory would fail its run-time overlap check).
struct SpanOut {
  float* master;
  void* m;
  void* v;  // AdamW only
};

struct AdamWArgs {
  AdamWHyper hyper;
  AdamWConstants consts;
  const float* master;
  const void* m;
  const void* v;
};

template <ElementType kMoment>
const void* MomentAt(const void* base, int64_t begin) {
  if constexpr (kMoment == ElementType::kBFloat16) return static_cast<const uint16_t*>(base) + begin;
  return static_cast<const float*>(base) + begin;
}

// Element i of an in-place AdamW span: updates master[i], m[i], v[i] and returns the new
// master. Always inlined into the loops below (a call would keep them scalar).
template <ElementType kGrad, ElementType kMoment>
MAINSTAY_CAST_INLINE float AdamWInPlace(const AdamWHyper& h, const AdamWConstants& c, float multiplier,
                                        const void* grad, int64_t i, float* master, void* m, void* v) {
  const float g = LoadGrad(grad, kGrad, i) * multiplier;
  float p = master[i];
  float mi = LoadMoment(m, kMoment, i);
  float vi = LoadMoment(v, kMoment, i);
  AdamWElement(h, c, g, p, mi, vi);
  master[i] = p;
  StoreMoment(m, kMoment, i, mi);
  StoreMoment(v, kMoment, i, vi);
  return p;
}

template <ElementType kGrad, ElementType kMoment>
MAINSTAY_CAST_INLINE void PrefetchAdamWSlice(const void* grad, const float* master, const void* m, const void* v,
                                             int64_t i) {
  constexpr int kGradBytes = kGrad == ElementType::kBFloat16 ? 2 : 4;
  constexpr int kMomentBytes = kMoment == ElementType::kBFloat16 ? 2 : 4;
  PrefetchSlice<4, true>(master, i);
  PrefetchSlice<kMomentBytes, true>(m, i);
  PrefetchSlice<kMomentBytes, true>(v, i);
  PrefetchSlice<kGradBytes, false>(grad, i);
}

// The dry run's loop: the outputs go to scratch that never aliases the state, and say so
// (__restrict parameters): otherwise the vectorizer's run-time overlap checks, one per pair
// of arrays, exceed its limit and the loop stays scalar.
template <ElementType kGrad, ElementType kMoment>
MAINSTAY_VECTOR_CLONES void AdamWSpanOut(const AdamWHyper h, const AdamWConstants c, const void* __restrict grad,
                                         const float* __restrict master, const void* __restrict m,
                                         const void* __restrict v, int64_t n, float* __restrict master_out,
                                         void* __restrict m_out, void* __restrict v_out) {
  const float multiplier = h.grad_multiplier;
  for (int64_t t = 0; t < n; t += kPrefetchSlice) {
    PrefetchAdamWSlice<kGrad, kMoment>(grad, master, m, v, t + kPrefetchAhead);
    const int64_t end = std::min(n, t + kPrefetchSlice);
    for (int64_t i = t; i < end; ++i) {
      const float g = LoadGrad(grad, kGrad, i) * multiplier;
      float p = master[i];
      float mi = LoadMoment(m, kMoment, i);
      float vi = LoadMoment(v, kMoment, i);
      AdamWElement(h, c, g, p, mi, vi);
      master_out[i] = p;
      StoreMoment(m_out, kMoment, i, mi);
      StoreMoment(v_out, kMoment, i, vi);
    }
  }
}

template <ElementType kGrad, ElementType kMoment, bool kInPlace>
MAINSTAY_VECTOR_CLONES void AdamWSpan(const AdamWArgs& args, const void* grad, int64_t begin, int64_t n,
                                      const SpanOut& out) {
  if constexpr (!kInPlace) {
    AdamWSpanOut<kGrad, kMoment>(args.hyper, args.consts, grad, args.master + begin, MomentAt<kMoment>(args.m, begin),
                                 MomentAt<kMoment>(args.v, begin), n, out.master, out.m, out.v);
  } else {
    // Copies held by value: no store through master[] can alias them, so they stay in registers.
    const AdamWHyper h = args.hyper;
    const AdamWConstants c = args.consts;
    const float multiplier = h.grad_multiplier;
    float* master = const_cast<float*>(args.master) + begin;
    void* m = const_cast<void*>(MomentAt<kMoment>(args.m, begin));
    void* v = const_cast<void*>(MomentAt<kMoment>(args.v, begin));
    for (int64_t t = 0; t < n; t += kPrefetchSlice) {
      PrefetchAdamWSlice<kGrad, kMoment>(grad, master, m, v, t + kPrefetchAhead);
      const int64_t end = std::min(n, t + kPrefetchSlice);
      for (int64_t i = t; i < end; ++i) AdamWInPlace<kGrad, kMoment>(h, c, multiplier, grad, i, master, m, v);
    }
  }
}

struct SgdArgs {
  SgdHyper hyper;
  const float* master;
  const void* buf;
};

template <ElementType kGrad, ElementType kMoment>
MAINSTAY_VECTOR_CLONES void SgdSpanOut(const SgdHyper h, const void* __restrict grad, const float* __restrict master,
                                       const void* __restrict buf, int64_t n, float* __restrict master_out,
                                       void* __restrict buf_out) {
  const float multiplier = h.grad_multiplier;
  for (int64_t i = 0; i < n; ++i) {
    const float g = LoadGrad(grad, kGrad, i) * multiplier;
    float p = master[i];
    float b = LoadMoment(buf, kMoment, i);
    SgdElement(h, g, p, b);
    master_out[i] = p;
    StoreMoment(buf_out, kMoment, i, b);
  }
}

template <ElementType kGrad, ElementType kMoment, bool kInPlace>
MAINSTAY_VECTOR_CLONES void SgdSpan(const SgdArgs& args, const void* grad, int64_t begin, int64_t n,
                                    const SpanOut& out) {
  if constexpr (!kInPlace) {
    SgdSpanOut<kGrad, kMoment>(args.hyper, grad, args.master + begin, MomentAt<kMoment>(args.buf, begin), n,
                               out.master, out.m);
  } else {
    const SgdHyper h = args.hyper;
    const float multiplier = h.grad_multiplier;
    float* master = const_cast<float*>(args.master) + begin;
    void* buf = const_cast<void*>(MomentAt<kMoment>(args.buf, begin));
    for (int64_t i = 0; i < n; ++i) {
      const float g = LoadGrad(grad, kGrad, i) * multiplier;
      float p = master[i];
      float b = LoadMoment(buf, kMoment, i);
      SgdElement(h, g, p, b);
      master[i] = p;
      StoreMoment(buf, kMoment, i, b);
    }
  }
}

// FP16 <-> FP32 in loops. The conversions are exact (or correctly rounded), so each has one
// right answer; casts.h's Fp16ToFloat / FloatToFp16 branch, which keeps a loop around them
// scalar, and vector_casts.h has branch-free forms with the same bits for every input.
template <Format kModel>
float ModelValue(uint16_t bits) {
  if constexpr (kModel == Format::kFP16) return Fp16Value(bits);
  return Bf16ToFloat(bits);
}

template <Format kModel>
uint16_t ModelBits(float x) {
  if constexpr (kModel == Format::kFP16) return Fp16Bits(FloatBits(x));
  return ToModelBits(x, Format::kBF16);
}

// FP16 gradients are widened once per sub-block and the FP32 loops run on the copy: the
// values are LoadGrad's, so the results are too.
MAINSTAY_VECTOR_CLONES inline void WidenFp16Grad(const void* grad, int64_t begin, int64_t n, float* out) {
  const uint16_t* h = static_cast<const uint16_t*>(grad) + begin;
  for (int64_t i = 0; i < n; ++i) out[i] = Fp16Value(h[i]);
}

// ---- Model-dtype values and their amax.

template <Format kModel>
MAINSTAY_VECTOR_CLONES void ModelBitsSpan(const float* master, int64_t n, uint16_t* bits) {
  for (int64_t i = 0; i < n; ++i) bits[i] = ModelBits<kModel>(master[i]);
}

// Largest magnitude of n model-dtype values, as the bits of a non-negative value; NaNs are
// ignored (fmax semantics), +inf wins. Sign-magnitude encodings order magnitudes like
// integers, so this is an integer max (16-bit lanes) rather than a float compare.
template <Format kModel>
MAINSTAY_VECTOR_CLONES uint16_t MaxMagnitudeBits(const uint16_t* bits, int64_t n) {
  constexpr int16_t kInf = kModel == Format::kFP16 ? 0x7C00 : 0x7F80;  // larger magnitudes are NaN
  int16_t best = 0;
  for (int64_t i = 0; i < n; ++i) {
    int16_t a = static_cast<int16_t>(bits[i] & 0x7FFF);
    a = a > kInf ? int16_t{0} : a;
    best = a > best ? a : best;
  }
  return static_cast<uint16_t>(best);
}

inline void AtomicMax(float* slot, float value) {
  std::atomic_ref<float> ref(*slot);
  float current = ref.load(std::memory_order_relaxed);
  while (value > current && !ref.compare_exchange_weak(current, value, std::memory_order_relaxed)) {
  }
}

// Where per-block amaxes go: slots for the fragment's block range (common/format.h).
struct BlockAmaxTarget {
  float* slots = nullptr;  // slots[global block - range_begin], zeroed before the pass
  int64_t range_begin = 0;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t tile_cols = 0;  // ceil(cols / block_cols)
  int64_t fragment_begin = 0;
  int64_t fragment_end = 0;
};

// Merges the block amaxes of the model values `bits` of global elements [global_begin,
// global_begin + n) into `t`, walking row segments and, inside them, block-column segments.
// A block whose fragment elements all lie in this chunk [chunk_begin, chunk_end) (global) is
// owned by it and updated plainly; a block shared with another chunk is updated with an
// atomic max (exact and order-independent, so still deterministic). Returns the max over
// all n values (the tensor amax contribution).
template <Format kModel, int64_t kBlockRows, int64_t kBlockCols>
float WalkBlockAmax(const BlockAmaxTarget& t, const uint16_t* bits, int64_t global_begin, int64_t n,
                    int64_t chunk_begin, int64_t chunk_end) {
  const int64_t cols = t.cols;
  int64_t r = global_begin / cols;
  int64_t c = global_begin % cols;
  uint16_t total = 0;
  int64_t done = 0;
  while (done < n) {
    const int64_t len = std::min(cols - c, n - done);
    const int64_t tile_row = r / kBlockRows;
    const int64_t first_row = tile_row * kBlockRows;
    const int64_t last_row = std::min(first_row + kBlockRows, t.rows) - 1;
    const int64_t c_end = c + len;
    int64_t tile_col = c / kBlockCols;
    for (int64_t cc = c; cc < c_end; ++tile_col) {
      const int64_t block_c0 = tile_col * kBlockCols;
      const int64_t block_c_last = std::min(block_c0 + kBlockCols, cols) - 1;
      const int64_t seg_end = std::min(block_c_last + 1, c_end);
      const uint16_t* seg = bits + done + (cc - c);
      // Whole blocks (the common case) get a loop of constant trip count.
      const uint16_t a_bits = seg_end - cc == kBlockCols ? MaxMagnitudeBits<kModel>(seg, kBlockCols)
                                                         : MaxMagnitudeBits<kModel>(seg, seg_end - cc);
      total = std::max(total, a_bits);
      const float a = ModelBitsToFloat(a_bits, kModel);
      float* slot = t.slots + (tile_row * t.tile_cols + tile_col - t.range_begin);
      const int64_t first = std::max(first_row * cols + block_c0, t.fragment_begin);
      const int64_t last = std::min(last_row * cols + block_c_last, t.fragment_end - 1);
      if (first >= chunk_begin && last < chunk_end) {
        if (a > *slot) *slot = a;
      } else {
        AtomicMax(slot, a);
      }
      cc = seg_end;
    }
    done += len;
    c = c_end;
    if (c == cols) {
      c = 0;
      ++r;
    }
  }
  return ModelBitsToFloat(total, kModel);
}

// ---- Casts of the model values (FusedAdamWQuantize).

// bf16 / fp16 output: the model value re-encoded in `kOut` (the identity when they match),
// 2 little-endian bytes per element.
template <Format kModel, Format kOut>
void Cast16Span(const uint16_t* bits, int64_t n, uint8_t* out) {
  if constexpr (kModel == kOut) {
    std::memcpy(out, bits, static_cast<size_t>(n) * 2);
  } else {
    uint16_t tmp[kSubBlockElements];
    for (int64_t i = 0; i < n; ++i) tmp[i] = ModelBits<kOut>(ModelValue<kModel>(bits[i]));
    std::memcpy(out, tmp, static_cast<size_t>(n) * 2);
  }
}

// FP8 with a per-tensor scale: q = cvt(fl(x * scale)).
template <Format kModel, bool kE5M2>
MAINSTAY_VECTOR_CLONES void CastFp8Span(const uint16_t* bits, int64_t n, float scale, uint8_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    const float y = ModelValue<kModel>(bits[i]) * scale;
    out[i] = kE5M2 ? E5M2Bits(y) : E4M3Bits(y);  // FloatToE5M2 / FloatToE4M3, branch-free
  }
}

// MXFP8 over n elements made of whole 32-element blocks: per block e = MxfpBlockScale(amax,
// 448), q = cvt_e4m3(fl(x * 2^(127 - e))).
template <Format kModel>
MAINSTAY_VECTOR_CLONES void CastMxfp8Span(const uint16_t* bits, int64_t n, uint8_t* out, uint8_t* scales) {
  constexpr int64_t kBlock = 32;
  for (int64_t b = 0; b * kBlock < n; ++b) {
    const uint16_t* x = bits + b * kBlock;
    const uint8_t e = MxfpBlockScale(ModelBitsToFloat(MaxMagnitudeBits<kModel>(x, kBlock), kModel), kE4M3Max);
    const float multiplier = MxfpMultiplier(e);
    uint8_t* q = out + b * kBlock;
    for (int64_t i = 0; i < kBlock; ++i) q[i] = E4M3Bits(ModelValue<kModel>(x[i]) * multiplier);
    scales[b] = e;
  }
}

// What an optimizer pass casts the updated values into (FusedAdamWQuantize); kNone: nothing.
enum class CastKind { kNone, kBF16, kFP16, kFP8E4M3, kFP8E5M2, kMXFP8 };

// The optimizer pass of the daemon's apply: the AdamW update in place and the cast of the new
// model value. fp8: q = cvt(fl(model(p) * scale)); 16-bit: the model value in the output
// format, little-endian; mxfp8 (n a multiple of 32): per 32-element block, the block's scale e
// from the amax of its new model values into scales[b] and q = cvt_e4m3(fl(x * 2^(127 - e))).
// `out` and `scales` point at the span's first output byte and block scale. fp8 and 16-bit run
// as ONE loop: the update is bound by the divide/sqrt unit and the cast by the integer ALUs,
// and in one loop body they run side by side (AVX-512 has the registers for it). mxfp8 runs
// the update over the whole L1-resident span first, then the cast of its model bits (the
// AVX-512 loop where the CPU has it): a loop per block around both kept the block reduction
// scalar (docs/benchmarks.md, "Hand-written AVX-512 casts"). The same operations as AdamWSpan
// + ModelBitsSpan + CastFp8Span / Cast16Span / CastMxfp8Span, so the same bits.
template <ElementType kGrad, ElementType kMoment, Format kModel, CastKind kCast>
MAINSTAY_VECTOR_CLONES void AdamWCastSpan(const AdamWArgs& args, const void* grad, int64_t begin, int64_t n,
                                          float scale, uint8_t* out, uint8_t* scales) {
  static_assert(kCast != CastKind::kNone);
  const AdamWHyper h = args.hyper;
  const AdamWConstants c = args.consts;
  const float multiplier = h.grad_multiplier;
  float* master = const_cast<float*>(args.master) + begin;
  void* m = const_cast<void*>(MomentAt<kMoment>(args.m, begin));
  void* v = const_cast<void*>(MomentAt<kMoment>(args.v, begin));
  if constexpr (kCast == CastKind::kMXFP8) {
    uint16_t bits[kSubBlockElements];
    for (int64_t t = 0; t < n; t += kPrefetchSlice) {
      PrefetchAdamWSlice<kGrad, kMoment>(grad, master, m, v, t + kPrefetchAhead);
      const int64_t end = std::min(n, t + kPrefetchSlice);
      for (int64_t i = t; i < end; ++i) {
        bits[i] = ModelBits<kModel>(AdamWInPlace<kGrad, kMoment>(h, c, multiplier, grad, i, master, m, v));
      }
    }
    if (avx512::Enabled()) {
      avx512::CastMxfp8FromBits(bits, n, kModel == Format::kFP16, out, scales);
    } else {
      CastMxfp8Span<kModel>(bits, n, out, scales);
    }
  } else {
    for (int64_t t = 0; t < n; t += kPrefetchSlice) {
      PrefetchAdamWSlice<kGrad, kMoment>(grad, master, m, v, t + kPrefetchAhead);
      const int64_t end = std::min(n, t + kPrefetchSlice);
      for (int64_t i = t; i < end; ++i) {
        const float p = AdamWInPlace<kGrad, kMoment>(h, c, multiplier, grad, i, master, m, v);
        const uint16_t bits = ModelBits<kModel>(p);
        if constexpr (kCast == CastKind::kFP8E4M3 || kCast == CastKind::kFP8E5M2) {
          const float y = ModelValue<kModel>(bits) * scale;
          out[i] = kCast == CastKind::kFP8E5M2 ? E5M2Bits(y) : E4M3Bits(y);
        } else {
          constexpr Format kOut = kCast == CastKind::kFP16 ? Format::kFP16 : Format::kBF16;
          uint16_t q = bits;
          if constexpr (kOut != kModel) q = ModelBits<kOut>(ModelValue<kModel>(bits));
          out[2 * i] = static_cast<uint8_t>(q);
          out[2 * i + 1] = static_cast<uint8_t>(q >> 8);
        }
      }
    }
  }
}

// AdamWCastSpan's per-tensor fp8 form in AVX-512 intrinsics, for FP32 gradients and moments
// (PickAdamWCast picks it when avx512::Enabled(); +10-17 %, docs/benchmarks.md). A separate
// function: with the intrinsics' call as a branch inside AdamWCastSpan, GCC stopped
// vectorizing the portable loop next to it (0.19 G elements/s instead of 1.35).
template <Format kModel, CastKind kCast>
void AdamWCastFp8SpanAvx512(const AdamWArgs& args, const void* grad, int64_t begin, int64_t n, float scale,
                            uint8_t* out, uint8_t* /*scales*/) {
  static_assert(kCast == CastKind::kFP8E4M3 || kCast == CastKind::kFP8E5M2);
  avx512::AdamWCastFp8(args.hyper, args.consts, static_cast<const float*>(grad), const_cast<float*>(args.master) + begin,
                       static_cast<float*>(const_cast<void*>(args.m)) + begin,
                       static_cast<float*>(const_cast<void*>(args.v)) + begin, n, scale, kModel == Format::kFP16,
                       kCast == CastKind::kFP8E5M2, out);
}

}  // namespace mainstay::kernels::cpu

#endif  // MAINSTAY_KERNELS_CPU_OPTIMIZER_LOOPS_H_
