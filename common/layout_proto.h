// Conversion between the layout types of common/layout.h and their wire form in
// proto/mainstay/v1/common.proto.
//
// ToProto never fails and overwrites the whole output message. FromProto treats the message as
// untrusted input (it came over the network and a client builds buffers from it): it checks
// every enum value and index and every structural promise of layout.h, and answers
// INVALID_ARGUMENT whose message starts with the path of the offending field, for example
// "buckets[2].shards[1].fragments[0].bucket_offset: ...". On success
// LayoutFromProto(LayoutToProto(x)) == x for every Layout that ComputeLayout returns.
//
// Enums: proto value 0 (*_UNSPECIFIED) and values unknown to this build are rejected, except
// for TensorSpec.format, where FORMAT_UNSPECIFIED means "not resolved yet" and reads as
// bf16, the C++ default.
//
// Thread safety: every function is pure and may be called concurrently.
#ifndef MAINSTAY_COMMON_LAYOUT_PROTO_H_
#define MAINSTAY_COMMON_LAYOUT_PROTO_H_

#include "absl/status/statusor.h"
#include "common/format.h"
#include "common/layout.h"
#include "common/step_hyper.h"
#include "common/tensor_spec.h"
#include "mainstay/v1/common.pb.h"

namespace mainstay {

v1::Format FormatToProto(Format format);
absl::StatusOr<Format> FormatFromProto(v1::Format format);

v1::ElementType ElementTypeToProto(ElementType type);
absl::StatusOr<ElementType> ElementTypeFromProto(v1::ElementType type);

v1::LayoutPolicy LayoutPolicyToProto(LayoutPolicy policy);
absl::StatusOr<LayoutPolicy> LayoutPolicyFromProto(v1::LayoutPolicy policy);

void TensorSpecToProto(const TensorSpec& spec, v1::TensorSpec* out);
// Checks: non-empty name, at least one dimension, every dimension >= 1, at most 2^40 elements.
absl::StatusOr<TensorSpec> TensorSpecFromProto(const v1::TensorSpec& proto);

void LayoutToProto(const Layout& layout, v1::Layout* out);
// Checks, besides enums and indices: D in [1, kMaxDataParallelSize]; per tensor a unique name,
// numel = product of shape, 64-element-aligned bucket_offset inside its bucket and the bucket's
// format; per bucket index = position, numel = D * shard_numel and a multiple of
// BucketAlignment(D), data_numel = the sum of its tensors, tensors listed once in increasing
// non-overlapping order, exactly D shards with rank r covering [r * shard_numel,
// (r+1) * shard_numel); fragments inside their shard, in order, consistent with their tensor's
// bucket_offset, and partitioning every tensor exactly (whole tensors under kWholeTensor).
absl::StatusOr<Layout> LayoutFromProto(const v1::Layout& proto);

// A step's per-group hyperparameters <-> repeated GroupHyperparams (FinishStepRequest.groups,
// StepStats.groups, ReplicaInputHeader.groups). Values are copied as they are (CheckStepHyper
// validates them); ToProto appends to `out`.
void StepHyperToProto(std::span<const GroupHyper> groups, google::protobuf::RepeatedPtrField<v1::GroupHyperparams>* out);
StepHyper StepHyperFromProto(const google::protobuf::RepeatedPtrField<v1::GroupHyperparams>& groups);

}  // namespace mainstay

#endif  // MAINSTAY_COMMON_LAYOUT_PROTO_H_
