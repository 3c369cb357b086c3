// Standby coordinators pass every call to the leader (server/grpc/standby_forwarder.h): two
// mainstay-coordinator processes on one real etcd (Debian's etcd-server), raw gRPC stubs at the
// standby's address, the same calls at the leader's for comparison. Needs /usr/bin/etcd
// (scripts/install_deps.sh); skipped without it.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/cluster_secret.h"
#include "common/grpc_status.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "mainstay/v1/admin.grpc.pb.h"
#include "mainstay/v1/coordinator.grpc.pb.h"
#include "tests/testing/etcd_server.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/subprocess.h"

namespace mainstay {
namespace {

using ::mainstay::testing::EtcdServer;
using ::mainstay::testing::IsOk;
using ::mainstay::testing::ReadFileOrEmpty;
using ::mainstay::testing::StatusIs;
using ::mainstay::testing::Subprocess;
using ::mainstay::testing::TempDir;
using ::testing::HasSubstr;

constexpr absl::Duration kWaitTimeout = absl::Seconds(60);
constexpr char kSecret[] = "0123456789abcdef0123456789abcdef0123456789abcdef";
constexpr char kAdminToken[] = "admin-token-of-the-standby-test";

void WriteFile(const std::string& path, const std::string& text) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr) << path;
  std::fputs(text.c_str(), f);
  std::fclose(f);
  ::chmod(path.c_str(), 0600);
}

// A context with a deadline and, as asked, the cluster secret and the admin token.
std::unique_ptr<::grpc::ClientContext> Context(bool secret, bool admin = false,
                                               absl::Duration timeout = absl::Seconds(20)) {
  auto context = std::make_unique<::grpc::ClientContext>();
  context->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  if (secret) context->AddMetadata(kClusterSecretMetadata, kSecret);
  if (admin) context->AddMetadata("authorization", absl::StrCat("Bearer ", kAdminToken));
  return context;
}

// One coordinator process on the test's etcd, its log and port in its own directory.
struct Coordinator {
  std::unique_ptr<TempDir> dir;
  std::unique_ptr<Subprocess> process;
  std::string address;
  std::shared_ptr<::grpc::Channel> channel;
  std::unique_ptr<v1::Coordinator::Stub> stub;
  std::unique_ptr<v1::Admin::Stub> admin;

  std::string log() const { return ReadFileOrEmpty(dir->File("log")); }
};

class StandbyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!EtcdServer::Available()) GTEST_SKIP() << EtcdServer::Binary() << " is not installed (etcd-server)";
    MAINSTAY_ASSERT_OK_AND_ASSIGN(etcd_, EtcdServer::Start());
    MAINSTAY_ASSERT_OK_AND_ASSIGN(files_, TempDir::Create("standby-test"));
    WriteFile(files_->File("secret"), kSecret);
    WriteFile(files_->File("admin-token"), kAdminToken);
    ASSERT_NO_FATAL_FAILURE(Start(leader_, "lead", "I coordinator: leading ("));
    ASSERT_NO_FATAL_FAILURE(Start(standby_, "standby", "I coordinator: standby: lead at "));
  }
  void TearDown() override {
    if (HasFailure()) {
      for (const Coordinator* c : {&leader_, &standby_}) {
        if (c->dir != nullptr) std::fprintf(stderr, "---- %s ----\n%s", c->dir->path().c_str(), c->log().c_str());
      }
    }
  }

  // Starts `c` as coordinator `id` and waits for `line` in its log.
  void Start(Coordinator& c, const std::string& id, const std::string& line) {
    MAINSTAY_ASSERT_OK_AND_ASSIGN(c.dir, TempDir::Create("standby-test-" + id));
    std::vector<std::string> argv = {MAINSTAY_COORDINATOR_BIN, "--listen", "127.0.0.1:0", "--etcd-endpoints",
                                     etcd_->endpoint(), "--etcd-lease-ttl-ms", "2000", "--coordinator-id", id,
                                     "--port-file", c.dir->File("port"), "--metrics-listen", "off",
                                     "--cluster-secret-file", files_->File("secret"), "--admin-token-file",
                                     files_->File("admin-token"), "--tick-ms", "50"};
    MAINSTAY_ASSERT_OK_AND_ASSIGN(c.process, Subprocess::Start({argv, c.dir->File("log")}));
    MAINSTAY_ASSERT_OK_AND_ASSIGN(int port, testing::WaitForPortFile(c.dir->File("port"), *c.process, kWaitTimeout));
    c.address = absl::StrCat("127.0.0.1:", port);
    c.channel = ::grpc::CreateChannel(c.address, ::grpc::InsecureChannelCredentials());
    c.stub = v1::Coordinator::NewStub(c.channel);
    c.admin = v1::Admin::NewStub(c.channel);
    const absl::Time deadline = absl::Now() + kWaitTimeout;
    while (!absl::StrContains(c.log(), line) && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(50));
    ASSERT_THAT(c.log(), HasSubstr(line));
  }

  absl::StatusOr<v1::KvPutResponse> Put(Coordinator& c, const std::string& key, const std::string& value,
                                        bool secret = true) {
    v1::KvPutRequest request;
    request.set_key(key);
    request.set_value(value);
    v1::KvPutResponse response;
    auto context = Context(secret);
    const ::grpc::Status s = c.stub->KvPut(context.get(), request, &response);
    if (!s.ok()) return FromGrpcStatus(s);
    return response;
  }
  absl::StatusOr<v1::KvGetResponse> Get(Coordinator& c, const std::string& key, int64_t wait_ms = 0,
                                        absl::Duration timeout = absl::Seconds(20)) {
    v1::KvGetRequest request;
    request.set_key(key);
    request.set_wait_ms(wait_ms);
    v1::KvGetResponse response;
    auto context = Context(true, false, timeout);
    const ::grpc::Status s = c.stub->KvGet(context.get(), request, &response);
    if (!s.ok()) return FromGrpcStatus(s);
    return response;
  }

  std::unique_ptr<EtcdServer> etcd_;
  std::unique_ptr<TempDir> files_;
  Coordinator leader_, standby_;
};

TEST_F(StandbyTest, AStandbyPassesCallsToTheLeaderWithTheirMetadataAndAnswers) {
  // A write through the standby is the leader's: read back from the leader directly.
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::KvPutResponse put, Put(standby_, "k", "through the standby"));
  EXPECT_TRUE(put.applied());
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::KvGetResponse got, Get(leader_, "k"));
  ASSERT_EQ(got.entries_size(), 1);
  EXPECT_EQ(got.entries(0).value(), "through the standby");
  EXPECT_EQ(got.revision(), put.revision());

  // The caller's own metadata decides, not the standby's: no cluster secret, no internal call;
  // no admin token, no admin call. The answers are the leader's, word for word.
  absl::StatusOr<v1::KvPutResponse> direct = Put(leader_, "k", "x", /*secret=*/false);
  absl::StatusOr<v1::KvPutResponse> forwarded = Put(standby_, "k", "x", /*secret=*/false);
  EXPECT_THAT(forwarded, StatusIs(absl::StatusCode::kPermissionDenied));
  EXPECT_EQ(forwarded.status(), direct.status());
  v1::CordonDaemonRequest cordon;
  cordon.set_daemon_id("no-such-daemon");
  v1::CordonDaemonResponse cordoned;
  auto without = Context(false);
  EXPECT_THAT(FromGrpcStatus(standby_.admin->CordonDaemon(without.get(), cordon, &cordoned)),
              StatusIs(absl::StatusCode::kPermissionDenied));
  auto with = Context(false, /*admin=*/true);
  EXPECT_THAT(FromGrpcStatus(standby_.admin->CordonDaemon(with.get(), cordon, &cordoned)),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no-such-daemon")));

  // Health (the grpc.health.v1 service, as a Kubernetes probe asks it) is the leader's.
  auto health = ::grpc::health::v1::Health::NewStub(standby_.channel);
  ::grpc::health::v1::HealthCheckRequest check;
  ::grpc::health::v1::HealthCheckResponse serving;
  auto health_context = Context(false);
  ASSERT_THAT(FromGrpcStatus(health->Check(health_context.get(), check, &serving)), IsOk());
  EXPECT_EQ(serving.status(), ::grpc::health::v1::HealthCheckResponse::SERVING);

  // The caller's deadline goes along: a long poll ends at it.
  const absl::Time start = absl::Now();
  EXPECT_THAT(Get(standby_, "never", 60'000, absl::Milliseconds(700)), StatusIs(absl::StatusCode::kDeadlineExceeded));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));

  // A stream: KvWatch through the standby sees the changes as they happen.
  auto watch_context = Context(true);
  v1::KvWatchRequest watch;
  watch.set_key("w/");
  watch.set_prefix(true);
  watch.set_start_revision(put.revision());
  auto stream = standby_.stub->KvWatch(watch_context.get(), watch);
  ASSERT_THAT(Put(leader_, "w/1", "one"), IsOk());
  ASSERT_THAT(Put(standby_, "w/2", "two"), IsOk());
  v1::KvWatchResponse change;
  std::vector<std::string> seen;
  while (seen.size() < 2 && stream->Read(&change)) seen.push_back(change.entry().key() + "=" + change.entry().value());
  EXPECT_THAT(seen, ::testing::ElementsAre("w/1=one", "w/2=two"));
  watch_context->TryCancel();
  stream->Finish().ok();

  // A call that already came through a standby is not passed on again (no loops).
  auto hopped = Context(true);
  hopped->AddMetadata("mainstay-forwarded-by", "someone");
  v1::KvGetRequest get;
  get.set_key("k");
  v1::KvGetResponse response;
  EXPECT_THAT(FromGrpcStatus(standby_.stub->KvGet(hopped.get(), get, &response)),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("standby")));
}

TEST_F(StandbyTest, AStandbyStoppingEndsItsForwardedCallsWithUnavailable) {
  absl::StatusOr<v1::KvGetResponse> waiting;
  std::thread poll([&] { waiting = Get(standby_, "never", 60'000, absl::Seconds(60)); });
  absl::SleepFor(absl::Milliseconds(500));  // the long poll is at the leader
  ASSERT_THAT(standby_.process->Signal(SIGTERM), IsOk());
  MAINSTAY_ASSERT_OK_AND_ASSIGN(int exit_status, standby_.process->Wait(kWaitTimeout));
  poll.join();
  EXPECT_EQ(exit_status, 0);
  // UNAVAILABLE, which clients retry elsewhere, rather than CANCELLED, which they would not.
  EXPECT_THAT(waiting, StatusIs(absl::StatusCode::kUnavailable));
}

TEST_F(StandbyTest, AfterTheLeaderDiesTheStandbysAddressAnswersAsTheNewLeader) {
  ASSERT_THAT(Put(standby_, "kept", "before"), IsOk());
  ASSERT_THAT(leader_.process->Signal(SIGKILL), IsOk());
  ASSERT_THAT(leader_.process->Wait(kWaitTimeout).status(), IsOk());
  // Meanwhile calls fail with UNAVAILABLE (retryable); within the lease TTL (2 s) plus the poll
  // the standby leads, on the same address.
  const absl::Time deadline = absl::Now() + kWaitTimeout;
  absl::StatusOr<v1::KvGetResponse> got = Get(standby_, "kept");
  while (!got.ok() && absl::Now() < deadline) {
    // (CANCELLED: a call reaching the standby's gRPC server in the instant it closes for the
    // takeover; the client library retries it like UNAVAILABLE, client/src/client.cc.)
    EXPECT_THAT(got.status().code(), ::testing::AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kCancelled))
        << got.status();
    absl::SleepFor(absl::Milliseconds(100));
    got = Get(standby_, "kept");
  }
  ASSERT_THAT(got, IsOk());
  EXPECT_EQ(got->entries(0).value(), "before");
  EXPECT_THAT(standby_.log(), HasSubstr("I coordinator: leading ("));
}

}  // namespace
}  // namespace mainstay
