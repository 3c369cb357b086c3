// PublishedTensors / DequantizedTensor (mainstay/published.h).
#include "mainstay/published.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/casts.h"

namespace mainstay {
namespace {

std::vector<uint8_t> Bytes(const void* p, size_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  return std::vector<uint8_t>(b, b + n);
}

NamedTensor Owned(std::string name, std::string dtype, std::vector<int64_t> shape, std::vector<uint8_t> bytes) {
  NamedTensor t;
  t.name = std::move(name);
  t.dtype = std::move(dtype);
  t.shape = std::move(shape);
  t.owned = std::move(bytes);
  return t;
}

NamedTensor Scalar(std::string name, float value) { return Owned(std::move(name), "F32", {}, Bytes(&value, sizeof(value))); }

}  // namespace

absl::StatusOr<std::vector<NamedTensor>> PublishedTensors(const PulledBucket& bucket, int32_t tensor) {
  absl::StatusOr<TensorView> view = bucket.Tensor(tensor);
  if (!view.ok()) return view.status();
  if (!view->complete) {
    return absl::FailedPreconditionError(absl::StrCat("tensor ", view->info->name, ": the pulled shards of bucket ",
                                                      bucket.bucket(), " do not cover all of it"));
  }
  const LayoutTensor& t = *view->info;
  std::vector<NamedTensor> out;
  NamedTensor data;
  data.name = t.name;
  data.dtype = "U8";
  data.shape = t.shape;
  data.view = view->data;
  switch (view->format) {
    case Format::kBF16:
      data.dtype = "BF16";
      out.push_back(std::move(data));
      return out;
    case Format::kFP16:
      data.dtype = "F16";
      out.push_back(std::move(data));
      return out;
    case Format::kFP8E4M3Delayed:
    case Format::kFP8E4M3Current:
    case Format::kFP8E5M2Delayed:
    case Format::kFP8E5M2Current: {
      const bool e5m2 = view->format == Format::kFP8E5M2Delayed || view->format == Format::kFP8E5M2Current;
      data.dtype = e5m2 ? "F8_E5M2" : "F8_E4M3";
      out.push_back(std::move(data));
      out.push_back(Scalar(t.name + "_scale_inv", view->scale_inv));
      return out;
    }
    default:
      break;
  }
  absl::StatusOr<std::vector<uint8_t>> grid = bucket.TensorScaleGrid(tensor);
  if (!grid.ok()) return grid.status();
  const Matrix2D g = ScaleGrid(view->format, View2D(t.shape));
  const int64_t rows = View2D(t.shape).rows, cols = View2D(t.shape).cols;
  switch (view->format) {
    case Format::kFP8Block:
      data.dtype = "F8_E4M3";
      out.push_back(std::move(data));
      out.push_back(Owned(t.name + "_scale_inv", "F32", {g.rows, g.cols}, *std::move(grid)));
      return out;
    case Format::kMXFP8:
      data.dtype = "F8_E4M3";
      out.push_back(std::move(data));
      out.push_back(Owned(t.name + "_scale", "U8", {g.rows, g.cols}, *std::move(grid)));
      return out;
    case Format::kNVFP4: {
      data.shape = {rows, cols / 2};
      out.push_back(std::move(data));
      // The 16x16 tiles' scales, each on its 16 rows: [rows, cols / 16].
      std::vector<uint8_t> expanded(static_cast<size_t>(rows * g.cols));
      for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(expanded.data() + r * g.cols, grid->data() + (r / 16) * g.cols, static_cast<size_t>(g.cols));
      }
      out.push_back(Owned(t.name + "_scale", "F8_E4M3", {rows, g.cols}, std::move(expanded)));
      out.push_back(Scalar(t.name + "_scale_2", view->scale_inv));
      return out;
    }
    default:
      return absl::UnimplementedError(
          absl::StrCat("tensor ", t.name, ": no published convention for format ", FormatName(view->format)));
  }
}

absl::StatusOr<NamedTensor> DequantizedTensor(const PulledBucket& bucket, int32_t tensor, bool bf16) {
  absl::StatusOr<TensorView> view = bucket.Tensor(tensor);
  if (!view.ok()) return view.status();
  const LayoutTensor& t = *view->info;
  if (bf16 && view->format == Format::kBF16 && view->complete) {
    NamedTensor same;
    same.name = t.name;
    same.dtype = "BF16";
    same.shape = t.shape;
    same.view = view->data;
    return same;
  }
  absl::StatusOr<std::vector<float>> values = bucket.Dequantize(tensor);
  if (!values.ok()) return values.status();
  if (!bf16) return Owned(t.name, "F32", t.shape, Bytes(values->data(), values->size() * sizeof(float)));
  std::vector<uint8_t> bits(values->size() * 2);
  for (size_t i = 0; i < values->size(); ++i) {
    const uint16_t b = kernels::FloatToBf16((*values)[i]);
    std::memcpy(bits.data() + 2 * i, &b, 2);
  }
  return Owned(t.name, "BF16", t.shape, std::move(bits));
}

}  // namespace mainstay
