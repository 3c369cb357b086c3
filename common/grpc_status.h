// The one place where grpc::Status and absl::Status are converted.
//
// gRPC and absl share the canonical code numbering (0..16), so codes map one to one; the
// message is carried as is. Thread safety: stateless.
#ifndef MAINSTAY_COMMON_GRPC_STATUS_H_
#define MAINSTAY_COMMON_GRPC_STATUS_H_

#include <grpcpp/support/status.h>
#include <grpcpp/support/string_ref.h>

#include <map>

#include "absl/status/status.h"

namespace mainstay {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);
// A finished call's status with the ErrorDetail the server sent in its trailing metadata
// (kErrorDetailMetadataKey, common/error_detail.h) attached as the status's payload. A detail
// that does not parse is dropped: the code and message still say what happened.
absl::Status FromGrpcCall(const grpc::Status& status,
                          const std::multimap<grpc::string_ref, grpc::string_ref>& trailing);

}  // namespace mainstay

#endif  // MAINSTAY_COMMON_GRPC_STATUS_H_
