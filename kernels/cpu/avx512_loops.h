// Hand-written AVX-512 forms of the quantize / dequantize element loops of quantize.cc and
// block_quantize.cc, and of three loops of the optimizer pass (optimizer_loops.h: the mxfp8
// cast of model bits, AdamW + per-tensor fp8 cast, the dry run for the amax), chosen at run
// time when the CPU has AVX-512 (F, BW, VL, DQ).
//
// Why they exist: the portable loops are plain C++ that GCC vectorizes, and on a streaming
// pass they run at about half the speed of memcpy. Measured on a 2-vCPU Xeon (AVX-512), one
// thread, kernels_bench: the portable E4M3 cast runs at 2.35 G elements/s in cache but 1.4-1.55
// from memory, because the core stalls on memory and computes in turn. These loops compute
// faster (3.2 in cache: 16 elements per instruction, the 32 -> 8 bit narrowing one
// instruction) and prefetch the input a few KiB ahead, so memory and arithmetic overlap: 2.6-2.9
// from memory (docs/benchmarks.md, "Hand-written AVX-512 casts").
//
// Every function computes exactly the bits of its portable counterpart: the same integer and
// IEEE FP32 operations of vector_casts.h and optimizer_math.h, 16 lanes at a time (round to
// nearest even, no FMA, no flush-to-zero), except where a hardware conversion is itself exact
// and correctly rounded (FP32 <-> FP16, vcvtps2ph / vcvtph2ps, with NaNs mapped as
// vector_casts.h maps them). tests/unit/avx512_loops_test.cc checks each against the portable loops (sampled bit
// patterns, every code, tail and alignment; the optimizer loops' state and outputs bit for
// bit), and quantize_test runs the whole kernels both ways (MAINSTAY_CPU_KERNELS).
//
// Internal to kernels/cpu. Thread safety: pure functions over caller-owned buffers. Calling
// any loop below when Enabled() is false is undefined (illegal instruction).
#ifndef MAINSTAY_KERNELS_CPU_AVX512_LOOPS_H_
#define MAINSTAY_KERNELS_CPU_AVX512_LOOPS_H_

#include <cstdint>

#include "kernels/kernels.h"
#include "kernels/optimizer_math.h"

namespace mainstay::kernels::cpu::avx512 {

// Whether the loops below run: the CPU has AVX-512 F, BW, VL and DQ, the build targets
// x86-64 with GCC or Clang, and the environment variable MAINSTAY_CPU_KERNELS is not
// "portable" (which keeps the portable loops, for tests and comparisons). Decided once per
// process.
bool Enabled();

// Per-tensor FP8: dst[i] = cvt(fl(model(src[i]) * scale)), cvt = E4M3 or E5M2 (satfinite),
// model = bf16 or fp16 rounding of the FP32 master.
void QuantizeFp8(const float* src, uint8_t* dst, int64_t n, float scale, bool fp16_model, bool e5m2);

// bf16 / fp16 data (2 little-endian bytes per element) of the model values.
void Cast16(const float* src, uint8_t* dst, int64_t n, bool fp16_model, bool fp16_out);

// One row piece of a block-scaled E4M3 format (mxfp8: block_cols 32, fp8_block: 128): the
// columns [c0, c1) of one row, src/dst at column c0, mult[k] the multiplier of the row's
// block (c0 / block_cols + k). dst[i] = E4M3(fl(model(src[i]) * mult[block of c0 + i])).
void QuantizeE4M3Piece(const float* src, int64_t c0, int64_t c1, int block_cols, const float* mult,
                       bool fp16_model, uint8_t* dst);

// nvfp4 (16-column tiles): the same for E2M1 codes, packed two per byte (even element in the
// low nibble) into `packed`, which points at the byte of the piece's first element; that
// element must be even in the fragment. With an odd count the last byte's high nibble is 0.
void QuantizeE2M1PiecePacked(const float* src, int64_t c0, int64_t c1, const float* enc, bool fp16_model,
                             uint8_t* packed);

// The optimizer pass's mxfp8 cast (CastMxfp8Span of optimizer_loops.h): n model-dtype values
// given as bits (n a multiple of 32, whole 1x32 blocks); per block e = MxfpBlockScale(amax,
// 448) into scales[b] and out = E4M3(fl(value * 2^(127 - e))).
void CastMxfp8FromBits(const uint16_t* bits, int64_t n, bool fp16_model, uint8_t* out, uint8_t* scales);

// The dry run of AdamW that only wants the amax (the daemon's probe for current scaling): for
// n elements (FP32 gradients, masters and moments), the FP32 bits of the largest model-dtype
// magnitude of the updated masters (NaN ignored), nothing stored. With `lanes` (the 8 FP64
// accumulators of AccumulateGradStats, for elements starting at a multiple of 8) the squares
// of grad * multiplier are added to them and the non-finite ones counted into *nonfinite.
int32_t AdamWDryRunAmax(const AdamWHyper& hyper, const AdamWConstants& consts, const float* grad, const float* master,
                        const float* m, const float* v, int64_t n, bool fp16_model, double* lanes,
                        int64_t* nonfinite);

// The updated masters of that dry run, written to out[0, n): what its amax is taken over (for
// tests: the daemon never needs them).
void AdamWDryRunMasters(const AdamWHyper& hyper, const AdamWConstants& consts, const float* grad, const float* master,
                        const float* m, const float* v, int64_t n, float* out);

// The optimizer pass's AdamW in place + per-tensor fp8 cast (AdamWCastSpan, FP32 gradients
// and moments): master, m, v updated in place and out[i] = cvt(fl(model(new master) * scale)).
void AdamWCastFp8(const AdamWHyper& hyper, const AdamWConstants& consts, const float* grad, float* master, float* m,
                  float* v, int64_t n, float scale, bool fp16_model, bool e5m2, uint8_t* out);

// The decoded block scales of mxfp8 (e8m0: E8M0Value) or nvfp4 (E4M3Value) of `count` blocks.
void DecodeBlockScales(const uint8_t* scales, int64_t count, bool e8m0, float* out);

// Dequantization. With `stream` the output is written with non-temporal stores (it bypasses
// the caches: for outputs larger than them, see StreamOutput); the values are the same.
//
// Per-tensor FP8: dst[i] = value(src[i]) * scale_inv.
void DequantizeFp8(const uint8_t* src, float* dst, int64_t n, float scale_inv, bool e5m2, bool stream);

// bf16 / fp16 (2 little-endian bytes per element): dst[i] = Bf16ToFloat / Fp16Value.
void Dequantize16(const uint8_t* src, float* dst, int64_t n, bool fp16, bool stream);

// Block E4M3: dst[i] = E4M3Value(q[i]) * scale[block of c0 + i] (layout as QuantizeE4M3Piece).
void DequantizeE4M3Piece(const uint8_t* q, int64_t c0, int64_t c1, int block_cols, const float* scale, float* dst,
                         bool stream);

// nvfp4: dst[i] = fl(fl(E2M1Value(code i) * scale[tile]) * s_dec), codes packed as in
// QuantizeE2M1PiecePacked (the piece's first element even in the fragment).
void DequantizeE2M1PiecePacked(const uint8_t* packed, int64_t c0, int64_t c1, const float* scale, float s_dec,
                               float* dst, bool stream);

// Whether a dequantization writing `bytes` in all streams its output: above 8 MiB, more than
// the caches of the cores that write it hold, so the output would be evicted before any use.
inline bool StreamOutput(int64_t bytes) { return bytes >= (int64_t{8} << 20); }

}  // namespace mainstay::kernels::cpu::avx512

#endif  // MAINSTAY_KERNELS_CPU_AVX512_LOOPS_H_
