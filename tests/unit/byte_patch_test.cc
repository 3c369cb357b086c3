// common/byte_patch: patches round-trip at every density and length (including changes in the
// first and last byte and runs of adjacent changes), the size limit sends a dense chunk whole,
// and every malformed patch is refused with the record it breaks at.
#include "common/byte_patch.h"

#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace mainstay {
namespace {

using ::testing::HasSubstr;

// A scalar size of the encoding, written from its definition: per changed byte, the LEB128 varint
// of the unchanged bytes before it (since the previous change) plus the byte.
size_t ExpectedSize(const std::vector<uint8_t>& from, const std::vector<uint8_t>& to) {
  size_t size = 0, gap = 0;
  for (size_t i = 0; i < to.size(); ++i) {
    if (from[i] == to[i]) {
      ++gap;
      continue;
    }
    size_t varint = 1;
    for (size_t v = gap; v >= 128; v >>= 7) ++varint;
    size += varint + 1;
    gap = 0;
  }
  return size;
}

TEST(BytePatchTest, RoundTripsAtEveryDensityAndLength) {
  std::mt19937 rng(7);
  for (const size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{9}, size_t{100}, size_t{4096},
                         size_t{65536}, size_t{65539}}) {
    for (const double density : {0.0, 0.001, 0.01, 0.1, 0.5, 1.0}) {
      std::vector<uint8_t> from(n), to(n);
      for (size_t i = 0; i < n; ++i) {
        from[i] = static_cast<uint8_t>(rng());
        const bool change = std::uniform_real_distribution<double>(0, 1)(rng) < density;
        to[i] = change ? static_cast<uint8_t>(from[i] + 1 + rng() % 255) : from[i];
      }
      if (n > 0 && density > 0) to[0] = static_cast<uint8_t>(from[0] ^ 0x80), to[n - 1] = static_cast<uint8_t>(from[n - 1] ^ 1);
      std::optional<std::string> patch = EncodeBytePatch(from, to, SIZE_MAX);
      ASSERT_TRUE(patch.has_value());
      EXPECT_EQ(patch->size(), ExpectedSize(from, to)) << n << " bytes, density " << density;
      std::vector<uint8_t> data = from;
      ASSERT_TRUE(ApplyBytePatch(data, *patch).ok()) << n << " bytes, density " << density;
      EXPECT_EQ(data, to) << n << " bytes, density " << density;
    }
  }
}

TEST(BytePatchTest, AGapOfManyVarintBytesRoundTrips) {
  std::vector<uint8_t> from(1 << 21, 3), to = from;
  to.back() = 4;  // one change after a 2 MiB - 1 gap: a 3-byte varint
  std::optional<std::string> patch = EncodeBytePatch(from, to, SIZE_MAX);
  ASSERT_TRUE(patch.has_value());
  EXPECT_EQ(patch->size(), 4u);
  ASSERT_TRUE(ApplyBytePatch(from, *patch).ok());
  EXPECT_EQ(from, to);
}

TEST(BytePatchTest, APatchAtTheLimitOrUnequalSizesIsNone) {
  std::vector<uint8_t> from(64, 0), to(64, 1);  // every byte changed: 2 bytes each
  EXPECT_FALSE(EncodeBytePatch(from, to, 128).has_value());
  EXPECT_TRUE(EncodeBytePatch(from, to, 129).has_value());
  EXPECT_FALSE(EncodeBytePatch(from, std::vector<uint8_t>(63, 1), SIZE_MAX).has_value());
  const std::optional<std::string> none = EncodeBytePatch(from, from, 1);
  ASSERT_TRUE(none.has_value());
  EXPECT_TRUE(none->empty());
}

TEST(BytePatchTest, MalformedPatchesAreRefusedNamingTheRecord) {
  std::vector<uint8_t> data(16, 0);
  EXPECT_THAT(ApplyBytePatch(data, std::string("\x01\x05\x80", 3)).message(), HasSubstr("record 1: its gap is cut off"));
  EXPECT_THAT(ApplyBytePatch(data, std::string("\x01", 1)).message(), HasSubstr("record 0: no byte after its gap"));
  EXPECT_THAT(ApplyBytePatch(data, std::string("\x10\x05", 2)).message(), HasSubstr("record 0: position past"));
  // Fifteen unchanged bytes, one changed, then a record with a gap of 0: past the end.
  EXPECT_THAT(ApplyBytePatch(data, std::string("\x0f\x05\x00\x05", 4)).message(), HasSubstr("record 1: position past"));
  EXPECT_THAT(ApplyBytePatch(data, std::string(11, '\xff') + "\x01\x05").message(), HasSubstr("over 10 bytes"));
  // A gap whose varint overflows 64 bits is still refused as past the end, not wrapped around.
  EXPECT_THAT(ApplyBytePatch(data, std::string(9, '\xff') + "\x7f\x05").message(), HasSubstr("position past"));
  EXPECT_EQ(ApplyBytePatch(data, std::string("\x10\x05", 2)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(ApplyBytePatch(data, "").ok());
}

}  // namespace
}  // namespace mainstay
