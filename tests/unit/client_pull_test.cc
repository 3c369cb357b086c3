// From PullParams streams to per-tensor views and FP32 values (client/src/pull_assembly.h,
// mainstay/pulled.h), with synthetic streams built like a daemon builds them: no daemon.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "client/src/pull_assembly.h"
#include "common/byte_patch.h"
#include "common/chunk_hash.h"
#include "common/crc32c.h"
#include "client/src/testing/fake_services.h"
#include "client/src/testing/test_specs.h"
#include "common/status.h"
#include "kernels/casts.h"
#include "kernels/kernels.h"
#include "mainstay/buffers.h"
#include "mainstay/pulled.h"
#include "tests/testing/status_matchers.h"

namespace mainstay {
namespace {

using client_internal::BufferPool;
using client_internal::MakePulledBucket;
using client_internal::PooledBytes;
using client_internal::ShardPullAssembler;
using ::mainstay::testing::IsOk;
using ::mainstay::testing::StatusIs;
using ::testing::HasSubstr;
using testing_fakes::MakePullStream;

// Deterministic master values of a whole bucket: each tensor gets values from its name, so
// layouts for different D hold the same tensor values.
std::vector<float> BucketMaster(const Layout& layout, int32_t bucket) {
  std::vector<float> master(layout.buckets[bucket].numel, 0.0f);
  for (int32_t t : layout.buckets[bucket].tensors) {
    const LayoutTensor& info = layout.tensors[t];
    std::mt19937 rng(static_cast<uint32_t>(std::hash<std::string>()(info.name)));
    const int t_index = static_cast<int>(std::hash<std::string>()(info.name) % 5);
    // Magnitudes differ by tensor, so scales taken from the wrong tensor or block show.
    std::normal_distribution<float> dist(0.0f, 0.05f * static_cast<float>(1 << t_index));
    for (int64_t i = 0; i < info.numel; ++i) master[info.bucket_offset + i] = dist(rng);
  }
  return master;
}

// Pulls shards [begin, end) of a bucket through the assembler, as the client does.
// With `pieces`, each data chunk goes in as the grpc transport decodes it (OnDataChunk), cut
// into up to three pieces at places that vary from chunk to chunk.
absl::StatusOr<PulledBucket> Pull(std::shared_ptr<const Layout> layout, int32_t bucket, int32_t begin, int32_t end,
                                  const std::vector<float>& master, int64_t chunk_bytes = 1000, bool pieces = false) {
  const Bucket& b = layout->buckets[bucket];
  const int64_t base = DataBytes(b.format, begin * b.shard_numel);
  // A reused buffer holds the previous pull's bytes: start from garbage, every byte must be written.
  PooledBytes data = PooledBytes::Unpooled(DataBytes(b.format, end * b.shard_numel) - base);
  std::memset(data.data(), 0xCD, data.size());
  std::vector<PulledShard> shards;
  for (int32_t s = begin; s < end; ++s) {
    MAINSTAY_ASSIGN_OR_RETURN(std::vector<v1::PullParamsResponse> stream,
                              MakePullStream(*layout, bucket, s, 7, master, chunk_bytes));
    const IndexRange bytes = ShardByteRange(b, s);
    ShardPullAssembler assembler(*layout, bucket, s, 7, data.span().subspan(bytes.begin - base, bytes.size()),
                                 /*verify_crc32c=*/true);
    for (const v1::PullParamsResponse& m : stream) {
      if (!pieces || !m.has_data()) {
        MAINSTAY_RETURN_IF_ERROR(assembler.OnMessage(m));
        continue;
      }
      const auto* bytes = reinterpret_cast<const uint8_t*>(m.data().data().data());
      const size_t size = m.data().data().size();
      const size_t cut1 = std::min(size, size_t{7} * s), cut2 = std::min(size, cut1 + size / 3);
      const std::vector<std::span<const uint8_t>> parts = {
          {bytes, cut1}, {bytes + cut1, cut2 - cut1}, {bytes + cut2, size - cut2}};
      MAINSTAY_RETURN_IF_ERROR(assembler.OnDataChunk(m.data().element_offset(), parts));
    }
    MAINSTAY_ASSIGN_OR_RETURN(PulledShard shard, assembler.Finish());
    shards.push_back(std::move(shard));
  }
  return MakePulledBucket(layout, bucket, begin, std::move(data), std::move(shards));
}

// FP32 values of a tensor quantized whole and dequantized whole (one fragment, independent of
// the layout and of the client's per-fragment assembly), as TE would see them.
std::vector<float> ReferenceDequantize(const LayoutTensor& t, std::span<const float> values) {
  const Matrix2D view = View2D(t.shape);
  const kernels::Fragment frag{view, {0, t.numel}};
  const FormatDescriptor& d = Describe(t.format);
  std::vector<float> block_amax(ScaleBlockRange(t.format, view, frag.elements).size());
  float amax = 0;
  EXPECT_THAT(kernels::ComputePartialAmax(kernels::Device{}, t.format, Format::kBF16, frag, values,
                                          {&amax, std::span<float>(block_amax)}),
              IsOk());
  std::vector<uint8_t> data(DataBytes(t.format, t.numel));
  std::vector<uint8_t> scales(d.has_block_scales() ? block_amax.size() * BitsOf(d.block_scale) / 8 : 0);
  float scale_inv = 1.0f;
  kernels::ScaleInputs in;
  in.tensor_amax = amax;
  in.block_amax = block_amax;
  EXPECT_THAT(kernels::Quantize(kernels::Device{}, t.format, Format::kBF16, frag, values, in,
                                {data, scales, &scale_inv}),
              IsOk());
  std::vector<float> out(t.numel);
  EXPECT_THAT(kernels::Dequantize(kernels::Device{}, t.format, frag,
                                  {data, scales, d.tensor_scale ? scale_inv : 1.0f}, std::span<float>(out)),
              IsOk());
  return out;
}

struct TensorResult {
  int fragments = 0;
  bool shared_block = false;  // two fragments' scale ranges overlap (a tile cut by a shard boundary)
  std::vector<float> values;
  std::vector<uint8_t> data;
  std::vector<uint8_t> grid;
};

// Every tensor of the all-formats job, pulled whole bucket by bucket under D ranks.
std::map<std::string, TensorResult> PullAll(int64_t d) {
  std::map<std::string, TensorResult> out;
  absl::StatusOr<Layout> l = ComputeJobLayout(testing_fakes::AllFormatsSpec(d));
  EXPECT_THAT(l, IsOk());
  if (!l.ok()) return out;
  auto layout = std::make_shared<const Layout>(*l);
  for (int32_t b = 0; b < static_cast<int32_t>(layout->buckets.size()); ++b) {
    absl::StatusOr<PulledBucket> pulled = Pull(layout, b, 0, static_cast<int32_t>(d), BucketMaster(*layout, b));
    EXPECT_THAT(pulled, IsOk()) << "D=" << d << " bucket " << b;
    if (!pulled.ok()) continue;
    EXPECT_TRUE(pulled->complete());
    EXPECT_EQ(pulled->version(), 7);
    for (int32_t t : pulled->tensors()) {
      absl::StatusOr<TensorView> view = pulled->Tensor(t);
      EXPECT_THAT(view, IsOk());
      EXPECT_TRUE(view->complete);
      TensorResult r;
      r.fragments = static_cast<int>(view->fragments.size());
      for (size_t i = 1; i < view->fragments.size(); ++i) {
        const IndexRange& prev = view->fragments[i - 1].scale_blocks;
        if (!prev.empty() && view->fragments[i].scale_blocks.begin < prev.end) r.shared_block = true;
      }
      r.data.assign(view->data.begin(), view->data.end());
      absl::StatusOr<std::vector<float>> values = pulled->Dequantize(t);
      EXPECT_THAT(values, IsOk()) << layout->tensors[t].name;
      if (values.ok()) r.values = *values;
      absl::StatusOr<std::vector<uint8_t>> grid = pulled->TensorScaleGrid(t);
      EXPECT_THAT(grid, IsOk());
      if (grid.ok()) r.grid = *grid;
      out[layout->tensors[t].name] = std::move(r);
    }
  }
  return out;
}

TEST(ClientPullTest, WholeBucketDequantizeIsTheSameForEveryDAndEveryFormat) {
  const std::map<std::string, TensorResult> reference = PullAll(1);
  ASSERT_EQ(reference.size(), 8u);
  for (int64_t d : {2, 3, 4, 6}) {
    const std::map<std::string, TensorResult> got = PullAll(d);
    ASSERT_EQ(got.size(), reference.size()) << "D=" << d;
    int split = 0, shared = 0;
    for (const auto& [name, r] : got) {
      split += r.fragments > 1;
      shared += r.shared_block;
    }
    // The job is built so that tensors straddle shards and shard boundaries cut 2D tiles.
    EXPECT_GT(split, 2) << "D=" << d;
    if (d >= 3) {
      EXPECT_GT(shared, 0) << "D=" << d;
    }
    for (const auto& [name, ref] : reference) {
      const TensorResult& r = got.at(name);
      EXPECT_EQ(r.data, ref.data) << name << " D=" << d;
      EXPECT_EQ(r.grid, ref.grid) << name << " D=" << d;
      ASSERT_EQ(r.values.size(), ref.values.size());
      for (size_t i = 0; i < r.values.size(); ++i) {
        ASSERT_EQ(kernels::FloatBits(r.values[i]), kernels::FloatBits(ref.values[i])) << name << " D=" << d << " i=" << i;
      }
    }
  }
}

// The grpc transport's data chunks, decoded in pieces from gRPC's slices, land the same bytes,
// and the same violations are refused.
TEST(ClientPullTest, DataChunksInPiecesLandAsTheirMessagesDo) {
  absl::StatusOr<Layout> l = ComputeJobLayout(testing_fakes::AllFormatsSpec(3));
  ASSERT_THAT(l, IsOk());
  auto layout = std::make_shared<const Layout>(*l);
  for (int32_t b = 0; b < static_cast<int32_t>(layout->buckets.size()); ++b) {
    const std::vector<float> master = BucketMaster(*layout, b);
    absl::StatusOr<PulledBucket> whole = Pull(layout, b, 0, 3, master);
    absl::StatusOr<PulledBucket> pieces = Pull(layout, b, 0, 3, master, 1000, /*pieces=*/true);
    ASSERT_THAT(whole, IsOk());
    ASSERT_THAT(pieces, IsOk());
    ASSERT_EQ(pieces->data().size(), whole->data().size());
    EXPECT_EQ(std::memcmp(pieces->data().data(), whole->data().data(), whole->data().size()), 0) << "bucket " << b;
  }
  absl::StatusOr<std::vector<v1::PullParamsResponse>> stream =
      MakePullStream(*layout, 0, 1, 7, BucketMaster(*layout, 0), 1000);
  ASSERT_THAT(stream, IsOk());
  ASSERT_GT(stream->size(), 3u);
  const Bucket& b = layout->buckets[0];
  std::vector<uint8_t> out(ShardByteRange(b, 1).size());
  ShardPullAssembler assembler(*layout, 0, 1, 7, out, /*verify_crc32c=*/true);
  const std::string& data = (*stream)[1].data().data();
  const std::span<const uint8_t> piece(reinterpret_cast<const uint8_t*>(data.data()), data.size());
  EXPECT_THAT(assembler.OnDataChunk(0, std::span<const std::span<const uint8_t>>(&piece, 1)),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("before the header")));
  ASSERT_THAT(assembler.OnMessage((*stream)[0]), IsOk());
  EXPECT_THAT(assembler.OnDataChunk(1, std::span<const std::span<const uint8_t>>(&piece, 1)),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("expected 0")));
}

TEST(ClientPullTest, DequantizedValuesEqualWholeTensorDequantization) {
  auto layout = std::make_shared<const Layout>(*ComputeJobLayout(testing_fakes::AllFormatsSpec(3)));
  int checked = 0;
  for (int32_t b = 0; b < static_cast<int32_t>(layout->buckets.size()); ++b) {
    const std::vector<float> master = BucketMaster(*layout, b);
    MAINSTAY_ASSERT_OK_AND_ASSIGN(PulledBucket pulled, Pull(layout, b, 0, 3, master));
    for (int32_t t : pulled.tensors()) {
      const LayoutTensor& info = layout->tensors[t];
      MAINSTAY_ASSERT_OK_AND_ASSIGN(std::vector<float> values, pulled.Dequantize(t));
      const std::vector<float> want =
          ReferenceDequantize(info, std::span<const float>(master).subspan(info.bucket_offset, info.numel));
      for (int64_t i = 0; i < info.numel; ++i) {
        ASSERT_EQ(kernels::FloatBits(values[i]), kernels::FloatBits(want[i])) << info.name << " i=" << i;
      }
      ++checked;
    }
  }
  EXPECT_EQ(checked, 8);
}

TEST(ClientPullTest, DequantizedValuesApproximateTheMasters) {
  auto layout = std::make_shared<const Layout>(*ComputeJobLayout(testing_fakes::AllFormatsSpec(3)));
  for (int32_t b = 0; b < static_cast<int32_t>(layout->buckets.size()); ++b) {
    const std::vector<float> master = BucketMaster(*layout, b);
    MAINSTAY_ASSERT_OK_AND_ASSIGN(PulledBucket pulled, Pull(layout, b, 0, 3, master));
    for (int32_t t : pulled.tensors()) {
      const LayoutTensor& info = layout->tensors[t];
      MAINSTAY_ASSERT_OK_AND_ASSIGN(std::vector<float> values, pulled.Dequantize(t));
      double err = 0, mag = 0;
      for (int64_t i = 0; i < info.numel; ++i) {
        const float m = master[info.bucket_offset + i];
        if (info.format == Format::kBF16) {
          ASSERT_EQ(values[i], kernels::Bf16ToFloat(kernels::FloatToBf16(m)));
        }
        err += std::abs(values[i] - m);
        mag += std::abs(m);
      }
      // 4-bit E2M1 is the coarsest: mean relative error well under 25%.
      EXPECT_LT(err, 0.25 * mag) << info.name << " " << FormatName(info.format);
    }
  }
}

TEST(ClientPullTest, OneShardCoversOnlyItsFragments) {
  auto layout = std::make_shared<const Layout>(*ComputeJobLayout(testing_fakes::AllFormatsSpec(3)));
  MAINSTAY_ASSERT_OK_AND_ASSIGN(int32_t mx, FindTensor(*layout, "layers.0.mx.weight"));
  const int32_t b = layout->tensors[mx].bucket;
  MAINSTAY_ASSERT_OK_AND_ASSIGN(PulledBucket one, Pull(layout, b, 1, 2, BucketMaster(*layout, b)));
  EXPECT_FALSE(one.complete());
  EXPECT_EQ(one.shard_begin(), 1);
  EXPECT_EQ(one.elements(), (IndexRange{layout->buckets[b].shard_numel, 2 * layout->buckets[b].shard_numel}));
  MAINSTAY_ASSERT_OK_AND_ASSIGN(TensorView view, one.Tensor("layers.0.mx.weight"));
  EXPECT_FALSE(view.complete);
  ASSERT_EQ(view.fragments.size(), 1u);
  EXPECT_EQ(view.fragments[0].shard, 1);
  EXPECT_EQ(view.data.size(), static_cast<size_t>(DataBytes(view.format, view.elements.size())));
  EXPECT_EQ(view.fragments[0].scales.size(), static_cast<size_t>(view.fragments[0].scale_blocks.size()));
  EXPECT_THAT(one.Dequantize(mx), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("whole bucket")));
}

// The trainer-side all-gather of mainstay.torch: each rank dequantizes only its own shard into its
// slice of a flat FP32 bucket; the slices put together equal whole-tensor dequantization bit for
// bit (tiles and MXFP8 blocks cut by shard boundaries included) and padding stays 0.
TEST(ClientPullTest, ShardByShardDequantizeCoveredEqualsWholeBucketDequantize) {
  for (int64_t d : {1, 2, 3, 4, 6}) {
    auto layout = std::make_shared<const Layout>(*ComputeJobLayout(testing_fakes::AllFormatsSpec(d)));
    for (int32_t b = 0; b < static_cast<int32_t>(layout->buckets.size()); ++b) {
      const Bucket& bucket = layout->buckets[b];
      const std::vector<float> master = BucketMaster(*layout, b);
      std::vector<float> flat(bucket.numel, -1.0f);  // every element must be written
      for (int32_t s = 0; s < static_cast<int32_t>(d); ++s) {
        MAINSTAY_ASSERT_OK_AND_ASSIGN(PulledBucket one, Pull(layout, b, s, s + 1, master));
        ASSERT_THAT(one.DequantizeCovered(std::span<float>(flat).subspan(s * bucket.shard_numel, bucket.shard_numel)),
                    IsOk()) << "D=" << d << " bucket " << b << " shard " << s;
      }
      MAINSTAY_ASSERT_OK_AND_ASSIGN(PulledBucket whole, Pull(layout, b, 0, static_cast<int32_t>(d), master));
      std::vector<bool> in_tensor(bucket.numel, false);
      for (int32_t t : bucket.tensors) {
        const LayoutTensor& info = layout->tensors[t];
        MAINSTAY_ASSERT_OK_AND_ASSIGN(std::vector<float> want, whole.Dequantize(t));
        for (int64_t i = 0; i < info.numel; ++i) {
          in_tensor[info.bucket_offset + i] = true;
          ASSERT_EQ(kernels::FloatBits(flat[info.bucket_offset + i]), kernels::FloatBits(want[i]))
              << info.name << " D=" << d << " i=" << i;
        }
      }
      for (int64_t i = 0; i < bucket.numel; ++i) {
        if (!in_tensor[i]) {
          ASSERT_EQ(flat[i], 0.0f) << "padding element " << i << " D=" << d;
        }
      }
    }
  }
}

TEST(ClientPullTest, DequantizeCoveredChecksTheOutputSize) {
  auto layout = std::make_shared<const Layout>(*ComputeJobLayout(testing_fakes::AllFormatsSpec(2)));
  MAINSTAY_ASSERT_OK_AND_ASSIGN(PulledBucket one, Pull(layout, 0, 1, 2, BucketMaster(*layout, 0)));
  std::vector<float> wrong(layout->buckets[0].shard_numel + 1);
  EXPECT_THAT(one.DequantizeCovered(wrong), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cover")));
}

TEST(ClientPullTest, TensorLookupErrors) {
  auto layout = std::make_shared<const Layout>(*ComputeJobLayout(testing_fakes::AllFormatsSpec(2)));
  MAINSTAY_ASSERT_OK_AND_ASSIGN(PulledBucket pulled, Pull(layout, 0, 0, 2, BucketMaster(*layout, 0)));
  EXPECT_THAT(pulled.Tensor("missing"), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_THAT(pulled.Tensor(1000), StatusIs(absl::StatusCode::kInvalidArgument));
  int32_t other = -1;
  for (size_t t = 0; t < layout->tensors.size(); ++t) {
    if (layout->tensors[t].bucket != 0) other = static_cast<int32_t>(t);
  }
  ASSERT_GE(other, 0);
  EXPECT_THAT(pulled.Tensor(other), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bucket")));
  std::vector<float> wrong(3);
  EXPECT_THAT(pulled.Dequantize(pulled.tensors()[0], wrong), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(ClientPullTest, UnchangedAnswerMeansKeepTheWeights) {
  auto layout = std::make_shared<const Layout>(*ComputeJobLayout(testing_fakes::SmallSpec(2)));
  std::vector<PulledShard> shards;
  for (int32_t s = 0; s < 2; ++s) {
    std::vector<uint8_t> data(DataBytes(layout->buckets[0].format, layout->buckets[0].shard_numel));
    ShardPullAssembler assembler(*layout, 0, s, 7, data, true);
    v1::PullParamsResponse m;
    m.mutable_header()->set_version(6);
    m.mutable_header()->set_unchanged(true);
    ASSERT_THAT(assembler.OnMessage(m), IsOk());
    m.Clear();
    m.mutable_data()->set_element_offset(0);
    m.mutable_data()->set_data("xx");
    EXPECT_THAT(assembler.OnMessage(m), StatusIs(absl::StatusCode::kInternal, HasSubstr("unchanged")));
    MAINSTAY_ASSERT_OK_AND_ASSIGN(PulledShard shard, assembler.Finish());
    shards.push_back(shard);
  }
  MAINSTAY_ASSERT_OK_AND_ASSIGN(PulledBucket pulled, MakePulledBucket(layout, 0, 0, {}, shards));
  EXPECT_TRUE(pulled.unchanged());
  EXPECT_EQ(pulled.version(), 6);
  EXPECT_TRUE(pulled.data().empty());
  ASSERT_FALSE(pulled.tensors().empty());
  EXPECT_THAT(pulled.Tensor(pulled.tensors()[0]), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("skipped")));
  std::vector<float> out(2 * layout->buckets[0].shard_numel);
  EXPECT_THAT(pulled.DequantizeCovered(out), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("skipped")));
}

TEST(ClientPullTest, ShardsThatDisagreeOnTheVersionAreAborted) {
  auto layout = std::make_shared<const Layout>(*ComputeJobLayout(testing_fakes::SmallSpec(2)));
  PulledShard a, b;
  a.shard = 0;
  a.version = 5;
  a.unchanged = true;
  b.shard = 1;
  b.version = 6;
  b.unchanged = true;
  EXPECT_THAT(MakePulledBucket(layout, 0, 0, {}, {a, b}), StatusIs(absl::StatusCode::kAborted, HasSubstr("pull again")));
}

// A valid stream with one message changed by `mutate` must be refused with `code`.
void ExpectRefused(const std::function<void(std::vector<v1::PullParamsResponse>&)>& mutate, absl::StatusCode code,
                   const std::string& message) {
  auto layout = std::make_shared<const Layout>(*ComputeJobLayout(testing_fakes::AllFormatsSpec(3)));
  MAINSTAY_ASSERT_OK_AND_ASSIGN(int32_t mx, FindTensor(*layout, "layers.0.mx.weight"));
  const int32_t b = layout->tensors[mx].bucket;
  MAINSTAY_ASSERT_OK_AND_ASSIGN(std::vector<v1::PullParamsResponse> stream,
                                MakePullStream(*layout, b, 1, 7, BucketMaster(*layout, b), 512));
  mutate(stream);
  std::vector<uint8_t> data(DataBytes(layout->buckets[b].format, layout->buckets[b].shard_numel));
  ShardPullAssembler assembler(*layout, b, 1, 7, data, true);
  absl::Status status;
  for (const v1::PullParamsResponse& m : stream) {
    status = assembler.OnMessage(m);
    if (!status.ok()) break;
  }
  if (status.ok()) status = assembler.Finish().status();
  EXPECT_THAT(status, StatusIs(code, HasSubstr(message)));
}

TEST(ClientPullTest, ProtocolViolationsAreInternalErrors) {
  using Stream = std::vector<v1::PullParamsResponse>;
  ExpectRefused([](Stream& s) { s.insert(s.begin() + 1, s[0]); }, absl::StatusCode::kInternal, "second header");
  ExpectRefused([](Stream& s) { s.erase(s.begin()); }, absl::StatusCode::kInternal, "before the header");
  ExpectRefused([](Stream& s) { std::swap(s[1], s[2]); }, absl::StatusCode::kInternal, "expected");
  ExpectRefused([](Stream& s) { s.erase(s.begin() + 2); }, absl::StatusCode::kInternal, "expected");
  ExpectRefused([](Stream& s) { s.pop_back(); }, absl::StatusCode::kInternal, "scales");
  ExpectRefused([](Stream& s) { s[0].mutable_header()->set_version(8); }, absl::StatusCode::kInternal, "version");
  ExpectRefused([](Stream& s) { s[0].mutable_header()->set_total_data_bytes(1); }, absl::StatusCode::kInternal,
                "total_data_bytes");
  ExpectRefused([](Stream& s) { s[0].mutable_header()->mutable_fragments()->RemoveLast(); },
                absl::StatusCode::kInternal, "fragments");
  ExpectRefused([](Stream& s) { s[0].mutable_header()->mutable_fragments(0)->set_tensor(99); },
                absl::StatusCode::kInternal, "fragments[0]");
  ExpectRefused([](Stream& s) { s[0].mutable_header()->set_scale_type(v1::ELEMENT_TYPE_FP32); },
                absl::StatusCode::kInternal, "scale_type");
  ExpectRefused([](Stream& s) { s[0].mutable_header()->set_format(v1::FORMAT_BF16); }, absl::StatusCode::kInternal,
                "format");
  ExpectRefused([](Stream& s) { s[1].mutable_data()->mutable_data()->push_back('x'); }, absl::StatusCode::kInternal,
                "expected");
  ExpectRefused([](Stream& s) { (*s[1].mutable_data()->mutable_data())[0] ^= 1; }, absl::StatusCode::kDataLoss,
                "CRC-32C");
}

// Delta pulls (PullParamsRequest.delta_chunk_bytes): a stream of version B's changed chunks,
// built from two full streams the way the daemon builds it, patched into a copy of version A.
struct DeltaCase {
  std::shared_ptr<const Layout> layout;
  int32_t bucket = 0;
  std::vector<uint8_t> a, b;                  // shard 1's packed data of the two versions
  std::vector<uint8_t> a_scales, b_scales;    // and its block scales
  std::vector<v1::PullParamsResponse> delta;  // header, changed chunks, B's scales (or their changed chunks)
  int64_t changed_bytes = 0;                  // payload bytes of the changed chunks
  int patched_chunks = 0;                     // of them, sent as byte patches
  int64_t scale_bytes = 0;                    // payload bytes of the scales
};

std::vector<uint8_t> ScalesOf(const std::vector<v1::PullParamsResponse>& stream) {
  std::vector<uint8_t> out;
  for (const v1::PullParamsResponse& m : stream) {
    if (m.has_scales()) out.insert(out.end(), m.scales().data().begin(), m.scales().data().end());
  }
  return out;
}

std::vector<uint8_t> DataOf(const std::vector<v1::PullParamsResponse>& stream) {
  std::vector<uint8_t> out;
  for (const v1::PullParamsResponse& m : stream) {
    if (m.has_data()) out.insert(out.end(), m.data().data().begin(), m.data().data().end());
  }
  return out;
}

// With `patches`, a changed chunk goes as a byte patch against A when that is smaller; with
// `scales`, the block scales go as a delta too (their changed chunks, patched likewise).
DeltaCase MakeDelta(int64_t chunk, bool patches = false, bool scales = false) {
  DeltaCase c;
  c.layout = std::make_shared<const Layout>(*ComputeJobLayout(testing_fakes::AllFormatsSpec(2)));
  const int32_t mx = *FindTensor(*c.layout, "layers.0.mx.weight");
  c.bucket = c.layout->tensors[mx].bucket;
  std::vector<float> master = BucketMaster(*c.layout, c.bucket);
  auto a = MakePullStream(*c.layout, c.bucket, 1, 7, master, 1 << 20);
  for (size_t i = 0; i < master.size(); i += 997) master[i] *= 1.5f;  // a few values move
  auto b = MakePullStream(*c.layout, c.bucket, 1, 7, master, 1 << 20);
  EXPECT_TRUE(a.ok() && b.ok());
  c.a = DataOf(*a);
  c.b = DataOf(*b);
  c.a_scales = ScalesOf(*a);
  c.b_scales = ScalesOf(*b);
  const int bits = Describe(c.layout->buckets[c.bucket].format).bits_per_element;
  v1::PullParamsResponse header = (*b)[0];
  header.mutable_header()->set_delta(true);
  header.mutable_header()->set_data_crc32c(Crc32c(c.b.data(), c.b.size()));
  c.delta.push_back(header);
  google::protobuf::RepeatedField<int32_t> listed;  // (not into c.delta[0]: c.delta grows meanwhile)
  testing_fakes::ForEachDeltaChunk(c.a, c.b, chunk, patches, &listed,
                                   [&](int64_t begin, std::string data, std::string patch) {
                                     v1::PullParamsResponse m;
                                     m.mutable_data()->set_element_offset(begin * 8 / bits);
                                     c.changed_bytes += static_cast<int64_t>(data.size() + patch.size());
                                     if (!patch.empty()) ++c.patched_chunks;
                                     m.mutable_data()->set_data(std::move(data));
                                     m.mutable_data()->set_patch(std::move(patch));
                                     c.delta.push_back(std::move(m));
                                   });
  c.delta[0].mutable_header()->mutable_delta_chunks()->Swap(&listed);
  if (!scales) {
    for (const v1::PullParamsResponse& m : *b) {
      if (m.has_scales()) c.delta.push_back(m);
    }
    c.scale_bytes = static_cast<int64_t>(c.b_scales.size());
    return c;
  }
  const int entry = static_cast<int>(c.b_scales.size() / header.header().total_scales());
  c.delta[0].mutable_header()->set_delta_scales(true);
  c.delta[0].mutable_header()->set_scales_crc32c(Crc32c(c.b_scales.data(), c.b_scales.size()));
  testing_fakes::ForEachDeltaChunk(c.a_scales, c.b_scales, chunk, patches, &listed,
                                   [&](int64_t begin, std::string data, std::string patch) {
                                     v1::PullParamsResponse m;
                                     m.mutable_scales()->set_scale_offset(begin / entry);
                                     c.scale_bytes += static_cast<int64_t>(data.size() + patch.size());
                                     m.mutable_scales()->set_data(std::move(data));
                                     m.mutable_scales()->set_patch(std::move(patch));
                                     c.delta.push_back(std::move(m));
                                   });
  c.delta[0].mutable_header()->mutable_delta_scale_chunks()->Swap(&listed);
  return c;
}

absl::StatusOr<PulledShard> RunDelta(const DeltaCase& c, std::vector<uint8_t>& data, int64_t chunk, bool asked = true,
                                     bool patches_asked = true, const std::vector<uint8_t>* since_scales = nullptr) {
  ShardPullAssembler assembler(*c.layout, c.bucket, 1, 7, data, /*verify_crc32c=*/false);
  if (asked) {
    assembler.ExpectDelta(chunk, patches_asked,
                          since_scales != nullptr ? std::span<const uint8_t>(*since_scales) : std::span<const uint8_t>());
  }
  for (const v1::PullParamsResponse& m : c.delta) MAINSTAY_RETURN_IF_ERROR(assembler.OnMessage(m));
  return assembler.Finish();
}

TEST(ClientPullTest, ADeltaPatchesTheCopyIntoTheNewVersionByteForByte) {
  constexpr int64_t kChunk = 512;  // (the daemon takes 4 KiB and up; this shard is 4 KiB)
  const DeltaCase whole = MakeDelta(kChunk);
  ASSERT_GT(whole.changed_bytes, 0);
  ASSERT_LT(whole.changed_bytes, static_cast<int64_t>(whole.b.size()));  // some chunks stay the reader's
  // Changed chunks whole, then as byte patches where smaller: the few moved values, not their chunks.
  const DeltaCase patched = MakeDelta(kChunk, /*patches=*/true);
  ASSERT_GT(patched.patched_chunks, 0);
  ASSERT_LT(patched.changed_bytes, whole.changed_bytes);
  for (const DeltaCase* c : {&whole, &patched}) {
    std::vector<uint8_t> data = c->a;
    MAINSTAY_ASSERT_OK_AND_ASSIGN(PulledShard shard, RunDelta(*c, data, kChunk));
    EXPECT_EQ(data, c->b);
    EXPECT_EQ(shard.data_bytes_received, c->changed_bytes);
  }
}

TEST(ClientPullTest, AForgedTruncatedOrUnaskedDeltaIsRefused) {
  constexpr int64_t kChunk = 512;
  DeltaCase c = MakeDelta(kChunk);
  ASSERT_GE(c.delta.size(), 3u);
  std::vector<uint8_t> data = c.a;
  // A changed byte in a chunk: the whole result's CRC-32C is not the daemon's.
  DeltaCase forged = c;
  (*forged.delta[1].mutable_data()->mutable_data())[5] ^= 0x40;
  EXPECT_THAT(RunDelta(forged, data, kChunk), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("CRC-32C")));
  // A chunk left out, or one the header did not list.
  DeltaCase truncated = c;
  truncated.delta.erase(truncated.delta.begin() + 1);
  data = c.a;
  EXPECT_THAT(RunDelta(truncated, data, kChunk), StatusIs(absl::StatusCode::kInternal));
  DeltaCase unlisted = c;
  unlisted.delta[0].mutable_header()->mutable_delta_chunks()->RemoveLast();
  data = c.a;
  EXPECT_THAT(RunDelta(unlisted, data, kChunk), StatusIs(absl::StatusCode::kInternal));
  // A copy that is not what the reader's hashes claimed: the result is not the version.
  const auto& listed = c.delta[0].header().delta_chunks();
  int64_t kept = 0;  // a chunk the delta does not send
  while (std::find(listed.begin(), listed.end(), kept) != listed.end()) ++kept;
  ASSERT_LT(kept * kChunk, static_cast<int64_t>(c.a.size()));
  data = c.a;
  data[kept * kChunk] ^= 1;
  EXPECT_THAT(RunDelta(c, data, kChunk), StatusIs(absl::StatusCode::kDataLoss));
  // A delta nobody asked for, and chunk indexes out of order.
  data = c.a;
  EXPECT_THAT(RunDelta(c, data, kChunk, /*asked=*/false), StatusIs(absl::StatusCode::kInternal, HasSubstr("asked")));
  DeltaCase disordered = c;
  disordered.delta[0].mutable_header()->add_delta_chunks(0);
  data = c.a;
  EXPECT_THAT(RunDelta(disordered, data, kChunk), StatusIs(absl::StatusCode::kInternal, HasSubstr("ascending")));
}

TEST(ClientPullTest, AForgedMalformedOrUnaskedBytePatchIsRefused) {
  constexpr int64_t kChunk = 512;
  const DeltaCase c = MakeDelta(kChunk, /*patches=*/true);
  size_t first = 1;  // the first message holding a patch
  while (first < c.delta.size() && c.delta[first].data().patch().empty()) ++first;
  ASSERT_LT(first, c.delta.size());
  std::vector<uint8_t> data = c.a;
  // A patch whose new byte is not the version's: the whole result's CRC-32C is not the daemon's.
  DeltaCase forged = c;
  std::string* patch = forged.delta[first].mutable_data()->mutable_patch();
  patch->back() = static_cast<char>(patch->back() ^ 0x40);
  EXPECT_THAT(RunDelta(forged, data, kChunk), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("CRC-32C")));
  // A patch that is cut off mid-record, or points past its chunk.
  DeltaCase cut = c;
  cut.delta[first].mutable_data()->mutable_patch()->pop_back();
  data = c.a;
  EXPECT_THAT(RunDelta(cut, data, kChunk), StatusIs(absl::StatusCode::kInternal, HasSubstr("no byte after its gap")));
  DeltaCase past = c;
  past.delta[first].mutable_data()->mutable_patch()->append("\xff\x7f\x01");
  data = c.a;
  EXPECT_THAT(RunDelta(past, data, kChunk), StatusIs(absl::StatusCode::kInternal, HasSubstr("past the chunk")));
  // A patch with data beside it, or for a request that did not name its copy's version.
  DeltaCase both = c;
  both.delta[first].mutable_data()->set_data("x");
  data = c.a;
  EXPECT_THAT(RunDelta(both, data, kChunk), StatusIs(absl::StatusCode::kInternal, HasSubstr("both data and a byte patch")));
  data = c.a;
  EXPECT_THAT(RunDelta(c, data, kChunk, /*asked=*/true, /*patches_asked=*/false),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("byte patch that was not asked for")));
  // A patch in a stream that is not a delta.
  auto stream = MakePullStream(*c.layout, c.bucket, 1, 7, BucketMaster(*c.layout, c.bucket), 1 << 20);
  ASSERT_TRUE(stream.ok());
  (*stream)[1].mutable_data()->set_patch(c.delta[first].data().patch());
  std::vector<uint8_t> out(c.b.size());
  ShardPullAssembler assembler(*c.layout, c.bucket, 1, 7, out, /*verify_crc32c=*/true);
  assembler.ExpectDelta(kChunk, /*patches=*/true);
  absl::Status s = assembler.OnMessage((*stream)[0]);
  if (s.ok()) s = assembler.OnMessage((*stream)[1]);
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kInternal, HasSubstr("outside a delta")));
}

TEST(ClientPullTest, ADeltaOfTheBlockScalesPatchesTheCopysScalesIntoTheNewVersions) {
  constexpr int64_t kChunk = 512;
  for (const bool patches : {false, true}) {
    const DeltaCase c = MakeDelta(kChunk, patches, /*scales=*/true);
    ASSERT_NE(c.a_scales, c.b_scales);
    ASSERT_GT(c.delta[0].header().delta_scale_chunks_size(), 0);
    std::vector<uint8_t> data = c.a;
    MAINSTAY_ASSERT_OK_AND_ASSIGN(PulledShard shard, RunDelta(c, data, kChunk, true, true, &c.a_scales));
    EXPECT_EQ(data, c.b);
    EXPECT_EQ(shard.scales, c.b_scales);
    EXPECT_EQ(shard.scale_bytes_received, c.scale_bytes);
    if (patches) {
      EXPECT_LT(c.scale_bytes, static_cast<int64_t>(c.b_scales.size()));
    }
  }
}

TEST(ClientPullTest, AForgedTruncatedOrUnaskedDeltaOfTheScalesIsRefused) {
  constexpr int64_t kChunk = 512;
  const DeltaCase c = MakeDelta(kChunk, /*patches=*/true, /*scales=*/true);
  const size_t last = c.delta.size() - 1;  // a scale chunk
  ASSERT_TRUE(c.delta[last].has_scales());
  std::vector<uint8_t> data = c.a;
  // Scales that are not the version's: DATA_LOSS on the scales' CRC-32C.
  DeltaCase forged = c;
  v1::ScaleChunk* chunk = forged.delta[last].mutable_scales();
  std::string* bytes = chunk->patch().empty() ? chunk->mutable_data() : chunk->mutable_patch();
  bytes->back() = static_cast<char>(bytes->back() ^ 0x10);
  EXPECT_THAT(RunDelta(forged, data, kChunk, true, true, &c.a_scales),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("block scales")));
  // A copy whose scales are not what its hashes said.
  std::vector<uint8_t> wrong = c.a_scales;
  wrong[0] ^= 1;
  data = c.a;
  if (c.delta[0].header().delta_scale_chunks(0) != 0) {
    EXPECT_THAT(RunDelta(c, data, kChunk, true, true, &wrong), StatusIs(absl::StatusCode::kDataLoss));
  }
  // A scale chunk left out; a delta of the scales that the request did not ask for.
  DeltaCase truncated = c;
  truncated.delta.pop_back();
  data = c.a;
  EXPECT_THAT(RunDelta(truncated, data, kChunk, true, true, &c.a_scales),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("scale chunks")));
  data = c.a;
  EXPECT_THAT(RunDelta(c, data, kChunk), StatusIs(absl::StatusCode::kInternal, HasSubstr("scales that was not asked")));
  // A copy of other scales' size.
  std::vector<uint8_t> shorter(c.a_scales.begin(), c.a_scales.end() - 1);
  data = c.a;
  EXPECT_THAT(RunDelta(c, data, kChunk, true, true, &shorter), StatusIs(absl::StatusCode::kInternal));
}

TEST(BufferPoolTest, AReleasedBufferIsReusedForTheSameSizeOnly) {
  std::shared_ptr<BufferPool> pool = BufferPool::Create(1 << 20);
  uint8_t* first;
  {
    PooledBytes a = pool->Acquire(4096);
    first = a.data();
    EXPECT_EQ(a.size(), 4096u);
  }
  EXPECT_EQ(pool->cached_bytes(), 4096);
  PooledBytes other = pool->Acquire(100);  // another size: a new allocation
  EXPECT_EQ(pool->reuses(), 0);
  PooledBytes again = pool->Acquire(4096);
  EXPECT_EQ(again.data(), first);
  EXPECT_EQ(pool->reuses(), 1);
  EXPECT_EQ(pool->cached_bytes(), 0);
}

TEST(BufferPoolTest, KeepsAtMostTheLimitDroppingTheOldestFirst) {
  std::shared_ptr<BufferPool> pool = BufferPool::Create(10000);
  {
    PooledBytes a = pool->Acquire(4000);
    PooledBytes b = pool->Acquire(5000);
    PooledBytes c = pool->Acquire(6000);
    PooledBytes too_big = pool->Acquire(20000);
    a = PooledBytes();  // released: 4000 cached
    b = PooledBytes();  // 9000
  }  // c (6000) pushes out a, then b; too_big is never kept
  EXPECT_EQ(pool->cached_bytes(), 6000);
  PooledBytes reused = pool->Acquire(6000);
  EXPECT_EQ(pool->reuses(), 1);
  PooledBytes fresh = pool->Acquire(4000);
  EXPECT_EQ(pool->reuses(), 1);
}

TEST(BufferPoolTest, ABufferOutlivingItsPoolIsFreed) {
  std::shared_ptr<BufferPool> pool = BufferPool::Create(1 << 20);
  PooledBytes held = pool->Acquire(1 << 16);
  std::memset(held.data(), 1, held.size());
  pool.reset();
  held = PooledBytes();  // no pool to go back to (ASan/valgrind would flag a leak or a stale pool)
  EXPECT_EQ(held.size(), 0u);
}

TEST(BufferPoolTest, ZeroLimitKeepsNothing) {
  std::shared_ptr<BufferPool> pool = BufferPool::Create(0);
  { PooledBytes a = pool->Acquire(64); }
  EXPECT_EQ(pool->cached_bytes(), 0);
}

}  // namespace
}  // namespace mainstay
