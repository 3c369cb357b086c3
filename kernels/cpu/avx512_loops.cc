// AVX-512 loops (avx512_loops.h). Each vector function below is the 16-lane form of the
// vector_casts.h function of the same name, operation for operation, so that the two give the
// same bits; the comments say where a hardware instruction replaces a sequence.
#include "kernels/cpu/avx512_loops.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "kernels/cpu/vector_casts.h"
#include "kernels/optimizer_math.h"
#include "kernels/scaling.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MAINSTAY_AVX512_LOOPS 1
#include <immintrin.h>
#endif

namespace mainstay::kernels::cpu::avx512 {

#if MAINSTAY_AVX512_LOOPS

bool Enabled() {
  static const bool enabled = [] {
    const char* env = std::getenv("MAINSTAY_CPU_KERNELS");
    const std::string_view choice = env == nullptr ? "" : env;
    if (choice == "portable") return false;
    if (!choice.empty() && choice != "auto") {
      std::fprintf(stderr,
                   "mainstay: MAINSTAY_CPU_KERNELS=%s is not a choice (auto, portable); using auto\n",
                   env);
    }
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }();
  return enabled;
}

namespace {

#define MAINSTAY_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define MAINSTAY_AVX512_INLINE inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vl,avx512dq")))

// How far ahead the loops prefetch their input. The hardware prefetcher alone leaves the core
// waiting on memory between bursts of arithmetic; 4 KiB ahead (about one microsecond of
// input at this loop's speed) measured best of 1, 4, 8 and 16 KiB on the E4M3 cast.
constexpr int64_t kPrefetchBytes = 4096;

MAINSTAY_AVX512_INLINE __m512i Const(uint32_t v) { return _mm512_set1_epi32(static_cast<int>(v)); }
MAINSTAY_AVX512_INLINE __m512 AsFloat(__m512i v) { return _mm512_castsi512_ps(v); }
MAINSTAY_AVX512_INLINE __m512i AsInt(__m512 v) { return _mm512_castps_si512(v); }
MAINSTAY_AVX512_INLINE __mmask16 FirstLanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u);
}
MAINSTAY_AVX512_INLINE void Prefetch(const void* p) {
  _mm_prefetch(static_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
}

// ModelValueBits: the FP32 value of the master rounded to the model dtype. bf16: integer
// round to nearest even, NaN -> 0x7FFF0000. fp16: vcvtps2ph with round to nearest even is
// the correctly rounded conversion (subnormal halves and overflow to inf included), and
// vcvtph2ps is exact; NaN -> 0x7FFFE000 as in vector_casts.h.
template <bool kFp16>
MAINSTAY_AVX512_INLINE __m512 ModelValue(__m512 x) {
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  if constexpr (!kFp16) {
    const __m512i u = AsInt(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), Const(1));
    const __m512i r = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(u, Const(0x7FFF)), lsb), Const(0xFFFF0000u));
    return AsFloat(_mm512_mask_mov_epi32(r, nan, Const(0x7FFF0000u)));
  } else {
    const __m512 r = _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return _mm512_mask_mov_ps(r, nan, AsFloat(Const(0x7FFFE000u)));
  }
}

// Bf16Bits / Fp16Bits: 16-bit codes in the low half of each lane.
MAINSTAY_AVX512_INLINE __m512i Bf16Bits(__m512 x) {
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __m512i u = AsInt(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), Const(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, Const(0x7FFF)), lsb), 16);
  return _mm512_mask_mov_epi32(r, nan, Const(0x7FFF));
}

MAINSTAY_AVX512_INLINE __m512i Fp16Bits(__m512 x) {
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __m512i r = _mm512_cvtepu16_epi32(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  return _mm512_mask_mov_epi32(r, nan, Const(0x7FFF));
}

// MinifloatSatBits: the code in the low bits of each lane.
template <int kExpBits, int kMantBits, int kBias, uint32_t kMaxCode, uint32_t kNanCode>
MAINSTAY_AVX512_INLINE __m512i MinifloatSat(__m512 y) {
  constexpr uint32_t kMinNormalBits = static_cast<uint32_t>(127 + 1 - kBias) << 23;
  constexpr int kDrop = 23 - kMantBits;
  constexpr uint32_t kMagicBits = static_cast<uint32_t>(127 + 1 - kBias - kMantBits + 23) << 23;
  constexpr int kSignBit = kExpBits + kMantBits;
  const __m512i u = AsInt(y);
  const __m512i a = _mm512_and_si512(u, Const(0x7FFFFFFFu));
  const __m512i rebased = _mm512_sub_epi32(a, Const(static_cast<uint32_t>(127 - kBias) << 23));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(rebased, kDrop), Const(1));
  const __m512i normal =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(rebased, Const((1u << (kDrop - 1)) - 1u)), lsb), kDrop);
  const __m512i sub =
      _mm512_sub_epi32(AsInt(_mm512_add_ps(AsFloat(a), AsFloat(Const(kMagicBits)))), Const(kMagicBits));
  __m512i code = _mm512_mask_mov_epi32(normal, _mm512_cmplt_epi32_mask(a, Const(kMinNormalBits)), sub);
  code = _mm512_min_epi32(code, Const(kMaxCode));
  // code | ((u >> 31) << kSignBit), as one ternary-logic op: A | (B & C).
  code = _mm512_ternarylogic_epi32(code, _mm512_srli_epi32(u, 31 - kSignBit), Const(1u << kSignBit), 0xF8);
  return _mm512_mask_mov_epi32(code, _mm512_cmpgt_epi32_mask(a, Const(0x7F800000u)), Const(kNanCode));
}

MAINSTAY_AVX512_INLINE __m512i E4M3(__m512 y) { return MinifloatSat<4, 3, 7, 0x7E, 0x7F>(y); }
MAINSTAY_AVX512_INLINE __m512i E5M2(__m512 y) { return MinifloatSat<5, 2, 15, 0x7B, 0x7F>(y); }
MAINSTAY_AVX512_INLINE __m512i E2M1(__m512 y) { return MinifloatSat<2, 1, 1, 0x7, 0x7>(y); }

// MinifloatMagnitudeBits of 16 magnitudes.
template <int kMantBits, int kBias>
MAINSTAY_AVX512_INLINE __m512i MinifloatMagnitude(__m512i mag) {
  const __m512i normal =
      _mm512_add_epi32(_mm512_slli_epi32(mag, 23 - kMantBits), Const(static_cast<uint32_t>(127 - kBias) << 23));
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag),
                                   AsFloat(Const(static_cast<uint32_t>(127 + 1 - kBias - kMantBits) << 23)));
  return _mm512_mask_mov_epi32(normal, _mm512_cmplt_epi32_mask(mag, Const(1u << kMantBits)), AsInt(sub));
}

// E4M3Value / E5M2Value of 16 codes (one per lane).
MAINSTAY_AVX512_INLINE __m512 E4M3Value(__m512i q) {
  const __m512i mag = _mm512_and_si512(q, Const(0x7F));
  const __m512i magnitude = MinifloatMagnitude<3, 7>(mag);  // (not inside the macro: its comma)
  __m512i bits = _mm512_ternarylogic_epi32(magnitude, _mm512_slli_epi32(q, 24), Const(0x80000000u), 0xF8);
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(mag, Const(0x7F)), Const(0x7FC00000u));
  return AsFloat(bits);
}

MAINSTAY_AVX512_INLINE __m512 E5M2Value(__m512i q) {
  const __m512i mag = _mm512_and_si512(q, Const(0x7F));
  const __m512i sign = _mm512_and_si512(_mm512_slli_epi32(q, 24), Const(0x80000000u));
  __m512i bits = _mm512_or_si512(MinifloatMagnitude<2, 15>(mag), sign);
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(mag, Const(0x7C)),
                               _mm512_or_si512(Const(0x7F800000u), sign));
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmpgt_epi32_mask(mag, Const(0x7C)), Const(0x7FC00000u));
  return AsFloat(bits);
}

// E8M0Value of 16 codes: 2^(e - 127); 0 -> 2^-127; 0xFF -> NaN.
MAINSTAY_AVX512_INLINE __m512 E8M0Value(__m512i e) {
  __m512i bits = _mm512_slli_epi32(e, 23);
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(e, Const(0)), Const(0x00400000u));
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(e, Const(0xFF)), Const(0x7FC00000u));
  return AsFloat(bits);
}

// The 16 E2M1 values, from the portable decoder, for a table lookup (vpermps).
MAINSTAY_AVX512_INLINE __m512 E2M1Table() {
  alignas(64) float table[16];
  for (int k = 0; k < 16; ++k) table[k] = cpu::E2M1Value(static_cast<uint8_t>(k));
  return _mm512_load_ps(table);
}

// The multiplier of each lane of the 16 columns [col, col + 16) of a row piece starting at
// column c0: block_value[k] belongs to the row's block c0 / kBlockCols + k. With blocks of at
// least 16 columns a vector spans at most two blocks; the second block's value is read only
// when one of the vector's `remaining` columns (those left in the piece) lies in it.
template <int kBlockCols>
MAINSTAY_AVX512_INLINE __m512 LaneValues(const float* block_value, int64_t c0, int64_t col, int64_t remaining) {
  static_assert(kBlockCols >= 16);
  const int64_t lanes = remaining < 16 ? remaining : 16;
  const int64_t b = col / kBlockCols - c0 / kBlockCols;
  const int64_t r = col % kBlockCols;
  __m512 v = _mm512_set1_ps(block_value[b]);
  if (r + lanes > kBlockCols) {
    v = _mm512_mask_mov_ps(v, static_cast<__mmask16>(0xFFFFu << (kBlockCols - r)), _mm512_set1_ps(block_value[b + 1]));
  }
  return v;
}

// Writes the n floats op(i, mask, remaining) for the vectors at i of [0, n) to dst: a masked
// head up to dst's first 64-byte boundary, whole aligned vectors, a masked tail. With `stream`
// the whole vectors go out as non-temporal stores: a large output then skips the read for
// ownership of every line it writes, which halves the memory traffic of a dequantization
// (4 bytes written per 1 or 0.5 read). The loads of op may use `mask` (lanes past the end).
template <typename Op>
MAINSTAY_AVX512_INLINE void StoreFloats(const Op& op, float* dst, int64_t n, bool stream) {
  int64_t i = (((64 - (reinterpret_cast<uintptr_t>(dst) & 63)) & 63) / sizeof(float));
  i = i < n ? i : n;
  if (i > 0) _mm512_mask_storeu_ps(dst, FirstLanes(i), op(0, FirstLanes(i), i));
  if (stream) {
    for (; i + 16 <= n; i += 16) _mm512_stream_ps(dst + i, op(i, static_cast<__mmask16>(0xFFFF), 16));
    _mm_sfence();
  } else {
    for (; i + 16 <= n; i += 16) _mm512_store_ps(dst + i, op(i, static_cast<__mmask16>(0xFFFF), 16));
  }
  if (i < n) _mm512_mask_storeu_ps(dst + i, FirstLanes(n - i), op(i, FirstLanes(n - i), n - i));
}

// ---- Loops.

template <bool kFp16, bool kE5M2>
MAINSTAY_AVX512 void QuantizeFp8Loop(const float* src, uint8_t* dst, int64_t n, float scale) {
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = FirstLanes(n - i);
    Prefetch(src + i);
    const __m512 y = _mm512_mul_ps(ModelValue<kFp16>(_mm512_maskz_loadu_ps(m, src + i)), s);
    _mm_mask_storeu_epi8(dst + i, m, _mm512_cvtepi32_epi8(kE5M2 ? E5M2(y) : E4M3(y)));
  }
}

template <bool kFp16Model, bool kFp16Out>
MAINSTAY_AVX512 void Cast16Loop(const float* src, uint8_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = FirstLanes(n - i);
    Prefetch(src + i);
    __m512 x = _mm512_maskz_loadu_ps(m, src + i);
    if constexpr (kFp16Model != kFp16Out) x = ModelValue<kFp16Model>(x);
    const __m512i h = kFp16Out ? Fp16Bits(x) : Bf16Bits(x);
    _mm256_mask_storeu_epi16(dst + 2 * i, m, _mm512_cvtepi32_epi16(h));
  }
}

// fl(model(src[i + j]) * the multiplier of its block), j < 16, for the vector at i of a block
// row piece of n elements starting at column c0 (lanes outside `m` read as 0).
template <bool kFp16, int kBlockCols>
MAINSTAY_AVX512_INLINE __m512 ScaledModelValues(const float* src, int64_t c0, int64_t i, int64_t n, __mmask16 m,
                                                const float* mult) {
  Prefetch(src + i);
  return _mm512_mul_ps(ModelValue<kFp16>(_mm512_maskz_loadu_ps(m, src + i)),
                       LaneValues<kBlockCols>(mult, c0, c0 + i, n - i));
}

template <bool kFp16, int kBlockCols>
MAINSTAY_AVX512 void QuantizeE4M3PieceLoop(const float* src, int64_t c0, int64_t c1, const float* mult,
                                           uint8_t* dst) {
  const int64_t n = c1 - c0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = FirstLanes(n - i);
    const __m512 y = ScaledModelValues<kFp16, kBlockCols>(src, c0, i, n, m, mult);
    _mm_mask_storeu_epi8(dst + i, m, _mm512_cvtepi32_epi8(E4M3(y)));
  }
}

template <bool kFp16>
MAINSTAY_AVX512 void QuantizeE2M1PieceLoop(const float* src, int64_t c0, int64_t c1, const float* enc,
                                           uint8_t* packed) {
  const int64_t n = c1 - c0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = FirstLanes(n - i);
    // Lanes past the end give code 0: the high nibble of an odd count's last byte.
    const __m512i code = _mm512_maskz_mov_epi32(m, E2M1(ScaledModelValues<kFp16, 16>(src, c0, i, n, m, enc)));
    // Each 64-bit lane holds codes 2k (bits 0..3) and 2k + 1 (bits 32..35): the byte is
    // code_2k | code_2k+1 << 4, the low byte of lane | lane >> 28.
    const __m128i bytes = _mm512_cvtepi64_epi8(_mm512_or_si512(code, _mm512_srli_epi64(code, 28)));
    const int64_t nbytes = ((n - i < 16 ? n - i : 16) + 1) / 2;
    _mm_mask_storeu_epi8(packed + i / 2, static_cast<__mmask16>((1u << nbytes) - 1u), bytes);
  }
}

// The ops of StoreFloats for each dequantization (functors: a lambda would not carry the
// target attribute).
template <bool kE5M2>
struct Fp8Values {
  const uint8_t* src;
  __m512 scale_inv;
  MAINSTAY_AVX512_INLINE __m512 operator()(int64_t i, __mmask16 m, int64_t /*remaining*/) const {
    if (i % 64 == 0) Prefetch(src + i);
    const __m512i q = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, src + i));
    return _mm512_mul_ps(kE5M2 ? E5M2Value(q) : E4M3Value(q), scale_inv);
  }
};

// bf16 / fp16 data (2 little-endian bytes per element) to FP32: bf16 by a shift (Bf16ToFloat);
// fp16 by vcvtph2ps, exact, except that it quiets a signaling NaN: NaN lanes take
// Fp16Value's bits instead (the payload shifted up, the quiet bit as it was).
template <bool kFp16>
struct Values16 {
  const uint8_t* src;
  MAINSTAY_AVX512_INLINE __m512 operator()(int64_t i, __mmask16 m, int64_t /*remaining*/) const {
    if (i % 32 == 0) Prefetch(src + 2 * i);
    const __m256i h = _mm256_maskz_loadu_epi16(m, src + 2 * i);
    if constexpr (!kFp16) return AsFloat(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    const __m512i w = _mm512_cvtepu16_epi32(h);
    const __m512i mag = _mm512_and_si512(w, Const(0x7FFF));
    const __m512i nan_bits = _mm512_ternarylogic_epi32(_mm512_slli_epi32(mag, 13), _mm512_slli_epi32(w, 16),
                                                       Const(0x80000000u), 0xF8);  // mag << 13 | sign
    return _mm512_mask_mov_ps(_mm512_cvtph_ps(h), _mm512_cmpgt_epi32_mask(mag, Const(0x7C00)),
                              AsFloat(_mm512_or_si512(nan_bits, Const(0x7F800000u))));
  }
};

template <int kBlockCols>
struct E4M3BlockValues {
  const uint8_t* q;
  int64_t c0;
  const float* scale;
  MAINSTAY_AVX512_INLINE __m512 operator()(int64_t i, __mmask16 m, int64_t remaining) const {
    if (i % 64 == 0) Prefetch(q + i);
    const __m512 v = E4M3Value(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, q + i)));
    return _mm512_mul_ps(v, LaneValues<kBlockCols>(scale, c0, c0 + i, remaining));
  }
};

// E2M1 codes packed two per byte; element i's byte is packed[i / 2] (the piece's first
// element is even in the fragment), so a vector starting on an odd i first shifts its codes.
struct E2M1Values {
  const uint8_t* packed;
  int64_t c0;
  const float* scale;
  __m512 table;
  __m512 s_dec;
  MAINSTAY_AVX512_INLINE __m512 operator()(int64_t i, __mmask16 /*m*/, int64_t remaining) const {
    if (i % 128 == 0) Prefetch(packed + i / 2);
    const int64_t lanes = remaining < 16 ? remaining : 16;
    const int64_t first = i / 2;
    const int64_t nbytes = (i + lanes + 1) / 2 - first;  // bytes holding elements [i, i + lanes)
    __m128i bytes = _mm_maskz_loadu_epi8(FirstLanes(nbytes), packed + first);
    if (i % 2 != 0) {  // element i is the high nibble of byte `first`: shift the 9 bytes down 4 bits
      bytes = _mm_or_si128(_mm_srli_epi64(bytes, 4), _mm_slli_epi64(_mm_srli_si128(bytes, 8), 60));
    }
    const __m512i b = _mm512_cvtepu8_epi64(bytes);
    // Lane 2k's low 4 bits: byte k's low nibble; lane 2k + 1's: its high nibble (vpermps
    // reads only the low 4 bits of each index).
    const __m512 v = _mm512_permutexvar_ps(_mm512_or_si512(b, _mm512_slli_epi64(b, 28)), table);
    return _mm512_mul_ps(_mm512_mul_ps(v, LaneValues<16>(scale, c0, c0 + i, remaining)), s_dec);
  }
};

// The largest of the 32 unsigned 16-bit lanes.
MAINSTAY_AVX512_INLINE uint16_t MaxU16(__m512i x) {
  const __m256i m256 = _mm256_max_epu16(_mm512_castsi512_si256(x), _mm512_extracti64x4_epi64(x, 1));
  const __m128i m128 = _mm_max_epu16(_mm256_castsi256_si128(m256), _mm256_extracti128_si256(m256, 1));
  // phminposuw finds the minimum of 8 words: the max is the complement of the complements' min.
  const __m128i inv = _mm_xor_si128(m128, _mm_set1_epi16(-1));
  return static_cast<uint16_t>(~_mm_cvtsi128_si32(_mm_minpos_epu16(inv)) & 0xFFFF);
}

template <bool kFp16>
MAINSTAY_AVX512 void CastMxfp8FromBitsLoop(const uint16_t* bits, int64_t n, uint8_t* out, uint8_t* scales) {
  constexpr Format kModel = kFp16 ? Format::kFP16 : Format::kBF16;
  const __m512i inf16 = _mm512_set1_epi16(static_cast<short>(kFp16 ? 0x7C00 : 0x7F80));
  for (int64_t b = 0; b * 32 < n; ++b) {
    const __m512i x = _mm512_loadu_si512(bits + 32 * b);
    // MaxMagnitudeBits: magnitudes, NaNs (above inf) counted as 0.
    const __m512i a = _mm512_and_si512(x, _mm512_set1_epi16(0x7FFF));
    const uint16_t amax = MaxU16(_mm512_maskz_mov_epi16(_mm512_cmple_epu16_mask(a, inf16), a));
    const uint8_t e = MxfpBlockScale(ModelBitsToFloat(amax, kModel), kE4M3Max);
    const __m512 mult = _mm512_set1_ps(MxfpMultiplier(e));
    for (int half = 0; half < 2; ++half) {
      const __m256i h = half == 0 ? _mm512_castsi512_si256(x) : _mm512_extracti64x4_epi64(x, 1);
      // The model value: bf16 bits shifted up (exact); fp16 through vcvtph2ps (exact; a NaN's
      // payload may differ from Fp16Value's, and every NaN casts to the same code).
      const __m512 v = kFp16 ? _mm512_cvtph_ps(h) : AsFloat(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 32 * b + 16 * half),
                       _mm512_cvtepi32_epi8(E4M3(_mm512_mul_ps(v, mult))));
    }
    scales[b] = e;
  }
}

// AdamWElement's operations in its order on 16 lanes (g = grad * multiplier already): the
// updated masters; m and v are updated in registers only.
struct AdamWVectors {
  __m512 multiplier, beta1, beta2, one_minus_beta1, one_minus_beta2, decay, step_size, bc2_sqrt, eps;

  MAINSTAY_AVX512_INLINE static AdamWVectors Of(const AdamWHyper& hyper, const AdamWConstants& c) {
    return {_mm512_set1_ps(hyper.grad_multiplier), _mm512_set1_ps(hyper.beta1),   _mm512_set1_ps(hyper.beta2),
            _mm512_set1_ps(c.one_minus_beta1),     _mm512_set1_ps(c.one_minus_beta2), _mm512_set1_ps(c.decay),
            _mm512_set1_ps(c.step_size),           _mm512_set1_ps(c.bc2_sqrt),     _mm512_set1_ps(hyper.eps)};
  }

  // grad[i + j] * multiplier of the lanes in k; prefetches the four arrays ahead of i.
  MAINSTAY_AVX512_INLINE __m512 Gradients(const float* grad, const float* master, const float* m, const float* v,
                                          int64_t i, __mmask16 k) const {
    Prefetch(grad + i);
    Prefetch(master + i);
    Prefetch(m + i);
    Prefetch(v + i);
    return _mm512_mul_ps(_mm512_maskz_loadu_ps(k, grad + i), multiplier);
  }

  // Updates m and v in place and returns the new master.
  MAINSTAY_AVX512_INLINE __m512 Step(__m512 g, __m512 master, __m512& m, __m512& v) const {
    m = _mm512_add_ps(_mm512_mul_ps(beta1, m), _mm512_mul_ps(one_minus_beta1, g));
    v = _mm512_add_ps(_mm512_mul_ps(beta2, v), _mm512_mul_ps(one_minus_beta2, _mm512_mul_ps(g, g)));
    const __m512 p = _mm512_mul_ps(master, decay);
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), bc2_sqrt), eps);
    return _mm512_sub_ps(p, _mm512_mul_ps(step_size, _mm512_div_ps(m, denom)));
  }

  MAINSTAY_AVX512_INLINE __m512 Updated(__m512 g, __m512 master, __m512 m, __m512 v) const {
    return Step(g, master, m, v);
  }
};

// The optimizer pass of the daemon's apply for per-tensor FP8 (AdamWCastSpan with kFP8E4M3 /
// kFP8E5M2, FP32 gradients and moments): AdamW in place and the cast of the new model value,
// one loop.
template <bool kFp16, bool kE5M2>
MAINSTAY_AVX512 void AdamWCastFp8Loop(const AdamWHyper& hyper, const AdamWConstants& c, const float* grad,
                                      float* master, float* m, float* v, int64_t n, float scale, uint8_t* out) {
  const AdamWVectors adamw = AdamWVectors::Of(hyper, c);
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = FirstLanes(n - i);
    const __m512 g = adamw.Gradients(grad, master, m, v, i, k);
    __m512 mi = _mm512_maskz_loadu_ps(k, m + i);
    __m512 vi = _mm512_maskz_loadu_ps(k, v + i);
    const __m512 p = adamw.Step(g, _mm512_maskz_loadu_ps(k, master + i), mi, vi);
    _mm512_mask_storeu_ps(master + i, k, p);
    _mm512_mask_storeu_ps(m + i, k, mi);
    _mm512_mask_storeu_ps(v + i, k, vi);
    const __m512 y = _mm512_mul_ps(ModelValue<kFp16>(p), s);
    _mm_mask_storeu_epi8(out + i, k, _mm512_cvtepi32_epi8(kE5M2 ? E5M2(y) : E4M3(y)));
  }
}

// The dry run of AdamW for the amax (FusedAdamW with StepOutputs::dry_run, FP32 gradients
// and moments, only the tensor amax and the gradient statistics wanted): nothing stored. The
// statistics follow AccumulateGradStats: lane l of the 8 FP64 accumulators takes the elements
// i with i % 8 == l, in order (the lower 8 of a vector, then the upper 8).
template <bool kFp16>
MAINSTAY_AVX512 int32_t AdamWDryRunAmaxLoop(const AdamWHyper& hyper, const AdamWConstants& c, const float* grad,
                                            const float* master, const float* m, const float* v, int64_t n,
                                            double* lanes, int64_t* nonfinite) {
  const AdamWVectors adamw = AdamWVectors::Of(hyper, c);
  __m512d acc = lanes != nullptr ? _mm512_loadu_pd(lanes) : _mm512_setzero_pd();
  __m512i raw = _mm512_setzero_si512();
  int64_t bad = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = FirstLanes(n - i);
    const __m512 g = adamw.Gradients(grad, master, m, v, i, k);
    const __m512 updated = adamw.Updated(g, _mm512_maskz_loadu_ps(k, master + i), _mm512_maskz_loadu_ps(k, m + i),
                                         _mm512_maskz_loadu_ps(k, v + i));
    // AmaxBits: |x| as ordered integer bits, NaN -> 0 (and lanes past the end -> 0).
    const __m512i a = _mm512_and_si512(AsInt(updated), Const(0x7FFFFFFFu));
    raw = _mm512_max_epi32(raw, _mm512_maskz_mov_epi32(k & _mm512_cmple_epi32_mask(a, Const(0x7F800000u)), a));
    if (lanes != nullptr) {
      const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(g));
      const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(g), 1)));
      acc = _mm512_mask_add_pd(acc, static_cast<__mmask8>(k & 0xFF), acc, _mm512_mul_pd(lo, lo));
      acc = _mm512_mask_add_pd(acc, static_cast<__mmask8>(k >> 8), acc, _mm512_mul_pd(hi, hi));
      // Not finite: NaN (quiet or signaling) or +-inf.
      bad += __builtin_popcount(static_cast<unsigned>(_mm512_mask_fpclass_ps_mask(k, g, 0x99)));
    }
  }
  if (lanes != nullptr) {
    _mm512_storeu_pd(lanes, acc);
    *nonfinite += bad;
  }
  return ModelAmaxOfRaw<kFp16>(_mm512_reduce_max_epi32(raw));
}

MAINSTAY_AVX512 void AdamWDryRunMastersLoop(const AdamWHyper& hyper, const AdamWConstants& c, const float* grad,
                                            const float* master, const float* m, const float* v, int64_t n,
                                            float* out) {
  const AdamWVectors adamw = AdamWVectors::Of(hyper, c);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = FirstLanes(n - i);
    const __m512 g = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, grad + i), adamw.multiplier);
    _mm512_mask_storeu_ps(out + i, k,
                          adamw.Updated(g, _mm512_maskz_loadu_ps(k, master + i), _mm512_maskz_loadu_ps(k, m + i),
                                        _mm512_maskz_loadu_ps(k, v + i)));
  }
}

}  // namespace

MAINSTAY_AVX512 void DecodeBlockScales(const uint8_t* scales, int64_t count, bool e8m0, float* out) {
  for (int64_t i = 0; i < count; i += 16) {
    const __mmask16 m = FirstLanes(count - i);
    const __m512i q = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, scales + i));
    _mm512_mask_storeu_ps(out + i, m, e8m0 ? E8M0Value(q) : E4M3Value(q));
  }
}

void CastMxfp8FromBits(const uint16_t* bits, int64_t n, bool fp16_model, uint8_t* out, uint8_t* scales) {
  fp16_model ? CastMxfp8FromBitsLoop<true>(bits, n, out, scales) : CastMxfp8FromBitsLoop<false>(bits, n, out, scales);
}

int32_t AdamWDryRunAmax(const AdamWHyper& hyper, const AdamWConstants& consts, const float* grad, const float* master,
                        const float* m, const float* v, int64_t n, bool fp16_model, double* lanes,
                        int64_t* nonfinite) {
  return fp16_model ? AdamWDryRunAmaxLoop<true>(hyper, consts, grad, master, m, v, n, lanes, nonfinite)
                    : AdamWDryRunAmaxLoop<false>(hyper, consts, grad, master, m, v, n, lanes, nonfinite);
}

void AdamWDryRunMasters(const AdamWHyper& hyper, const AdamWConstants& consts, const float* grad, const float* master,
                        const float* m, const float* v, int64_t n, float* out) {
  AdamWDryRunMastersLoop(hyper, consts, grad, master, m, v, n, out);
}

void AdamWCastFp8(const AdamWHyper& hyper, const AdamWConstants& consts, const float* grad, float* master, float* m,
                  float* v, int64_t n, float scale, bool fp16_model, bool e5m2, uint8_t* out) {
  if (fp16_model) {
    e5m2 ? AdamWCastFp8Loop<true, true>(hyper, consts, grad, master, m, v, n, scale, out)
         : AdamWCastFp8Loop<true, false>(hyper, consts, grad, master, m, v, n, scale, out);
  } else {
    e5m2 ? AdamWCastFp8Loop<false, true>(hyper, consts, grad, master, m, v, n, scale, out)
         : AdamWCastFp8Loop<false, false>(hyper, consts, grad, master, m, v, n, scale, out);
  }
}

void QuantizeFp8(const float* src, uint8_t* dst, int64_t n, float scale, bool fp16_model, bool e5m2) {
  if (fp16_model) {
    e5m2 ? QuantizeFp8Loop<true, true>(src, dst, n, scale) : QuantizeFp8Loop<true, false>(src, dst, n, scale);
  } else {
    e5m2 ? QuantizeFp8Loop<false, true>(src, dst, n, scale) : QuantizeFp8Loop<false, false>(src, dst, n, scale);
  }
}

void Cast16(const float* src, uint8_t* dst, int64_t n, bool fp16_model, bool fp16_out) {
  if (fp16_model) {
    fp16_out ? Cast16Loop<true, true>(src, dst, n) : Cast16Loop<true, false>(src, dst, n);
  } else {
    fp16_out ? Cast16Loop<false, true>(src, dst, n) : Cast16Loop<false, false>(src, dst, n);
  }
}

void QuantizeE4M3Piece(const float* src, int64_t c0, int64_t c1, int block_cols, const float* mult,
                       bool fp16_model, uint8_t* dst) {
  if (block_cols == 32) {
    fp16_model ? QuantizeE4M3PieceLoop<true, 32>(src, c0, c1, mult, dst)
               : QuantizeE4M3PieceLoop<false, 32>(src, c0, c1, mult, dst);
  } else {
    fp16_model ? QuantizeE4M3PieceLoop<true, 128>(src, c0, c1, mult, dst)
               : QuantizeE4M3PieceLoop<false, 128>(src, c0, c1, mult, dst);
  }
}

void QuantizeE2M1PiecePacked(const float* src, int64_t c0, int64_t c1, const float* enc, bool fp16_model,
                             uint8_t* packed) {
  fp16_model ? QuantizeE2M1PieceLoop<true>(src, c0, c1, enc, packed)
             : QuantizeE2M1PieceLoop<false>(src, c0, c1, enc, packed);
}

MAINSTAY_AVX512 void DequantizeFp8(const uint8_t* src, float* dst, int64_t n, float scale_inv, bool e5m2,
                                   bool stream) {
  if (e5m2) {
    StoreFloats(Fp8Values<true>{src, _mm512_set1_ps(scale_inv)}, dst, n, stream);
  } else {
    StoreFloats(Fp8Values<false>{src, _mm512_set1_ps(scale_inv)}, dst, n, stream);
  }
}

MAINSTAY_AVX512 void Dequantize16(const uint8_t* src, float* dst, int64_t n, bool fp16, bool stream) {
  if (fp16) {
    StoreFloats(Values16<true>{src}, dst, n, stream);
  } else {
    StoreFloats(Values16<false>{src}, dst, n, stream);
  }
}

MAINSTAY_AVX512 void DequantizeE4M3Piece(const uint8_t* q, int64_t c0, int64_t c1, int block_cols,
                                         const float* scale, float* dst, bool stream) {
  if (block_cols == 32) {
    StoreFloats(E4M3BlockValues<32>{q, c0, scale}, dst, c1 - c0, stream);
  } else {
    StoreFloats(E4M3BlockValues<128>{q, c0, scale}, dst, c1 - c0, stream);
  }
}

MAINSTAY_AVX512 void DequantizeE2M1PiecePacked(const uint8_t* packed, int64_t c0, int64_t c1, const float* scale,
                                               float s_dec, float* dst, bool stream) {
  StoreFloats(E2M1Values{packed, c0, scale, E2M1Table(), _mm512_set1_ps(s_dec)}, dst, c1 - c0, stream);
}

#else  // not x86-64 GCC/Clang: never enabled, and the loops are never called.

bool Enabled() { return false; }
void QuantizeFp8(const float*, uint8_t*, int64_t, float, bool, bool) { std::abort(); }
void Cast16(const float*, uint8_t*, int64_t, bool, bool) { std::abort(); }
void QuantizeE4M3Piece(const float*, int64_t, int64_t, int, const float*, bool, uint8_t*) { std::abort(); }
void QuantizeE2M1PiecePacked(const float*, int64_t, int64_t, const float*, bool, uint8_t*) { std::abort(); }
void DecodeBlockScales(const uint8_t*, int64_t, bool, float*) { std::abort(); }
void CastMxfp8FromBits(const uint16_t*, int64_t, bool, uint8_t*, uint8_t*) { std::abort(); }
int32_t AdamWDryRunAmax(const AdamWHyper&, const AdamWConstants&, const float*, const float*, const float*, const float*,
                        int64_t, bool, double*, int64_t*) {
  std::abort();
}
void AdamWDryRunMasters(const AdamWHyper&, const AdamWConstants&, const float*, const float*, const float*,
                        const float*, int64_t, float*) {
  std::abort();
}
void AdamWCastFp8(const AdamWHyper&, const AdamWConstants&, const float*, float*, float*, float*, int64_t, float, bool,
                  bool, uint8_t*) {
  std::abort();
}
void DequantizeFp8(const uint8_t*, float*, int64_t, float, bool, bool) { std::abort(); }
void Dequantize16(const uint8_t*, float*, int64_t, bool, bool) { std::abort(); }
void DequantizeE4M3Piece(const uint8_t*, int64_t, int64_t, int, const float*, float*, bool) { std::abort(); }
void DequantizeE2M1PiecePacked(const uint8_t*, int64_t, int64_t, const float*, float, float*, bool) { std::abort(); }

#endif

}  // namespace mainstay::kernels::cpu::avx512
