// Time as an interface, so leases and TTLs can be tested with an injected clock.
//
// Thread safety: implementations are thread-safe.
#ifndef MAINSTAY_COMMON_CLOCK_H_
#define MAINSTAY_COMMON_CLOCK_H_

#include <atomic>
#include <chrono>
#include <cstdint>

namespace mainstay {

class Clock {
 public:
  virtual ~Clock() = default;
  // Wall time: for what is shown to people and stored (creation times, KV expiry).
  virtual int64_t NowUnixMs() const = 0;
  // Monotonic time in ms from an arbitrary origin: for durations and deadlines (leases). It
  // never jumps when the wall clock is set.
  virtual int64_t MonotonicMs() const = 0;
};

class RealClock : public Clock {
 public:
  int64_t NowUnixMs() const override {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
  }
  int64_t MonotonicMs() const override {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  // A process-wide instance (never destroyed).
  static RealClock* Get() {
    static RealClock* clock = new RealClock();
    return clock;
  }
};

// A clock that moves only when told to (tests).
class FakeClock : public Clock {
 public:
  explicit FakeClock(int64_t start_unix_ms = 1'700'000'000'000) : now_(start_unix_ms) {}
  int64_t NowUnixMs() const override { return now_.load(); }
  int64_t MonotonicMs() const override { return mono_.load(); }
  // Time passes: both clocks move.
  void Advance(int64_t ms) {
    now_ += ms;
    mono_ += ms;
  }
  // Someone sets the wall clock (NTP step, an operator): only the wall clock moves.
  void JumpWall(int64_t ms) { now_ += ms; }

 private:
  std::atomic<int64_t> now_;
  std::atomic<int64_t> mono_{1'000'000};
};

}  // namespace mainstay

#endif  // MAINSTAY_COMMON_CLOCK_H_
