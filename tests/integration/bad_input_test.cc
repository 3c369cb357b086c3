// Bad pushes through the real mainstayd: a coordinator and one daemon as real processes, a
// trainer through the client library for the good traffic and a raw Shard stub for the bad
// (the client library would refuse to send these). Each case checks the status code the daemon
// answers and then that nothing was stored: the correct push of the same (bucket, shard, step,
// rank) is not a duplicate and the step commits to the masters of the unsharded reference.
// slice_test covers wrong size, dtype, bucket and token, duplicates and non-finite gradients.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/crc32c.h"
#include "common/grpc_status.h"
#include "common/job_spec.h"
#include "common/status.h"
#include "mainstay/client.h"
#include "mainstay/v1/shard.grpc.pb.h"
#include "tests/testing/reference_model.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/subprocess.h"

namespace mainstay {
namespace {

using ::mainstay::testing::GradValue;
using ::mainstay::testing::InitialValue;
using ::mainstay::testing::IsOk;
using ::mainstay::testing::ReadFileOrEmpty;
using ::mainstay::testing::ReferenceModel;
using ::mainstay::testing::StatusIs;
using ::mainstay::testing::Subprocess;
using ::mainstay::testing::TempDir;
using ::testing::HasSubstr;

constexpr absl::Duration kStartTimeout = absl::Seconds(60);
constexpr int64_t kMaxChunkBytes = 4 << 20;  // docs/protocol.md

float Lr(int64_t step) { return 1e-3f * static_cast<float>(step + 1); }

// D = 1, one bucket whose shard (5 MiB of FP32) holds more than one 4 MiB chunk.
JobSpec Spec(const std::string& name) {
  JobSpec spec;
  spec.name = name;
  spec.recipe = "bf16_mixed";
  spec.data_parallel_size = 1;
  spec.optimizer.max_grad_norm = 0.0f;  // no clipping: bit-exact comparison with the reference
  spec.optimizer.weight_decay = 0.0f;
  spec.tensors = {{"layers.0.mlp.fc1.weight", {1280, 1024}}, {"layers.0.norm.weight", {1024}}};
  return spec;
}

// The bucket's values: value(tensor, element) for every tensor (padding 0).
template <typename Fn>
std::vector<float> BucketValues(const Layout& layout, int32_t bucket, Fn value) {
  std::vector<float> out = *MakeBucketBuffer(layout, bucket);
  for (int32_t t : layout.buckets[static_cast<size_t>(bucket)].tensors) {
    const LayoutTensor& tensor = layout.tensors[static_cast<size_t>(t)];
    for (int64_t i = 0; i < tensor.numel; ++i) out[static_cast<size_t>(tensor.bucket_offset + i)] = value(t, i);
  }
  return out;
}

std::string Bytes(std::span<const float> values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
}

struct Chunk {
  int64_t element_offset = 0;
  std::string data;
  std::optional<uint32_t> trailer;  // set: a PushGradTrailer with this CRC-32C instead of a chunk
};

Chunk Trailer(uint32_t crc) { return Chunk{0, "", crc}; }

// `values` as 1 MiB chunks, the first at element `offset`.
std::vector<Chunk> InChunks(std::span<const float> values, int64_t offset = 0) {
  constexpr size_t kElements = 1 << 18;
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < values.size(); i += kElements) {
    chunks.push_back(
        {offset + static_cast<int64_t>(i), Bytes(values.subspan(i, std::min(kElements, values.size() - i))), {}});
  }
  return chunks;
}

std::vector<Chunk> Concat(std::vector<Chunk> a, const std::vector<Chunk>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// One PushGrad stream through a raw stub: the header, then `chunks` and trailers in their order
// (until the daemon ends the stream), then the end of the stream, or a cancelled call when `cancel_before_end`.
absl::Status RawPush(const std::string& address, const v1::PushGradHeader& header, const std::vector<Chunk>& chunks,
                     bool cancel_before_end = false) {
  auto stub = v1::Shard::NewStub(::grpc::CreateChannel(address, ::grpc::InsecureChannelCredentials()));
  ::grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  v1::PushGradResponse response;
  auto writer = stub->PushGrad(&context, &response);
  v1::PushGradRequest request;
  *request.mutable_header() = header;
  bool open = writer->Write(request);
  for (const Chunk& c : chunks) {
    if (!open) break;
    request.Clear();
    if (c.trailer.has_value()) {
      request.mutable_trailer()->set_crc32c(*c.trailer);
    } else {
      request.mutable_chunk()->set_element_offset(c.element_offset);
      request.mutable_chunk()->set_data(c.data);
    }
    open = writer->Write(request);
  }
  if (cancel_before_end) context.TryCancel();
  if (open && !cancel_before_end) writer->WritesDone();
  return FromGrpcStatus(writer->Finish());
}

class BadInputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = *TempDir::Create("mainstay-bad-input");
    auto coordinator = Subprocess::Start({{MAINSTAY_COORDINATOR_BIN, "--listen", "127.0.0.1:0", "--state-dir",
                                           dir_->File("state"), "--port-file", dir_->File("cport")},
                                          dir_->File("coordinator.log")});
    ASSERT_THAT(coordinator.status(), IsOk());
    coordinator_ = *std::move(coordinator);
    absl::StatusOr<int> port = testing::WaitForPortFile(dir_->File("cport"), *coordinator_, kStartTimeout);
    ASSERT_THAT(port.status(), IsOk());
    coordinator_address_ = absl::StrCat("127.0.0.1:", *port);
    auto d = Subprocess::Start({{MAINSTAYD_BIN, "--coordinator", coordinator_address_, "--listen", "127.0.0.1:0",
                                 "--node-name", "node0", "--threads", "1", "--metrics-listen", "off", "--memory-bytes",
                                 "4000000000", "--push-idle-timeout-ms", "2000", "--port-file", dir_->File("dport")},
                                dir_->File("daemon.log")});
    ASSERT_THAT(d.status(), IsOk());
    daemon_ = *std::move(d);
    ASSERT_THAT(testing::WaitForPortFile(dir_->File("dport"), *daemon_, kStartTimeout).status(), IsOk());

    ClientOptions o;
    o.coordinator = coordinator_address_;
    o.job_spec_json = JobSpecToJson(Spec("bad-input"));
    o.rank = 0;
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(o);
    ASSERT_THAT(client.status(), IsOk()) << Logs();
    client_ = *std::move(client);
    const JobPlacement placement = client_->placement();
    ASSERT_EQ(placement.daemons.size(), 1u);
    address_ = placement.daemons[0].address;

    // Version 0 and step 0, so step 1 is the next one and the trainer holds version 1.
    const Layout& layout = client_->layout();
    for (const Bucket& b : layout.buckets) {
      std::vector<float> init = BucketValues(layout, b.index, [](int32_t t, int64_t i) { return InitialValue(t, i); });
      ASSERT_THAT(client_->PushInitialParams(b.index, init, /*all_shards=*/true).Wait().status(), IsOk()) << Logs();
    }
    PushStep(0);
    ASSERT_THAT(client_->FinishStep(0, Lr(0), 0.0).status(), IsOk()) << Logs();
  }

  std::string Logs() const {
    return "--- coordinator\n" + ReadFileOrEmpty(dir_->File("coordinator.log")) + "--- daemon\n" +
           ReadFileOrEmpty(dir_->File("daemon.log"));
  }

  const Layout& layout() const { return client_->layout(); }
  int64_t shard_numel() const { return layout().buckets[0].shard_numel; }

  // The correct gradient of bucket 0 at `step` (D = 1: the shard is the whole bucket).
  std::vector<float> Grad(int64_t step) const {
    return BucketValues(layout(), 0, [&](int32_t t, int64_t i) { return GradValue(t, i, step); });
  }

  // The header a correct trainer sends for bucket 0 at `step`, with the payload's CRC-32C.
  v1::PushGradHeader Header(int64_t step) const {
    const std::vector<float> g = Grad(step);
    v1::PushGradHeader h;
    h.set_job_id(client_->job_id());
    h.set_job_token(client_->job_token());
    h.set_placement_epoch(client_->placement().epoch);
    h.set_bucket(0);
    h.set_shard(0);
    h.set_step(step);
    h.set_rank(0);
    h.set_kind(v1::PUSH_KIND_GRADIENT);
    h.set_dtype(v1::ELEMENT_TYPE_FP32);
    h.set_total_bytes(static_cast<int64_t>(g.size() * 4));
    h.set_crc32c(Crc32c(g.data(), g.size() * 4));
    return h;
  }

  // Every bucket's correct push of `step` through the client library; none may be a duplicate
  // (a duplicate would mean an earlier bad push was stored).
  void PushStep(int64_t step) {
    for (const Bucket& b : layout().buckets) {
      std::vector<float> g = BucketValues(layout(), b.index, [&](int32_t t, int64_t i) { return GradValue(t, i, step); });
      absl::StatusOr<PushResult> r = client_->PushGrad(b.index, step, ElementSpan::Fp32(g)).Wait();
      ASSERT_THAT(r.status(), IsOk()) << Logs();
      EXPECT_FALSE(r->duplicate) << "bucket " << b.index << " step " << step << ": an earlier bad push was stored";
    }
  }

  // Step 1 pushed correctly commits as version 2 with the reference's masters.
  void ExpectStepOneCommitsAsIfNothingHappened() {
    PushStep(1);
    absl::StatusOr<StepStats> stats = client_->FinishStep(1, Lr(1), 0.0);
    ASSERT_THAT(stats.status(), IsOk()) << Logs();
    EXPECT_FALSE(stats->skipped);
    EXPECT_EQ(stats->version, 2);
    ReferenceModel ref(*ResolveJob(Spec("bad-input")));
    ref.Step(0, Lr(0));
    ref.Step(1, Lr(1));
    absl::StatusOr<std::vector<float>> master = FetchMasters(0);
    ASSERT_THAT(master.status(), IsOk());
    for (int32_t t : layout().buckets[0].tensors) {
      const LayoutTensor& tensor = layout().tensors[static_cast<size_t>(t)];
      EXPECT_EQ(0, std::memcmp(master->data() + tensor.bucket_offset, ref.master(static_cast<size_t>(t)).data(),
                               static_cast<size_t>(tensor.numel) * 4))
          << "master of " << tensor.name;
    }
  }

  absl::StatusOr<std::vector<float>> FetchMasters(int32_t bucket) {
    auto stub = v1::Shard::NewStub(::grpc::CreateChannel(address_, ::grpc::InsecureChannelCredentials()));
    ::grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    v1::FetchShardStateRequest request;
    request.set_job_id(client_->job_id());
    request.mutable_shard()->set_bucket(bucket);
    request.mutable_shard()->set_shard(0);
    auto reader = stub->FetchShardState(&context, request);
    v1::FetchShardStateResponse message;
    std::vector<float> master;
    while (reader->Read(&message)) {
      if (message.has_header()) master.assign(static_cast<size_t>(message.header().shard_numel()), 0.0f);
      if (message.has_chunk() && message.chunk().buffer() == v1::STATE_BUFFER_MASTER) {
        std::memcpy(master.data() + message.chunk().element_offset(), message.chunk().data().data(),
                    message.chunk().data().size());
      }
    }
    MAINSTAY_RETURN_IF_ERROR(FromGrpcStatus(reader->Finish()));
    return master;
  }

  std::unique_ptr<TempDir> dir_;
  std::unique_ptr<Subprocess> coordinator_;
  std::unique_ptr<Subprocess> daemon_;
  std::string coordinator_address_;
  std::unique_ptr<Client> client_;
  std::string address_;  // the daemon's
};

TEST_F(BadInputTest, StreamEndingBeforeTotalBytesIsInvalidArgumentAndStoresNothing) {
  const std::vector<float> g = Grad(1);
  const size_t half = g.size() / 2;
  EXPECT_THAT(RawPush(address_, Header(1), InChunks(std::span(g).first(half))),
              StatusIs(absl::StatusCode::kInvalidArgument));
  // With no chunk at all.
  EXPECT_THAT(RawPush(address_, Header(1), {}), StatusIs(absl::StatusCode::kInvalidArgument));
  ExpectStepOneCommitsAsIfNothingHappened();
}

TEST_F(BadInputTest, StreamCancelledByTheTrainerMidwayStoresNothing) {
  const std::vector<float> g = Grad(1);
  const size_t half = g.size() / 2;
  EXPECT_THAT(RawPush(address_, Header(1), InChunks(std::span(g).first(half)), /*cancel_before_end=*/true),
              StatusIs(absl::StatusCode::kCancelled));
  ExpectStepOneCommitsAsIfNothingHappened();
}

TEST_F(BadInputTest, ChunkOverFourMebibytesIsInvalidArgumentAndStoresNothing) {
  const std::vector<float> g = Grad(1);
  const size_t big = static_cast<size_t>(kMaxChunkBytes) / 4 + 1;  // one element over the limit
  ASSERT_LT(big, g.size()) << "the shard must hold more than a maximal chunk";
  EXPECT_THAT(RawPush(address_, Header(1),
                      {{0, Bytes(std::span(g).first(big)), {}},
                       {static_cast<int64_t>(big), Bytes(std::span(g).subspan(big)), {}}}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  ExpectStepOneCommitsAsIfNothingHappened();
}

TEST_F(BadInputTest, PayloadCorruptedInTransitIsDataLossAndStoresNothing) {
  const std::vector<float> g = Grad(1);
  std::vector<Chunk> corrupt = InChunks(g);
  corrupt[1].data[12345] ^= 0x10;  // one flipped bit; the header carries the CRC-32C of the real data
  EXPECT_THAT(RawPush(address_, Header(1), corrupt), StatusIs(absl::StatusCode::kDataLoss));
  // Garbage: the header's CRC-32C matches nothing.
  const std::vector<float> garbage(g.size(), -1.5e30f);
  EXPECT_THAT(RawPush(address_, Header(1), InChunks(garbage)), StatusIs(absl::StatusCode::kDataLoss));
  ExpectStepOneCommitsAsIfNothingHappened();
}

// The CRC-32C after the payload (crc32c_follows, how the client library's grpc transport sends
// it): a wrong one is DATA_LOSS; a missing, unannounced, misplaced or second trailer, or one
// announced next to the header's own CRC, is INVALID_ARGUMENT. The correct form is what
// PushStep sends.
TEST_F(BadInputTest, CrcTrailerWrongMissingOrOutOfPlaceIsRefusedAndStoresNothing) {
  const std::vector<float> g = Grad(1);
  const uint32_t crc = Crc32c(g.data(), g.size() * 4);
  const std::vector<Chunk> chunks = InChunks(g);
  ASSERT_GE(chunks.size(), 2u);
  v1::PushGradHeader follows = Header(1);
  follows.clear_crc32c();
  follows.set_crc32c_follows(true);
  EXPECT_THAT(RawPush(address_, follows, Concat(chunks, {Trailer(crc ^ 0x100)})),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("CRC-32C of the payload")));
  std::vector<Chunk> corrupt = chunks;
  corrupt[1].data[777] ^= 0x01;
  EXPECT_THAT(RawPush(address_, follows, Concat(corrupt, {Trailer(crc)})), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(RawPush(address_, follows, chunks),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ended without one")));
  EXPECT_THAT(RawPush(address_, Header(1), Concat(chunks, {Trailer(crc)})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("did not announce")));
  std::vector<Chunk> misplaced(chunks.begin(), chunks.end() - 1);
  misplaced.push_back(Trailer(crc));
  misplaced.push_back(chunks.back());
  EXPECT_THAT(RawPush(address_, follows, misplaced),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("after the CRC-32C trailer")));
  EXPECT_THAT(RawPush(address_, follows, Concat(chunks, {Trailer(crc), Trailer(crc)})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("after the CRC-32C trailer")));
  v1::PushGradHeader both = Header(1);
  both.set_crc32c_follows(true);
  EXPECT_THAT(RawPush(address_, both, Concat(chunks, {Trailer(crc)})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("set one or the other")));
  ExpectStepOneCommitsAsIfNothingHappened();
}

TEST_F(BadInputTest, ChunksOutOfOrderAreInvalidArgumentAndStoreNothing) {
  const std::vector<float> g = Grad(1);
  const size_t half = g.size() / 2;
  // The second half first.
  EXPECT_THAT(RawPush(address_, Header(1),
                      Concat(InChunks(std::span(g).subspan(half), static_cast<int64_t>(half)), InChunks(std::span(g).first(half)))),
              StatusIs(absl::StatusCode::kInvalidArgument));
  // Overlapping: the first chunk sent twice.
  std::vector<Chunk> chunks = InChunks(g);
  chunks.insert(chunks.begin() + 1, chunks[0]);
  EXPECT_THAT(RawPush(address_, Header(1), chunks), StatusIs(absl::StatusCode::kInvalidArgument));
  // A gap: the second chunk left out.
  chunks = InChunks(g);
  chunks.erase(chunks.begin() + 1);
  EXPECT_THAT(RawPush(address_, Header(1), chunks), StatusIs(absl::StatusCode::kInvalidArgument));
  ExpectStepOneCommitsAsIfNothingHappened();
}

TEST_F(BadInputTest, StepTooFarAheadIsFailedPreconditionAndStoresNothing) {
  // Step 0 is committed: the daemon takes steps 1 and 2, not 3.
  const std::vector<float> g = Grad(3);
  v1::PushGradHeader h = Header(3);
  EXPECT_THAT(RawPush(address_, h, InChunks(g)), StatusIs(absl::StatusCode::kFailedPrecondition));
  // A step already committed is refused the same way.
  EXPECT_THAT(RawPush(address_, Header(0), InChunks(Grad(0))), StatusIs(absl::StatusCode::kFailedPrecondition));
  ExpectStepOneCommitsAsIfNothingHappened();
  // Now step 3 is open, and its push is new.
  EXPECT_THAT(RawPush(address_, h, InChunks(g)), IsOk());
}

TEST_F(BadInputTest, UnknownJobIsUnavailableAndStoresNothing) {
  // The daemon cannot tell a job it never heard of from one whose assignment is still on its
  // way (docs/daemon.md): UNAVAILABLE, and the trainer's deadline ends the retries.
  v1::PushGradHeader h = Header(1);
  h.set_job_id("no-such-job");
  EXPECT_THAT(RawPush(address_, h, InChunks(Grad(1))), StatusIs(absl::StatusCode::kUnavailable));
  ExpectStepOneCommitsAsIfNothingHappened();
}

TEST_F(BadInputTest, MissingTokenOrAnotherJobsTokenIsRefusedAndStoresNothing) {
  v1::PushGradHeader h = Header(1);
  h.clear_job_token();
  EXPECT_THAT(RawPush(address_, h, InChunks(Grad(1))), StatusIs(absl::StatusCode::kUnauthenticated));
  // A trainer of job B cannot write job A.
  ClientOptions o;
  o.coordinator = coordinator_address_;
  o.job_spec_json = JobSpecToJson(Spec("other-job"));
  o.rank = 0;
  absl::StatusOr<std::unique_ptr<Client>> other = Client::Connect(o);
  ASSERT_THAT(other.status(), IsOk()) << Logs();
  h.set_job_token((*other)->job_token());
  EXPECT_THAT(RawPush(address_, h, InChunks(Grad(1))), StatusIs(absl::StatusCode::kPermissionDenied));
  ExpectStepOneCommitsAsIfNothingHappened();
}

TEST_F(BadInputTest, SilentOrReplacedPushStreamsAreCancelledAndStoreNothing) {
  // Issue 18, item 7: one open stream per (job, bucket, shard, step, rank), and none silent for
  // longer than --push-idle-timeout-ms (2 s here).
  auto stub = v1::Shard::NewStub(::grpc::CreateChannel(address_, ::grpc::InsecureChannelCredentials()));
  struct Open {
    ::grpc::ClientContext context;
    v1::PushGradResponse response;
    std::unique_ptr<::grpc::ClientWriter<v1::PushGradRequest>> writer;
  };
  auto open = [&](const v1::PushGradHeader& h) {
    auto o = std::make_unique<Open>();
    o->context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
    o->writer = stub->PushGrad(&o->context, &o->response);
    v1::PushGradRequest request;
    *request.mutable_header() = h;
    EXPECT_TRUE(o->writer->Write(request));
    return o;
  };
  // A second stream of the same push replaces the first, which the daemon cancels.
  std::unique_ptr<Open> first = open(Header(1));
  absl::SleepFor(absl::Milliseconds(300));
  std::unique_ptr<Open> second = open(Header(1));
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_THAT(FromGrpcStatus(first->writer->Finish()), StatusIs(absl::StatusCode::kCancelled));
  // The newer one is alive; the trainer gives it up (nothing stored either).
  second->context.TryCancel();
  EXPECT_THAT(FromGrpcStatus(second->writer->Finish()), StatusIs(absl::StatusCode::kCancelled));
  // A stream that sends its header and then nothing is cancelled after the idle timeout.
  v1::PushGradHeader other = Header(1);
  other.set_bucket(static_cast<int32_t>(layout().buckets.size()) - 1);
  other.set_total_bytes(layout().buckets.back().shard_numel * 4);
  other.clear_crc32c();
  const absl::Time start = absl::Now();
  std::unique_ptr<Open> silent = open(other);
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (ReadFileOrEmpty(dir_->File("daemon.log")).find("PushGrad stream(s) that sent nothing") == std::string::npos &&
         absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_LT(absl::Now(), give_up) << "the silent stream was not cancelled\n" << Logs();
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(1900));
  EXPECT_THAT(FromGrpcStatus(silent->writer->Finish()), StatusIs(absl::StatusCode::kCancelled));
  ExpectStepOneCommitsAsIfNothingHappened();  // none of the three stored anything
}

TEST_F(BadInputTest, CheckpointPathsOutsideTheCoordinatorsDirectoryAreRefusedAndChangeNothing) {
  // The daemon writes and reads checkpoints only under the --checkpoint-dir the coordinator
  // named at registration; this coordinator has none, so every path is refused (issue 18, 4).
  auto stub = v1::Shard::NewStub(::grpc::CreateChannel(address_, ::grpc::InsecureChannelCredentials()));
  const std::string elsewhere = dir_->File("elsewhere");
  v1::WriteCheckpointRequest write;
  write.set_job_id(client_->job_id());
  write.set_placement_epoch(client_->placement().epoch);
  write.set_checkpoint_id("ck-1");
  write.set_directory_uri(elsewhere);
  write.set_committed_step(0);
  v1::WriteCheckpointResponse written;
  ::grpc::ClientContext write_context;
  EXPECT_THAT(FromGrpcStatus(stub->WriteCheckpoint(&write_context, write, &written)),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("no --checkpoint-dir")));
  EXPECT_FALSE(std::filesystem::exists(elsewhere)) << "nothing may be written";

  // A restore pointing at a manifest outside (here through '..') replaces nothing.
  v1::AssignShardRequest assign;
  assign.set_job_id(client_->job_id());
  assign.set_placement_epoch(client_->placement().epoch + 1);
  assign.mutable_from_checkpoint()->set_checkpoint_id("ck-1");
  assign.mutable_from_checkpoint()->set_manifest_uri(dir_->File("state/../elsewhere/MANIFEST"));
  v1::AssignShardResponse assigned;
  ::grpc::ClientContext assign_context;
  EXPECT_THAT(FromGrpcStatus(stub->AssignShard(&assign_context, assign, &assigned)),
              StatusIs(absl::StatusCode::kInvalidArgument));
  ExpectStepOneCommitsAsIfNothingHappened();
}

}  // namespace
}  // namespace mainstay
