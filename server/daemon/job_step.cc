// The arithmetic of one step (DESIGN.md sections 1 and 5) and the step thread's loop with
// the commit. ExecuteStep runs without the job's lock and writes only scratch buffers and new
// snapshots, so a failure anywhere in it leaves the job exactly as it was.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/error_detail.h"
#include "common/logging.h"
#include "common/layout_proto.h"
#include "common/status.h"
#include "kernels/scaling.h"
#include "server/daemon/job.h"
#include "server/metrics/daemon_metrics.h"

namespace mainstay::daemon {

namespace {

double MsSince(absl::Time start) { return absl::ToDoubleMilliseconds(absl::Now() - start); }

int ElementBytes(ElementType type) { return BitsOf(type) / 8; }

float ToFloat(const uint8_t* p, ElementType type) {
  switch (type) {
    case ElementType::kBFloat16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return kernels::Bf16ToFloat(h);
    }
    case ElementType::kFloat16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return kernels::Fp16ToFloat(h);
    }
    default: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
  }
}

// The contributions of several ranks summed in FP32, in rank order (deterministic).
void SumContributions(const std::map<int32_t, std::vector<uint8_t>>& by_rank, ElementType type, int64_t n,
                      std::vector<float>& out) {
  out.assign(static_cast<size_t>(n), 0.0f);
  const int bytes = ElementBytes(type);
  bool first = true;
  for (const auto& [rank, data] : by_rank) {
    const uint8_t* p = data.data();
    if (type == ElementType::kFloat32 && first) {
      std::memcpy(out.data(), p, static_cast<size_t>(n) * 4);
    } else {
      for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = first ? ToFloat(p + i * bytes, type)
                                                                         : out[static_cast<size_t>(i)] + ToFloat(p + i * bytes, type);
    }
    first = false;
  }
}

bool HasTensorAmax(Format format) {
  const FormatDescriptor& d = Describe(format);
  return d.scaling == ScalingMode::kDelayed || d.scaling == ScalingMode::kCurrent || format == Format::kNVFP4;
}

float Fp8Max(Format format) {
  return format == Format::kFP8E5M2Delayed || format == Format::kFP8E5M2Current ? kernels::kE5M2Max
                                                                                 : kernels::kE4M3Max;
}

// Whether the cast of `format` needs the amax of the new values before it runs, so that a
// step learns it by a dry run of the update before it is decided. Delayed scaling casts with
// the history's scale, but its amax goes into the history through the step's MAX. mxfp8
// finds its block amaxes in the update's pass only with AdamW (FusedAdamWQuantize) and blocks
// inside the fragment; SGD updates, then casts with the probed block amaxes.
bool NeedsAmaxBeforeCast(Format format, const kernels::Fragment& frag, bool adamw) {
  const ScalingMode mode = Describe(format).scaling;
  if (mode == ScalingMode::kCurrent || mode == ScalingMode::kDelayed) return true;
  if (format == Format::kNVFP4 || format == Format::kFP8Block) return true;
  return format == Format::kMXFP8 && !(adamw && kernels::CastsInAdamWPass(format, frag));
}

// Whether the cast of `format` takes only the tensor's reduced amax (one scale per tensor, no
// block scales). A replica shard then skips the dry run: its primary, a member of the same
// group, contributes the same fragment's amax to the MAX, and the replica casts with the
// reduced value like every daemon (0, its contribution, is the MAX's identity).
bool TensorScaleOnly(Format format) {
  const ScalingMode mode = Describe(format).scaling;
  return mode == ScalingMode::kCurrent || mode == ScalingMode::kDelayed;
}

kernels::AdamWHyper AdamWHyperOf(const OptimizerSpec& opt, const GroupHyper& h, int64_t step, float multiplier) {
  return kernels::AdamWHyper{static_cast<float>(h.lr), opt.beta1, opt.beta2, opt.eps,
                             static_cast<float>(h.weight_decay), step + 1, multiplier};
}

kernels::SgdHyper SgdHyperOf(const OptimizerSpec& opt, const GroupHyper& h, int64_t step, float multiplier) {
  return kernels::SgdHyper{static_cast<float>(h.lr), opt.momentum, static_cast<float>(h.weight_decay), step + 1,
                           multiplier};
}

// The gradients and the optimizer state of the fragment `offset` elements into a shard.
kernels::GradView GradAt(kernels::GradView grad, int64_t offset) {
  return {static_cast<const uint8_t*>(grad.data) + offset * ElementBytes(grad.type), grad.type};
}

kernels::OptimizerState StateAt(StateBuffer<float>& master, StateBuffer<uint8_t>& m, StateBuffer<uint8_t>& v,
                                int64_t offset, const OptimizerSpec& opt) {
  const int moment_bytes = ElementBytes(opt.moment_dtype);
  return {master.data() + offset, m.data() + offset * moment_bytes,
          opt.type == OptimizerType::kAdamW ? v.data() + offset * moment_bytes : nullptr, opt.moment_dtype};
}

// A fragment's bytes in ShardState::scalars, at FragmentCast::slot: the gradient statistics
// (double sum of squares, int64 non-finite count), the tensor amax, the cast's scale_inv, then
// one amax per scale block (the kernels' output, later the reduced input of the cast).
constexpr int64_t kSlotSumSquares = 0, kSlotNonfinite = 8, kSlotAmax = 16, kSlotScaleInv = 20, kSlotBlocks = 24;
int64_t SlotBytes(const IndexRange& blocks) { return (kSlotBlocks + 4 * blocks.size() + 7) / 8 * 8; }
template <typename T>
T* SlotAt(const StateBuffer<uint8_t>& scalars, int64_t offset) {
  return reinterpret_cast<T*>(const_cast<uint8_t*>(scalars.data()) + offset);
}

// `b` holding `n` zeroes: a new block when its size differs, else zeroed in place.
template <typename T>
absl::Status ZeroFilled(kernels::StateMemory& memory, StateBuffer<T>& b, int64_t n) {
  if (b.size() != static_cast<size_t>(n)) return b.Reset(memory, n);
  if (n > 0) std::memset(b.data(), 0, b.size() * sizeof(T));
  return absl::OkStatus();
}

// Step `step`'s update of one fragment (AdamW or SGD as the job says): the probe's dry run, or
// in place where the cast cannot share the pass.
absl::Status UpdateFragment(const kernels::Device& device, Format format, Format model, const kernels::Fragment& frag,
                            kernels::GradView grad, const kernels::OptimizerState& state, const OptimizerSpec& opt,
                            const GroupHyper& h, int64_t step, float multiplier, const kernels::StepOutputs& out) {
  if (opt.type == OptimizerType::kAdamW) {
    return kernels::FusedAdamW(device, format, model, frag, grad, state, AdamWHyperOf(opt, h, step, multiplier), out);
  }
  return kernels::FusedSgd(device, format, model, frag, grad, state, SgdHyperOf(opt, h, step, multiplier), out);
}

}  // namespace

absl::StatusOr<Job::StepResult> Job::ExecuteStep(int64_t step, const StepInputs& inputs,
                                                 const std::vector<std::shared_ptr<ShardState>>& shards,
                                                 const std::vector<char>& is_replica,
                                                 const std::vector<std::string>& members, int64_t epoch,
                                                 const std::map<Key, std::vector<v1::DaemonEndpoint>>& replicas_of) {
  StepResult result;
  v1::StepStats& stats = result.stats;
  v1::StepPhaseTimes& phases = *stats.mutable_phases();
  stats.set_step(step);
  const Layout& layout = job_.layout;
  const OptimizerSpec& opt = job_.spec.optimizer;
  const Format model = job_.recipe.model_dtype;
  const kernels::Device& device = options_.memory->device();
  const absl::Time deadline = absl::Now() + options_.peer_timeout;
  // The group is joined right before the first reduction, after the forwards: a daemon holding
  // only replicas starts its step when the first one arrives.
  bool new_group = false;
  // Set when a reduction failed here but a peer had decided the step: its results replace the
  // remaining reductions (job_outcome.cc).
  std::optional<v1::StepDecision> learned;
  const bool restoring = inputs.restored;

  // The roles are the attempt's own (a promotion meanwhile fails it at the newer epoch).
  std::vector<Key> replica_keys;
  for (size_t i = 0; i < shards.size(); ++i) {
    if (is_replica[i]) replica_keys.push_back({shards[i]->bucket, shards[i]->shard});
  }

  // The step's hyperparameters, one entry per param group (step -1 and restores have none).
  StepHyper hyper;
  if (!inputs.finished.empty()) hyper = inputs.finished.begin()->second;
  stats.set_clip_factor(1.0);

  // 1. Gradients: views (summed when several ranks contributed), partial stats, peer SUM. The
  // primary shards' inputs go to their replicas meanwhile (job_replica.cc); replica shards add
  // nothing to the sums and take their inputs after the SUM.
  std::vector<kernels::GradView> grads(shards.size());
  std::vector<float> multipliers(shards.size(), 1.0f);
  std::vector<double> loss_scales(shards.size(), 1.0);  // of each shard's input
  std::vector<Forward> forwards;
  std::map<Key, ReplicaInput> replica_in;  // the replica shards' inputs, once taken
  std::vector<std::vector<FragmentCast>> casts(shards.size());  // per shard, per fragment
  const int moment_bytes = ElementBytes(opt.moment_dtype);
  const bool adamw = opt.type == OptimizerType::kAdamW;
  absl::Time t = absl::Now();
  double partial[2] = {0.0, 0.0};  // sum of squares, non-finite count (after the peer SUM)
  if (step < 0 && !restoring) {
    for (size_t i = 0; i < shards.size(); ++i) {
      const ShardState& s = *shards[i];
      if (is_replica[i] || !replicas_of.count({s.bucket, s.shard})) continue;
      forwards.push_back({i, inputs.shards.at({s.bucket, s.shard}).by_rank.begin()->second.data(), ElementType::kFloat32, 1.0});
    }
    if (!forwards.empty()) {
      MAINSTAY_RETURN_IF_ERROR(ForwardInputs(step, epoch, forwards, shards, hyper, replicas_of, deadline));
    }
  }
  if (step >= 0) {
    for (size_t i = 0; i < shards.size(); ++i) {
      ShardState& s = *shards[i];
      if (is_replica[i]) continue;
      const ShardInputs& in = inputs.shards.at({s.bucket, s.shard});
      loss_scales[i] = in.loss_scale;
      if (in.num_contributors == 1) {
        grads[i] = {in.by_rank.begin()->second.data(), in.dtype};
      } else {
        SumContributions(in.by_rank, in.dtype, s.numel, s.grad_sum);
        grads[i] = {s.grad_sum.data(), ElementType::kFloat32};
      }
      if (replicas_of.count({s.bucket, s.shard})) {
        const bool reduced = in.num_contributors == 1;
        forwards.push_back({i, static_cast<const uint8_t*>(grads[i].data), grads[i].type, in.loss_scale,
                            reduced ? in.crc32c : 0, reduced && in.copies_sent});
      }
    }
    // On a GPU the kernels read the gradients from state memory (the forwards keep the host's).
    for (size_t i = 0; i < shards.size(); ++i) {
      if (is_replica[i]) continue;
      MAINSTAY_ASSIGN_OR_RETURN(grads[i], StageGradient(*shards[i], grads[i]));
    }
    absl::Status forwarded;
    int64_t forwarded_bytes = 0;
    std::thread forwarder;
    if (!forwards.empty()) {
      forwarder = std::thread([&] {
        forwarded = ForwardInputs(step, epoch, forwards, shards, hyper, replicas_of, deadline, &forwarded_bytes);
      });
    }
    // The primaries' partial stats, one fragment at a time (padding past the last tensor is no
    // parameter and counts for nothing). The probe's bet: unless the last step clipped, the
    // dry runs of step 2 run here with the clip factor taken as 1, and give the statistics in
    // the same pass (FusedAdamW's stats are GradStats's, bit for bit, and they are the same
    // values: the multiplier is 1 / loss scale either way). When the SUM then clips after all,
    // step 2 runs those dry runs again with the real factor. Either way the step's results
    // are the same bits; the bet only saves the statistics' own pass over the gradients.
    const bool bet = !last_step_clipped_ && hyper.size() == static_cast<size_t>(num_groups_);
    absl::Status stats_status;
    for (size_t i = 0; i < shards.size() && stats_status.ok(); ++i) {
      ShardState& s = *shards[i];
      if (is_replica[i]) continue;
      casts[i] = FragmentCasts(s);
      stats_status = EnsureStepBuffers(s, casts[i]);
      if (!stats_status.ok()) break;
      const float unscale = static_cast<float>(1.0 / loss_scales[i]);
      for (FragmentCast& c : casts[i]) {
        // The kernels write the statistics to the fragment's slot; they are summed below, in
        // this same order, once the device has run them.
        auto* sum_squares = SlotAt<double>(s.scalars, c.slot + kSlotSumSquares);
        auto* nonfinite = SlotAt<int64_t>(s.scalars, c.slot + kSlotNonfinite);
        const LayoutTensor& tensor = layout.tensors[static_cast<size_t>(c.f->tensor)];
        const Format format = layout.buckets[static_cast<size_t>(s.bucket)].format;
        if (bet && NeedsAmaxBeforeCast(format, c.frag, adamw)) {
          kernels::StepOutputs out;
          out.amax = AmaxSlots(s, c);
          out.grad_sum_squares = sum_squares;
          out.grad_nonfinite = nonfinite;
          out.dry_run = true;
          stats_status = UpdateFragment(device, format, model, c.frag, GradAt(grads[i], c.offset),
                                        StateAt(s.master, s.m, s.v, c.offset, opt), opt,
                                        hyper[static_cast<size_t>(tensor.param_group)], step, unscale, out);
          c.probed = true;
        } else {
          stats_status =
              kernels::GradStats(device, GradAt(grads[i], c.offset), c.frag.size(), unscale, sum_squares, nonfinite);
        }
        if (!stats_status.ok()) break;
      }
    }
    if (stats_status.ok()) stats_status = options_.memory->Synchronize();
    for (size_t i = 0; i < shards.size() && stats_status.ok(); ++i) {
      ShardState& s = *shards[i];
      if (is_replica[i]) continue;
      for (FragmentCast& c : casts[i]) {
        partial[0] += *SlotAt<double>(s.scalars, c.slot + kSlotSumSquares);
        partial[1] += static_cast<double>(*SlotAt<int64_t>(s.scalars, c.slot + kSlotNonfinite));
        if (c.probed) TakeAmaxes(s, c);
      }
    }
    if (forwarder.joinable()) forwarder.join();  // every forward lands before this daemon's SUM
    stats.set_forwarded_bytes(forwarded_bytes);
    MAINSTAY_RETURN_IF_ERROR(stats_status);
    MAINSTAY_RETURN_IF_ERROR(forwarded);
    phases.set_grad_stats_ms(MsSince(t));
    MAINSTAY_ASSIGN_OR_RETURN(new_group, EnsureGroup(members, epoch, deadline));
    t = absl::Now();
    // Decides the step when it finds a non-finite gradient (the step is then skipped).
    auto reduce_stats = [&] {
      return RunReduction(
          step, 0, [&] { return group_->AllReduceSum(std::span<double>(partial, 2), deadline); },
          [&](v1::StepDecision* d) {
            if (!(partial[1] > 0.0)) return false;
            d->add_stats_sums(partial[0]);
            d->add_stats_sums(partial[1]);
            d->set_skipped(true);
            return true;
          });
    };
    absl::Status reduced_stats = reduce_stats();
    absl::StatusOr<v1::StepDecision> decision;  // when the reduction failed here: the peers' decision
    if (!reduced_stats.ok()) decision = LearnDecision(step, members, reduced_stats);
    if (!reduced_stats.ok() && decision.status() == reduced_stats && !new_group && MovedOn(epoch)) {
      // The peers left the group for a newer placement, which moves this daemon's shards away
      // (a fence): this attempt cannot meet them again. Its pushes go with the copy.
      return absl::AbortedError(absl::StrCat("the peers left placement epoch ", epoch,
                                             " for a newer one, which moves this daemon's shards (",
                                             reduced_stats.message(), ")"));
    }
    if (!reduced_stats.ok() && decision.status() == reduced_stats && !new_group) {
      // The group was built at an earlier step and a peer has left it since (its reduction of
      // the previous step failed and it learned the decision from us). Nobody decided anything
      // of this step, so build the group the peers now meet in and reduce again, once, rather
      // than fail the step back to the trainers.
      Log(LogLevel::kInfo, "daemon",
          absl::StrCat("job ", job_id_, ": step ", step, ": the peer group broke since the last step (",
                       reduced_stats.message(), "); joining the peers' new one"));
      MAINSTAY_ASSIGN_OR_RETURN(new_group, EnsureGroup(members, epoch, deadline));
      reduced_stats = reduce_stats();
      if (!reduced_stats.ok()) decision = LearnDecision(step, members, reduced_stats);
    }
    if (!reduced_stats.ok()) {
      MAINSTAY_ASSIGN_OR_RETURN(learned, std::move(decision));
      if (learned->stats_sums_size() != 2) {
        return absl::InternalError(absl::StrCat("the decision of step ", step, " learned from a peer has ",
                                                learned->stats_sums_size(), " stats sums, not 2"));
      }
      partial[0] = learned->stats_sums(0);
      partial[1] = learned->stats_sums(1);
      if (learned->skipped()) {
        absl::MutexLock lock(&mu_);
        decisions_[step] = *learned;  // so that other daemons in doubt can learn it here too
      }
    }
    phases.set_reduce_stats_ms(MsSince(t));
    const double norm = std::sqrt(partial[0]);
    stats.set_grad_norm(norm);
    stats.set_nonfinite_count(static_cast<int64_t>(partial[1]));
    if (partial[1] > 0.0) {
      result.skipped = true;
      loss_scale_.Update(/*overflow=*/true);
      stats.set_loss_scale(loss_scale_.scale);
      return result;
    }
    // Every primary forwarded its inputs of this attempt before its SUM, so they are here now.
    MAINSTAY_ASSIGN_OR_RETURN(replica_in, TakeReplicaInputs(step, epoch, replica_keys, deadline));
    for (size_t i = 0; i < shards.size(); ++i) {
      if (!is_replica[i]) continue;
      ReplicaInput& in = replica_in.at({shards[i]->bucket, shards[i]->shard});
      if (options_.faults.Is(StepFault::Kind::kDropReplicaInput, step)) {
        std::fill(in.data.begin(), in.data.end(), uint8_t{0});
        Log(LogLevel::kWarning, "daemon", absl::StrCat("job ", job_id_, ": injected fault: the replica of ",
                                                       ShardName(shards[i]->bucket, shards[i]->shard), " drops its "
                                                       "input of step ", step, " (--inject-fault)"));
      }
      MAINSTAY_ASSIGN_OR_RETURN(grads[i], StageGradient(*shards[i], {in.data.data(), in.dtype}));
      loss_scales[i] = in.loss_scale;
    }
    double clip = 1.0;
    if (opt.max_grad_norm > 0.0f) {
      const double c = static_cast<double>(opt.max_grad_norm) / (norm + 1e-6);
      if (c < 1.0) clip = c;
    }
    stats.set_clip_factor(clip);
    last_step_clipped_ = clip != 1.0;
    if (clip != 1.0) {
      for (std::vector<FragmentCast>& shard_casts : casts) {
        for (FragmentCast& c : shard_casts) c.probed = false;  // lost the bet: probe again
      }
    }
    // One rounding from the exact factor: (clip / loss scale) in double, then to FP32.
    for (size_t i = 0; i < shards.size(); ++i) multipliers[i] = static_cast<float>(clip / loss_scales[i]);
  } else if (!restoring) {
    MAINSTAY_ASSIGN_OR_RETURN(replica_in, TakeReplicaInputs(step, epoch, replica_keys, deadline));
  }
  // A daemon holding only replicas has no FinishStep calls: the primaries forwarded the step's
  // hyperparameters. Every value any input carried goes into the MAX check below.
  std::vector<const StepHyper*> hypers;
  if (step >= 0) {
    if (!inputs.finished.empty()) hypers.push_back(&hyper);
    for (const auto& [key, in] : replica_in) hypers.push_back(&in.hyper);
    if (inputs.finished.empty() && !hypers.empty()) hyper = *hypers.front();
    for (const StepHyper* h : hypers) {
      if (h->size() != static_cast<size_t>(num_groups_)) {
        return absl::InternalError(absl::StrCat("step ", step, " has hyperparameters for ", h->size(),
                                                " param groups, job ", job_id_, " has ", num_groups_));
      }
    }
    if (hyper.empty()) {
      return absl::InternalError(absl::StrCat("step ", step, " of job ", job_id_, " runs without hyperparameters"));
    }
    stats.set_lr(hyper[0].lr);
    stats.set_weight_decay(hyper[0].weight_decay);
    StepHyperToProto(hyper, stats.mutable_groups());
  }

  // 2. The amaxes the new version's casts need before they can run (version 0: of the initial
  // values, built in the scratch buffers). A step writes no state here: formats whose scales
  // depend on the new values' amax (fp8 current and delayed, nvfp4, fp8_block, mxfp8 with
  // blocks that straddle fragments) get a dry run of the update (StepOutputs::dry_run); the
  // update itself runs in place once the step is decided (ApplyStep).
  t = absl::Now();
  // The plan's amaxes, then per param group [lr, -lr, weight_decay, -weight_decay]: after the
  // MAX, the pairs tell whether every daemon's ranks sent the same hyperparameters
  // (max == -max(-x)). Step -1 and restores carry zeros.
  const size_t hyper_at = static_cast<size_t>(plan_.size());
  std::vector<float> reduced(hyper_at + 4 * static_cast<size_t>(num_groups_), 0.0f);
  for (size_t g = 0; g < static_cast<size_t>(num_groups_); ++g) {
    float* r = &reduced[hyper_at + 4 * g];
    std::fill(r, r + 4, hypers.empty() ? 0.0f : -std::numeric_limits<float>::infinity());
    for (const StepHyper* h : hypers) {
      const float lr = static_cast<float>((*h)[g].lr), wd = static_cast<float>((*h)[g].weight_decay);
      r[0] = std::max(r[0], lr);
      r[1] = std::max(r[1], -lr);
      r[2] = std::max(r[2], wd);
      r[3] = std::max(r[3], -wd);
    }
  }
  std::vector<std::vector<char>> amax_written(shards.size());  // per shard, per fragment
  for (size_t i = 0; i < shards.size(); ++i) {
    ShardState& s = *shards[i];
    const Bucket& bucket = layout.buckets[static_cast<size_t>(s.bucket)];
    const int64_t n = s.numel;
    if (restoring) {
      // LoadRestore read the state into the scratch buffers.
    } else if (step < 0) {
      const std::vector<uint8_t>& initial = is_replica[i]
                                                ? replica_in.at({s.bucket, s.shard}).data
                                                : inputs.shards.at({s.bucket, s.shard}).by_rank.begin()->second;
      if (s.scratch_master.size() != static_cast<size_t>(n)) {
        MAINSTAY_RETURN_IF_ERROR(s.scratch_master.Reset(*options_.memory, n));
      }
      std::memcpy(s.scratch_master.data(), initial.data(), static_cast<size_t>(n) * 4);
      MAINSTAY_RETURN_IF_ERROR(ZeroFilled(*options_.memory, s.scratch_m, n * moment_bytes));
      MAINSTAY_RETURN_IF_ERROR(ZeroFilled(*options_.memory, s.scratch_v, adamw ? n * moment_bytes : 0));
    }
    if (casts[i].empty()) casts[i] = FragmentCasts(s);  // step 1 built the primaries' casts
    MAINSTAY_RETURN_IF_ERROR(EnsureStepBuffers(s, casts[i]));
    amax_written[i].assign(casts[i].size(), 0);
    for (size_t k = 0; k < casts[i].size(); ++k) {
      const FragmentCast& c = casts[i][k];
      const LayoutTensor& tensor = layout.tensors[static_cast<size_t>(c.f->tensor)];
      const kernels::Fragment& frag = c.frag;
      if (step < 0) {
        const float* master = s.scratch_master.data() + c.offset;
        MAINSTAY_RETURN_IF_ERROR(kernels::ComputePartialAmax(
            device, bucket.format, model, frag, std::span<const float>(master, static_cast<size_t>(frag.size())),
            AmaxSlots(s, c)));
        amax_written[i][k] = 1;
      } else if (!c.probed && NeedsAmaxBeforeCast(bucket.format, frag, adamw) &&
                 !(is_replica[i] && TensorScaleOnly(bucket.format))) {
        kernels::StepOutputs out;
        out.amax = AmaxSlots(s, c);
        out.dry_run = true;
        MAINSTAY_RETURN_IF_ERROR(UpdateFragment(device, bucket.format, model, frag, GradAt(grads[i], c.offset),
                                                StateAt(s.master, s.m, s.v, c.offset, opt), opt,
                                                hyper[static_cast<size_t>(tensor.param_group)], step, multipliers[i],
                                                out));
        amax_written[i][k] = 1;
      }
    }
  }
  MAINSTAY_RETURN_IF_ERROR(options_.memory->Synchronize());
  for (size_t i = 0; i < shards.size(); ++i) {
    for (size_t k = 0; k < casts[i].size(); ++k) {
      FragmentCast& c = casts[i][k];
      if (amax_written[i][k]) TakeAmaxes(*shards[i], c);
      float& r = reduced[static_cast<size_t>(c.f->tensor)];
      r = std::max(r, c.tensor_amax);
      plan_.Contribute(c.f->tensor, c.blocks, c.block_amax, std::span<float>(reduced));
    }
  }
  phases.set_update_ms(MsSince(t));

  // 3. Amaxes whose scale spans fragments (and so possibly daemons): peer MAX.
  t = absl::Now();
  auto decide = [&](v1::StepDecision* d) {
    if (step >= 0) {
      d->add_stats_sums(partial[0]);
      d->add_stats_sums(partial[1]);
    }
    d->mutable_reduced_max()->Assign(reduced.begin(), reduced.end());
    return true;
  };
  if (step < 0) {
    MAINSTAY_ASSIGN_OR_RETURN(new_group, EnsureGroup(members, epoch, deadline));
  }
  if (!learned.has_value()) {
    const absl::Status reduced_amax = RunReduction(
        step, 1, [&] { return group_->AllReduceMax(std::span<float>(reduced), deadline); }, decide);
    if (!reduced_amax.ok()) {
      MAINSTAY_ASSIGN_OR_RETURN(learned, LearnDecision(step, members, reduced_amax));
    }
  }
  if (learned.has_value()) {
    if (learned->skipped() || learned->reduced_max_size() != static_cast<int>(reduced.size())) {
      return absl::InternalError(absl::StrCat("the decision of step ", step, " learned from a peer has ",
                                              learned->reduced_max_size(), " reduced values, this daemon expects ",
                                              reduced.size()));
    }
    std::copy(learned->reduced_max().begin(), learned->reduced_max().end(), reduced.begin());
    absl::MutexLock lock(&mu_);
    decisions_[step] = *learned;  // so that other daemons in doubt can learn it here too
  }
  phases.set_reduce_amax_ms(MsSince(t));
  for (size_t g = 0; g < static_cast<size_t>(num_groups_); ++g) {
    const float* r = &reduced[hyper_at + 4 * g];
    if (r[0] != -r[1] || r[2] != -r[3]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the ranks sent different hyperparameters for step ", step,
          num_groups_ > 1 ? absl::StrCat(" (param group ", g, ")") : "", ": lr from ", -r[1], " to ", r[0],
          ", weight_decay from ", -r[3], " to ", r[2], " across daemons"));
    }
  }
  // The casts' scales, from the reduced amaxes (and, for delayed scaling, the history as it
  // stands before this step records its amax).
  for (size_t i = 0; i < shards.size(); ++i) {
    for (FragmentCast& c : casts[i]) {
      plan_.Apply(c.f->tensor, c.blocks, std::span<float>(c.block_amax), std::span<const float>(reduced));
      c.tensor_amax = reduced[static_cast<size_t>(c.f->tensor)];
      // A restore republishes the saved version with the scale it was cast with.
      c.tensor_scale = restoring ? cast_scale_[static_cast<size_t>(c.f->tensor)]
                                 : delayed_[static_cast<size_t>(c.f->tensor)].scale;
    }
  }

  // 4. Version 0 and restores: quantize the scratch state into the new version now. A step
  // hands its update to ApplyStep, which runs once the step is decided everywhere it must be.
  t = absl::Now();
  if (step >= 0 && !restoring) {
    StepUpdate& u = result.update.emplace(StepUpdate{});  // clang: no emplace() of it inside Job
    u.grads = std::move(grads);
    u.multipliers = std::move(multipliers);
    u.hyper = hyper;
    u.replica_in = std::move(replica_in);  // the replicas' gradient views point into these (unstaged)
    // The new versions' memory, now: the apply allocates nothing.
    for (size_t i = 0; i < shards.size(); ++i) u.snapshots.push_back(NewSnapshot(*shards[i], casts[i], step + 1));
    u.casts = std::move(casts);
  } else {
    for (size_t i = 0; i < shards.size(); ++i) {
      std::shared_ptr<QuantizedShard> snap =
          NewSnapshot(*shards[i], casts[i], restoring ? inputs.publish_version : step + 1);
      const absl::Status cast = CastShard(*shards[i], casts[i], *snap, /*update=*/nullptr, 0);
      if (!cast.ok() && !restoring && job_.spec.replication_factor > 1 && members.size() > 1) {
        // Version 0 is decided (the MAX above): the peers publish it and, with replicas, wait
        // for this daemon to hold it. As for a step's apply (ApplyStep), better no daemon (its
        // replicas take over) than one that can neither publish nor give the decision up.
        // (Without replicas nobody waits: the attempt fails, and the next one learns the
        // decision from the peers and casts again.)
        Log(LogLevel::kError, "daemon",
            absl::StrCat("job ", job_id_, ": version 0 was decided but its cast of ",
                         ShardName(shards[i]->bucket, shards[i]->shard), " failed (", cast.ToString(), "); aborting"));
        std::abort();
      }
      MAINSTAY_RETURN_IF_ERROR(cast);
      result.published.push_back(std::move(snap));
    }
  }
  phases.set_quantize_ms(MsSince(t));

  // 5. Nothing can fail from here: advance the scaling state the next step will use.
  for (size_t ti = 0; ti < layout.tensors.size(); ++ti) {
    const Format format = layout.tensors[ti].format;
    if (Describe(format).scaling == ScalingMode::kDelayed && !restoring) {
      cast_scale_[ti] = delayed_[ti].scale;
      delayed_[ti].Record(reduced[ti], Fp8Max(format), job_.recipe.fp8_amax_compute_algo, job_.recipe.fp8_margin);
    }
    stats.add_tensor_amax(reduced[ti]);
  }
  if (step >= 0) loss_scale_.Update(/*overflow=*/false);
  stats.set_loss_scale(loss_scale_.scale);
  return result;
}

std::vector<Job::FragmentCast> Job::FragmentCasts(const ShardState& s) const {
  const Layout& layout = job_.layout;
  const Bucket& bucket = layout.buckets[static_cast<size_t>(s.bucket)];
  const Shard& shard = bucket.shards[static_cast<size_t>(s.shard)];
  std::vector<FragmentCast> casts;
  for (const TensorFragment& f : shard.fragments) {
    FragmentCast c;
    c.f = &f;
    c.frag = kernels::Fragment{View2D(layout.tensors[static_cast<size_t>(f.tensor)].shape), f.elements};
    c.offset = f.bucket_offset - shard.elements.begin;
    c.blocks = FragmentScaleBlocks(layout, f);
    c.block_amax.assign(static_cast<size_t>(c.blocks.size()), 0.0f);
    c.slot = casts.empty() ? 0 : casts.back().slot + SlotBytes(casts.back().blocks);
    casts.push_back(std::move(c));
  }
  return casts;
}

absl::Status Job::EnsureStepBuffers(ShardState& s, const std::vector<FragmentCast>& casts) {
  kernels::StateMemory& memory = *options_.memory;
  const int64_t scalar_bytes = casts.empty() ? 0 : casts.back().slot + SlotBytes(casts.back().blocks);
  if (s.scalars.size() != static_cast<size_t>(scalar_bytes)) {
    MAINSTAY_RETURN_IF_ERROR(s.scalars.Reset(memory, scalar_bytes));
  }
  if (!memory.staged()) return absl::OkStatus();
  const Bucket& bucket = job_.layout.buckets[static_cast<size_t>(s.bucket)];
  const FormatDescriptor& d = Describe(bucket.format);
  int64_t num_scales = 0;
  for (const FragmentCast& c : casts) num_scales += c.blocks.size();
  const int64_t cast_bytes =
      DataBytes(bucket.format, s.numel) + (d.has_block_scales() ? num_scales * (BitsOf(d.block_scale) / 8) : 0);
  if (s.cast_stage.size() != static_cast<size_t>(cast_bytes)) {
    s.cast_output->Invalidate();
    MAINSTAY_RETURN_IF_ERROR(s.cast_stage.Reset(memory, cast_bytes));
  }
  return absl::OkStatus();
}

kernels::AmaxOutputs Job::AmaxSlots(ShardState& s, const FragmentCast& c) {
  return {SlotAt<float>(s.scalars, c.slot + kSlotAmax),
          std::span<float>(SlotAt<float>(s.scalars, c.slot + kSlotBlocks), static_cast<size_t>(c.blocks.size()))};
}

void Job::TakeAmaxes(const ShardState& s, FragmentCast& c) {
  c.tensor_amax = *SlotAt<float>(s.scalars, c.slot + kSlotAmax);
  const float* blocks = SlotAt<float>(s.scalars, c.slot + kSlotBlocks);
  std::copy(blocks, blocks + c.blocks.size(), c.block_amax.begin());
}

absl::StatusOr<kernels::GradView> Job::StageGradient(ShardState& s, kernels::GradView grad) {
  kernels::StateMemory& memory = *options_.memory;
  if (!memory.staged()) return grad;
  const int64_t bytes = s.numel * ElementBytes(grad.type);
  if (s.grad_stage.size() < static_cast<size_t>(bytes)) {
    MAINSTAY_RETURN_IF_ERROR(s.grad_stage.Reset(memory, s.numel * 4));
  }
  MAINSTAY_RETURN_IF_ERROR(memory.Copy(s.grad_stage.data(), grad.data, bytes));
  return kernels::GradView{s.grad_stage.data(), grad.type};
}

std::shared_ptr<QuantizedShard> Job::NewSnapshot(ShardState& s, const std::vector<FragmentCast>& casts,
                                                 int64_t version) {
  const Bucket& bucket = job_.layout.buckets[static_cast<size_t>(s.bucket)];
  const FormatDescriptor& d = Describe(bucket.format);
  auto snap = std::make_shared<QuantizedShard>();
  snap->version = version;
  snap->bucket = s.bucket;
  snap->shard = s.shard;
  snap->format = bucket.format;
  snap->elements = bucket.shards[static_cast<size_t>(s.shard)].elements;
  const size_t data_bytes = static_cast<size_t>(DataBytes(bucket.format, s.numel));
  snap->data = std::move(s.spare_data);  // an evicted version's buffer, or empty
  s.spare_data.clear();
  // A buffer of this shard's size is an evicted version of this shard: the cast writes every
  // fragment's bytes again, and the padding between and after them is still the zeros it was
  // allocated with (nothing writes there), so it is not zeroed again (a pass over the whole
  // shard every step). Any other buffer starts as zeros.
  if (snap->data.size() != data_bytes) snap->data.assign(data_bytes, 0);
  snap->has_scales = d.has_block_scales();
  snap->scale_type = d.block_scale;
  const int scale_bytes = d.has_block_scales() ? BitsOf(d.block_scale) / 8 : 0;
  for (const FragmentCast& c : casts) snap->num_scales += c.blocks.size();
  snap->scales.assign(static_cast<size_t>(snap->num_scales * scale_bytes), 0);
  return snap;
}

absl::Status Job::CastShard(ShardState& s, const std::vector<FragmentCast>& casts, QuantizedShard& snapshot,
                            const StepUpdate* update, size_t i) {
  const Layout& layout = job_.layout;
  const OptimizerSpec& opt = job_.spec.optimizer;
  const Format model = job_.recipe.model_dtype;
  const kernels::Device& device = options_.memory->device();
  const Bucket& bucket = layout.buckets[static_cast<size_t>(s.bucket)];
  const Shard& shard = bucket.shards[static_cast<size_t>(s.shard)];
  const FormatDescriptor& d = Describe(bucket.format);
  const bool adamw = opt.type == OptimizerType::kAdamW;
  const int scale_bytes = d.has_block_scales() ? BitsOf(d.block_scale) / 8 : 0;
  float* masters = update != nullptr ? s.master.data() : s.scratch_master.data();
  // On staged memory the kernels cast into s.cast_stage (data, then scales), copied out below.
  kernels::StateMemory& memory = *options_.memory;
  uint8_t* data_out = memory.staged() ? s.cast_stage.data() : snapshot.data.data();
  uint8_t* scales_out = memory.staged() ? s.cast_stage.data() + snapshot.data.size() : snapshot.scales.data();
  // No cuda_ipc pull reads the cast output while it is written.
  if (memory.staged()) s.cast_output->Invalidate();
  const bool pow2_scales = kernels::ScaleInputs{}.pow2_scales;  // the recipes' (fp8 current: no)
  int64_t scale_offset = 0;
  for (const FragmentCast& c : casts) {
    const kernels::Fragment& frag = c.frag;
    kernels::ScaleInputs in;
    in.pow2_scales = pow2_scales;
    in.tensor_scale = c.tensor_scale;
    in.tensor_amax = c.tensor_amax;
    // The reduced block amaxes, where the kernels read them.
    float* block_amax = SlotAt<float>(s.scalars, c.slot + kSlotBlocks);
    std::copy(c.block_amax.begin(), c.block_amax.end(), block_amax);
    in.block_amax = std::span<const float>(block_amax, c.block_amax.size());
    const IndexRange bytes = FragmentShardByteRange(bucket, shard, *c.f);
    float* scale_inv = SlotAt<float>(s.scalars, c.slot + kSlotScaleInv);
    *scale_inv = 0.0f;
    kernels::QuantizedOutputs out;
    out.data = std::span<uint8_t>(data_out + bytes.begin, static_cast<size_t>(bytes.size()));
    out.block_scales =
        std::span<uint8_t>(scales_out + scale_offset * scale_bytes, static_cast<size_t>(c.blocks.size() * scale_bytes));
    out.tensor_scale_inv = d.tensor_scale ? scale_inv : nullptr;
    const std::span<const float> master(masters + c.offset, static_cast<size_t>(frag.size()));
    bool cast = false;  // done in the update's pass
    if (update != nullptr) {
      const int64_t step = snapshot.version - 1;
      const kernels::GradView g = GradAt(update->grads[i], c.offset);
      const kernels::OptimizerState state = StateAt(s.master, s.m, s.v, c.offset, opt);
      const float multiplier = update->multipliers[i];
      const GroupHyper& h = update->hyper[static_cast<size_t>(layout.tensors[static_cast<size_t>(c.f->tensor)].param_group)];
      if (adamw && kernels::CastsInAdamWPass(bucket.format, frag)) {
        MAINSTAY_RETURN_IF_ERROR(kernels::FusedAdamWQuantize(device, bucket.format, model, frag, g, state,
                                                             AdamWHyperOf(opt, h, step, multiplier), in,
                                                             kernels::StepOutputs{}, out));
        cast = true;
      } else {
        MAINSTAY_RETURN_IF_ERROR(
            UpdateFragment(device, bucket.format, model, frag, g, state, opt, h, step, multiplier, kernels::StepOutputs{}));
      }
    }
    if (!cast) MAINSTAY_RETURN_IF_ERROR(kernels::Quantize(device, bucket.format, model, frag, master, in, out));
    scale_offset += c.blocks.size();
  }
  if (memory.staged()) {
    MAINSTAY_RETURN_IF_ERROR(memory.Copy(snapshot.data.data(), data_out, static_cast<int64_t>(snapshot.data.size())));
    MAINSTAY_RETURN_IF_ERROR(
        memory.Copy(snapshot.scales.data(), scales_out, static_cast<int64_t>(snapshot.scales.size())));
  }
  MAINSTAY_RETURN_IF_ERROR(memory.Synchronize());
  if (memory.staged()) {
    // The version's data stays in cast_stage until the next cast: cuda_ipc pulls copy it from there.
    snapshot.device_cast = CastOutput::NextCast();
    s.cast_output->Publish(snapshot.device_cast, s.cast_stage.data());
    snapshot.device = s.cast_output;
  }
  for (const FragmentCast& c : casts) {
    FragmentMeta meta;
    meta.tensor = c.f->tensor;
    meta.elements = c.f->elements;
    meta.format = bucket.format;
    if (d.scaling == ScalingMode::kDelayed) {
      meta.scale = c.tensor_scale;
    } else if (d.scaling == ScalingMode::kCurrent) {
      meta.scale = kernels::CurrentScalingScale(c.tensor_amax, Fp8Max(bucket.format), pow2_scales);
    } else if (bucket.format == Format::kNVFP4) {
      meta.scale = kernels::Nvfp4GlobalEncodeScale(c.tensor_amax);
    }
    meta.scale_inv = *SlotAt<float>(s.scalars, c.slot + kSlotScaleInv);
    meta.amax = HasTensorAmax(bucket.format) ? c.tensor_amax : 0.0f;
    snapshot.fragments.push_back(meta);
  }
  return absl::OkStatus();
}

void Job::ApplyStep(int64_t step, StepResult& result, const std::vector<std::shared_ptr<ShardState>>& shards,
                    const std::vector<char>& is_replica) {
  const absl::Time t = absl::Now();
  StepUpdate& update = *result.update;
  for (size_t i = 0; i < shards.size(); ++i) {
    const absl::Status cast = CastShard(*shards[i], update.casts[i], *update.snapshots[i], &update, i);
    if (!cast.ok()) {
      // The same fragments and buffers passed the decision's dry run: a failure here is a bug,
      // and the shards may be half updated. Better no daemon (its replicas or checkpoint take
      // over) than a torn shard.
      Log(LogLevel::kError, "daemon",
          absl::StrCat("job ", job_id_, ": step ", step, " was decided but its update of ",
                       ShardName(shards[i]->bucket, shards[i]->shard), " failed (", cast.ToString(),
                       "); aborting rather than keep a half-updated shard"));
      std::abort();
    }
    result.published.push_back(std::move(update.snapshots[i]));
    if (i == 0 && shards.size() > 1 && options_.faults.armed()) {
      const bool primary = std::count(is_replica.begin(), is_replica.end(), 0) > 0;
      const bool replica = std::count(is_replica.begin(), is_replica.end(), 1) > 0;
      CrashIfInjected(StepFault::Phase::kUpdate, step, primary, replica,
                      [&] { return absl::StrCat("with 1 of its ", shards.size(), " shards updated by step ", step); });
    }
  }
  for (auto& [key, in] : update.replica_in) result.spent.push_back(std::move(in.data));
  result.update.reset();  // the replicas' inputs are no longer needed
  result.stats.mutable_phases()->set_quantize_ms(MsSince(t));
}

void Job::TouchNewShards() {
  std::vector<std::shared_ptr<ShardState>> shards;
  shards.swap(shards_to_touch_);
  mu_.Unlock();
  const OptimizerSpec& opt = job_.spec.optimizer;
  const auto moment_bytes = static_cast<size_t>(ElementBytes(opt.moment_dtype));
  const bool adamw = opt.type == OptimizerType::kAdamW;
  std::vector<std::vector<uint8_t>> pushes;
  const absl::Time t0 = absl::Now();
  for (const std::shared_ptr<ShardState>& s : shards) {
    // The step thread's own buffers (version 0 builds the state in them: job_step.cc), still
    // empty unless something already filled them.
    if (s->initialized || !s->scratch_master.empty()) continue;
    const auto n = static_cast<size_t>(s->numel);
    const Format format = job_.layout.buckets[static_cast<size_t>(s->bucket)].format;
    kernels::StateMemory& memory = *options_.memory;
    absl::Status touched = s->scratch_master.Reset(memory, s->numel);
    if (touched.ok()) touched = s->scratch_m.Reset(memory, s->numel * static_cast<int64_t>(moment_bytes));
    if (touched.ok()) touched = s->scratch_v.Reset(memory, adamw ? s->numel * static_cast<int64_t>(moment_bytes) : 0);
    if (touched.ok()) touched = EnsureStepBuffers(*s, FragmentCasts(*s));
    if (touched.ok() && memory.staged()) touched = s->grad_stage.Reset(memory, s->numel * 4);
    if (!touched.ok()) {
      // Version 0 allocates them again, and fails the step if they still do not fit.
      Log(LogLevel::kWarning, "daemon", absl::StrCat("job ", job_id_, ": ", touched.ToString()));
      s->scratch_master.clear();
      continue;
    }
    s->spare_data.assign(static_cast<size_t>(DataBytes(format, s->numel)), 0);
    pushes.emplace_back(n * 4, 0);  // the initial parameters' or a first FP32 gradient's landing
  }
  if (!pushes.empty()) {
    Log(LogLevel::kInfo, "daemon",
        absl::StrCat("job ", job_id_, ": touched the buffers of ", pushes.size(), " new shard(s) in ",
                     absl::ToInt64Milliseconds(absl::Now() - t0), " ms"));
  }
  mu_.Lock();
  for (std::vector<uint8_t>& p : pushes) spare_buffers_.push_back(std::move(p));
}

void Job::RunSteps() {
  mu_.Lock();
  while (true) {
    Changed();  // what the previous round decided (a step, a restore, a move)
    mu_.Await(absl::Condition(this, &Job::ShouldWake));
    if (stopping_) break;
    if (restore_ != nullptr) {
      RunRestore();
      continue;
    }
    if (!moves_in_.empty()) {
      RunMovesIn();
      continue;
    }
    if (!shards_to_touch_.empty()) {
      TouchNewShards();
      continue;
    }
    const int64_t step = next_step_;
    StepInputs inputs = std::move(pending_[step]);
    pending_.erase(step);
    executing_step_ = step;
    executing_epoch_ = epoch_;
    executing_hyper_.reset();
    if (!inputs.finished.empty()) executing_hyper_ = inputs.finished.begin()->second;
    executing_keys_.clear();
    for (const auto& [key, in] : inputs.shards) {
      for (const auto& [rank, data] : in.by_rank) executing_keys_.insert({key.first, key.second, rank});
    }
    std::vector<std::shared_ptr<ShardState>> shards;
    for (const auto& [key, state] : shards_) shards.push_back(state);
    const std::vector<char> is_replica = RolesLocked(shards);
    const std::vector<std::string> members = members_;
    const int64_t epoch = epoch_;
    std::map<Key, std::vector<v1::DaemonEndpoint>> replicas_of;  // of this daemon's primaries
    for (const auto& [key, ids] : replicas_) {
      auto owned = shards_.find(key);
      if (owned == shards_.end() || owned->second->replica) continue;
      for (const std::string& id : ids) {
        v1::DaemonEndpoint e;
        if (auto it = endpoints_.find(id); it != endpoints_.end()) e = it->second;
        e.set_daemon_id(id);
        replicas_of[key].push_back(std::move(e));
      }
    }
    const int64_t now_ms = options_.clock->NowUnixMs();
    const double wait_ms = static_cast<double>(now_ms - inputs.first_push_ms);
    mu_.Unlock();

    absl::StatusOr<StepResult> result = ExecuteStep(step, inputs, shards, is_replica, members, epoch, replicas_of);
    if (!result.ok()) {
      BreakGroup();  // a failed collective leaves the group unusable
      // A failed attempt may have left kernels running on the GPU; the next one (or a move)
      // writes the buffers they read only after them. Their own error was reported already.
      (void)options_.memory->Synchronize();
    }
    if (result.ok() && job_.spec.replication_factor > 1) {
      // Decided: but it is committed and acknowledged only once every replica holds the decision
      // (version 0 too: a replica that gave it up would wait for initial values for ever).
      if (absl::Status held = ConfirmDecisionHeld(step, members); !held.ok()) result = held;
    }
    if (result.ok() && result->update.has_value()) {
      // A move's copy still streaming this state (a move called off while it streamed:
      // CopyForMove) ends first; a job stopping meanwhile leaves the state as it is.
      absl::MutexLock lock(&mu_);
      auto no_copies = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_ || copies_out_ == 0; };
      mu_.Await(absl::Condition(&no_copies));
      if (copies_out_ > 0) {
        result = absl::UnavailableError(absl::StrCat("job ", job_id_, " stopped on this daemon"));
      } else {
        applying_ = true;  // nothing can fail from here: the state is updated in place
      }
    }
    if (result.ok() && result->update.has_value()) ApplyStep(step, *result, shards, is_replica);

    mu_.Lock();
    applying_ = false;
    executing_step_ = -2;
    executing_keys_.clear();
    if (!result.ok() && fence_epoch_ > epoch && result.status().code() != absl::StatusCode::kInvalidArgument) {
      // A move fenced this daemon while the attempt ran, and the attempt failed (no peer decided
      // it): its pushes stay, for the move's copy to carry (job_move.cc). The trainers' FinishStep
      // calls get the fence's error and go to the new owners; nothing is pushed again.
      decisions_.erase(step);
      StepInputs& back = pending_[step];
      for (auto& [key, in] : inputs.shards) {
        for (auto& [rank, data] : in.by_rank) {
          back.shards[key].Add(rank, in.num_contributors, in.dtype, in.loss_scale, std::move(data));
        }
      }
      back.finished.insert(inputs.finished.begin(), inputs.finished.end());
      if (back.first_push_ms == 0) back.first_push_ms = inputs.first_push_ms;
      Log(LogLevel::kInfo, "daemon",
          absl::StrCat("job ", job_id_, ": step ", step, " did not complete at placement epoch ", epoch,
                       " before the move to epoch ", fence_epoch_, " (", result.status().message(),
                       "); its pushes go to the shards' new owners"));
      continue;
    }
    if (!result.ok()) {
      // Every daemon fails this attempt alike (the decision, if any, was deterministic), so the
      // next attempt must not be answered with this one's results.
      decisions_.erase(step);
      Log(LogLevel::kWarning, "daemon",
          absl::StrCat("job ", job_id_, ": step ", step, " failed and changed nothing: ", result.status().ToString()));
      // INVALID_ARGUMENT (the trainers disagree) stays what it is; anything else is ABORTED:
      // the trainers push the step again.
      const std::string message = absl::StrCat("step ", step, " of job ", job_id_,
                                               " failed on this daemon and changed nothing (",
                                               result.status().message(), "); push step ", step, " again");
      RecordFailureLocked(step, ErrorWithDetail(result.status().code() == absl::StatusCode::kInvalidArgument
                                                    ? absl::InvalidArgumentError(message)
                                                    : absl::AbortedError(message)));
      for (const auto& [key, in] : inputs.shards) {
        for (const auto& [rank, data] : in.by_rank) dropped_pushes_[step].insert({key, rank});
      }
      if (options_.metrics != nullptr) options_.metrics->StepFailed(job_id_);
      continue;
    }
    v1::StepStats& stats = result->stats;
    if (!result->skipped) {
      const std::set<int64_t> pinned = PinnedVersionsLocked();
      for (size_t i = 0; i < shards.size(); ++i) {
        shards[i]->Commit(result->published[i], options_.retained_versions, /*in_place=*/step >= 0, pinned);
      }
      version_ = step + 1;
    }
    if (step >= 0) committed_step_ = step;
    next_step_ = step + 1;
    replica_inputs_.erase(replica_inputs_.begin(), replica_inputs_.upper_bound(step));
    trainer_copies_.erase(trainer_copies_.begin(), trainer_copies_.upper_bound(step));
    rewound_ = false;
    // The step's input buffers serve the next step's pushes (as many as this step used).
    spare_buffers_.clear();
    for (auto& [key, in] : inputs.shards) {
      for (auto& [rank, data] : in.by_rank) spare_buffers_.push_back(std::move(data));
    }
    for (std::vector<uint8_t>& data : result->spent) spare_buffers_.push_back(std::move(data));
    committed_scaling_ = ScalingProto();
    failures_.erase(step);
    failed_attempts_.erase(failed_attempts_.begin(), failed_attempts_.upper_bound(step));
    dropped_pushes_.erase(dropped_pushes_.begin(), dropped_pushes_.upper_bound(step));
    loss_scale_now_ = loss_scale_.scale;
    const int64_t commit_ms = options_.clock->NowUnixMs();
    stats.set_version(version_);
    stats.set_skipped(result->skipped);
    stats.set_commit_unix_ms(commit_ms);
    stats.set_step_time_ms(commit_ms - inputs.first_push_ms);
    stats.mutable_phases()->set_wait_inputs_ms(wait_ms);
    if (options_.metrics != nullptr && step >= 0) options_.metrics->StepDecided(job_id_, stats);
    stats_[step] = std::move(stats);
    while (stats_.size() > 1000) stats_.erase(stats_.begin());
  }
  mu_.Unlock();
}

}  // namespace mainstay::daemon
