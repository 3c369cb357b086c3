// mainstay.Error, mainstay.Layout (dict/list views + bucket buffer helpers), compute_layout.
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "client/python/py_common.h"

namespace mainstay::python {
namespace {

PyObject* g_error = nullptr;

py::tuple Range(IndexRange r) { return py::make_tuple(r.begin, r.end); }

py::dict TensorDict(const Layout& l, int32_t index) {
  const LayoutTensor& t = l.tensors[index];
  py::dict d;
  d["index"] = index;
  d["name"] = t.name;
  d["shape"] = py::tuple(py::cast(t.shape));
  d["format"] = std::string(FormatName(t.format));
  d["numel"] = t.numel;
  d["bucket"] = t.bucket;
  d["bucket_offset"] = t.bucket_offset;
  d["param_group"] = t.param_group;
  return d;
}

py::dict BucketDict(const Layout& l, const Bucket& b) {
  py::dict d;
  d["index"] = b.index;
  d["format"] = std::string(FormatName(b.format));
  d["numel"] = b.numel;
  d["shard_numel"] = b.shard_numel;
  d["shard_bytes"] = DataBytes(b.format, b.shard_numel);  // packed data of one shard
  d["bucket_bytes"] = DataBytes(b.format, b.numel);       // of every shard
  d["data_numel"] = b.data_numel;
  d["tensors"] = py::cast(b.tensors);
  py::list shards;
  for (const Shard& s : b.shards) {
    py::dict sd;
    sd["rank"] = s.rank;
    sd["elements"] = Range(s.elements);
    py::list frags;
    for (const TensorFragment& f : s.fragments) {
      py::dict fd;
      fd["tensor"] = f.tensor;
      fd["name"] = l.tensors[f.tensor].name;
      fd["elements"] = Range(f.elements);
      fd["bucket_offset"] = f.bucket_offset;
      frags.append(fd);
    }
    sd["fragments"] = frags;
    shards.append(sd);
  }
  d["shards"] = shards;
  return d;
}

py::list TensorsList(const Layout& l) {
  py::list out;
  for (size_t i = 0; i < l.tensors.size(); ++i) out.append(TensorDict(l, static_cast<int32_t>(i)));
  return out;
}

py::list BucketsList(const Layout& l) {
  py::list out;
  for (const Bucket& b : l.buckets) out.append(BucketDict(l, b));
  return out;
}

int32_t TensorIndex(const Layout& l, const py::object& key) {
  if (py::isinstance<py::str>(key)) return Take(FindTensor(l, key.cast<std::string>()));
  const int32_t index = key.cast<int32_t>();
  Take(TensorBucketRange(l, index));  // range check
  return index;
}

const Bucket& BucketAt(const Layout& l, int32_t bucket) {
  Take(ShardBucketRange(l, bucket, 0));  // range check
  return l.buckets[bucket];
}

// {name: array} -> flat bucket buffer (float32 or uint16, from the arrays' dtype).
py::array Flatten(const PyLayout& self, int32_t bucket, const py::dict& tensors) {
  const Layout& l = *self.layout;
  const Bucket& b = BucketAt(l, bucket);
  py::dtype dtype = py::dtype::of<float>();
  if (!tensors.empty()) {
    dtype = py::array::ensure(*tensors.begin()->second).dtype();
    if (!dtype.is(py::dtype::of<float>()) && !dtype.is(py::dtype::of<uint16_t>())) {
      throw py::value_error("flatten: arrays must be float32 (or uint16 bf16 bits)");
    }
  }
  py::array out(dtype, std::vector<py::ssize_t>{b.numel});
  std::memset(out.mutable_data(), 0, b.numel * dtype.itemsize());
  for (const auto& [key, value] : tensors) {
    const int32_t t = Take(FindTensor(l, key.cast<std::string>()));
    const LayoutTensor& info = l.tensors[t];
    if (info.bucket != bucket) {
      throw py::value_error(absl::StrCat("flatten: ", info.name, " is in bucket ", info.bucket, ", not ", bucket));
    }
    py::array a = py::array::ensure(value, py::array::c_style);
    if (!a || !a.dtype().is(dtype) || a.size() != info.numel) {
      throw py::value_error(absl::StrCat("flatten: ", info.name, " needs ", info.numel, " elements of ",
                                         std::string(py::str(dtype))));
    }
    std::memcpy(static_cast<char*>(out.mutable_data()) + info.bucket_offset * dtype.itemsize(), a.data(),
                info.numel * dtype.itemsize());
  }
  return out;
}

// Flat bucket buffer -> {name: array shaped like the tensor} (copies).
py::dict Unflatten(const PyLayout& self, int32_t bucket, const py::array& flat_in) {
  const Layout& l = *self.layout;
  const Bucket& b = BucketAt(l, bucket);
  py::array flat = py::array::ensure(flat_in, py::array::c_style);
  if (!flat || flat.size() != b.numel) throw py::value_error(absl::StrCat("unflatten: need ", b.numel, " elements"));
  py::dict out;
  const py::ssize_t item = flat.itemsize();
  for (int32_t t : b.tensors) {
    const LayoutTensor& info = l.tensors[t];
    py::array a(flat.dtype(), std::vector<py::ssize_t>(info.shape.begin(), info.shape.end()));
    std::memcpy(a.mutable_data(), static_cast<const char*>(flat.data()) + info.bucket_offset * item, info.numel * item);
    out[py::str(info.name)] = a;
  }
  return out;
}

}  // namespace

[[noreturn]] void ThrowStatus(const absl::Status& status) {
  py::object type = py::reinterpret_borrow<py::object>(g_error);
  const std::string code = absl::StatusCodeToString(status.code());
  py::object e = type(absl::StrCat(code, ": ", status.message()));
  e.attr("code") = code;
  e.attr("message") = std::string(status.message());
  std::optional<ErrorInfo> info = GetErrorInfo(status);
  if (info.has_value()) {
    py::dict d;
    d["placement_epoch"] = info->placement_epoch;
    d["committed_step"] = info->committed_step;
    d["version"] = info->version;
    e.attr("info") = d;
  } else {
    e.attr("info") = py::none();
  }
  PyErr_SetObject(g_error, e.ptr());
  throw py::error_already_set();
}

namespace {

// What an object's __cuda_array_interface__ says, checked: C-contiguous, not masked, a pointer.
struct CudaArray {
  std::string typestr;
  int64_t element_bytes = 0;  // from typestr
  int64_t elements = 0;
  uintptr_t address = 0;
  bool readonly = false;
  std::optional<void*> stream;  // the stream it names, if any
};

CudaArray ParseCudaArray(const py::object& data) {
  const py::dict iface = data.attr("__cuda_array_interface__").cast<py::dict>();
  auto field = [&](const char* key) -> py::object {
    if (!iface.contains(key)) throw py::value_error(absl::StrCat("__cuda_array_interface__ has no '", key, "'"));
    return iface[key];
  };
  CudaArray a;
  a.typestr = py::str(field("typestr")).cast<std::string>();
  int digits = 0;
  if (a.typestr.size() < 3 || !absl::SimpleAtoi(a.typestr.substr(2), &digits) || digits < 1) {
    throw py::value_error(absl::StrCat("__cuda_array_interface__: typestr '", a.typestr, "' names no element size"));
  }
  a.element_bytes = digits;
  a.elements = 1;
  std::vector<int64_t> shape;
  for (const py::handle d : field("shape").cast<py::tuple>()) shape.push_back(d.cast<int64_t>());
  for (int64_t d : shape) a.elements *= d;
  if (iface.contains("strides") && !iface["strides"].is_none()) {
    int64_t expect = a.element_bytes;
    const py::tuple strides = iface["strides"].cast<py::tuple>();
    for (size_t k = shape.size(); k-- > 0;) {
      if (shape[k] > 1 && strides[k].cast<int64_t>() != expect) {
        throw py::value_error("a CUDA array must be C-contiguous (e.g. t.contiguous())");
      }
      expect *= shape[k];
    }
  }
  if (iface.contains("mask") && !iface["mask"].is_none()) throw py::value_error("a masked CUDA array");
  const py::tuple pointer = field("data").cast<py::tuple>();
  a.address = pointer[0].cast<uintptr_t>();
  a.readonly = pointer.size() > 1 && pointer[1].cast<bool>();
  if (a.address == 0 && a.elements > 0) throw py::value_error("a CUDA array with a null pointer");
  if (iface.contains("stream") && !iface["stream"].is_none()) {
    const auto s = iface["stream"].cast<uint64_t>();
    if (s == 0) throw py::value_error("__cuda_array_interface__: stream 0 is ambiguous (the interface forbids it)");
    a.stream = reinterpret_cast<void*>(static_cast<uintptr_t>(s));
  }
  return a;
}

// SpanOf for an object with __cuda_array_interface__.
ElementSpan CudaArraySpan(const py::object& data, const std::string& dtype, py::object* keep,
                          std::optional<void*>* stream) {
  const CudaArray a = ParseCudaArray(data);
  ElementType type = ElementType::kFloat32;
  if (a.typestr == "<f4") {
  } else if (a.typestr == "<f2") {
    type = ElementType::kFloat16;
  } else if (a.typestr == "<i2" || a.typestr == "<u2") {
    type = dtype == "fp16" ? ElementType::kFloat16 : ElementType::kBFloat16;
  } else {
    throw py::value_error(absl::StrCat("a CUDA array of typestr '", a.typestr,
                                       "': expected float32 (<f4), float16 (<f2), or int16/uint16 (<i2, <u2) "
                                       "holding bf16 bits (a bfloat16 tensor: pass t.view(torch.int16))"));
  }
  if (stream != nullptr && a.stream.has_value()) *stream = a.stream;
  *keep = data;
  return {reinterpret_cast<const void*>(a.address), type, a.elements};
}

}  // namespace

ElementSpan SpanOf(const py::object& data, const std::string& dtype, py::object* keep, std::optional<void*>* stream) {
  if (py::hasattr(data, "__cuda_array_interface__")) return CudaArraySpan(data, dtype, keep, stream);
  py::array a = py::array::ensure(data, py::array::c_style);
  if (!a) throw py::value_error("expected a numpy array or a CUDA array (__cuda_array_interface__)");
  *keep = a;
  const int64_t n = a.size();
  if (a.dtype().is(py::dtype::of<float>())) {
    return {a.data(), ElementType::kFloat32, n};
  }
  if (a.dtype().is(py::dtype("float16"))) return {a.data(), ElementType::kFloat16, n};
  if (a.dtype().is(py::dtype::of<uint16_t>()) || a.dtype().is(py::dtype::of<int16_t>())) {
    return {a.data(), dtype == "fp16" ? ElementType::kFloat16 : ElementType::kBFloat16, n};
  }
  throw py::value_error("arrays must be float32, float16, or uint16/int16 holding bf16 bits");
}

std::span<uint8_t> DestinationOf(const py::object& out, std::optional<void*>* stream) {
  if (py::hasattr(out, "__cuda_array_interface__")) {
    const CudaArray a = ParseCudaArray(out);
    if (a.readonly) throw py::value_error("the destination CUDA array is read-only");
    *stream = a.stream;
    return {reinterpret_cast<uint8_t*>(a.address), static_cast<size_t>(a.elements * a.element_bytes)};
  }
  if (!py::isinstance<py::array>(out)) {
    throw py::value_error("the destination must be a numpy array or a CUDA array (__cuda_array_interface__)");
  }
  py::array a = py::reinterpret_borrow<py::array>(out);
  if (!(a.flags() & py::array::c_style)) throw py::value_error("the destination array must be C-contiguous");
  if (!a.writeable()) throw py::value_error("the destination array is read-only");
  if (a.dtype().has_fields() || a.dtype().kind() == 'O') {
    throw py::value_error("the destination array must hold plain numbers (e.g. np.uint8), not objects or records");
  }
  return {static_cast<uint8_t*>(a.mutable_data()), static_cast<size_t>(a.nbytes())};
}

py::dict PulledShardDict(const PulledShard& p) {
  py::dict d;
  d["shard"] = p.shard;
  d["version"] = p.version;
  d["unchanged"] = p.unchanged;
  d["num_scales"] = p.num_scales;
  d["scales"] = py::bytes(reinterpret_cast<const char*>(p.scales.data()), p.scales.size());
  py::list frags;
  for (const FragmentQuantInfo& f : p.fragments) {
    py::dict fd;
    fd["tensor"] = f.tensor;
    fd["elements"] = py::make_tuple(f.elements.begin, f.elements.end);
    fd["bucket_offset"] = f.bucket_offset;
    fd["scale"] = f.scale;
    fd["scale_inv"] = f.scale_inv;
    fd["amax"] = f.amax;
    fd["scale_blocks"] = py::make_tuple(f.scale_blocks.begin, f.scale_blocks.end);
    fd["scale_offset"] = f.scale_offset;
    frags.append(fd);
  }
  d["fragments"] = frags;
  return d;
}

py::dict StepStatsDict(const StepStats& s) {
  py::dict d;
  d["step"] = s.step;
  d["version"] = s.version;
  d["skipped"] = s.skipped;
  d["grad_norm"] = s.grad_norm;
  d["clip_factor"] = s.clip_factor;
  d["loss_scale"] = s.loss_scale;
  d["lr"] = s.lr;
  d["weight_decay"] = s.weight_decay;
  py::list groups;
  for (const GroupHyper& g : s.groups) {
    py::dict gd;
    gd["lr"] = g.lr;
    gd["weight_decay"] = g.weight_decay;
    groups.append(gd);
  }
  d["groups"] = groups;
  d["nonfinite_count"] = s.nonfinite_count;
  d["commit_unix_ms"] = s.commit_unix_ms;
  d["step_time_ms"] = s.step_time_ms;
  d["attempts"] = s.attempts;
  d["first_abort"] = s.first_abort;
  d["forwarded_bytes"] = s.forwarded_bytes;
  py::dict phases;
  phases["wait_inputs_ms"] = s.phases.wait_inputs_ms;
  phases["grad_stats_ms"] = s.phases.grad_stats_ms;
  phases["reduce_stats_ms"] = s.phases.reduce_stats_ms;
  phases["update_ms"] = s.phases.update_ms;
  phases["reduce_amax_ms"] = s.phases.reduce_amax_ms;
  phases["quantize_ms"] = s.phases.quantize_ms;
  d["phases"] = phases;
  d["tensor_amax"] = py::cast(s.tensor_amax);
  return d;
}

py::dict PushResultDict(const PushResult& r) {
  py::dict d;
  d["duplicate"] = r.duplicate;
  d["received_elements"] = r.received_elements;
  d["contributions"] = r.contributions;
  return d;
}

void BindLayout(py::module_& m) {
  g_error = PyErr_NewExceptionWithDoc("mainstay.Error",
                                      "A Mainstay call failed; .code is the status code name (UNAVAILABLE, ...), "
                                      ".message the text, .info the daemon's ErrorInfo dict or None.",
                                      PyExc_RuntimeError, nullptr);
  m.attr("Error") = py::handle(g_error);

  py::class_<PyLayout>(m, "Layout", "A job's layout: buckets, shards, tensors (element offsets).")
      .def_property_readonly("policy", [](const PyLayout& s) { return std::string(LayoutPolicyName(s.layout->policy)); })
      .def_property_readonly("data_parallel_size", [](const PyLayout& s) { return s.layout->data_parallel_size; })
      .def("shard_record_bytes", [](const PyLayout& s, int32_t bucket) {
        return PulledBucket::ShardRecordBytes(*s.layout, bucket);
      }, py::arg("bucket"), "Bytes of one shard record of the bucket (PulledBucket.shard_record).")
      .def_property_readonly("num_param_groups", [](const PyLayout& s) { return NumParamGroups(*s.layout); })
      .def_property_readonly("bucket_numel", [](const PyLayout& s) { return s.layout->bucket_numel; })
      .def_property_readonly("tensors", [](const PyLayout& s) { return TensorsList(*s.layout); })
      .def_property_readonly("buckets", [](const PyLayout& s) { return BucketsList(*s.layout); })
      .def("to_dict", [](const PyLayout& s) {
        py::dict d;
        d["policy"] = std::string(LayoutPolicyName(s.layout->policy));
        d["data_parallel_size"] = s.layout->data_parallel_size;
        d["bucket_numel"] = s.layout->bucket_numel;
        d["tensors"] = TensorsList(*s.layout);
        d["buckets"] = BucketsList(*s.layout);
        return d;
      })
      .def("tensor_index", [](const PyLayout& s, const std::string& name) { return Take(FindTensor(*s.layout, name)); })
      .def("tensor", [](const PyLayout& s, const py::object& key) { return TensorDict(*s.layout, TensorIndex(*s.layout, key)); })
      .def("bucket_buffer", [](const PyLayout& s, int32_t bucket, const py::object& dtype) {
        const Bucket& b = BucketAt(*s.layout, bucket);
        py::array out(py::dtype::from_args(dtype), std::vector<py::ssize_t>{b.numel});
        std::memset(out.mutable_data(), 0, b.numel * out.itemsize());
        return out;
      }, py::arg("bucket"), py::arg("dtype") = py::dtype::of<float>(), "Zero-filled flat buffer of a bucket.")
      .def("shard_range", [](const PyLayout& s, int32_t bucket, int32_t shard) {
        return Range(Take(ShardBucketRange(*s.layout, bucket, shard)));
      })
      .def("shard_view", [](const PyLayout& s, int32_t bucket, int32_t shard, py::array flat) {
        const IndexRange r = Take(ShardBucketRange(*s.layout, bucket, shard));
        if (flat.ndim() != 1 || flat.size() != s.layout->buckets[bucket].numel) {
          throw py::value_error("shard_view: expected the bucket's flat buffer");
        }
        return flat[py::slice(r.begin, r.end, 1)];
      }, "View (no copy) of shard `shard` inside a flat bucket buffer.")
      .def("flatten", &Flatten, py::arg("bucket"), py::arg("tensors"),
           "{name: array} -> flat bucket buffer; tensors not given and padding stay zero.")
      .def("unflatten", &Unflatten, py::arg("bucket"), py::arg("flat"),
           "Flat bucket buffer -> {name: array with the tensor's shape} (copies).");

  m.def("compute_layout", [](const std::string& spec_json, int64_t data_parallel_size) {
    return PyLayout{std::make_shared<const Layout>(Take(ComputeJobLayout(spec_json, data_parallel_size)))};
  }, py::arg("spec_json"), py::arg("data_parallel_size") = 0,
        "The layout the coordinator computes for a job spec (JSON text), offline; D overrides the spec's.");
}

}  // namespace mainstay::python
