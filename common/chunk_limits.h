// Chunk sizes, as shard.proto states them. A gRPC data-plane message (a push's gradient chunk, a
// pull's data and scale chunks, a forwarded step input, a shard's state in a move) holds at most
// kMaxChunkBytes of payload, and ClientOptions::chunk_bytes (every transport) is in
// [kMinChunkBytes, kMaxChunkBytes]; the ucx and nccl daemons accept chunks up to their own larger
// limits (ucx_worker.h, nccl_link.h). One definition for the client and the daemon; the tests
// keep their own copy of the protocol's number, as an independent oracle.
#ifndef MAINSTAY_COMMON_CHUNK_LIMITS_H_
#define MAINSTAY_COMMON_CHUNK_LIMITS_H_

#include <cstdint>

namespace mainstay {

inline constexpr int64_t kMaxChunkBytes = int64_t{4} << 20;  // the protocol's limit on one chunk's payload
inline constexpr int64_t kMinChunkBytes = 1024;              // the smallest ClientOptions::chunk_bytes

}  // namespace mainstay

#endif  // MAINSTAY_COMMON_CHUNK_LIMITS_H_
