// The grpc transport: PushGrad and PullParams streams of the Shard service.
#include <algorithm>
#include <memory>

#include "client/src/rpc_errors.h"
#include "client/src/transport.h"

namespace mainstay::client_internal {
namespace {

class GrpcTransport final : public DataTransport {
 public:
  explicit GrpcTransport(const TransportContext& context) : context_(context) {}

  v1::Transport kind() const override { return v1::TRANSPORT_GRPC; }
  absl::Status Attach(const v1::DaemonEndpoint&, Deadline) override { return absl::OkStatus(); }

  absl::StatusOr<v1::PushGradResponse> Push(const Route& route, const v1::PushGradHeader& header, ElementSpan data,
                                            Deadline, grpc::ClientContext* context) override {
    const int64_t chunk_elements = std::max<int64_t>(1, context_.chunk_bytes / data.element_bytes());
    v1::PushGradResponse response;
    std::unique_ptr<grpc::ClientWriter<v1::PushGradRequest>> writer = route.stub->PushGrad(context, &response);
    v1::PushGradRequest message;
    *message.mutable_header() = header;
    bool ok = writer->Write(message);
    v1::GradChunk* chunk = message.mutable_chunk();
    for (int64_t offset = 0; ok && offset < data.numel; offset += chunk_elements) {
      const ElementSpan part = data.Sub(offset, std::min(chunk_elements, data.numel - offset));
      chunk->set_element_offset(offset);
      chunk->set_data(part.data, part.bytes());
      ok = writer->Write(message);
    }
    if (ok) writer->WritesDone();
    absl::Status s = StatusFromCall(writer->Finish(), context);
    if (!s.ok()) return s;
    return response;
  }

  absl::Status Pull(const Route& route, const v1::PullParamsRequest& request, ShardPullAssembler& assembler, Deadline,
                    grpc::ClientContext* context) override {
    std::unique_ptr<grpc::ClientReader<v1::PullParamsResponse>> reader = route.stub->PullParams(context, request);
    v1::PullParamsResponse message;
    absl::Status local;
    while (reader->Read(&message)) {
      local = assembler.OnMessage(message);
      if (!local.ok()) {
        context->TryCancel();
        break;
      }
    }
    absl::Status s = StatusFromCall(reader->Finish(), context);
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
