// Invariant checks for the libFuzzer targets: a violation prints why and aborts, which libFuzzer
// reports as a crash with the input saved. scripts/fuzz.sh runs the targets with stderr closed
// (-close_fd_mask=2: the daemon logs a line per input); the message then goes where libFuzzer
// sends the sanitizers' reports. Rerunning the saved input prints it on stderr too.
#ifndef MAINSTAY_TESTS_FUZZ_FUZZ_CHECK_H_
#define MAINSTAY_TESTS_FUZZ_FUZZ_CHECK_H_

#include <cstdio>
#include <cstdlib>
#include <string>

// Present when a sanitizer runtime is linked; prints to the sanitizers' report file.
extern "C" void __sanitizer_report_error_summary(const char* summary) __attribute__((weak));

namespace mainstay::fuzz {

[[noreturn]] inline void Fail(const std::string& what) {
  const std::string message = "invariant violated: " + what;
  std::fprintf(stderr, "%s\n", message.c_str());
  if (&__sanitizer_report_error_summary != nullptr) __sanitizer_report_error_summary(message.c_str());
  std::abort();
}

inline void Check(bool ok, const std::string& what) {
  if (!ok) Fail(what);
}

}  // namespace mainstay::fuzz

#endif  // MAINSTAY_TESTS_FUZZ_FUZZ_CHECK_H_
