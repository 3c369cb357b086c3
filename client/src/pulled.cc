// PulledBucket: per-tensor views, scale-grid merging and dequantization over pulled shards.
#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/src/pull_assembly.h"
#include "common/status.h"
#include "kernels/kernels.h"
#include "mainstay/buffers.h"
#include "mainstay/pulled.h"

namespace mainstay {
namespace {

const Layout& EmptyLayout() {
  static const Layout* layout = new Layout();
  return *layout;
}

int ScaleEntryBytes(Format format) {
  const FormatDescriptor& d = Describe(format);
  return d.has_block_scales() ? BitsOf(d.block_scale) / 8 : 0;
}

// Whether the fragment [begin, end) of a rows x cols tensor has an element in scale block
// `block` (compact row-major grid of block_rows x block_cols blocks).
bool FragmentTouchesBlock(const FormatDescriptor& d, Matrix2D view, Matrix2D grid, IndexRange fragment,
                          int64_t block) {
  const int64_t tr = block / grid.cols, tc = block % grid.cols;
  const int64_t c_lo = tc * d.block_cols, c_hi = std::min(view.cols, c_lo + d.block_cols);
  const int64_t r_lo = tr * d.block_rows, r_hi = std::min(view.rows, r_lo + d.block_rows);
  for (int64_t r = r_lo; r < r_hi; ++r) {
    const int64_t lo = r * view.cols + c_lo, hi = r * view.cols + c_hi;
    if (lo < fragment.end && fragment.begin < hi) return true;
  }
  return false;
}

// The shape of a bucket's shard records (PulledBucket::ShardRecordBytes).
struct RecordShape {
  int64_t max_fragments = 0;
  int64_t max_scales = 0;   // block-scale entries
  int64_t data_bytes = 0;   // of one shard
  int entry_bytes = 0;      // of one block scale
  int64_t fragment_at() const { return kRecordHeaderBytes; }
  int64_t data_at() const { return kRecordHeaderBytes + max_fragments * 12; }
  int64_t scales_at() const { return data_at() + data_bytes; }
  int64_t bytes() const { return scales_at() + max_scales * entry_bytes; }
  static constexpr int64_t kRecordHeaderBytes = 24;
};
constexpr uint32_t kRecordMagic = 0x3152534Du;  // "MSR1" in little-endian bytes

int64_t ShardScaleEntries(const Layout& layout, const Shard& shard) {
  int64_t n = 0;
  for (const TensorFragment& f : shard.fragments) n += FragmentScaleBlocks(layout, f).size();
  return n;
}

RecordShape ShapeOf(const Layout& layout, const Bucket& b) {
  RecordShape r;
  for (const Shard& s : b.shards) {
    r.max_fragments = std::max<int64_t>(r.max_fragments, static_cast<int64_t>(s.fragments.size()));
    r.max_scales = std::max(r.max_scales, ShardScaleEntries(layout, s));
  }
  r.data_bytes = DataBytes(b.format, b.shard_numel);
  r.entry_bytes = ScaleEntryBytes(b.format);
  return r;
}

}  // namespace

PulledBucket::PulledBucket() = default;
PulledBucket::PulledBucket(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}

const Layout& PulledBucket::layout() const { return impl_ ? *impl_->layout : EmptyLayout(); }
const Bucket& PulledBucket::bucket_info() const {
  static const Bucket* empty = new Bucket();
  return impl_ ? impl_->layout->buckets[impl_->bucket] : *empty;
}
int32_t PulledBucket::bucket() const { return impl_ ? impl_->bucket : 0; }
Format PulledBucket::format() const { return bucket_info().format; }
int64_t PulledBucket::version() const { return impl_ ? impl_->version : 0; }
bool PulledBucket::unchanged() const { return impl_ ? impl_->unchanged : false; }
int32_t PulledBucket::shard_begin() const { return impl_ ? impl_->shard_begin : 0; }
int32_t PulledBucket::shard_end() const { return impl_ ? impl_->shard_end : 0; }
bool PulledBucket::complete() const {
  return impl_ && impl_->shard_begin == 0 && impl_->shard_end == static_cast<int32_t>(bucket_info().shards.size());
}
IndexRange PulledBucket::elements() const {
  if (!impl_) return {};
  const int64_t n = bucket_info().shard_numel;
  return {impl_->shard_begin * n, impl_->shard_end * n};
}
std::span<const uint8_t> PulledBucket::data() const {
  return impl_ ? std::span<const uint8_t>(impl_->data.span()) : std::span<const uint8_t>();
}
const std::vector<PulledShard>& PulledBucket::shards() const {
  static const std::vector<PulledShard>* empty = new std::vector<PulledShard>();
  return impl_ ? impl_->shards : *empty;
}

std::vector<int32_t> PulledBucket::tensors() const {
  std::vector<int32_t> out;
  for (const PulledShard& s : shards()) {
    for (const FragmentQuantInfo& f : s.fragments) {
      if (out.empty() || out.back() != f.tensor) out.push_back(f.tensor);
    }
  }
  if (out.empty() && impl_ && impl_->unchanged) {
    // No fragment metadata comes with an unchanged answer; list the layout's tensors instead.
    for (int32_t s = impl_->shard_begin; s < impl_->shard_end; ++s) {
      for (const TensorFragment& f : bucket_info().shards[s].fragments) {
        if (out.empty() || out.back() != f.tensor) out.push_back(f.tensor);
      }
    }
  }
  return out;
}

absl::StatusOr<TensorView> PulledBucket::Tensor(std::string_view name) const {
  MAINSTAY_ASSIGN_OR_RETURN(int32_t index, FindTensor(layout(), name));
  return Tensor(index);
}

absl::StatusOr<TensorView> PulledBucket::Tensor(int32_t tensor) const {
  if (!impl_) return absl::FailedPreconditionError("empty PulledBucket");
  const Layout& l = *impl_->layout;
  if (tensor < 0 || tensor >= static_cast<int32_t>(l.tensors.size())) {
    return InvalidArgumentError("tensor", "index ", tensor, " is not in [0, ", l.tensors.size(), ")");
  }
  const LayoutTensor& t = l.tensors[tensor];
  if (t.bucket != impl_->bucket) {
    return InvalidArgumentError("tensor", t.name, " is in bucket ", t.bucket, ", not ", impl_->bucket);
  }
  if (impl_->unchanged) {
    return absl::FailedPreconditionError(absl::StrCat("bucket ", impl_->bucket, ": step ", impl_->version,
                                                      " was skipped (unchanged); keep the weights you hold"));
  }
  const Format format = t.format;
  const int entry = ScaleEntryBytes(format);
  const int64_t covered_begin = elements().begin;
  TensorView view;
  view.tensor = tensor;
  view.info = &t;
  view.format = format;
  for (const PulledShard& s : impl_->shards) {
    for (const FragmentQuantInfo& f : s.fragments) {
      if (f.tensor != tensor) continue;
      FragmentView fv;
      fv.shard = s.shard;
      fv.elements = f.elements;
      const int64_t byte_begin = DataBytes(format, f.bucket_offset - covered_begin);
      fv.data = std::span<const uint8_t>(impl_->data.span()).subspan(byte_begin, DataBytes(format, f.elements.size()));
      fv.scales = std::span<const uint8_t>(s.scales).subspan(f.scale_offset * entry, f.scale_blocks.size() * entry);
      fv.scale_blocks = f.scale_blocks;
      fv.scale = f.scale;
      fv.scale_inv = f.scale_inv;
      fv.amax = f.amax;
      view.fragments.push_back(fv);
    }
  }
  if (view.fragments.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("tensor ", t.name, " has no fragment in shards [",
                                                      impl_->shard_begin, ", ", impl_->shard_end, ")"));
  }
  const FragmentView& first = view.fragments.front();
  view.elements = {first.elements.begin, view.fragments.back().elements.end};
  view.complete = view.elements.begin == 0 && view.elements.end == t.numel;
  const int64_t data_begin = DataBytes(format, t.bucket_offset + first.elements.begin - covered_begin);
  view.data = std::span<const uint8_t>(impl_->data.span()).subspan(data_begin, DataBytes(format, view.elements.size()));
  view.scale = first.scale;
  view.scale_inv = first.scale_inv;
  view.amax = first.amax;
  return view;
}

absl::Status PulledBucket::Dequantize(int32_t tensor, std::span<float> out) const {
  MAINSTAY_ASSIGN_OR_RETURN(TensorView view, Tensor(tensor));
  const LayoutTensor& t = *view.info;
  if (!view.complete) {
    return absl::FailedPreconditionError(absl::StrCat("tensor ", t.name, " is only partly covered by shards [",
                                                      shard_begin(), ", ", shard_end(), "): pull the whole bucket"));
  }
  if (static_cast<int64_t>(out.size()) != t.numel) {
    return InvalidArgumentError("out", "tensor ", t.name, " has ", t.numel, " elements, got ", out.size());
  }
  const Matrix2D view2d = View2D(t.shape);
  const bool tensor_scale = Describe(view.format).tensor_scale;
  for (const FragmentView& f : view.fragments) {
    kernels::QuantizedInputs in;
    in.data = f.data;
    in.block_scales = f.scales;
    in.tensor_scale_inv = tensor_scale ? f.scale_inv : 1.0f;
    MAINSTAY_RETURN_IF_ERROR(Annotate(
        kernels::Dequantize(kernels::Device{}, view.format, kernels::Fragment{view2d, f.elements}, in,
                            out.subspan(f.elements.begin, f.elements.size())),
        absl::StrCat("dequantize ", t.name, " [", f.elements.begin, ", ", f.elements.end, ")")));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> PulledBucket::Dequantize(int32_t tensor) const {
  if (!impl_ || tensor < 0 || tensor >= static_cast<int32_t>(layout().tensors.size())) {
    return InvalidArgumentError("tensor", "index ", tensor, " is not a tensor of this bucket");
  }
  std::vector<float> out(layout().tensors[tensor].numel);
  MAINSTAY_RETURN_IF_ERROR(Dequantize(tensor, std::span<float>(out)));
  return out;
}

absl::Status PulledBucket::DequantizeCovered(std::span<float> out) const {
  if (!impl_) return absl::FailedPreconditionError("empty PulledBucket");
  if (impl_->unchanged) {
    return absl::FailedPreconditionError(absl::StrCat("bucket ", impl_->bucket, ": step ", impl_->version,
                                                      " was skipped (unchanged); keep the weights you hold"));
  }
  const IndexRange covered = elements();
  if (static_cast<int64_t>(out.size()) != covered.size()) {
    return InvalidArgumentError("out", "bucket ", impl_->bucket, " shards [", impl_->shard_begin, ", ",
                                impl_->shard_end, ") cover ", covered.size(), " elements, got ", out.size());
  }
  std::fill(out.begin(), out.end(), 0.0f);
  const Layout& l = *impl_->layout;
  for (const PulledShard& s : impl_->shards) {
    for (const FragmentQuantInfo& f : s.fragments) {
      const LayoutTensor& t = l.tensors[f.tensor];
      const int entry = ScaleEntryBytes(t.format);
      const int64_t offset = f.bucket_offset - covered.begin;
      kernels::QuantizedInputs in;
      in.data = std::span<const uint8_t>(impl_->data.span()).subspan(DataBytes(t.format, offset),
                                                              DataBytes(t.format, f.elements.size()));
      in.block_scales =
          std::span<const uint8_t>(s.scales).subspan(f.scale_offset * entry, f.scale_blocks.size() * entry);
      in.tensor_scale_inv = Describe(t.format).tensor_scale ? f.scale_inv : 1.0f;
      MAINSTAY_RETURN_IF_ERROR(Annotate(
          kernels::Dequantize(kernels::Device{}, t.format, kernels::Fragment{View2D(t.shape), f.elements}, in,
                              out.subspan(offset, f.elements.size())),
          absl::StrCat("dequantize ", t.name, " [", f.elements.begin, ", ", f.elements.end, ")")));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint8_t>> PulledBucket::TensorScaleGrid(int32_t tensor) const {
  MAINSTAY_ASSIGN_OR_RETURN(TensorView view, Tensor(tensor));
  const FormatDescriptor& d = Describe(view.format);
  if (!d.has_block_scales()) return std::vector<uint8_t>();
  const int entry = ScaleEntryBytes(view.format);
  const Matrix2D view2d = View2D(view.info->shape);
  const Matrix2D grid = ScaleGrid(view.format, view2d);
  std::vector<uint8_t> out(grid.numel() * entry, 0);
  for (const FragmentView& f : view.fragments) {
    for (int64_t i = 0; i < f.scale_blocks.size(); ++i) {
      const int64_t block = f.scale_blocks.begin + i;
      // Blocks inside the fragment's range that it does not touch carry no value of its own.
      if (!FragmentTouchesBlock(d, view2d, grid, f.elements, block)) continue;
      std::memcpy(out.data() + block * entry, f.scales.data() + i * entry, entry);
    }
  }
  return out;
}

int64_t PulledBucket::ShardRecordBytes(const Layout& layout, int32_t bucket) {
  if (bucket < 0 || bucket >= static_cast<int32_t>(layout.buckets.size())) return 0;
  return ShapeOf(layout, layout.buckets[bucket]).bytes();
}

absl::Status PulledBucket::WriteShardRecord(std::span<uint8_t> out) const {
  if (!impl_ || impl_->shards.size() != 1) {
    return absl::FailedPreconditionError("WriteShardRecord: the PulledBucket must cover exactly one shard");
  }
  if (impl_->unchanged) {
    return absl::FailedPreconditionError(absl::StrCat("WriteShardRecord: bucket ", impl_->bucket, " version ",
                                                      impl_->version, " is unchanged (a skipped step): no data"));
  }
  const RecordShape shape = ShapeOf(*impl_->layout, bucket_info());
  if (static_cast<int64_t>(out.size()) != shape.bytes()) {
    return InvalidArgumentError("out", "bucket ", impl_->bucket, " records are ", shape.bytes(), " bytes, got ",
                                out.size());
  }
  const PulledShard& s = impl_->shards[0];
  std::fill(out.begin(), out.end(), uint8_t{0});
  const int32_t shard = s.shard;
  std::memcpy(out.data(), &kRecordMagic, 4);
  std::memcpy(out.data() + 4, &shard, 4);
  std::memcpy(out.data() + 8, &s.version, 8);
  std::memcpy(out.data() + 16, &s.num_scales, 8);
  for (size_t i = 0; i < s.fragments.size(); ++i) {
    const float meta[3] = {s.fragments[i].scale, s.fragments[i].scale_inv, s.fragments[i].amax};
    std::memcpy(out.data() + shape.fragment_at() + static_cast<int64_t>(i) * 12, meta, 12);
  }
  std::memcpy(out.data() + shape.data_at(), impl_->data.data(), static_cast<size_t>(shape.data_bytes));
  std::memcpy(out.data() + shape.scales_at(), s.scales.data(), s.scales.size());
  return absl::OkStatus();
}

absl::StatusOr<PulledBucket> PulledBucket::FromShardRecords(std::shared_ptr<const Layout> layout, int32_t bucket,
                                                             std::span<const uint8_t> records) {
  if (layout == nullptr || bucket < 0 || bucket >= static_cast<int32_t>(layout->buckets.size())) {
    return InvalidArgumentError("bucket", "no bucket ", bucket, " in the layout");
  }
  const Bucket& b = layout->buckets[bucket];
  const RecordShape shape = ShapeOf(*layout, b);
  const int64_t d = static_cast<int64_t>(b.shards.size());
  if (static_cast<int64_t>(records.size()) != d * shape.bytes()) {
    return InvalidArgumentError("records", "bucket ", bucket, " needs ", d, " records of ", shape.bytes(),
                                " bytes (", d * shape.bytes(), "), got ", records.size(), " bytes");
  }
  client_internal::PooledBytes data = client_internal::PooledBytes::Unpooled(static_cast<size_t>(d * shape.data_bytes));
  std::vector<PulledShard> shards(static_cast<size_t>(d));
  for (int64_t r = 0; r < d; ++r) {
    const uint8_t* rec = records.data() + r * shape.bytes();
    uint32_t magic = 0;
    int32_t shard = -1;
    PulledShard& out = shards[static_cast<size_t>(r)];
    std::memcpy(&magic, rec, 4);
    std::memcpy(&shard, rec + 4, 4);
    std::memcpy(&out.version, rec + 8, 8);
    std::memcpy(&out.num_scales, rec + 16, 8);
    const Shard& layout_shard = b.shards[static_cast<size_t>(r)];
    if (magic != kRecordMagic || shard != r) {
      return InvalidArgumentError("records", "record ", r, " of bucket ", bucket, " is not shard ", r,
                                  "'s (magic ", magic, ", shard ", shard, "): every rank must write its own "
                                  "shard's record, in rank order");
    }
    if (out.num_scales != ShardScaleEntries(*layout, layout_shard)) {
      return InvalidArgumentError("records", "record ", r, " of bucket ", bucket, " has ", out.num_scales,
                                  " block scales, the layout gives ", ShardScaleEntries(*layout, layout_shard));
    }
    out.shard = shard;
    out.scales.assign(rec + shape.scales_at(), rec + shape.scales_at() + out.num_scales * shape.entry_bytes);
    int64_t scale_offset = 0;
    for (size_t i = 0; i < layout_shard.fragments.size(); ++i) {
      const TensorFragment& f = layout_shard.fragments[i];
      float meta[3];
      std::memcpy(meta, rec + shape.fragment_at() + static_cast<int64_t>(i) * 12, 12);
      FragmentQuantInfo info;
      info.tensor = f.tensor;
      info.elements = f.elements;
      info.bucket_offset = f.bucket_offset;
      info.scale = meta[0];
      info.scale_inv = meta[1];
      info.amax = meta[2];
      info.scale_blocks = FragmentScaleBlocks(*layout, f);
      info.scale_offset = scale_offset;
      scale_offset += info.scale_blocks.size();
      out.fragments.push_back(info);
    }
    std::memcpy(data.data() + r * shape.data_bytes, rec + shape.data_at(), static_cast<size_t>(shape.data_bytes));
  }
  return client_internal::MakePulledBucket(std::move(layout), bucket, 0, std::move(data), std::move(shards));
}

}  // namespace mainstay
