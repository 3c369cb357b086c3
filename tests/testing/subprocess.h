// Child processes and scratch directories for multi-process tests (real binaries on
// 127.0.0.1:0, STYLE.md habit 7).
//
//   MAINSTAY_ASSERT_OK_AND_ASSIGN(auto dir, TempDir::Create());
//   MAINSTAY_ASSERT_OK_AND_ASSIGN(auto child, Subprocess::Start({.argv = {bin, "--port-file", dir->File("port")}}));
//   MAINSTAY_ASSERT_OK_AND_ASSIGN(int port, WaitForPortFile(dir->File("port"), *child, absl::Seconds(60)));
//
// A Subprocess is started with fork + exec; the child gets SIGKILL if the thread that started
// it exits (PR_SET_PDEATHSIG), so a crashed test leaves no server behind. The destructor
// kills (SIGKILL) and reaps a child that still runs. Thread safety: one thread per object.
#ifndef MAINSTAY_TESTS_TESTING_SUBPROCESS_H_
#define MAINSTAY_TESTS_TESTING_SUBPROCESS_H_

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace mainstay::testing {

class Subprocess {
 public:
  struct Options {
    std::vector<std::string> argv;  // argv[0] is the program's path
    // stdout and stderr are appended to this file; empty: inherited from the test.
    std::string output_path;
  };

  // INVALID_ARGUMENT for an empty argv; INTERNAL when fork fails. A program that cannot be
  // executed shows as a child exiting with code 127.
  static absl::StatusOr<std::unique_ptr<Subprocess>> Start(const Options& options);
  ~Subprocess();
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;

  pid_t pid() const { return pid_; }
  // False once the child has exited (it is reaped then).
  bool Running();
  absl::Status Signal(int signal_number);
  // The raw wait status (WIFEXITED / WEXITSTATUS / WIFSIGNALED...) once the child exits;
  // DEADLINE_EXCEEDED when it still runs after `timeout`.
  absl::StatusOr<int> Wait(absl::Duration timeout);
  // SIGKILL, then reap. Returns the wait status.
  absl::StatusOr<int> Kill();

 private:
  explicit Subprocess(pid_t pid) : pid_(pid) {}
  pid_t pid_;
  std::optional<int> wait_status_;  // set once reaped
};

// "exited with code 2", "killed by signal 9": for test messages.
std::string DescribeWaitStatus(int wait_status);

// A fresh directory under $TEST_TMPDIR (or /tmp), removed with its contents by the destructor.
class TempDir {
 public:
  static absl::StatusOr<std::unique_ptr<TempDir>> Create(const std::string& prefix = "mainstay-test");
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  explicit TempDir(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

// Waits until the file at `path` holds a port number (written whole, e.g. by rename) and
// returns it. FAILED_PRECONDITION as soon as `process` exits; DEADLINE_EXCEEDED after `timeout`.
absl::StatusOr<int> WaitForPortFile(const std::string& path, Subprocess& process, absl::Duration timeout);

// Reads a whole file (e.g. a child's log for a failure message); empty when unreadable.
std::string ReadFileOrEmpty(const std::string& path);

// The program a test starts: the environment variable `env_name` when set and not empty (a
// prebuilt bundle run elsewhere, tests/gpu/run_on_device.sh), else `built_path` (the build
// tree's, compiled in by CMake).
std::string BinaryPath(const char* env_name, const char* built_path);

}  // namespace mainstay::testing

#endif  // MAINSTAY_TESTS_TESTING_SUBPROCESS_H_
