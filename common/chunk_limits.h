// The data plane's chunk sizes, as shard.proto states them: every payload (a push's gradient, a
// pull's data and scales, a forwarded step input, a shard's state in a move) travels in chunks
// of at most kMaxChunkBytes bytes. One definition for the client, the daemon and the tests.
#ifndef MAINSTAY_COMMON_CHUNK_LIMITS_H_
#define MAINSTAY_COMMON_CHUNK_LIMITS_H_

#include <cstdint>

namespace mainstay {

inline constexpr int64_t kMaxChunkBytes = int64_t{4} << 20;  // the protocol's limit on one chunk's payload
inline constexpr int64_t kMinChunkBytes = 1024;              // the smallest ClientOptions::chunk_bytes

}  // namespace mainstay

#endif  // MAINSTAY_COMMON_CHUNK_LIMITS_H_
