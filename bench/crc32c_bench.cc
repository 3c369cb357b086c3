// CRC-32C throughput (common/crc32c) against memcpy of the same bytes and against one crc32
// chain (the previous implementation's speed), both measured in the same run; and a copy with
// its CRC (Crc32cCopyExtend, one pass) against memcpy followed by Crc32c (two passes).
//
//   ./build/bench/crc32c_bench [--mib 256] [--repeats 5]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/crc32c.h"

namespace {

double Seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"), noinline)) uint32_t OneChain(const uint8_t* p, size_t n) {
  uint64_t s = 0xFFFFFFFFu;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    s = __builtin_ia32_crc32di(s, w);
  }
  return ~static_cast<uint32_t>(s);
}
#endif

// Best of `repeats`, MB/s (MB = 2^20 bytes).
template <typename F>
double Best(int repeats, size_t bytes, F f) {
  double best = 0;
  for (int r = 0; r < repeats; ++r) {
    const double t0 = Seconds();
    f();
    best = std::max(best, bytes / 1048576.0 / (Seconds() - t0));
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  size_t mib = 256;
  int repeats = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--mib") {
      mib = std::strtoull(argv[i + 1], nullptr, 10);
    } else if (flag == "--repeats") {
      repeats = std::atoi(argv[i + 1]);
    } else {
      std::fprintf(stderr, "unknown flag %s\nusage: crc32c_bench [--mib N] [--repeats N]\n", argv[i]);
      return 2;
    }
  }
  const size_t n = mib << 20;
  std::vector<uint8_t> a(n), b(n);
  for (size_t i = 0; i < n; ++i) a[i] = static_cast<uint8_t>(i * 131 + (i >> 12));
  volatile uint32_t sink = 0;
  const double copy = Best(repeats, n, [&] { std::memcpy(b.data(), a.data(), n); });
  const double crc = Best(repeats, n, [&] { sink = mainstay::Crc32c(a.data(), n); });
  std::printf("crc32c_bench: %zu MiB, best of %d\n", mib, repeats);
  std::printf("%-22s %10s %8s\n", "", "MB/s", "ratio");
  std::printf("%-22s %10.0f %8.2f\n", "memcpy (baseline)", copy, 1.0);
  std::printf("%-22s %10.0f %8.2f\n", "Crc32c", crc, crc / copy);
  const double fused = Best(repeats, n, [&] { sink = mainstay::Crc32cCopyExtend(0, b.data(), a.data(), n); });
  const double separate = Best(repeats, n, [&] {
    std::memcpy(b.data(), a.data(), n);
    sink = mainstay::Crc32c(b.data(), n);
  });
  // Chunk by chunk, as the grpc transport copies a push (1 MiB chunks into fresh buffers).
  constexpr size_t kChunk = 1 << 20;
  std::vector<std::vector<uint8_t>> chunks(4, std::vector<uint8_t>(kChunk));
  const double chunked_fused = Best(repeats, n, [&] {
    uint32_t c = 0;
    for (size_t off = 0, i = 0; off < n; off += kChunk, ++i) {
      c = mainstay::Crc32cCopyExtend(c, chunks[i % 4].data(), a.data() + off, std::min(kChunk, n - off));
    }
    sink = c;
  });
  const double chunked_separate = Best(repeats, n, [&] {
    uint32_t c = mainstay::Crc32c(a.data(), n);
    for (size_t off = 0, i = 0; off < n; off += kChunk, ++i) {
      std::memcpy(chunks[i % 4].data(), a.data() + off, std::min(kChunk, n - off));
    }
    sink = c;
  });
  std::printf("%-22s %10.0f %8.2f\n", "memcpy, then Crc32c", separate, separate / copy);
  std::printf("%-22s %10.0f %8.2f\n", "Crc32cCopyExtend", fused, fused / copy);
  std::printf("%-22s %10.0f %8.2f\n", "1 MiB chunks: 2 passes", chunked_separate, chunked_separate / copy);
  std::printf("%-22s %10.0f %8.2f\n", "1 MiB chunks: fused", chunked_fused, chunked_fused / copy);
#if defined(__x86_64__)
  if (__builtin_cpu_supports("sse4.2")) {
    const double chain = Best(repeats, n, [&] { sink = OneChain(a.data(), n); });
    std::printf("%-22s %10.0f %8.2f\n", "one crc32 chain", chain, chain / copy);
    std::printf("Crc32c / one chain: %.2f\n", crc / chain);
  }
#endif
  (void)sink;
  return 0;
}
