// mainstay.v1.ErrorDetail (common.proto) carried on an absl::Status as a payload, so core code
// can say "the current epoch is 7" without gRPC; the gRPC adapters move it to and from the
// trailing metadata key "mainstay-error-detail-bin". Thread safety: stateless.
#ifndef MAINSTAY_COMMON_ERROR_DETAIL_H_
#define MAINSTAY_COMMON_ERROR_DETAIL_H_

#include <optional>

#include "absl/status/status.h"
#include "mainstay/v1/common.pb.h"

namespace mainstay {

inline constexpr char kErrorDetailPayloadUrl[] = "type.googleapis.com/mainstay.v1.ErrorDetail";
inline constexpr char kErrorDetailMetadataKey[] = "mainstay-error-detail-bin";

absl::Status AttachErrorDetail(absl::Status status, const v1::ErrorDetail& detail);
// The detail attached to `status`, if any (and if it parses).
std::optional<v1::ErrorDetail> GetErrorDetail(const absl::Status& status);

}  // namespace mainstay

#endif  // MAINSTAY_COMMON_ERROR_DETAIL_H_
