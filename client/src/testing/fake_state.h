// Internal state shared by the fake coordinator and the fake daemons (fake_services.h).
#ifndef MAINSTAY_CLIENT_SRC_TESTING_FAKE_STATE_H_
#define MAINSTAY_CLIENT_SRC_TESTING_FAKE_STATE_H_

#include "common/error_detail.h"
#include <grpcpp/grpcpp.h>

#include <cmath>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/src/testing/fake_services.h"
#include "common/layout.h"
#include "mainstay/v1/common.pb.h"

namespace mainstay::testing_fakes {

inline grpc::Status WithDetail(grpc::ServerContext* context, grpc::StatusCode code, const std::string& message,
                               const v1::ErrorDetail& detail) {
  context->AddTrailingMetadata(kErrorDetailMetadataKey, detail.SerializeAsString());
  return grpc::Status(code, message);
}

using GradKey = std::tuple<int64_t, int32_t, int32_t>;  // step, bucket, shard

struct FakeCluster::State {
  FakeClusterOptions options;
  std::string coordinator_address;
  std::vector<std::string> daemon_addresses;
  std::vector<std::unique_ptr<grpc::Service>> services;
  std::vector<std::unique_ptr<grpc::Server>> servers;

  mutable absl::Mutex mu;
  absl::CondVar changed;
  int unavailable_left ABSL_GUARDED_BY(mu) = 0;
  grpc::StatusCode unavailable_code ABSL_GUARDED_BY(mu) = grpc::StatusCode::UNAVAILABLE;
  int create_unavailable_left ABSL_GUARDED_BY(mu) = 0;
  std::string job_id ABSL_GUARDED_BY(mu), job_token ABSL_GUARDED_BY(mu), request_id ABSL_GUARDED_BY(mu);
  std::shared_ptr<const Layout> layout ABSL_GUARDED_BY(mu);
  int64_t epoch ABSL_GUARDED_BY(mu) = 0;
  std::vector<int> owners ABSL_GUARDED_BY(mu);  // bucket * D + shard -> daemon
  std::vector<std::vector<float>> master ABSL_GUARDED_BY(mu);
  std::set<std::pair<int32_t, int32_t>> initial ABSL_GUARDED_BY(mu);
  int64_t version ABSL_GUARDED_BY(mu) = -1;
  int64_t committed_step ABSL_GUARDED_BY(mu) = -1;
  std::map<GradKey, std::map<int32_t, std::vector<float>>> grads ABSL_GUARDED_BY(mu);
  std::map<GradKey, int32_t> contributors ABSL_GUARDED_BY(mu);
  std::map<int64_t, std::map<int32_t, std::pair<double, double>>> finished ABSL_GUARDED_BY(mu);  // step -> rank -> lr, wd
  std::map<int64_t, v1::StepStats> results ABSL_GUARDED_BY(mu);
  // GiveUpStep: the step given up once it is complete, and how often each step was given up.
  int64_t give_up_step ABSL_GUARDED_BY(mu) = -2;
  bool give_up_then_commit ABSL_GUARDED_BY(mu) = false;
  std::map<int64_t, int> given_up ABSL_GUARDED_BY(mu);
  int fenced_finishes_left ABSL_GUARDED_BY(mu) = 0;    // FenceNextFinishes
  int stats_unavailable_left ABSL_GUARDED_BY(mu) = 0;  // FailNextStatsReads
  FakeStats stats ABSL_GUARDED_BY(mu);
  // Checkpoints of the fake Admin service: id -> the masters, version and committed step saved.
  struct Checkpoint {
    std::vector<std::vector<float>> master;
    int64_t version = 0;
    int64_t committed_step = -1;
  };
  std::map<std::string, Checkpoint> checkpoints ABSL_GUARDED_BY(mu);

  // Data-plane admission, as a daemon `daemon` would answer.
  grpc::Status Admit(grpc::ServerContext* context, int daemon, const std::string& job, const std::string& token,
                     int64_t request_epoch, int32_t bucket, int32_t shard) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (unavailable_left > 0) {
      --unavailable_left;
      ++stats.unavailable_answers;
      return grpc::Status(unavailable_code, unavailable_code == grpc::StatusCode::UNAVAILABLE
                                                ? "fake daemon: job not assigned yet"
                                                : "fake daemon: a call cut short by a stopping server");
    }
    if (layout == nullptr || job != job_id) return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown job");
    if (token != job_token) return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "bad job token");
    if (request_epoch > epoch) {
      ++stats.unavailable_answers;
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "fake daemon: epoch not received yet");
    }
    if (bucket < 0) return grpc::Status::OK;  // not shard-scoped
    if (bucket >= static_cast<int32_t>(layout->buckets.size()) || shard < 0 || shard >= layout->data_parallel_size) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown bucket or shard");
    }
    if (owners[bucket * layout->data_parallel_size + shard] != daemon) {
      ++stats.stale_epoch_answers;
      v1::ErrorDetail detail;
      detail.set_placement_epoch(epoch);
      return WithDetail(context, grpc::StatusCode::FAILED_PRECONDITION, "fake daemon: shard not owned here", detail);
    }
    return grpc::Status::OK;
  }

  // Commits step committed_step + 1 when every rank finished it and every shard has its pushes.
  void TryCommit() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const int64_t step = committed_step + 1;
    const int64_t d = layout->data_parallel_size;
    auto fin = finished.find(step);
    if (fin == finished.end() || static_cast<int64_t>(fin->second.size()) != d) return;
    bool nonfinite = false;
    double sum_sq = 0;
    for (int32_t b = 0; b < static_cast<int32_t>(layout->buckets.size()); ++b) {
      for (int32_t s = 0; s < d; ++s) {
        const GradKey key{step, b, s};
        auto g = grads.find(key);
        if (g == grads.end() || static_cast<int32_t>(g->second.size()) != contributors[key]) return;
      }
    }
    if (give_up_step == step) {  // as a daemon whose peer died mid-step: nothing changes
      give_up_step = -2;
      ++given_up[step];
      changed.SignalAll();
      // With give_up_then_commit the step commits below after all, as a move's new owner
      // finishes it with the pushes the move carried.
      if (!give_up_then_commit) {
        finished.erase(step);
        for (auto g = grads.begin(); g != grads.end();) {
          if (std::get<0>(g->first) == step) {
            contributors.erase(g->first);
            g = grads.erase(g);
          } else {
            ++g;
          }
        }
        return;
      }
    }
    const auto [lr, wd] = fin->second.begin()->second;
    std::vector<std::vector<float>> updated = master;
    for (int32_t b = 0; b < static_cast<int32_t>(layout->buckets.size()); ++b) {
      const int64_t n = layout->buckets[b].shard_numel;
      for (int32_t s = 0; s < d; ++s) {
        for (int64_t i = 0; i < n; ++i) {
          float g = 0;
          for (const auto& [rank, values] : grads[{step, b, s}]) g += values[i];
          if (!std::isfinite(g)) nonfinite = true;
          sum_sq += static_cast<double>(g) * g;
          float& m = updated[b][s * n + i];
          m = m - static_cast<float>(lr) * g - static_cast<float>(lr * wd) * m;
        }
      }
    }
    v1::StepStats st;
    st.set_step(step);
    st.set_skipped(nonfinite);
    if (!nonfinite) {
      master = std::move(updated);
      version = step + 1;
    }
    st.set_version(version);
    st.set_grad_norm(std::sqrt(sum_sq));
    st.set_clip_factor(1.0);
    st.set_loss_scale(1.0);
    st.set_lr(lr);
    st.set_weight_decay(wd);
    st.add_groups()->set_lr(lr);
    st.mutable_groups(0)->set_weight_decay(wd);
    st.set_commit_unix_ms(absl::ToUnixMillis(absl::Now()));
    results[step] = st;
    committed_step = step;
    for (auto it = grads.begin(); it != grads.end();) it = std::get<0>(it->first) == step ? grads.erase(it) : ++it;
    changed.SignalAll();
  }
};


std::unique_ptr<grpc::Service> MakeFakeDaemon(FakeCluster::State* state, int index);

}  // namespace mainstay::testing_fakes

#endif  // MAINSTAY_CLIENT_SRC_TESTING_FAKE_STATE_H_
