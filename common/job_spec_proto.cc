#include "common/job_spec_proto.h"

#include <nlohmann/json.hpp>

#include "common/recipe.h"

namespace mainstay {

void JobSpecToProto(const JobSpec& spec, v1::JobSpec* out) {
  out->Clear();
  out->set_name(spec.name);
  out->set_recipe(spec.recipe);
  const RecipeOptions& o = spec.recipe_options;
  v1::RecipeOptions* po = out->mutable_recipe_options();
  if (o.fp8_amax_history_len) po->set_fp8_amax_history_len(*o.fp8_amax_history_len);
  if (o.fp8_amax_compute_algo) po->set_fp8_amax_compute_algo(std::string(AmaxComputeAlgoName(*o.fp8_amax_compute_algo)));
  if (o.fp8_margin) po->set_fp8_margin(*o.fp8_margin);
  if (o.first_last_layers_bf16) po->set_first_last_layers_bf16(*o.first_last_layers_bf16);
  if (o.num_layers_at_start_in_bf16) po->set_num_layers_at_start_in_bf16(*o.num_layers_at_start_in_bf16);
  if (o.num_layers_at_end_in_bf16) po->set_num_layers_at_end_in_bf16(*o.num_layers_at_end_in_bf16);
  for (const FormatOverride& ov : spec.overrides) {
    v1::FormatOverride* p = out->add_overrides();
    p->set_pattern(ov.pattern);
    p->set_format(std::string(FormatName(ov.format)));
  }
  v1::OptimizerSpec* opt = out->mutable_optimizer();
  opt->set_type(std::string(OptimizerTypeName(spec.optimizer.type)));
  opt->set_beta1(spec.optimizer.beta1);
  opt->set_beta2(spec.optimizer.beta2);
  opt->set_eps(spec.optimizer.eps);
  opt->set_weight_decay(spec.optimizer.weight_decay);
  opt->set_momentum(spec.optimizer.momentum);
  opt->set_max_grad_norm(spec.optimizer.max_grad_norm);
  opt->set_moment_dtype(spec.optimizer.moment_dtype == ElementType::kBFloat16 ? "bf16" : "fp32");
  out->set_data_parallel_size(spec.data_parallel_size);
  out->set_layout_policy(std::string(LayoutPolicyName(spec.layout_policy)));
  out->set_bucket_numel(spec.bucket_numel);
  out->set_num_layers(spec.num_layers);
  for (const TensorSpec& t : spec.tensors) {
    v1::TensorSpec* p = out->add_tensors();
    p->set_name(t.name);
    for (int64_t d : t.shape) p->add_shape(d);
    p->set_param_group(t.param_group);
  }
  for (const std::string& node : spec.trainer_nodes) out->add_trainer_nodes(node);
  out->set_replication_factor(spec.replication_factor);
  out->set_unreduced_pushes(spec.unreduced_pushes);
}

absl::StatusOr<JobSpec> JobSpecFromProto(const v1::JobSpec& p) {
  using Json = nlohmann::json;
  Json j;
  j["name"] = p.name();
  if (!p.recipe().empty()) j["recipe"] = p.recipe();
  if (p.has_recipe_options()) {
    const v1::RecipeOptions& o = p.recipe_options();
    Json options = Json::object();
    if (o.has_fp8_amax_history_len()) options["fp8_amax_history_len"] = o.fp8_amax_history_len();
    if (o.has_fp8_amax_compute_algo()) options["fp8_amax_compute_algo"] = o.fp8_amax_compute_algo();
    if (o.has_fp8_margin()) options["fp8_margin"] = o.fp8_margin();
    if (o.has_first_last_layers_bf16()) options["first_last_layers_bf16"] = o.first_last_layers_bf16();
    if (o.has_num_layers_at_start_in_bf16()) options["num_layers_at_start_in_bf16"] = o.num_layers_at_start_in_bf16();
    if (o.has_num_layers_at_end_in_bf16()) options["num_layers_at_end_in_bf16"] = o.num_layers_at_end_in_bf16();
    j["recipe_options"] = options;
  }
  if (p.overrides_size() > 0) {
    Json overrides = Json::array();
    for (const v1::FormatOverride& ov : p.overrides()) overrides.push_back({{"pattern", ov.pattern()}, {"format", ov.format()}});
    j["overrides"] = overrides;
  }
  if (p.has_optimizer()) {
    const v1::OptimizerSpec& o = p.optimizer();
    Json opt = Json::object();
    if (!o.type().empty()) opt["type"] = o.type();
    if (o.has_beta1()) opt["beta1"] = o.beta1();
    if (o.has_beta2()) opt["beta2"] = o.beta2();
    if (o.has_eps()) opt["eps"] = o.eps();
    if (o.has_weight_decay()) opt["weight_decay"] = o.weight_decay();
    if (o.has_momentum()) opt["momentum"] = o.momentum();
    if (o.has_max_grad_norm()) opt["max_grad_norm"] = o.max_grad_norm();
    if (!o.moment_dtype().empty()) opt["moment_dtype"] = o.moment_dtype();
    j["optimizer"] = opt;
  }
  j["data_parallel_size"] = p.data_parallel_size();
  if (!p.layout_policy().empty()) j["layout_policy"] = p.layout_policy();
  j["bucket_numel"] = p.bucket_numel();
  j["num_layers"] = p.num_layers();
  Json tensors = Json::array();
  for (const v1::TensorSpec& t : p.tensors()) {
    Json entry = {{"name", t.name()}, {"shape", std::vector<int64_t>(t.shape().begin(), t.shape().end())}};
    if (t.param_group() != 0) entry["param_group"] = t.param_group();
    tensors.push_back(std::move(entry));
  }
  j["tensors"] = tensors;
  if (p.trainer_nodes_size() > 0) {
    j["trainer_nodes"] = std::vector<std::string>(p.trainer_nodes().begin(), p.trainer_nodes().end());
  }
  if (p.replication_factor() != 0) j["replication_factor"] = p.replication_factor();
  if (p.unreduced_pushes()) j["unreduced_pushes"] = true;
  return ParseJobSpecJson(j.dump());
}

}  // namespace mainstay
