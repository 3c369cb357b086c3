#include "client/src/pull_assembly.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/byte_patch.h"
#include "common/chunk_hash.h"
#include "common/crc32c.h"
#include "common/layout_proto.h"
#include "common/status.h"

namespace mainstay::client_internal {
namespace {

template <typename... Args>
absl::Status Violation(const Args&... args) {
  return absl::InternalError(absl::StrCat("daemon broke the PullParams protocol: ", args...));
}

// A header's list of a delta's chunks (ascending, each < `chunks`) into `out`.
absl::Status ListedChunks(const google::protobuf::RepeatedField<int32_t>& listed, int64_t chunks, const char* what,
                          std::vector<int32_t>* out) {
  int64_t last = -1;
  for (const int32_t c : listed) {
    if (c <= last || c >= chunks) return Violation(what, " ", c, " (of ", chunks, ", ascending)");
    last = c;
  }
  out->assign(listed.begin(), listed.end());
  return absl::OkStatus();
}

}  // namespace

ShardPullAssembler::ShardPullAssembler(const Layout& layout, int32_t bucket, int32_t shard,
                                       int64_t requested_version, std::span<uint8_t> data_out,
                                       bool verify_crc32c)
    : layout_(layout),
      bucket_(layout.buckets.at(bucket)),
      shard_(bucket_.shards.at(shard)),
      requested_version_(requested_version),
      data_out_(data_out),
      verify_crc32c_(verify_crc32c) {
  const FormatDescriptor& d = Describe(bucket_.format);
  scale_entry_bytes_ = d.has_block_scales() ? BitsOf(d.block_scale) / 8 : 0;
  result_.shard = shard;
}

absl::Status ShardPullAssembler::OnMessage(const v1::PullParamsResponse& message) {
  switch (message.msg_case()) {
    case v1::PullParamsResponse::kHeader:
      return OnHeader(message.header());
    case v1::PullParamsResponse::kData:
      return OnData(message.data());
    case v1::PullParamsResponse::kScales:
      return OnScales(message.scales());
    default:
      return Violation("empty message");
  }
}

absl::Status ShardPullAssembler::OnHeader(const v1::PullParamsHeader& h) {
  if (have_header_) return Violation("a second header");
  have_header_ = true;
  result_.version = h.version();
  result_.unchanged = h.unchanged();
  if (h.unchanged()) return absl::OkStatus();
  if (requested_version_ >= 0 && h.version() != requested_version_) {
    return Violation("version ", h.version(), " sent for requested version ", requested_version_);
  }
  absl::StatusOr<Format> format = FormatFromProto(h.format());
  if (!format.ok() || *format != bucket_.format) {
    return Violation("header.format ", v1::Format_Name(h.format()), " is not the bucket's ",
                     FormatName(bucket_.format));
  }
  if (h.elements().begin() != shard_.elements.begin || h.elements().end() != shard_.elements.end) {
    return Violation("header.elements [", h.elements().begin(), ", ", h.elements().end(), ") is not shard ",
                     shard_.rank, "'s [", shard_.elements.begin, ", ", shard_.elements.end, ")");
  }
  const int64_t data_bytes = DataBytes(bucket_.format, bucket_.shard_numel);
  if (h.total_data_bytes() != data_bytes || static_cast<int64_t>(data_out_.size()) != data_bytes) {
    return Violation("header.total_data_bytes ", h.total_data_bytes(), ", expected ", data_bytes);
  }
  if (h.fragments_size() != static_cast<int>(shard_.fragments.size())) {
    return Violation("header has ", h.fragments_size(), " fragments, the layout ", shard_.fragments.size());
  }
  int64_t scales = 0;
  result_.fragments.reserve(shard_.fragments.size());
  for (int i = 0; i < h.fragments_size(); ++i) {
    const v1::FragmentQuantization& q = h.fragments(i);
    const TensorFragment& f = shard_.fragments[i];
    if (q.tensor() != f.tensor || q.elements().begin() != f.elements.begin || q.elements().end() != f.elements.end) {
      return Violation("header.fragments[", i, "] is tensor ", q.tensor(), " [", q.elements().begin(), ", ",
                       q.elements().end(), "), the layout's is tensor ", f.tensor, " [", f.elements.begin, ", ",
                       f.elements.end, ")");
    }
    absl::StatusOr<Format> ff = FormatFromProto(q.format());
    if (!ff.ok() || *ff != layout_.tensors[f.tensor].format) {
      return Violation("header.fragments[", i, "].format ", v1::Format_Name(q.format()), " is not the tensor's");
    }
    FragmentQuantInfo info;
    info.tensor = f.tensor;
    info.elements = f.elements;
    info.bucket_offset = f.bucket_offset;
    info.scale = q.scale();
    info.scale_inv = q.scale_inv();
    info.amax = q.amax();
    info.scale_blocks = FragmentScaleBlocks(layout_, f);
    info.scale_offset = scales;
    scales += info.scale_blocks.size();
    result_.fragments.push_back(info);
  }
  const FormatDescriptor& d = Describe(bucket_.format);
  const v1::ElementType want_type =
      d.has_block_scales() ? ElementTypeToProto(d.block_scale) : v1::ELEMENT_TYPE_UNSPECIFIED;
  if (h.scale_type() != want_type) {
    return Violation("header.scale_type ", v1::ElementType_Name(h.scale_type()), ", expected ",
                     v1::ElementType_Name(want_type));
  }
  if (h.total_scales() != scales || h.total_scale_bytes() != scales * scale_entry_bytes_) {
    return Violation("header announces ", h.total_scales(), " scales in ", h.total_scale_bytes(),
                     " bytes, the layout gives ", scales, " in ", scales * scale_entry_bytes_);
  }
  result_.num_scales = scales;
  result_.scales.assign(scales * scale_entry_bytes_, 0);
  expected_crc_ = h.data_crc32c();
  if (h.delta()) {
    if (delta_chunk_bytes_ == 0) return Violation("a delta that was not asked for");
    if (h.data_crc32c() == 0) return Violation("a delta without the CRC-32C of the result");
    MAINSTAY_RETURN_IF_ERROR(ListedChunks(h.delta_chunks(), ChunkCount(data_bytes, delta_chunk_bytes_), "delta chunk",
                                          &delta_chunks_));
    delta_ = true;
  }
  if (h.delta_scales()) {
    if (!delta_ || since_scales_.empty()) return Violation("a delta of the scales that was not asked for");
    if (static_cast<int64_t>(since_scales_.size()) != h.total_scale_bytes()) {
      return Violation("a delta of ", h.total_scale_bytes(), " bytes of scales for a copy of ", since_scales_.size());
    }
    MAINSTAY_RETURN_IF_ERROR(ListedChunks(h.delta_scale_chunks(), ChunkCount(h.total_scale_bytes(), delta_chunk_bytes_),
                                          "delta scale chunk", &delta_scale_chunks_));
    delta_scales_ = true;
    expected_scales_crc_ = h.scales_crc32c();
    std::memcpy(result_.scales.data(), since_scales_.data(), since_scales_.size());
  }
  return absl::OkStatus();
}

absl::Status ShardPullAssembler::DataAllowed() const {
  if (!have_header_) return Violation("data before the header");
  if (result_.unchanged) return Violation("data after an unchanged header");
  if (next_scale_ > 0) return Violation("data after scales");
  return absl::OkStatus();
}

absl::Status ShardPullAssembler::OnData(const v1::ParamChunk& chunk) {
  MAINSTAY_RETURN_IF_ERROR(DataAllowed());
  if (delta_) return OnDeltaData(chunk);
  if (!chunk.patch().empty()) return Violation("a byte patch outside a delta");
  const std::span<const uint8_t> piece(reinterpret_cast<const uint8_t*>(chunk.data().data()), chunk.data().size());
  return LandData(chunk.element_offset(), std::span<const std::span<const uint8_t>>(&piece, 1));
}

absl::Status ShardPullAssembler::OnDataChunk(int64_t element_offset, std::span<const std::span<const uint8_t>> pieces) {
  MAINSTAY_RETURN_IF_ERROR(DataAllowed());
  if (delta_) {  // a delta's whole chunk (readers only): the protobuf path's checks
    v1::ParamChunk chunk;
    chunk.set_element_offset(element_offset);
    for (const std::span<const uint8_t> piece : pieces) {
      chunk.mutable_data()->append(reinterpret_cast<const char*>(piece.data()), piece.size());
    }
    return OnDeltaData(chunk);
  }
  return LandData(element_offset, pieces);
}

absl::Status ShardPullAssembler::LandData(int64_t element_offset, std::span<const std::span<const uint8_t>> pieces) {
  if (element_offset != next_element_) {
    return Violation("data chunk at element ", element_offset, ", expected ", next_element_);
  }
  int64_t bytes = 0;
  for (const std::span<const uint8_t> piece : pieces) bytes += static_cast<int64_t>(piece.size());
  const int bits = Describe(bucket_.format).bits_per_element;
  const int64_t elements = bytes * 8 / bits;
  if (bytes == 0 || elements * bits != bytes * 8) return Violation("data chunk of ", bytes, " bytes");
  if (next_element_ + elements > bucket_.shard_numel) {
    return Violation("data past the shard's ", bucket_.shard_numel, " elements");
  }
  uint8_t* at = data_out_.data() + DataBytes(bucket_.format, next_element_);
  for (const std::span<const uint8_t> piece : pieces) {
    std::memcpy(at, piece.data(), piece.size());
    at += piece.size();
  }
  next_element_ += elements;
  result_.data_bytes_received += bytes;
  DataLanded(bytes);  // while the chunk is in cache
  return absl::OkStatus();
}

absl::Status ShardPullAssembler::LandDeltaChunk(std::span<uint8_t> out, int32_t index, int64_t offset, int unit_bits,
                                                const std::string& data, const std::string& patch,
                                                const char* what, int64_t* received) {
  const auto size = static_cast<int64_t>(out.size());
  const int64_t begin = index * delta_chunk_bytes_;
  const int64_t bytes = std::min(delta_chunk_bytes_, size - begin);
  if (!patch.empty() && !data.empty()) return Violation(what, " chunk ", index, ": both data and a byte patch");
  if (offset != begin * 8 / unit_bits || (patch.empty() && static_cast<int64_t>(data.size()) != bytes)) {
    return Violation(what, " chunk at ", offset, " of ", data.size(), " bytes, expected chunk ", index, ": at ",
                     begin * 8 / unit_bits, ", ", bytes, " bytes or a byte patch");
  }
  if (patch.empty()) {
    std::memcpy(out.data() + begin, data.data(), static_cast<size_t>(bytes));
    *received += bytes;
    return absl::OkStatus();
  }
  if (!delta_patches_) return Violation("a byte patch that was not asked for");
  if (absl::Status s = ApplyBytePatch(out.subspan(static_cast<size_t>(begin), static_cast<size_t>(bytes)), patch);
      !s.ok()) {
    return Violation(what, " chunk ", index, ": ", s.message());
  }
  *received += static_cast<int64_t>(patch.size());
  return absl::OkStatus();
}

absl::Status ShardPullAssembler::OnDeltaData(const v1::ParamChunk& chunk) {
  if (next_delta_ >= delta_chunks_.size()) return Violation("more delta chunks than the header listed");
  MAINSTAY_RETURN_IF_ERROR(LandDeltaChunk(data_out_, delta_chunks_[next_delta_], chunk.element_offset(),
                                          Describe(bucket_.format).bits_per_element, chunk.data(), chunk.patch(),
                                          "delta", &result_.data_bytes_received));
  ++next_delta_;
  return absl::OkStatus();
}

absl::Status ShardPullAssembler::OnDeltaScales(const v1::ScaleChunk& chunk) {
  if (next_delta_scale_ >= delta_scale_chunks_.size()) return Violation("more delta scale chunks than the header listed");
  MAINSTAY_RETURN_IF_ERROR(LandDeltaChunk(result_.scales, delta_scale_chunks_[next_delta_scale_], chunk.scale_offset(),
                                          scale_entry_bytes_ * 8, chunk.data(), chunk.patch(), "delta scale",
                                          &result_.scale_bytes_received));
  ++next_delta_scale_;
  return absl::OkStatus();
}

absl::Status ShardPullAssembler::OnScales(const v1::ScaleChunk& chunk) {
  if (!have_header_) return Violation("scales before the header");
  if (result_.unchanged) return Violation("scales after an unchanged header");
  if (delta_ && next_delta_ != delta_chunks_.size()) return Violation("scales before every delta chunk");
  if (!delta_ && next_element_ != bucket_.shard_numel) return Violation("scales before all data");
  if (delta_scales_) return OnDeltaScales(chunk);
  if (!chunk.patch().empty()) return Violation("a byte patch of scales outside a delta of the scales");
  if (chunk.scale_offset() != next_scale_) {
    return Violation("scale chunk at entry ", chunk.scale_offset(), ", expected ", next_scale_);
  }
  const int64_t bytes = static_cast<int64_t>(chunk.data().size());
  if (scale_entry_bytes_ == 0 || bytes == 0 || bytes % scale_entry_bytes_ != 0) {
    return Violation("scale chunk of ", bytes, " bytes");
  }
  const int64_t entries = bytes / scale_entry_bytes_;
  if (next_scale_ + entries > result_.num_scales) return Violation("more than ", result_.num_scales, " scales");
  std::memcpy(result_.scales.data() + next_scale_ * scale_entry_bytes_, chunk.data().data(), bytes);
  next_scale_ += entries;
  result_.scale_bytes_received += bytes;
  return absl::OkStatus();
}

void ShardPullAssembler::DataLanded(int64_t bytes) {
  const int64_t n = std::min<int64_t>(bytes, static_cast<int64_t>(data_out_.size()) - crc_through_);
  if (!have_header_ || n <= 0 || !verify_crc32c_ || expected_crc_ == 0) return;
  crc_ = Crc32cExtend(crc_, data_out_.data() + crc_through_, static_cast<size_t>(n));
  crc_through_ += n;
}

absl::Status ShardPullAssembler::Placed() {
  if (!have_header_) return Violation("data before the header");
  if (result_.unchanged) return Violation("data after an unchanged header");
  if (next_element_ != 0 || next_scale_ != 0) return Violation("data placed after chunks");
  if (delta_) return Violation("a delta placed as a whole shard");
  result_.data_bytes_received = static_cast<int64_t>(data_out_.size());
  result_.scale_bytes_received = static_cast<int64_t>(result_.scales.size());
  next_element_ = bucket_.shard_numel;
  next_scale_ = result_.num_scales;
  return absl::OkStatus();
}

absl::StatusOr<PulledShard> ShardPullAssembler::Finish() {
  if (!have_header_) return Violation("stream without a header");
  if (delta_) {
    // Always checked: the unsent chunks are the reader's, so only the whole says it is this version.
    auto check = [&](const char* what, std::span<const uint8_t> bytes, uint32_t expected) -> absl::Status {
      const uint32_t crc = Crc32c(bytes.data(), bytes.size());
      if (crc == expected) return absl::OkStatus();
      return absl::DataLossError(absl::StrCat("delta of bucket ", bucket_.index, " shard ", shard_.rank, " gives ", what,
                                              " with CRC-32C ", crc, ", the daemon's version has ", expected,
                                              " (a forged or damaged delta, or a copy that is not what its hashes said)"));
    };
    if (next_delta_ != delta_chunks_.size()) {
      return Violation("stream ended after ", next_delta_, " of the delta's ", delta_chunks_.size(), " chunks");
    }
    if (delta_scales_) {
      if (next_delta_scale_ != delta_scale_chunks_.size()) {
        return Violation("stream ended after ", next_delta_scale_, " of the delta's ", delta_scale_chunks_.size(),
                         " scale chunks");
      }
      MAINSTAY_RETURN_IF_ERROR(check("block scales", result_.scales, expected_scales_crc_));
    } else if (next_scale_ != result_.num_scales) {
      return Violation("stream ended after ", next_scale_, " of ", result_.num_scales, " scales");
    }
    MAINSTAY_RETURN_IF_ERROR(check("data", data_out_, expected_crc_));
    return std::move(result_);
  }
  if (!result_.unchanged) {
    if (next_element_ != bucket_.shard_numel) {
      return Violation("stream ended after ", next_element_, " of ", bucket_.shard_numel, " elements");
    }
    if (next_scale_ != result_.num_scales) {
      return Violation("stream ended after ", next_scale_, " of ", result_.num_scales, " scales");
    }
    if (verify_crc32c_ && expected_crc_ != 0) {
      DataLanded(static_cast<int64_t>(data_out_.size()) - crc_through_);  // what no transport reported
      const uint32_t crc = crc_;
      if (crc != expected_crc_) {
        return absl::DataLossError(absl::StrCat("PullParams data of bucket ", bucket_.index, " shard ", shard_.rank,
                                                " has CRC-32C ", crc, ", the daemon sent ", expected_crc_));
      }
    }
  }
  return std::move(result_);
}

absl::StatusOr<PulledBucket> MakePulledBucket(std::shared_ptr<const Layout> layout, int32_t bucket,
                                              int32_t shard_begin, PooledBytes data,
                                              std::vector<PulledShard> shards) {
  if (layout == nullptr || bucket < 0 || bucket >= static_cast<int32_t>(layout->buckets.size())) {
    return absl::InvalidArgumentError("MakePulledBucket: bad bucket");
  }
  const Bucket& b = layout->buckets[bucket];
  const int32_t shard_end = shard_begin + static_cast<int32_t>(shards.size());
  if (shards.empty() || shard_begin < 0 || shard_end > static_cast<int32_t>(b.shards.size())) {
    return absl::InvalidArgumentError("MakePulledBucket: bad shard range");
  }
  for (size_t i = 0; i < shards.size(); ++i) {
    const PulledShard& s = shards[i];
    if (s.shard != shard_begin + static_cast<int32_t>(i)) {
      return absl::InvalidArgumentError("MakePulledBucket: shards out of order");
    }
    if (s.version != shards[0].version || s.unchanged != shards[0].unchanged) {
      return absl::AbortedError(absl::StrCat("bucket ", bucket, ": shard ", shard_begin, " answered version ",
                                             shards[0].version, shards[0].unchanged ? " (unchanged)" : "",
                                             " but shard ", s.shard, " version ", s.version,
                                             s.unchanged ? " (unchanged)" : "", "; pull again"));
    }
  }
  auto impl = std::make_shared<PulledBucket::Impl>();
  impl->bucket = bucket;
  impl->shard_begin = shard_begin;
  impl->shard_end = shard_end;
  impl->version = shards[0].version;
  impl->unchanged = shards[0].unchanged;
  if (!impl->unchanged) {
    const int64_t want = DataBytes(b.format, shard_end * b.shard_numel) - DataBytes(b.format, shard_begin * b.shard_numel);
    if (static_cast<int64_t>(data.size()) != want) {
      return absl::InvalidArgumentError(absl::StrCat("MakePulledBucket: ", data.size(), " data bytes, expected ", want));
    }
    impl->data = std::move(data);
  }
  impl->shards = std::move(shards);
  impl->layout = std::move(layout);
  return PulledBucket(std::move(impl));
}

}  // namespace mainstay::client_internal
