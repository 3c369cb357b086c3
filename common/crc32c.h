// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), as used by PushGradHeader.crc32c and
// PullParamsHeader.data_crc32c. Table-driven; thread-safe (the table is built once).
#ifndef MAINSTAY_COMMON_CRC32C_H_
#define MAINSTAY_COMMON_CRC32C_H_

#include <array>
#include <cstddef>
#include <cstdint>

namespace mainstay {

// CRC-32C of `size` bytes, continuing from `crc` (0 to start). Crc32c("123456789") = 0xE3069283.
inline uint32_t Crc32c(const void* data, size_t size, uint32_t crc = 0) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
  for (size_t i = 0; i < size; ++i) crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

}  // namespace mainstay

#endif  // MAINSTAY_COMMON_CRC32C_H_
