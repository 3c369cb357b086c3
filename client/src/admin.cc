// Client: the admin RPCs a trainer makes on its own job (checkpoints), over the coordinator's
// channel. The Admin service lives on the coordinator's port (admin.proto).
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "client/src/client_impl.h"
#include "client/src/rpc_errors.h"
#include "common/status.h"
#include "mainstay/client.h"
#include "mainstay/v1/admin.grpc.pb.h"

namespace mainstay {
namespace {

std::string StateName(v1::CheckpointState state) {
  std::string name = v1::CheckpointState_Name(state);
  constexpr absl::string_view kPrefix = "CHECKPOINT_STATE_";
  if (absl::string_view(name).substr(0, kPrefix.size()) == kPrefix) name = name.substr(kPrefix.size());
  return name;
}

CheckpointInfo CheckpointFromProto(const v1::CheckpointInfo& p) {
  CheckpointInfo c;
  c.checkpoint_id = p.checkpoint_id();
  c.job_id = p.job_id();
  c.job_name = p.job_name();
  c.version = p.version();
  c.state = StateName(p.state());
  c.created_unix_ms = p.created_unix_ms();
  c.size_bytes = p.size_bytes();
  c.file_count = p.file_count();
  c.manifest_uri = p.manifest_uri();
  c.error = p.error();
  return c;
}

}  // namespace

absl::StatusOr<CheckpointInfo> Client::CreateCheckpoint(bool wait, const AdminCallOptions& options) {
  const Deadline deadline = impl_->DeadlineAfter(options.timeout);
  auto stub = v1::Admin::NewStub(impl_->coordinator_channel);
  v1::CreateCheckpointRequest request;
  request.set_admin_token(options.admin_token.value_or(impl_->options.admin_token));
  request.set_job_id(impl_->job_id);
  request.set_wait(wait);
  v1::CreateCheckpointResponse response;
  MAINSTAY_RETURN_IF_ERROR(impl_->Retry(
      absl::StrCat("CreateCheckpoint of job ", impl_->job_id, " at coordinator ", impl_->options.coordinator),
      deadline, nullptr, [&](const client_internal::Route&, grpc::ClientContext* context) {
        return client_internal::StatusFromCall(stub->CreateCheckpoint(context, request, &response), context);
      }));
  return CheckpointFromProto(response.checkpoint());
}

absl::StatusOr<RestoreResult> Client::RestoreCheckpoint(const std::string& checkpoint_id,
                                                        const AdminCallOptions& options) {
  if (checkpoint_id.empty()) return InvalidArgumentError("checkpoint_id", "is required");
  const Deadline deadline = impl_->DeadlineAfter(options.timeout);
  auto stub = v1::Admin::NewStub(impl_->coordinator_channel);
  v1::RestoreCheckpointRequest request;
  request.set_admin_token(options.admin_token.value_or(impl_->options.admin_token));
  request.set_checkpoint_id(checkpoint_id);
  request.set_job_id(impl_->job_id);
  v1::RestoreCheckpointResponse response;
  MAINSTAY_RETURN_IF_ERROR(impl_->Retry(
      absl::StrCat("RestoreCheckpoint ", checkpoint_id, " into job ", impl_->job_id, " at coordinator ",
                   impl_->options.coordinator),
      deadline, nullptr, [&](const client_internal::Route&, grpc::ClientContext* context) {
        return client_internal::StatusFromCall(stub->RestoreCheckpoint(context, request, &response), context);
      }));
  // Every shard was reassigned: route the next pulls by the new placement.
  MAINSTAY_RETURN_IF_ERROR(impl_->RefreshPlacement(deadline, response.placement_epoch()));
  return RestoreResult{response.version(), response.placement_epoch()};
}

}  // namespace mainstay
