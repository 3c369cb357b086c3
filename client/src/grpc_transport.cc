// The grpc transport: PushGrad and PullParams streams of the Shard service.
//
// Both run as raw (ByteBuffer) calls on a completion queue of their own, which is what gRPC's
// synchronous API does inside, so that the chunks skip protobuf (common/grpc_chunk.h): a pushed
// chunk is copied once, from the caller's memory into its message, instead of into a protobuf
// string, a second string and then the message; a pulled chunk is copied once, from gRPC's
// slices into the caller's buffer. The header, the answer and anything a daemon encodes
// differently go through protobuf as before.
#include <grpcpp/generic/generic_stub.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/src/rpc_errors.h"
#include "client/src/transport.h"
#include "common/grpc_chunk.h"

namespace mainstay::client_internal {
namespace {

static_assert(v1::GradChunk::kElementOffsetFieldNumber == 1 && v1::GradChunk::kDataFieldNumber == 2);
static_assert(v1::ParamChunk::kElementOffsetFieldNumber == 1 && v1::ParamChunk::kDataFieldNumber == 2);

std::string MethodName(const char* method) { return absl::StrCat("/", v1::Shard::service_full_name(), "/", method); }

template <typename Message>
bool Serialize(const Message& message, grpc::ByteBuffer* out) {
  bool own = false;
  out->Clear();
  return grpc::SerializationTraits<Message>::Serialize(message, out, &own).ok();
}

template <typename Message>
bool Parse(grpc::ByteBuffer* in, Message* out) {
  return grpc::SerializationTraits<Message>::Deserialize(in, out).ok();
}

// One streaming call with raw messages, each operation waited for in turn on the call's own
// completion queue. Not thread-safe (one caller). The call belongs to `context`.
class RawStream {
 public:
  RawStream(const std::shared_ptr<grpc::Channel>& channel, const char* method, grpc::ClientContext* context)
      : stub_(channel) {
    if (channel == nullptr) return;  // Finish says INTERNAL
    call_ = stub_.PrepareCall(context, MethodName(method), &cq_);
    ok_ = call_ != nullptr && Wait([&](void* tag) { call_->StartCall(tag); });
  }
  ~RawStream() {
    cq_.Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (cq_.Next(&tag, &ok)) {
    }
  }

  // False once the stream broke (then only Finish remains).
  bool ok() const { return ok_; }
  bool Write(const grpc::ByteBuffer& message) {
    return ok_ = ok_ && Wait([&](void* tag) { call_->Write(message, tag); });
  }
  bool WritesDone() {
    return ok_ = ok_ && Wait([&](void* tag) { call_->WritesDone(tag); });
  }
  bool Read(grpc::ByteBuffer* message) {
    return ok_ = ok_ && Wait([&](void* tag) { call_->Read(message, tag); });
  }
  grpc::Status Finish() {
    grpc::Status status;
    if (call_ == nullptr) return grpc::Status(grpc::StatusCode::INTERNAL, "the gRPC call could not be made");
    Wait([&](void* tag) { call_->Finish(&status, tag); });
    return status;
  }

 private:
  template <typename Start>
  bool Wait(const Start& start) {
    start(this);
    void* tag = nullptr;
    bool ok = false;
    if (!cq_.Next(&tag, &ok)) return false;  // not before Shutdown
    return ok;
  }

  grpc::GenericStub stub_;
  grpc::CompletionQueue cq_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call_;
  bool ok_ = false;
};

class GrpcTransport final : public DataTransport {
 public:
  explicit GrpcTransport(const TransportContext& context) : context_(context) {}

  v1::Transport kind() const override { return v1::TRANSPORT_GRPC; }
  absl::Status Attach(const v1::DaemonEndpoint&, Deadline) override { return absl::OkStatus(); }

  // The payload's CRC-32C is computed as each chunk is copied into its message (one pass for
  // both), and sent after the last chunk when the header asks for it.
  bool ComputesPushCrc32c() const override { return true; }

  absl::StatusOr<v1::PushGradResponse> Push(const Route& route, const v1::PushGradHeader& header, ElementSpan data,
                                            Deadline, grpc::ClientContext* context,
                                            std::optional<uint32_t>* payload_crc32c) override {
    const int64_t chunk_elements = std::max<int64_t>(1, context_.chunk_bytes / data.element_bytes());
    RawStream stream(route.channel, "PushGrad", context);
    v1::PushGradRequest first;
    *first.mutable_header() = header;
    grpc::ByteBuffer message;
    if (!Serialize(first, &message)) return absl::InternalError("PushGrad: the header could not be serialized");
    stream.Write(message);
    const bool crc_wanted = header.crc32c() == 0 && (header.crc32c_follows() || payload_crc32c != nullptr);
    uint32_t crc = 0;
    int64_t offset = 0;
    for (; stream.ok() && offset < data.numel; offset += chunk_elements) {
      const ElementSpan part = data.Sub(offset, std::min(chunk_elements, data.numel - offset));
      stream.Write(EncodeChunkCopy(v1::PushGradRequest::kChunkFieldNumber, offset,
                                   {static_cast<const uint8_t*>(part.data), static_cast<size_t>(part.bytes())},
                                   crc_wanted ? &crc : nullptr));
    }
    if (header.crc32c_follows() && stream.ok()) {
      v1::PushGradRequest last;
      last.mutable_trailer()->set_crc32c(crc);
      grpc::ByteBuffer trailer;
      if (!Serialize(last, &trailer)) return absl::InternalError("PushGrad: the trailer could not be serialized");
      stream.Write(trailer);
    }
    stream.WritesDone();
    grpc::ByteBuffer answer;
    stream.Read(&answer);  // the one response, unless the daemon refused the push
    absl::Status s = StatusFromCall(stream.Finish(), context);
    if (!s.ok()) return s;
    v1::PushGradResponse response;
    if (!Parse(&answer, &response)) return absl::InternalError("PushGrad: the daemon's answer is not a response");
    if (crc_wanted && payload_crc32c != nullptr && offset >= data.numel) *payload_crc32c = crc;  // all of it
    return response;
  }

  absl::Status Pull(const Route& route, const v1::PullParamsRequest& request, ShardPullAssembler& assembler, Deadline,
                    grpc::ClientContext* context) override {
    RawStream stream(route.channel, "PullParams", context);
    grpc::ByteBuffer message;
    if (!Serialize(request, &message)) return absl::InternalError("PullParams: the request could not be serialized");
    stream.Write(message);
    stream.WritesDone();
    absl::Status local;
    ChunkView chunk;
    v1::PullParamsResponse parsed;
    while (local.ok() && stream.Read(&message)) {
      if (DecodeChunk(message, v1::PullParamsResponse::kDataFieldNumber, &chunk)) {
        local = assembler.OnDataChunk(chunk.offset, chunk.pieces);
      } else if (Parse(&message, &parsed)) {
        local = assembler.OnMessage(parsed);
      } else {
        local = absl::InternalError("PullParams: the daemon sent a message that is not a PullParamsResponse");
      }
      chunk.Release();  // the message's memory goes back to gRPC now, not at the next read
      message.Clear();
    }
    if (!local.ok()) context->TryCancel();
    absl::Status s = StatusFromCall(stream.Finish(), context);
    if (!local.ok()) return local;  // a protocol violation outranks the CANCELLED it caused
    return s;
  }

  void Shutdown() override {}  // the client cancels its gRPC contexts itself

 private:
  const TransportContext context_;
};

}  // namespace

std::unique_ptr<DataTransport> MakeGrpcTransport(const TransportContext& context) {
  return std::make_unique<GrpcTransport>(context);
}

}  // namespace mainstay::client_internal
