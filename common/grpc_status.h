// The one place where grpc::Status and absl::Status are converted.
//
// gRPC and absl share the canonical code numbering (0..16), so codes map one to one; the
// message is carried as is. Thread safety: stateless.
#ifndef MAINSTAY_COMMON_GRPC_STATUS_H_
#define MAINSTAY_COMMON_GRPC_STATUS_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace mainstay {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace mainstay

#endif  // MAINSTAY_COMMON_GRPC_STATUS_H_
