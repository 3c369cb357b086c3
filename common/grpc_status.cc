#include "common/grpc_status.h"

#include <string>

#include "common/error_detail.h"
#include "mainstay/v1/common.pb.h"

namespace mainstay {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  int code = static_cast<int>(status.error_code());
  // Codes outside the canonical range (a misbehaving peer) become UNKNOWN, never OK.
  if (code <= 0 || code > static_cast<int>(absl::StatusCode::kUnauthenticated)) {
    return absl::UnknownError(status.error_message());
  }
  return absl::Status(static_cast<absl::StatusCode>(code), status.error_message());
}

absl::Status FromGrpcCall(const grpc::Status& status,
                          const std::multimap<grpc::string_ref, grpc::string_ref>& trailing) {
  absl::Status result = FromGrpcStatus(status);
  if (result.ok()) return result;
  auto it = trailing.find(kErrorDetailMetadataKey);
  if (it == trailing.end()) return result;
  v1::ErrorDetail detail;
  if (!detail.ParseFromArray(it->second.data(), static_cast<int>(it->second.size()))) return result;
  return AttachErrorDetail(std::move(result), detail);
}

}  // namespace mainstay
