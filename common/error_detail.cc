#include "common/error_detail.h"

#include <string>

#include "absl/strings/cord.h"
#include "absl/types/optional.h"

namespace mainstay {

absl::Status AttachErrorDetail(absl::Status status, const v1::ErrorDetail& detail) {
  if (status.ok()) return status;
  status.SetPayload(kErrorDetailPayloadUrl, absl::Cord(detail.SerializeAsString()));
  return status;
}

std::optional<v1::ErrorDetail> GetErrorDetail(const absl::Status& status) {
  absl::optional<absl::Cord> payload = status.GetPayload(kErrorDetailPayloadUrl);
  if (!payload.has_value()) return std::nullopt;
  v1::ErrorDetail detail;
  if (!detail.ParseFromString(std::string(*payload))) return std::nullopt;
  return detail;
}

}  // namespace mainstay
