// Proves the layout guarantees of DESIGN.md section 3.
#include "common/layout.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <numeric>
#include <random>
#include <set>

#include "absl/strings/str_cat.h"
#include "tests/testing/status_matchers.h"

namespace mainstay {
namespace {

using ::mainstay::testing::IsOk;
using ::mainstay::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

const std::vector<int64_t> kDs = {1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 64};

// A transformer-ish model with odd shapes: vocab 50257, hidden sizes that are not powers of two.
std::vector<TensorSpec> OddModel(int64_t hidden, Format format, int layers = 3) {
  std::vector<TensorSpec> t;
  t.push_back({"embedding.word_embeddings.weight", {1001, hidden}, format});
  for (int l = 0; l < layers; ++l) {
    std::string p = absl::StrCat("decoder.layers.", l, ".");
    t.push_back({p + "input_layernorm.weight", {hidden}, format});
    t.push_back({p + "self_attention.linear_qkv.weight", {3 * hidden, hidden}, format});
    t.push_back({p + "self_attention.linear_qkv.bias", {3 * hidden}, format});
    t.push_back({p + "self_attention.linear_proj.weight", {hidden, hidden}, format});
    t.push_back({p + "mlp.linear_fc1.weight", {4 * hidden + 16, hidden}, format});
    t.push_back({p + "mlp.linear_fc2.weight", {hidden, 4 * hidden + 16}, format});
    t.push_back({p + "odd.weight", {7, 13, 3}, format});
  }
  t.push_back({"final_layernorm.weight", {hidden}, format});
  return t;
}

Layout MustLayout(std::span<const TensorSpec> tensors, int64_t d, LayoutPolicy policy, int64_t bucket = 0) {
  absl::StatusOr<Layout> layout = ComputeLayout(tensors, {d, policy, bucket});
  EXPECT_THAT(layout, IsOk());
  return layout.ok() ? *std::move(layout) : Layout{};
}

// Checks every structural guarantee of one layout.
void CheckInvariants(const Layout& layout) {
  const int64_t d = layout.data_parallel_size;
  std::map<int32_t, std::vector<IndexRange>> pieces;  // tensor -> fragments' element ranges
  for (const Bucket& b : layout.buckets) {
    SCOPED_TRACE(absl::StrCat("bucket ", b.index, " D=", d));
    ASSERT_EQ(b.shards.size(), static_cast<size_t>(d));
    EXPECT_EQ(b.numel, b.shard_numel * d);
    EXPECT_EQ(b.numel % BucketAlignment(d), 0);
    EXPECT_EQ(b.shard_numel % kTensorAlignment, 0) << "every shard is whole 64-element groups";
    EXPECT_GT(b.shard_numel, 0);
    for (const Shard& s : b.shards) {
      EXPECT_EQ(s.elements.begin, s.rank * b.shard_numel);
      EXPECT_EQ(s.elements.size(), b.shard_numel);
      EXPECT_EQ(s.elements.begin % kTensorAlignment, 0);
      int64_t prev_end = s.elements.begin;
      for (const TensorFragment& f : s.fragments) {
        EXPECT_EQ(layout.tensors[f.tensor].bucket, b.index);
        EXPECT_GE(f.bucket_offset, prev_end) << "fragments are in bucket order, disjoint";
        EXPECT_LE(f.bucket_offset + f.elements.size(), s.elements.end);
        EXPECT_EQ(f.bucket_offset, layout.tensors[f.tensor].bucket_offset + f.elements.begin);
        prev_end = f.bucket_offset + f.elements.size();
        pieces[f.tensor].push_back(f.elements);
      }
    }
    int64_t data = 0;
    for (int32_t t : b.tensors) data += layout.tensors[t].numel;
    EXPECT_EQ(b.data_numel, data);
  }
  ASSERT_EQ(pieces.size(), layout.tensors.size()) << "every tensor has fragments";
  for (auto& [t, ranges] : pieces) {
    const LayoutTensor& tensor = layout.tensors[t];
    EXPECT_EQ(tensor.bucket_offset % kTensorAlignment, 0) << tensor.name;
    std::sort(ranges.begin(), ranges.end(), [](auto& a, auto& b) { return a.begin < b.begin; });
    int64_t next = 0;
    for (const IndexRange& r : ranges) {
      EXPECT_EQ(r.begin, next) << tensor.name << ": fragments leave no gap and do not overlap";
      EXPECT_GT(r.size(), 0);
      next = r.end;
    }
    EXPECT_EQ(next, tensor.numel) << tensor.name << ": fragments cover the whole tensor";
  }
}

TEST(LayoutTest, FlatLayoutInvariantsHoldForEveryD) {
  for (int64_t hidden : {64, 200, 4096}) {
    for (int64_t d : kDs) {
      SCOPED_TRACE(absl::StrCat("hidden=", hidden, " D=", d));
      auto tensors = OddModel(hidden, Format::kBF16);
      CheckInvariants(MustLayout(tensors, d, LayoutPolicy::kFlat, 1'000'000));
      CheckInvariants(MustLayout(tensors, d, LayoutPolicy::kFlat, 1));  // one tensor per bucket
    }
  }
}

TEST(LayoutTest, WholeTensorInvariantsHoldForEveryD) {
  for (int64_t d : kDs) {
    SCOPED_TRACE(absl::StrCat("D=", d));
    CheckInvariants(MustLayout(OddModel(200, Format::kFP8E4M3Current), d, LayoutPolicy::kWholeTensor));
  }
}

TEST(LayoutTest, RandomShapesKeepInvariants) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<TensorSpec> tensors;
    const int n = 1 + rng() % 20;
    for (int i = 0; i < n; ++i) {
      std::vector<int64_t> shape;
      const int rank = 1 + rng() % 3;
      for (int k = 0; k < rank; ++k) shape.push_back(1 + rng() % 300);
      tensors.push_back({absl::StrCat("t", i), shape, static_cast<Format>(rng() % AllFormats().size())});
    }
    const int64_t d = kDs[rng() % kDs.size()];
    const auto policy = rng() % 2 ? LayoutPolicy::kFlat : LayoutPolicy::kWholeTensor;
    SCOPED_TRACE(absl::StrCat("trial ", trial, " D=", d, " ", LayoutPolicyName(policy)));
    CheckInvariants(MustLayout(tensors, d, policy, 1 + rng() % 200'000));
  }
}

// The packed NVFP4 shard r must be exactly element shard r / 2 (DESIGN.md section 3).
void CheckPackedShardsAlign(const Layout& layout) {
  for (const Bucket& b : layout.buckets) {
    ASSERT_EQ(b.format, Format::kNVFP4);
    EXPECT_EQ(DataBytes(b.format, b.numel) * 2, b.numel) << "packed bucket is exactly half";
    for (const Shard& s : b.shards) {
      const IndexRange bytes = ShardByteRange(b, s.rank);
      EXPECT_EQ(bytes.begin * 2, s.elements.begin);
      EXPECT_EQ(bytes.end * 2, s.elements.end);
      EXPECT_EQ(bytes.size() * layout.data_parallel_size, DataBytes(b.format, b.numel));
      for (const TensorFragment& f : s.fragments) {
        // A fragment never starts or ends inside a byte.
        EXPECT_EQ(f.elements.begin % 2, 0);
        EXPECT_EQ((f.bucket_offset - s.elements.begin) % 2, 0);
        const IndexRange fb = FragmentShardByteRange(b, s, f);
        EXPECT_EQ(fb.begin * 2, f.bucket_offset - s.elements.begin);
        // Byte b of the tensor's packed data holds its elements 2b and 2b+1.
        EXPECT_EQ(bytes.begin + fb.begin, (layout.tensors[f.tensor].bucket_offset + f.elements.begin) / 2);
      }
    }
  }
}

TEST(LayoutTest, NvFp4PackedShardIsElementShardHalfForEveryD) {
  for (int64_t hidden : {4096, 208, 48}) {
    for (int64_t d : kDs) {
      for (auto policy : {LayoutPolicy::kFlat, LayoutPolicy::kWholeTensor}) {
        SCOPED_TRACE(absl::StrCat("hidden=", hidden, " D=", d, " ", LayoutPolicyName(policy)));
        auto tensors = OddModel(hidden, Format::kNVFP4, 2);
        CheckPackedShardsAlign(MustLayout(tensors, d, policy, 3'000'000));
      }
    }
  }
}

// D=6 with hidden 4096: padding the element buffer to lcm(D,128) and the packed byte buffer
// separately (Megatron's scheme) puts the wrong bytes in shard r; our layout does not.
TEST(LayoutTest, NvFp4D6Hidden4096AlignsWhereSeparatePackedPaddingDoesNot) {
  const int64_t d = 6;
  std::vector<TensorSpec> tensors = {{"w", {4096, 4096}, Format::kNVFP4}, {"v", {48, 4096}, Format::kNVFP4}};
  Layout layout = MustLayout(tensors, d, LayoutPolicy::kFlat);
  ASSERT_EQ(layout.buckets.size(), 1u);
  CheckPackedShardsAlign(layout);

  // The separately padded scheme, computed independently here.
  const int64_t data = 4096 * 4096 + 48 * 4096;
  const int64_t pad = std::lcm(d, int64_t{128});
  const int64_t elements = (data + pad - 1) / pad * pad;
  const int64_t packed = (elements / 2 + pad - 1) / pad * pad;
  bool misaligned = false;
  for (int64_t r = 0; r < d; ++r) misaligned |= (packed / d) * r != (elements / d) * r / 2;
  EXPECT_TRUE(misaligned) << "the hazard this layout exists to avoid";
}

TEST(LayoutTest, FlatTakesTensorsInReverseOrderAndClosesBucketsAtThreshold) {
  std::vector<TensorSpec> tensors = {{"a", {100}}, {"b", {1000}}, {"c", {10}}, {"d", {3000}}};
  Layout layout = MustLayout(tensors, 2, LayoutPolicy::kFlat, 1000);
  // Reverse order d, c, b, a: d alone reaches 1000; c (10) + b (64-aligned 1000) reaches it; a remains.
  ASSERT_EQ(layout.buckets.size(), 3u);
  EXPECT_THAT(layout.buckets[0].tensors, ::testing::ElementsAre(3));
  EXPECT_THAT(layout.buckets[1].tensors, ::testing::ElementsAre(2, 1));
  EXPECT_THAT(layout.buckets[2].tensors, ::testing::ElementsAre(0));
  EXPECT_EQ(layout.tensors[2].bucket_offset, 0);
  EXPECT_EQ(layout.tensors[1].bucket_offset, 64) << "tensor starts are padded to 64 elements";
  EXPECT_EQ(layout.buckets[1].numel, 1152) << "64 + 1000 rounded up to lcm(128, 128)";
  EXPECT_EQ(layout.buckets[0].numel, 3072);
}

TEST(LayoutTest, BucketsHoldOneFormat) {
  std::vector<TensorSpec> tensors = {{"w1", {64, 64}, Format::kNVFP4},
                                     {"n1", {64}, Format::kBF16},
                                     {"w2", {64, 64}, Format::kNVFP4},
                                     {"n2", {64}, Format::kBF16}};
  Layout layout = MustLayout(tensors, 4, LayoutPolicy::kFlat);
  ASSERT_EQ(layout.buckets.size(), 2u);
  EXPECT_EQ(layout.buckets[0].format, Format::kBF16) << "the last tensor's format comes first";
  EXPECT_THAT(layout.buckets[0].tensors, ::testing::ElementsAre(3, 1));
  EXPECT_EQ(layout.buckets[1].format, Format::kNVFP4);
  EXPECT_THAT(layout.buckets[1].tensors, ::testing::ElementsAre(2, 0));
}

TEST(LayoutTest, DefaultBucketSizeIsMax40MAnd1MTimesD) {
  EXPECT_EQ(DefaultBucketNumel(1), 40'000'000);
  EXPECT_EQ(DefaultBucketNumel(40), 40'000'000);
  EXPECT_EQ(DefaultBucketNumel(41), 41'000'000);
  EXPECT_EQ(DefaultBucketNumel(64), 64'000'000);
  std::vector<TensorSpec> tensors = {{"a", {30'000'000}}, {"b", {30'000'000}}, {"c", {30'000'000}}};
  Layout l8 = MustLayout(tensors, 8, LayoutPolicy::kFlat);
  EXPECT_EQ(l8.bucket_numel, 40'000'000);
  EXPECT_EQ(l8.buckets.size(), 2u) << "c+b reach 40M, a remains";
  Layout l64 = MustLayout(tensors, 64, LayoutPolicy::kFlat);
  EXPECT_EQ(l64.bucket_numel, 64'000'000);
  EXPECT_EQ(l64.buckets.size(), 1u) << "c+b = 60M < 64M, so a joins them: 90M closes one bucket";
  EXPECT_EQ(l64.buckets[0].tensors.size(), 3u);
}

TEST(LayoutTest, BucketAlignmentIsLcmOf64DAnd128) {
  EXPECT_EQ(BucketAlignment(1), 128);
  EXPECT_EQ(BucketAlignment(2), 128);
  EXPECT_EQ(BucketAlignment(3), 384);
  EXPECT_EQ(BucketAlignment(6), 384);
  EXPECT_EQ(BucketAlignment(8), 512);
  EXPECT_EQ(BucketAlignment(12), 768);
}

TEST(LayoutTest, WholeTensorNeverSplitsAndReportsLoad) {
  std::vector<TensorSpec> tensors = {{"big", {1000, 64}}, {"mid", {500, 64}}, {"mid2", {400, 64}},
                                     {"small", {100, 64}}, {"tiny", {10}},    {"tiny2", {7}}};
  for (int64_t d : {2, 3, 4}) {
    Layout layout = MustLayout(tensors, d, LayoutPolicy::kWholeTensor);
    ASSERT_EQ(layout.buckets.size(), 1u);
    const Bucket& b = layout.buckets[0];
    std::set<int32_t> seen;
    for (const Shard& s : b.shards) {
      for (const TensorFragment& f : s.fragments) {
        EXPECT_EQ(f.elements.begin, 0) << layout.tensors[f.tensor].name << " is not split";
        EXPECT_EQ(f.elements.end, layout.tensors[f.tensor].numel);
        EXPECT_TRUE(seen.insert(f.tensor).second);
      }
    }
    EXPECT_EQ(seen.size(), tensors.size());
    ShardLoadStats stats = LoadStats(b);
    int64_t max_load = 0, sum = 0;
    for (const Shard& s : b.shards) {
      max_load = std::max(max_load, s.load());
      sum += s.load();
    }
    EXPECT_EQ(stats.max, max_load);
    EXPECT_DOUBLE_EQ(stats.mean, static_cast<double>(sum) / d);
    EXPECT_EQ(sum, b.data_numel);
    EXPECT_GE(stats.imbalance(), 1.0);
    // Largest-first greedy: the most loaded shard exceeds the mean by at most one tensor.
    EXPECT_LE(stats.max, stats.mean + 64000 + 64);
  }
  // With D=2: big (64000) -> shard 0; mid (32000), mid2 (25600), small (6400) -> shard 1,
  Layout l2 = MustLayout(tensors, 2, LayoutPolicy::kWholeTensor);
  // and the tie at 64000 each sends tiny (64 padded) to the lower rank, shard 0.
  const Bucket& b2 = l2.buckets[0];
  ASSERT_EQ(b2.shards[0].fragments.size(), 2u);
  EXPECT_EQ(b2.shards[0].fragments[1].tensor, 4);
  EXPECT_EQ(l2.tensors[0].bucket_offset, 0);
  EXPECT_EQ(l2.tensors[1].bucket_offset, b2.shard_numel);
  EXPECT_EQ(LoadStats(b2).max, 64010);
}

TEST(LayoutTest, FlatTensorsStraddleShards) {
  std::vector<TensorSpec> tensors = {{"w", {100, 100}}};
  Layout layout = MustLayout(tensors, 4, LayoutPolicy::kFlat);
  const Bucket& b = layout.buckets[0];
  EXPECT_EQ(b.numel, 10240);
  EXPECT_EQ(b.shard_numel, 2560);
  for (const Shard& s : b.shards) {
    ASSERT_EQ(s.fragments.size(), 1u);
    EXPECT_EQ(s.fragments[0].elements.begin, s.rank * 2560);
  }
  EXPECT_EQ(b.shards[3].fragments[0].elements.end, 10000);
  EXPECT_EQ(b.padding(), 240);
}

TEST(LayoutTest, ScaleBlockRangesOfFragmentsCoverEveryBlock) {
  for (Format format : {Format::kMXFP8, Format::kFP8Block, Format::kNVFP4}) {
    for (int64_t d : {3, 5, 7}) {
      std::vector<TensorSpec> tensors = {{"w", {320, 288}, format}};
      Layout layout = MustLayout(tensors, d, LayoutPolicy::kFlat);
      const Matrix2D grid = ScaleGrid(format, {320, 288});
      std::vector<int> covered(grid.numel(), 0);
      IndexRange prev;
      for (const Shard& s : layout.buckets[0].shards) {
        for (const TensorFragment& f : s.fragments) {
          IndexRange r = FragmentScaleBlocks(layout, f);
          ASSERT_GE(r.begin, 0);
          ASSERT_LE(r.end, grid.numel());
          if (format == Format::kMXFP8) {
            EXPECT_EQ(r.begin, f.elements.begin / 32) << "1x32 blocks split exactly";
            EXPECT_EQ(r.end, f.elements.end / 32);
            EXPECT_GE(r.begin, prev.end) << "and never shared";
          }
          for (int64_t i = r.begin; i < r.end; ++i) covered[i]++;
          prev = r;
        }
      }
      for (size_t i = 0; i < covered.size(); ++i) {
        EXPECT_GE(covered[i], 1) << FormatName(format) << " block " << i;
      }
    }
  }
}

struct BadSpec {
  std::string what;
  std::vector<TensorSpec> tensors;
  LayoutOptions options;
  std::string field;
};

TEST(LayoutTest, BadSpecsAreInvalidArgumentNamingTheField) {
  const std::vector<BadSpec> cases = {
      {"no tensors", {}, {2}, "tensors"},
      {"zero dimension", {{"a", {4}}, {"b", {3, 0}}}, {2}, "tensors[1].shape[1]"},
      {"negative dimension", {{"a", {-5}}}, {2}, "tensors[0].shape[0]"},
      {"no dimensions", {{"a", {}}}, {2}, "tensors[0].shape"},
      {"duplicate names", {{"a", {4}}, {"b", {4}}, {"a", {8}}}, {2}, "tensors[2].name"},
      {"empty name", {{"", {4}}}, {2}, "tensors[0].name"},
      {"D=0", {{"a", {4}}}, {0}, "data_parallel_size"},
      {"D<0", {{"a", {4}}}, {-3}, "data_parallel_size"},
      {"huge D", {{"a", {4}}}, {1 << 20}, "data_parallel_size"},
      {"negative bucket", {{"a", {4}}}, {2, LayoutPolicy::kFlat, -1}, "bucket_numel"},
      {"one tensor over 2^40", {{"a", {1 << 21, 1 << 20}}}, {2}, "tensors[0].shape"},
      {"overflowing shape", {{"a", {int64_t{1} << 40, int64_t{1} << 40, 4}}}, {2}, "tensors[0].shape"},
      {"total over 2^40", {{"a", {1 << 20, 1 << 19}}, {"b", {1 << 20, 1 << 19}}, {"c", {64}}}, {2}, "tensors"},
      {"bad policy", {{"a", {4}}}, {2, static_cast<LayoutPolicy>(9)}, "layout_policy"},
      {"bad format", {{"a", {4}, static_cast<Format>(77)}}, {2}, "tensors[0].format"},
  };
  for (const BadSpec& c : cases) {
    SCOPED_TRACE(c.what);
    EXPECT_THAT(ComputeLayout(c.tensors, c.options),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.field + ": ")));
  }
}

TEST(LayoutTest, ExactlyTwoTo40ElementsIsAccepted) {
  // 2^40 elements in one tensor: within the limit; the layout is computed without overflow.
  std::vector<TensorSpec> tensors = {{"a", {1 << 20, 1 << 20}}};
  Layout layout = MustLayout(tensors, 64, LayoutPolicy::kFlat);
  EXPECT_EQ(TotalDataNumel(layout), int64_t{1} << 40);
  CheckInvariants(layout);
}

TEST(LayoutTest, PolicyNamesParse) {
  EXPECT_THAT(ParseLayoutPolicy("flat"), IsOk());
  EXPECT_EQ(*ParseLayoutPolicy("whole_tensor"), LayoutPolicy::kWholeTensor);
  EXPECT_THAT(ParseLayoutPolicy("striped"),
              StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr("flat"), HasSubstr("whole_tensor"))));
}

}  // namespace
}  // namespace mainstay
