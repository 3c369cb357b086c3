// Which amaxes of a job must be MAX-reduced across its daemons each step, computed from the
// layout alone so that every daemon builds the same plan (DESIGN.md section 4: every daemon
// takes part in every reduction, contributing 0 where it owns nothing).
//
// The reduced vector is [tensor amax for every tensor of the layout] followed by the
// SHARED BLOCKS: the 2D scale tiles (fp8_block 128x128, nvfp4 16x16) that more than one
// fragment of a tensor touches, because a shard boundary cuts through them. 1x32 mxfp8
// blocks never straddle a fragment (fragments are multiples of 64 elements and mxfp8 needs
// cols % 32 == 0), so they are never shared; with the whole_tensor policy no tile is shared
// at all and the vector is one float per tensor.
//
// Thread safety: immutable after construction.
#ifndef MAINSTAY_SERVER_DAEMON_REDUCTION_PLAN_H_
#define MAINSTAY_SERVER_DAEMON_REDUCTION_PLAN_H_

#include <cstdint>
#include <span>
#include <vector>

#include "common/layout.h"

namespace mainstay::daemon {

class ReductionPlan {
 public:
  // A run of shared blocks of one tensor: blocks [blocks.begin, blocks.end) of its compact
  // scale grid sit at [offset, offset + blocks.size()) of the reduced vector.
  struct Segment {
    int32_t tensor = 0;
    IndexRange blocks;
    int64_t offset = 0;
  };

  explicit ReductionPlan(const Layout& layout);

  int64_t num_tensors() const { return num_tensors_; }
  // Length of the reduced vector: tensors + shared blocks.
  int64_t size() const { return size_; }
  const std::vector<Segment>& segments() const { return segments_; }

  // Copies the entries of a fragment's partial block amaxes (`block_amax`, one per block of
  // `fragment_blocks`) that are shared into `reduced` (MAX with what is there).
  void Contribute(int32_t tensor, IndexRange fragment_blocks, std::span<const float> block_amax,
                  std::span<float> reduced) const;
  // After the reduction: overwrites the shared entries of a fragment's block amaxes with the
  // reduced values.
  void Apply(int32_t tensor, IndexRange fragment_blocks, std::span<float> block_amax,
             std::span<const float> reduced) const;

 private:
  template <typename Fn>
  void ForEachOverlap(int32_t tensor, IndexRange fragment_blocks, const Fn& fn) const;

  int64_t num_tensors_ = 0;
  int64_t size_ = 0;
  std::vector<Segment> segments_;               // sorted by (tensor, blocks.begin)
  std::vector<std::vector<int32_t>> by_tensor_; // indices into segments_ per tensor
};

}  // namespace mainstay::daemon

#endif  // MAINSTAY_SERVER_DAEMON_REDUCTION_PLAN_H_
