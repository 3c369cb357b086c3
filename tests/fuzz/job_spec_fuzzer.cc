// libFuzzer target: the fuzz input is a job-spec JSON document (docs/job_spec.md) as a user,
// mainstayctl or the client library hands it to ParseJobSpecJson.
//
// Invariants (a violation aborts, so libFuzzer reports it with the input):
//  - no crash, leak or UB (built with -fsanitize=fuzzer,address,undefined by scripts/fuzz.sh);
//  - ParseJobSpecJson and ResolveJob fail only with INVALID_ARGUMENT;
//  - a spec that parses round-trips: through its canonical JSON and through mainstay.v1.JobSpec
//    (JobSpecToProto, wire bytes, JobSpecFromProto) to an equal spec, and ResolveJob gives the
//    same answer for the round-tripped spec (equal recipe, formats and layout, or the same error);
//  - a resolved layout round-trips through mainstay.v1.Layout (the daemon compares the two).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/job_spec.h"
#include "common/job_spec_proto.h"
#include "common/layout_proto.h"
#include "mainstay/v1/common.pb.h"
#include "tests/fuzz/fuzz_check.h"

namespace mainstay {
namespace {

using fuzz::Check;
using fuzz::Fail;

bool SameRecipeOptions(const RecipeOptions& a, const RecipeOptions& b) {
  return a.fp8_amax_history_len == b.fp8_amax_history_len && a.fp8_amax_compute_algo == b.fp8_amax_compute_algo &&
         a.fp8_margin == b.fp8_margin && a.first_last_layers_bf16 == b.first_last_layers_bf16 &&
         a.num_layers_at_start_in_bf16 == b.num_layers_at_start_in_bf16 &&
         a.num_layers_at_end_in_bf16 == b.num_layers_at_end_in_bf16;
}

bool SameOverrides(const std::vector<FormatOverride>& a, const std::vector<FormatOverride>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].pattern != b[i].pattern || a[i].format != b[i].format) return false;
  }
  return true;
}

// Field by field (JobSpec has no operator==), plus the canonical JSON.
void CheckSameSpec(const JobSpec& a, const JobSpec& b, const char* how) {
  const std::string where = std::string(" differs after the ") + how + " round trip";
  Check(a.name == b.name, "name" + where);
  Check(a.recipe == b.recipe, "recipe" + where);
  Check(SameRecipeOptions(a.recipe_options, b.recipe_options), "recipe_options" + where);
  Check(SameOverrides(a.overrides, b.overrides), "overrides" + where);
  Check(a.optimizer == b.optimizer, "optimizer" + where);
  Check(a.data_parallel_size == b.data_parallel_size, "data_parallel_size" + where);
  Check(a.layout_policy == b.layout_policy, "layout_policy" + where);
  Check(a.bucket_numel == b.bucket_numel, "bucket_numel" + where);
  Check(a.num_layers == b.num_layers, "num_layers" + where);
  Check(a.tensors == b.tensors, "tensors" + where);
  Check(a.trainer_nodes == b.trainer_nodes, "trainer_nodes" + where);
  Check(JobSpecToJson(a) == JobSpecToJson(b), "canonical JSON" + where);
}

void CheckResolvesTheSame(const JobSpec& a, const JobSpec& b) {
  absl::StatusOr<ResolvedJob> ra = ResolveJob(a);
  absl::StatusOr<ResolvedJob> rb = ResolveJob(b);
  if (!ra.ok()) {
    Check(ra.status().code() == absl::StatusCode::kInvalidArgument,
          "ResolveJob failed with an unexpected code: " + ra.status().ToString());
    Check(ra.status() == rb.status(), "ResolveJob answers differently after the proto round trip");
    return;
  }
  Check(rb.ok(), "the round-tripped spec does not resolve: " + rb.status().ToString());
  Check(ra->recipe == rb->recipe, "resolved recipe differs after the proto round trip");
  Check(ra->formats == rb->formats, "resolved formats differ after the proto round trip");
  Check(ra->layout == rb->layout, "layout differs after the proto round trip");
  v1::Layout proto;
  LayoutToProto(ra->layout, &proto);
  v1::Layout wire;
  Check(wire.ParseFromString(proto.SerializeAsString()), "the Layout message does not parse back");
  absl::StatusOr<Layout> back = LayoutFromProto(wire);
  Check(back.ok(), "LayoutFromProto refused a computed layout: " + back.status().ToString());
  Check(*back == ra->layout, "the layout differs after its proto round trip");
}

}  // namespace
}  // namespace mainstay

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace mainstay;
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<JobSpec> spec = ParseJobSpecJson(text);
  if (!spec.ok()) {
    Check(spec.status().code() == absl::StatusCode::kInvalidArgument,
          "ParseJobSpecJson failed with an unexpected code: " + spec.status().ToString());
    return 0;
  }
  // Canonical JSON.
  absl::StatusOr<JobSpec> from_json = ParseJobSpecJson(JobSpecToJson(*spec));
  Check(from_json.ok(), "the canonical JSON does not parse: " + from_json.status().ToString());
  CheckSameSpec(*spec, *from_json, "JSON");
  // mainstay.v1.JobSpec, through its wire bytes as the coordinator receives it.
  v1::JobSpec proto;
  JobSpecToProto(*spec, &proto);
  v1::JobSpec wire;
  Check(wire.ParseFromString(proto.SerializeAsString()), "the JobSpec message does not parse back");
  absl::StatusOr<JobSpec> from_proto = JobSpecFromProto(wire);
  Check(from_proto.ok(), "JobSpecFromProto refused a parsed spec: " + from_proto.status().ToString());
  CheckSameSpec(*spec, *from_proto, "proto");
  CheckResolvesTheSame(*spec, *from_proto);
  return 0;
}
