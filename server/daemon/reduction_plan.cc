#include "server/daemon/reduction_plan.h"

#include <algorithm>

#include "common/format.h"

namespace mainstay::daemon {

ReductionPlan::ReductionPlan(const Layout& layout)
    : num_tensors_(static_cast<int64_t>(layout.tensors.size())), by_tensor_(layout.tensors.size()) {
  size_ = num_tensors_;
  // Fragments of each tensor in element order (bucket order is element order within a tensor).
  std::vector<std::vector<IndexRange>> ranges(layout.tensors.size());
  for (const Bucket& bucket : layout.buckets) {
    const FormatDescriptor& d = Describe(bucket.format);
    if (!d.has_block_scales() || d.block_rows <= 1) continue;  // no 2D tiles: never shared
    for (const Shard& shard : bucket.shards) {
      for (const TensorFragment& f : shard.fragments) {
        ranges[static_cast<size_t>(f.tensor)].push_back(FragmentScaleBlocks(layout, f));
      }
    }
  }
  for (size_t t = 0; t < ranges.size(); ++t) {
    std::vector<IndexRange>& r = ranges[t];
    if (r.size() < 2) continue;
    std::sort(r.begin(), r.end(), [](const IndexRange& a, const IndexRange& b) { return a.begin < b.begin; });
    // Blocks covered twice or more: the overlap of each range with the furthest end so far.
    std::vector<IndexRange> shared;
    int64_t reach = r[0].end;
    for (size_t i = 1; i < r.size(); ++i) {
      const IndexRange overlap{r[i].begin, std::min(r[i].end, reach)};
      if (!overlap.empty()) {
        if (!shared.empty() && overlap.begin <= shared.back().end) {
          shared.back().end = std::max(shared.back().end, overlap.end);
        } else {
          shared.push_back(overlap);
        }
      }
      reach = std::max(reach, r[i].end);
    }
    for (const IndexRange& s : shared) {
      by_tensor_[t].push_back(static_cast<int32_t>(segments_.size()));
      segments_.push_back({static_cast<int32_t>(t), s, size_});
      size_ += s.size();
    }
  }
}

template <typename Fn>
void ReductionPlan::ForEachOverlap(int32_t tensor, IndexRange fragment_blocks, const Fn& fn) const {
  for (int32_t index : by_tensor_[static_cast<size_t>(tensor)]) {
    const Segment& s = segments_[static_cast<size_t>(index)];
    const int64_t begin = std::max(s.blocks.begin, fragment_blocks.begin);
    const int64_t end = std::min(s.blocks.end, fragment_blocks.end);
    for (int64_t b = begin; b < end; ++b) fn(b - fragment_blocks.begin, s.offset + (b - s.blocks.begin));
  }
}

void ReductionPlan::Contribute(int32_t tensor, IndexRange fragment_blocks, std::span<const float> block_amax,
                               std::span<float> reduced) const {
  ForEachOverlap(tensor, fragment_blocks, [&](int64_t local, int64_t global) {
    float& r = reduced[static_cast<size_t>(global)];
    r = std::max(r, block_amax[static_cast<size_t>(local)]);
  });
}

void ReductionPlan::Apply(int32_t tensor, IndexRange fragment_blocks, std::span<float> block_amax,
                          std::span<const float> reduced) const {
  ForEachOverlap(tensor, fragment_blocks, [&](int64_t local, int64_t global) {
    block_amax[static_cast<size_t>(local)] = reduced[static_cast<size_t>(global)];
  });
}

}  // namespace mainstay::daemon
