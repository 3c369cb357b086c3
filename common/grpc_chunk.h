// The bulk messages of the gRPC data plane, encoded and decoded without protobuf copying their
// payload. Each is a protobuf message with one field `field` (wire type 2) holding a chunk:
//
//   Outer { Chunk <field>; }   Chunk { int64 offset = 1; bytes data = 2; }
//
// which is GradChunk in PushGradRequest (field 2), ParamChunk in PullParamsResponse (field 2) and
// ScaleChunk in PullParamsResponse (field 3) (shard.proto). The encoders write exactly the bytes
// protobuf's serializer writes for such a message; the decoder reads only that canonical form and
// says "not mine" for anything else (other fields, repeated or reordered fields, trailing bytes,
// varints longer than their shortest form), which the caller then parses with protobuf as
// before. So either side may be a plain protobuf peer (another language's client, the tests'
// fake daemon).
//
// Why: protobuf copies a `bytes` field into a std::string when it sets or parses one, and gRPC
// copies the serialized message once more. For 1 MiB gradient and parameter chunks those copies
// were a third of the trainers' and daemons' CPU in a step (docs/benchmarks.md).
//
// Thread safety: no shared state. A ChunkView holds references to the buffer's slices: its
// pieces stay valid while the view lives, whatever becomes of the ByteBuffer.
#ifndef MAINSTAY_COMMON_GRPC_CHUNK_H_
#define MAINSTAY_COMMON_GRPC_CHUNK_H_

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

namespace mainstay {

// `field` is 1..15 (the framing's tag is one byte); another aborts.

// The message with `data` copied once, into one gRPC slice with the framing. With `crc32c` not
// null, the CRC-32C there is extended over `data` in the same pass (Crc32cCopyExtend).
grpc::ByteBuffer EncodeChunkCopy(int field, int64_t offset, std::span<const uint8_t> data, uint32_t* crc32c = nullptr);
// The message with `data` referenced in place, not copied: `owner` (which must keep `data`
// alive and unchanged) is released when gRPC drops its last reference to the bytes, which may be
// after the write that sent them completed. A null owner is for data that outlives every copy
// of the message (tests).
grpc::ByteBuffer EncodeChunkShared(int field, int64_t offset, std::span<const uint8_t> data,
                                   std::shared_ptr<const void> owner);

// Move-only: a piece may point into a Slice of `slices` itself (gRPC keeps slices of up to 23
// bytes inline), which a move keeps in place and a copy would not.
struct ChunkView {
  ChunkView() = default;
  ChunkView(ChunkView&&) = default;
  ChunkView& operator=(ChunkView&&) = default;
  ChunkView(const ChunkView&) = delete;
  ChunkView& operator=(const ChunkView&) = delete;

  // Drops the references to the buffer's memory (and the pieces pointing into it) now.
  void Release() {
    pieces.clear();
    slices.clear();
    offset = bytes = 0;
  }

  int64_t offset = 0;
  int64_t bytes = 0;                             // the sum of the pieces' sizes
  std::vector<std::span<const uint8_t>> pieces;  // the data, in order, inside `slices`
  std::vector<grpc::Slice> slices;               // the buffer's slices (references, not copies)
};

// True and *out filled when `buffer` is the canonical encoding of a chunk in `field`; false,
// with *out released, when it is anything else (then parse it with protobuf: it may be another
// message of the stream, or a chunk a protobuf peer encoded differently, or garbage).
bool DecodeChunk(const grpc::ByteBuffer& buffer, int field, ChunkView* out);

}  // namespace mainstay

#endif  // MAINSTAY_COMMON_GRPC_CHUNK_H_
