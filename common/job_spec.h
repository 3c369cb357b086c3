// The job spec: what a user writes to describe a training job (docs/job_spec.md).
//
// A JSON document: tensors (names and shapes), recipe and its options, per-tensor format
// overrides, optimizer, D, layout policy and bucket size. ParseJobSpecJson validates types
// and ranges; ResolveJob turns a spec into formats and a Layout, which is what the
// coordinator stores and every client and daemon shares.
//
// Thread safety: pure functions. Errors: INVALID_ARGUMENT whose message starts with the
// JSON path of the offending field ("tensors[3].shape[1]: ..."); NOT_FOUND / PERMISSION_DENIED
// etc. for a spec file that cannot be read.
#ifndef MAINSTAY_COMMON_JOB_SPEC_H_
#define MAINSTAY_COMMON_JOB_SPEC_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/format.h"
#include "common/layout.h"
#include "common/recipe.h"
#include "common/tensor_spec.h"

namespace mainstay {

enum class OptimizerType { kAdamW, kSGD };
absl::string_view OptimizerTypeName(OptimizerType type);

struct OptimizerSpec {
  OptimizerType type = OptimizerType::kAdamW;
  float beta1 = 0.9f;          // AdamW first-moment decay
  float beta2 = 0.999f;        // AdamW second-moment decay
  float eps = 1e-8f;           // AdamW denominator epsilon
  float weight_decay = 0.01f;  // decoupled; the trainer may override it per step
  float momentum = 0.9f;       // SGD momentum
  float max_grad_norm = 1.0f;  // global-norm clipping threshold; 0 disables clipping
  ElementType moment_dtype = ElementType::kFloat32;  // kFloat32 or kBFloat16
  friend bool operator==(const OptimizerSpec&, const OptimizerSpec&) = default;
};

struct JobSpec {
  std::string name;                       // unique per coordinator; [A-Za-z0-9._-], 1..128 chars
  std::string recipe = "bf16_mixed";      // a name from RecipeNames() (or a Bridge alias)
  RecipeOptions recipe_options;
  std::vector<FormatOverride> overrides;  // first match wins
  OptimizerSpec optimizer;
  int64_t data_parallel_size = 1;         // D
  LayoutPolicy layout_policy = LayoutPolicy::kFlat;
  int64_t bucket_numel = 0;               // elements; 0 = DefaultBucketNumel(D)
  int num_layers = 0;                     // transformer layers; 0 = inferred from names
  std::vector<TensorSpec> tensors;        // registration order; formats are resolved later
  std::vector<std::string> trainer_nodes; // node of each trainer rank (D entries) or empty
  int replication_factor = 1;             // copies of each shard's state, 1..kMaxReplicationFactor
  // Trainers push each rank's unreduced gradient (num_contributors = D) rather than a
  // reduce-scattered shard: the daemons hold D buffers per shard and step, which placement counts.
  bool unreduced_pushes = false;
};

inline constexpr int kMaxReplicationFactor = 3;

absl::StatusOr<JobSpec> ParseJobSpecJson(absl::string_view json_text);
absl::StatusOr<JobSpec> LoadJobSpecFile(const std::string& path);
// Canonical JSON of `spec` (ParseJobSpecJson(JobSpecToJson(s)) == s), pretty-printed.
std::string JobSpecToJson(const JobSpec& spec);

// A spec with its recipe, every tensor's resolved format and the layout.
struct ResolvedJob {
  JobSpec spec;
  Recipe recipe;
  std::vector<ResolvedFormat> formats;  // one per spec.tensors entry
  Layout layout;
};
absl::StatusOr<ResolvedJob> ResolveJob(const JobSpec& spec);

// What a daemon holds for a job (docs/daemon.md, "Memory"), per element of a shard it holds as
// primary or replica: the FP32 master and the moments, once (a step is decided before it
// updates them in place: server/daemon/job_step.cc); the gradients of the two steps that may
// be open, `contributors` buffers each (D with unreduced pushes, else 1; counted at 4 B, the
// widest push type) plus their FP32 sum when there are several; and `retained_versions`
// published snapshots plus the one the next step is cast into. The coordinator's placement
// and the daemon's admission of an assignment both use it.
struct MemoryPlan {
  int64_t moment_bytes = 8;     // per element, all moments: AdamW 2 x 4 (or 2 x 2 in BF16), SGD 1 x 4
  int64_t contributors = 1;     // gradient buffers per shard and open step
  int retained_versions = 4;    // mainstayd --retained-versions (the coordinator assumes the default)
};
MemoryPlan PlanMemory(const JobSpec& spec, int retained_versions = 4);
// Bytes held for one shard of `bucket` / for one rank (its shard of every bucket).
int64_t ShardMemoryBytes(const Bucket& bucket, const MemoryPlan& plan);
int64_t RankMemoryBytes(const Layout& layout, const MemoryPlan& plan);

}  // namespace mainstay

#endif  // MAINSTAY_COMMON_JOB_SPEC_H_
