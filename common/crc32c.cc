#include "common/crc32c.h"

#include <array>
#include <cassert>
#include <cstring>

namespace mainstay {
namespace {

constexpr uint32_t kPolynomial = 0x82F63B78u;

constexpr std::array<uint32_t, 256> MakeTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPolynomial : c >> 1;
    table[i] = c;
  }
  return table;
}
constexpr std::array<uint32_t, 256> kTable = MakeTable();

// The CRC register (no pre/post inversion) after `n` more bytes.
uint32_t ExtendPortable(uint32_t state, const uint8_t* p, size_t n) {
  for (size_t i = 0; i < n; ++i) state = kTable[(state ^ p[i]) & 0xFF] ^ (state >> 8);
  return state;
}

#if defined(__x86_64__)
// The crc32 instruction has a latency of 3 cycles and a throughput of one per cycle, so one
// dependent chain runs at a third of the core's speed. Large inputs are therefore cut into
// rounds of three equal blocks, one chain per block, and the three registers are joined with
// the linearity of the CRC: for blocks A, B of equal length L,
//   reg(s, A B) = Shift_L(reg(s, A)) ^ reg(0, B)
// where Shift_L multiplies by x^(8L) modulo the polynomial: reg(v, L zero bytes).
constexpr size_t kBlock = 4096;

// Shift_L as four byte-indexed tables (the operator is linear over GF(2)).
struct ShiftTable {
  std::array<std::array<uint32_t, 256>, 4> t;
  uint32_t Apply(uint32_t v) const {
    return t[0][v & 0xFF] ^ t[1][(v >> 8) & 0xFF] ^ t[2][(v >> 16) & 0xFF] ^ t[3][v >> 24];
  }
};

ShiftTable MakeShiftTable(size_t length) {
  // The images of the 32 basis vectors, each as reg(1 << bit, `length` zero bytes).
  std::array<uint32_t, 32> basis{};
  for (int bit = 0; bit < 32; ++bit) {
    uint32_t v = 1u << bit;
    for (size_t i = 0; i < length; ++i) v = kTable[v & 0xFF] ^ (v >> 8);
    basis[bit] = v;
  }
  ShiftTable table{};
  for (int byte = 0; byte < 4; ++byte) {
    for (uint32_t value = 0; value < 256; ++value) {
      uint32_t image = 0;
      for (int bit = 0; bit < 8; ++bit) {
        if (value & (1u << bit)) image ^= basis[byte * 8 + bit];
      }
      table.t[byte][value] = image;
    }
  }
  return table;
}

// One chain over `n` bytes (a multiple of 8 is consumed; the caller finishes the rest). With
// kCopy, every word read is also stored to `dst`, so a copy and its CRC take one pass.
template <bool kCopy>
__attribute__((target("sse4.2"))) uint64_t Chain(uint64_t s, uint8_t* dst, const uint8_t* p, size_t n) {
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    if constexpr (kCopy) {
      std::memcpy(dst, &word, 8);
      dst += 8;
    }
    s = __builtin_ia32_crc32di(s, word);
  }
  return s;
}

// The register after `n` more bytes at `p` (also copied to `dst` with kCopy).
template <bool kCopy>
__attribute__((target("sse4.2"))) uint32_t ExtendSse42(uint32_t state, uint8_t* dst, const uint8_t* p, size_t n) {
  uint64_t s = state;
  if (n >= 3 * kBlock) {
    static const ShiftTable shift1 = MakeShiftTable(kBlock);
    static const ShiftTable shift2 = MakeShiftTable(2 * kBlock);
    for (; n >= 3 * kBlock; n -= 3 * kBlock, p += 3 * kBlock) {
      uint64_t a = s, b = 0, c = 0;
      const uint8_t* pa = p;
      const uint8_t* pb = p + kBlock;
      const uint8_t* pc = p + 2 * kBlock;
      for (size_t i = 0; i < kBlock; i += 8) {
        uint64_t wa, wb, wc;
        std::memcpy(&wa, pa + i, 8);
        std::memcpy(&wb, pb + i, 8);
        std::memcpy(&wc, pc + i, 8);
        if constexpr (kCopy) {
          std::memcpy(dst + i, &wa, 8);
          std::memcpy(dst + kBlock + i, &wb, 8);
          std::memcpy(dst + 2 * kBlock + i, &wc, 8);
        }
        a = __builtin_ia32_crc32di(a, wa);
        b = __builtin_ia32_crc32di(b, wb);
        c = __builtin_ia32_crc32di(c, wc);
      }
      if constexpr (kCopy) dst += 3 * kBlock;
      s = shift2.Apply(static_cast<uint32_t>(a)) ^ shift1.Apply(static_cast<uint32_t>(b)) ^ static_cast<uint32_t>(c);
    }
  }
  s = Chain<kCopy>(s, dst, p, n);
  const size_t words = n & ~size_t{7};
  p += words;
  if constexpr (kCopy) dst += words;
  n &= 7;
  uint32_t s32 = static_cast<uint32_t>(s);
  for (; n > 0; --n, ++p) {
    if constexpr (kCopy) *dst++ = *p;
    s32 = __builtin_ia32_crc32qi(s32, *p);
  }
  return s32;
}

bool HaveSse42() {
  static const bool have = __builtin_cpu_supports("sse4.2");
  return have;
}
#endif

}  // namespace

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t size) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint32_t state = ~crc;
#if defined(__x86_64__)
  if (HaveSse42()) return ~ExtendSse42<false>(state, nullptr, p, size);
#endif
  return ~ExtendPortable(state, p, size);
}

uint32_t Crc32cCopyExtend(uint32_t crc, void* dst, const void* src, size_t size) {
  const uint8_t* p = static_cast<const uint8_t*>(src);
  uint8_t* d = static_cast<uint8_t*>(dst);
  assert(size == 0 || reinterpret_cast<uintptr_t>(d) + size <= reinterpret_cast<uintptr_t>(p) ||
         reinterpret_cast<uintptr_t>(p) + size <= reinterpret_cast<uintptr_t>(d));  // no overlap
#if defined(__x86_64__)
  if (HaveSse42()) return ~ExtendSse42<true>(~crc, d, p, size);
#endif
  if (size > 0) std::memcpy(d, p, size);
  return ~ExtendPortable(~crc, d, size);
}

uint32_t Crc32cExtendPortable(uint32_t crc, const void* data, size_t size) {
  return ~ExtendPortable(~crc, static_cast<const uint8_t*>(data), size);
}

}  // namespace mainstay
