// How the coordinator tells daemons about their shards: AssignShard / DropShard on the
// daemon's Shard service. An interface so the coordinator core has no gRPC in it; the gRPC
// implementation (server/grpc) delivers calls in the background with retries, a fake records
// them in tests.
//
// Thread safety: implementations are thread-safe; calls return at once (delivery is
// asynchronous and best-effort until the daemon answers; a daemon that restarts asks for its
// placement anyway).
#ifndef MAINSTAY_SERVER_COORDINATOR_SHARD_ASSIGNER_H_
#define MAINSTAY_SERVER_COORDINATOR_SHARD_ASSIGNER_H_

#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "mainstay/v1/shard.pb.h"

namespace mainstay::coordinator {

class ShardAssigner {
 public:
  virtual ~ShardAssigner() = default;
  virtual void Assign(const std::string& daemon_address, const v1::AssignShardRequest& request) = 0;
  virtual void Drop(const std::string& daemon_address, const v1::DropShardRequest& request) = 0;
  // Where a daemon's refusal of an AssignShard for lack of memory (RESOURCE_EXHAUSTED, never
  // retried) goes: refused(address, request, status), called with no lock of the assigner's
  // held. Replacing it (null removes it) waits until no call of the previous one runs.
  using RefusedHandler =
      std::function<void(const std::string& address, const v1::AssignShardRequest&, const absl::Status&)>;
  virtual void SetRefusedHandler(RefusedHandler handler) = 0;
  // Synchronous (checkpoints): the daemon's answer, with its ErrorDetail payload kept. The
  // default answers UNIMPLEMENTED.
  virtual absl::StatusOr<v1::WriteCheckpointResponse> WriteCheckpoint(const std::string& daemon_address,
                                                                      const v1::WriteCheckpointRequest& request,
                                                                      absl::Time deadline) {
    return absl::UnimplementedError("this ShardAssigner cannot write checkpoints");
  }
};

// Records every call (tests).
class RecordingShardAssigner : public ShardAssigner {
 public:
  struct Call {
    std::string address;
    bool assign = true;
    v1::AssignShardRequest assign_request;
    v1::DropShardRequest drop_request;
  };
  void Assign(const std::string& address, const v1::AssignShardRequest& request) override {
    std::lock_guard<std::mutex> lock(mu_);
    calls_.push_back({address, true, request, {}});
  }
  void Drop(const std::string& address, const v1::DropShardRequest& request) override {
    std::lock_guard<std::mutex> lock(mu_);
    calls_.push_back({address, false, {}, request});
  }
  void SetRefusedHandler(RefusedHandler handler) override {
    std::lock_guard<std::mutex> lock(mu_);
    refused_ = std::move(handler);
  }
  // A daemon's refusal, as the gRPC assigner reports it (tests).
  void Refuse(const std::string& address, const v1::AssignShardRequest& request, const absl::Status& status) {
    RefusedHandler handler;
    {
      std::lock_guard<std::mutex> lock(mu_);
      handler = refused_;
    }
    if (handler) handler(address, request, status);
  }
  std::vector<Call> calls() const {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_;
  }

 private:
  mutable std::mutex mu_;
  std::vector<Call> calls_;
  RefusedHandler refused_;
};

}  // namespace mainstay::coordinator

#endif  // MAINSTAY_SERVER_COORDINATOR_SHARD_ASSIGNER_H_
