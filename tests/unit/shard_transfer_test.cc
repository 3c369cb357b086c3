// The move's wire codec (server/daemon/shard_transfer.h): every buffer, the pending pushes and
// the committed step's stats come through byte for byte; a stream that is short, overlapping or
// malformed is refused, never half-read.
#include "server/daemon/shard_transfer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/memory.h"
#include "tests/testing/status_matchers.h"

namespace mainstay::daemon {
namespace {

using ::mainstay::testing::IsOk;
using ::mainstay::testing::StatusIs;

ShardStateCopy MakeCopy() {
  ShardStateCopy copy;
  copy.version = 7;
  copy.committed_step = 6;
  copy.moment_type = ElementType::kBFloat16;
  EXPECT_THAT(copy.master.Reset(HostCopyMemory(), 100), IsOk());
  EXPECT_THAT(copy.m.Reset(HostCopyMemory(), 200), IsOk());
  EXPECT_THAT(copy.v.Reset(HostCopyMemory(), 200), IsOk());
  for (size_t i = 0; i < copy.master.size(); ++i) copy.master[i] = 0.25f * static_cast<float>(i) - 3.0f;
  for (size_t i = 0; i < copy.m.size(); ++i) copy.m[i] = static_cast<uint8_t>(i * 7), copy.v[i] = static_cast<uint8_t>(i * 13);
  copy.scaling.set_loss_scale(1024.0);
  PendingPushCopy a{7, 0, 2, ElementType::kFloat32, 1.0, std::vector<uint8_t>(400)};
  PendingPushCopy b{7, 1, 2, ElementType::kBFloat16, 512.0, std::vector<uint8_t>(200)};
  for (size_t i = 0; i < a.payload.size(); ++i) a.payload[i] = static_cast<uint8_t>(i * 3 + 1);
  for (size_t i = 0; i < b.payload.size(); ++i) b.payload[i] = static_cast<uint8_t>(i * 5 + 2);
  copy.pending = {a, b};
  v1::StepStats stats;
  stats.set_step(6);
  stats.set_version(7);
  copy.committed_stats = stats;
  return copy;
}

std::vector<v1::FetchShardStateResponse> Encode(const ShardStateCopy& copy, int64_t chunk) {
  std::vector<v1::FetchShardStateResponse> out;
  EXPECT_THAT(WriteShardState(copy, chunk, [&](const v1::FetchShardStateResponse& m) {
                out.push_back(m);
                return true;
              }),
              IsOk());
  return out;
}

TEST(ShardTransferTest, EveryBufferThePendingPushesAndTheStatsComeThroughByteForByte) {
  const ShardStateCopy copy = MakeCopy();
  for (int64_t chunk : {8, 64, 4096}) {
    ShardStateReader reader(HostCopyMemory(), 100);
    for (const auto& m : Encode(copy, chunk)) ASSERT_THAT(reader.Add(m), IsOk());
    absl::StatusOr<ShardStateCopy> got = reader.Finish(0, 1);
    ASSERT_THAT(got.status(), IsOk());
    EXPECT_EQ(got->version, 7);
    EXPECT_EQ(got->committed_step, 6);
    EXPECT_EQ(got->master, copy.master);
    EXPECT_EQ(got->m, copy.m);
    EXPECT_EQ(got->v, copy.v);
    EXPECT_EQ(got->scaling.loss_scale(), 1024.0);
    ASSERT_EQ(got->pending.size(), 2u);
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_EQ(got->pending[i].step, copy.pending[i].step);
      EXPECT_EQ(got->pending[i].rank, copy.pending[i].rank);
      EXPECT_EQ(got->pending[i].num_contributors, copy.pending[i].num_contributors);
      EXPECT_EQ(got->pending[i].dtype, copy.pending[i].dtype);
      EXPECT_EQ(got->pending[i].loss_scale, copy.pending[i].loss_scale);
      EXPECT_EQ(got->pending[i].payload, copy.pending[i].payload);
    }
    ASSERT_TRUE(got->committed_stats.has_value());
    EXPECT_EQ(got->committed_stats->version(), 7);
  }
}

TEST(ShardTransferTest, AStreamThatEndsShortOrRepeatsAChunkIsRefused) {
  const std::vector<v1::FetchShardStateResponse> messages = Encode(MakeCopy(), 64);
  {  // the last pending chunk is missing
    ShardStateReader reader(HostCopyMemory(), 100);
    for (size_t i = 0; i + 1 < messages.size(); ++i) ASSERT_THAT(reader.Add(messages[i]), IsOk());
    EXPECT_THAT(reader.Finish(0, 1).status(),
                StatusIs(absl::StatusCode::kDataLoss, ::testing::HasSubstr("STATE_BUFFER_PENDING_PUSHES")));
  }
  {  // a pending chunk comes twice
    ShardStateReader reader(HostCopyMemory(), 100);
    for (const auto& m : messages) ASSERT_THAT(reader.Add(m), IsOk());
    EXPECT_THAT(reader.Add(messages.back()), StatusIs(absl::StatusCode::kDataLoss));
  }
}

TEST(ShardTransferTest, APendingPushOfAnImpossibleSizeIsRefusedAtTheHeader) {
  std::vector<v1::FetchShardStateResponse> messages = Encode(MakeCopy(), 64);
  messages[0].mutable_header()->mutable_pending(1)->set_bytes(201);  // not whole bf16 elements
  ShardStateReader reader(HostCopyMemory(), 100);
  EXPECT_THAT(reader.Add(messages[0]), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("malformed")));
}

// State memory with no room left (a GPU whose memory another process took).
class FullMemory : public kernels::StateMemory {
 public:
  const kernels::Device& device() const override { return host_->device(); }
  bool staged() const override { return false; }
  std::string Describe() const override { return "full"; }
  int64_t capacity_bytes() const override { return 0; }
  absl::StatusOr<void*> Allocate(int64_t bytes) override {
    return absl::ResourceExhaustedError(absl::StrCat("no room for ", bytes, " bytes"));
  }
  void Free(void* block) override { host_->Free(block); }
  absl::Status Copy(void* dst, const void* src, int64_t bytes) override { return host_->Copy(dst, src, bytes); }
  absl::Status Synchronize() override { return host_->Synchronize(); }

 private:
  std::unique_ptr<kernels::StateMemory> host_ = kernels::HostStateMemory(nullptr);
};

// The masters and moments land in the reader's state memory as they arrive: one that cannot hold
// them refuses the header with RESOURCE_EXHAUSTED (the coordinator then places the move
// elsewhere); a header announcing another size than the layout's shard is DATA_LOSS, before
// anything is allocated (not a full memory: the move must not go elsewhere for it).
TEST(ShardTransferTest, ACopyThatDoesNotFitOrIsOfAnotherSizeIsRefusedAtTheHeader) {
  const std::vector<v1::FetchShardStateResponse> messages = Encode(MakeCopy(), 64);
  FullMemory full;
  ShardStateReader refused(full, 100);
  EXPECT_THAT(refused.Add(messages[0]), StatusIs(absl::StatusCode::kResourceExhausted));
  for (int64_t numel : {int64_t{101}, int64_t{1} << 62, int64_t{-1}}) {
    std::vector<v1::FetchShardStateResponse> other = messages;
    other[0].mutable_header()->set_shard_numel(numel);
    ShardStateReader reader(full, 100);
    EXPECT_THAT(reader.Add(other[0]), StatusIs(absl::StatusCode::kDataLoss, ::testing::HasSubstr("layout's shard")));
  }
}

}  // namespace
}  // namespace mainstay::daemon
