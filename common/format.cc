#include "common/format.h"

#include <array>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace mainstay {
namespace {

using E = ElementType;
using S = ScalingMode;
using A = AmaxScope;

// Indexed by Format. FORMATS.md is the source of every number here.
constexpr std::array<FormatDescriptor, 9> kFormats = {{
    {Format::kBF16, "bf16", E::kBFloat16, 16, S::kNone, A::kNone, 0, 0, E::kFloat32, false, 1, false},
    {Format::kFP16, "fp16", E::kFloat16, 16, S::kNone, A::kNone, 0, 0, E::kFloat32, false, 1, false},
    {Format::kFP8E4M3Delayed, "fp8_e4m3_delayed", E::kE4M3, 8, S::kDelayed, A::kTensorHistory, 0, 0,
     E::kFloat32, true, 1, false},
    {Format::kFP8E5M2Delayed, "fp8_e5m2_delayed", E::kE5M2, 8, S::kDelayed, A::kTensorHistory, 0, 0,
     E::kFloat32, true, 1, false},
    {Format::kFP8E4M3Current, "fp8_e4m3_current", E::kE4M3, 8, S::kCurrent, A::kTensor, 0, 0,
     E::kFloat32, true, 1, false},
    {Format::kFP8E5M2Current, "fp8_e5m2_current", E::kE5M2, 8, S::kCurrent, A::kTensor, 0, 0,
     E::kFloat32, true, 1, false},
    {Format::kMXFP8, "mxfp8", E::kE4M3, 8, S::kBlock, A::kBlock, 1, 32, E::kE8M0, false, 32, true},
    {Format::kFP8Block, "fp8_block", E::kE4M3, 8, S::kBlock, A::kBlock, 128, 128, E::kFloat32, false,
     1, false},
    {Format::kNVFP4, "nvfp4", E::kE2M1, 4, S::kBlock, A::kBlockAndTensor, 16, 16, E::kE4M3, true, 16,
     true},
}};

constexpr bool DescriptorsInEnumOrder() {
  for (size_t i = 0; i < kFormats.size(); ++i) {
    if (static_cast<size_t>(kFormats[i].format) != i) return false;
  }
  return true;
}
static_assert(DescriptorsInEnumOrder(), "kFormats must be indexed by Format");

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

std::span<const FormatDescriptor> AllFormats() { return kFormats; }

const FormatDescriptor& Describe(Format format) { return kFormats[static_cast<size_t>(format)]; }

absl::string_view FormatName(Format format) { return Describe(format).name; }

absl::StatusOr<Format> ParseFormat(absl::string_view name) {
  for (const FormatDescriptor& d : kFormats) {
    if (d.name == name) return d.format;
  }
  std::vector<absl::string_view> names;
  for (const FormatDescriptor& d : kFormats) names.push_back(d.name);
  return absl::InvalidArgumentError(absl::StrCat("unknown format '", name,
                                                 "'; known formats: ", absl::StrJoin(names, ", ")));
}

int BitsOf(ElementType type) {
  switch (type) {
    case E::kFloat32:
      return 32;
    case E::kBFloat16:
    case E::kFloat16:
      return 16;
    case E::kE4M3:
    case E::kE5M2:
    case E::kE8M0:
      return 8;
    case E::kE2M1:
      return 4;
  }
  return 0;
}

absl::string_view ElementTypeName(ElementType type) {
  switch (type) {
    case E::kFloat32:
      return "fp32";
    case E::kBFloat16:
      return "bf16";
    case E::kFloat16:
      return "fp16";
    case E::kE4M3:
      return "e4m3";
    case E::kE5M2:
      return "e5m2";
    case E::kE2M1:
      return "e2m1";
    case E::kE8M0:
      return "e8m0";
  }
  return "?";
}

int64_t DataBytes(Format format, int64_t elements) {
  return CeilDiv(elements * Describe(format).bits_per_element, 8);
}

Matrix2D View2D(std::span<const int64_t> shape) {
  if (shape.empty()) return {1, 1};  // a scalar
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
  return {rows, shape.back()};
}

absl::Status CheckShapeSupported(Format format, std::span<const int64_t> shape) {
  const FormatDescriptor& d = Describe(format);
  auto shape_str = [&] { return absl::StrCat("[", absl::StrJoin(shape, ", "), "]"); };
  if (d.requires_2d && shape.size() < 2) {
    return absl::FailedPreconditionError(
        absl::StrCat(d.name, " needs a 2-D tensor; shape ", shape_str(), " has ", shape.size(),
                     " dimension(s)"));
  }
  if (d.shape_multiple > 1) {
    Matrix2D v = View2D(shape);
    if (v.rows % d.shape_multiple != 0 || v.cols % d.shape_multiple != 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          d.name, " needs rows and cols multiples of ", d.shape_multiple, "; shape ", shape_str(),
          " is ", v.rows, " x ", v.cols));
    }
  }
  return absl::OkStatus();
}

Matrix2D ScaleGrid(Format format, Matrix2D view) {
  const FormatDescriptor& d = Describe(format);
  if (!d.has_block_scales()) return {0, 0};
  return {CeilDiv(view.rows, d.block_rows), CeilDiv(view.cols, d.block_cols)};
}

IndexRange ScaleBlockRange(Format format, Matrix2D view, IndexRange fragment) {
  const FormatDescriptor& d = Describe(format);
  if (!d.has_block_scales() || fragment.empty() || view.cols <= 0) return {};
  const int64_t br = d.block_rows, bc = d.block_cols;
  const int64_t tile_cols = CeilDiv(view.cols, bc);
  const int64_t r0 = fragment.begin / view.cols, c0 = fragment.begin % view.cols;
  const int64_t r1 = (fragment.end - 1) / view.cols, c1 = (fragment.end - 1) % view.cols;
  const int64_t tr0 = r0 / br, tr1 = r1 / br;
  // A later row of the fragment in the first tile row starts at column 0; an earlier row
  // in the last tile row runs to the last column.
  const bool first_has_full_start = r0 + 1 <= r1 && (r0 + 1) / br == tr0;
  const bool last_has_full_end = r1 - 1 >= r0 && (r1 - 1) / br == tr1;
  const int64_t lo = tr0 * tile_cols + (first_has_full_start ? 0 : c0 / bc);
  const int64_t hi = tr1 * tile_cols + (last_has_full_end ? tile_cols - 1 : c1 / bc);
  return {lo, hi + 1};
}

}  // namespace mainstay
