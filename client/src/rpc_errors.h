// How the client reads a finished call's status: gRPC code and message (common/grpc_status.h)
// plus the ErrorDetail a daemon or the coordinator attaches in the trailing metadata key
// "mainstay-error-detail-bin" (common.proto), kept as an absl::Status payload so it survives
// Annotate and reaches the caller (GetErrorInfo). Classify decides what the retry loop does.
//
// Thread safety: stateless functions.
#ifndef MAINSTAY_CLIENT_SRC_RPC_ERRORS_H_
#define MAINSTAY_CLIENT_SRC_RPC_ERRORS_H_

#include "common/error_detail.h"
#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <map>
#include <optional>

#include "absl/status/status.h"
#include "mainstay/v1/common.pb.h"

namespace mainstay::client_internal {

// The same key and payload URL as the servers use (common/error_detail.h).
using ::mainstay::kErrorDetailMetadataKey;
using ::mainstay::kErrorDetailPayloadUrl;

using TrailingMetadata = std::multimap<grpc::string_ref, grpc::string_ref>;

// `status` as absl::Status; when it is an error and `trailing` holds a parseable ErrorDetail, the
// detail's serialized bytes are attached as payload kErrorDetailPayloadUrl.
absl::Status StatusFromCall(const grpc::Status& status, const TrailingMetadata& trailing);
// The same for a finished call of `context`. Takes the status first so that the trailing metadata
// is read only after the call finished (gRPC fills its map once, at the first read).
absl::Status StatusFromCall(const grpc::Status& status, grpc::ClientContext* context);
// The ErrorDetail payload of `status`, if any.
std::optional<v1::ErrorDetail> ErrorDetailOf(const absl::Status& status);

enum class RetryAction {
  kFail,              // return the error to the caller
  kBackoff,           // UNAVAILABLE: wait, then try again until the deadline
  kRefreshPlacement,  // FAILED_PRECONDITION naming a newer epoch: re-read placement, try again
};
// `used_epoch` is the placement epoch the request carried; `placement_routed` says whether the
// call was routed by placement (coordinator calls are not).
RetryAction Classify(const absl::Status& status, int64_t used_epoch, bool placement_routed);

}  // namespace mainstay::client_internal

#endif  // MAINSTAY_CLIENT_SRC_RPC_ERRORS_H_
