// Push staging: a PushGrad stream from its header to its stored contribution (DESIGN.md
// section 8: validation before any byte is kept, idempotent duplicates, nothing stored unless
// every byte arrived and its CRC-32C matches).
#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/chunk_limits.h"
#include "common/crc32c.h"
#include "common/error_detail.h"
#include "common/status.h"
#include "server/daemon/job.h"

namespace mainstay::daemon {
namespace {

int ElementBytes(ElementType type) { return BitsOf(type) / 8; }

}  // namespace

absl::StatusOr<std::unique_ptr<PushSession>> Job::BeginPush(const v1::PushGradHeader& h) {
  MAINSTAY_RETURN_IF_ERROR(CheckToken(h.job_token()));
  auto session = std::make_unique<PushSession>();
  session->job_ = shared_from_this();
  session->header_ = h;
  if (h.num_contributors() == 0) session->header_.set_num_contributors(1);
  if (h.crc32c_follows() && (h.crc32c() != 0 || h.replica_copy())) {
    return absl::InvalidArgumentError(
        absl::StrCat("PushGrad: crc32c_follows announces the payload's CRC-32C after the payload, and the header ",
                     h.replica_copy() ? "is a replica_copy (which carries crc32c in the header)"
                                      : "carries one already (crc32c): set one or the other"));
  }
  absl::MutexLock lock(&mu_);
  if (h.replica_copy()) {
    MAINSTAY_RETURN_IF_ERROR(BeginTrainerCopyLocked(session->header_, *session));
    return session;
  }
  MAINSTAY_RETURN_IF_ERROR(CheckRoute(h.placement_epoch(), h.bucket(), h.shard()));
  const int64_t d = job_.layout.data_parallel_size;
  const int64_t numel = job_.layout.buckets[static_cast<size_t>(h.bucket())].shard_numel;
  ElementType dtype;
  switch (h.dtype()) {
    case v1::ELEMENT_TYPE_FP32: dtype = ElementType::kFloat32; break;
    case v1::ELEMENT_TYPE_BF16: dtype = ElementType::kBFloat16; break;
    case v1::ELEMENT_TYPE_FP16: dtype = ElementType::kFloat16; break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("PushGrad: dtype ", v1::ElementType_Name(h.dtype()),
                                                     " is not FP32, BF16 or FP16"));
  }
  if (h.rank() < 0 || h.rank() >= d) {
    return absl::InvalidArgumentError(absl::StrCat("PushGrad: rank ", h.rank(), " is outside [0, ", d, ")"));
  }
  const int32_t contributors = session->header_.num_contributors();
  const int64_t expected_bytes = numel * ElementBytes(dtype);
  if (h.total_bytes() != expected_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("PushGrad: total_bytes ", h.total_bytes(), " but ",
                                                   ShardName(h.bucket(), h.shard()), " holds ", numel, " elements = ",
                                                   expected_bytes, " bytes of ", ElementTypeName(dtype)));
  }
  const ShardState& state = *shards_.at({h.bucket(), h.shard()});
  bool duplicate = false;
  if (h.kind() == v1::PUSH_KIND_INITIAL_PARAMS) {
    if (h.step() != -1) return absl::InvalidArgumentError("PushGrad: initial parameters must have step -1");
    if (dtype != ElementType::kFloat32) return absl::InvalidArgumentError("PushGrad: initial parameters must be FP32");
    if (!restored_from_.empty()) {
      return ErrorWithDetail(absl::FailedPreconditionError(absl::StrCat(
          "PushGrad: job ", job_id_, " is restored from checkpoint ", restored_from_,
          "; it takes no initial parameters (pull the latest version instead)")));
    }
    if (version_ >= 0 || state.initialized) {
      return ErrorWithDetail(absl::FailedPreconditionError(absl::StrCat(
          "PushGrad: initial parameters of job ", job_id_, " were already taken (version ", version_, " exists)")));
    }
    auto it = pending_.find(-1);
    duplicate = (it != pending_.end() && it->second.shards.count({h.bucket(), h.shard()})) || executing_step_ == -1;
  } else if (h.kind() == v1::PUSH_KIND_GRADIENT) {
    if (h.step() < 0) return absl::InvalidArgumentError(absl::StrCat("PushGrad: step ", h.step(), " < 0"));
    if (contributors != 1 && contributors != d) {
      return absl::InvalidArgumentError(
          absl::StrCat("PushGrad: num_contributors ", contributors, " must be 1 (reduced) or D = ", d));
    }
    if (contributors > 1 && !job_.spec.unreduced_pushes) {
      // The daemons' memory was planned for one gradient buffer per shard and step.
      return absl::InvalidArgumentError(absl::StrCat(
          "PushGrad: num_contributors ", contributors, ": job ", job_id_,
          " takes reduced (reduce-scattered) pushes only; create it with \"unreduced_pushes\": true in its spec to "
          "push every rank's unreduced gradient"));
    }
    if (h.step() <= committed_step_ && committed_step_ >= 0) {
      return ErrorWithDetail(absl::FailedPreconditionError(
          absl::StrCat("PushGrad: step ", h.step(), " of job ", job_id_, " is already decided (committed step ",
                       committed_step_, ")")));
    }
    const int64_t first_open = std::max<int64_t>(next_step_, 0);
    if (rewound_ && h.step() != next_step_) return RewoundError("PushGrad", h.step());
    if (h.step() > first_open + 1) {
      return ErrorWithDetail(absl::FailedPreconditionError(
          absl::StrCat("PushGrad: step ", h.step(), " is ahead of job ", job_id_, ": the daemon takes steps ",
                       first_open, " and ", first_open + 1, " now")));
    }
    if (loss_scale_.config.dynamic && h.loss_scale() != 0.0 && h.loss_scale() != loss_scale_now_) {
      return ErrorWithDetail(absl::FailedPreconditionError(absl::StrCat(
          "PushGrad: loss_scale ", h.loss_scale(), " differs from the daemon's current ", loss_scale_now_)));
    }
    if (executing_step_ == h.step()) {
      if (!executing_keys_.count({h.bucket(), h.shard(), h.rank()})) return RunsWithoutPushError(h);
      duplicate = true;
    } else if (auto it = pending_.find(h.step()); it != pending_.end()) {
      auto sit = it->second.shards.find({h.bucket(), h.shard()});
      if (sit != it->second.shards.end()) {
        const ShardInputs& in = sit->second;
        if (in.by_rank.count(h.rank())) {
          duplicate = true;
        } else if (in.num_contributors != contributors) {
          return absl::InvalidArgumentError(absl::StrCat("PushGrad: num_contributors ", contributors,
                                                         " differs from the step's earlier pushes (",
                                                         in.num_contributors, ")"));
        } else if (static_cast<int32_t>(in.by_rank.size()) >= contributors) {
          return absl::InvalidArgumentError(absl::StrCat("PushGrad: ", ShardName(h.bucket(), h.shard()), " of step ",
                                                         h.step(), " already has all ", contributors,
                                                         " contributions"));
        } else if (in.loss_scale != (h.loss_scale() > 0.0 ? h.loss_scale() : 1.0)) {
          return absl::InvalidArgumentError(absl::StrCat("PushGrad: loss_scale ", h.loss_scale(),
                                                         " differs from the step's earlier pushes (", in.loss_scale, ")"));
        } else if (in.dtype != dtype) {
          return absl::InvalidArgumentError(absl::StrCat("PushGrad: dtype ", ElementTypeName(dtype),
                                                         " differs from the step's earlier pushes (",
                                                         ElementTypeName(in.dtype), ")"));
        }
      }
    }
  } else {
    return absl::InvalidArgumentError("PushGrad: kind must be PUSH_KIND_GRADIENT or PUSH_KIND_INITIAL_PARAMS");
  }
  session->numel_ = numel;
  session->elem_bytes_ = ElementBytes(dtype);
  session->duplicate_ = duplicate;
  session->track_crc_ = !duplicate && (h.crc32c() != 0 || h.crc32c_follows());
  session->expected_crc_ = h.crc32c();
  // No buffer yet: a stream that sends only its header holds no memory (PushSession::Reserve).
  return session;
}

std::vector<uint8_t> Job::TakeSpareBuffer(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  for (auto it = spare_buffers_.begin(); it != spare_buffers_.end(); ++it) {
    if (static_cast<int64_t>(it->size()) == bytes) {
      std::vector<uint8_t> spare = std::move(*it);
      spare_buffers_.erase(it);
      return spare;
    }
  }
  return {};
}

void PushSession::Reserve(int64_t bytes) {
  if (static_cast<int64_t>(buffer_.size()) >= bytes) return;
  const int64_t total = numel_ * elem_bytes_;
  if (buffer_.capacity() == 0) {
    // A buffer of an earlier step, if one fits: no allocation, no zero-fill, no page faults
    // (every byte is overwritten: a push is stored only once all of it arrived). Otherwise
    // address space for the whole payload, whose pages are touched only as chunks land.
    buffer_ = job_->TakeSpareBuffer(total);
    if (buffer_.empty()) buffer_.reserve(static_cast<size_t>(total));
    if (static_cast<int64_t>(buffer_.size()) >= bytes) return;
  }
  buffer_.resize(static_cast<size_t>(bytes));
}

std::span<uint8_t> PushSession::destination() {
  if (duplicate_) return {};
  Reserve(numel_ * elem_bytes_);  // these transports land the whole payload at once
  return std::span<uint8_t>(buffer_);
}

absl::Status PushSession::AddChunk(int64_t element_offset, absl::string_view data) {
  const std::span<const uint8_t> piece(reinterpret_cast<const uint8_t*>(data.data()), data.size());
  return AddChunk(element_offset, std::span<const std::span<const uint8_t>>(&piece, 1));
}

absl::Status PushSession::AddChunk(int64_t element_offset, std::span<const std::span<const uint8_t>> pieces) {
  size_t size = 0;
  for (const std::span<const uint8_t> piece : pieces) size += piece.size();
  if (failed_) return absl::InvalidArgumentError("PushGrad: the stream already failed");
  failed_ = true;
  if (element_offset != received_) {
    return absl::InvalidArgumentError(absl::StrCat("PushGrad: chunk at element ", element_offset, ", expected ",
                                                   received_, " (chunks must be in order without gaps)"));
  }
  if (size > static_cast<size_t>(kMaxChunkBytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("PushGrad: chunk of ", size, " bytes is over the protocol's ", kMaxChunkBytes, " bytes"));
  }
  if (size % static_cast<size_t>(elem_bytes_) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("PushGrad: chunk of ", size, " bytes is not whole ", elem_bytes_, "-byte elements"));
  }
  const int64_t n = static_cast<int64_t>(size) / elem_bytes_;
  if (n == 0 || received_ + n > numel_) {
    return absl::InvalidArgumentError(absl::StrCat("PushGrad: chunk of ", n, " elements at ", element_offset,
                                                   " overruns the shard of ", numel_, " elements"));
  }
  if (!duplicate_) {
    Reserve((received_ + n) * elem_bytes_);
    uint8_t* at = buffer_.data() + received_ * elem_bytes_;
    for (const std::span<const uint8_t> piece : pieces) {
      if (track_crc_) {
        crc_ = ::mainstay::Crc32cCopyExtend(crc_, at, piece.data(), piece.size());  // one pass for both
      } else if (!piece.empty()) {
        std::memcpy(at, piece.data(), piece.size());
      }
      at += piece.size();
    }
  }
  received_ += n;
  failed_ = false;
  return absl::OkStatus();
}

void PushSession::Landed(int64_t bytes) {
  const int64_t n = std::min(bytes / elem_bytes_, numel_ - received_);
  if (n <= 0 || duplicate_) return;
  if (track_crc_) {
    crc_ = ::mainstay::Crc32cExtend(crc_, buffer_.data() + received_ * elem_bytes_, static_cast<size_t>(n) * elem_bytes_);
  }
  received_ += n;
}

absl::StatusOr<v1::PushGradResponse> PushSession::Finish() {
  if (failed_) return absl::InvalidArgumentError("PushGrad: the stream failed; nothing was stored");
  if (duplicate_ && received_ == 0) received_ = numel_;  // a duplicate needs no payload (ucx, nccl send none)
  if (received_ != numel_) {
    return absl::InvalidArgumentError(absl::StrCat("PushGrad: the stream ended after ", received_, " of ", numel_,
                                                   " elements; nothing was stored"));
  }
  if (header_.crc32c_follows() && !duplicate_ && !trailer_received_) {
    return absl::InvalidArgumentError(
        "PushGrad: the header announced a CRC-32C trailer (crc32c_follows) and the stream ended without one; "
        "nothing was stored");
  }
  if (track_crc_ && expected_crc_ != 0 && crc_ != expected_crc_) {  // never tracked for a duplicate
    return absl::DataLossError(absl::StrCat("PushGrad: CRC-32C of the payload is ", crc_, ", the trainer sent ",
                                            expected_crc_, "; nothing was stored"));
  }
  return job_->StorePush(*this);
}

absl::Status Job::RunsWithoutPushError(const v1::PushGradHeader& h) const {
  // An attempt of the step that began without this push: one at an older placement, from before
  // this daemon became the shard's primary (a failover), which will not complete. The push is
  // for the next attempt, once this one ended: UNAVAILABLE makes the trainer retry it.
  return absl::UnavailableError(absl::StrCat("PushGrad: an attempt of step ", h.step(), " of job ", job_id_,
                                             " runs here without rank ", h.rank(), "'s push of ",
                                             ShardName(h.bucket(), h.shard()), " (it began at an older placement); "
                                             "retry once it ended"));
}

absl::StatusOr<v1::PushGradResponse> Job::StorePush(PushSession& session) {
  const v1::PushGradHeader& h = session.header_;
  v1::PushGradResponse response;
  response.set_received_elements(session.received_);
  absl::MutexLock lock(&mu_);
  if (session.replica_copy_) return StoreTrainerCopyLocked(session);
  if (session.duplicate_) {
    response.set_duplicate(true);
    return response;
  }
  // Re-check what may have changed while the data streamed in.
  MAINSTAY_RETURN_IF_ERROR(CheckRoute(h.placement_epoch(), h.bucket(), h.shard()));
  if (h.kind() == v1::PUSH_KIND_INITIAL_PARAMS ? version_ >= 0 : (committed_step_ >= h.step() && committed_step_ >= 0)) {
    return ErrorWithDetail(absl::FailedPreconditionError(
        absl::StrCat("PushGrad: step ", h.step(), " was decided while the push streamed in")));
  }
  if (executing_step_ == h.step()) {
    if (!executing_keys_.count({h.bucket(), h.shard(), h.rank()})) return RunsWithoutPushError(h);
    response.set_duplicate(true);
    return response;
  }
  failures_.erase(h.step());  // a step pushed again after a failure is a new attempt
  StepInputs& step = pending_[h.step()];
  if (step.first_push_ms == 0) step.first_push_ms = options_.clock->NowUnixMs();
  ShardInputs& in = step.shards[{h.bucket(), h.shard()}];
  if (in.by_rank.empty()) {
    in.num_contributors = h.kind() == v1::PUSH_KIND_INITIAL_PARAMS ? 1 : h.num_contributors();
    in.loss_scale = h.loss_scale() > 0.0 ? h.loss_scale() : 1.0;
    in.dtype = h.dtype() == v1::ELEMENT_TYPE_BF16   ? ElementType::kBFloat16
               : h.dtype() == v1::ELEMENT_TYPE_FP16 ? ElementType::kFloat16
                                                    : ElementType::kFloat32;
  }
  if (in.by_rank.count(h.rank()) || (h.kind() == v1::PUSH_KIND_INITIAL_PARAMS && !in.by_rank.empty())) {
    response.set_duplicate(true);  // a concurrent identical push won the race
    return response;
  }
  in.by_rank[h.rank()] = std::move(session.buffer_);
  if (in.num_contributors == 1) {
    in.crc32c = session.track_crc_ && session.expected_crc_ != 0 ? session.crc_ : 0;
    in.copies_sent = h.copies_sent();
  }
  response.set_contributions(static_cast<int32_t>(in.by_rank.size()));
  if (h.kind() != v1::PUSH_KIND_INITIAL_PARAMS) {
    CrashIfInjectedLocked(StepFault::Phase::kInput, h.step(),
                          [&] {
                            return absl::StrCat("with rank ", h.rank(), "'s push of step ", h.step(), " stored, not answered");
                          });
  }
  return response;
}

}  // namespace mainstay::daemon
