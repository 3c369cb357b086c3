// Quantized parameters pulled from the daemons: one shard or a whole bucket (the all-gather),
// with per-tensor views (data bytes + block scales + per-tensor metadata) and dequantization.
//
// A PulledBucket covers the shards [shard_begin, shard_end) of one bucket at one version. Its
// data() is the packed data of those shards, back to back, exactly as the bucket's packed buffer
// holds them (DataBytes(format, elements) bytes; 4-bit formats: even element in the low nibble),
// so a tensor's data is one contiguous byte range. Block scales stay per shard: each shard sends
// the FragmentScaleBlocks (common/layout.h) of its fragments, concatenated in fragment order; a
// FragmentView points at its own entries, and TensorScaleGrid merges them into the tensor's
// compact row-major scale grid (ScaleGrid, common/format.h).
//
// When unchanged() the step before version() was skipped: no data came, keep the weights held.
//
// Ownership: a PulledBucket is an immutable value sharing its bytes between copies (copying is
// cheap). Views (spans, LayoutTensor pointers) point into that shared state and stay valid while
// any copy of the PulledBucket lives. Thread safety: every method is const and may be called
// concurrently. Errors: INVALID_ARGUMENT / NOT_FOUND for a bad tensor index or name;
// FAILED_PRECONDITION when the data needed is not there (unchanged, or a tensor with fragments in
// shards this object does not cover).
#ifndef MAINSTAY_CLIENT_PULLED_H_
#define MAINSTAY_CLIENT_PULLED_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/format.h"
#include "common/layout.h"
#include "mainstay/export.h"

namespace mainstay {

// Quantization metadata of one fragment (PullParamsHeader.fragments) with where its block scales
// are in its shard's scale sequence.
struct FragmentQuantInfo {
  int32_t tensor = 0;          // index into Layout::tensors
  IndexRange elements;         // elements of the flattened tensor
  int64_t bucket_offset = 0;   // bucket element offset of elements.begin
  // Per-tensor values of this version (the same on every shard holding part of the tensor):
  // fp8 delayed/current: scale = multiplier applied before the cast, scale_inv = RN(1/scale);
  // nvfp4: scale = global S_enc, scale_inv = global S_dec. 0 when the format has none.
  float scale = 0.0f;
  float scale_inv = 0.0f;
  float amax = 0.0f;           // whole-tensor amax quantized in this version; 0 when not kept
  IndexRange scale_blocks;     // FragmentScaleBlocks: blocks of the tensor's compact scale grid
  int64_t scale_offset = 0;    // index of the first of those entries in the shard's scale sequence
};

// What one shard's PullParams answered (its data lives in the PulledBucket's data()).
struct PulledShard {
  int32_t shard = 0;
  int64_t version = 0;
  bool unchanged = false;
  int64_t num_scales = 0;                   // block-scale entries
  std::vector<uint8_t> scales;              // num_scales entries of the format's block_scale type
  std::vector<FragmentQuantInfo> fragments; // in shard order
  // Bytes of packed data that came over the wire: the whole shard, or for a delta pull
  // (Client::PullBucketSince) only the chunks that changed (whole or as byte patches). 0 when
  // unchanged or placed by a transport that does not count.
  int64_t data_bytes_received = 0;
  // The same for the block scales (all of `scales` but in a delta pull).
  int64_t scale_bytes_received = 0;
};

// One fragment of a tensor inside a PulledBucket.
struct FragmentView {
  int32_t shard = 0;
  IndexRange elements;               // elements of the flattened tensor
  std::span<const uint8_t> data;     // DataBytes(format, elements.size()) bytes
  std::span<const uint8_t> scales;   // scale_blocks.size() block-scale entries
  IndexRange scale_blocks;           // compact scale-grid indices the entries belong to
  float scale = 0.0f, scale_inv = 0.0f, amax = 0.0f;
};

// One tensor inside a PulledBucket.
struct TensorView {
  int32_t tensor = 0;
  const LayoutTensor* info = nullptr;  // name, shape, format, bucket, bucket_offset
  Format format = Format::kBF16;
  bool complete = false;               // every fragment of the tensor is covered
  IndexRange elements;                 // elements of the flattened tensor covered
  std::span<const uint8_t> data;       // packed data of `elements` (contiguous)
  std::vector<FragmentView> fragments; // covered fragments, in element order
  float scale = 0.0f, scale_inv = 0.0f, amax = 0.0f;  // per-tensor values (see FragmentQuantInfo)
};

class MAINSTAY_CLIENT_EXPORT PulledBucket {
 public:
  struct Impl;

  PulledBucket();  // empty: no layout, no shards
  explicit PulledBucket(std::shared_ptr<const Impl> impl);

  const Layout& layout() const;
  const Bucket& bucket_info() const;
  int32_t bucket() const;
  Format format() const;
  int64_t version() const;
  bool unchanged() const;
  int32_t shard_begin() const;
  int32_t shard_end() const;
  bool complete() const;                  // covers every shard of the bucket
  IndexRange elements() const;            // bucket elements covered
  std::span<const uint8_t> data() const;  // packed data of elements(); empty when unchanged
  const std::vector<PulledShard>& shards() const;

  // Tensors of the bucket with at least one element covered, in bucket order.
  std::vector<int32_t> tensors() const;
  absl::StatusOr<TensorView> Tensor(int32_t tensor) const;
  absl::StatusOr<TensorView> Tensor(std::string_view name) const;

  // FP32 values of a whole tensor (numel, row-major), each fragment through
  // kernels::Dequantize. FAILED_PRECONDITION unless the tensor is complete; INVALID_ARGUMENT
  // when `out` is not numel floats.
  absl::Status Dequantize(int32_t tensor, std::span<float> out) const;
  absl::StatusOr<std::vector<float>> Dequantize(int32_t tensor) const;
  // FP32 values of every covered bucket element: `out` holds elements().size() floats in bucket
  // order (out[0] is bucket element elements().begin); each covered fragment goes through
  // kernels::Dequantize, padding between and after tensors becomes 0. Unlike Dequantize this
  // needs no complete tensor, so a single pulled shard dequantizes into its slice of a flat
  // bucket buffer (the trainers then all-gather the FP32 shards). FAILED_PRECONDITION when
  // unchanged; INVALID_ARGUMENT when `out` has the wrong size.
  absl::Status DequantizeCovered(std::span<float> out) const;

  // The tensor's compact block-scale grid (ScaleGrid rows x cols entries of the format's
  // block_scale type, row-major), merged from the fragments; blocks touched by no covered
  // fragment stay 0. Empty for formats without block scales.
  absl::StatusOr<std::vector<uint8_t>> TensorScaleGrid(int32_t tensor) const;

  // ---- The trainers' all-gather of quantized shards (mainstay.torch).
  // A rank that pulled only its own shard hands it to the other ranks as one record of
  // ShardRecordBytes (the same for every shard of a bucket, so an all-gather of equal byte
  // buffers moves it); every rank rebuilds the bucket from the D records (FromShardRecords) and
  // dequantizes it locally. The all-gather then moves the published bytes (1 B per element for
  // fp8, 0.5 B for nvfp4, 2 B for bf16, plus block scales) instead of FP32.
  // A record: a 24-byte header (magic "MSR1", shard, version, block-scale entries), then for
  // each fragment of the shard in layout order its scale, scale_inv and amax (3 floats), padded
  // to the bucket's most fragments per shard, then the shard's packed data, then its block
  // scales, padded to the bucket's most. Host byte order: every rank runs on the same kind of
  // host.
  static int64_t ShardRecordBytes(const Layout& layout, int32_t bucket);
  // Writes the record of the one shard this object covers into `out` (ShardRecordBytes bytes).
  // FAILED_PRECONDITION unless it covers exactly one shard and is not unchanged;
  // INVALID_ARGUMENT when `out` has another size.
  absl::Status WriteShardRecord(std::span<uint8_t> out) const;
  // The whole bucket from D records back to back, record r holding shard r (an all-gather's
  // output). INVALID_ARGUMENT for a bad bucket, a size that is not D records, or a record that
  // is not shard r's (bad magic, wrong shard); ABORTED when the records are of different
  // versions (ranks that pulled different versions: pull again).
  static absl::StatusOr<PulledBucket> FromShardRecords(std::shared_ptr<const Layout> layout, int32_t bucket,
                                                       std::span<const uint8_t> records);

 private:
  std::shared_ptr<const Impl> impl_;
};

}  // namespace mainstay

#endif  // MAINSTAY_CLIENT_PULLED_H_
