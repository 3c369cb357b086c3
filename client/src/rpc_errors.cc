#include "client/src/rpc_errors.h"

#include <string>

#include "absl/strings/cord.h"
#include "common/grpc_status.h"
#include "mainstay/client.h"

namespace mainstay {
namespace client_internal {

absl::Status StatusFromCall(const grpc::Status& status, const TrailingMetadata& trailing) {
  return FromGrpcCall(status, trailing);
}

absl::Status StatusFromCall(const grpc::Status& status, grpc::ClientContext* context) {
  if (status.ok()) return absl::OkStatus();
  return StatusFromCall(status, context->GetServerTrailingMetadata());
}

std::optional<v1::ErrorDetail> ErrorDetailOf(const absl::Status& status) {
  auto payload = status.GetPayload(kErrorDetailPayloadUrl);
  if (!payload.has_value()) return std::nullopt;
  v1::ErrorDetail detail;
  if (!detail.ParseFromString(std::string(*payload))) return std::nullopt;
  return detail;
}

RetryAction Classify(const absl::Status& status, int64_t used_epoch, bool placement_routed) {
  switch (status.code()) {
    case absl::StatusCode::kUnavailable:
      return RetryAction::kBackoff;
    case absl::StatusCode::kFailedPrecondition: {
      if (!placement_routed) return RetryAction::kFail;
      std::optional<v1::ErrorDetail> detail = ErrorDetailOf(status);
      if (detail.has_value() && detail->placement_epoch() > used_epoch) return RetryAction::kRefreshPlacement;
      return RetryAction::kFail;
    }
    default:
      return RetryAction::kFail;
  }
}

}  // namespace client_internal

std::optional<ErrorInfo> GetErrorInfo(const absl::Status& status) {
  std::optional<v1::ErrorDetail> detail = client_internal::ErrorDetailOf(status);
  if (!detail.has_value()) return std::nullopt;
  return ErrorInfo{detail->placement_epoch(), detail->committed_step(), detail->version()};
}

}  // namespace mainstay
