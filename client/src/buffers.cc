#include "mainstay/buffers.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "common/status.h"

namespace mainstay {
namespace {

absl::Status CheckTensor(const Layout& layout, int32_t tensor) {
  if (tensor < 0 || tensor >= static_cast<int32_t>(layout.tensors.size())) {
    return InvalidArgumentError("tensor", "index ", tensor, " is not in [0, ", layout.tensors.size(), ")");
  }
  const LayoutTensor& t = layout.tensors[tensor];
  if (t.bucket < 0 || t.bucket >= static_cast<int32_t>(layout.buckets.size())) {
    return InvalidArgumentError("tensor", "tensor ", tensor, " names bucket ", t.bucket, " outside the layout");
  }
  return absl::OkStatus();
}

absl::Status CheckBucket(const Layout& layout, int32_t bucket) {
  if (bucket < 0 || bucket >= static_cast<int32_t>(layout.buckets.size())) {
    return InvalidArgumentError("bucket", "index ", bucket, " is not in [0, ", layout.buckets.size(), ")");
  }
  return absl::OkStatus();
}

// The tensor's range, after checking both spans' sizes.
absl::StatusOr<IndexRange> CheckCopy(const Layout& layout, int32_t tensor, size_t tensor_size, size_t bucket_size) {
  MAINSTAY_RETURN_IF_ERROR(CheckTensor(layout, tensor));
  const LayoutTensor& t = layout.tensors[tensor];
  const Bucket& b = layout.buckets[t.bucket];
  if (static_cast<int64_t>(tensor_size) != t.numel) {
    return InvalidArgumentError("values", "tensor ", t.name, " has ", t.numel, " elements, got ", tensor_size);
  }
  if (static_cast<int64_t>(bucket_size) != b.numel) {
    return InvalidArgumentError("bucket_buffer", "bucket ", b.index, " has ", b.numel, " elements, got ", bucket_size);
  }
  return IndexRange{t.bucket_offset, t.bucket_offset + t.numel};
}

template <typename T>
absl::Status CopyIn(const Layout& layout, int32_t tensor, std::span<const T> values, std::span<T> bucket_buffer) {
  MAINSTAY_ASSIGN_OR_RETURN(IndexRange r, CheckCopy(layout, tensor, values.size(), bucket_buffer.size()));
  std::copy(values.begin(), values.end(), bucket_buffer.begin() + r.begin);
  return absl::OkStatus();
}

template <typename T>
absl::Status CopyOut(const Layout& layout, int32_t tensor, std::span<const T> bucket_buffer, std::span<T> out) {
  MAINSTAY_ASSIGN_OR_RETURN(IndexRange r, CheckCopy(layout, tensor, out.size(), bucket_buffer.size()));
  std::copy(bucket_buffer.begin() + r.begin, bucket_buffer.begin() + r.end, out.begin());
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Layout> ComputeJobLayout(std::string_view spec_json, int64_t data_parallel_size) {
  MAINSTAY_ASSIGN_OR_RETURN(JobSpec spec, ParseJobSpecJson(absl::string_view(spec_json.data(), spec_json.size())));
  if (data_parallel_size < 0) {
    return InvalidArgumentError("data_parallel_size", "must be >= 0, got ", data_parallel_size);
  }
  if (data_parallel_size > 0) spec.data_parallel_size = data_parallel_size;
  MAINSTAY_ASSIGN_OR_RETURN(ResolvedJob job, ResolveJob(spec));
  return std::move(job.layout);
}

absl::StatusOr<int32_t> FindTensor(const Layout& layout, std::string_view name) {
  for (size_t i = 0; i < layout.tensors.size(); ++i) {
    if (layout.tensors[i].name == name) return static_cast<int32_t>(i);
  }
  return absl::NotFoundError(absl::StrCat("no tensor named \"", absl::string_view(name.data(), name.size()),
                                          "\" in the layout"));
}

absl::StatusOr<IndexRange> TensorBucketRange(const Layout& layout, int32_t tensor) {
  MAINSTAY_RETURN_IF_ERROR(CheckTensor(layout, tensor));
  const LayoutTensor& t = layout.tensors[tensor];
  return IndexRange{t.bucket_offset, t.bucket_offset + t.numel};
}

absl::StatusOr<IndexRange> ShardBucketRange(const Layout& layout, int32_t bucket, int32_t shard) {
  MAINSTAY_RETURN_IF_ERROR(CheckBucket(layout, bucket));
  const Bucket& b = layout.buckets[bucket];
  if (shard < 0 || static_cast<size_t>(shard) >= b.shards.size()) {
    return InvalidArgumentError("shard", "index ", shard, " is not in [0, ", b.shards.size(), ")");
  }
  return IndexRange{shard * b.shard_numel, (shard + 1) * b.shard_numel};
}

absl::StatusOr<std::vector<float>> MakeBucketBuffer(const Layout& layout, int32_t bucket) {
  MAINSTAY_RETURN_IF_ERROR(CheckBucket(layout, bucket));
  return std::vector<float>(layout.buckets[bucket].numel, 0.0f);
}

absl::Status CopyTensorToBucket(const Layout& layout, int32_t tensor, std::span<const float> values,
                                std::span<float> bucket_buffer) {
  return CopyIn(layout, tensor, values, bucket_buffer);
}
absl::Status CopyTensorToBucket(const Layout& layout, int32_t tensor, std::span<const uint16_t> values,
                                std::span<uint16_t> bucket_buffer) {
  return CopyIn(layout, tensor, values, bucket_buffer);
}
absl::Status CopyTensorFromBucket(const Layout& layout, int32_t tensor, std::span<const float> bucket_buffer,
                                  std::span<float> out) {
  return CopyOut(layout, tensor, bucket_buffer, out);
}
absl::Status CopyTensorFromBucket(const Layout& layout, int32_t tensor, std::span<const uint16_t> bucket_buffer,
                                  std::span<uint16_t> out) {
  return CopyOut(layout, tensor, bucket_buffer, out);
}

}  // namespace mainstay
