// libFuzzer target: the fuzz input is a sequence of PushGrad streams against a real in-process
// ShardDaemon holding one small job (2 ranks, both shards of every bucket on this daemon, a job
// token). Each stream is a header whose fields come from the input (job, token, epoch, bucket,
// shard, step, rank, kind, dtype, total_bytes, num_contributors, crc32c or crc32c_follows with a
// trailer, loss_scale), then
// chunks with offsets and sizes from the input (in order or not, overlapping, short, over the
// end, not whole elements, garbage bytes), then Finish or an abandoned stream. Stream i starts
// from the i-th push of a correct trainer (initial parameters, then the gradients of steps 0, 1,
// ...) and the input changes fields of it, so an input of zeros trains correctly; whenever the
// pushes stored so far complete a step, every rank that pushed calls FinishStep and the step
// runs (garbage gradients included).
//
// Invariants (a violation aborts, so libFuzzer reports it with the input):
//  - no crash, leak or UB (built with -fsanitize=fuzzer,address,undefined by scripts/fuzz.sh);
//  - every failure is a code of the expected family (INVALID_ARGUMENT, NOT_FOUND,
//    FAILED_PRECONDITION, DATA_LOSS, UNAUTHENTICATED, PERMISSION_DENIED, UNAVAILABLE);
//  - AddChunk answers exactly as the protocol says (docs/protocol.md): OK for the next whole
//    elements in order within the shard and at most 4 MiB, INVALID_ARGUMENT otherwise, and a
//    failed stream stays failed;
//  - Finish of a stream whose chunks were all accepted and cover the shard is OK unless the
//    CRC-32C (the header's, or the trailer's) is wrong (DATA_LOSS) or an announced trailer is
//    missing (INVALID_ARGUMENT, unless a duplicate); a short stream is INVALID_ARGUMENT;
//  - crc32c_follows next to a header crc32c is refused at BeginPush;
//  - a successful Finish is a duplicate exactly when the same (kind, bucket, shard, step, rank)
//    was stored before in this run (initial parameters: per (bucket, shard));
//  - a failed or abandoned stream stores nothing: the same header pushed again with correct data
//    is accepted and is not a duplicate;
//  - a step is decided exactly when the pushes that succeeded complete it and its ranks finish
//    it: every FinishStep then returns OK, and no step is decided earlier.
// A fresh daemon per input keeps runs independent (libFuzzer's minimizer needs that).
#include <fuzzer/FuzzedDataProvider.h>
#include <openssl/sha.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "common/crc32c.h"
#include "common/job_spec.h"
#include "common/job_spec_proto.h"
#include "common/layout_proto.h"
#include "mainstay/v1/shard.pb.h"
#include "server/daemon/shard_daemon.h"
#include "tests/fuzz/fuzz_check.h"

namespace mainstay {
namespace {

constexpr char kJobId[] = "fuzz-job";
constexpr char kToken[] = "fuzz-token";
constexpr int64_t kEpoch = 1;
constexpr int64_t kMaxChunkBytes = 4 << 20;  // docs/protocol.md

using fuzz::Check;
using fuzz::Fail;

void CheckFamily(const absl::Status& s, const char* where) {
  switch (s.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kDataLoss:
    case absl::StatusCode::kUnauthenticated:
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kUnavailable:
      return;
    default:
      Fail(std::string(where) + " failed with an unexpected code: " + s.ToString());
  }
}

std::string Sha256(const std::string& text) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(text.data()), text.size(), digest);
  return std::string(reinterpret_cast<const char*>(digest), sizeof(digest));
}

// The job every input runs against: two buckets (bucket_numel 64), D = 2.
const ResolvedJob& TheJob() {
  static const ResolvedJob* job = [] {
    JobSpec spec;
    spec.name = "fuzz";
    spec.recipe = "bf16_with_fp8_current_scaling_mixed";
    spec.data_parallel_size = 2;
    spec.unreduced_pushes = true;  // both push modes are fuzzed
    spec.bucket_numel = 64;
    spec.tensors = {{"layers.0.mlp.fc1.weight", {16, 4}}, {"layers.0.norm.weight", {6}}, {"layers.1.w", {4, 4}}};
    absl::StatusOr<ResolvedJob> resolved = ResolveJob(spec);
    if (!resolved.ok()) Fail("the fuzzer's job does not resolve: " + resolved.status().ToString());
    return new ResolvedJob(*std::move(resolved));
  }();
  return *job;
}

v1::AssignShardRequest Assignment() {
  const ResolvedJob& job = TheJob();
  v1::AssignShardRequest req;
  req.set_job_id(kJobId);
  req.set_job_token_sha256(Sha256(kToken));
  req.set_placement_epoch(kEpoch);
  JobSpecToProto(job.spec, req.mutable_spec());
  LayoutToProto(job.layout, req.mutable_layout());
  req.mutable_from_trainer();
  for (const Bucket& b : job.layout.buckets) {
    for (const Shard& s : b.shards) {
      v1::ShardPlacement* p = req.mutable_placement()->add_shards();
      p->mutable_shard()->set_bucket(b.index);
      p->mutable_shard()->set_shard(s.rank);
      p->set_daemon_id("d0");
      v1::ShardRef* ref = req.add_shards();
      ref->set_bucket(b.index);
      ref->set_shard(s.rank);
    }
  }
  return req;
}

int ElementBytesOf(v1::ElementType t) {
  switch (t) {
    case v1::ELEMENT_TYPE_FP32: return 4;
    case v1::ELEMENT_TYPE_BF16:
    case v1::ELEMENT_TYPE_FP16: return 2;
    default: return 0;  // refused by BeginPush
  }
}

template <typename T>
T Pick(FuzzedDataProvider& in, std::initializer_list<T> choices) {
  const size_t i = in.ConsumeIntegralInRange<size_t>(0, choices.size() - 1);
  return *(choices.begin() + i);
}

struct Stream {
  v1::PushGradHeader header;
  struct Chunk {
    int64_t offset = 0;
    std::string data;
  };
  std::vector<Chunk> chunks;
  std::optional<uint32_t> trailer;  // a PushGradTrailer's CRC-32C, passed before Finish
  bool finish = true;
};

// True for the "right" choice `right` times in `of`. An exhausted input reads as 0, so short
// inputs make right choices and most streams reach the deeper checks.
bool Right(FuzzedDataProvider& in, int right, int of) { return in.ConsumeIntegralInRange(0, of - 1) < right; }

// The i-th push of a correct trainer schedule: initial parameters of every shard, then the
// gradients of step 0, 1, ... of every shard (rank = shard, reduced, FP32).
v1::PushGradHeader Canonical(int i) {
  const Layout& layout = TheJob().layout;
  const int num_shards = static_cast<int>(layout.buckets.size()) * 2;
  v1::PushGradHeader h;
  h.set_job_id(kJobId);
  h.set_job_token(kToken);
  h.set_placement_epoch(kEpoch);
  h.set_bucket((i % num_shards) / 2);
  h.set_shard(i % 2);
  h.set_rank(i % 2);
  h.set_kind(i < num_shards ? v1::PUSH_KIND_INITIAL_PARAMS : v1::PUSH_KIND_GRADIENT);
  h.set_step(i < num_shards ? -1 : i / num_shards - 1);
  h.set_dtype(v1::ELEMENT_TYPE_FP32);
  h.set_num_contributors(1);
  return h;
}

// Draws stream `i`: the canonical push with any field or chunk changed by the input. An input
// of zeros is a correct run that commits steps; each mutation breaks one thing.
Stream DrawStream(FuzzedDataProvider& in, int i) {
  const Layout& layout = TheJob().layout;
  Stream s;
  s.header = Canonical(i);
  v1::PushGradHeader& h = s.header;
  if (!Right(in, 15, 16)) h.set_job_id(Pick<const char*>(in, {"", "other-job", "fuzz-job "}));
  if (!Right(in, 15, 16)) h.set_job_token(Pick<const char*>(in, {"", "wrong", "fuzz-token\n"}));
  if (!Right(in, 15, 16)) h.set_placement_epoch(Pick<int64_t>(in, {0, kEpoch + 1, -1}));
  const int32_t num_buckets = static_cast<int32_t>(layout.buckets.size());
  switch (in.ConsumeIntegralInRange(0, 15)) {  // which push: another shard, step, rank or kind
    case 1: h.set_bucket(in.ConsumeIntegralInRange<int32_t>(0, num_buckets - 1)); break;
    case 2: h.set_shard(in.ConsumeIntegralInRange<int32_t>(0, 1)); break;
    case 3: h.set_rank(in.ConsumeIntegralInRange<int32_t>(0, 1)); break;
    case 4: h.set_step(in.ConsumeIntegralInRange<int64_t>(-1, 4)); break;
    case 5: h.set_kind(h.kind() == v1::PUSH_KIND_GRADIENT ? v1::PUSH_KIND_INITIAL_PARAMS : v1::PUSH_KIND_GRADIENT); break;
    case 6: h.set_num_contributors(Pick<int32_t>(in, {0, 2, 3, -1})); break;
    case 7: h.set_dtype(Pick(in, {v1::ELEMENT_TYPE_BF16, v1::ELEMENT_TYPE_FP16})); break;
    case 8:  // anything at all
      h.set_bucket(in.ConsumeIntegral<int32_t>());
      h.set_shard(in.ConsumeIntegral<int32_t>());
      h.set_rank(in.ConsumeIntegral<int32_t>());
      h.set_step(in.ConsumeIntegral<int64_t>());
      h.set_kind(static_cast<v1::PushKind>(in.ConsumeIntegralInRange(0, 5)));
      h.set_dtype(static_cast<v1::ElementType>(in.ConsumeIntegralInRange(0, 20)));
      h.set_num_contributors(in.ConsumeIntegral<int32_t>());
      break;
    case 9: h.set_loss_scale(Pick<double>(in, {1.0, 2.0, -1.0, 65536.0})); break;
    default: break;
  }

  // The shard's size as the header would need it (when bucket and dtype are valid).
  int64_t numel = 0;
  if (h.bucket() >= 0 && h.bucket() < num_buckets) numel = layout.buckets[static_cast<size_t>(h.bucket())].shard_numel;
  const int elem = ElementBytesOf(h.dtype());
  const int64_t total = numel * elem;
  switch (in.ConsumeIntegralInRange(0, 7)) {
    case 6: h.set_total_bytes(total + Pick<int64_t>(in, {-4, -2, -1, 1, 2, 4})); break;
    case 7: h.set_total_bytes(in.ConsumeIntegral<int64_t>()); break;
    default: h.set_total_bytes(total);
  }

  // Chunks: mostly the next elements, sometimes anywhere, of any size.
  const int num_chunks = in.ConsumeIntegralInRange(1, 6);
  int64_t next = 0;  // elements, as a well-behaved client would count them
  const int unit = elem > 0 ? elem : 1;
  for (int c = 0; c < num_chunks; ++c) {
    Stream::Chunk chunk;
    switch (in.ConsumeIntegralInRange(0, 7)) {
      case 6: chunk.offset = in.ConsumeIntegralInRange<int64_t>(-1, numel + 1); break;  // out of order, overlapping
      case 7: chunk.offset = in.ConsumeIntegral<int64_t>(); break;
      default: chunk.offset = next;
    }
    const int64_t rest = std::max<int64_t>(numel - next, 0);
    size_t bytes = 0;
    switch (in.ConsumeIntegralInRange(0, 15)) {
      case 0:
      case 1:
      case 2:
      case 3: bytes = static_cast<size_t>(rest) * unit; break;  // the rest
      case 4:
      case 5:
      case 6:
      case 7:
      case 8: bytes = static_cast<size_t>(in.ConsumeIntegralInRange<int64_t>(1, std::max<int64_t>(rest, 1))) * unit; break;
      case 9: bytes = static_cast<size_t>(rest + 1) * unit; break;                    // past the end
      case 10: bytes = static_cast<size_t>(kMaxChunkBytes) + unit; break;             // over the protocol's limit
      default: bytes = in.ConsumeIntegralInRange<size_t>(0, 9); break;                // tiny, not whole elements
    }
    // Payload: the input's bytes (garbage, NaN, whatever), padded with a pattern.
    chunk.data = in.ConsumeBytesAsString(std::min<size_t>(bytes, 64));
    chunk.data.resize(bytes, '\x3c');
    if (chunk.offset == next) next += static_cast<int64_t>(bytes) / unit;
    s.chunks.push_back(std::move(chunk));
    if (next >= numel && Right(in, 3, 4)) break;  // complete: usually the stream ends here
  }
  uint32_t crc = 0;
  for (const Stream::Chunk& c : s.chunks) crc = Crc32cExtend(crc, c.data.data(), c.data.size());
  switch (in.ConsumeIntegralInRange(0, 7)) {
    case 0: h.set_crc32c(crc); break;
    case 1: h.set_crc32c(0); break;
    case 2:
    case 3: h.set_crc32c(in.ConsumeIntegral<uint32_t>()); break;
    // After the payload (crc32c_follows): right, wrong, missing, or announced next to a header CRC.
    case 4:
      h.set_crc32c_follows(true);
      s.trailer = crc;
      break;
    case 5:
      h.set_crc32c_follows(true);
      s.trailer = in.ConsumeIntegral<uint32_t>();
      break;
    case 6: h.set_crc32c_follows(true); break;
    default:
      h.set_crc32c_follows(true);
      h.set_crc32c(crc | 1);
      s.trailer = crc;
  }
  s.finish = Right(in, 7, 8);
  return s;
}

// How often each outcome was reached, printed at exit with MAINSTAY_FUZZ_STATS=1 (to see that
// the inputs get past the header checks).
struct Outcomes {
  int64_t refused_headers = 0, sessions = 0, chunks_taken = 0, chunks_refused = 0, stored = 0, duplicates = 0,
          data_loss = 0, refused_finishes = 0, abandoned = 0, probes = 0, commits = 0;
  ~Outcomes() {
    if (std::getenv("MAINSTAY_FUZZ_STATS") == nullptr) return;
    std::fprintf(stderr,
                 "refused headers %lld, sessions %lld, chunks taken %lld / refused %lld, stored %lld, duplicates %lld, "
                 "DATA_LOSS %lld, refused finishes %lld, abandoned %lld, probes %lld, commits %lld\n",
                 static_cast<long long>(refused_headers), static_cast<long long>(sessions),
                 static_cast<long long>(chunks_taken), static_cast<long long>(chunks_refused),
                 static_cast<long long>(stored), static_cast<long long>(duplicates), static_cast<long long>(data_loss),
                 static_cast<long long>(refused_finishes), static_cast<long long>(abandoned),
                 static_cast<long long>(probes), static_cast<long long>(commits));
  }
};
Outcomes outcomes;

using Key = std::tuple<int, int32_t, int32_t, int64_t, int32_t>;  // kind, bucket, shard, step, rank

Key KeyOf(const v1::PushGradHeader& h) {
  if (h.kind() == v1::PUSH_KIND_INITIAL_PARAMS) return {h.kind(), h.bucket(), h.shard(), -1, 0};
  return {h.kind(), h.bucket(), h.shard(), h.step(), h.rank()};
}

// What the daemon holds, as the streams that succeeded say.
struct Model {
  std::set<Key> stored;
  std::set<std::pair<int32_t, int32_t>> initial;  // (bucket, shard) with initial parameters
  struct Contributions {
    int32_t expected = 1;
    std::set<int32_t> ranks;
  };
  std::map<int64_t, std::map<std::pair<int32_t, int32_t>, Contributions>> grads;  // step -> (bucket, shard) -> ..
  int64_t next_step = 0;  // the step a commit would decide

  void Store(const v1::PushGradHeader& h) {
    stored.insert(KeyOf(h));
    if (h.kind() == v1::PUSH_KIND_INITIAL_PARAMS) {
      initial.insert({h.bucket(), h.shard()});
    } else {
      Contributions& c = grads[h.step()][{h.bucket(), h.shard()}];
      c.expected = h.num_contributors() == 0 ? 1 : h.num_contributors();
      c.ranks.insert(h.rank());
    }
  }
  // The ranks that must call FinishStep for next_step, when every shard has all its pushes.
  std::optional<std::set<int32_t>> ReadyRanks(int num_shards) const {
    if (static_cast<int>(initial.size()) != num_shards) return std::nullopt;
    auto it = grads.find(next_step);
    if (it == grads.end() || static_cast<int>(it->second.size()) != num_shards) return std::nullopt;
    std::set<int32_t> ranks;
    for (const auto& [key, c] : it->second) {
      if (static_cast<int32_t>(c.ranks.size()) != c.expected) return std::nullopt;
      ranks.insert(c.ranks.begin(), c.ranks.end());
    }
    return ranks;
  }
};

// Runs one stream and records in `model` what it stored (Finish OK, not a duplicate). When the
// header was accepted but the stream failed or was abandoned, pushes the same header again with
// correct data: it must be accepted and must not be a duplicate (nothing was stored).
void RunStream(daemon::ShardDaemon& d, const Stream& s, Model& model) {
  const v1::PushGradHeader& h = s.header;
  absl::StatusOr<std::unique_ptr<daemon::PushSession>> session = d.BeginPush(h);
  if (!session.ok()) {
    CheckFamily(session.status(), "BeginPush");
    ++outcomes.refused_headers;
    return;
  }
  // Accepted: the header must have been one a correct trainer could send.
  const Layout& layout = TheJob().layout;
  Check(h.job_id() == kJobId && h.job_token() == kToken, "BeginPush accepted a wrong job or token");
  Check(h.bucket() >= 0 && h.bucket() < static_cast<int32_t>(layout.buckets.size()), "BeginPush accepted a bad bucket");
  Check(h.shard() >= 0 && h.shard() < 2 && h.rank() >= 0 && h.rank() < 2, "BeginPush accepted a bad shard or rank");
  const int elem = ElementBytesOf(h.dtype());
  Check(elem > 0, "BeginPush accepted dtype " + v1::ElementType_Name(h.dtype()));
  const int64_t numel = layout.buckets[static_cast<size_t>(h.bucket())].shard_numel;
  Check(h.total_bytes() == numel * elem, "BeginPush accepted a wrong total_bytes");
  Check(h.placement_epoch() <= kEpoch, "BeginPush accepted a future epoch");
  Check(!h.crc32c_follows() || h.crc32c() == 0, "BeginPush accepted crc32c_follows next to a header crc32c");
  ++outcomes.sessions;

  int64_t received = 0;
  bool failed = false;
  std::string payload;
  for (const Stream::Chunk& c : s.chunks) {
    const absl::Status st = (*session)->AddChunk(c.offset, c.data);
    const int64_t n = static_cast<int64_t>(c.data.size()) / elem;
    const bool valid = !failed && c.offset == received && !c.data.empty() && c.data.size() % elem == 0 &&
                       received + n <= numel && static_cast<int64_t>(c.data.size()) <= kMaxChunkBytes;
    if (valid) {
      Check(st.ok(), "AddChunk refused a valid chunk: " + st.ToString());
      received += n;
      payload += c.data;
      ++outcomes.chunks_taken;
    } else {
      Check(st.code() == absl::StatusCode::kInvalidArgument,
            "AddChunk answered an invalid chunk with " + st.ToString() + " (offset " + std::to_string(c.offset) +
                ", " + std::to_string(c.data.size()) + " bytes, received " + std::to_string(received) + " of " +
                std::to_string(numel) + ")");
      failed = true;
      ++outcomes.chunks_refused;
    }
  }
  const bool was_stored = model.stored.count(KeyOf(h)) > 0;
  bool stored_now = false;
  if (s.finish) {
    if (s.trailer.has_value()) (*session)->SetTrailingCrc32c(*s.trailer);
    absl::StatusOr<v1::PushGradResponse> r = (*session)->Finish();
    // The CRC-32C the push is checked against: the header's, or the trailer's (0: none).
    const uint32_t expected = h.crc32c_follows() ? s.trailer.value_or(0) : h.crc32c();
    if (failed || received != numel) {
      Check(r.status().code() == absl::StatusCode::kInvalidArgument,
            "Finish of a failed or short stream answered " + r.status().ToString());
    } else if (h.crc32c_follows() && !s.trailer.has_value() && !was_stored) {
      Check(r.status().code() == absl::StatusCode::kInvalidArgument,
            "Finish without the announced CRC-32C trailer answered " + r.status().ToString());
    } else {
      const uint32_t crc = Crc32c(payload.data(), payload.size());
      if (expected != 0 && expected != crc && !was_stored) {
        Check(r.status().code() == absl::StatusCode::kDataLoss, "a wrong CRC-32C answered " + r.status().ToString());
        ++outcomes.data_loss;
      } else {
        Check(r.ok(), "Finish of a complete stream failed: " + r.status().ToString());
        Check(r->duplicate() == was_stored, was_stored ? "a repeated push was stored again" : "a new push was called a duplicate");
        Check(r->received_elements() == numel, "received_elements is not the shard's size");
        stored_now = !r->duplicate();
        ++(stored_now ? outcomes.stored : outcomes.duplicates);
      }
    }
    if (!r.ok()) ++outcomes.refused_finishes;
  } else {
    ++outcomes.abandoned;
  }
  session->reset();  // the stream ends here (abandoned streams too)
  if (stored_now) {
    model.Store(h);
    return;
  }
  if (was_stored) return;
  // Nothing may have been stored: the same push done right is new.
  ++outcomes.probes;
  Stream good;
  good.header = h;
  std::string data(static_cast<size_t>(numel * elem), '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 7 + 1);
  good.header.set_crc32c(Crc32c(data.data(), data.size()));
  good.header.set_crc32c_follows(false);
  absl::StatusOr<std::unique_ptr<daemon::PushSession>> again = d.BeginPush(good.header);
  Check(again.ok(), "after a failed stream the same header is refused: " + again.status().ToString());
  Check((*again)->AddChunk(0, data).ok(), "after a failed stream a whole-shard chunk is refused");
  absl::StatusOr<v1::PushGradResponse> r = (*again)->Finish();
  Check(r.ok(), "after a failed stream the correct push failed: " + r.status().ToString());
  Check(!r->duplicate(), "a failed or abandoned stream stored something (the correct push is a duplicate)");
  model.Store(h);
}

// When the model says the next step has all its pushes, every rank that pushed finishes it (in
// parallel: FinishStep waits for the others); the step must then be decided.
void MaybeCommit(daemon::ShardDaemon& d, FuzzedDataProvider& in, Model& model) {
  const int num_shards = static_cast<int>(TheJob().layout.buckets.size()) * 2;
  const std::vector<v1::JobProgress> before = d.Progress();
  Check(before.size() == 1 && before[0].committed_step() == model.next_step - 1,
        "the daemon decided a step the successful pushes did not complete");
  const std::optional<std::set<int32_t>> ranks = model.ReadyRanks(num_shards);
  if (!ranks.has_value()) return;
  const double lr = in.ConsumeFloatingPointInRange<double>(0.0, 0.1);
  std::vector<absl::StatusOr<v1::StepStats>> results(ranks->size(), absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  size_t i = 0;
  for (int32_t rank : *ranks) {
    threads.emplace_back([&, rank, i] {
      v1::FinishStepRequest req;
      req.set_job_id(kJobId);
      req.set_job_token(kToken);
      req.set_placement_epoch(kEpoch);
      req.set_step(model.next_step);
      req.set_rank(rank);
      req.set_lr(lr);
      results[i] = d.FinishStep(req, absl::Now() + absl::Seconds(20));
    });
    ++i;
  }
  for (std::thread& t : threads) t.join();
  for (const auto& r : results) Check(r.ok(), "FinishStep of a complete step failed: " + r.status().ToString());
  const std::vector<v1::JobProgress> progress = d.Progress();
  Check(progress.size() == 1 && progress[0].committed_step() == model.next_step,
        "the step is not decided after every FinishStep returned");
  ++outcomes.commits;
  model.grads.erase(model.next_step);
  ++model.next_step;
}

}  // namespace
}  // namespace mainstay

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace mainstay;
  static const v1::AssignShardRequest* assign = new v1::AssignShardRequest(Assignment());
  FuzzedDataProvider in(data, size);
  daemon::ShardDaemonOptions options;
  options.peer_timeout = absl::Seconds(5);
  daemon::ShardDaemon d(options);
  d.set_daemon_id("d0");
  if (absl::StatusOr<v1::AssignShardResponse> r = d.AssignShard(*assign); !r.ok()) {
    Fail("AssignShard: " + r.status().ToString());
  }
  Model model;
  for (int i = 0; i < 32 && in.remaining_bytes() > 0; ++i) {
    const Stream s = DrawStream(in, i);
    RunStream(d, s, model);
    MaybeCommit(d, in, model);
  }
  d.Shutdown();
  return 0;
}
