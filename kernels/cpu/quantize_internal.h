// Internal to kernels/cpu: how the quantize kernels split a fragment into work, shared by
// quantize.cc (entry points, per-tensor formats) and block_quantize.cc (mxfp8, fp8_block,
// nvfp4).
//
// Work is cut into FIXED pieces that depend on the tensor shape and the fragment only, never
// on the thread count: element passes use chunks of kChunkElements fragment elements (chunk
// c covers fragment offsets [c * kChunkElements, (c + 1) * kChunkElements), so every chunk
// of a 4-bit fragment starts on a byte); block-amax passes use rectangles of whole blocks,
// so no two tasks write the same block; the block-scale pass uses fixed runs of blocks. Inside a chunk, rows are walked in pieces of at most
// kPieceElements elements, the width of the stack scratch arrays. Every value is computed by
// the same expression wherever it falls, so results never depend on the split either.
//
// Thread safety: pure functions over caller-owned buffers.
#ifndef MAINSTAY_KERNELS_CPU_QUANTIZE_INTERNAL_H_
#define MAINSTAY_KERNELS_CPU_QUANTIZE_INTERNAL_H_

#include <algorithm>
#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "common/format.h"
#include "kernels/kernels.h"
#include "kernels/cpu/vector_casts.h"

// MAINSTAY_VECTOR_CLONES: see kernels/cpu/vector_casts.h.

namespace mainstay::kernels::cpu {

inline constexpr int64_t kChunkElements = int64_t{64} * 1024;
inline constexpr int64_t kPieceElements = 4096;

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Calls fn(row, col_begin, col_end, offset) for the flattened elements [begin, end) of a
// `cols`-wide matrix, one call per row piece of at most `max_piece` elements; `offset` is
// the piece's first element minus `base` (its index in the fragment's arrays).
template <typename Fn>
void ForEachRowPiece(int64_t cols, int64_t begin, int64_t end, int64_t base, int64_t max_piece, Fn&& fn) {
  int64_t row = begin / cols;
  int64_t col = begin % cols;
  int64_t pos = begin;
  while (pos < end) {
    const int64_t n = std::min({cols - col, end - pos, max_piece});
    fn(row, col, col + n, pos - base);
    pos += n;
    col += n;
    if (col == cols) {
      col = 0;
      ++row;
    }
  }
}

// The largest AmaxBits of n FP32 values (NaN counted 0), not yet rounded to the model dtype
// (ModelAmaxOfRaw does that once per block or chunk). Prefetches as the streaming loops do.
int32_t RawAmax(const float* src, int64_t n);

// Amax of a fragment's model-dtype values, as FP32 bits in an int32 (fmax semantics), over
// fixed chunks on `executor`. The per-tensor path of every format.
int32_t PartialAmaxBits(CpuExecutor* executor, bool fp16_model, const float* master, int64_t n);

// block_quantize.cc: the block-scaled formats, with kernels.cc's arguments already checked.
absl::Status BlockPartialAmax(const Device& device, Format format, Format model_dtype, const Fragment& fragment,
                              std::span<const float> master, const AmaxOutputs& out);
absl::Status BlockQuantize(const Device& device, Format format, Format model_dtype, const Fragment& fragment,
                           std::span<const float> master, const ScaleInputs& scales, const QuantizedOutputs& out);
absl::Status BlockDequantize(const Device& device, Format format, const Fragment& fragment,
                             const QuantizedInputs& in, std::span<float> out);

}  // namespace mainstay::kernels::cpu

#endif  // MAINSTAY_KERNELS_CPU_QUANTIZE_INTERNAL_H_
