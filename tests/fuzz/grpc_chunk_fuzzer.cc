// libFuzzer target: common/grpc_chunk's DecodeChunk on any message a peer could send, which the
// daemon runs on every PushGrad message and the client on every PullParams message
// (docs/transports.md, "Chunks and pipelining"). The first input byte picks the message
// (its value mod 3: PushGradRequest.chunk, PullParamsResponse.data, PullParamsResponse.scales)
// and where the message is cut into gRPC slices (the rest of its bits); the rest of the input is
// the message.
//
// Invariants (a violation aborts, so libFuzzer reports it with the input):
//  - no crash, leak or UB (built with -fsanitize=fuzzer,address,undefined by scripts/fuzz.sh);
//  - sound: a message DecodeChunk accepts, protobuf parses, with that chunk set, to the same
//    offset and data, and the encoders write protobuf's bytes for that chunk;
//  - complete: whenever protobuf parses the message with that chunk set, the bytes protobuf
//    writes for the chunk alone are accepted (so a plain protobuf peer always takes the fast
//    path).
#include <google/protobuf/stubs/logging.h>
#include <grpcpp/support/byte_buffer.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

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

enum class Kind { kGradChunk, kParamChunk, kScaleChunk };

int FieldOf(Kind kind) {
  switch (kind) {
    case Kind::kGradChunk:
      return v1::PushGradRequest::kChunkFieldNumber;
    case Kind::kParamChunk:
      return v1::PullParamsResponse::kDataFieldNumber;
    default:
      return v1::PullParamsResponse::kScalesFieldNumber;
  }
}

ProtoView ParseWithProtobuf(const std::string& bytes, Kind kind) {
  ProtoView out;
  if (kind == Kind::kGradChunk) {
    v1::PushGradRequest m;
    if (!m.ParseFromString(bytes) || !m.has_chunk()) return out;
    v1::PushGradRequest alone;
    alone.mutable_chunk()->set_element_offset(m.chunk().element_offset());
    alone.mutable_chunk()->set_data(m.chunk().data());
    return {true, m.chunk().element_offset(), m.chunk().data(), alone.SerializeAsString()};
  }
  v1::PullParamsResponse m;
  if (!m.ParseFromString(bytes)) return out;
  v1::PullParamsResponse alone;
  if (kind == Kind::kParamChunk) {
    if (!m.has_data() || !m.data().patch().empty()) return out;
    alone.mutable_data()->set_element_offset(m.data().element_offset());
    alone.mutable_data()->set_data(m.data().data());
    return {true, m.data().element_offset(), m.data().data(), alone.SerializeAsString()};
  }
  if (!m.has_scales() || !m.scales().patch().empty()) return out;
  alone.mutable_scales()->set_scale_offset(m.scales().scale_offset());
  alone.mutable_scales()->set_data(m.scales().data());
  return {true, m.scales().scale_offset(), m.scales().data(), alone.SerializeAsString()};
}

}  // namespace
}  // namespace mainstay

// protobuf logs every string field that is not UTF-8; the fuzzer feeds it plenty.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler([](google::protobuf::LogLevel, const char*, int, const std::string&) {});
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace mainstay;
  if (size == 0) return 0;
  const auto kind = static_cast<Kind>(data[0] % 3);
  const int field = FieldOf(kind);
  const auto pattern = static_cast<uint8_t>(data[0] / 3);
  const std::string message(reinterpret_cast<const char*>(data + 1), size - 1);
  ChunkView view;
  const bool decoded = DecodeChunk(Sliced(message, pattern), field, &view);
  const ProtoView proto = ParseWithProtobuf(message, kind);
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
    Check(DecodeChunk(Sliced(proto.canonical, pattern), field, &again), "protobuf's own encoding was refused");
    Check(again.offset == proto.offset && Joined(again) == proto.data, "protobuf's own encoding decoded wrongly");
  }
  return 0;
}
