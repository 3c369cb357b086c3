// The cap on reader traffic of one daemon (mainstayd --reader-bytes-per-sec): a token bucket of
// bytes shared by every job's readers. Trainers' pulls never pass through it, so readers cannot
// take the network or the CPU from training beyond the cap (docs/weight_serving.md, "Fan-out").
//
// A pull is admitted while the bucket holds any tokens and takes its whole size (the bucket may
// go into debt: a shard is never split); otherwise it is refused with the wait until tokens are
// back, and the reader retries. The rate over time is the cap; a burst is at most one second's
// worth plus one shard. Thread-safe.
#ifndef MAINSTAY_SERVER_DAEMON_READER_LIMITER_H_
#define MAINSTAY_SERVER_DAEMON_READER_LIMITER_H_

#include <algorithm>
#include <cstdint>

#include "absl/synchronization/mutex.h"

namespace mainstay::daemon {

class ReaderLimiter {
 public:
  // `bytes_per_sec` > 0.
  explicit ReaderLimiter(int64_t bytes_per_sec) : rate_(bytes_per_sec), tokens_(static_cast<double>(bytes_per_sec)) {}

  int64_t bytes_per_sec() const { return rate_; }

  // 0: admitted, `bytes` taken. Otherwise the milliseconds until a pull can be admitted.
  int64_t Admit(int64_t bytes, int64_t now_ms) {
    absl::MutexLock lock(&mu_);
    if (last_ms_ >= 0 && now_ms > last_ms_) {
      tokens_ = std::min(static_cast<double>(rate_), tokens_ + static_cast<double>(rate_) * (now_ms - last_ms_) / 1000.0);
    }
    last_ms_ = std::max(last_ms_, now_ms);
    if (tokens_ <= 0.0) return std::max<int64_t>(1, static_cast<int64_t>(-tokens_ * 1000.0 / rate_) + 1);
    tokens_ -= static_cast<double>(bytes);
    return 0;
  }

 private:
  const int64_t rate_;
  absl::Mutex mu_;
  double tokens_ ABSL_GUARDED_BY(mu_);
  int64_t last_ms_ ABSL_GUARDED_BY(mu_) = -1;
};

}  // namespace mainstay::daemon

#endif  // MAINSTAY_SERVER_DAEMON_READER_LIMITER_H_
