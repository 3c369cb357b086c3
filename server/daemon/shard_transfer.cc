#include "server/daemon/shard_transfer.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/layout_proto.h"
#include "common/status.h"
#include "server/daemon/shard_daemon.h"

namespace mainstay::daemon {
namespace {

// `base`: bytes of the buffer written before these (the pending pushes share one buffer).
absl::Status WriteBuffer(v1::StateBuffer buffer, const uint8_t* bytes, int64_t size, int element_bytes,
                         int64_t chunk, const std::function<bool(const v1::FetchShardStateResponse&)>& write,
                         int64_t base = 0) {
  v1::FetchShardStateResponse message;
  for (int64_t off = 0; off < size; off += chunk) {
    const int64_t n = std::min<int64_t>(chunk, size - off);
    message.Clear();
    v1::ShardStateChunk& c = *message.mutable_chunk();
    c.set_buffer(buffer);
    c.set_element_offset((base + off) / element_bytes);
    c.set_data(bytes + off, static_cast<size_t>(n));
    if (!write(message)) return absl::CancelledError("FetchShardState: the reader went away");
  }
  return absl::OkStatus();
}

}  // namespace

kernels::StateMemory& HostCopyMemory() {
  static kernels::StateMemory* const memory = kernels::HostStateMemory(nullptr).release();
  return *memory;
}

absl::Status WriteShardState(const ShardStateCopy& copy, int64_t chunk_bytes,
                             const std::function<bool(const v1::FetchShardStateResponse&)>& write) {
  v1::FetchShardStateResponse message;
  v1::ShardStateHeader& h = *message.mutable_header();
  h.set_version(copy.version);
  h.set_committed_step(copy.committed_step);
  h.set_shard_numel(static_cast<int64_t>(copy.master.size()));
  h.set_moment_type(ElementTypeToProto(copy.moment_type));
  h.set_loss_scale(copy.scaling.loss_scale() > 0.0 ? copy.scaling.loss_scale() : 1.0);
  h.set_loss_scale_good_steps(copy.scaling.loss_scale_good_steps());
  h.set_loss_scale_hysteresis(copy.scaling.loss_scale_hysteresis_left());
  *h.mutable_scaling() = copy.scaling;
  if (copy.newest != nullptr) *h.mutable_newest() = PullHeaderOf(PullResult{copy.newest, false});
  if (copy.committed_stats.has_value()) *h.mutable_committed_stats() = *copy.committed_stats;
  for (const v1::StepDecision& d : copy.decisions) *h.add_decisions() = d;
  for (const PendingPushCopy& p : copy.pending) {
    v1::PendingPush& e = *h.add_pending();
    e.set_step(p.step);
    e.set_rank(p.rank);
    e.set_num_contributors(p.num_contributors);
    e.set_dtype(ElementTypeToProto(p.dtype));
    e.set_loss_scale(p.loss_scale);
    e.set_bytes(static_cast<int64_t>(p.payload.size()));
  }
  if (!write(message)) return absl::CancelledError("FetchShardState: the reader went away");
  const int mb = BitsOf(copy.moment_type) / 8;
  MAINSTAY_RETURN_IF_ERROR(WriteBuffer(v1::STATE_BUFFER_MASTER, reinterpret_cast<const uint8_t*>(copy.master.data()),
                                       static_cast<int64_t>(copy.master.size() * 4), 4, chunk_bytes, write));
  MAINSTAY_RETURN_IF_ERROR(WriteBuffer(v1::STATE_BUFFER_MOMENT1, copy.m.data(), static_cast<int64_t>(copy.m.size()),
                                       mb, chunk_bytes, write));
  MAINSTAY_RETURN_IF_ERROR(WriteBuffer(v1::STATE_BUFFER_MOMENT2, copy.v.data(), static_cast<int64_t>(copy.v.size()),
                                       mb, chunk_bytes, write));
  if (copy.newest != nullptr) {
    MAINSTAY_RETURN_IF_ERROR(WriteBuffer(v1::STATE_BUFFER_VERSION_DATA, copy.newest->data.data(),
                                         static_cast<int64_t>(copy.newest->data.size()), 1, chunk_bytes, write));
    MAINSTAY_RETURN_IF_ERROR(WriteBuffer(v1::STATE_BUFFER_VERSION_SCALES, copy.newest->scales.data(),
                                         static_cast<int64_t>(copy.newest->scales.size()), 1, chunk_bytes, write));
  }
  // The pending payloads, as one buffer: chunk offsets count from the first one's start.
  int64_t base = 0;
  for (const PendingPushCopy& p : copy.pending) {
    const int64_t size = static_cast<int64_t>(p.payload.size());
    MAINSTAY_RETURN_IF_ERROR(
        WriteBuffer(v1::STATE_BUFFER_PENDING_PUSHES, p.payload.data(), size, 1, chunk_bytes, write, base));
    base += size;
  }
  return absl::OkStatus();
}

absl::Status ShardStateReader::Add(const v1::FetchShardStateResponse& message) {
  if (message.has_header()) {
    if (have_header_) return absl::InvalidArgumentError("FetchShardState: a second header");
    have_header_ = true;
    header_ = message.header();
    const int64_t n = header_.shard_numel();
    if (n != 0 && n != shard_numel_) {
      return absl::DataLossError(absl::StrCat("FetchShardState: the copy has ", n, " elements, the layout's shard ",
                                              shard_numel_, " (the source's job differs?)"));
    }
    MAINSTAY_ASSIGN_OR_RETURN(copy_.moment_type, ElementTypeFromProto(header_.moment_type()));
    copy_.version = header_.version();
    copy_.committed_step = header_.committed_step();
    copy_.scaling = header_.scaling();
    if (header_.has_committed_stats()) copy_.committed_stats = header_.committed_stats();
    copy_.decisions.assign(header_.decisions().begin(), header_.decisions().end());
    MAINSTAY_RETURN_IF_ERROR(copy_.master.Reset(land_, n));
    data_.resize(static_cast<size_t>(header_.newest().total_data_bytes()));
    scales_.resize(static_cast<size_t>(header_.newest().total_scale_bytes()));
    int64_t pending_bytes = 0;
    for (const v1::PendingPush& p : header_.pending()) {
      PendingPushCopy e;
      e.step = p.step();
      e.rank = p.rank();
      e.num_contributors = p.num_contributors();
      MAINSTAY_ASSIGN_OR_RETURN(e.dtype, ElementTypeFromProto(p.dtype()));
      e.loss_scale = p.loss_scale();
      if (p.bytes() < 0 || p.bytes() % (BitsOf(e.dtype) / 8) != 0 || p.step() < -1 || p.num_contributors() < 1) {
        return absl::InvalidArgumentError(absl::StrCat("FetchShardState: pending push of rank ", p.rank(), " step ",
                                                       p.step(), " is malformed (", p.bytes(), " bytes, ",
                                                       p.num_contributors(), " contributors)"));
      }
      pending_bytes += p.bytes();
      copy_.pending.push_back(std::move(e));
    }
    pending_.resize(static_cast<size_t>(pending_bytes));
    return absl::OkStatus();
  }
  if (!have_header_) return absl::InvalidArgumentError("FetchShardState: a chunk before the header");
  const v1::ShardStateChunk& c = message.chunk();
  const int mb = BitsOf(copy_.moment_type) / 8;
  const size_t numel = copy_.master.size();
  uint8_t* base = nullptr;
  size_t size = 0;
  int element_bytes = 1;
  switch (c.buffer()) {
    case v1::STATE_BUFFER_MASTER:
      base = reinterpret_cast<uint8_t*>(copy_.master.data()), size = numel * 4, element_bytes = 4;
      break;
    case v1::STATE_BUFFER_MOMENT1:
      if (copy_.m.empty()) MAINSTAY_RETURN_IF_ERROR(copy_.m.Reset(land_, static_cast<int64_t>(numel) * mb));
      base = copy_.m.data(), size = copy_.m.size(), element_bytes = mb;
      break;
    case v1::STATE_BUFFER_MOMENT2:
      if (copy_.v.empty()) MAINSTAY_RETURN_IF_ERROR(copy_.v.Reset(land_, static_cast<int64_t>(numel) * mb));
      base = copy_.v.data(), size = copy_.v.size(), element_bytes = mb;
      break;
    case v1::STATE_BUFFER_VERSION_DATA:
      base = data_.data(), size = data_.size();
      break;
    case v1::STATE_BUFFER_VERSION_SCALES:
      base = scales_.data(), size = scales_.size();
      break;
    case v1::STATE_BUFFER_PENDING_PUSHES:
      base = pending_.data(), size = pending_.size();
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("FetchShardState: unknown buffer ", c.buffer()));
  }
  const int64_t off = c.element_offset() * element_bytes;
  int64_t& received = received_[c.buffer()];
  if (off != received || off + static_cast<int64_t>(c.data().size()) > static_cast<int64_t>(size)) {
    return absl::DataLossError(absl::StrCat("FetchShardState: chunk of buffer ", v1::StateBuffer_Name(c.buffer()),
                                            " at byte ", off, " (", c.data().size(), " bytes) does not follow byte ",
                                            received, " of ", size));
  }
  std::memcpy(base + off, c.data().data(), c.data().size());
  received += static_cast<int64_t>(c.data().size());
  return absl::OkStatus();
}

absl::StatusOr<ShardStateCopy> ShardStateReader::Finish(int32_t bucket, int32_t shard) {
  if (!have_header_) return absl::DataLossError("FetchShardState: the stream ended before its header");
  const int64_t numel = header_.shard_numel();
  const int64_t mb = BitsOf(copy_.moment_type) / 8;
  const int64_t want[kBuffers] = {0,
                                  numel * 4,
                                  numel * mb,
                                  static_cast<int64_t>(copy_.v.size()),
                                  static_cast<int64_t>(data_.size()),
                                  static_cast<int64_t>(scales_.size()),
                                  static_cast<int64_t>(pending_.size())};
  for (int b = 1; b < kBuffers; ++b) {
    if (received_[b] != want[b]) {
      return absl::DataLossError(absl::StrCat("FetchShardState: the stream ended after ", received_[b], " of ",
                                              want[b], " bytes of buffer ", v1::StateBuffer_Name(b)));
    }
  }
  if (copy_.m.empty()) MAINSTAY_RETURN_IF_ERROR(copy_.m.Reset(land_, numel * mb));  // an empty shard
  if (header_.has_newest()) {
    const v1::PullParamsHeader& h = header_.newest();
    auto q = std::make_shared<QuantizedShard>();
    q->version = h.version();
    q->bucket = bucket;
    q->shard = shard;
    MAINSTAY_ASSIGN_OR_RETURN(q->format, FormatFromProto(h.format()));
    q->elements = {h.elements().begin(), h.elements().end()};
    q->data = std::move(data_);
    q->has_scales = h.scale_type() != v1::ELEMENT_TYPE_UNSPECIFIED;
    if (q->has_scales) {
      MAINSTAY_ASSIGN_OR_RETURN(q->scale_type, ElementTypeFromProto(h.scale_type()));
    }
    q->num_scales = h.total_scales();
    q->scales = std::move(scales_);
    for (const v1::FragmentQuantization& f : h.fragments()) {
      FragmentMeta meta;
      meta.tensor = f.tensor();
      meta.elements = {f.elements().begin(), f.elements().end()};
      MAINSTAY_ASSIGN_OR_RETURN(meta.format, FormatFromProto(f.format()));
      meta.scale = f.scale();
      meta.scale_inv = f.scale_inv();
      meta.amax = f.amax();
      q->fragments.push_back(meta);
    }
    copy_.newest = std::move(q);
  }
  const uint8_t* at = pending_.data();
  for (int i = 0; i < header_.pending_size(); ++i) {
    const size_t n = static_cast<size_t>(header_.pending(i).bytes());
    copy_.pending[static_cast<size_t>(i)].payload.assign(at, at + n);
    at += n;
  }
  return std::move(copy_);
}

}  // namespace mainstay::daemon
