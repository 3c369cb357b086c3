// The coordinator's state on a real etcd (server/coordinator/etcd_state_store.h): the log and
// its snapshots survive a reload, only the leader writes (the fence), a standby sees who
// leads and takes over when the leader's lease goes, and an etcd restart is ridden through.
#include "server/coordinator/etcd_state_store.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "etcd/etcdserver/etcdserverpb/rpc.pb.h"
#include "tests/testing/etcd_server.h"
#include "tests/testing/status_matchers.h"

namespace mainstay::coordinator {
namespace {

using ::mainstay::testing::EtcdServer;
using ::mainstay::testing::IsOk;
using ::mainstay::testing::StatusIs;
using ::testing::HasSubstr;

v1::StateBatch KvBatch(int64_t sequence, const std::string& key, const std::string& value) {
  v1::StateBatch batch;
  batch.set_sequence(sequence);
  v1::KvEntry* e = batch.add_records()->mutable_put_kv();
  e->set_key(key);
  e->set_value(value);
  e->set_version(1);
  batch.mutable_counters()->set_kv_revision(sequence);
  return batch;
}

class EtcdStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(EtcdServer::Available()) << "no etcd binary at " << EtcdServer::Binary()
                                         << " (scripts/install_deps.sh installs etcd-server)";
    MAINSTAY_ASSERT_OK_AND_ASSIGN(etcd_, EtcdServer::Start());
  }
  std::unique_ptr<EtcdClient> Client(absl::Duration ttl = absl::Seconds(2)) {
    EtcdOptions o;
    o.endpoints = {etcd_->endpoint()};
    o.prefix = "/test/";
    o.lease_ttl = ttl;
    o.call_timeout = absl::Seconds(2);
    absl::StatusOr<std::unique_ptr<EtcdClient>> c = EtcdClient::Create(o);
    EXPECT_THAT(c.status(), IsOk());
    return c.ok() ? *std::move(c) : nullptr;
  }
  std::unique_ptr<EtcdLeadership> Lead(EtcdClient* client, const std::string& who) {
    std::string holder;
    absl::StatusOr<std::unique_ptr<EtcdLeadership>> l = EtcdLeadership::TryAcquire(client, who, &holder);
    EXPECT_THAT(l.status(), IsOk());
    EXPECT_NE(l.ok() ? l->get() : nullptr, nullptr) << "held by " << holder;
    return l.ok() ? *std::move(l) : nullptr;
  }
  std::unique_ptr<EtcdServer> etcd_;
};

TEST_F(EtcdStoreTest, TheLogAndItsSnapshotsSurviveAReload) {
  auto client = Client();
  auto leader = Lead(client.get(), "a");
  ASSERT_NE(leader, nullptr);
  auto store = NewEtcdStateStore(client.get(), leader.get());
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::CoordinatorState empty, store->Load());
  EXPECT_EQ(empty.sequence(), 0);
  // More batches than one etcd transaction takes (they go in several).
  for (int64_t s = 1; s <= 250; ++s) ASSERT_THAT(store->Write(KvBatch(s, absl::StrCat("k", s % 7), "v")), IsOk());
  ASSERT_THAT(store->Sync(), IsOk());
  {
    auto again = NewEtcdStateStore(client.get(), leader.get());
    MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::CoordinatorState loaded, again->Load());
    EXPECT_EQ(loaded.sequence(), 250);
    EXPECT_EQ(loaded.kv_size(), 7);
    EXPECT_EQ(loaded.counters().kv_revision(), 250);
  }
  // A snapshot drops the log before it; later batches go on top.
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::CoordinatorState now, store->Load());
  ASSERT_THAT(store->WriteSnapshot(now), IsOk());
  ASSERT_THAT(store->Append(KvBatch(251, "after", "snapshot")), IsOk());
  etcdserverpb::RangeRequest log;
  log.set_key("/test/state/log/");
  log.set_range_end("/test/state/log0");
  MAINSTAY_ASSERT_OK_AND_ASSIGN(etcdserverpb::RangeResponse left, client->Range(log));
  EXPECT_EQ(left.kvs_size(), 1);  // only batch 251
  auto again = NewEtcdStateStore(client.get(), leader.get());
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::CoordinatorState loaded, again->Load());
  EXPECT_EQ(loaded.sequence(), 251);
  EXPECT_EQ(loaded.kv_size(), 8);
}

TEST_F(EtcdStoreTest, AStandbySeesTheLeaderAndTakesOverWhenItsLeaseGoes) {
  auto a = Client();
  auto b = Client();
  auto leader = Lead(a.get(), "a at 10.0.0.1:7070");
  ASSERT_NE(leader, nullptr);
  std::string holder;
  MAINSTAY_ASSERT_OK_AND_ASSIGN(std::unique_ptr<EtcdLeadership> none, EtcdLeadership::TryAcquire(b.get(), "b", &holder));
  EXPECT_EQ(none, nullptr);
  EXPECT_EQ(holder, "a at 10.0.0.1:7070");
  leader.reset();  // a clean stop revokes the lease: b leads at once
  EXPECT_NE(Lead(b.get(), "b"), nullptr);
}

TEST_F(EtcdStoreTest, AnOldLeaderCannotWriteOnceAnotherLeads) {
  auto a = Client();
  auto b = Client();
  auto old_leader = Lead(a.get(), "a");
  ASSERT_NE(old_leader, nullptr);
  auto old_store = NewEtcdStateStore(a.get(), old_leader.get());
  ASSERT_THAT(old_store->Load().status(), IsOk());
  ASSERT_THAT(old_store->Append(KvBatch(1, "epoch", "1")), IsOk());
  // a's lease ends (as if it were partitioned away for longer than the TTL); b takes over.
  ASSERT_THAT(a->RevokeLease(old_leader->lease()), IsOk());
  auto new_leader = Lead(b.get(), "b");
  ASSERT_NE(new_leader, nullptr);
  auto new_store = NewEtcdStateStore(b.get(), new_leader.get());
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::CoordinatorState seen, new_store->Load());
  EXPECT_EQ(seen.sequence(), 1);
  ASSERT_THAT(new_store->Append(KvBatch(2, "epoch", "2 by b")), IsOk());
  // a still believes it leads: its next commit of the same sequence is refused, and stays so.
  ASSERT_THAT(old_store->Write(KvBatch(2, "epoch", "2 by a")), IsOk());
  EXPECT_THAT(old_store->Sync(), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no longer the leader")));
  EXPECT_THAT(old_store->Write(KvBatch(3, "x", "y")), StatusIs(absl::StatusCode::kFailedPrecondition));
  auto check = NewEtcdStateStore(b.get(), new_leader.get());
  MAINSTAY_ASSERT_OK_AND_ASSIGN(v1::CoordinatorState after, check->Load());
  ASSERT_EQ(after.kv_size(), 1);
  EXPECT_EQ(after.kv(0).value(), "2 by b");
}

TEST_F(EtcdStoreTest, ALeaderWhoseLeaseExpiresIsToldSo) {
  auto a = Client();
  auto leader = Lead(a.get(), "a");
  ASSERT_NE(leader, nullptr);
  absl::Notification lost;
  std::string why;
  leader->Start([&](const absl::Status& s) {
    why = std::string(s.message());
    lost.Notify();
  });
  ASSERT_THAT(a->RevokeLease(leader->lease()), IsOk());  // what an expiry does to the key
  EXPECT_TRUE(lost.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_THAT(why, HasSubstr("lost its leadership"));
}

TEST_F(EtcdStoreTest, AnEtcdRestartIsRiddenThrough) {
  auto a = Client(absl::Seconds(5));
  auto leader = Lead(a.get(), "a");
  ASSERT_NE(leader, nullptr);
  auto store = NewEtcdStateStore(a.get(), leader.get());
  ASSERT_THAT(store->Load().status(), IsOk());
  ASSERT_THAT(store->Append(KvBatch(1, "k", "before")), IsOk());
  ASSERT_THAT(etcd_->Kill(), IsOk());
  ASSERT_THAT(store->Write(KvBatch(2, "k", "during")), IsOk());
  std::atomic<bool> synced{false};
  absl::Status result;
  std::thread sync([&] {
    result = store->Sync();  // retries while etcd is down
    synced = true;
  });
  absl::SleepFor(absl::Seconds(1));
  EXPECT_FALSE(synced.load());
  ASSERT_THAT(etcd_->Restart(), IsOk());
  sync.join();
  EXPECT_THAT(result, IsOk()) << etcd_->Log();
  auto again = NewEtcdStateStore(a.get(), leader.get());
  absl::StatusOr<v1::CoordinatorState> l = again->Load();
  ASSERT_THAT(l.status(), IsOk()) << etcd_->Log();
  v1::CoordinatorState loaded = *l;
  EXPECT_EQ(loaded.sequence(), 2);
  EXPECT_EQ(loaded.kv(0).value(), "during");
}

TEST(EtcdOptionsTest, BadEndpointsAndOptionsAreRefusedWithTheFlagNamed) {
  EXPECT_THAT(ParseEtcdEndpoints("http://a:2379,b"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'b'")));
  EXPECT_THAT(ParseEtcdEndpoints(" , "), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no endpoint")));
  MAINSTAY_ASSERT_OK_AND_ASSIGN(auto two, ParseEtcdEndpoints("http://10.0.0.1:2379, 10.0.0.2:2379"));
  EXPECT_EQ(two.size(), 2u);
  EtcdOptions o;
  o.endpoints = {"https://10.0.0.1:2379"};
  EXPECT_THAT(EtcdClient::Create(o).status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--etcd-ca-file")));
  o.endpoints = {"10.0.0.1:2379"};
  o.prefix = "/no-slash";
  EXPECT_THAT(EtcdClient::Create(o).status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--etcd-prefix")));
  o.prefix = "/p/";
  o.lease_ttl = absl::Milliseconds(500);
  EXPECT_THAT(EtcdClient::Create(o).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--etcd-lease-ttl-ms")));
}

}  // namespace
}  // namespace mainstay::coordinator
