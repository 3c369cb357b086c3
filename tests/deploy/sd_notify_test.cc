// common/sd_notify.h against a socket of the test's own, standing in for systemd: the text
// arrives as one datagram on a path or an abstract socket, an unset NOTIFY_SOCKET is a silent
// success, and a bad or dead socket is an error the caller can log, never a crash.
#include "common/sd_notify.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "tests/deploy/notify_listener.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/subprocess.h"

namespace mainstay {
namespace {

using ::mainstay::testing::IsOk;
using ::mainstay::testing::NotifyListener;
using ::mainstay::testing::StatusIs;
using ::mainstay::testing::TempDir;
using ::testing::HasSubstr;
using ::testing::Optional;

constexpr absl::Duration kWait = absl::Seconds(5);

// Each test sets NOTIFY_SOCKET itself; none may leak into the next.
class SdNotifyTest : public ::testing::Test {
 protected:
  void TearDown() override { unsetenv("NOTIFY_SOCKET"); }
};

TEST_F(SdNotifyTest, UnsetOrEmptySocketIsANoOpSuccess) {
  unsetenv("NOTIFY_SOCKET");
  EXPECT_THAT(SdNotify("READY=1"), IsOk());
  setenv("NOTIFY_SOCKET", "", 1);
  EXPECT_THAT(SdNotify("READY=1"), IsOk());
}

TEST_F(SdNotifyTest, DeliversTheWholeTextToAPathSocket) {
  MAINSTAY_ASSERT_OK_AND_ASSIGN(auto dir, TempDir::Create("mainstay-notify"));
  MAINSTAY_ASSERT_OK_AND_ASSIGN(auto listener, NotifyListener::Bind(dir->File("notify")));
  setenv("NOTIFY_SOCKET", listener->name().c_str(), 1);

  EXPECT_THAT(SdNotify("READY=1\nSTATUS=serving on 0.0.0.0:7070"), IsOk());
  EXPECT_THAT(listener->Receive(kWait), Optional(std::string("READY=1\nSTATUS=serving on 0.0.0.0:7070")));
  EXPECT_THAT(SdNotify("STOPPING=1"), IsOk());
  EXPECT_THAT(listener->Receive(kWait), Optional(std::string("STOPPING=1")));
}

TEST_F(SdNotifyTest, DeliversToAnAbstractSocketNamedWithAt) {
  // systemd itself uses abstract names ("@/org/freedesktop/systemd1/notify/...") in containers.
  const std::string name = absl::StrCat("@mainstay-sd-notify-test-", getpid());
  MAINSTAY_ASSERT_OK_AND_ASSIGN(auto listener, NotifyListener::Bind(name));
  setenv("NOTIFY_SOCKET", name.c_str(), 1);

  EXPECT_THAT(SdNotify("READY=1"), IsOk());
  EXPECT_THAT(listener->Receive(kWait), Optional(std::string("READY=1")));
}

TEST_F(SdNotifyTest, RejectsNamesThatAreNeitherAbsolutePathsNorAbstract) {
  for (const char* name : {"relative/notify", "vsock:2:1234"}) {
    setenv("NOTIFY_SOCKET", name, 1);
    EXPECT_THAT(SdNotify("READY=1"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(name)));
  }
}

TEST_F(SdNotifyTest, RejectsAPathLongerThanAUnixSocketAddress) {
  setenv("NOTIFY_SOCKET", ("/" + std::string(200, 'x')).c_str(), 1);
  EXPECT_THAT(SdNotify("READY=1"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("longer than")));
}

TEST_F(SdNotifyTest, SocketWithoutAListenerIsUnavailableNotFatal) {
  MAINSTAY_ASSERT_OK_AND_ASSIGN(auto dir, TempDir::Create("mainstay-notify"));
  setenv("NOTIFY_SOCKET", dir->File("nobody-here").c_str(), 1);
  EXPECT_THAT(SdNotify("READY=1"), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("nobody-here")));
}

}  // namespace
}  // namespace mainstay
