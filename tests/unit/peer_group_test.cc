// PeerGroup implementations against the contract in server/peer/peer_group.h: the in-process
// fake and Gloo over TCP on loopback (rendezvous through an InMemoryKvClient), with the members
// as threads of this process.
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <latch>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/peer/fake_peer_group.h"
#include "server/peer/gloo_peer_group.h"
#include "server/peer/kv_client.h"
#include "server/peer/peer_group.h"
#include "tests/testing/status_matchers.h"

namespace mainstay::peer {
namespace {

using ::mainstay::testing::IsOk;
using ::mainstay::testing::StatusIs;
using ::testing::AnyOf;

enum class Impl { kFake, kGloo };

// Generous on a loaded 2-core machine; the deadlines under test are well below it.
constexpr absl::Duration kCreateDeadline = absl::Seconds(20);
constexpr absl::Duration kSlack = absl::Seconds(2);

// The factories the member threads of one test share: the fake meets in the factory, Gloo in
// the KV.
class Members {
 public:
  explicit Members(Impl impl) : impl_(impl), gloo_(&kv_) {}
  PeerGroupFactory& factory() { return impl_ == Impl::kFake ? static_cast<PeerGroupFactory&>(fake_) : gloo_; }
  InMemoryKvClient& kv() { return kv_; }

 private:
  const Impl impl_;
  InMemoryKvClient kv_;
  InProcessPeerGroupFactory fake_;
  GlooPeerGroupFactory gloo_;
};

// Runs fn(rank) on `size` threads and joins them.
void RunMembers(int size, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) threads.emplace_back(fn, rank);
  for (std::thread& thread : threads) thread.join();
}

std::string UniqueKey(const std::string& base) {
  static std::atomic<int> counter{0};
  return absl::StrCat(base, "/gen", counter++);
}

// Rank r's addends. Even indexes are small integers (every order gives the exact sum); odd
// ones mix 1e16, -1e16 and 0.1, where the order of the additions changes the result.
std::vector<double> SumInput(int rank, int n) {
  std::vector<double> v(n);
  for (int i = 0; i < n; ++i) {
    if (i % 2 == 0) {
      v[i] = rank * 100 + i;
    } else {
      const int pick = (rank + i) % 3;
      v[i] = pick == 0 ? 1e16 : pick == 1 ? -1e16 : 0.1 * (i + 1);
    }
  }
  return v;
}

std::vector<float> MaxInput(int rank, int size, int n) {
  std::vector<float> v(n);
  for (int i = 0; i < n; ++i) v[i] = static_cast<float>((rank * 7 + i * 3) % 11) * 0.5f;
  if (n > 0 && rank == size - 1) v[0] = std::numeric_limits<float>::infinity();
  return v;
}

// The fake's promise: addition in rank order.
std::vector<double> RankOrderSum(int size, int n) {
  std::vector<double> sum = SumInput(0, n);
  for (int r = 1; r < size; ++r) {
    const std::vector<double> in = SumInput(r, n);
    for (int i = 0; i < n; ++i) sum[i] += in[i];
  }
  return sum;
}

std::vector<float> ExpectedMax(int size, int n) {
  std::vector<float> max = MaxInput(0, size, n);
  for (int r = 1; r < size; ++r) {
    const std::vector<float> in = MaxInput(r, size, n);
    for (int i = 0; i < n; ++i) max[i] = std::fmax(max[i], in[i]);
  }
  return max;
}

bool BitIdentical(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

class PeerGroupTest : public ::testing::TestWithParam<std::tuple<Impl, int>> {
 protected:
  Impl impl() const { return std::get<0>(GetParam()); }
  int size() const { return std::get<1>(GetParam()); }
};

// The failure cases need at least two members.
using MultiMemberPeerGroupTest = PeerGroupTest;

TEST_P(PeerGroupTest, SumAndMaxAreCorrectAndBitIdenticalOnEveryMember) {
  Members members(impl());
  const std::string key = UniqueKey("sum_and_max");
  constexpr int kN = 13;  // several ring segments per member
  std::vector<std::vector<double>> sums(size());
  std::vector<std::vector<float>> maxes(size());
  RunMembers(size(), [&](int rank) {
    auto group = members.factory().Create(key, rank, size(), absl::Now() + kCreateDeadline);
    ASSERT_THAT(group, IsOk());
    EXPECT_EQ((*group)->rank(), rank);
    EXPECT_EQ((*group)->size(), size());
    sums[rank] = SumInput(rank, kN);
    EXPECT_THAT((*group)->AllReduceSum(sums[rank], absl::Now() + absl::Seconds(10)), IsOk());
    maxes[rank] = MaxInput(rank, size(), kN);
    EXPECT_THAT((*group)->AllReduceMax(maxes[rank], absl::Now() + absl::Seconds(10)), IsOk());
  });

  const std::vector<double> rank_order = RankOrderSum(size(), kN);
  for (int rank = 0; rank < size(); ++rank) {
    EXPECT_TRUE(BitIdentical(sums[rank], sums[0])) << "rank " << rank;
    EXPECT_EQ(maxes[rank], ExpectedMax(size(), kN)) << "rank " << rank;
    for (int i = 0; i < kN; i += 2) EXPECT_EQ(sums[rank][i], rank_order[i]) << "rank " << rank << " index " << i;
  }
  if (impl() == Impl::kFake) {
    EXPECT_TRUE(BitIdentical(sums[0], rank_order)) << "the fake adds in rank order";
  }
}

TEST_P(PeerGroupTest, RepeatedReductionsOnOneGroupStayInStep) {
  Members members(impl());
  const std::string key = UniqueKey("repeated");
  RunMembers(size(), [&](int rank) {
    auto group = members.factory().Create(key, rank, size(), absl::Now() + kCreateDeadline);
    ASSERT_THAT(group, IsOk());
    for (int step = 0; step < 20; ++step) {
      const int n = step % 5;  // includes empty reductions
      std::vector<double> sum = SumInput(rank, n);
      ASSERT_THAT((*group)->AllReduceSum(sum, absl::Now() + absl::Seconds(10)), IsOk()) << "step " << step;
      const std::vector<double> expected = RankOrderSum(size(), n);
      for (int i = 0; i < n; i += 2) EXPECT_EQ(sum[i], expected[i]) << "step " << step;
      std::vector<float> max = MaxInput(rank, size(), n + 1);
      ASSERT_THAT((*group)->AllReduceMax(max, absl::Now() + absl::Seconds(10)), IsOk()) << "step " << step;
      EXPECT_EQ(max, ExpectedMax(size(), n + 1)) << "step " << step;
    }
  });
}

TEST_P(MultiMemberPeerGroupTest, MismatchedLengthsAreInvalidArgumentOnEveryMemberAndTheGroupGoesOn) {
  Members members(impl());
  const std::string key = UniqueKey("mismatch");
  RunMembers(size(), [&](int rank) {
    auto group = members.factory().Create(key, rank, size(), absl::Now() + kCreateDeadline);
    ASSERT_THAT(group, IsOk());
    std::vector<double> values(rank == 1 ? 4 : 3, 1.5);
    const std::vector<double> before = values;
    EXPECT_THAT((*group)->AllReduceSum(values, absl::Now() + absl::Seconds(10)),
                StatusIs(absl::StatusCode::kInvalidArgument));
    EXPECT_EQ(values, before);
    // Every member saw the same failure, so the next reduction is in step.
    std::vector<double> one = {1.0};
    EXPECT_THAT((*group)->AllReduceSum(one, absl::Now() + absl::Seconds(10)), IsOk());
    EXPECT_EQ(one[0], size());
  });
}

TEST_P(MultiMemberPeerGroupTest, MemberThatNeverJoinsFailsCreateByTheDeadline) {
  Members members(impl());
  const std::string key = UniqueKey("never_joins");
  const absl::Duration wait = absl::Milliseconds(500);
  RunMembers(size() - 1, [&](int rank) {  // the last rank never calls Create
    const absl::Time start = absl::Now();
    auto group = members.factory().Create(key, rank, size(), start + wait);
    EXPECT_THAT(group, StatusIs(absl::StatusCode::kDeadlineExceeded));
    EXPECT_LT(absl::Now() - start, wait + kSlack);
  });
}

// A member that learns the others will not come (they moved to a newer epoch or generation)
// leaves at once, with its abort check's error, instead of waiting until its deadline.
TEST_P(MultiMemberPeerGroupTest, AMemberWhoseAbortCheckFailsLeavesLongBeforeTheDeadline) {
  Members members(impl());
  const std::string key = UniqueKey("aborted");
  const absl::Duration wait = absl::Seconds(30);
  std::atomic<bool> moved_on{false};
  const AbortCheck abort = [&]() -> absl::Status {
    return moved_on.load() ? absl::AbortedError("the job moved on") : absl::OkStatus();
  };
  std::thread later([&] {
    absl::SleepFor(absl::Milliseconds(400));
    moved_on = true;
  });
  RunMembers(size() - 1, [&](int rank) {  // the last rank never calls Create
    const absl::Time start = absl::Now();
    auto group = members.factory().Create(key, rank, size(), start + wait, abort);
    EXPECT_THAT(group, StatusIs(absl::StatusCode::kAborted, ::testing::HasSubstr("the job moved on")));
    EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  });
  later.join();
}

TEST_P(MultiMemberPeerGroupTest, MemberThatDiesMidRunFailsTheSurvivorsWithinTheirDeadline) {
  Members members(impl());
  const std::string key = UniqueKey("dies");
  const int dying = size() - 1;
  const absl::Duration wait = absl::Seconds(1);
  RunMembers(size(), [&](int rank) {
    auto group = members.factory().Create(key, rank, size(), absl::Now() + kCreateDeadline);
    ASSERT_THAT(group, IsOk());
    std::vector<double> values = {1.0, 2.0};
    ASSERT_THAT((*group)->AllReduceSum(values, absl::Now() + absl::Seconds(10)), IsOk());
    if (rank == dying) {
      group->reset();  // closes its connections, as a crashed daemon's kernel would
      return;
    }
    const absl::Time start = absl::Now();
    const absl::Status status = (*group)->AllReduceSum(values, start + wait);
    EXPECT_THAT(status, AnyOf(StatusIs(absl::StatusCode::kUnavailable), StatusIs(absl::StatusCode::kDeadlineExceeded)));
    EXPECT_LT(absl::Now() - start, wait + kSlack);
    EXPECT_EQ(values, (std::vector<double>{size() * 1.0, size() * 2.0})) << "a failed reduction changed the values";
    // Broken: the same error again, at once.
    const absl::Time again = absl::Now();
    std::vector<float> max = {1.0f};
    EXPECT_EQ((*group)->AllReduceMax(max, again + absl::Seconds(10)), status);
    EXPECT_LT(absl::Now() - again, absl::Milliseconds(100));
  });
}

TEST_P(MultiMemberPeerGroupTest, MemberThatStopsReducingFailsTheOthersByTheirDeadline) {
  Members members(impl());
  const std::string key = UniqueKey("stops");
  const int silent = size() - 1;
  const absl::Duration wait = absl::Milliseconds(500);
  std::latch others_done(size() - 1);
  RunMembers(size(), [&](int rank) {
    auto group = members.factory().Create(key, rank, size(), absl::Now() + kCreateDeadline);
    ASSERT_THAT(group, IsOk());
    if (rank == silent) {
      others_done.wait();  // alive and connected, but never reduces (a hung daemon)
      return;
    }
    const absl::Time start = absl::Now();
    std::vector<double> values = {1.0};
    EXPECT_THAT((*group)->AllReduceSum(values, start + wait),
                AnyOf(StatusIs(absl::StatusCode::kDeadlineExceeded), StatusIs(absl::StatusCode::kUnavailable)));
    EXPECT_LT(absl::Now() - start, wait + kSlack);
    others_done.count_down();
  });
}

TEST_P(PeerGroupTest, BadRankOrSizeIsInvalidArgument) {
  Members members(impl());
  const absl::Time deadline = absl::Now() + absl::Seconds(1);
  EXPECT_THAT(members.factory().Create("bad", size(), size(), deadline), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(members.factory().Create("bad", -1, size(), deadline), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(members.factory().Create("bad", 0, 0, deadline), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(members.factory().Create("", 0, size(), deadline), StatusIs(absl::StatusCode::kInvalidArgument));
}

std::string ImplName(Impl impl) { return impl == Impl::kFake ? "Fake" : "Gloo"; }

std::string ImplAndSizeName(const ::testing::TestParamInfo<std::tuple<Impl, int>>& info) {
  return absl::StrCat(ImplName(std::get<0>(info.param)), "_", std::get<1>(info.param), "members");
}

INSTANTIATE_TEST_SUITE_P(AllSizes, PeerGroupTest,
                         ::testing::Combine(::testing::Values(Impl::kFake, Impl::kGloo), ::testing::Values(1, 2, 3, 4)),
                         ImplAndSizeName);
INSTANTIATE_TEST_SUITE_P(AllSizes, MultiMemberPeerGroupTest,
                         ::testing::Combine(::testing::Values(Impl::kFake, Impl::kGloo), ::testing::Values(2, 3, 4)),
                         ImplAndSizeName);

class PeerGroupImplTest : public ::testing::TestWithParam<Impl> {};

TEST_P(PeerGroupImplTest, TwoGroupsWithDifferentKeysReduceAtOnce) {
  Members members(GetParam());
  const std::string key_a = UniqueKey("group_a");
  const std::string key_b = UniqueKey("group_b");
  // Group A has 2 members, group B 3: five threads, all reducing at the same time.
  RunMembers(5, [&](int thread) {
    const bool in_a = thread < 2;
    const int rank = in_a ? thread : thread - 2;
    const int size = in_a ? 2 : 3;
    auto group = members.factory().Create(in_a ? key_a : key_b, rank, size, absl::Now() + kCreateDeadline);
    ASSERT_THAT(group, IsOk());
    for (int step = 0; step < 10; ++step) {
      std::vector<double> values = {in_a ? 1.0 : 10.0, static_cast<double>(step)};
      ASSERT_THAT((*group)->AllReduceSum(values, absl::Now() + absl::Seconds(10)), IsOk());
      EXPECT_EQ(values, (std::vector<double>{size * (in_a ? 1.0 : 10.0), size * static_cast<double>(step)}));
    }
  });
}

TEST_P(PeerGroupImplTest, GenerationsOnlyRiseAndEveryMemberSeesTheSameOne) {
  Members members(GetParam());
  PeerGroupFactory& f = members.factory();
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  auto gen = [&](const std::string& key, int64_t at_least) {
    absl::StatusOr<int64_t> g = f.Generation(key, at_least, deadline);
    EXPECT_THAT(g.status(), IsOk());
    return g.value_or(-1);
  };
  EXPECT_EQ(gen("gen_a", 0), 0);  // unknown: 0
  EXPECT_EQ(gen("gen_a", 1), 1);  // a member's group of generation 0 broke
  EXPECT_EQ(gen("gen_a", 1), 1);  // another member saw the same break
  EXPECT_EQ(gen("gen_a", 0), 1);  // a late member joins generation 1
  EXPECT_EQ(gen("gen_b", 0), 0);  // per base key
  // Members raising the counter at once end on the highest value, whatever the order.
  RunMembers(8, [&](int rank) { gen("gen_c", rank + 1); });
  EXPECT_EQ(gen("gen_c", 0), 8);
}

INSTANTIATE_TEST_SUITE_P(BothImpls, PeerGroupImplTest, ::testing::Values(Impl::kFake, Impl::kGloo),
                         [](const auto& info) { return ImplName(info.param); });

TEST(InProcessPeerGroupTest, KillFailsAWaitingMemberAtOnce) {
  InProcessPeerGroupFactory factory;
  RunMembers(2, [&](int rank) {
    auto group = factory.Create("kill", rank, 2, absl::Now() + kCreateDeadline);
    ASSERT_THAT(group, IsOk());
    if (rank == 1) {
      absl::SleepFor(absl::Milliseconds(50));  // rank 0 is waiting in its reduction by now
      factory.Kill("kill", 1);
      std::vector<double> values = {1.0};
      EXPECT_THAT((*group)->AllReduceSum(values, absl::Now() + absl::Seconds(10)),
                  StatusIs(absl::StatusCode::kUnavailable));
      return;
    }
    const absl::Time start = absl::Now();
    std::vector<double> values = {1.0};
    EXPECT_THAT((*group)->AllReduceSum(values, start + absl::Seconds(10)), StatusIs(absl::StatusCode::kUnavailable));
    EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  });
}

TEST(InProcessPeerGroupTest, KillBeforeJoiningFailsEveryCreate) {
  InProcessPeerGroupFactory factory;
  factory.Kill("killed_early", 2);
  RunMembers(3, [&](int rank) {
    EXPECT_THAT(factory.Create("killed_early", rank, 3, absl::Now() + absl::Seconds(10)),
                StatusIs(absl::StatusCode::kUnavailable));
  });
}

TEST(InProcessPeerGroupTest, ARankJoinsAKeyOnce) {
  InProcessPeerGroupFactory factory;
  RunMembers(2, [&](int rank) {
    auto group = factory.Create("once", rank, 2, absl::Now() + kCreateDeadline);
    ASSERT_THAT(group, IsOk());
  });
  EXPECT_THAT(factory.Create("once", 0, 2, absl::Now() + absl::Seconds(1)),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(GlooPeerGroupTest, ANewGenerationOnTheSameKvConnectsAfresh) {
  InMemoryKvClient kv;
  GlooPeerGroupFactory factory(&kv);
  for (int generation = 0; generation < 3; ++generation) {
    // Same job, new generation: the old addresses stay in the KV and must not be used.
    const std::string key = absl::StrCat("job7/epoch1/gen", generation);
    RunMembers(3, [&](int rank) {
      auto group = factory.Create(key, rank, 3, absl::Now() + kCreateDeadline);
      ASSERT_THAT(group, IsOk());
      std::vector<double> values = {static_cast<double>(generation)};
      ASSERT_THAT((*group)->AllReduceSum(values, absl::Now() + absl::Seconds(10)), IsOk());
      EXPECT_EQ(values[0], 3.0 * generation);
    });
  }
}

TEST(GlooPeerGroupTest, SizeOneTouchesNeitherKvNorNetwork) {
  GlooPeerGroupFactory factory(nullptr);
  auto group = factory.Create("alone", 0, 1, absl::Now() + absl::Seconds(1));
  ASSERT_THAT(group, IsOk());
  std::vector<double> values = {0.1, 1e16};
  EXPECT_THAT((*group)->AllReduceSum(values, absl::Now() + absl::Seconds(1)), IsOk());
  EXPECT_EQ(values, (std::vector<double>{0.1, 1e16}));
}

// A KV that is down: Put and Get fail.
class UnreachableKvClient : public KvClient {
 public:
  absl::Status Put(const std::string&, const std::string&, absl::Duration) override {
    return absl::UnavailableError("coordinator unreachable");
  }
  absl::StatusOr<std::string> Get(const std::string&, absl::Time) override {
    return absl::UnavailableError("coordinator unreachable");
  }
  absl::StatusOr<int64_t> RaiseCounter(const std::string&, int64_t, absl::Time) override {
    return absl::UnavailableError("coordinator unreachable");
  }
};

TEST(GlooPeerGroupTest, KvFailureIsUnavailableNotAnException) {
  UnreachableKvClient kv;
  GlooPeerGroupFactory factory(&kv);
  EXPECT_THAT(factory.Create("kv_down", 0, 2, absl::Now() + absl::Seconds(5)),
              StatusIs(absl::StatusCode::kUnavailable, ::testing::HasSubstr("coordinator unreachable")));
}

TEST(GlooPeerGroupTest, UnusableHostnameIsFailedPrecondition) {
  InMemoryKvClient kv;
  GlooPeerGroupOptions options;
  options.hostname = "no-such-host.invalid";
  GlooPeerGroupFactory factory(&kv, options);
  EXPECT_THAT(factory.Create("bad_host", 0, 2, absl::Now() + absl::Seconds(5)),
              StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST(GlooPeerGroupTest, ListensOnANamedInterface) {
  InMemoryKvClient kv;
  GlooPeerGroupOptions options;
  options.interface = "lo";
  GlooPeerGroupFactory factory(&kv, options);
  RunMembers(2, [&](int rank) {
    auto group = factory.Create("interface_lo", rank, 2, absl::Now() + kCreateDeadline);
    ASSERT_THAT(group, IsOk());
    std::vector<float> max = {static_cast<float>(rank)};
    ASSERT_THAT((*group)->AllReduceMax(max, absl::Now() + absl::Seconds(10)), IsOk());
    EXPECT_EQ(max[0], 1.0f);
  });
}

TEST(GlooPeerGroupTest, UnknownInterfaceIsFailedPrecondition) {
  InMemoryKvClient kv;
  GlooPeerGroupOptions options;
  options.interface = "nosuchif0";
  GlooPeerGroupFactory factory(&kv, options);
  EXPECT_THAT(factory.Create("bad_interface", 0, 2, absl::Now() + absl::Seconds(5)),
              StatusIs(absl::StatusCode::kFailedPrecondition));
}

}  // namespace
}  // namespace mainstay::peer
