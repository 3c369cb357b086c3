// CPU kernels of the block-scaled formats: mxfp8 (1x32 blocks, E8M0 scales), fp8_block
// (128x128 tiles, FP32 scale_inv) and nvfp4 (16x16 tiles, E4M3 scales + FP32 global scale).
// FORMATS.md states the math; quantize_internal.h the chunking.
//
// Amax: fixed rectangles of whole blocks (never shared, so no two tasks write one entry).
// For 2D tiles a rectangle keeps a running per-column max over the tile's rows (a long,
// vectorizable element-wise loop) and reduces each tile's columns once per tile row.
// Quantize: one vectorized pass over the block range computes the block scales (written to
// the output) and each block's element multiplier into a table; then fixed element chunks
// walk their rows in pieces, each piece one call that casts block by block (whole blocks
// with a fixed trip count) reading the multipliers straight from the table. Dequantize
// mirrors the element pass. On a CPU with AVX-512 the element passes run the hand-written
// loops of avx512_loops.h (same bits; a 4-bit piece that starts on an odd element keeps the
// portable loop, which completes the byte its predecessor began).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "kernels/cpu/avx512_loops.h"
#include "kernels/cpu/executor.h"
#include "kernels/cpu/quantize_internal.h"
#include "kernels/cpu/vector_casts.h"
#include "kernels/scaling.h"

namespace mainstay::kernels::cpu {
namespace {

// Blocks per task of the block-scale pass.
constexpr int64_t kBlockChunk = 16 * 1024;
// Minimum width of a block-amax rectangle (see AmaxRects).
constexpr int64_t kMinRectCols = 4096;

// The block grid of one fragment.
struct Grid {
  int64_t rows = 0, cols = 0;
  int64_t block_rows = 0, block_cols = 0;
  int64_t grid_cols = 0;       // blocks per block row
  int64_t begin = 0, end = 0;  // the fragment's elements
  IndexRange range;            // the fragment's block range (entry i of block_* = block range.begin + i)

  // Local index of the block holding (row, 0); add col / block_cols for other columns.
  int64_t RowBase(int64_t row) const { return (row / block_rows) * grid_cols - range.begin; }
};

Grid MakeGrid(Format format, const Fragment& f) {
  const FormatDescriptor& d = Describe(format);
  Grid g;
  g.rows = f.view.rows;
  g.cols = f.view.cols;
  g.block_rows = d.block_rows;
  g.block_cols = d.block_cols;
  g.grid_cols = CeilDiv(g.cols, g.block_cols);
  g.begin = f.elements.begin;
  g.end = f.elements.end;
  g.range = ScaleBlockRange(format, f.view, f.elements);
  return g;
}

// ---- Amax.

// The loops below take the FP32 magnitudes' max; RectAmax rounds each block's max to the model
// dtype once (ModelAmaxOfRaw), which gives the max of the rounded values.
// The loops prefetch as the optimizer's do (PrefetchSlice, vector_casts.h).
MAINSTAY_VECTOR_CLONES void UpdateColumnMax(const float* src, int32_t* colmax, int64_t n) {
  for (int64_t t = 0; t < n; t += kPrefetchSlice) {
    PrefetchSlice<4, false>(src, t + kPrefetchAhead);
    const int64_t end = std::min(n, t + kPrefetchSlice);
    for (int64_t i = t; i < end; ++i) {
      const int32_t a = AmaxBits(FloatBits(src[i]));
      colmax[i] = a > colmax[i] ? a : colmax[i];
    }
  }
}

// Amax of `blocks` whole consecutive 1x32 blocks: a fixed inner trip count GCC turns into
// full vectors.
MAINSTAY_VECTOR_CLONES void WholeBlocks32Amax(const float* src, int64_t blocks, int32_t* out) {
  for (int64_t b = 0; b < blocks; ++b) {
    if (b % 2 == 0) PrefetchSlice<4, false>(src, 32 * b + kPrefetchAhead);
    int32_t m = 0;
    for (int64_t i = 0; i < 32; ++i) {
      const int32_t a = AmaxBits(FloatBits(src[32 * b + i]));
      m = a > m ? a : m;
    }
    out[b] = m;
  }
}

int32_t MaxOf(const int32_t* v, int64_t n) {
  int32_t m = 0;
  for (int64_t i = 0; i < n; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

// Per-tile max of `tiles` whole tiles' column maxima.
template <int kTileCols>
MAINSTAY_VECTOR_CLONES void WholeTilesMax(const int32_t* colmax, int64_t tiles, int32_t* out) {
  for (int64_t t = 0; t < tiles; ++t) {
    int32_t m = 0;
    for (int64_t i = 0; i < kTileCols; ++i) m = colmax[kTileCols * t + i] > m ? colmax[kTileCols * t + i] : m;
    out[t] = m;
  }
}

// Block rows [tr_begin, tr_end) x block columns [tc_begin, tc_end).
struct Rect {
  int64_t tr_begin, tr_end, tc_begin, tc_end;
};

std::vector<Rect> AmaxRects(const Grid& g) {
  const int64_t first_tr = g.begin / g.cols / g.block_rows;
  const int64_t last_tr = (g.end - 1) / g.cols / g.block_rows;
  // About kChunkElements per rectangle, but rows of at least kMinRectCols columns: a
  // rectangle reads block_rows row segments at once, and short segments defeat prefetching.
  const int64_t rect_cols = std::max(kChunkElements / g.block_rows, kMinRectCols);
  const int64_t tc_step = std::clamp<int64_t>(rect_cols / g.block_cols, 1, g.grid_cols);
  const int64_t tr_step =
      tc_step == g.grid_cols ? std::max<int64_t>(1, kChunkElements / (g.block_rows * g.grid_cols * g.block_cols)) : 1;
  std::vector<Rect> rects;
  for (int64_t tr = first_tr; tr <= last_tr; tr += tr_step) {
    for (int64_t tc = 0; tc < g.grid_cols; tc += tc_step) {
      rects.push_back({tr, std::min(last_tr + 1, tr + tr_step), tc, std::min(g.grid_cols, tc + tc_step)});
    }
  }
  return rects;
}

// The fragment's columns [first, last) on `row` (empty when the row is outside it).
void FragmentCols(const Grid& g, int64_t row, int64_t* first, int64_t* last) {
  const int64_t row_start = row * g.cols;
  *first = std::clamp(g.begin - row_start, int64_t{0}, g.cols);
  *last = std::clamp(g.end - row_start, int64_t{0}, g.cols);
}

// Block amaxes of one rectangle, written for its blocks that lie in the block range (those
// the fragment does not touch get 0); returns their max.
template <bool kFp16Model>
int32_t RectAmax(const Grid& g, const float* master, const Rect& rect, float* block_amax) {
  constexpr int64_t kBatch = 256;
  int32_t batch[kBatch];
  int32_t rect_max = 0;
  auto store = [&](int64_t tr, int64_t tc, int32_t raw) {
    const int32_t m = ModelAmaxOfRaw<kFp16Model>(raw);
    const int64_t global = tr * g.grid_cols + tc;
    if (global >= g.range.begin && global < g.range.end) block_amax[global - g.range.begin] = BitsFloat(m);
    rect_max = std::max(rect_max, m);
  };
  if (g.block_rows == 1) {  // 1xN blocks: reduce each block of each row directly
    const int64_t bc = g.block_cols;
    for (int64_t row = rect.tr_begin; row < rect.tr_end; ++row) {
      int64_t first, last;
      FragmentCols(g, row, &first, &last);
      // Blocks wholly inside the fragment go through the fixed-width kernel.
      const int64_t whole_begin = std::clamp(CeilDiv(first, bc), rect.tc_begin, rect.tc_end);
      const int64_t whole_end = bc == 32 ? std::clamp(last / bc, whole_begin, rect.tc_end) : whole_begin;
      for (int64_t tc = rect.tc_begin; tc < rect.tc_end; ++tc) {
        if (tc == whole_begin && whole_end > whole_begin) {
          for (int64_t b = whole_begin; b < whole_end; b += kBatch) {
            const int64_t n = std::min(kBatch, whole_end - b);
            WholeBlocks32Amax(master + (row * g.cols + b * bc - g.begin), n, batch);
            for (int64_t i = 0; i < n; ++i) store(row, b + i, batch[i]);
          }
          tc = whole_end - 1;
          continue;
        }
        const int64_t lo = std::max(first, tc * bc);
        const int64_t hi = std::min(last, (tc + 1) * bc);
        store(row, tc, lo < hi ? RawAmax(master + (row * g.cols + lo - g.begin), hi - lo) : 0);
      }
    }
    return rect_max;
  }
  // 2D tiles: running max per column over the tile's rows, then per tile over its columns.
  const int64_t col_lo = rect.tc_begin * g.block_cols;
  const int64_t col_hi = std::min(g.cols, rect.tc_end * g.block_cols);
  const int64_t whole_tiles = (col_hi - col_lo) / g.block_cols;  // the last tile may be partial
  std::vector<int32_t> colmax(static_cast<size_t>(col_hi - col_lo));
  for (int64_t tr = rect.tr_begin; tr < rect.tr_end; ++tr) {
    std::fill(colmax.begin(), colmax.end(), 0);
    const int64_t row_end = std::min(g.rows, (tr + 1) * g.block_rows);
    for (int64_t row = tr * g.block_rows; row < row_end; ++row) {
      int64_t first, last;
      FragmentCols(g, row, &first, &last);
      const int64_t lo = std::max(first, col_lo);
      const int64_t hi = std::min(last, col_hi);
      if (lo >= hi) continue;
      UpdateColumnMax(master + (row * g.cols + lo - g.begin), colmax.data() + (lo - col_lo), hi - lo);
    }
    int64_t tc = rect.tc_begin;
    for (int64_t t = 0; t < whole_tiles && (g.block_cols == 16 || g.block_cols == 128); t += kBatch) {
      const int64_t n = std::min(kBatch, whole_tiles - t);
      const int32_t* src = colmax.data() + t * g.block_cols;
      if (g.block_cols == 16) {
        WholeTilesMax<16>(src, n, batch);
      } else {
        WholeTilesMax<128>(src, n, batch);
      }
      for (int64_t i = 0; i < n; ++i) store(tr, tc++, batch[i]);
    }
    for (; tc < rect.tc_end; ++tc) {
      const int64_t lo = tc * g.block_cols - col_lo;
      const int64_t hi = std::min(g.cols, (tc + 1) * g.block_cols) - col_lo;
      store(tr, tc, MaxOf(colmax.data() + lo, hi - lo));
    }
  }
  return rect_max;
}

// ---- Block scales (the vectorized pass over the block range).

MAINSTAY_VECTOR_CLONES void MxfpScales(const float* amax, uint8_t* scales, float* mult, int64_t n) {
  const float inv_max = 1.0f / kE4M3Max;  // MxfpBlockScale's fl(1 / fp8_max)
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t e = E8M0RoundUpBits(FloatBits(amax[i] * inv_max));
    scales[i] = e;
    mult[i] = MxfpMultiplierValue(e);
  }
}

// Nvfp4TileScaleE4M3 and Nvfp4TileEncode.
MAINSTAY_VECTOR_CLONES void Nvfp4Scales(const float* amax, float s_enc, float s_dec, uint8_t* scales, float* enc,
                                        int64_t n) {
  const float one_sixth = 1.0f / 6.0f;
  const float factor = s_enc * one_sixth;
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t s = E4M3Bits(MinFltMaxValue(amax[i] * factor));
    scales[i] = s;
    const float sv = E4M3Value(s);
    const float e = MinFltMaxValue(1.0f / (sv * s_dec));
    enc[i] = BitsFloat(SelectBits(sv > 0.0f, FloatBits(e), FloatBits(FLT_MAX)));
  }
}

void Fp8BlockScales(const float* amax, uint8_t* scales, float* mult, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float scale = CurrentScalingScale(amax[i], kE4M3Max, /*pow2=*/true);
    const float scale_inv = ScaleInv(scale);
    memcpy(scales + 4 * i, &scale_inv, sizeof(scale_inv));
    mult[i] = scale;
  }
}

// ---- Element passes.

// Calls op(i, v) for the columns c0 + i of [c0, c1) of one row, v = block_value[the
// column's block - c0's block]. Whole blocks run with the fixed trip count kBlockCols.
template <int kBlockCols, typename Op>
inline void ForEachBlockOfPiece(int64_t c0, int64_t c1, const float* block_value, const Op& op) {
  int64_t c = c0;
  int64_t b = 0;
  const int64_t lead_end = std::min(c1, (c0 / kBlockCols + 1) * kBlockCols);
  if (c0 % kBlockCols != 0 || lead_end - c0 < kBlockCols) {  // a partial first block
    const float v = block_value[b++];
    for (; c < lead_end; ++c) op(c - c0, v);
  }
  for (; c + kBlockCols <= c1; c += kBlockCols) {
    const float v = block_value[b++];
    for (int64_t i = 0; i < kBlockCols; ++i) op(c - c0 + i, v);
  }
  if (c < c1) {
    const float v = block_value[b];
    for (; c < c1; ++c) op(c - c0, v);
  }
}

template <bool kFp16Model, int kBlockCols>
MAINSTAY_VECTOR_CLONES void QuantizeE4M3Piece(const float* __restrict src, int64_t c0, int64_t c1,
                                              const float* __restrict mult, uint8_t* __restrict dst) {
  ForEachBlockOfPiece<kBlockCols>(c0, c1, mult, [&](int64_t i, float m) {
    dst[i] = E4M3Bits(BitsFloat(ModelValueBits<kFp16Model>(FloatBits(src[i]))) * m);
  });
}

// 16-wide tiles are too short for a loop per tile: the multipliers are spread over the
// piece first, then one loop casts it.
template <bool kFp16Model, int kBlockCols>
MAINSTAY_VECTOR_CLONES void QuantizeE2M1Piece(const float* __restrict src, int64_t c0, int64_t c1,
                                              const float* __restrict enc, uint8_t* __restrict codes) {
  alignas(64) float spread[kPieceElements];
  ForEachBlockOfPiece<kBlockCols>(c0, c1, enc, [&](int64_t i, float e) { spread[i] = e; });
  for (int64_t i = 0; i < c1 - c0; ++i) {
    codes[i] = E2M1Bits(BitsFloat(ModelValueBits<kFp16Model>(FloatBits(src[i]))) * spread[i]);
  }
}

template <int kBlockCols>
MAINSTAY_VECTOR_CLONES void DequantizeE4M3Piece(const uint8_t* __restrict q, int64_t c0, int64_t c1,
                                                const float* __restrict scale, float* __restrict dst) {
  ForEachBlockOfPiece<kBlockCols>(c0, c1, scale, [&](int64_t i, float s) { dst[i] = E4M3Value(q[i]) * s; });
}

template <int kBlockCols>
MAINSTAY_VECTOR_CLONES void DequantizeE2M1Piece(const uint8_t* __restrict codes, int64_t c0, int64_t c1,
                                                const float* __restrict scale, float s_dec, float* __restrict dst) {
  alignas(64) float spread[kPieceElements];
  ForEachBlockOfPiece<kBlockCols>(c0, c1, scale, [&](int64_t i, float s) { spread[i] = s; });
  for (int64_t i = 0; i < c1 - c0; ++i) dst[i] = (E2M1Value(codes[i]) * spread[i]) * s_dec;
}

// Two codes per byte, the even fragment offset in the low nibble. Pieces of one chunk come
// in order, so a piece starting on an odd offset completes the byte its predecessor began.
MAINSTAY_VECTOR_CLONES void PackNibbles(const uint8_t* codes, int64_t n, int64_t offset, uint8_t* data) {
  int64_t k = 0;
  if (offset % 2 != 0 && n > 0) {
    data[offset / 2] = static_cast<uint8_t>(data[offset / 2] | (codes[0] << 4));
    k = 1;
  }
  uint8_t* dst = data + (offset + k) / 2;
  const uint8_t* src = codes + k;
  const int64_t pairs = (n - k) / 2;
  for (int64_t j = 0; j < pairs; ++j) dst[j] = static_cast<uint8_t>(src[2 * j] | (src[2 * j + 1] << 4));
  if ((n - k) % 2 != 0) dst[pairs] = src[2 * pairs];  // high nibble 0 until the next piece
}

MAINSTAY_VECTOR_CLONES void UnpackNibbles(const uint8_t* data, int64_t n, int64_t offset, uint8_t* codes) {
  int64_t k = 0;
  if (offset % 2 != 0 && n > 0) {
    codes[0] = static_cast<uint8_t>(data[offset / 2] >> 4);
    k = 1;
  }
  const uint8_t* src = data + (offset + k) / 2;
  uint8_t* dst = codes + k;
  const int64_t pairs = (n - k) / 2;
  for (int64_t j = 0; j < pairs; ++j) {
    dst[2 * j] = static_cast<uint8_t>(src[j] & 0xF);
    dst[2 * j + 1] = static_cast<uint8_t>(src[j] >> 4);
  }
  if ((n - k) % 2 != 0) dst[2 * pairs] = static_cast<uint8_t>(src[pairs] & 0xF);
}

// Runs fn(row, c0, c1, offset) over the row pieces of the fragment's fixed element chunks,
// chunk by chunk on the executor, pieces of one chunk in order.
template <typename Fn>
void ForEachChunkPiece(CpuExecutor* executor, const Grid& g, const Fn& fn) {
  const int64_t n = g.end - g.begin;
  ParallelFor(executor, CeilDiv(n, kChunkElements), [&](int64_t c) {
    const int64_t first = g.begin + c * kChunkElements;
    const int64_t last = std::min(g.end, first + kChunkElements);
    ForEachRowPiece(g.cols, first, last, g.begin, kPieceElements, fn);
  });
}

}  // namespace

absl::Status BlockPartialAmax(const Device& device, Format format, Format model_dtype, const Fragment& fragment,
                              std::span<const float> master, const AmaxOutputs& out) {
  const Grid g = MakeGrid(format, fragment);
  const bool fp16 = model_dtype == Format::kFP16;
  int32_t tensor_max = 0;
  if (g.range.size() > 0) {
    const std::vector<Rect> rects = AmaxRects(g);
    std::vector<int32_t> rect_max(rects.size(), 0);
    const auto rect_amax = fp16 ? RectAmax<true> : RectAmax<false>;
    ParallelFor(device.executor, static_cast<int64_t>(rects.size()), [&](int64_t i) {
      rect_max[static_cast<size_t>(i)] =
          rect_amax(g, master.data(), rects[static_cast<size_t>(i)], out.block_amax.data());
    });
    for (int32_t m : rect_max) tensor_max = std::max(tensor_max, m);
  }
  if (out.tensor_amax != nullptr) *out.tensor_amax = BitsFloat(static_cast<uint32_t>(tensor_max));
  return absl::OkStatus();
}

absl::Status BlockQuantize(const Device& device, Format format, Format model_dtype, const Fragment& fragment,
                           std::span<const float> master, const ScaleInputs& scales, const QuantizedOutputs& out) {
  const Grid g = MakeGrid(format, fragment);
  const bool fp16 = model_dtype == Format::kFP16;
  const int64_t blocks = g.range.size();
  float s_enc = 1.0f, s_dec = 1.0f;
  if (format == Format::kNVFP4) {
    s_enc = Nvfp4GlobalEncodeScale(scales.tensor_amax);
    s_dec = ScaleInv(s_enc);
    if (out.tensor_scale_inv != nullptr) *out.tensor_scale_inv = s_dec;
  }
  if (blocks == 0) return absl::OkStatus();

  // Block scales to the output, each block's element multiplier to `mult`.
  std::unique_ptr<float[]> mult(new float[static_cast<size_t>(blocks)]);
  ParallelFor(device.executor, CeilDiv(blocks, kBlockChunk), [&](int64_t c) {
    const int64_t i = c * kBlockChunk;
    const int64_t n = std::min(kBlockChunk, blocks - i);
    const float* amax = scales.block_amax.data() + i;
    switch (format) {
      case Format::kMXFP8:
        MxfpScales(amax, out.block_scales.data() + i, mult.get() + i, n);
        break;
      case Format::kFP8Block:
        Fp8BlockScales(amax, out.block_scales.data() + 4 * i, mult.get() + i, n);
        break;
      default:
        Nvfp4Scales(amax, s_enc, s_dec, out.block_scales.data() + i, mult.get() + i, n);
        break;
    }
  });

  // Element pass: each row piece reads the multipliers of its blocks straight from the table.
  const float* src = master.data();
  uint8_t* data = out.data.data();
  using E4M3Piece = void (*)(const float*, int64_t, int64_t, const float*, uint8_t*);
  const E4M3Piece e4m3_piece =
      format == Format::kMXFP8 ? (fp16 ? QuantizeE4M3Piece<true, 32> : QuantizeE4M3Piece<false, 32>)
                               : (fp16 ? QuantizeE4M3Piece<true, 128> : QuantizeE4M3Piece<false, 128>);
  const auto e2m1_piece = fp16 ? QuantizeE2M1Piece<true, 16> : QuantizeE2M1Piece<false, 16>;
  const bool use_avx512 = avx512::Enabled();
  ForEachChunkPiece(device.executor, g, [&](int64_t row, int64_t c0, int64_t c1, int64_t offset) {
    const float* piece_mult = mult.get() + g.RowBase(row) + c0 / g.block_cols;
    if (use_avx512 && format == Format::kNVFP4 && offset % 2 == 0) {
      avx512::QuantizeE2M1PiecePacked(src + offset, c0, c1, piece_mult, fp16, data + offset / 2);
    } else if (use_avx512 && format != Format::kNVFP4) {
      avx512::QuantizeE4M3Piece(src + offset, c0, c1, static_cast<int>(g.block_cols), piece_mult, fp16,
                                data + offset);
    } else if (format == Format::kNVFP4) {
      alignas(64) uint8_t codes[kPieceElements];
      e2m1_piece(src + offset, c0, c1, piece_mult, codes);
      PackNibbles(codes, c1 - c0, offset, data);
    } else {
      e4m3_piece(src + offset, c0, c1, piece_mult, data + offset);
    }
  });
  return absl::OkStatus();
}

absl::Status BlockDequantize(const Device& device, Format format, const Fragment& fragment,
                             const QuantizedInputs& in, std::span<float> out) {
  const Grid g = MakeGrid(format, fragment);
  const uint8_t* scales = in.block_scales.data();
  const uint8_t* data = in.data.data();
  float* dst = out.data();
  const bool use_avx512 = avx512::Enabled();
  const bool stream = avx512::StreamOutput(fragment.size() * 4);
  ForEachChunkPiece(device.executor, g, [&](int64_t row, int64_t c0, int64_t c1, int64_t offset) {
    // The dequantization factor of each block of the piece (at most kPieceElements / 16 + 2).
    alignas(64) float block_scale[kPieceElements / 16 + 2];
    const int64_t first = g.RowBase(row) + c0 / g.block_cols;
    const int64_t count = (c1 - 1) / g.block_cols - c0 / g.block_cols + 1;
    if (format == Format::kFP8Block) {
      memcpy(block_scale, scales + 4 * first, static_cast<size_t>(count) * sizeof(float));
    } else if (use_avx512) {
      avx512::DecodeBlockScales(scales + first, count, format == Format::kMXFP8, block_scale);
    } else {
      for (int64_t b = 0; b < count; ++b) {
        block_scale[b] = format == Format::kMXFP8 ? E8M0Value(scales[first + b]) : E4M3Value(scales[first + b]);
      }
    }
    if (use_avx512 && format == Format::kNVFP4 && offset % 2 == 0) {
      avx512::DequantizeE2M1PiecePacked(data + offset / 2, c0, c1, block_scale, in.tensor_scale_inv, dst + offset,
                                        stream);
    } else if (use_avx512 && format != Format::kNVFP4) {
      avx512::DequantizeE4M3Piece(data + offset, c0, c1, static_cast<int>(g.block_cols), block_scale, dst + offset,
                                  stream);
    } else if (format == Format::kNVFP4) {
      alignas(64) uint8_t codes[kPieceElements];
      UnpackNibbles(data, c1 - c0, offset, codes);
      DequantizeE2M1Piece<16>(codes, c0, c1, block_scale, in.tensor_scale_inv, dst + offset);
    } else if (format == Format::kMXFP8) {
      DequantizeE4M3Piece<32>(data + offset, c0, c1, block_scale, dst + offset);
    } else {
      DequantizeE4M3Piece<128>(data + offset, c0, c1, block_scale, dst + offset);
    }
  });
  return absl::OkStatus();
}

}  // namespace mainstay::kernels::cpu
