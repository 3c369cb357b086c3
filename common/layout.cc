#include "common/layout.h"

#include <algorithm>
#include <numeric>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace mainstay {
namespace {

int64_t RoundUp(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

absl::Status ValidateInputs(std::span<const TensorSpec> tensors, const LayoutOptions& options) {
  if (options.data_parallel_size < 1 || options.data_parallel_size > kMaxDataParallelSize) {
    return InvalidArgumentError("data_parallel_size", "must be in [1, ", kMaxDataParallelSize,
                                "], got ", options.data_parallel_size);
  }
  if (options.bucket_numel < 0 || options.bucket_numel > kMaxTotalElements) {
    return InvalidArgumentError("bucket_numel", "must be 0 (default) or in [1, 2^40], got ",
                                options.bucket_numel);
  }
  if (options.policy != LayoutPolicy::kFlat && options.policy != LayoutPolicy::kWholeTensor) {
    return InvalidArgumentError("layout_policy", "unknown policy value ",
                                static_cast<int>(options.policy));
  }
  if (tensors.empty()) return InvalidArgumentError("tensors", "a job needs at least one tensor");
  if (tensors.size() > (size_t{1} << 24)) {
    return InvalidArgumentError("tensors", "at most 2^24 tensors, got ", tensors.size());
  }
  absl::flat_hash_map<absl::string_view, size_t> seen;
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorSpec& t = tensors[i];
    const std::string field = absl::StrCat("tensors[", i, "]");
    if (t.name.empty()) return InvalidArgumentError(absl::StrCat(field, ".name"), "must not be empty");
    auto [it, inserted] = seen.emplace(t.name, i);
    if (!inserted) {
      return InvalidArgumentError(absl::StrCat(field, ".name"), "duplicate name '", t.name,
                                  "' (also tensors[", it->second, "])");
    }
    if (t.param_group < 0 || t.param_group >= kMaxParamGroups) {
      return InvalidArgumentError(absl::StrCat(field, ".param_group"), "must be in [0, ", kMaxParamGroups, "), got ",
                                  t.param_group);
    }
    if (t.shape.empty()) {
      return InvalidArgumentError(absl::StrCat(field, ".shape"), "must have at least one dimension");
    }
    int64_t numel = 1;
    for (size_t d = 0; d < t.shape.size(); ++d) {
      const int64_t dim = t.shape[d];
      if (dim < 1) {
        return InvalidArgumentError(absl::StrCat(field, ".shape[", d, "]"), "must be positive, got ", dim);
      }
      // numel * dim > 2^40 without overflowing: both factors are positive.
      if (dim > kMaxTotalElements || numel > kMaxTotalElements / dim) {
        return InvalidArgumentError(absl::StrCat(field, ".shape"), "tensor '", t.name,
                                    "' has more than 2^40 elements");
      }
      numel *= dim;
    }
    total += RoundUp(numel, kTensorAlignment);
    if (total > kMaxTotalElements) {
      return InvalidArgumentError("tensors", "the job has more than 2^40 elements (limit reached at tensors[",
                                  i, "] '", t.name, "')");
    }
    if (static_cast<int>(t.format) < 0 || static_cast<size_t>(t.format) >= AllFormats().size()) {
      return InvalidArgumentError(absl::StrCat(field, ".format"), "unknown format value ",
                                  static_cast<int>(t.format));
    }
  }
  return absl::OkStatus();
}

// Reverse registration order, grouped by format in order of first appearance: one group is
// one buffer, so every bucket holds a single format.
std::vector<std::vector<int32_t>> GroupByFormat(std::span<const TensorSpec> tensors) {
  std::vector<std::vector<int32_t>> groups;
  std::vector<Format> group_format;
  for (int32_t i = static_cast<int32_t>(tensors.size()) - 1; i >= 0; --i) {
    auto it = std::find(group_format.begin(), group_format.end(), tensors[i].format);
    if (it == group_format.end()) {
      group_format.push_back(tensors[i].format);
      groups.emplace_back();
      it = group_format.end() - 1;
    }
    groups[it - group_format.begin()].push_back(i);
  }
  return groups;
}

// Cuts one group into buckets: a bucket closes once its aligned size reaches the threshold.
std::vector<std::vector<int32_t>> CutIntoBuckets(const std::vector<int32_t>& group,
                                                 std::span<const TensorSpec> tensors, int64_t bucket_numel) {
  std::vector<std::vector<int32_t>> buckets;
  std::vector<int32_t> current;
  int64_t size = 0;
  for (int32_t t : group) {
    current.push_back(t);
    size = RoundUp(size, kTensorAlignment) + tensors[t].numel();
    if (size >= bucket_numel) {
      buckets.push_back(std::move(current));
      current.clear();
      size = 0;
    }
  }
  if (!current.empty()) buckets.push_back(std::move(current));
  return buckets;
}

// Flat: tensors one after another at 64-element-aligned offsets.
void PlaceFlat(const std::vector<int32_t>& members, Layout& layout, Bucket& bucket, int64_t alignment) {
  int64_t offset = 0;
  for (int32_t t : members) {
    offset = RoundUp(offset, kTensorAlignment);
    layout.tensors[t].bucket_offset = offset;
    offset += layout.tensors[t].numel;
  }
  bucket.tensors = members;
  bucket.numel = RoundUp(offset, alignment);
  bucket.shard_numel = bucket.numel / layout.data_parallel_size;
}

// Whole tensor: largest first onto the least-loaded shard (lowest rank on ties); every
// shard is then padded to the largest one.
void PlaceWholeTensor(const std::vector<int32_t>& members, Layout& layout, Bucket& bucket, int64_t alignment) {
  const int64_t d = layout.data_parallel_size;
  std::vector<int32_t> order = members;
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return layout.tensors[a].numel > layout.tensors[b].numel;
  });
  std::vector<int64_t> load(d, 0);
  std::vector<std::vector<int32_t>> owned(d);
  for (int32_t t : order) {
    const int64_t r = std::min_element(load.begin(), load.end()) - load.begin();
    owned[r].push_back(t);
    load[r] += RoundUp(layout.tensors[t].numel, kTensorAlignment);
  }
  // D * shard_numel must be a multiple of lcm(64 D, 128).
  const int64_t shard_multiple = alignment / d;
  bucket.shard_numel = RoundUp(std::max<int64_t>(*std::max_element(load.begin(), load.end()), 1), shard_multiple);
  bucket.numel = bucket.shard_numel * d;
  bucket.tensors.clear();
  for (int64_t r = 0; r < d; ++r) {
    int64_t offset = r * bucket.shard_numel;
    for (int32_t t : owned[r]) {
      layout.tensors[t].bucket_offset = offset;
      offset += RoundUp(layout.tensors[t].numel, kTensorAlignment);
      bucket.tensors.push_back(t);
    }
  }
}

// Intersects each tensor's element range with each shard's range.
void CutShards(Layout& layout, Bucket& bucket) {
  const int64_t d = layout.data_parallel_size;
  bucket.shards.resize(d);
  for (int64_t r = 0; r < d; ++r) {
    bucket.shards[r].rank = static_cast<int32_t>(r);
    bucket.shards[r].elements = {r * bucket.shard_numel, (r + 1) * bucket.shard_numel};
  }
  bucket.data_numel = 0;
  for (int32_t t : bucket.tensors) {
    const LayoutTensor& tensor = layout.tensors[t];
    bucket.data_numel += tensor.numel;
    const int64_t begin = tensor.bucket_offset, end = tensor.bucket_offset + tensor.numel;
    for (int64_t r = begin / bucket.shard_numel; r < d && r * bucket.shard_numel < end; ++r) {
      Shard& shard = bucket.shards[r];
      const int64_t lo = std::max(begin, shard.elements.begin);
      const int64_t hi = std::min(end, shard.elements.end);
      if (lo >= hi) continue;
      shard.fragments.push_back({t, {lo - begin, hi - begin}, lo});
    }
  }
}

}  // namespace

absl::string_view LayoutPolicyName(LayoutPolicy policy) {
  return policy == LayoutPolicy::kWholeTensor ? "whole_tensor" : "flat";
}

absl::StatusOr<LayoutPolicy> ParseLayoutPolicy(absl::string_view name) {
  if (name == "flat") return LayoutPolicy::kFlat;
  if (name == "whole_tensor") return LayoutPolicy::kWholeTensor;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown layout policy '", name, "'; known policies: flat, whole_tensor"));
}

int64_t BucketAlignment(int64_t data_parallel_size) {
  return std::lcm(kTensorAlignment * data_parallel_size, int64_t{128});
}

int64_t DefaultBucketNumel(int64_t data_parallel_size) {
  return std::max<int64_t>(40'000'000, 1'000'000 * data_parallel_size);
}

int64_t Shard::load() const {
  int64_t n = 0;
  for (const TensorFragment& f : fragments) n += f.elements.size();
  return n;
}

absl::StatusOr<Layout> ComputeLayout(std::span<const TensorSpec> tensors, const LayoutOptions& options) {
  MAINSTAY_RETURN_IF_ERROR(ValidateInputs(tensors, options));
  Layout layout;
  layout.policy = options.policy;
  layout.data_parallel_size = options.data_parallel_size;
  layout.bucket_numel =
      options.bucket_numel > 0 ? options.bucket_numel : DefaultBucketNumel(options.data_parallel_size);
  layout.tensors.reserve(tensors.size());
  for (const TensorSpec& t : tensors) {
    layout.tensors.push_back({t.name, t.shape, t.format, t.numel(), 0, 0, t.param_group});
  }
  const int64_t alignment = BucketAlignment(layout.data_parallel_size);
  for (const std::vector<int32_t>& group : GroupByFormat(tensors)) {
    for (std::vector<int32_t>& members : CutIntoBuckets(group, tensors, layout.bucket_numel)) {
      Bucket bucket;
      bucket.index = static_cast<int32_t>(layout.buckets.size());
      bucket.format = tensors[members.front()].format;
      for (int32_t t : members) layout.tensors[t].bucket = bucket.index;
      if (layout.policy == LayoutPolicy::kFlat) {
        PlaceFlat(members, layout, bucket, alignment);
      } else {
        PlaceWholeTensor(members, layout, bucket, alignment);
      }
      CutShards(layout, bucket);
      layout.buckets.push_back(std::move(bucket));
    }
  }
  return layout;
}

IndexRange ShardByteRange(const Bucket& bucket, int32_t rank) {
  const IndexRange& e = bucket.shards.at(rank).elements;
  return {DataBytes(bucket.format, e.begin), DataBytes(bucket.format, e.end)};
}

IndexRange FragmentShardByteRange(const Bucket& bucket, const Shard& shard, const TensorFragment& f) {
  const int64_t begin = f.bucket_offset - shard.elements.begin;
  return {DataBytes(bucket.format, begin), DataBytes(bucket.format, begin + f.elements.size())};
}

IndexRange FragmentScaleBlocks(const Layout& layout, const TensorFragment& f) {
  const LayoutTensor& t = layout.tensors.at(f.tensor);
  return ScaleBlockRange(t.format, View2D(t.shape), f.elements);
}

ShardLoadStats LoadStats(const Bucket& bucket) {
  ShardLoadStats stats;
  if (bucket.shards.empty()) return stats;
  int64_t sum = 0;
  for (const Shard& s : bucket.shards) {
    const int64_t load = s.load();
    stats.max = std::max(stats.max, load);
    sum += load;
  }
  stats.mean = static_cast<double>(sum) / bucket.shards.size();
  return stats;
}

int64_t TotalNumel(const Layout& layout) {
  int64_t n = 0;
  for (const Bucket& b : layout.buckets) n += b.numel;
  return n;
}

int64_t TotalDataNumel(const Layout& layout) {
  int64_t n = 0;
  for (const Bucket& b : layout.buckets) n += b.data_numel;
  return n;
}

}  // namespace mainstay
