#include "server/grpc/data_streams.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/byte_patch.h"
#include "common/chunk_hash.h"
#include "common/crc32c.h"
#include "common/grpc_chunk.h"
#include "common/grpc_status.h"
#include "common/status.h"
#include "mainstay/v1/shard.grpc.pb.h"  // gRPC's SerializationTraits of protobuf messages
#include "server/grpc/waiters.h"

namespace mainstay::daemon {
namespace {

using grpc_server::CallDeadline;
using grpc_server::Calls;
using grpc_server::ToGrpcWithDetail;

// The chunk messages that PushGrad and PullParams read and write without protobuf's payload
// copies (common/grpc_chunk.h), as shard.proto numbers them.
constexpr int kGradChunkField = v1::PushGradRequest::kChunkFieldNumber;
constexpr int kParamChunkField = v1::PullParamsResponse::kDataFieldNumber;
constexpr int kScaleChunkField = v1::PullParamsResponse::kScalesFieldNumber;
static_assert(v1::GradChunk::kElementOffsetFieldNumber == 1 && v1::GradChunk::kDataFieldNumber == 2);
static_assert(v1::ParamChunk::kElementOffsetFieldNumber == 1 && v1::ParamChunk::kDataFieldNumber == 2);
static_assert(v1::ScaleChunk::kScaleOffsetFieldNumber == 1 && v1::ScaleChunk::kDataFieldNumber == 2);

// `buffer` parsed as a `Message`; the buffer is left as it is.
template <typename Message>
bool ParseMessage(const ::grpc::ByteBuffer& buffer, Message* out) {
  ::grpc::ByteBuffer copy(buffer);  // references to the same slices
  return ::grpc::SerializationTraits<Message>::Deserialize(&copy, out).ok();
}

// PushGrad: header first (validated before any data), then chunks into the session, then the
// CRC-32C trailer when the header announced one (crc32c_follows).
// A chunk's payload lands straight from gRPC's slices (common/grpc_chunk.h), not through a
// protobuf string; a chunk some other way encoded is parsed with protobuf.
class PushGradReactor final : public ::grpc::ServerReadReactor<::grpc::ByteBuffer> {
 public:
  PushGradReactor(ShardDaemon* core, Calls* calls, metrics::Counter* pushed_bytes, StepDrain* drain,
                  PushStreams* streams, ::grpc::CallbackServerContext* context, ::grpc::ByteBuffer* response)
      : core_(core),
        calls_(calls),
        pushed_bytes_(pushed_bytes),
        drain_(drain),
        streams_(streams),
        context_(context),
        response_(response) {
    if (!calls_->Enter()) {
      Finish(ShuttingDown());
      return;
    }
    entered_ = true;
    streams_->Open(context_);
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok && context_->IsCancelled()) {
      // By the trainer, or by PushStreams (idle, or replaced by a newer stream of this push).
      return End(
          absl::CancelledError("PushGrad: the stream was cancelled (by the trainer, after sending nothing "
                               "for the daemon's idle timeout, or by a newer stream of the same push); "
                               "nothing of it is stored"));
    }
    streams_->Touch(context_);
    if (!ok) {  // the client half-closed: the stream is complete
      if (session_ == nullptr) return End(absl::InvalidArgumentError("PushGrad: the stream had no header"));
      absl::StatusOr<v1::PushGradResponse> result = session_->Finish();
      if (result.ok()) {
        core_->connections()->Record(header_.job_id(), header_.rank(), v1::TRANSPORT_GRPC, context_->peer(), bytes_, 0);
        bool own = false;
        if (!::grpc::SerializationTraits<v1::PushGradResponse>::Serialize(*result, response_, &own).ok()) {
          return End(absl::InternalError("PushGrad: the response could not be serialized"));
        }
      }
      return End(result.status());
    }
    if (session_ != nullptr && !trailer_seen_ && DecodeChunk(request_, kGradChunkField, &chunk_)) {
      if (absl::Status s = session_->AddChunk(chunk_.offset, chunk_.pieces); !s.ok()) return End(s);
      Count(chunk_.bytes);
      chunk_.Release();  // the chunk's memory goes back to gRPC now, not at the next read
      request_.Clear();
      StartRead(&request_);
      return;
    }
    v1::PushGradRequest request;
    if (!ParseMessage(request_, &request)) {
      return End(absl::InvalidArgumentError("PushGrad: a message that is not a PushGradRequest"));
    }
    if (session_ == nullptr) {
      if (!request.has_header())
        return End(absl::InvalidArgumentError("PushGrad: the first message must be the header"));
      absl::StatusOr<std::unique_ptr<PushSession>> session = core_->BeginPush(request.header());
      if (!session.ok()) return End(session.status());
      if (drain_ != nullptr) {
        if (absl::Status s = drain_->AdmitPush(request.header().job_id(), request.header().step()); !s.ok()) {
          return End(s);  // the session is dropped: nothing of this push is stored
        }
      }
      session_ = *std::move(session);
      header_ = request.header();
      streams_->Keyed(context_, absl::StrCat(header_.job_id(), "/", header_.bucket(), "/", header_.shard(), "/",
                                             header_.step(), "/", header_.rank(), "/", header_.kind()));
    } else if (trailer_seen_) {
      return End(absl::InvalidArgumentError("PushGrad: a message after the CRC-32C trailer, which must be the last"));
    } else if (request.has_trailer()) {
      if (!header_.crc32c_follows()) {
        return End(absl::InvalidArgumentError(
            "PushGrad: a CRC-32C trailer that the header did not announce (crc32c_follows); nothing was stored"));
      }
      trailer_seen_ = true;
      session_->SetTrailingCrc32c(request.trailer().crc32c());
    } else {
      if (!request.has_chunk()) return End(absl::InvalidArgumentError("PushGrad: a second header in one stream"));
      if (absl::Status s = session_->AddChunk(request.chunk().element_offset(), request.chunk().data()); !s.ok()) {
        return End(s);
      }
      Count(static_cast<int64_t>(request.chunk().data().size()));
    }
    StartRead(&request_);
  }

  void OnDone() override {
    streams_->Close(context_);
    delete this;
  }

 private:
  void End(const absl::Status& status) {
    Finish(ToGrpcWithDetail(context_, status));
    if (entered_) calls_->Exit();
    entered_ = false;
  }
  void Count(int64_t payload) {
    if (pushed_bytes_ != nullptr) pushed_bytes_->Increment(static_cast<double>(payload));
    bytes_ += payload;
  }

  ShardDaemon* const core_;
  Calls* const calls_;
  metrics::Counter* const pushed_bytes_;  // null: no metrics
  StepDrain* const drain_;                // null: no graceful drain
  PushStreams* const streams_;            // not owned
  ::grpc::CallbackServerContext* const context_;
  ::grpc::ByteBuffer* const response_;
  ::grpc::ByteBuffer request_;
  ChunkView chunk_;  // the last chunk read (kept to reuse its vectors)
  std::unique_ptr<PushSession> session_;
  v1::PushGradHeader header_;  // of session_
  int64_t bytes_ = 0;          // payload received
  bool trailer_seen_ = false;  // the PushGradTrailer came: nothing may follow it
  bool entered_ = false;
};

// PullParams: parked until the version is decided (server/grpc/waiters.h: no thread while it
// waits), then the header, data chunks and scale chunks, each written when the previous one is
// done (no thread while it streams either). The payload bytes written go to `pulled_bytes`
// (null: no metrics).
class PullWriter final : public ::grpc::ServerWriteReactor<::grpc::ByteBuffer> {
 public:
  // `request` is the call's message, parsed here (INVALID_ARGUMENT when it is not a request).
  PullWriter(ShardDaemon* core, Calls* calls, grpc_server::Waiters* waiters, metrics::Counter* pulled_bytes,
             ::grpc::CallbackServerContext* context, const ::grpc::ByteBuffer& request)
      : core_(core), calls_(calls), pulled_bytes_(pulled_bytes), context_(context) {
    if (!calls_->Enter()) {
      Finish(ShuttingDown());
      return;
    }
    if (!ParseMessage(request, &request_)) {
      Calls* calls = calls_;
      Finish(::grpc::Status(::grpc::StatusCode::INVALID_ARGUMENT, "PullParams: not a PullParamsRequest"));
      calls->Exit();
      return;
    }
    entered_ = true;
    grpc_server::AnswerWhenReady<PullResult>(
        calls_, waiters, context_, request_.job_id(), CallDeadline(context_),
        [this] { return core_->PullParams(request_, absl::InfinitePast()); }, grpc_server::DeadlinePassed<PullResult>,
        [this](absl::StatusOr<PullResult> result) { Begin(std::move(result)); }, FromGrpcStatus(ShuttingDown()));
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(::grpc::Status(::grpc::StatusCode::CANCELLED, "PullParams: the client went away"));
      return;
    }
    if (pulled_bytes_ != nullptr && payload_ > 0) pulled_bytes_->Increment(static_cast<double>(payload_));
    WriteNext();
  }
  void OnDone() override {
    if (entered_) calls_->Exit();
    delete this;
  }

 private:
  void Begin(absl::StatusOr<PullResult> result) {
    if (!result.ok()) {
      Finish(ToGrpcWithDetail(context_, result.status()));
      return;
    }
    result_ = *std::move(result);
    const QuantizedShard& s = *result_.shard;
    chunk_ = ChunkBytes(request_.max_chunk_bytes());
    bits_ = Describe(s.format).bits_per_element;
    scale_entry_ = s.num_scales > 0 ? static_cast<int64_t>(s.scales.size()) / s.num_scales : 1;
    v1::PullParamsResponse first;
    *first.mutable_header() = PullHeaderOf(result_);
    if (result_.unchanged) {
      data_off_ = scale_off_ = INT64_MAX;  // the header says it all
    } else if (request_.delta_chunk_bytes() != 0) {
      absl::Status planned = PlanDelta(first.mutable_header());
      if (planned.ok() && result_.reader) {
        // A reader's delta is charged against the reader cap for its changed chunks whole (an
        // upper bound of what their patches send) and the scales it sends.
        const int64_t scales = scale_delta_.now != nullptr ? scale_delta_.WholeBytes(delta_chunk_)
                                                           : static_cast<int64_t>(result_.shard->scales.size());
        planned = core_->AdmitReaderBytes(request_.job_id(), data_delta_.WholeBytes(delta_chunk_) + scales);
      }
      if (!planned.ok()) {
        Finish(ToGrpcWithDetail(context_, planned));
        return;
      }
      data_off_ = static_cast<int64_t>(result_.shard->data.size());  // only the delta's chunks
    }
    Write(first);
  }

  void Write(const v1::PullParamsResponse& message) {
    bool own = false;
    message_.Clear();  // gRPC serializes only into an empty buffer
    const ::grpc::Status s = ::grpc::SerializationTraits<v1::PullParamsResponse>::Serialize(message, &message_, &own);
    if (!s.ok()) {
      Finish(s);
      return;
    }
    StartWrite(&message_);
  }

  // One array of a delta pull (the packed data, or the block scales): the chunks whose XXH3-64
  // differs from the reader's copy's, each sent whole or as a byte patch against `base` (the
  // reader's version, when this daemon still keeps it and the chunk there hashes as the reader's).
  struct DeltaPart {
    const std::vector<uint8_t>* now = nullptr;
    const std::vector<uint8_t>* base = nullptr;  // null: whole chunks
    const google::protobuf::RepeatedField<uint64_t>* have = nullptr;
    std::vector<int64_t> chunks;
    size_t next = 0;
    int64_t sent = 0;  // payload bytes written

    bool done() const { return next >= chunks.size(); }
    // The listed chunks' bytes: what the delta sends at most (patches send less).
    int64_t WholeBytes(int64_t chunk_bytes) const {
      int64_t total = 0;
      for (const int64_t c : chunks)
        total += std::min(chunk_bytes, static_cast<int64_t>(now->size()) - c * chunk_bytes);
      return total;
    }
    // The next chunk: its first byte, and its bytes in `now` or its byte patch against `base`.
    // Adds what it sends to `sent`.
    struct Chunk {
      int64_t begin = 0;
      std::span<const uint8_t> bytes;    // whole: inside `now`
      std::optional<std::string> patch;  // or this patch
    };
    Chunk Next(int64_t chunk_bytes) {
      const int64_t index = chunks[next++];
      Chunk c;
      c.begin = index * chunk_bytes;
      const auto n = static_cast<size_t>(std::min(chunk_bytes, static_cast<int64_t>(now->size()) - c.begin));
      c.bytes = std::span<const uint8_t>(now->data() + c.begin, n);
      if (base != nullptr) {
        const std::span<const uint8_t> was(base->data() + c.begin, n);
        if (ChunkHash64(was.data(), was.size()) == (*have)[static_cast<int>(index)]) {
          c.patch = EncodeBytePatch(was, c.bytes, n);
        }
      }
      sent += static_cast<int64_t>(c.patch.has_value() ? c.patch->size() : n);
      return c;
    }
  };

  // Lists the chunks of `now` whose hash is not the reader's (`have`, one per chunk, else
  // INVALID_ARGUMENT naming `what`) into `listed` and `part`.
  static absl::Status PlanPart(const std::vector<uint8_t>& now, const google::protobuf::RepeatedField<uint64_t>& have,
                               int64_t chunk, const char* what, google::protobuf::RepeatedField<int32_t>* listed,
                               DeltaPart* part) {
    const std::vector<uint64_t> hashes = ChunkHashes(now, chunk);
    if (have.size() != static_cast<int>(hashes.size())) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": ", have.size(), " hashes for the shard's ", hashes.size(),
                                                     " chunks of ", chunk, " bytes"));
    }
    part->now = &now;
    part->have = &have;
    for (size_t i = 0; i < hashes.size(); ++i) {
      if (hashes[i] != have[static_cast<int>(i)]) {
        listed->Add(static_cast<int32_t>(i));
        part->chunks.push_back(static_cast<int64_t>(i));
      }
    }
    return absl::OkStatus();
  }

  // A delta pull: the changed chunks of the data (and, when the reader hashed its scales, of the
  // block scales), listed in the header with the CRC-32C of the whole new data (and scales)
  // (docs/weight_serving.md, "Delta sync").
  absl::Status PlanDelta(v1::PullParamsHeader* header) {
    const QuantizedShard& s = *result_.shard;
    const int64_t chunk = request_.delta_chunk_bytes();
    if (chunk < 4096 || (chunk & (chunk - 1)) != 0 || chunk > kMaxChunkBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("delta_chunk_bytes: a power of two in [4096, ", kMaxChunkBytes, "], got ", chunk));
    }
    MAINSTAY_RETURN_IF_ERROR(PlanPart(s.data, request_.have_chunk_hashes(), chunk, "have_chunk_hashes",
                                      header->mutable_delta_chunks(), &data_delta_));
    header->set_delta(true);
    header->set_data_crc32c(Crc32c(s.data.data(), s.data.size()));
    if (!s.scales.empty() && request_.have_scale_chunk_hashes_size() > 0) {
      MAINSTAY_RETURN_IF_ERROR(PlanPart(s.scales, request_.have_scale_chunk_hashes(), chunk, "have_scale_chunk_hashes",
                                        header->mutable_delta_scale_chunks(), &scale_delta_));
      header->set_delta_scales(true);
      header->set_scales_crc32c(Crc32c(s.scales.data(), s.scales.size()));
      scale_off_ = static_cast<int64_t>(s.scales.size());  // only the delta's chunks
    }
    delta_chunk_ = chunk;
    if (request_.has_delta_since_version() && (!data_delta_.done() || !scale_delta_.done())) {
      base_ = BaseOfPatches();
      if (base_ != nullptr) {
        data_delta_.base = &base_->data;
        if (base_->scales.size() == s.scales.size()) scale_delta_.base = &base_->scales;
      }
    }
    return absl::OkStatus();
  }

  // The version the reader's copy holds (delta_since_version), when this daemon still keeps it:
  // the changed chunks whose hash in it is the reader's go as byte patches against it. Null
  // otherwise (evicted, skipped, or not this placement's): whole chunks, which are always right.
  std::shared_ptr<const QuantizedShard> BaseOfPatches() {
    std::shared_ptr<const QuantizedShard> base = core_->KeptVersion(request_, request_.delta_since_version());
    return base != nullptr && base->data.size() == result_.shard->data.size() ? base : nullptr;
  }

  void WriteNext() {
    const QuantizedShard& s = *result_.shard;
    const auto data_size = static_cast<int64_t>(s.data.size());
    const auto scales_size = static_cast<int64_t>(s.scales.size());
    // Whole chunks go out of the version's own bytes (common/grpc_chunk.h): the message holds the
    // version alive, and a version is reused only when nothing holds it (Job::NewSnapshot).
    if (!data_delta_.done() || !scale_delta_.done()) {
      const bool data = !data_delta_.done();
      DeltaPart::Chunk c = (data ? data_delta_ : scale_delta_).Next(delta_chunk_);
      const int64_t offset = data ? c.begin * 8 / bits_ : c.begin / scale_entry_;
      if (!c.patch.has_value()) {
        message_ = EncodeChunkShared(data ? kParamChunkField : kScaleChunkField, offset, c.bytes, result_.shard);
        payload_ = static_cast<int64_t>(c.bytes.size());
        StartWrite(&message_);
        return;
      }
      payload_ = static_cast<int64_t>(c.patch->size());
      v1::PullParamsResponse message;
      if (data) {
        message.mutable_data()->set_element_offset(offset);
        *message.mutable_data()->mutable_patch() = *std::move(c.patch);
      } else {
        message.mutable_scales()->set_scale_offset(offset);
        *message.mutable_scales()->mutable_patch() = *std::move(c.patch);
      }
      Write(message);
      return;
    }
    if (data_off_ < data_size) {
      const int64_t n = std::min(chunk_, data_size - data_off_);
      message_ = EncodeChunkShared(kParamChunkField, data_off_ * 8 / bits_,
                                   {s.data.data() + data_off_, static_cast<size_t>(n)}, result_.shard);
      data_off_ += n;
      payload_ = n;
    } else if (scale_off_ < scales_size) {
      const int64_t n = std::min(chunk_, scales_size - scale_off_);
      message_ = EncodeChunkShared(kScaleChunkField, scale_off_ / scale_entry_,
                                   {s.scales.data() + scale_off_, static_cast<size_t>(n)}, result_.shard);
      scale_off_ += n;
      payload_ = n;
    } else {
      if (!result_.unchanged) {
        const int64_t sent = delta_chunk_ == 0
                                 ? data_size + scales_size
                                 : data_delta_.sent + (scale_delta_.now != nullptr ? scale_delta_.sent : scales_size);
        core_->connections()->Record(request_.job_id(), request_.rank(), v1::TRANSPORT_GRPC, context_->peer(), 0, sent);
      }
      Finish(::grpc::Status::OK);
      return;
    }
    StartWrite(&message_);
  }

  ShardDaemon* const core_;
  Calls* const calls_;
  metrics::Counter* const pulled_bytes_;
  ::grpc::CallbackServerContext* const context_;
  v1::PullParamsRequest request_;  // set once, in the constructor
  bool entered_ = false;
  // Touched by one thread at a time: the first answer, then each OnWriteDone in turn.
  PullResult result_;
  ::grpc::ByteBuffer message_;  // the write in flight
  int64_t chunk_ = 0;
  int bits_ = 8;
  int64_t scale_entry_ = 1;
  int64_t data_off_ = 0;   // bytes of the data written
  int64_t scale_off_ = 0;  // bytes of the scales written
  int64_t payload_ = 0;    // payload bytes of the write in flight
  // A delta pull (PlanDelta): chunks of delta_chunk_ bytes (0: not a delta) of the data and
  // the scales to send, and the reader's version they may be patches against.
  int64_t delta_chunk_ = 0;
  DeltaPart data_delta_;
  DeltaPart scale_delta_;
  std::shared_ptr<const QuantizedShard> base_;
};

}  // namespace

int64_t ChunkBytes(int64_t requested) {
  const int64_t chunk = requested > 0 ? std::min(requested, kMaxChunkBytes) : kDefaultChunkBytes;
  return std::max<int64_t>(chunk - chunk % 8, 8);  // whole elements of every type
}

::grpc::Status ShuttingDown() { return ::grpc::Status(::grpc::StatusCode::UNAVAILABLE, "daemon is shutting down"); }

::grpc::ServerReadReactor<::grpc::ByteBuffer>* NewPushGradReactor(ShardDaemon* core, Calls* calls,
                                                                  metrics::Counter* pushed_bytes, StepDrain* drain,
                                                                  PushStreams* streams,
                                                                  ::grpc::CallbackServerContext* context,
                                                                  ::grpc::ByteBuffer* response) {
  return new PushGradReactor(core, calls, pushed_bytes, drain, streams, context, response);
}

::grpc::ServerWriteReactor<::grpc::ByteBuffer>* NewPullWriter(ShardDaemon* core, Calls* calls,
                                                              grpc_server::Waiters* waiters,
                                                              metrics::Counter* pulled_bytes,
                                                              ::grpc::CallbackServerContext* context,
                                                              const ::grpc::ByteBuffer& request) {
  return new PullWriter(core, calls, waiters, pulled_bytes, context, request);
}

}  // namespace mainstay::daemon
