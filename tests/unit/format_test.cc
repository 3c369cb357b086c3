// The format descriptors say exactly what FORMATS.md says.
#include "common/format.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/testing/status_matchers.h"

namespace mainstay {
namespace {

using ::mainstay::testing::IsOk;
using ::mainstay::testing::StatusIs;
using ::testing::HasSubstr;

TEST(FormatTest, DescriptorsMatchFormatsMd) {
  const FormatDescriptor& bf16 = Describe(Format::kBF16);
  EXPECT_EQ(bf16.bits_per_element, 16);
  EXPECT_FALSE(bf16.has_block_scales());
  EXPECT_FALSE(bf16.tensor_scale);
  EXPECT_EQ(bf16.amax_scope, AmaxScope::kNone);

  for (Format f : {Format::kFP8E4M3Delayed, Format::kFP8E5M2Delayed}) {
    EXPECT_EQ(Describe(f).bits_per_element, 8);
    EXPECT_EQ(Describe(f).scaling, ScalingMode::kDelayed);
    EXPECT_EQ(Describe(f).amax_scope, AmaxScope::kTensorHistory);
    EXPECT_TRUE(Describe(f).tensor_scale);
  }
  EXPECT_EQ(Describe(Format::kFP8E4M3Current).element, ElementType::kE4M3);
  EXPECT_EQ(Describe(Format::kFP8E5M2Current).element, ElementType::kE5M2);
  EXPECT_EQ(Describe(Format::kFP8E4M3Current).amax_scope, AmaxScope::kTensor);

  const FormatDescriptor& mx = Describe(Format::kMXFP8);
  EXPECT_EQ(mx.element, ElementType::kE4M3);
  EXPECT_EQ(mx.block_rows, 1);
  EXPECT_EQ(mx.block_cols, 32);
  EXPECT_EQ(mx.block_scale, ElementType::kE8M0);
  EXPECT_EQ(mx.shape_multiple, 32);

  const FormatDescriptor& blk = Describe(Format::kFP8Block);
  EXPECT_EQ(blk.block_rows, 128);
  EXPECT_EQ(blk.block_cols, 128);
  EXPECT_EQ(blk.block_scale, ElementType::kFloat32);
  EXPECT_EQ(blk.shape_multiple, 1) << "partial tiles are allowed";

  const FormatDescriptor& fp4 = Describe(Format::kNVFP4);
  EXPECT_EQ(fp4.element, ElementType::kE2M1);
  EXPECT_EQ(fp4.bits_per_element, 4);
  EXPECT_EQ(fp4.block_rows, 16);
  EXPECT_EQ(fp4.block_cols, 16);
  EXPECT_EQ(fp4.block_scale, ElementType::kE4M3);
  EXPECT_TRUE(fp4.tensor_scale) << "FP32 global scale";
  EXPECT_EQ(fp4.amax_scope, AmaxScope::kBlockAndTensor);
  EXPECT_TRUE(fp4.requires_2d);
}

TEST(FormatTest, NamesRoundTripAndUnknownListsKnown) {
  for (const FormatDescriptor& d : AllFormats()) {
    ASSERT_THAT(ParseFormat(d.name), IsOk());
    EXPECT_EQ(*ParseFormat(d.name), d.format);
    EXPECT_EQ(FormatName(d.format), d.name);
  }
  EXPECT_THAT(ParseFormat("fp6"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("known formats: bf16, fp16")));
}

TEST(FormatTest, DataBytesDeriveFromElements) {
  EXPECT_EQ(DataBytes(Format::kBF16, 64), 128);
  EXPECT_EQ(DataBytes(Format::kFP8E4M3Current, 64), 64);
  EXPECT_EQ(DataBytes(Format::kNVFP4, 64), 32);
  EXPECT_EQ(DataBytes(Format::kNVFP4, int64_t{1} << 40), int64_t{1} << 39);
}

TEST(FormatTest, ShapeSupport) {
  const std::vector<int64_t> ok2d = {64, 96};
  const std::vector<int64_t> odd = {50, 64};
  const std::vector<int64_t> vec = {4096};
  EXPECT_THAT(CheckShapeSupported(Format::kMXFP8, ok2d), IsOk());
  EXPECT_THAT(CheckShapeSupported(Format::kMXFP8, odd),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("multiples of 32")));
  EXPECT_THAT(CheckShapeSupported(Format::kNVFP4, vec),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("2-D")));
  EXPECT_THAT(CheckShapeSupported(Format::kFP8Block, odd), IsOk());
  EXPECT_THAT(CheckShapeSupported(Format::kFP8E4M3Current, vec), IsOk());
  const std::vector<int64_t> three_d = {4, 8, 32};  // 32 x 32 view
  EXPECT_THAT(CheckShapeSupported(Format::kMXFP8, three_d), IsOk());
}

TEST(FormatTest, ScaleGridIsCompactRowMajor) {
  EXPECT_EQ(ScaleGrid(Format::kMXFP8, {64, 96}).rows, 64);
  EXPECT_EQ(ScaleGrid(Format::kMXFP8, {64, 96}).cols, 3);
  EXPECT_EQ(ScaleGrid(Format::kFP8Block, {300, 129}).rows, 3);
  EXPECT_EQ(ScaleGrid(Format::kFP8Block, {300, 129}).cols, 2);
  EXPECT_EQ(ScaleGrid(Format::kNVFP4, {48, 32}).numel(), 6);
  EXPECT_EQ(ScaleGrid(Format::kBF16, {48, 32}).numel(), 0);
}

TEST(FormatTest, ScaleBlockRangeOfFragments) {
  // 16x16 tiles on a 64 x 64 tensor: 4 x 4 tiles.
  const Matrix2D v{64, 64};
  // Half of row 0: tiles 0..1 of tile row 0.
  EXPECT_EQ(ScaleBlockRange(Format::kNVFP4, v, {0, 32}), (IndexRange{0, 2}));
  // Row 0 col 32 to row 1 col 15: row 0 touches tiles 2,3 and row 1 tile 0 -> range [0, 4).
  EXPECT_EQ(ScaleBlockRange(Format::kNVFP4, v, {32, 80}), (IndexRange{0, 4}));
  // Rows 15..16 exactly: row 15 -> tile row 0, row 16 -> tile row 1.
  EXPECT_EQ(ScaleBlockRange(Format::kNVFP4, v, {15 * 64, 17 * 64}), (IndexRange{0, 8}));
  // Row 16, columns 48..63 only: tile (1, 3).
  EXPECT_EQ(ScaleBlockRange(Format::kNVFP4, v, {16 * 64 + 48, 17 * 64}), (IndexRange{7, 8}));
  // mxfp8 1x32 blocks: exact.
  EXPECT_EQ(ScaleBlockRange(Format::kMXFP8, v, {64, 192}), (IndexRange{2, 6}));
  EXPECT_TRUE(ScaleBlockRange(Format::kFP8E4M3Current, v, {0, 64}).empty());
  EXPECT_TRUE(ScaleBlockRange(Format::kNVFP4, v, {64, 64}).empty());
}

}  // namespace
}  // namespace mainstay
