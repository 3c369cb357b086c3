#include "common/job_spec.h"

#include <cmath>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"

namespace mainstay {
namespace {

using Json = nlohmann::json;

std::string Join(absl::string_view path, absl::string_view key) {
  return path.empty() ? std::string(key) : absl::StrCat(path, ".", key);
}

// Rejects keys the spec does not know: a typo must not silently fall back to a default.
absl::Status CheckKeys(const Json& object, absl::string_view path, std::initializer_list<const char*> known) {
  std::set<std::string> allowed(known.begin(), known.end());
  for (auto it = object.begin(); it != object.end(); ++it) {
    if (!allowed.count(it.key())) {
      return InvalidArgumentError(Join(path, it.key()), "unknown field; known fields: ",
                                  absl::StrJoin(allowed, ", "));
    }
  }
  return absl::OkStatus();
}

absl::Status ExpectObject(const Json& j, absl::string_view path) {
  if (!j.is_object()) return InvalidArgumentError(path.empty() ? "spec" : path, "must be a JSON object");
  return absl::OkStatus();
}

absl::StatusOr<std::string> GetString(const Json& j, const std::string& path) {
  if (!j.is_string()) return InvalidArgumentError(path, "must be a string");
  return j.get<std::string>();
}

absl::StatusOr<int64_t> GetInt(const Json& j, const std::string& path, int64_t lo, int64_t hi) {
  int64_t v = 0;
  if (j.is_number_integer()) {
    if (j.is_number_unsigned() && j.get<uint64_t>() > static_cast<uint64_t>(hi)) {
      return InvalidArgumentError(path, "must be in [", lo, ", ", hi, "]");
    }
    v = j.get<int64_t>();
  } else if (j.is_number_float() && std::isfinite(j.get<double>()) && j.get<double>() == std::floor(j.get<double>()) &&
             std::fabs(j.get<double>()) < 9e18) {
    v = static_cast<int64_t>(j.get<double>());  // 4e7 written as a float
  } else {
    return InvalidArgumentError(path, "must be an integer, got ", j.dump());
  }
  if (v < lo || v > hi) return InvalidArgumentError(path, "must be in [", lo, ", ", hi, "], got ", v);
  return v;
}

absl::StatusOr<float> GetFloat(const Json& j, const std::string& path, double lo, double hi) {
  if (!j.is_number()) return InvalidArgumentError(path, "must be a number, got ", j.dump());
  const double v = j.get<double>();
  if (!std::isfinite(v) || v < lo || v > hi) return InvalidArgumentError(path, "must be in [", lo, ", ", hi, "], got ", v);
  return static_cast<float>(v);
}

absl::StatusOr<bool> GetBool(const Json& j, const std::string& path) {
  if (!j.is_boolean()) return InvalidArgumentError(path, "must be true or false");
  return j.get<bool>();
}

absl::Status ValidateJobName(const std::string& name) {
  if (name.empty() || name.size() > 128) return InvalidArgumentError("name", "must have 1 to 128 characters");
  for (char c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') {
      return InvalidArgumentError("name", "may hold only letters, digits, '.', '_' and '-'; got '", name, "'");
    }
  }
  return absl::OkStatus();
}

absl::Status ParseRecipeOptions(const Json& j, RecipeOptions& out) {
  const std::string p = "recipe_options";
  MAINSTAY_RETURN_IF_ERROR(ExpectObject(j, p));
  MAINSTAY_RETURN_IF_ERROR(CheckKeys(j, p,
                                     {"fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_margin",
                                      "first_last_layers_bf16", "num_layers_at_start_in_bf16",
                                      "num_layers_at_end_in_bf16"}));
  const int64_t kIntMax = std::numeric_limits<int>::max();
  if (j.contains("fp8_amax_history_len")) {
    MAINSTAY_ASSIGN_OR_RETURN(out.fp8_amax_history_len,
                              GetInt(j["fp8_amax_history_len"], p + ".fp8_amax_history_len", 1, 65536));
  }
  if (j.contains("fp8_amax_compute_algo")) {
    MAINSTAY_ASSIGN_OR_RETURN(std::string algo,
                              GetString(j["fp8_amax_compute_algo"], p + ".fp8_amax_compute_algo"));
    absl::StatusOr<AmaxComputeAlgo> parsed = ParseAmaxComputeAlgo(algo);
    if (!parsed.ok()) return Annotate(parsed.status(), p + ".fp8_amax_compute_algo");
    out.fp8_amax_compute_algo = *parsed;
  }
  if (j.contains("fp8_margin")) {
    MAINSTAY_ASSIGN_OR_RETURN(out.fp8_margin, GetInt(j["fp8_margin"], p + ".fp8_margin", 0, 126));
  }
  if (j.contains("first_last_layers_bf16")) {
    MAINSTAY_ASSIGN_OR_RETURN(out.first_last_layers_bf16,
                              GetBool(j["first_last_layers_bf16"], p + ".first_last_layers_bf16"));
  }
  if (j.contains("num_layers_at_start_in_bf16")) {
    MAINSTAY_ASSIGN_OR_RETURN(out.num_layers_at_start_in_bf16,
                              GetInt(j["num_layers_at_start_in_bf16"], p + ".num_layers_at_start_in_bf16", 0, kIntMax));
  }
  if (j.contains("num_layers_at_end_in_bf16")) {
    MAINSTAY_ASSIGN_OR_RETURN(out.num_layers_at_end_in_bf16,
                              GetInt(j["num_layers_at_end_in_bf16"], p + ".num_layers_at_end_in_bf16", 0, kIntMax));
  }
  return absl::OkStatus();
}

absl::Status ParseOptimizer(const Json& j, OptimizerSpec& out) {
  const std::string p = "optimizer";
  MAINSTAY_RETURN_IF_ERROR(ExpectObject(j, p));
  MAINSTAY_RETURN_IF_ERROR(
      CheckKeys(j, p, {"type", "beta1", "beta2", "eps", "weight_decay", "momentum", "max_grad_norm", "moment_dtype"}));
  if (j.contains("type")) {
    MAINSTAY_ASSIGN_OR_RETURN(std::string type, GetString(j["type"], p + ".type"));
    if (type == "adamw") {
      out.type = OptimizerType::kAdamW;
    } else if (type == "sgd") {
      out.type = OptimizerType::kSGD;
    } else {
      return InvalidArgumentError(p + ".type", "unknown optimizer '", type, "'; known: adamw, sgd");
    }
  }
  // beta < 1 keeps the bias correction 1 - beta^t away from zero.
  if (j.contains("beta1")) {
    MAINSTAY_ASSIGN_OR_RETURN(out.beta1, GetFloat(j["beta1"], p + ".beta1", 0.0, 0.9999999));
  }
  if (j.contains("beta2")) {
    MAINSTAY_ASSIGN_OR_RETURN(out.beta2, GetFloat(j["beta2"], p + ".beta2", 0.0, 0.9999999));
  }
  if (j.contains("eps")) {
    MAINSTAY_ASSIGN_OR_RETURN(out.eps, GetFloat(j["eps"], p + ".eps", 1e-30, 1.0));
  }
  if (j.contains("weight_decay")) {
    MAINSTAY_ASSIGN_OR_RETURN(out.weight_decay, GetFloat(j["weight_decay"], p + ".weight_decay", 0.0, 1e3));
  }
  if (j.contains("momentum")) {
    MAINSTAY_ASSIGN_OR_RETURN(out.momentum, GetFloat(j["momentum"], p + ".momentum", 0.0, 1.0));
  }
  if (j.contains("max_grad_norm")) {
    MAINSTAY_ASSIGN_OR_RETURN(out.max_grad_norm, GetFloat(j["max_grad_norm"], p + ".max_grad_norm", 0.0, 1e30));
  }
  if (j.contains("moment_dtype")) {
    MAINSTAY_ASSIGN_OR_RETURN(std::string dtype, GetString(j["moment_dtype"], p + ".moment_dtype"));
    if (dtype == "fp32") {
      out.moment_dtype = ElementType::kFloat32;
    } else if (dtype == "bf16") {
      out.moment_dtype = ElementType::kBFloat16;
    } else {
      return InvalidArgumentError(p + ".moment_dtype", "must be fp32 or bf16, got '", dtype, "'");
    }
  }
  return absl::OkStatus();
}

absl::Status ParseTensors(const Json& j, std::vector<TensorSpec>& out) {
  if (!j.is_array()) return InvalidArgumentError("tensors", "must be an array of {name, shape}");
  out.reserve(j.size());
  for (size_t i = 0; i < j.size(); ++i) {
    const std::string p = absl::StrCat("tensors[", i, "]");
    const Json& t = j[i];
    MAINSTAY_RETURN_IF_ERROR(ExpectObject(t, p));
    MAINSTAY_RETURN_IF_ERROR(CheckKeys(t, p, {"name", "shape", "param_group"}));
    if (!t.contains("name")) return InvalidArgumentError(p + ".name", "is required");
    if (!t.contains("shape")) return InvalidArgumentError(p + ".shape", "is required");
    TensorSpec spec;
    MAINSTAY_ASSIGN_OR_RETURN(spec.name, GetString(t["name"], p + ".name"));
    const Json& shape = t["shape"];
    if (!shape.is_array()) return InvalidArgumentError(p + ".shape", "must be an array of positive integers");
    for (size_t d = 0; d < shape.size(); ++d) {
      MAINSTAY_ASSIGN_OR_RETURN(int64_t dim, GetInt(shape[d], absl::StrCat(p, ".shape[", d, "]"),
                                                    std::numeric_limits<int64_t>::min(),
                                                    std::numeric_limits<int64_t>::max()));
      spec.shape.push_back(dim);  // ranges are checked by the layout with the same field path
    }
    if (t.contains("param_group")) {
      MAINSTAY_ASSIGN_OR_RETURN(int64_t group, GetInt(t["param_group"], p + ".param_group", 0, kMaxParamGroups - 1));
      spec.param_group = static_cast<int32_t>(group);
    }
    out.push_back(std::move(spec));
  }
  return absl::OkStatus();
}

}  // namespace

absl::string_view OptimizerTypeName(OptimizerType type) {
  return type == OptimizerType::kSGD ? "sgd" : "adamw";
}

absl::StatusOr<JobSpec> ParseJobSpecJson(absl::string_view json_text) {
  Json j = Json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false,
                       /*ignore_comments=*/true);
  if (j.is_discarded()) {
    // Re-parse with exceptions only to get the position of the syntax error. Not only
    // parse_error: a number too large for a double ("1e400") is out_of_range.
    try {
      Json unused = Json::parse(json_text.begin(), json_text.end(), nullptr, true, true);
      (void)unused;
    } catch (const Json::exception& e) {
      return absl::InvalidArgumentError(absl::StrCat("spec: not valid JSON: ", e.what()));
    }
    return absl::InvalidArgumentError("spec: not valid JSON");
  }
  MAINSTAY_RETURN_IF_ERROR(ExpectObject(j, ""));
  MAINSTAY_RETURN_IF_ERROR(CheckKeys(j, "",
                                     {"name", "recipe", "recipe_options", "overrides", "optimizer",
                                      "data_parallel_size", "layout_policy", "bucket_numel", "num_layers",
                                      "tensors", "trainer_nodes", "replication_factor", "unreduced_pushes"}));
  JobSpec spec;
  if (!j.contains("name")) return InvalidArgumentError("name", "is required");
  MAINSTAY_ASSIGN_OR_RETURN(spec.name, GetString(j["name"], "name"));
  MAINSTAY_RETURN_IF_ERROR(ValidateJobName(spec.name));
  if (j.contains("recipe")) {
    MAINSTAY_ASSIGN_OR_RETURN(spec.recipe, GetString(j["recipe"], "recipe"));
    absl::StatusOr<Recipe> recipe = FindRecipe(spec.recipe);
    if (!recipe.ok()) return Annotate(recipe.status(), "recipe");
  }
  if (j.contains("recipe_options")) MAINSTAY_RETURN_IF_ERROR(ParseRecipeOptions(j["recipe_options"], spec.recipe_options));
  if (j.contains("overrides")) {
    const Json& o = j["overrides"];
    if (!o.is_array()) return InvalidArgumentError("overrides", "must be an array of {pattern, format}");
    for (size_t i = 0; i < o.size(); ++i) {
      const std::string p = absl::StrCat("overrides[", i, "]");
      MAINSTAY_RETURN_IF_ERROR(ExpectObject(o[i], p));
      MAINSTAY_RETURN_IF_ERROR(CheckKeys(o[i], p, {"pattern", "format"}));
      if (!o[i].contains("pattern")) return InvalidArgumentError(p + ".pattern", "is required");
      if (!o[i].contains("format")) return InvalidArgumentError(p + ".format", "is required");
      FormatOverride override_spec;
      MAINSTAY_ASSIGN_OR_RETURN(override_spec.pattern, GetString(o[i]["pattern"], p + ".pattern"));
      if (override_spec.pattern.empty()) return InvalidArgumentError(p + ".pattern", "must not be empty");
      MAINSTAY_ASSIGN_OR_RETURN(std::string format, GetString(o[i]["format"], p + ".format"));
      absl::StatusOr<Format> parsed = ParseFormat(format);
      if (!parsed.ok()) return Annotate(parsed.status(), p + ".format");
      override_spec.format = *parsed;
      spec.overrides.push_back(std::move(override_spec));
    }
  }
  if (j.contains("optimizer")) MAINSTAY_RETURN_IF_ERROR(ParseOptimizer(j["optimizer"], spec.optimizer));
  if (j.contains("data_parallel_size")) {
    MAINSTAY_ASSIGN_OR_RETURN(spec.data_parallel_size,
                              GetInt(j["data_parallel_size"], "data_parallel_size", 1, kMaxDataParallelSize));
  }
  if (j.contains("replication_factor")) {
    MAINSTAY_ASSIGN_OR_RETURN(int64_t r, GetInt(j["replication_factor"], "replication_factor", 1, kMaxReplicationFactor));
    spec.replication_factor = static_cast<int>(r);
  }
  if (j.contains("unreduced_pushes")) {
    MAINSTAY_ASSIGN_OR_RETURN(spec.unreduced_pushes, GetBool(j["unreduced_pushes"], "unreduced_pushes"));
  }
  if (j.contains("layout_policy")) {
    MAINSTAY_ASSIGN_OR_RETURN(std::string policy, GetString(j["layout_policy"], "layout_policy"));
    absl::StatusOr<LayoutPolicy> parsed = ParseLayoutPolicy(policy);
    if (!parsed.ok()) return Annotate(parsed.status(), "layout_policy");
    spec.layout_policy = *parsed;
  }
  if (j.contains("bucket_numel")) {
    MAINSTAY_ASSIGN_OR_RETURN(spec.bucket_numel, GetInt(j["bucket_numel"], "bucket_numel", 0, kMaxTotalElements));
  }
  if (j.contains("num_layers")) {
    MAINSTAY_ASSIGN_OR_RETURN(spec.num_layers, GetInt(j["num_layers"], "num_layers", 0, 1 << 20));
  }
  if (!j.contains("tensors")) return InvalidArgumentError("tensors", "is required");
  MAINSTAY_RETURN_IF_ERROR(ParseTensors(j["tensors"], spec.tensors));
  if (j.contains("trainer_nodes")) {
    const Json& nodes = j["trainer_nodes"];
    if (!nodes.is_array()) return InvalidArgumentError("trainer_nodes", "must be an array of node names");
    for (size_t i = 0; i < nodes.size(); ++i) {
      MAINSTAY_ASSIGN_OR_RETURN(std::string node, GetString(nodes[i], absl::StrCat("trainer_nodes[", i, "]")));
      spec.trainer_nodes.push_back(std::move(node));
    }
    if (!spec.trainer_nodes.empty() && static_cast<int64_t>(spec.trainer_nodes.size()) != spec.data_parallel_size) {
      return InvalidArgumentError("trainer_nodes", "has ", spec.trainer_nodes.size(),
                                  " entries; needs one per rank (data_parallel_size = ", spec.data_parallel_size, ")");
    }
  }
  return spec;
}

absl::StatusOr<JobSpec> LoadJobSpecFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open job spec '", path, "'"));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("cannot read job spec '", path, "'"));
  absl::StatusOr<JobSpec> spec = ParseJobSpecJson(text.str());
  if (!spec.ok()) return Annotate(spec.status(), path);
  return spec;
}

std::string JobSpecToJson(const JobSpec& spec) {
  Json j;
  j["name"] = spec.name;
  j["recipe"] = spec.recipe;
  Json options = Json::object();
  const RecipeOptions& o = spec.recipe_options;
  if (o.fp8_amax_history_len) options["fp8_amax_history_len"] = *o.fp8_amax_history_len;
  if (o.fp8_amax_compute_algo) {
    options["fp8_amax_compute_algo"] = std::string(AmaxComputeAlgoName(*o.fp8_amax_compute_algo));
  }
  if (o.fp8_margin) options["fp8_margin"] = *o.fp8_margin;
  if (o.first_last_layers_bf16) options["first_last_layers_bf16"] = *o.first_last_layers_bf16;
  if (o.num_layers_at_start_in_bf16) options["num_layers_at_start_in_bf16"] = *o.num_layers_at_start_in_bf16;
  if (o.num_layers_at_end_in_bf16) options["num_layers_at_end_in_bf16"] = *o.num_layers_at_end_in_bf16;
  if (!options.empty()) j["recipe_options"] = options;
  if (!spec.overrides.empty()) {
    Json overrides = Json::array();
    for (const FormatOverride& ov : spec.overrides) {
      overrides.push_back({{"pattern", ov.pattern}, {"format", std::string(FormatName(ov.format))}});
    }
    j["overrides"] = overrides;
  }
  const OptimizerSpec& opt = spec.optimizer;
  j["optimizer"] = {{"type", std::string(OptimizerTypeName(opt.type))},
                    {"beta1", opt.beta1},
                    {"beta2", opt.beta2},
                    {"eps", opt.eps},
                    {"weight_decay", opt.weight_decay},
                    {"momentum", opt.momentum},
                    {"max_grad_norm", opt.max_grad_norm},
                    {"moment_dtype", opt.moment_dtype == ElementType::kBFloat16 ? "bf16" : "fp32"}};
  j["data_parallel_size"] = spec.data_parallel_size;
  j["layout_policy"] = std::string(LayoutPolicyName(spec.layout_policy));
  j["bucket_numel"] = spec.bucket_numel;
  j["num_layers"] = spec.num_layers;
  Json tensors = Json::array();
  for (const TensorSpec& t : spec.tensors) {
    Json entry = {{"name", t.name}, {"shape", t.shape}};
    if (t.param_group != 0) entry["param_group"] = t.param_group;
    tensors.push_back(std::move(entry));
  }
  j["tensors"] = tensors;
  if (!spec.trainer_nodes.empty()) j["trainer_nodes"] = spec.trainer_nodes;
  if (spec.replication_factor != 1) j["replication_factor"] = spec.replication_factor;
  if (spec.unreduced_pushes) j["unreduced_pushes"] = true;
  return j.dump(2);
}

MemoryPlan PlanMemory(const JobSpec& spec, int retained_versions) {
  MemoryPlan plan;
  const int64_t moment = spec.optimizer.moment_dtype == ElementType::kBFloat16 ? 2 : 4;
  plan.moment_bytes = spec.optimizer.type == OptimizerType::kSGD ? moment : 2 * moment;
  plan.contributors = spec.unreduced_pushes ? spec.data_parallel_size : 1;
  plan.retained_versions = retained_versions;
  return plan;
}

int64_t ShardMemoryBytes(const Bucket& bucket, const MemoryPlan& plan) {
  const int64_t state = 4 + plan.moment_bytes;
  const int64_t grads = 2 * plan.contributors * 4 + (plan.contributors > 1 ? 4 : 0);
  // The retained versions and the one the next step is cast into (the daemon keeps its buffer).
  return bucket.shard_numel * (state + grads) +
         (plan.retained_versions + 1) * DataBytes(bucket.format, bucket.shard_numel);
}

int64_t RankMemoryBytes(const Layout& layout, const MemoryPlan& plan) {
  int64_t bytes = 0;
  for (const Bucket& b : layout.buckets) bytes += ShardMemoryBytes(b, plan);
  return bytes;
}

absl::StatusOr<ResolvedJob> ResolveJob(const JobSpec& spec) {
  ResolvedJob job;
  job.spec = spec;
  absl::StatusOr<Recipe> recipe = FindRecipe(spec.recipe);
  if (!recipe.ok()) return Annotate(recipe.status(), "recipe");
  MAINSTAY_ASSIGN_OR_RETURN(job.recipe, ApplyRecipeOptions(*std::move(recipe), spec.recipe_options));
  MAINSTAY_ASSIGN_OR_RETURN(job.formats, ResolveFormats(job.recipe, spec.overrides, spec.tensors, spec.num_layers));
  for (size_t i = 0; i < job.spec.tensors.size(); ++i) job.spec.tensors[i].format = job.formats[i].format;
  MAINSTAY_ASSIGN_OR_RETURN(
      job.layout, ComputeLayout(job.spec.tensors, {spec.data_parallel_size, spec.layout_policy, spec.bucket_numel}));
  return job;
}

}  // namespace mainstay
