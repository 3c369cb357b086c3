// common/crc32c: the three-chain SSE4.2 path against the byte-at-a-time table, at every length
// around the 12 KiB round it works in, at odd alignments, and as a chain of Extend calls cut
// anywhere (how the transports compute a payload's CRC chunk by chunk); the copying variant the same way.
#include "common/crc32c.h"

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace mainstay {
namespace {

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> out(n);
  for (uint8_t& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

TEST(Crc32cTest, KnownValues) {
  EXPECT_EQ(Crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(Crc32cExtendPortable(0, "123456789", 9), 0xE3069283u);
  EXPECT_EQ(Crc32c(nullptr, 0), 0u);
  const std::vector<uint8_t> zeros(32, 0);
  EXPECT_EQ(Crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);  // RFC 3720, B.4
}

TEST(Crc32cTest, EveryLengthAroundTheThreeBlockRoundMatchesTheTable) {
  const std::vector<uint8_t> data = RandomBytes(4 * 12288 + 64, 1);
  std::vector<size_t> lengths;
  for (size_t n = 0; n < 64; ++n) lengths.push_back(n);
  for (size_t round : {size_t{12288}, size_t{2 * 12288}, size_t{3 * 12288}}) {
    for (size_t n = round - 24; n <= round + 24; ++n) lengths.push_back(n);
  }
  for (size_t n : lengths) {
    for (size_t offset : {0, 1, 3, 7}) {
      ASSERT_EQ(Crc32c(data.data() + offset, n), Crc32cExtendPortable(0, data.data() + offset, n))
          << "length " << n << " offset " << offset;
    }
  }
}

TEST(Crc32cTest, LargeRandomInputsMatchTheTable) {
  std::mt19937 rng(7);
  const std::vector<uint8_t> data = RandomBytes(3 << 20, 2);
  for (int i = 0; i < 20; ++i) {
    const size_t offset = rng() % 4096;
    const size_t n = rng() % (data.size() - offset);
    ASSERT_EQ(Crc32c(data.data() + offset, n), Crc32cExtendPortable(0, data.data() + offset, n))
        << "length " << n << " offset " << offset;
  }
}

TEST(Crc32cTest, ExtendingInPiecesEqualsOnePass) {
  std::mt19937 rng(11);
  const std::vector<uint8_t> data = RandomBytes(1 << 20, 3);
  const uint32_t whole = Crc32c(data.data(), data.size());
  for (int trial = 0; trial < 10; ++trial) {
    uint32_t crc = 0;
    size_t at = 0;
    while (at < data.size()) {
      const size_t n = std::min<size_t>(data.size() - at, rng() % 50000);
      crc = Crc32cExtend(crc, data.data() + at, n);
      at += n;
    }
    ASSERT_EQ(crc, whole) << "trial " << trial;
  }
}

// The copying variant: the CRC of the source, and the destination equal to the source byte for
// byte, with nothing written around it, at every length around the round and at odd alignments
// of both ends; and chained in pieces like a transport's chunks.
TEST(Crc32cTest, CopyExtendCopiesExactlyAndReturnsTheSameCrc) {
  const std::vector<uint8_t> data = RandomBytes(4 * 12288 + 64, 6);
  std::vector<size_t> lengths;
  for (size_t n = 0; n < 64; ++n) lengths.push_back(n);
  for (size_t round : {size_t{12288}, size_t{2 * 12288}, size_t{3 * 12288}}) {
    for (size_t n = round - 24; n <= round + 24; n += 3) lengths.push_back(n);
  }
  constexpr uint8_t kGuard = 0xA5;
  for (size_t n : lengths) {
    for (size_t src_offset : {0, 5}) {
      for (size_t dst_offset : {0, 3}) {
        std::vector<uint8_t> out(n + 16, kGuard);
        const uint8_t* src = data.data() + src_offset;
        const uint32_t crc = Crc32cCopyExtend(0x1234u, out.data() + 8 + dst_offset, src, n);
        ASSERT_EQ(crc, Crc32cExtendPortable(0x1234u, src, n)) << "length " << n;
        ASSERT_EQ(std::memcmp(out.data() + 8 + dst_offset, src, n), 0) << "length " << n;
        for (size_t i = 0; i < 8 + dst_offset; ++i) ASSERT_EQ(out[i], kGuard) << "length " << n;
        for (size_t i = 8 + dst_offset + n; i < out.size(); ++i) ASSERT_EQ(out[i], kGuard) << "length " << n;
      }
    }
  }
  std::mt19937 rng(12);
  const std::vector<uint8_t> big = RandomBytes(1 << 20, 7);
  std::vector<uint8_t> copy(big.size());
  uint32_t crc = 0;
  for (size_t at = 0; at < big.size();) {
    const size_t n = std::min<size_t>(big.size() - at, rng() % 50000);
    crc = Crc32cCopyExtend(crc, copy.data() + at, big.data() + at, n);
    at += n;
  }
  EXPECT_EQ(crc, Crc32c(big.data(), big.size()));
  EXPECT_EQ(copy, big);
}

TEST(Crc32cTest, DetectsASingleFlippedBitAnywhere) {
  std::vector<uint8_t> data = RandomBytes(64 << 10, 4);
  const uint32_t good = Crc32c(data.data(), data.size());
  std::mt19937 rng(5);
  for (int i = 0; i < 200; ++i) {
    const size_t at = rng() % data.size();
    const uint8_t bit = static_cast<uint8_t>(1u << (rng() % 8));
    data[at] ^= bit;
    ASSERT_NE(Crc32c(data.data(), data.size()), good) << "byte " << at;
    data[at] ^= bit;
  }
}

}  // namespace
}  // namespace mainstay
