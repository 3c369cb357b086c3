#include "common/layout_proto.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/format.h"
#include "common/layout.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "tests/testing/status_matchers.h"

namespace mainstay {
namespace {

using ::mainstay::testing::IsOk;
using ::mainstay::testing::StatusIs;
using ::testing::StartsWith;

std::string Upper(absl::string_view s) { return absl::AsciiStrToUpper(s); }

// ---- Enums

TEST(FormatProtoTest, EveryFormatRoundTripsUnderItsCanonicalName) {
  for (const FormatDescriptor& d : AllFormats()) {
    const v1::Format p = FormatToProto(d.format);
    EXPECT_EQ(v1::Format_Name(p), "FORMAT_" + Upper(d.name));
    MAINSTAY_ASSERT_OK_AND_ASSIGN(Format back, FormatFromProto(p));
    EXPECT_EQ(back, d.format);
  }
  // Every proto value but UNSPECIFIED is some C++ format.
  EXPECT_EQ(v1::Format_descriptor()->value_count(), static_cast<int>(AllFormats().size()) + 1);
}

TEST(FormatProtoTest, UnspecifiedAndUnknownValuesAreInvalidArgument) {
  EXPECT_THAT(FormatFromProto(v1::FORMAT_UNSPECIFIED), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(FormatFromProto(static_cast<v1::Format>(42)), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(FormatFromProto(static_cast<v1::Format>(-1)), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(ElementTypeProtoTest, EveryElementTypeRoundTripsUnderItsName) {
  for (int i = 0; i <= static_cast<int>(ElementType::kE8M0); ++i) {
    const ElementType type = static_cast<ElementType>(i);
    const v1::ElementType p = ElementTypeToProto(type);
    EXPECT_EQ(v1::ElementType_Name(p), "ELEMENT_TYPE_" + Upper(ElementTypeName(type)));
    MAINSTAY_ASSERT_OK_AND_ASSIGN(ElementType back, ElementTypeFromProto(p));
    EXPECT_EQ(back, type);
  }
  EXPECT_EQ(v1::ElementType_descriptor()->value_count(), static_cast<int>(ElementType::kE8M0) + 2);
  EXPECT_THAT(ElementTypeFromProto(v1::ELEMENT_TYPE_UNSPECIFIED), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ElementTypeFromProto(static_cast<v1::ElementType>(99)), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(LayoutPolicyProtoTest, BothPoliciesRoundTripUnderTheirNames) {
  for (LayoutPolicy policy : {LayoutPolicy::kFlat, LayoutPolicy::kWholeTensor}) {
    const v1::LayoutPolicy p = LayoutPolicyToProto(policy);
    EXPECT_EQ(v1::LayoutPolicy_Name(p), "LAYOUT_POLICY_" + Upper(LayoutPolicyName(policy)));
    MAINSTAY_ASSERT_OK_AND_ASSIGN(LayoutPolicy back, LayoutPolicyFromProto(p));
    EXPECT_EQ(back, policy);
  }
  EXPECT_THAT(LayoutPolicyFromProto(v1::LAYOUT_POLICY_UNSPECIFIED), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(LayoutPolicyFromProto(static_cast<v1::LayoutPolicy>(3)), StatusIs(absl::StatusCode::kInvalidArgument));
}

// ---- TensorSpec

TEST(TensorSpecProtoTest, RoundTripsEveryFormat) {
  for (const FormatDescriptor& d : AllFormats()) {
    const TensorSpec spec{"decoder.layers.0.mlp.fc1.weight", {4096, 1024}, d.format};
    v1::TensorSpec proto;
    TensorSpecToProto(spec, &proto);
    MAINSTAY_ASSERT_OK_AND_ASSIGN(TensorSpec back, TensorSpecFromProto(proto));
    EXPECT_EQ(back, spec);
  }
}

TEST(TensorSpecProtoTest, UnspecifiedFormatReadsAsUnresolvedBf16) {
  v1::TensorSpec proto;
  proto.set_name("w");
  proto.add_shape(3);
  MAINSTAY_ASSERT_OK_AND_ASSIGN(TensorSpec spec, TensorSpecFromProto(proto));
  EXPECT_EQ(spec, (TensorSpec{"w", {3}, Format::kBF16}));
}

TEST(TensorSpecProtoTest, MalformedSpecsNameTheField) {
  v1::TensorSpec good;
  good.set_name("w");
  good.add_shape(8);
  good.add_shape(16);
  ASSERT_THAT(TensorSpecFromProto(good), IsOk());

  v1::TensorSpec p = good;
  p.clear_name();
  EXPECT_THAT(TensorSpecFromProto(p), StatusIs(absl::StatusCode::kInvalidArgument, StartsWith("name:")));
  p = good;
  p.clear_shape();
  EXPECT_THAT(TensorSpecFromProto(p), StatusIs(absl::StatusCode::kInvalidArgument, StartsWith("shape:")));
  p = good;
  p.set_shape(1, 0);
  EXPECT_THAT(TensorSpecFromProto(p), StatusIs(absl::StatusCode::kInvalidArgument, StartsWith("shape[1]:")));
  p = good;
  p.set_shape(0, int64_t{1} << 30);
  p.set_shape(1, int64_t{1} << 30);
  EXPECT_THAT(TensorSpecFromProto(p), StatusIs(absl::StatusCode::kInvalidArgument, StartsWith("shape:")));
  p = good;
  p.set_format(static_cast<v1::Format>(77));
  EXPECT_THAT(TensorSpecFromProto(p), StatusIs(absl::StatusCode::kInvalidArgument, StartsWith("format:")));
}

// ---- Layout round trips

// A small model with odd shapes and a mix of formats, so layouts have several buffers,
// several buckets, tensors straddling shards and 64-element padding everywhere.
std::vector<TensorSpec> MixedModel() {
  return {
      {"embedding.word_embeddings.weight", {1000, 96}, Format::kBF16},
      {"decoder.layers.0.input_layernorm.weight", {96}, Format::kBF16, 1},
      {"decoder.layers.0.self_attention.linear_qkv.weight", {288, 96}, Format::kNVFP4},
      {"decoder.layers.0.self_attention.linear_qkv.bias", {289}, Format::kBF16},
      {"decoder.layers.0.self_attention.linear_proj.weight", {96, 96}, Format::kMXFP8},
      {"decoder.layers.0.mlp.linear_fc1.weight", {384, 96}, Format::kFP8E4M3Current},
      {"decoder.layers.0.mlp.linear_fc2.weight", {96, 384}, Format::kFP8Block},
      {"decoder.layers.1.self_attention.linear_qkv.weight", {288, 96}, Format::kNVFP4},
      {"decoder.layers.1.mlp.linear_fc1.weight", {384, 96}, Format::kFP8E4M3Delayed},
      {"decoder.layers.1.mlp.linear_fc2.weight", {96, 384}, Format::kFP8E5M2Delayed},
      {"decoder.layers.1.odd", {7, 3, 5}, Format::kFP16},
      {"decoder.final_layernorm.weight", {97}, Format::kFP8E5M2Current, 2},
      {"output_layer.weight", {1000, 96}, Format::kBF16},
  };
}

// One format only: one buffer, so a small bucket_numel gives many buckets of one format.
std::vector<TensorSpec> OneFormatModel(Format format) {
  std::vector<TensorSpec> tensors;
  for (int i = 0; i < 6; ++i) {
    tensors.push_back({absl::StrCat("layers.", i, ".weight"), {256, 64 + 32 * i}, format});
    tensors.push_back({absl::StrCat("layers.", i, ".bias"), {65 + i}, format});
  }
  return tensors;
}

void ExpectRoundTrips(const Layout& layout) {
  v1::Layout proto;
  LayoutToProto(layout, &proto);
  MAINSTAY_ASSERT_OK_AND_ASSIGN(Layout back, LayoutFromProto(proto));
  EXPECT_TRUE(back == layout);

  std::string bytes;
  ASSERT_TRUE(proto.SerializeToString(&bytes));
  v1::Layout parsed;
  ASSERT_TRUE(parsed.ParseFromString(bytes));
  MAINSTAY_ASSERT_OK_AND_ASSIGN(Layout from_wire, LayoutFromProto(parsed));
  EXPECT_TRUE(from_wire == layout);

  // ToProto overwrites whatever the output held.
  v1::Layout reused = parsed;
  reused.add_tensors()->set_name("stale");
  LayoutToProto(layout, &reused);
  EXPECT_EQ(reused.SerializeAsString(), bytes);
}

class LayoutProtoRoundTripTest
    : public ::testing::TestWithParam<std::tuple<LayoutPolicy, int64_t, int64_t>> {};

TEST_P(LayoutProtoRoundTripTest, MixedFormatsSurviveProtoAndWire) {
  const auto [policy, d, bucket_numel] = GetParam();
  const std::vector<TensorSpec> tensors = MixedModel();
  MAINSTAY_ASSERT_OK_AND_ASSIGN(Layout layout, ComputeLayout(tensors, {d, policy, bucket_numel}));
  ExpectRoundTrips(layout);
}

TEST_P(LayoutProtoRoundTripTest, EachSingleFormatSurvivesProtoAndWire) {
  const auto [policy, d, bucket_numel] = GetParam();
  for (const FormatDescriptor& f : AllFormats()) {
    SCOPED_TRACE(f.name);
    const std::vector<TensorSpec> tensors = OneFormatModel(f.format);
    MAINSTAY_ASSERT_OK_AND_ASSIGN(Layout layout, ComputeLayout(tensors, {d, policy, bucket_numel}));
    ExpectRoundTrips(layout);
  }
}

INSTANTIATE_TEST_SUITE_P(
    PoliciesAndSizes, LayoutProtoRoundTripTest,
    ::testing::Combine(::testing::Values(LayoutPolicy::kFlat, LayoutPolicy::kWholeTensor),
                       ::testing::Values(1, 2, 3, 4, 6, 8, 12, 16, 64),
                       // 0 = default (one bucket per format here); 20000 = several buckets.
                       ::testing::Values(0, 20000)),
    [](const auto& info) {
      return absl::StrCat(LayoutPolicyName(std::get<0>(info.param)), "_D", std::get<1>(info.param), "_bucket",
                          std::get<2>(info.param));
    });

// ---- Malformed layouts

// D = 4, flat, one bf16 bucket of 8192 elements (shard_numel 2048). Reverse registration
// order puts c at 0, b at 3072 and a at 4096, so shard 1 holds the tail of c and all of b.
v1::Layout ValidProto(LayoutPolicy policy = LayoutPolicy::kFlat) {
  const std::vector<TensorSpec> tensors = {
      {"a", {64, 64}, Format::kBF16}, {"b", {1000}, Format::kBF16}, {"c", {32, 96}, Format::kBF16}};
  auto layout = ComputeLayout(tensors, {4, policy, 0});
  EXPECT_THAT(layout, IsOk());
  v1::Layout proto;
  if (layout.ok()) LayoutToProto(*layout, &proto);
  return proto;
}

struct Corruption {
  std::string name;
  std::function<void(v1::Layout&)> corrupt;
  std::string field;  // the error message must start with "<field>:"
};

std::vector<Corruption> Corruptions() {
  auto shard = [](v1::Layout& l, int r) { return l.mutable_buckets(0)->mutable_shards(r); };
  return {
      {"PolicyUnspecified", [](v1::Layout& l) { l.set_policy(v1::LAYOUT_POLICY_UNSPECIFIED); }, "policy"},
      {"PolicyOutOfRange", [](v1::Layout& l) { l.set_policy(static_cast<v1::LayoutPolicy>(9)); }, "policy"},
      {"DZero", [](v1::Layout& l) { l.set_data_parallel_size(0); }, "data_parallel_size"},
      {"DTooLarge", [](v1::Layout& l) { l.set_data_parallel_size(kMaxDataParallelSize + 1); }, "data_parallel_size"},
      {"BucketNumelZero", [](v1::Layout& l) { l.set_bucket_numel(0); }, "bucket_numel"},
      {"TensorNameEmpty", [](v1::Layout& l) { l.mutable_tensors(0)->clear_name(); }, "tensors[0].name"},
      {"TensorNameDuplicate", [](v1::Layout& l) { l.mutable_tensors(1)->set_name("a"); }, "tensors[1].name"},
      {"TensorShapeEmpty", [](v1::Layout& l) { l.mutable_tensors(0)->clear_shape(); }, "tensors[0].shape"},
      {"TensorShapeZero", [](v1::Layout& l) { l.mutable_tensors(0)->set_shape(1, 0); }, "tensors[0].shape[1]"},
      {"TensorShapeOverflow",
       [](v1::Layout& l) {
         l.mutable_tensors(0)->set_shape(0, int64_t{1} << 32);
         l.mutable_tensors(0)->set_shape(1, int64_t{1} << 32);
       },
       "tensors[0].shape"},
      {"TensorNumelWrong", [](v1::Layout& l) { l.mutable_tensors(0)->set_numel(4095); }, "tensors[0].numel"},
      {"TensorFormatUnspecified", [](v1::Layout& l) { l.mutable_tensors(0)->set_format(v1::FORMAT_UNSPECIFIED); },
       "tensors[0].format"},
      {"TensorFormatOutOfRange", [](v1::Layout& l) { l.mutable_tensors(0)->set_format(static_cast<v1::Format>(50)); },
       "tensors[0].format"},
      {"TensorFormatDiffersFromBucket", [](v1::Layout& l) { l.mutable_tensors(2)->set_format(v1::FORMAT_NVFP4); },
       "tensors[2].format"},
      {"TensorBucketNegative", [](v1::Layout& l) { l.mutable_tensors(0)->set_bucket(-1); }, "tensors[0].bucket"},
      {"TensorBucketPastEnd", [](v1::Layout& l) { l.mutable_tensors(0)->set_bucket(1); }, "tensors[0].bucket"},
      {"TensorOffsetMisaligned", [](v1::Layout& l) { l.mutable_tensors(0)->set_bucket_offset(4096 + 32); },
       "tensors[0].bucket_offset"},
      {"TensorOffsetPastBucket", [](v1::Layout& l) { l.mutable_tensors(0)->set_bucket_offset(8192); },
       "tensors[0].bucket_offset"},
      {"TensorOffsetHuge", [](v1::Layout& l) { l.mutable_tensors(0)->set_bucket_offset(INT64_MAX - 63); },
       "tensors[0].bucket_offset"},
      {"BucketIndexWrong", [](v1::Layout& l) { l.mutable_buckets(0)->set_index(3); }, "buckets[0].index"},
      {"BucketFormatUnspecified", [](v1::Layout& l) { l.mutable_buckets(0)->set_format(v1::FORMAT_UNSPECIFIED); },
       "buckets[0].format"},
      {"BucketShardNumelZero",
       [](v1::Layout& l) {
         l.mutable_buckets(0)->set_shard_numel(0);
         l.mutable_buckets(0)->set_numel(0);
       },
       "buckets[0].shard_numel"},
      {"BucketShardNumelHuge", [](v1::Layout& l) { l.mutable_buckets(0)->set_shard_numel(INT64_MAX / 2); },
       "buckets[0].shard_numel"},
      {"BucketNumelNotDTimesShard", [](v1::Layout& l) { l.mutable_buckets(0)->set_numel(8256); }, "buckets[0].numel"},
      {"BucketNumelMisaligned",
       [](v1::Layout& l) {
         l.mutable_buckets(0)->set_shard_numel(2048 + 32);
         l.mutable_buckets(0)->set_numel(4 * (2048 + 32));
       },
       "buckets[0].numel"},
      {"BucketDataNumelWrong", [](v1::Layout& l) { l.mutable_buckets(0)->set_data_numel(8000); },
       "buckets[0].data_numel"},
      {"BucketDataNumelOverNumel", [](v1::Layout& l) { l.mutable_buckets(0)->set_data_numel(9000); },
       "buckets[0].data_numel"},
      {"BucketTensorOutOfRange", [](v1::Layout& l) { l.mutable_buckets(0)->set_tensors(0, 3); },
       "buckets[0].tensors[0]"},
      {"BucketTensorListedTwice", [](v1::Layout& l) { l.mutable_buckets(0)->add_tensors(0); },
       "buckets[0].tensors[3]"},
      {"BucketTensorMissing", [](v1::Layout& l) { l.mutable_buckets(0)->mutable_tensors()->RemoveLast(); },
       "buckets[0].data_numel"},
      {"BucketTensorsOutOfOrder", [](v1::Layout& l) { l.mutable_buckets(0)->mutable_tensors()->SwapElements(0, 1); },
       "buckets[0].tensors[1]"},
      {"ShardMissing", [](v1::Layout& l) { l.mutable_buckets(0)->mutable_shards()->RemoveLast(); },
       "buckets[0].shards"},
      {"ShardExtra", [](v1::Layout& l) { *l.mutable_buckets(0)->add_shards() = l.buckets(0).shards(0); },
       "buckets[0].shards"},
      {"ShardRankWrong", [shard](v1::Layout& l) { shard(l, 1)->set_rank(2); }, "buckets[0].shards[1].rank"},
      {"ShardRangeWrong", [shard](v1::Layout& l) { shard(l, 1)->mutable_elements()->set_end(4000); },
       "buckets[0].shards[1].elements"},
      {"FragmentTensorOutOfRange", [shard](v1::Layout& l) { shard(l, 1)->mutable_fragments(0)->set_tensor(7); },
       "buckets[0].shards[1].fragments[0].tensor"},
      {"FragmentEmpty",
       [shard](v1::Layout& l) {
         auto* e = shard(l, 1)->mutable_fragments(0)->mutable_elements();
         e->set_end(e->begin());
       },
       "buckets[0].shards[1].fragments[0].elements"},
      {"FragmentPastTensorEnd",
       [shard](v1::Layout& l) { shard(l, 1)->mutable_fragments(0)->mutable_elements()->set_end(5000); },
       "buckets[0].shards[1].fragments[0].elements"},
      {"FragmentOffsetInconsistent",
       [shard](v1::Layout& l) {
         auto* f = shard(l, 1)->mutable_fragments(0);
         f->set_bucket_offset(f->bucket_offset() + 64);
       },
       "buckets[0].shards[1].fragments[0].bucket_offset"},
      {"FragmentOutsideShard",
       [shard](v1::Layout& l) { *shard(l, 0)->add_fragments() = l.buckets(0).shards(1).fragments(1); },
       "buckets[0].shards[0].fragments[1]"},
      {"FragmentDuplicated",
       [shard](v1::Layout& l) { *shard(l, 1)->add_fragments() = l.buckets(0).shards(1).fragments(0); },
       "buckets[0].shards[1].fragments[2]"},
      {"FragmentMissing", [shard](v1::Layout& l) { shard(l, 1)->mutable_fragments()->RemoveLast(); }, "tensors[1]"},
  };
}

class LayoutProtoCorruptionTest : public ::testing::TestWithParam<Corruption> {};

TEST_P(LayoutProtoCorruptionTest, IsInvalidArgumentNamingTheField) {
  v1::Layout proto = ValidProto();
  ASSERT_THAT(LayoutFromProto(proto), IsOk());
  // The fixture must look as the comment on ValidProto says.
  ASSERT_EQ(proto.buckets_size(), 1);
  ASSERT_EQ(proto.buckets(0).shards(1).fragments_size(), 2);
  GetParam().corrupt(proto);
  EXPECT_THAT(LayoutFromProto(proto),
              StatusIs(absl::StatusCode::kInvalidArgument, StartsWith(GetParam().field + ":")));
}

INSTANTIATE_TEST_SUITE_P(Fields, LayoutProtoCorruptionTest, ::testing::ValuesIn(Corruptions()),
                         [](const auto& info) { return info.param.name; });

TEST(LayoutProtoTest, WholeTensorLayoutRejectsASplitTensor) {
  v1::Layout proto = ValidProto(LayoutPolicy::kWholeTensor);
  ASSERT_THAT(LayoutFromProto(proto), IsOk());
  // The same shards as a flat layout would cut them: some tensor is now split.
  v1::Layout flat = ValidProto(LayoutPolicy::kFlat);
  flat.set_policy(v1::LAYOUT_POLICY_WHOLE_TENSOR);
  EXPECT_THAT(LayoutFromProto(flat), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("whole")));
}

TEST(LayoutProtoTest, EmptyProtoIsInvalidArgument) {
  EXPECT_THAT(LayoutFromProto(v1::Layout()), StatusIs(absl::StatusCode::kInvalidArgument, StartsWith("policy:")));
}

// Random single-field corruptions of every integer and enum field: the answer is always OK
// or INVALID_ARGUMENT, never a crash or another code.
TEST(LayoutProtoTest, RandomIntegerCorruptionsNeverCrash) {
  using google::protobuf::FieldDescriptor;
  using google::protobuf::Message;
  const v1::Layout base = ValidProto();
  // Collect every integer-valued (message, field, index) by walking the message tree.
  std::vector<std::function<void(Message&, int64_t)>> setters;
  std::function<void(const Message&, std::function<Message&(Message&)>)> walk =
      [&](const Message& m, std::function<Message&(Message&)> locate) {
        const auto* refl = m.GetReflection();
        std::vector<const FieldDescriptor*> fields;
        refl->ListFields(m, &fields);
        for (const FieldDescriptor* f : fields) {
          const int n = f->is_repeated() ? refl->FieldSize(m, f) : 1;
          for (int i = 0; i < n; ++i) {
            if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
              const Message& child = f->is_repeated() ? refl->GetRepeatedMessage(m, f, i) : refl->GetMessage(m, f);
              walk(child, [locate, f, i](Message& root) -> Message& {
                Message& parent = locate(root);
                const auto* r = parent.GetReflection();
                return f->is_repeated() ? *r->MutableRepeatedMessage(&parent, f, i) : *r->MutableMessage(&parent, f);
              });
              continue;
            }
            setters.push_back([locate, f, i](Message& root, int64_t v) {
              Message& msg = locate(root);
              const auto* r = msg.GetReflection();
              switch (f->cpp_type()) {
                case FieldDescriptor::CPPTYPE_INT32:
                  f->is_repeated() ? r->SetRepeatedInt32(&msg, f, i, static_cast<int32_t>(v))
                                   : r->SetInt32(&msg, f, static_cast<int32_t>(v));
                  break;
                case FieldDescriptor::CPPTYPE_INT64:
                  f->is_repeated() ? r->SetRepeatedInt64(&msg, f, i, v) : r->SetInt64(&msg, f, v);
                  break;
                case FieldDescriptor::CPPTYPE_ENUM:
                  r->SetEnumValue(&msg, f, static_cast<int>(v));
                  break;
                default:
                  break;
              }
            });
          }
        }
      };
  walk(base, [](Message& root) -> Message& { return root; });
  ASSERT_GT(setters.size(), 30u);

  const std::vector<int64_t> values = {0,    -1,   1,    2,     3,     63,        64,          1000,
                                       2048, 4096, 8192, 65536, 65537, INT32_MAX, INT64_MAX, INT64_MIN};
  std::mt19937 rng(1234);
  for (int iter = 0; iter < 3000; ++iter) {
    v1::Layout proto = base;
    const int edits = 1 + static_cast<int>(rng() % 2);
    for (int e = 0; e < edits; ++e) {
      setters[rng() % setters.size()](proto, values[rng() % values.size()]);
    }
    const absl::StatusOr<Layout> layout = LayoutFromProto(proto);
    if (layout.ok()) continue;
    ASSERT_EQ(layout.status().code(), absl::StatusCode::kInvalidArgument) << layout.status();
  }
}

}  // namespace
}  // namespace mainstay
