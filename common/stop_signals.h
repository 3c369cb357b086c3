// Graceful stop of a server binary: SIGTERM and SIGINT are blocked before any thread starts
// (threads inherit the mask) so that only WaitForStopSignal receives them, and SIGPIPE is
// ignored (a peer closing a socket must not kill the server).
//
// Thread safety: call BlockStopSignals once in main before starting threads; then
// WaitForStopSignal from one thread.
#ifndef MAINSTAY_COMMON_STOP_SIGNALS_H_
#define MAINSTAY_COMMON_STOP_SIGNALS_H_

#include <pthread.h>
#include <signal.h>

#include <csignal>
#include <ctime>

namespace mainstay {

class StopSignals {
 public:
  // Blocks SIGTERM and SIGINT in the calling thread and ignores SIGPIPE.
  static StopSignals Block() {
    StopSignals s;
    sigemptyset(&s.set_);
    sigaddset(&s.set_, SIGTERM);
    sigaddset(&s.set_, SIGINT);
    pthread_sigmask(SIG_BLOCK, &s.set_, nullptr);
    std::signal(SIGPIPE, SIG_IGN);
    return s;
  }
  // Returns the number of the stop signal received.
  int Wait() const {
    int signal_number = 0;
    while (sigwait(&set_, &signal_number) != 0) {
    }
    return signal_number;
  }
  // The stop signal received within `ms` milliseconds, or 0.
  int WaitFor(long ms) const {
    const timespec timeout{ms / 1000, (ms % 1000) * 1000000};
    const int signal_number = sigtimedwait(&set_, nullptr, &timeout);
    return signal_number > 0 ? signal_number : 0;
  }

 private:
  sigset_t set_;
};

}  // namespace mainstay

#endif  // MAINSTAY_COMMON_STOP_SIGNALS_H_
