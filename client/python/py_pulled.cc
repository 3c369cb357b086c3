// mainstay.PulledBucket: per-tensor views (numpy arrays over the pulled bytes) and dequantize.
#include <cstring>
#include <string>
#include <vector>

#include "client/python/py_common.h"
#include "mainstay/published.h"

namespace mainstay::python {
namespace {

// A read-only array over `bytes` of a PulledBucket; the capsule keeps a copy of it (cheap: the
// bytes are shared) alive as long as the array.
py::array View(const PulledBucket& owner, std::span<const uint8_t> bytes, const py::dtype& dtype,
               std::vector<py::ssize_t> shape = {}) {
  auto* keep = new PulledBucket(owner);
  py::capsule base(keep, [](void* p) { delete static_cast<PulledBucket*>(p); });
  if (shape.empty()) shape = {static_cast<py::ssize_t>(bytes.size()) / dtype.itemsize()};
  py::array a(dtype, shape, {}, bytes.data(), base);
  py::detail::array_proxy(a.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  return a;
}

// numpy dtype of a format's block scales: uint8 bits for E8M0 / E4M3, float32 for FP32.
py::dtype ScaleDtype(Format format) {
  const FormatDescriptor& d = Describe(format);
  if (d.has_block_scales() && d.block_scale == ElementType::kFloat32) return py::dtype::of<float>();
  return py::dtype::of<uint8_t>();
}

int32_t TensorOf(const PulledBucket& p, const py::object& key) {
  if (py::isinstance<py::str>(key)) return Take(FindTensor(p.layout(), key.cast<std::string>()));
  return key.cast<int32_t>();
}

py::tuple Range(IndexRange r) { return py::make_tuple(r.begin, r.end); }

py::dict TensorViewDict(const PulledBucket& p, const py::object& key) {
  const int32_t tensor = TensorOf(p, key);
  const TensorView v = Take(p.Tensor(tensor));
  const py::dtype scale_dtype = ScaleDtype(v.format);
  py::dict d;
  d["index"] = v.tensor;
  d["name"] = v.info->name;
  d["shape"] = py::tuple(py::cast(v.info->shape));
  d["format"] = std::string(FormatName(v.format));
  d["complete"] = v.complete;
  d["elements"] = Range(v.elements);
  d["data"] = View(p, v.data, py::dtype::of<uint8_t>());
  d["scale"] = v.scale;
  d["scale_inv"] = v.scale_inv;
  d["amax"] = v.amax;
  py::list frags;
  for (const FragmentView& f : v.fragments) {
    py::dict fd;
    fd["shard"] = f.shard;
    fd["elements"] = Range(f.elements);
    fd["data"] = View(p, f.data, py::dtype::of<uint8_t>());
    fd["scales"] = View(p, f.scales, scale_dtype);
    fd["scale_blocks"] = Range(f.scale_blocks);
    fd["scale"] = f.scale;
    fd["scale_inv"] = f.scale_inv;
    fd["amax"] = f.amax;
    frags.append(fd);
  }
  d["fragments"] = frags;
  if (Describe(v.format).has_block_scales()) {
    const std::vector<uint8_t> grid = Take(p.TensorScaleGrid(tensor));
    const Matrix2D g = ScaleGrid(v.format, View2D(v.info->shape));
    py::array a(scale_dtype, std::vector<py::ssize_t>{g.rows, g.cols});
    std::memcpy(a.mutable_data(), grid.data(), grid.size());
    d["scales"] = a;  // the tensor's compact scale grid, merged from the fragments
  } else {
    d["scales"] = py::none();
  }
  return d;
}

py::array Dequantize(const PulledBucket& p, const py::object& key) {
  const int32_t tensor = TensorOf(p, key);
  const LayoutTensor& info = Take(p.Tensor(tensor)).info[0];
  py::array_t<float> out(std::vector<py::ssize_t>(info.shape.begin(), info.shape.end()));
  std::span<float> dst(out.mutable_data(), static_cast<size_t>(info.numel));
  absl::Status s;
  {
    py::gil_scoped_release release;
    s = p.Dequantize(tensor, dst);
  }
  Check(s);
  return out;
}

// A writable C-contiguous array of `n` elements of T: `out` when given (checked; `what` names
// the call and the size in its messages), else a new one.
template <typename T>
py::array_t<T> OutArray(const py::object& out_obj, int64_t n, const std::string& what) {
  if (out_obj.is_none()) return py::array_t<T>(std::vector<py::ssize_t>{static_cast<py::ssize_t>(n)});
  const std::string need = what + ": out must be a writable C-contiguous " + std::string(py::str(py::dtype::of<T>())) +
                           " numpy array of " + std::to_string(n) + " elements";
  if (!py::isinstance<py::array>(out_obj)) throw py::type_error(need);
  py::array given = py::reinterpret_borrow<py::array>(out_obj);
  if (!given.dtype().is(py::dtype::of<T>()) || !(given.flags() & py::array::c_style) || !given.writeable() ||
      given.size() != n) {
    throw py::value_error(need + "; got " + std::string(py::str(given.dtype())) + " of " +
                          std::to_string(given.size()) + " elements");
  }
  return py::reinterpret_borrow<py::array_t<T>>(given);
}

// FP32 values of every covered bucket element, into `out` (a writable C-contiguous float32
// array of elements().size(), e.g. a torch tensor's .numpy() view: no copy) or a new array.
py::array DequantizeCovered(const PulledBucket& p, const py::object& out_obj) {
  const int64_t n = p.elements().size();
  py::array_t<float> out = OutArray<float>(out_obj, n, "dequantize_covered (the covered shards of the bucket)");
  std::span<float> dst(out.mutable_data(), static_cast<size_t>(n));
  absl::Status s;
  {
    py::gil_scoped_release release;
    s = p.DequantizeCovered(dst);
  }
  Check(s);
  return out;
}

py::array_t<uint8_t> ShardRecord(const PulledBucket& p, const py::object& out_obj) {
  py::array_t<uint8_t> out = OutArray<uint8_t>(out_obj, PulledBucket::ShardRecordBytes(p.layout(), p.bucket()),
                                               "shard_record");
  Check(p.WriteShardRecord(std::span<uint8_t>(out.mutable_data(), static_cast<size_t>(out.size()))));
  return out;
}

PulledBucket FromShardRecords(const PyLayout& layout, int32_t bucket, const py::buffer& records) {
  // Any contiguous byte buffer (numpy uint8, bytes); other dtypes are reinterpreted as bytes by
  // the caller, not converted here.
  const py::array given = py::array::ensure(records);
  if (!given || given.itemsize() != 1) throw py::type_error("from_shard_records: records must be a uint8 buffer");
  py::array_t<uint8_t, py::array::c_style> bytes = py::array_t<uint8_t, py::array::c_style>::ensure(given);
  if (!bytes) throw py::type_error("from_shard_records: records must be a C-contiguous uint8 buffer");
  absl::StatusOr<PulledBucket> p;
  {
    py::gil_scoped_release release;
    p = PulledBucket::FromShardRecords(layout.layout, bucket,
                                       std::span<const uint8_t>(bytes.data(), static_cast<size_t>(bytes.size())));
  }
  return Take(std::move(p));
}

}  // namespace

void BindPulled(py::module_& m) {
  // (name, safetensors dtype, numpy array): BF16/F16 as uint16 / float16, F32 as float32, the
  // FP8 codes and other bytes as uint8; shaped like the tensor.
  auto to_python = [](NamedTensor&& t) {
    py::dtype dtype = py::dtype::of<uint8_t>();
    size_t item = 1;
    if (t.dtype == "BF16") {
      dtype = py::dtype::of<uint16_t>();
      item = 2;
    } else if (t.dtype == "F16") {
      dtype = py::dtype("float16");
      item = 2;
    } else if (t.dtype == "F32") {
      dtype = py::dtype::of<float>();
      item = 4;
    }
    std::vector<py::ssize_t> shape(t.shape.begin(), t.shape.end());
    py::array a(dtype, shape);
    const std::span<const uint8_t> bytes = t.bytes();
    if (static_cast<size_t>(a.size()) * item != bytes.size()) {
      throw std::runtime_error("published tensor " + t.name + ": size does not match its shape");
    }
    std::memcpy(a.mutable_data(), bytes.data(), bytes.size());
    return py::make_tuple(t.name, t.dtype, a);
  };
  py::class_<PulledBucket>(m, "PulledBucket",
                           "Quantized parameters of one version: one shard or a whole bucket. When `unchanged`, the "
                           "step was skipped: keep the weights you hold.")
      .def_property_readonly("bucket", &PulledBucket::bucket)
      .def_property_readonly("version", &PulledBucket::version)
      .def_property_readonly("unchanged", &PulledBucket::unchanged)
      .def_property_readonly("data_bytes_received", [](const PulledBucket& p) {
        int64_t n = 0;
        for (const PulledShard& s : p.shards()) n += s.data_bytes_received;
        return n;
      }, "Bytes of packed data that came over the wire: all of data, or after a delta pull (pull_bucket(since=)) "
         "only the chunks that changed (whole or as byte patches).")
      .def_property_readonly("scale_bytes_received", [](const PulledBucket& p) {
        int64_t n = 0;
        for (const PulledShard& s : p.shards()) n += s.scale_bytes_received;
        return n;
      }, "The same for the block scales (0 for formats without them).")
      .def_property_readonly("scale_bytes", [](const PulledBucket& p) {
        int64_t n = 0;
        for (const PulledShard& s : p.shards()) n += static_cast<int64_t>(s.scales.size());
        return n;
      }, "Bytes of block scales the bucket holds, sent or not.")
      .def_property_readonly("format", [](const PulledBucket& p) { return std::string(FormatName(p.format())); })
      .def_property_readonly("shard_begin", &PulledBucket::shard_begin)
      .def_property_readonly("shard_end", &PulledBucket::shard_end)
      .def_property_readonly("complete", &PulledBucket::complete)
      .def_property_readonly("elements", [](const PulledBucket& p) { return Range(p.elements()); })
      .def_property_readonly("data", [](const PulledBucket& p) { return View(p, p.data(), py::dtype::of<uint8_t>()); },
                             "Packed data of the covered shards, as the bucket's packed buffer holds it.")
      .def_property_readonly("tensors", [](const PulledBucket& p) {
        py::list names;
        for (int32_t t : p.tensors()) names.append(p.layout().tensors[t].name);
        return names;
      })
      .def("tensor", &TensorViewDict, py::arg("tensor"),
           "Per-tensor view: data (uint8), scales (grid), fragments (data, scales, metadata), scale/scale_inv/amax.")
      .def("dequantize", &Dequantize, py::arg("tensor"), "FP32 values of a whole tensor, shaped like it.")
      .def("published", [to_python](const PulledBucket& p, const py::object& key) {
        std::vector<NamedTensor> tensors = Take(PublishedTensors(p, TensorOf(p, key)));
        py::list out;
        for (NamedTensor& t : tensors) out.append(to_python(std::move(t)));
        return out;
      }, py::arg("tensor"),
         "The tensor's published data and scales: [(name, safetensors dtype, array)], by the conventions of "
         "docs/weight_serving.md (BF16 as uint16 bits).")
      .def("dequantized", [to_python](const PulledBucket& p, const py::object& key, bool bf16) {
        return to_python(Take(DequantizedTensor(p, TensorOf(p, key), bf16)));
      }, py::arg("tensor"), py::arg("bf16") = false,
         "(name, 'F32' or 'BF16', array): the dequantized tensor, or rounded to bf16 (uint16 bits).")
      .def("dequantize_all", [](const PulledBucket& p) {
        py::dict out;
        for (int32_t t : p.tensors()) out[py::str(p.layout().tensors[t].name)] = Dequantize(p, py::int_(t));
        return out;
      }, "{name: FP32 array} for every tensor of the bucket (needs the whole bucket).")
      .def("dequantize_covered", &DequantizeCovered, py::arg("out") = py::none(),
           "FP32 values of every covered bucket element (padding 0), flat, in bucket order; works for a single "
           "pulled shard. out: a writable C-contiguous float32 array to fill in place (no copy).")
      .def("shard_record", &ShardRecord, py::arg("out") = py::none(),
           "The one shard this object covers as a fixed-size uint8 record (layout.shard_record_bytes(bucket)) "
           "for an all-gather among the trainers; out: a writable uint8 array to fill.")
      .def_static("from_shard_records", &FromShardRecords, py::arg("layout"), py::arg("bucket"), py::arg("records"),
                  "The whole bucket from its D shard records back to back (record r = shard r), as an "
                  "all-gather of shard_record() leaves them; dequantize locally with dequantize_covered().");

  m.def("dequantize", &Dequantize, py::arg("pulled"), py::arg("tensor"),
        "Same as pulled.dequantize(tensor).");
}

}  // namespace mainstay::python
