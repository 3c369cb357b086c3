// JobSpec <-> mainstay.v1.JobSpec. FromProto validates exactly as the JSON parser does (it
// goes through ParseJobSpecJson), so errors name the same field paths everywhere.
#ifndef MAINSTAY_COMMON_JOB_SPEC_PROTO_H_
#define MAINSTAY_COMMON_JOB_SPEC_PROTO_H_

#include "absl/status/statusor.h"
#include "common/job_spec.h"
#include "mainstay/v1/common.pb.h"

namespace mainstay {

void JobSpecToProto(const JobSpec& spec, v1::JobSpec* out);
absl::StatusOr<JobSpec> JobSpecFromProto(const v1::JobSpec& proto);

}  // namespace mainstay

#endif  // MAINSTAY_COMMON_JOB_SPEC_PROTO_H_
