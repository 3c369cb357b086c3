#include "tests/testing/subprocess.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"

namespace mainstay::testing {
namespace {

constexpr absl::Duration kPoll = absl::Milliseconds(10);

}  // namespace

absl::StatusOr<std::unique_ptr<Subprocess>> Subprocess::Start(const Options& options) {
  if (options.argv.empty()) return absl::InvalidArgumentError("argv: must not be empty");
  // Everything the child needs is prepared before fork: between fork and exec only
  // async-signal-safe calls are allowed (the test process has other threads).
  std::vector<char*> argv;
  for (const std::string& arg : options.argv) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);
  const char* output = options.output_path.empty() ? nullptr : options.output_path.c_str();
  const pid_t parent = ::getpid();

  const pid_t pid = ::fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(126);  // the parent died before prctl
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    if (output != nullptr) {
      const int fd = ::open(output, O_WRONLY | O_CREAT | O_APPEND, 0644);
      if (fd < 0) ::_exit(125);
      ::dup2(fd, STDOUT_FILENO);
      ::dup2(fd, STDERR_FILENO);
      ::close(fd);
    }
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  return std::unique_ptr<Subprocess>(new Subprocess(pid));
}

Subprocess::~Subprocess() {
  if (!wait_status_) (void)Kill();
}

bool Subprocess::Running() {
  if (wait_status_) return false;
  int status = 0;
  const pid_t r = ::waitpid(pid_, &status, WNOHANG);
  if (r == pid_) {
    wait_status_ = status;
    return false;
  }
  return r == 0;
}

absl::Status Subprocess::Signal(int signal_number) {
  if (!Running()) return absl::FailedPreconditionError(absl::StrCat("process ", pid_, " has exited"));
  if (::kill(pid_, signal_number) != 0) return absl::InternalError(absl::StrCat("kill: ", std::strerror(errno)));
  return absl::OkStatus();
}

absl::StatusOr<int> Subprocess::Wait(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (Running()) {
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("process ", pid_, " still runs after ", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(kPoll);
  }
  if (!wait_status_) return absl::InternalError(absl::StrCat("process ", pid_, " cannot be waited for"));
  return *wait_status_;
}

absl::StatusOr<int> Subprocess::Kill() {
  if (Running()) ::kill(pid_, SIGKILL);
  if (!wait_status_) {
    int status = 0;
    if (::waitpid(pid_, &status, 0) == pid_) wait_status_ = status;
  }
  if (!wait_status_) return absl::InternalError(absl::StrCat("process ", pid_, " cannot be reaped"));
  return *wait_status_;
}

std::string DescribeWaitStatus(int wait_status) {
  if (WIFEXITED(wait_status)) return absl::StrCat("exited with code ", WEXITSTATUS(wait_status));
  if (WIFSIGNALED(wait_status)) return absl::StrCat("killed by signal ", WTERMSIG(wait_status));
  return absl::StrCat("wait status ", wait_status);
}

absl::StatusOr<std::unique_ptr<TempDir>> TempDir::Create(const std::string& prefix) {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string pattern = absl::StrCat(base != nullptr && *base != '\0' ? base : "/tmp", "/", prefix, "-XXXXXX");
  if (::mkdtemp(pattern.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp ", pattern, ": ", std::strerror(errno)));
  }
  return std::unique_ptr<TempDir>(new TempDir(pattern));
}

TempDir::~TempDir() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

std::string ReadFileOrEmpty(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string BinaryPath(const char* env_name, const char* built_path) {
  const char* value = std::getenv(env_name);
  return value != nullptr && *value != '\0' ? std::string(value) : std::string(built_path);
}

absl::StatusOr<int> WaitForPortFile(const std::string& path, Subprocess& process, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    int port = 0;
    if (absl::SimpleAtoi(absl::StripAsciiWhitespace(ReadFileOrEmpty(path)), &port) && port > 0) return port;
    if (!process.Running()) {
      absl::StatusOr<int> status = process.Wait(absl::ZeroDuration());
      return absl::FailedPreconditionError(absl::StrCat(
          "process ", process.pid(), " ended before writing ", path, ": ",
          status.ok() ? DescribeWaitStatus(*status) : std::string(status.status().message())));
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("no port in ", path, " after ", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(kPoll);
  }
}

}  // namespace mainstay::testing
