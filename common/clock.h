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
  virtual int64_t NowUnixMs() const = 0;
};

class RealClock : public Clock {
 public:
  int64_t NowUnixMs() const override {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::system_clock::now().time_since_epoch())
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
  void Advance(int64_t ms) { now_ += ms; }

 private:
  std::atomic<int64_t> now_;
};

}  // namespace mainstay

#endif  // MAINSTAY_COMMON_CLOCK_H_
