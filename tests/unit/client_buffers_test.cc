// Bucket buffer helpers of libmainstay_client (mainstay/buffers.h): offline, no daemon.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "client/src/testing/test_specs.h"
#include "mainstay/buffers.h"
#include "tests/testing/status_matchers.h"

namespace mainstay {
namespace {

using ::mainstay::testing::IsOk;
using ::mainstay::testing::StatusIs;
using ::testing::HasSubstr;

TEST(ClientBuffersTest, ComputeJobLayoutMatchesTheSpecAndOverridesD) {
  MAINSTAY_ASSERT_OK_AND_ASSIGN(Layout l2, ComputeJobLayout(testing_fakes::SmallSpec(2)));
  EXPECT_EQ(l2.data_parallel_size, 2);
  EXPECT_EQ(l2.tensors.size(), 4u);
  MAINSTAY_ASSERT_OK_AND_ASSIGN(Layout l5, ComputeJobLayout(testing_fakes::SmallSpec(2), 5));
  EXPECT_EQ(l5.data_parallel_size, 5);
  for (const Bucket& b : l5.buckets) EXPECT_EQ(b.shards.size(), 5u);
}

TEST(ClientBuffersTest, ComputeJobLayoutRejectsBadSpecWithFieldPath) {
  EXPECT_THAT(ComputeJobLayout(R"({"name": "x", "tensors": [{"name": "a", "shape": [0]}]})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tensors[0].shape[0]")));
  EXPECT_THAT(ComputeJobLayout("not json"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ComputeJobLayout(testing_fakes::SmallSpec(2), -1), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(ClientBuffersTest, TensorRoundTripsThroughBucketBufferAndPaddingStaysZero) {
  MAINSTAY_ASSERT_OK_AND_ASSIGN(Layout layout, ComputeJobLayout(testing_fakes::AllFormatsSpec(3)));
  for (size_t b = 0; b < layout.buckets.size(); ++b) {
    MAINSTAY_ASSERT_OK_AND_ASSIGN(std::vector<float> buffer, MakeBucketBuffer(layout, static_cast<int32_t>(b)));
    ASSERT_EQ(static_cast<int64_t>(buffer.size()), layout.buckets[b].numel);
    std::vector<bool> covered(buffer.size(), false);
    for (int32_t t : layout.buckets[b].tensors) {
      std::vector<float> values(layout.tensors[t].numel);
      std::iota(values.begin(), values.end(), 1.0f + t * 1000);
      ASSERT_THAT(CopyTensorToBucket(layout, t, values, buffer), IsOk());
      for (int64_t i = 0; i < layout.tensors[t].numel; ++i) covered[layout.tensors[t].bucket_offset + i] = true;
    }
    for (int32_t t : layout.buckets[b].tensors) {
      std::vector<float> out(layout.tensors[t].numel);
      ASSERT_THAT(CopyTensorFromBucket(layout, t, buffer, out), IsOk());
      EXPECT_EQ(out.front(), 1.0f + t * 1000) << layout.tensors[t].name;
      EXPECT_EQ(out.back(), static_cast<float>(layout.tensors[t].numel) + t * 1000) << layout.tensors[t].name;
    }
    for (size_t i = 0; i < buffer.size(); ++i) {
      if (!covered[i]) {
        ASSERT_EQ(buffer[i], 0.0f) << "padding element " << i << " of bucket " << b;
      }
    }
  }
}

TEST(ClientBuffersTest, Bf16BucketCopiesUseTheSameOffsets) {
  MAINSTAY_ASSERT_OK_AND_ASSIGN(Layout layout, ComputeJobLayout(testing_fakes::SmallSpec(2)));
  MAINSTAY_ASSERT_OK_AND_ASSIGN(int32_t w2, FindTensor(layout, "w2"));
  const LayoutTensor& t = layout.tensors[w2];
  std::vector<uint16_t> bucket(layout.buckets[t.bucket].numel, 0);
  std::vector<uint16_t> values(t.numel, 0x3F80);
  ASSERT_THAT(CopyTensorToBucket(layout, w2, values, bucket), IsOk());
  EXPECT_EQ(bucket[t.bucket_offset], 0x3F80);
  EXPECT_EQ(bucket[t.bucket_offset + t.numel - 1], 0x3F80);
  std::vector<uint16_t> out(t.numel);
  ASSERT_THAT(CopyTensorFromBucket(layout, w2, bucket, out), IsOk());
  EXPECT_EQ(out, values);
}

TEST(ClientBuffersTest, ShardSpansPartitionTheBucket) {
  MAINSTAY_ASSERT_OK_AND_ASSIGN(Layout layout, ComputeJobLayout(testing_fakes::AllFormatsSpec(3)));
  MAINSTAY_ASSERT_OK_AND_ASSIGN(std::vector<float> buffer, MakeBucketBuffer(layout, 0));
  const int64_t n = layout.buckets[0].shard_numel;
  for (int32_t r = 0; r < 3; ++r) {
    MAINSTAY_ASSERT_OK_AND_ASSIGN(std::span<float> shard, ShardSpan(layout, 0, r, std::span<float>(buffer)));
    EXPECT_EQ(static_cast<int64_t>(shard.size()), n);
    EXPECT_EQ(shard.data(), buffer.data() + r * n);
    MAINSTAY_ASSERT_OK_AND_ASSIGN(IndexRange range, ShardBucketRange(layout, 0, r));
    EXPECT_EQ(range, (IndexRange{r * n, (r + 1) * n}));
  }
  EXPECT_THAT(ShardSpan(layout, 0, 3, std::span<float>(buffer)), StatusIs(absl::StatusCode::kInvalidArgument));
  std::vector<float> wrong(7);
  EXPECT_THAT(ShardSpan(layout, 0, 0, std::span<float>(wrong)), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(ClientBuffersTest, BadIndicesNamesAndSizesAreErrorsAndWriteNothing) {
  MAINSTAY_ASSERT_OK_AND_ASSIGN(Layout layout, ComputeJobLayout(testing_fakes::SmallSpec(2)));
  EXPECT_THAT(FindTensor(layout, "nope"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("nope")));
  EXPECT_THAT(MakeBucketBuffer(layout, 99), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(TensorBucketRange(layout, -1), StatusIs(absl::StatusCode::kInvalidArgument));
  MAINSTAY_ASSERT_OK_AND_ASSIGN(int32_t w1, FindTensor(layout, "w1"));
  MAINSTAY_ASSERT_OK_AND_ASSIGN(std::vector<float> buffer, MakeBucketBuffer(layout, layout.tensors[w1].bucket));
  std::vector<float> short_values(5, 1.0f);
  EXPECT_THAT(CopyTensorToBucket(layout, w1, short_values, buffer),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("w1")));
  for (float v : buffer) ASSERT_EQ(v, 0.0f);
}

TEST(ClientBuffersTest, ElementSpanSubAddressesWholeElements) {
  std::vector<uint16_t> bits(10);
  ElementSpan s = ElementSpan::Bf16(bits);
  EXPECT_EQ(s.bytes(), 20);
  ElementSpan sub = s.Sub(4, 3);
  EXPECT_EQ(sub.data, static_cast<const void*>(bits.data() + 4));
  EXPECT_EQ(sub.numel, 3);
  EXPECT_EQ(sub.type, ElementType::kBFloat16);
}

}  // namespace
}  // namespace mainstay
