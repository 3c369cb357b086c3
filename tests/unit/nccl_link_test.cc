// common/nccl_link without a GPU: version text, the recognition of NCCL's refusal of two ranks on
// one CUDA device, and Link::Connect's argument checks (which come before any CUDA or NCCL call).
// The transfers themselves run in tests/gpu/nccl_transport_gpu_test.
#include "common/nccl_link.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "tests/testing/status_matchers.h"

namespace mainstay::nccl {
namespace {

using ::mainstay::testing::StatusIs;

TEST(NcclLinkTest, VersionStringDecodesBothEncodings) {
  EXPECT_EQ(VersionString(22809), "2.28.9");
  EXPECT_EQ(VersionString(23102), "2.31.2");
  EXPECT_EQ(VersionString(2708), "2.7.8");
  EXPECT_GT(Version(), 0);  // the linked library answers without a device
}

TEST(NcclLinkTest, RefusalOfASharedDeviceIsRecognizedInBothWordings) {
  EXPECT_TRUE(NcclRefusesSharedDevice(absl::FailedPreconditionError(
      "NCCL joining: ncclCommGetAsyncError: invalid usage: Duplicate GPU detected : rank 1 and rank 0 both on "
      "CUDA device 1b000")));
  EXPECT_TRUE(NcclRefusesSharedDevice(absl::FailedPreconditionError(
      "Multiple Ranks are using the same GPU/Partition. Set NCCL_MULTI_RANK_GPU_ENABLE=1 to enable this")));
  EXPECT_FALSE(NcclRefusesSharedDevice(absl::UnavailableError("Duplicate GPU detected")));
  EXPECT_FALSE(NcclRefusesSharedDevice(absl::FailedPreconditionError("invalid usage: something else")));
}

TEST(NcclLinkTest, ConnectRejectsBadArgumentsBeforeTouchingTheDevice) {
  const std::string id(kUniqueIdBytes, 'x');
  const absl::Time deadline = absl::Now() + absl::Seconds(1);
  EXPECT_THAT(Link::Connect({0, 2, 1 << 20}, id, deadline, nullptr).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(Link::Connect({0, 0, kMinChunkBytes - 1}, id, deadline, nullptr).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(Link::Connect({0, 1, kMaxChunkBytes + 1}, id, deadline, nullptr).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(Link::Connect({0, 1, 1 << 20}, "short", deadline, nullptr).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace mainstay::nccl
