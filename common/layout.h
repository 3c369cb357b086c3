// The layout engine: a pure function (tensors, D, policy, bucket size) -> Layout.
//
// DESIGN.md section 3. Tensors are grouped by published format into buffers (so a bucket
// holds one format and byte offsets derive exactly from element offsets), taken in reverse
// registration order, and cut into buckets. Each bucket is padded so it splits into D
// equal shards; shard r belongs to trainer rank r. Every offset in a Layout is an ELEMENT
// offset; byte offsets come from DataBytes(bucket.format, elements), never stored.
//
// Guarantees (tested in tests/unit/layout_test.cc):
//  - tensor starts are multiples of kTensorAlignment (64) elements;
//  - bucket sizes are multiples of BucketAlignment(D) = lcm(64*D, 128), so every shard is
//    a whole number of 64-element groups and packed 4-bit shard r is exactly element
//    shard r / 2;
//  - each tensor's fragments partition it exactly (no gap, no overlap);
//  - with kWholeTensor no tensor is split across shards.
//
// Ownership: a Layout is a plain value. Thread safety: ComputeLayout is pure and may be
// called concurrently. Errors: INVALID_ARGUMENT naming the offending field (for example
// "tensors[3].shape[1]") for any bad input; it never crashes on user input.
#ifndef MAINSTAY_COMMON_LAYOUT_H_
#define MAINSTAY_COMMON_LAYOUT_H_

#include <cstdint>
#include <span>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/statusor.h"
#include "common/format.h"
#include "common/tensor_spec.h"

namespace mainstay {

enum class LayoutPolicy {
  kFlat,         // Megatron-style: tensors may straddle shards (a daemon owns fragments)
  kWholeTensor,  // MS-AMP-style: each tensor owned whole by one shard
};
absl::string_view LayoutPolicyName(LayoutPolicy policy);
// "flat" or "whole_tensor"; anything else -> INVALID_ARGUMENT listing both.
absl::StatusOr<LayoutPolicy> ParseLayoutPolicy(absl::string_view name);

inline constexpr int64_t kTensorAlignment = 64;
inline constexpr int64_t kMaxTotalElements = int64_t{1} << 40;
inline constexpr int64_t kMaxDataParallelSize = 65536;

// lcm(64 * D, 128): the multiple every bucket size is padded to.
int64_t BucketAlignment(int64_t data_parallel_size);
// max(40e6, 1e6 * D) elements.
int64_t DefaultBucketNumel(int64_t data_parallel_size);

struct LayoutOptions {
  int64_t data_parallel_size = 1;  // D, number of trainer ranks (= shards per bucket)
  LayoutPolicy policy = LayoutPolicy::kFlat;
  int64_t bucket_numel = 0;        // elements; 0 means DefaultBucketNumel(D)
};

// The part of one tensor that lies in one shard.
struct TensorFragment {
  int32_t tensor = 0;          // index into Layout::tensors
  IndexRange elements;         // range of the flattened tensor
  int64_t bucket_offset = 0;   // bucket element offset of elements.begin
  friend bool operator==(const TensorFragment&, const TensorFragment&) = default;
};

struct Shard {
  int32_t rank = 0;                      // trainer rank r owning this shard
  IndexRange elements;                   // bucket element range [r * shard_numel, (r+1) * shard_numel)
  std::vector<TensorFragment> fragments; // in bucket order
  int64_t load() const;                  // elements of real tensor data (padding excluded)
  friend bool operator==(const Shard&, const Shard&) = default;
};

struct Bucket {
  int32_t index = 0;
  Format format = Format::kBF16;    // every tensor in the bucket is published in this format
  int64_t numel = 0;                // padded size = D * shard_numel
  int64_t shard_numel = 0;
  int64_t data_numel = 0;           // sum of the tensors' sizes (the rest is padding)
  std::vector<int32_t> tensors;     // tensor indices in bucket order
  std::vector<Shard> shards;        // exactly D
  int64_t padding() const { return numel - data_numel; }
  friend bool operator==(const Bucket&, const Bucket&) = default;
};

struct LayoutTensor {
  std::string name;
  std::vector<int64_t> shape;
  Format format = Format::kBF16;
  int64_t numel = 0;
  int32_t bucket = 0;          // index into Layout::buckets
  int64_t bucket_offset = 0;   // element offset of the tensor's first element in its bucket
  int32_t param_group = 0;     // TensorSpec::param_group: whose step hyperparameters apply
  friend bool operator==(const LayoutTensor&, const LayoutTensor&) = default;
};

struct Layout {
  LayoutPolicy policy = LayoutPolicy::kFlat;
  int64_t data_parallel_size = 1;
  int64_t bucket_numel = 0;           // the threshold used (after defaulting)
  std::vector<LayoutTensor> tensors;  // registration order, as given
  std::vector<Bucket> buckets;
  friend bool operator==(const Layout&, const Layout&) = default;
};

absl::StatusOr<Layout> ComputeLayout(std::span<const TensorSpec> tensors, const LayoutOptions& options);

// ---- Derived quantities (never stored).

// Bytes of shard `rank` inside the bucket's packed data buffer.
IndexRange ShardByteRange(const Bucket& bucket, int32_t rank);
// Bytes of a fragment inside its shard's packed data buffer.
IndexRange FragmentShardByteRange(const Bucket& bucket, const Shard& shard, const TensorFragment& f);
// Scale blocks of the fragment's tensor touched by the fragment (see ScaleBlockRange).
IndexRange FragmentScaleBlocks(const Layout& layout, const TensorFragment& f);

struct ShardLoadStats {
  int64_t max = 0;     // elements in the most loaded shard
  double mean = 0;     // mean elements per shard
  double imbalance() const { return mean > 0 ? max / mean : 1.0; }
};
ShardLoadStats LoadStats(const Bucket& bucket);

int64_t TotalNumel(const Layout& layout);      // padded elements over all buckets
int64_t TotalDataNumel(const Layout& layout);  // real elements over all buckets

}  // namespace mainstay

#endif  // MAINSTAY_COMMON_LAYOUT_H_
