// The daemon's device allocator (kernels/memory.h) on the host, and StateBuffer over it
// (server/daemon/state_buffer.h): zeroed, aligned blocks; clear errors for sizes that cannot be
// served, leaving the buffer empty; a build or machine without the CUDA device refused by name.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "kernels/memory.h"
#include "server/daemon/state_buffer.h"
#include "tests/testing/status_matchers.h"

namespace mainstay::daemon {
namespace {

using ::mainstay::testing::IsOk;
using ::mainstay::testing::StatusIs;
using ::testing::HasSubstr;

TEST(StateMemoryTest, HostBlocksAreZeroedAlignedAndCopiedInOrder) {
  for (bool staged : {false, true}) {
    std::unique_ptr<kernels::StateMemory> memory = kernels::HostStateMemory(nullptr, staged);
    EXPECT_EQ(memory->staged(), staged);
    EXPECT_EQ(memory->device().kind, kernels::Device::Kind::kCpu);
    EXPECT_GT(memory->capacity_bytes(), 0);
    absl::StatusOr<void*> block = memory->Allocate(1000);
    ASSERT_THAT(block, IsOk());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(*block) % 256, 0u);
    const auto* bytes = static_cast<const uint8_t*>(*block);
    EXPECT_EQ(std::vector<uint8_t>(bytes, bytes + 1000), std::vector<uint8_t>(1000, 0));
    const std::vector<uint8_t> host = {1, 2, 3, 4};
    ASSERT_THAT(memory->Copy(*block, host.data(), 4), IsOk());
    ASSERT_THAT(memory->Synchronize(), IsOk());
    EXPECT_EQ(std::vector<uint8_t>(bytes, bytes + 4), host);
    memory->Free(*block);
    memory->Free(nullptr);
  }
}

TEST(StateMemoryTest, SizesThatCannotBeServedAreRefusedClearly) {
  std::unique_ptr<kernels::StateMemory> memory = kernels::HostStateMemory(nullptr);
  EXPECT_THAT(memory->Allocate(0), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must be > 0")));
  EXPECT_THAT(memory->Allocate(-8), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(memory->Allocate(int64_t{1} << 60),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("out of host memory")));
}

TEST(StateMemoryTest, ACudaDeviceThatIsNotThereIsRefusedByName) {
  // cuda:4096 exists nowhere: FAILED_PRECONDITION (no such device) with CUDA, UNIMPLEMENTED
  // in a build without it; either way the message names the device.
  absl::StatusOr<std::unique_ptr<kernels::StateMemory>> memory = kernels::CudaStateMemory(4096);
  ASSERT_FALSE(memory.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(memory.status()) || absl::IsUnimplemented(memory.status()))
      << memory.status();
  EXPECT_THAT(memory.status().message(), HasSubstr("cuda:4096"));
}

TEST(StateBufferTest, ResetAssignSwapAndMoveKeepOneOwnerOfEachBlock) {
  std::unique_ptr<kernels::StateMemory> memory = kernels::HostStateMemory(nullptr);
  StateBuffer<float> a;
  EXPECT_TRUE(a.empty());
  ASSERT_THAT(a.Reset(*memory, 3), IsOk());
  EXPECT_EQ(std::vector<float>(a.begin(), a.end()), std::vector<float>(3, 0.0f));
  const std::vector<float> values = {1.5f, -2.0f};
  ASSERT_THAT(a.Assign(*memory, values), IsOk());
  EXPECT_EQ(std::vector<float>(a.begin(), a.end()), values);
  StateBuffer<float> b;
  b.swap(a);
  EXPECT_TRUE(a.empty());
  EXPECT_EQ(b.size(), 2u);
  StateBuffer<float> c = std::move(b);
  EXPECT_TRUE(b.empty());  // NOLINT(bugprone-use-after-move): moved-from is empty by contract
  EXPECT_EQ(c[1], -2.0f);
  ASSERT_THAT(c.Reset(*memory, 0), IsOk());
  EXPECT_TRUE(c.empty());
}

TEST(StateBufferTest, AFailedResetLeavesTheBufferEmpty) {
  std::unique_ptr<kernels::StateMemory> memory = kernels::HostStateMemory(nullptr);
  StateBuffer<uint8_t> a;
  ASSERT_THAT(a.Reset(*memory, 16), IsOk());
  EXPECT_THAT(a.Reset(*memory, int64_t{1} << 60), StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_TRUE(a.empty());
  EXPECT_EQ(a.data(), nullptr);
}

}  // namespace
}  // namespace mainstay::daemon
