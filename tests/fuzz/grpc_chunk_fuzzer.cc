// libFuzzer target: common/grpc_chunk's DecodeChunk on any message a peer could send, which the
// daemon runs on every PushGrad message and the client on every PullParams message
// (docs/transports.md, "Chunks and pipelining"). The first input byte picks the chunk field
// (2 or 3) and where the message is cut into gRPC slices; the rest is the message.
//
// Invariants (a violation aborts, so libFuzzer reports it with the input):
//  - no crash, leak or UB (built with -fsanitize=fuzzer,address,undefined by scripts/fuzz.sh);
//  - sound: a message DecodeChunk accepts, protobuf parses, with that chunk set, to the same
//    offset and data, and the encoders write protobuf's bytes for that chunk;
//  - complete: whenever protobuf parses the message with that chunk set, the bytes protobuf
//    writes for the chunk alone are accepted (so a plain protobuf peer always takes the fast
//    path).
#include <cstdint>
#include <string>
#include <vector>

#include <grpcpp/support/byte_buffer.h>

#include "common/grpc_chunk.h"
#include "mainstay/v1/shard.pb.h"
#include "tests/fuzz/fuzz_check.h"

namespace mainstay {
namespace {

using fuzz::Check;

grpc::ByteBuffer Sliced(const std::string& bytes, uint8_t pattern) {
  std::vector<grpc::Slice> slices;
  size_t at = 0;
  for (int i = 0; at < bytes.size(); ++i) {
    const size_t n = std::min<size_t>(bytes.size() - at, 1 + ((pattern >> (i % 4 * 2)) & 3) * (1 + i % 5));
    slices.emplace_back(bytes.data() + at, n);
    at += n;
  }
  if (slices.empty()) slices.emplace_back();
  return grpc::ByteBuffer(slices.data(), slices.size());
}

std::string Joined(const ChunkView& view) {
  std::string out;
  for (const auto piece : view.pieces) out.append(reinterpret_cast<const char*>(piece.data()), piece.size());
  return out;
}

std::string Flatten(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  Check(buffer.Dump(&slices).ok(), "Dump of an encoded chunk");
  std::string out;
  for (const grpc::Slice& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

// The message as protobuf reads it: whether it parses with the chunk in `field` set, the
// chunk's offset and data, and the bytes protobuf writes for a message of that chunk alone.
struct ProtoView {
  bool parsed = false;
  int64_t offset = 0;
  std::string data;
  std::string canonical;
};

ProtoView ParseWithProtobuf(const std::string& bytes, int field) {
  ProtoView out;
  if (field == v1::PushGradRequest::kChunkFieldNumber) {
    v1::PushGradRequest m;
    if (!m.ParseFromString(bytes) || !m.has_chunk()) return out;
    v1::PushGradRequest alone;
    alone.mutable_chunk()->set_element_offset(m.chunk().element_offset());
    alone.mutable_chunk()->set_data(m.chunk().data());
    out = {true, m.chunk().element_offset(), m.chunk().data(), alone.SerializeAsString()};
  } else {
    v1::PullParamsResponse m;
    if (!m.ParseFromString(bytes) || !m.has_scales() || !m.scales().patch().empty()) return out;
    v1::PullParamsResponse alone;
    alone.mutable_scales()->set_scale_offset(m.scales().scale_offset());
    alone.mutable_scales()->set_data(m.scales().data());
    out = {true, m.scales().scale_offset(), m.scales().data(), alone.SerializeAsString()};
  }
  return out;
}

}  // namespace
}  // namespace mainstay

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace mainstay;
  if (size == 0) return 0;
  const int field = (data[0] & 1) != 0 ? static_cast<int>(v1::PullParamsResponse::kScalesFieldNumber)
                                       : static_cast<int>(v1::PushGradRequest::kChunkFieldNumber);
  const std::string message(reinterpret_cast<const char*>(data + 1), size - 1);
  ChunkView view;
  const bool decoded = DecodeChunk(Sliced(message, data[0]), field, &view);
  const ProtoView proto = ParseWithProtobuf(message, field);
  if (decoded) {
    Check(proto.parsed, "DecodeChunk accepted a message protobuf does not read as that chunk");
    Check(view.offset == proto.offset, "DecodeChunk's offset is not protobuf's");
    const std::string joined = Joined(view);
    Check(joined == proto.data, "DecodeChunk's data is not protobuf's");
    Check(view.bytes == static_cast<int64_t>(joined.size()), "ChunkView.bytes is not the pieces' size");
    const std::span<const uint8_t> bytes(reinterpret_cast<const uint8_t*>(joined.data()), joined.size());
    Check(Flatten(EncodeChunkCopy(field, view.offset, bytes)) == proto.canonical,
          "EncodeChunkCopy does not write protobuf's bytes");
    Check(Flatten(EncodeChunkShared(field, view.offset, bytes, nullptr)) == proto.canonical,
          "EncodeChunkShared does not write protobuf's bytes");
  }
  if (proto.parsed) {
    ChunkView again;
    Check(DecodeChunk(Sliced(proto.canonical, data[0]), field, &again), "protobuf's own encoding was refused");
    Check(again.offset == proto.offset && Joined(again) == proto.data, "protobuf's own encoding decoded wrongly");
  }
  return 0;
}
