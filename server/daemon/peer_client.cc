#include "server/daemon/peer_client.h"

#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace mainstay::daemon {

absl::StatusOr<StepFault> ParseStepFault(absl::string_view spec) {
  StepFault fault;
  if (spec.empty() || spec == "none") return fault;
  const std::vector<absl::string_view> parts = absl::StrSplit(spec, ':');
  int64_t step = 0;
  if (parts.size() == 3 && parts[0] == "lose-reduction" && absl::SimpleAtoi(parts[1], &step) && step >= -1 &&
      (parts[2] == "stats" || parts[2] == "amax")) {
    fault.step = step;
    fault.reduction = parts[2] == "stats" ? 0 : 1;
    return fault;
  }
  if (parts.size() == 2 &&
      (parts[0] == "drop-replica-input" || parts[0] == "crash-after-decision" || parts[0] == "crash-on-copy") &&
      absl::SimpleAtoi(parts[1], &step) && step >= 0) {
    fault.kind = parts[0] == "drop-replica-input"     ? StepFault::Kind::kDropReplicaInput
                 : parts[0] == "crash-after-decision" ? StepFault::Kind::kCrashAfterDecision
                                                      : StepFault::Kind::kCrashOnCopy;
    fault.step = step;
    return fault;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--inject-fault: '", spec,
                   "' is not 'lose-reduction:STEP:stats', 'lose-reduction:STEP:amax' (STEP >= -1), "
                   "'drop-replica-input:STEP', 'crash-after-decision:STEP', 'crash-on-copy:STEP' (STEP >= 0) or 'none'"));
}

}  // namespace mainstay::daemon
