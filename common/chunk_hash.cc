#include "common/chunk_hash.h"

#include <algorithm>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace mainstay {

uint64_t ChunkHash64(const void* data, size_t size) { return XXH3_64bits(data, size); }

std::vector<uint64_t> ChunkHashes(std::span<const uint8_t> data, int64_t chunk_bytes) {
  const auto size = static_cast<int64_t>(data.size());
  std::vector<uint64_t> out(static_cast<size_t>(ChunkCount(size, chunk_bytes)));
  for (size_t i = 0; i < out.size(); ++i) {
    const int64_t begin = static_cast<int64_t>(i) * chunk_bytes;
    out[i] = ChunkHash64(data.data() + begin, static_cast<size_t>(std::min(chunk_bytes, size - begin)));
  }
  return out;
}

}  // namespace mainstay
