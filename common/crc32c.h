// CRC-32C (Castagnoli), as PushGradHeader.crc32c and PullParamsHeader.data_crc32c carry it:
// reflected polynomial 0x82F63B78, initial value and final xor 0xFFFFFFFF (CRC32C("123456789")
// = 0xE3069283). Uses the SSE4.2 crc32 instruction when the CPU has it, three independent chains
// at a time on inputs of 12 KiB and more (1.8x one chain, memcpy speed, on the CI VM; bench/crc32c_bench). Thread-safe.
#ifndef MAINSTAY_COMMON_CRC32C_H_
#define MAINSTAY_COMMON_CRC32C_H_

#include <cstddef>
#include <cstdint>

namespace mainstay {

// Extends `crc` (the value returned for the preceding bytes; 0 to start) over `size` bytes.
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size);
inline uint32_t Crc32c(const void* data, size_t size) { return Crc32cExtend(0, data, size); }
// Copies `size` bytes from `src` to `dst` (which must not overlap) and returns the CRC-32C of
// the bytes written to `dst`, extended from `crc`, reading each byte once: a copy and its CRC in
// one pass over memory instead of two (bench/crc32c_bench). That equals Crc32cExtend(crc, src,
// size) unless another thread writes `src` during the copy; the CRC always describes the copy.
uint32_t Crc32cCopyExtend(uint32_t crc, void* dst, const void* src, size_t size);
// The same value from a byte-at-a-time table: the reference the fast path is tested against.
uint32_t Crc32cExtendPortable(uint32_t crc, const void* data, size_t size);

}  // namespace mainstay

#endif  // MAINSTAY_COMMON_CRC32C_H_
