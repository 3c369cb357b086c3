// Hashes of fixed-size chunks of a byte buffer, for delta pulls (PullParamsRequest.
// delta_chunk_bytes): the reader hashes the copy it holds, the daemon the version it serves, and
// only the chunks whose hashes differ are sent. XXH3-64 (libxxhash, seed 0): a changed chunk
// goes unnoticed with probability 2^-64, and the reader also checks the CRC-32C of the whole
// result (docs/weight_serving.md). Thread-safe (no state).
#ifndef MAINSTAY_COMMON_CHUNK_HASH_H_
#define MAINSTAY_COMMON_CHUNK_HASH_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace mainstay {

uint64_t ChunkHash64(const void* data, size_t size);
// One hash per chunk of `chunk_bytes` bytes (the last chunk shorter); chunk_bytes > 0.
std::vector<uint64_t> ChunkHashes(std::span<const uint8_t> data, int64_t chunk_bytes);
// Chunks of `chunk_bytes` in `size` bytes.
inline int64_t ChunkCount(int64_t size, int64_t chunk_bytes) { return (size + chunk_bytes - 1) / chunk_bytes; }

}  // namespace mainstay

#endif  // MAINSTAY_COMMON_CHUNK_HASH_H_
