#include "common/layout_proto.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/status.h"

namespace mainstay {
namespace {

std::string Index(absl::string_view base, int64_t i) { return absl::StrCat(base, "[", i, "]"); }

template <typename T>
absl::StatusOr<T> AtField(absl::StatusOr<T> value, absl::string_view field) {
  if (!value.ok()) return Annotate(value.status(), field);
  return value;
}

// The inverse of `to_proto` over the dense C++ enum [0, last]; so the two directions cannot
// disagree. Value 0 (*_UNSPECIFIED) is never an image of `to_proto`, so it is rejected here.
template <typename Cpp, typename Proto>
absl::StatusOr<Cpp> InverseOf(Proto (*to_proto)(Cpp), Cpp last, Proto value, absl::string_view type_name,
                              const std::string& value_name) {
  for (int i = 0; i <= static_cast<int>(last); ++i) {
    if (to_proto(static_cast<Cpp>(i)) == value) return static_cast<Cpp>(i);
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown or unspecified ", type_name, " value ",
                                                 static_cast<int>(value),
                                                 value_name.empty() ? "" : absl::StrCat(" (", value_name, ")")));
}

// Product of `shape`: at least one dimension, each >= 1, at most kMaxTotalElements in all.
absl::StatusOr<int64_t> CheckedNumel(const google::protobuf::RepeatedField<int64_t>& shape, absl::string_view field) {
  if (shape.empty()) return InvalidArgumentError(field, "must have at least one dimension");
  int64_t numel = 1;
  for (int d = 0; d < shape.size(); ++d) {
    const int64_t dim = shape[d];
    if (dim < 1) return InvalidArgumentError(Index(field, d), "must be positive, got ", dim);
    // Both factors are positive, so this bounds numel * dim without overflowing.
    if (dim > kMaxTotalElements || numel > kMaxTotalElements / dim) {
      return InvalidArgumentError(field, "more than 2^40 elements");
    }
    numel *= dim;
  }
  return numel;
}

void RangeToProto(const IndexRange& range, v1::IndexRange* out) {
  out->set_begin(range.begin);
  out->set_end(range.end);
}

IndexRange RangeFromProto(const v1::IndexRange& proto) { return {proto.begin(), proto.end()}; }

// Step 1: the scalar fields of every bucket (its shards come last, once tensors are known).
absl::Status BucketHeadersFromProto(const v1::Layout& proto, Layout& layout) {
  const int64_t d = layout.data_parallel_size;
  const int64_t alignment = BucketAlignment(d);
  // Bounds every shard size ComputeLayout can produce, and keeps d * shard_numel < 2^63.
  const int64_t max_shard_numel = kMaxTotalElements + alignment;
  layout.buckets.resize(proto.buckets_size());
  for (int i = 0; i < proto.buckets_size(); ++i) {
    const v1::Bucket& p = proto.buckets(i);
    const std::string field = Index("buckets", i);
    Bucket& b = layout.buckets[i];
    if (p.index() != i) {
      return InvalidArgumentError(field + ".index", "must equal the bucket's position ", i, ", got ", p.index());
    }
    b.index = i;
    MAINSTAY_ASSIGN_OR_RETURN(b.format, AtField(FormatFromProto(p.format()), field + ".format"));
    if (p.shard_numel() < 1 || p.shard_numel() > max_shard_numel) {
      return InvalidArgumentError(field + ".shard_numel", "must be in [1, ", max_shard_numel, "], got ",
                                  p.shard_numel());
    }
    b.shard_numel = p.shard_numel();
    if (p.numel() != d * b.shard_numel) {
      return InvalidArgumentError(field + ".numel", "must be data_parallel_size * shard_numel = ", d * b.shard_numel,
                                  ", got ", p.numel());
    }
    if (p.numel() % alignment != 0) {
      return InvalidArgumentError(field + ".numel", "must be a multiple of BucketAlignment(", d, ") = ", alignment,
                                  ", got ", p.numel());
    }
    b.numel = p.numel();
    if (p.data_numel() < 0 || p.data_numel() > b.numel) {
      return InvalidArgumentError(field + ".data_numel", "must be in [0, numel = ", b.numel, "], got ",
                                  p.data_numel());
    }
    b.data_numel = p.data_numel();
  }
  return absl::OkStatus();
}

// Step 2: tensors, each inside its bucket (whose header is known).
absl::Status TensorsFromProto(const v1::Layout& proto, Layout& layout) {
  absl::flat_hash_map<absl::string_view, int> names;
  layout.tensors.resize(proto.tensors_size());
  for (int i = 0; i < proto.tensors_size(); ++i) {
    const v1::LayoutTensor& p = proto.tensors(i);
    const std::string field = Index("tensors", i);
    LayoutTensor& t = layout.tensors[i];
    if (p.name().empty()) return InvalidArgumentError(field + ".name", "must not be empty");
    auto [it, inserted] = names.emplace(p.name(), i);
    if (!inserted) {
      return InvalidArgumentError(field + ".name", "duplicate name '", p.name(), "' (also tensors[", it->second, "])");
    }
    t.name = p.name();
    MAINSTAY_ASSIGN_OR_RETURN(t.numel, CheckedNumel(p.shape(), field + ".shape"));
    t.shape.assign(p.shape().begin(), p.shape().end());
    if (p.numel() != t.numel) {
      return InvalidArgumentError(field + ".numel", "must be the product of shape, ", t.numel, ", got ", p.numel());
    }
    MAINSTAY_ASSIGN_OR_RETURN(t.format, AtField(FormatFromProto(p.format()), field + ".format"));
    if (p.bucket() < 0 || p.bucket() >= proto.buckets_size()) {
      return InvalidArgumentError(field + ".bucket", "must be in [0, ", proto.buckets_size(), "), got ", p.bucket());
    }
    t.bucket = p.bucket();
    const Bucket& bucket = layout.buckets[t.bucket];
    if (t.format != bucket.format) {
      return InvalidArgumentError(field + ".format", FormatName(t.format), " differs from buckets[", t.bucket,
                                  "].format ", FormatName(bucket.format));
    }
    if (p.bucket_offset() < 0 || p.bucket_offset() % kTensorAlignment != 0 ||
        p.bucket_offset() > bucket.numel - t.numel) {
      return InvalidArgumentError(field + ".bucket_offset", "must be a multiple of ", kTensorAlignment,
                                  " in [0, ", bucket.numel - t.numel, "] (the tensor inside buckets[", t.bucket,
                                  "]), got ", p.bucket_offset());
    }
    t.bucket_offset = p.bucket_offset();
    if (p.param_group() < 0 || p.param_group() >= kMaxParamGroups) {
      return InvalidArgumentError(field + ".param_group", "must be in [0, ", kMaxParamGroups, "), got ", p.param_group());
    }
    t.param_group = p.param_group();
  }
  return absl::OkStatus();
}

// Step 3: each bucket's tensor list, and its shards and fragments.
absl::Status BucketContentsFromProto(const v1::Layout& proto, Layout& layout) {
  const int64_t d = layout.data_parallel_size;
  const int num_tensors = proto.tensors_size();
  std::vector<int64_t> covered(num_tensors, 0);  // fragment elements per tensor
  int64_t listed = 0;
  for (int i = 0; i < proto.buckets_size(); ++i) {
    const v1::Bucket& p = proto.buckets(i);
    const std::string field = Index("buckets", i);
    Bucket& b = layout.buckets[i];

    // Tensors: listed in increasing, non-overlapping bucket order, each in this bucket.
    int64_t end = 0, data_numel = 0;
    b.tensors.reserve(p.tensors_size());
    for (int k = 0; k < p.tensors_size(); ++k) {
      const int32_t t = p.tensors(k);
      const std::string tfield = Index(field + ".tensors", k);
      if (t < 0 || t >= num_tensors) {
        return InvalidArgumentError(tfield, "must be in [0, ", num_tensors, "), got ", t);
      }
      const LayoutTensor& tensor = layout.tensors[t];
      if (tensor.bucket != i) {
        return InvalidArgumentError(tfield, "tensors[", t, "] belongs to buckets[", tensor.bucket, "]");
      }
      if (tensor.bucket_offset < end) {
        return InvalidArgumentError(tfield, "tensors[", t, "] at offset ", tensor.bucket_offset,
                                    " overlaps or precedes the previous tensor, which ends at ", end);
      }
      end = tensor.bucket_offset + tensor.numel;
      data_numel += tensor.numel;
      b.tensors.push_back(t);
    }
    listed += p.tensors_size();
    if (data_numel != b.data_numel) {
      return InvalidArgumentError(field + ".data_numel", "must be the sum of its tensors' numel, ", data_numel,
                                  ", got ", b.data_numel);
    }

    // Shards: exactly D, rank r covering [r * shard_numel, (r + 1) * shard_numel).
    if (p.shards_size() != d) {
      return InvalidArgumentError(field + ".shards", "must hold data_parallel_size = ", d, " shards, got ",
                                  p.shards_size());
    }
    b.shards.resize(d);
    for (int r = 0; r < p.shards_size(); ++r) {
      const v1::Bucket::Shard& ps = p.shards(r);
      const std::string sfield = Index(field + ".shards", r);
      Shard& s = b.shards[r];
      if (ps.rank() != r) return InvalidArgumentError(sfield + ".rank", "must be ", r, ", got ", ps.rank());
      s.rank = r;
      s.elements = RangeFromProto(ps.elements());
      const IndexRange expected = {r * b.shard_numel, (r + 1) * b.shard_numel};
      if (s.elements != expected) {
        return InvalidArgumentError(sfield + ".elements", "must be [", expected.begin, ", ", expected.end, "), got [",
                                    s.elements.begin, ", ", s.elements.end, ")");
      }
      // Fragments: in bucket order inside the shard, each a non-empty slice of a tensor of
      // this bucket at the tensor's own offset.
      int64_t shard_end = s.elements.begin;
      s.fragments.reserve(ps.fragments_size());
      for (int j = 0; j < ps.fragments_size(); ++j) {
        const v1::TensorFragment& pf = ps.fragments(j);
        const std::string ffield = Index(sfield + ".fragments", j);
        TensorFragment f;
        if (pf.tensor() < 0 || pf.tensor() >= num_tensors) {
          return InvalidArgumentError(ffield + ".tensor", "must be in [0, ", num_tensors, "), got ", pf.tensor());
        }
        f.tensor = pf.tensor();
        const LayoutTensor& tensor = layout.tensors[f.tensor];
        if (tensor.bucket != i) {
          return InvalidArgumentError(ffield + ".tensor", "tensors[", f.tensor, "] belongs to buckets[", tensor.bucket,
                                      "]");
        }
        f.elements = RangeFromProto(pf.elements());
        if (f.elements.begin < 0 || f.elements.empty() || f.elements.end > tensor.numel) {
          return InvalidArgumentError(ffield + ".elements", "must be a non-empty range inside [0, ", tensor.numel,
                                      "), got [", f.elements.begin, ", ", f.elements.end, ")");
        }
        if (layout.policy == LayoutPolicy::kWholeTensor && f.elements.size() != tensor.numel) {
          return InvalidArgumentError(ffield + ".elements", "must hold all of tensors[", f.tensor,
                                      "] under the whole_tensor policy");
        }
        f.bucket_offset = pf.bucket_offset();
        if (f.bucket_offset != tensor.bucket_offset + f.elements.begin) {
          return InvalidArgumentError(ffield + ".bucket_offset", "must be tensors[", f.tensor,
                                      "].bucket_offset + elements.begin = ", tensor.bucket_offset + f.elements.begin,
                                      ", got ", f.bucket_offset);
        }
        if (f.bucket_offset < shard_end || f.bucket_offset + f.elements.size() > s.elements.end) {
          return InvalidArgumentError(ffield, "bucket elements [", f.bucket_offset, ", ",
                                      f.bucket_offset + f.elements.size(), ") must lie in the shard after the ",
                                      "previous fragment, within [", shard_end, ", ", s.elements.end, ")");
        }
        shard_end = f.bucket_offset + f.elements.size();
        covered[f.tensor] += f.elements.size();
        s.fragments.push_back(f);
      }
    }
  }
  // Every tensor is listed by its own bucket only (checked above) and at most once there
  // (offsets strictly increase), so this count means each is listed exactly once.
  if (listed != num_tensors) {
    return InvalidArgumentError("buckets", "list ", listed, " tensors in all, expected ", num_tensors);
  }
  // Fragments are disjoint (ordered within a shard, shards disjoint) and inside their tensor,
  // so covering numel elements means they partition it exactly.
  for (int t = 0; t < num_tensors; ++t) {
    if (covered[t] != layout.tensors[t].numel) {
      return InvalidArgumentError(Index("tensors", t), "its fragments cover ", covered[t], " of its ",
                                  layout.tensors[t].numel, " elements");
    }
  }
  return absl::OkStatus();
}

}  // namespace

// ---- Enums. ToProto switches have no default, so a new C++ value is a compile error here.

v1::Format FormatToProto(Format format) {
  switch (format) {
    case Format::kBF16:
      return v1::FORMAT_BF16;
    case Format::kFP16:
      return v1::FORMAT_FP16;
    case Format::kFP8E4M3Delayed:
      return v1::FORMAT_FP8_E4M3_DELAYED;
    case Format::kFP8E5M2Delayed:
      return v1::FORMAT_FP8_E5M2_DELAYED;
    case Format::kFP8E4M3Current:
      return v1::FORMAT_FP8_E4M3_CURRENT;
    case Format::kFP8E5M2Current:
      return v1::FORMAT_FP8_E5M2_CURRENT;
    case Format::kMXFP8:
      return v1::FORMAT_MXFP8;
    case Format::kFP8Block:
      return v1::FORMAT_FP8_BLOCK;
    case Format::kNVFP4:
      return v1::FORMAT_NVFP4;
  }
  return v1::FORMAT_UNSPECIFIED;
}

absl::StatusOr<Format> FormatFromProto(v1::Format format) {
  return InverseOf(&FormatToProto, static_cast<Format>(AllFormats().size() - 1), format, "Format",
                   v1::Format_Name(format));
}

v1::ElementType ElementTypeToProto(ElementType type) {
  switch (type) {
    case ElementType::kFloat32:
      return v1::ELEMENT_TYPE_FP32;
    case ElementType::kBFloat16:
      return v1::ELEMENT_TYPE_BF16;
    case ElementType::kFloat16:
      return v1::ELEMENT_TYPE_FP16;
    case ElementType::kE4M3:
      return v1::ELEMENT_TYPE_E4M3;
    case ElementType::kE5M2:
      return v1::ELEMENT_TYPE_E5M2;
    case ElementType::kE2M1:
      return v1::ELEMENT_TYPE_E2M1;
    case ElementType::kE8M0:
      return v1::ELEMENT_TYPE_E8M0;
  }
  return v1::ELEMENT_TYPE_UNSPECIFIED;
}

absl::StatusOr<ElementType> ElementTypeFromProto(v1::ElementType type) {
  return InverseOf(&ElementTypeToProto, ElementType::kE8M0, type, "ElementType", v1::ElementType_Name(type));
}

v1::LayoutPolicy LayoutPolicyToProto(LayoutPolicy policy) {
  switch (policy) {
    case LayoutPolicy::kFlat:
      return v1::LAYOUT_POLICY_FLAT;
    case LayoutPolicy::kWholeTensor:
      return v1::LAYOUT_POLICY_WHOLE_TENSOR;
  }
  return v1::LAYOUT_POLICY_UNSPECIFIED;
}

absl::StatusOr<LayoutPolicy> LayoutPolicyFromProto(v1::LayoutPolicy policy) {
  return InverseOf(&LayoutPolicyToProto, LayoutPolicy::kWholeTensor, policy, "LayoutPolicy",
                   v1::LayoutPolicy_Name(policy));
}

// ---- TensorSpec.

void TensorSpecToProto(const TensorSpec& spec, v1::TensorSpec* out) {
  out->Clear();
  out->set_name(spec.name);
  out->mutable_shape()->Add(spec.shape.begin(), spec.shape.end());
  out->set_format(FormatToProto(spec.format));
}

absl::StatusOr<TensorSpec> TensorSpecFromProto(const v1::TensorSpec& proto) {
  TensorSpec spec;
  if (proto.name().empty()) return InvalidArgumentError("name", "must not be empty");
  spec.name = proto.name();
  MAINSTAY_RETURN_IF_ERROR(CheckedNumel(proto.shape(), "shape").status());
  spec.shape.assign(proto.shape().begin(), proto.shape().end());
  if (proto.format() != v1::FORMAT_UNSPECIFIED) {
    MAINSTAY_ASSIGN_OR_RETURN(spec.format, AtField(FormatFromProto(proto.format()), "format"));
  }
  return spec;
}

// ---- Layout.

void LayoutToProto(const Layout& layout, v1::Layout* out) {
  out->Clear();
  out->set_policy(LayoutPolicyToProto(layout.policy));
  out->set_data_parallel_size(layout.data_parallel_size);
  out->set_bucket_numel(layout.bucket_numel);
  out->mutable_tensors()->Reserve(static_cast<int>(layout.tensors.size()));
  for (const LayoutTensor& t : layout.tensors) {
    v1::LayoutTensor* p = out->add_tensors();
    p->set_name(t.name);
    p->mutable_shape()->Add(t.shape.begin(), t.shape.end());
    p->set_format(FormatToProto(t.format));
    p->set_numel(t.numel);
    p->set_bucket(t.bucket);
    p->set_bucket_offset(t.bucket_offset);
    p->set_param_group(t.param_group);
  }
  out->mutable_buckets()->Reserve(static_cast<int>(layout.buckets.size()));
  for (const Bucket& b : layout.buckets) {
    v1::Bucket* p = out->add_buckets();
    p->set_index(b.index);
    p->set_format(FormatToProto(b.format));
    p->set_numel(b.numel);
    p->set_shard_numel(b.shard_numel);
    p->set_data_numel(b.data_numel);
    p->mutable_tensors()->Add(b.tensors.begin(), b.tensors.end());
    for (const Shard& s : b.shards) {
      v1::Bucket::Shard* ps = p->add_shards();
      ps->set_rank(s.rank);
      RangeToProto(s.elements, ps->mutable_elements());
      for (const TensorFragment& f : s.fragments) {
        v1::TensorFragment* pf = ps->add_fragments();
        pf->set_tensor(f.tensor);
        RangeToProto(f.elements, pf->mutable_elements());
        pf->set_bucket_offset(f.bucket_offset);
      }
    }
  }
}

absl::StatusOr<Layout> LayoutFromProto(const v1::Layout& proto) {
  Layout layout;
  MAINSTAY_ASSIGN_OR_RETURN(layout.policy, AtField(LayoutPolicyFromProto(proto.policy()), "policy"));
  if (proto.data_parallel_size() < 1 || proto.data_parallel_size() > kMaxDataParallelSize) {
    return InvalidArgumentError("data_parallel_size", "must be in [1, ", kMaxDataParallelSize, "], got ",
                                proto.data_parallel_size());
  }
  layout.data_parallel_size = proto.data_parallel_size();
  if (proto.bucket_numel() < 1 || proto.bucket_numel() > kMaxTotalElements) {
    return InvalidArgumentError("bucket_numel", "must be in [1, 2^40], got ", proto.bucket_numel());
  }
  layout.bucket_numel = proto.bucket_numel();
  MAINSTAY_RETURN_IF_ERROR(BucketHeadersFromProto(proto, layout));
  MAINSTAY_RETURN_IF_ERROR(TensorsFromProto(proto, layout));
  MAINSTAY_RETURN_IF_ERROR(BucketContentsFromProto(proto, layout));
  return layout;
}

void StepHyperToProto(std::span<const GroupHyper> groups, google::protobuf::RepeatedPtrField<v1::GroupHyperparams>* out) {
  for (const GroupHyper& g : groups) {
    v1::GroupHyperparams* p = out->Add();
    p->set_lr(g.lr);
    p->set_weight_decay(g.weight_decay);
  }
}

StepHyper StepHyperFromProto(const google::protobuf::RepeatedPtrField<v1::GroupHyperparams>& groups) {
  StepHyper out;
  out.reserve(static_cast<size_t>(groups.size()));
  for (const v1::GroupHyperparams& g : groups) out.push_back({g.lr(), g.weight_decay()});
  return out;
}

}  // namespace mainstay
