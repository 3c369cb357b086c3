// Trainer-side buffers derived from a Layout: flat bucket buffers, tensor <-> bucket copies and
// shard sub-spans. A bucket buffer holds `bucket.numel` elements; tensor t lives at
// [t.bucket_offset, t.bucket_offset + t.numel) (row-major, flattened) and everything else is
// padding that stays zero. Shard r of the bucket is [r * shard_numel, (r + 1) * shard_numel).
//
// Ownership: every span is caller-owned; nothing here keeps a pointer after it returns.
// Thread safety: pure functions; concurrent calls on distinct output buffers are safe.
// Errors: NOT_FOUND for an unknown tensor name; INVALID_ARGUMENT for an index out of range or a
// span of the wrong size (nothing is written then).
#ifndef MAINSTAY_CLIENT_BUFFERS_H_
#define MAINSTAY_CLIENT_BUFFERS_H_

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/format.h"
#include "common/layout.h"
#include "mainstay/export.h"

namespace mainstay {

// Caller-owned elements of one type, as pushed to a daemon: kFloat32, kBFloat16 or kFloat16
// (16-bit types as their raw bits, little-endian).
struct ElementSpan {
  const void* data = nullptr;
  ElementType type = ElementType::kFloat32;
  int64_t numel = 0;

  static ElementSpan Fp32(std::span<const float> v) {
    return {v.data(), ElementType::kFloat32, static_cast<int64_t>(v.size())};
  }
  static ElementSpan Bf16(std::span<const uint16_t> v) {
    return {v.data(), ElementType::kBFloat16, static_cast<int64_t>(v.size())};
  }
  static ElementSpan Fp16(std::span<const uint16_t> v) {
    return {v.data(), ElementType::kFloat16, static_cast<int64_t>(v.size())};
  }
  int64_t element_bytes() const { return BitsOf(type) / 8; }
  int64_t bytes() const { return numel * element_bytes(); }
  // Elements [begin, begin + n) of this span (unchecked).
  ElementSpan Sub(int64_t begin, int64_t n) const {
    return {static_cast<const char*>(data) + begin * element_bytes(), type, n};
  }
};

// The layout a coordinator computes for a job spec (docs/job_spec.md JSON), offline:
// ParseJobSpecJson + ResolveJob. `data_parallel_size` > 0 overrides the spec's D.
// INVALID_ARGUMENT naming the offending JSON field.
MAINSTAY_CLIENT_EXPORT absl::StatusOr<Layout> ComputeJobLayout(std::string_view spec_json,
                                                               int64_t data_parallel_size = 0);

// Index of the tensor called `name` in layout.tensors; NOT_FOUND when there is none.
MAINSTAY_CLIENT_EXPORT absl::StatusOr<int32_t> FindTensor(const Layout& layout, std::string_view name);

// Element range of tensor `tensor` inside its bucket. INVALID_ARGUMENT for a bad index.
MAINSTAY_CLIENT_EXPORT absl::StatusOr<IndexRange> TensorBucketRange(const Layout& layout, int32_t tensor);

// Element range of shard `shard` of bucket `bucket`. INVALID_ARGUMENT for bad indices.
MAINSTAY_CLIENT_EXPORT absl::StatusOr<IndexRange> ShardBucketRange(const Layout& layout, int32_t bucket,
                                                                   int32_t shard);

// A zero-filled FP32 buffer of bucket `bucket` (numel elements, padding included).
MAINSTAY_CLIENT_EXPORT absl::StatusOr<std::vector<float>> MakeBucketBuffer(const Layout& layout, int32_t bucket);

// Copies `values` (tensor.numel elements, row-major) into the tensor's place in `bucket_buffer`
// (the tensor's bucket, numel elements). Padding is not touched.
MAINSTAY_CLIENT_EXPORT absl::Status CopyTensorToBucket(const Layout& layout, int32_t tensor,
                                                       std::span<const float> values,
                                                       std::span<float> bucket_buffer);
MAINSTAY_CLIENT_EXPORT absl::Status CopyTensorToBucket(const Layout& layout, int32_t tensor,
                                                       std::span<const uint16_t> values,
                                                       std::span<uint16_t> bucket_buffer);
// Copies the tensor's elements out of `bucket_buffer` into `out` (tensor.numel elements).
MAINSTAY_CLIENT_EXPORT absl::Status CopyTensorFromBucket(const Layout& layout, int32_t tensor,
                                                         std::span<const float> bucket_buffer,
                                                         std::span<float> out);
MAINSTAY_CLIENT_EXPORT absl::Status CopyTensorFromBucket(const Layout& layout, int32_t tensor,
                                                         std::span<const uint16_t> bucket_buffer,
                                                         std::span<uint16_t> out);

// Shard `shard` of a bucket buffer (shard_numel elements). INVALID_ARGUMENT for bad indices or
// a buffer that is not the bucket's size.
template <typename T>
absl::StatusOr<std::span<T>> ShardSpan(const Layout& layout, int32_t bucket, int32_t shard,
                                       std::span<T> bucket_buffer) {
  absl::StatusOr<IndexRange> range = ShardBucketRange(layout, bucket, shard);
  if (!range.ok()) return range.status();
  if (static_cast<int64_t>(bucket_buffer.size()) != layout.buckets[bucket].numel) {
    return absl::InvalidArgumentError("bucket_buffer: size does not match the bucket's numel");
  }
  return bucket_buffer.subspan(range->begin, range->size());
}

}  // namespace mainstay

#endif  // MAINSTAY_CLIENT_BUFFERS_H_
