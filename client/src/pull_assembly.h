// From PullParams streams to a PulledBucket.
//
// ShardPullAssembler checks one shard's stream against the layout as untrusted input (header
// first and once; format, element range, byte and scale counts, fragments as the layout has them;
// chunks in order without gaps, whole elements, inside the shard) and copies the data straight
// into the caller's slice of the bucket buffer. MakePulledBucket joins consecutive shards.
//
// A delta pull (ExpectDelta: data_out already holds the reader's copy of the shard) takes only
// the chunks the header lists, in order, each whole or (when the request named the copy's version:
// ExpectDelta's patches) as a byte patch against data_out's bytes, and then always
// checks the CRC-32C of the whole result against the header's: a forged or truncated delta is
// DATA_LOSS or INTERNAL, and the caller drops data_out (its copy is a fresh buffer).
//
// Errors: INTERNAL for a stream that breaks the protocol (the daemon's fault, not retried);
// DATA_LOSS for a CRC-32C mismatch. Thread safety: an assembler belongs to one stream.
#ifndef MAINSTAY_CLIENT_SRC_PULL_ASSEMBLY_H_
#define MAINSTAY_CLIENT_SRC_PULL_ASSEMBLY_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/src/buffer_pool.h"
#include "common/layout.h"
#include "mainstay/pulled.h"
#include "mainstay/v1/shard.pb.h"

namespace mainstay {

struct __attribute__((visibility("hidden"))) PulledBucket::Impl {
  std::shared_ptr<const Layout> layout;
  int32_t bucket = 0;
  int32_t shard_begin = 0;
  int32_t shard_end = 0;
  int64_t version = 0;
  bool unchanged = false;
  client_internal::PooledBytes data;  // packed data of shards [shard_begin, shard_end); empty when unchanged
  std::vector<PulledShard> shards;  // shard_end - shard_begin entries, in order
};

namespace client_internal {

class ShardPullAssembler {
 public:
  // `data_out` is the shard's slice of the bucket's packed buffer: DataBytes(format, shard_numel)
  // bytes. `requested_version` < 0 accepts any version (latest).
  ShardPullAssembler(const Layout& layout, int32_t bucket, int32_t shard, int64_t requested_version,
                     std::span<uint8_t> data_out, bool verify_crc32c);

  // The request asked for a delta in chunks of `chunk_bytes` (PullParamsRequest.delta_chunk_bytes),
  // and with `patches`, named the version data_out holds (delta_since_version), so chunks may
  // come as byte patches (ParamChunk.patch); with `scales` (the copy's block scales, which it
  // hashed: have_scale_chunk_hashes; the caller keeps them alive) the scales may come as a
  // delta too. The daemon may still answer with the whole shard.
  void ExpectDelta(int64_t chunk_bytes, bool patches, std::span<const uint8_t> scales = {}) {
    delta_chunk_bytes_ = chunk_bytes;
    delta_patches_ = patches;
    since_scales_ = scales;
  }
  absl::Status OnMessage(const v1::PullParamsResponse& message);
  // A data chunk (ParamChunk with element_offset and data) that the transport decoded itself,
  // in pieces (common/grpc_chunk.h): the same checks and result as OnMessage.
  absl::Status OnDataChunk(int64_t element_offset, std::span<const std::span<const uint8_t>> pieces);
  // After the stream ended OK: everything announced arrived.
  absl::StatusOr<PulledShard> Finish();

  // For transports that place the payload themselves (ucx, nccl, cuda_ipc): after a header that
  // is not `unchanged`, the data goes to data_destination() (the whole shard) and the scales to
  // scale_destination(); Placed() then counts both as received, and Finish checks the CRC
  // (unless verify_crc32c is off, as for a destination in device memory).
  // DataLanded(bytes), optional, says the next `bytes` of data_destination() arrived (in order),
  // so the CRC covers them now, while later chunks are still in flight.
  bool unchanged() const { return result_.unchanged; }
  std::span<uint8_t> data_destination() const { return data_out_; }
  std::span<uint8_t> scale_destination() { return result_.scales; }
  void DataLanded(int64_t bytes);
  absl::Status Placed();

 private:
  absl::Status OnHeader(const v1::PullParamsHeader& header);
  absl::Status OnData(const v1::ParamChunk& chunk);
  // Why a data chunk cannot come now (OkStatus when it can).
  absl::Status DataAllowed() const;
  // Lands a whole data chunk of a pull that is not a delta.
  absl::Status LandData(int64_t element_offset, std::span<const std::span<const uint8_t>> pieces);
  absl::Status OnScales(const v1::ScaleChunk& chunk);
  absl::Status OnDeltaData(const v1::ParamChunk& chunk);
  absl::Status OnDeltaScales(const v1::ScaleChunk& chunk);
  // Lands one listed chunk of `out` (whole `data` or a byte `patch` against out's bytes) as the
  // chunk `index` of delta_chunk_bytes_, which must start at `offset` units of `unit_bits`.
  absl::Status LandDeltaChunk(std::span<uint8_t> out, int32_t index, int64_t offset, int unit_bits,
                              const std::string& data, const std::string& patch, const char* what,
                              int64_t* received);

  const Layout& layout_;
  const Bucket& bucket_;
  const Shard& shard_;
  const int64_t requested_version_;
  const std::span<uint8_t> data_out_;
  const bool verify_crc32c_;
  int scale_entry_bytes_ = 0;

  bool have_header_ = false;
  uint32_t expected_crc_ = 0;
  uint32_t crc_ = 0;            // CRC-32C of data_out_[0, crc_through_)
  int64_t crc_through_ = 0;
  int64_t next_element_ = 0;   // elements of data received
  int64_t next_scale_ = 0;     // scale entries received
  // Delta pulls: the chunk size asked for (0: none), whether the header announced a delta, the
  // chunks it listed and how many of them arrived.
  int64_t delta_chunk_bytes_ = 0;
  bool delta_patches_ = false;
  bool delta_ = false;
  std::vector<int32_t> delta_chunks_;
  size_t next_delta_ = 0;
  // The block scales as a delta (PullParamsHeader.delta_scales): the copy's scales the request
  // hashed, the listed chunks and how many arrived, and the CRC-32C of the new scales.
  std::span<const uint8_t> since_scales_;
  bool delta_scales_ = false;
  std::vector<int32_t> delta_scale_chunks_;
  size_t next_delta_scale_ = 0;
  uint32_t expected_scales_crc_ = 0;
  PulledShard result_;
};

// Joins consecutive shards [shard_begin, shard_begin + shards.size()) whose packed data is `data`
// (DataBytes of their elements). The shards must agree on version and `unchanged`; ABORTED
// otherwise (a latest pull raced a commit, or daemons disagree on the step's outcome): pull again.
absl::StatusOr<PulledBucket> MakePulledBucket(std::shared_ptr<const Layout> layout, int32_t bucket,
                                              int32_t shard_begin, PooledBytes data,
                                              std::vector<PulledShard> shards);

}  // namespace client_internal
}  // namespace mainstay

#endif  // MAINSTAY_CLIENT_SRC_PULL_ASSEMBLY_H_
