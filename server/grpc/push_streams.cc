#include "server/grpc/push_streams.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/logging.h"

namespace mainstay::daemon {

PushStreams::PushStreams(absl::Duration idle_timeout)
    : idle_timeout_(idle_timeout > absl::ZeroDuration() ? idle_timeout : absl::Seconds(60)) {
  sweeper_ = std::thread([this] { Sweep(); });
}

PushStreams::~PushStreams() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  sweeper_.join();
}

void PushStreams::Open(::grpc::CallbackServerContext* context) {
  absl::MutexLock lock(&mu_);
  streams_[context] = Stream{"", absl::Now()};
}

void PushStreams::Keyed(::grpc::CallbackServerContext* context, const std::string& key) {
  absl::MutexLock lock(&mu_);
  auto self = streams_.find(context);
  if (self == streams_.end()) return;
  self->second.key = key;
  self->second.last = absl::Now();
  auto [it, inserted] = by_key_.emplace(key, context);
  if (!inserted && it->second != context) {
    it->second->TryCancel();  // still open: Close would have removed it from by_key_
    ++replaced_;
    it->second = context;
  }
}

void PushStreams::Touch(::grpc::CallbackServerContext* context) {
  absl::MutexLock lock(&mu_);
  if (auto it = streams_.find(context); it != streams_.end()) it->second.last = absl::Now();
}

void PushStreams::Close(::grpc::CallbackServerContext* context) {
  absl::MutexLock lock(&mu_);
  auto it = streams_.find(context);
  if (it == streams_.end()) return;
  if (auto k = by_key_.find(it->second.key); k != by_key_.end() && k->second == context) by_key_.erase(k);
  streams_.erase(it);
}

int64_t PushStreams::idle_cancelled() const {
  absl::MutexLock lock(&mu_);
  return idle_cancelled_;
}

int64_t PushStreams::replaced() const {
  absl::MutexLock lock(&mu_);
  return replaced_;
}

size_t PushStreams::open() const {
  absl::MutexLock lock(&mu_);
  return streams_.size();
}

void PushStreams::Sweep() {
  const absl::Duration period = std::min(idle_timeout_ / 4, absl::Seconds(1));
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), period);
    if (stopping_) break;
    const absl::Time now = absl::Now();
    int64_t cancelled = 0;
    for (auto& [context, stream] : streams_) {
      if (now - stream.last < idle_timeout_) continue;
      context->TryCancel();
      stream.last = absl::InfiniteFuture();  // once; Close removes it
      ++cancelled;
    }
    if (cancelled > 0) {
      idle_cancelled_ += cancelled;
      Log(LogLevel::kWarning, "shard-server",
          absl::StrCat("cancelled ", cancelled, " PushGrad stream(s) that sent nothing for ",
                       absl::FormatDuration(idle_timeout_), " (nothing of them is stored)"));
    }
  }
}

}  // namespace mainstay::daemon
