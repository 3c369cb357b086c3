// The real binaries speak the systemd readiness protocol (Type=notify in deploy/systemd): the
// coordinator says READY=1 once it serves, the daemon only once it has registered (before
// that, systemd must not count it as started), and both say STOPPING=1 at SIGTERM, then exit 0.
#include <arpa/inet.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/deploy/notify_listener.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/subprocess.h"

namespace mainstay {
namespace {

using ::mainstay::testing::IsOk;
using ::mainstay::testing::NotifyListener;
using ::mainstay::testing::ReadFileOrEmpty;
using ::mainstay::testing::Subprocess;
using ::mainstay::testing::TempDir;
using ::testing::Optional;

constexpr absl::Duration kStart = absl::Seconds(60);

// Starts `argv` with NOTIFY_SOCKET naming `listener` (the child inherits the environment at
// fork; the test's own environment is restored right after).
absl::StatusOr<std::unique_ptr<Subprocess>> StartNotifying(const NotifyListener& listener,
                                                           const std::vector<std::string>& argv,
                                                           const std::string& log) {
  setenv("NOTIFY_SOCKET", listener.name().c_str(), 1);
  absl::StatusOr<std::unique_ptr<Subprocess>> child = Subprocess::Start({argv, log});
  unsetenv("NOTIFY_SOCKET");
  return child;
}

// A loopback port that was free a moment ago (the daemon must be told its coordinator's port
// before the coordinator runs).
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address = {};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address));
  getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  close(fd);
  return ntohs(address.sin_port);
}

void ExpectCleanExit(Subprocess& child, const std::string& log) {
  absl::StatusOr<int> status = child.Wait(absl::Seconds(30));
  ASSERT_THAT(status, IsOk());
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0)
      << testing::DescribeWaitStatus(*status) << "\n" << ReadFileOrEmpty(log);
}

TEST(ServerNotifyTest, CoordinatorSaysReadyWithItsAddressThenStoppingAtSigterm) {
  MAINSTAY_ASSERT_OK_AND_ASSIGN(auto dir, TempDir::Create("mainstay-notify"));
  MAINSTAY_ASSERT_OK_AND_ASSIGN(auto listener, NotifyListener::Bind(dir->File("notify")));
  const std::string log = dir->File("coordinator.log");
  MAINSTAY_ASSERT_OK_AND_ASSIGN(
      auto coordinator,
      StartNotifying(*listener,
                     {MAINSTAY_COORDINATOR_BIN, "--listen", "127.0.0.1:0", "--state-dir", dir->File("state"),
                      "--port-file", dir->File("port")},
                     log));

  const std::optional<std::string> ready = listener->Receive(kStart);
  ASSERT_TRUE(ready.has_value()) << ReadFileOrEmpty(log);
  // READY follows the port file, so the port is known by now.
  MAINSTAY_ASSERT_OK_AND_ASSIGN(int port, testing::WaitForPortFile(dir->File("port"), *coordinator, kStart));
  EXPECT_EQ(*ready, absl::StrCat("READY=1\nSTATUS=serving on 127.0.0.1:", port));

  ASSERT_THAT(coordinator->Signal(SIGTERM), IsOk());
  EXPECT_THAT(listener->Receive(kStart), Optional(std::string("STOPPING=1")));
  ExpectCleanExit(*coordinator, log);
}

TEST(ServerNotifyTest, DaemonSaysReadyOnlyOnceRegisteredThenStoppingAtSigterm) {
  MAINSTAY_ASSERT_OK_AND_ASSIGN(auto dir, TempDir::Create("mainstay-notify"));
  const std::string log = dir->File("daemon.log");
  const std::string coordinator_log = dir->File("coordinator.log");
  std::unique_ptr<NotifyListener> listener;
  std::unique_ptr<Subprocess> daemon, coordinator;
  std::optional<std::string> ready;
  // The coordinator's port is chosen before it runs, so another process (a parallel test) may
  // take it meanwhile: then the coordinator exits, and the test starts over on another port.
  for (int attempt = 1; !ready.has_value(); ++attempt) {
    ASSERT_LE(attempt, 3) << "the coordinator never started:\n" << ReadFileOrEmpty(coordinator_log);
    if (daemon != nullptr) daemon->Kill().IgnoreError();
    MAINSTAY_ASSERT_OK_AND_ASSIGN(listener, NotifyListener::Bind(dir->File(absl::StrCat("notify", attempt))));
    const std::string coordinator_address = absl::StrCat("127.0.0.1:", FreePort());
    MAINSTAY_ASSERT_OK_AND_ASSIGN(
        daemon, StartNotifying(*listener,
                               {MAINSTAYD_BIN, "--coordinator", coordinator_address, "--listen", "127.0.0.1:0",
                                "--threads", "1", "--memory-bytes", "1000000000", "--metrics-listen", "off",
                                "--port-file", dir->File("dport")},
                               log));

    // Running, but no coordinator to register with yet (it keeps retrying): not ready.
    EXPECT_EQ(listener->Receive(absl::Seconds(3)), std::nullopt) << ReadFileOrEmpty(log);
    ASSERT_TRUE(daemon->Running()) << ReadFileOrEmpty(log);

    MAINSTAY_ASSERT_OK_AND_ASSIGN(
        coordinator, Subprocess::Start({{MAINSTAY_COORDINATOR_BIN, "--listen", coordinator_address, "--state-dir",
                                         dir->File(absl::StrCat("state", attempt)), "--metrics-listen", "off"},
                                        coordinator_log}));
    for (absl::Time until = absl::Now() + kStart; !ready.has_value() && absl::Now() < until;) {
      ready = listener->Receive(absl::Milliseconds(500));
      if (!ready.has_value() && !coordinator->Running()) break;  // its port was taken: start over
    }
    ASSERT_TRUE(ready.has_value() || !coordinator->Running()) << ReadFileOrEmpty(log) << ReadFileOrEmpty(coordinator_log);
  }
  // The port file is written right before READY.
  MAINSTAY_ASSERT_OK_AND_ASSIGN(int port, testing::WaitForPortFile(dir->File("dport"), *daemon, kStart));
  EXPECT_EQ(*ready, absl::StrCat("READY=1\nSTATUS=daemon-1 serving on 127.0.0.1:", port));

  ASSERT_THAT(daemon->Signal(SIGTERM), IsOk());
  EXPECT_THAT(listener->Receive(kStart), Optional(std::string("STOPPING=1")));
  ExpectCleanExit(*daemon, log);
  ASSERT_THAT(coordinator->Signal(SIGTERM), IsOk());
  ExpectCleanExit(*coordinator, coordinator_log);
}

}  // namespace
}  // namespace mainstay
