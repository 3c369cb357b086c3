#include "common/status.h"

namespace mainstay {

absl::Status Annotate(const absl::Status& status, absl::string_view context) {
  if (status.ok() || context.empty()) return status;
  absl::Status annotated(status.code(), absl::StrCat(context, ": ", status.message()));
  status.ForEachPayload([&](absl::string_view url, const absl::Cord& payload) {
    annotated.SetPayload(url, payload);
  });
  return annotated;
}

}  // namespace mainstay
