// Number formats a tensor can be published in, exactly as ../shared/FORMATS.md states them.
//
// A FormatDescriptor is static, immutable data: bits per element, block shape, scale type
// and amax scope. Byte offsets are always derived from element offsets through the
// descriptor (DataBytes), never stored beside them (DESIGN.md section 3).
//
// Thread safety: all functions are pure; descriptors live for the whole program.
#ifndef MAINSTAY_COMMON_FORMAT_H_
#define MAINSTAY_COMMON_FORMAT_H_

#include <cstdint>
#include <span>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace mainstay {

// Element types of data and scales.
enum class ElementType {
  kFloat32,
  kBFloat16,
  kFloat16,
  kE4M3,  // FP8 E4M3 (no inf, max 448)
  kE5M2,  // FP8 E5M2 (max 57344)
  kE2M1,  // FP4 E2M1 (max 6), two per byte, even element in the low nibble
  kE8M0,  // scale-only: power of two 2^(e-127), 0xFF = NaN
};

// How a format's scales are obtained.
enum class ScalingMode {
  kNone,     // bf16 / fp16: a plain cast
  kDelayed,  // FP32 per-tensor scale from an amax history
  kCurrent,  // FP32 per-tensor scale from this step's amax
  kBlock,    // one scale per block (mxfp8, fp8_block, nvfp4)
};

// Which amax a format needs, and so which reductions span daemons.
enum class AmaxScope {
  kNone,            // no amax
  kTensorHistory,   // whole tensor, recorded into a history (delayed scaling)
  kTensor,          // whole tensor, this step
  kBlock,           // per block only
  kBlockAndTensor,  // per block plus the whole tensor (nvfp4 global scale)
};

enum class Format {
  kBF16,
  kFP16,
  kFP8E4M3Delayed,
  kFP8E5M2Delayed,
  kFP8E4M3Current,
  kFP8E5M2Current,
  kMXFP8,     // E4M3 data, E8M0 scale per 32 consecutive elements of a row
  kFP8Block,  // E4M3 data, FP32 scale per 128x128 tile
  kNVFP4,     // E2M1 data, E4M3 scale per 16x16 tile + FP32 global scale
};

struct FormatDescriptor {
  Format format;
  absl::string_view name;        // canonical name used in specs, protos and the CLI
  ElementType element;          // type of the published data
  int bits_per_element;         // 16, 8 or 4
  ScalingMode scaling;
  AmaxScope amax_scope;
  // Block scales: one `block_scale` per block of block_rows x block_cols elements of the
  // 2D view. Both 0 when the format has no block scales.
  int block_rows;
  int block_cols;
  ElementType block_scale;      // meaningful only when block_rows > 0
  // One FP32 per-tensor scale (fp8 delayed/current: the scale; nvfp4: the global S_dec).
  bool tensor_scale;
  // rows and cols of the 2D view must be multiples of this (1 = any shape).
  int shape_multiple;
  bool requires_2d;             // 1-D tensors fall back to bf16

  bool has_block_scales() const { return block_rows > 0; }
};

// Descriptor of every format, in enum order.
std::span<const FormatDescriptor> AllFormats();
const FormatDescriptor& Describe(Format format);
absl::string_view FormatName(Format format);
// Parses a canonical name ("nvfp4", "fp8_e4m3_current", ...). Unknown -> INVALID_ARGUMENT
// listing the known names.
absl::StatusOr<Format> ParseFormat(absl::string_view name);

// Size in bits of one element of `type` (E8M0 and FP8 types: 8; E2M1: 4).
int BitsOf(ElementType type);
absl::string_view ElementTypeName(ElementType type);

// Bytes holding `elements` elements of `format`. Exact for every offset a Layout produces
// (those are multiples of 64 elements); odd counts of 4-bit elements round up.
int64_t DataBytes(Format format, int64_t elements);

// The 2D view every format works on: rows = product of all dimensions but the last,
// cols = the last dimension (a 1-D tensor is one row). TE's view of a weight [out, in].
struct Matrix2D {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t numel() const { return rows * cols; }
};
Matrix2D View2D(std::span<const int64_t> shape);

// OK if `format` can publish a tensor of `shape`; otherwise FAILED_PRECONDITION whose
// message is the reason (recorded as the fallback reason when a recipe falls back to bf16).
absl::Status CheckShapeSupported(Format format, std::span<const int64_t> shape);

// Block-scale grid of a tensor: [ceil(rows/block_rows), ceil(cols/block_cols)], compact
// row-major (the canonical layout; TE's padded/swizzled layouts are output options).
// {0, 0} for formats without block scales.
Matrix2D ScaleGrid(Format format, Matrix2D view);

// A half-open range [begin, end) of indices; used for elements, bytes and scale blocks.
struct IndexRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
  bool empty() const { return end <= begin; }
  friend bool operator==(const IndexRange&, const IndexRange&) = default;
};

// Blocks of the compact scale grid touched by the element fragment [begin, end) of the
// flattened tensor, as the smallest row-major index range holding all of them. Exact and
// disjoint between fragments for 1xN blocks (mxfp8) when fragment ends are multiples of
// the block width; 2D tiles are shared by fragments that cut through them (their partial
// amaxes are MAX-reduced). Empty for formats without block scales or an empty fragment.
IndexRange ScaleBlockRange(Format format, Matrix2D view, IndexRange fragment);

}  // namespace mainstay

#endif  // MAINSTAY_COMMON_FORMAT_H_
