// Shared pieces of the Python module `mainstay` (pybind11, over the public C++ API only).
//
// Errors: every absl::Status error becomes mainstay.Error (a RuntimeError) with attributes
// `code` (e.g. "UNAVAILABLE"), `message` and `info` (the ErrorInfo as a dict, or None).
// Arrays: views into pulled data keep their PulledBucket alive and are read-only.
#ifndef MAINSTAY_CLIENT_PYTHON_PY_COMMON_H_
#define MAINSTAY_CLIENT_PYTHON_PY_COMMON_H_

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "mainstay/buffers.h"
#include "mainstay/client.h"
#include "mainstay/pulled.h"

namespace mainstay::python {

namespace py = pybind11;

// Raises mainstay.Error for a non-OK status.
[[noreturn]] void ThrowStatus(const absl::Status& status);
inline void Check(const absl::Status& status) {
  if (!status.ok()) ThrowStatus(status);
}
template <typename T>
T Take(absl::StatusOr<T> value) {
  if (!value.ok()) ThrowStatus(value.status());
  return *std::move(value);
}

// A Layout shared with the Client (or computed offline) as a Python object.
struct PyLayout {
  std::shared_ptr<const Layout> layout;
};

// Registers mainstay.Error, Layout, PulledBucket and compute_layout.
void BindLayout(py::module_& m);
void BindPulled(py::module_& m);

// What a push reads: a numpy array (host memory; made C-contiguous), or an object exposing the
// CUDA Array Interface (`__cuda_array_interface__`, versions 2 and 3: a CUDA tensor of PyTorch,
// CuPy, Numba), C-contiguous, whose device pointer the nccl and cuda_ipc transports take.
// float32 -> fp32, uint16/int16 -> bf16 bits (or fp16 bits when dtype == "fp16"), float16 ->
// fp16. `keep` receives the object actually used (a contiguous copy of a numpy input that was
// not). When the interface names a stream and `stream` is given, *stream receives it: the push
// waits for the work queued on it (1 = the legacy default stream, 2 = the per-thread one).
// ValueError for anything else.
ElementSpan SpanOf(const py::object& data, const std::string& dtype, py::object* keep,
                   std::optional<void*>* stream = nullptr);

// The bytes a pull may write (Client.pull_shard_into): a writable, C-contiguous numpy array
// (host memory), or a writable, C-contiguous CUDA array (__cuda_array_interface__), whose
// stream, if it names one, goes to *stream. ValueError for anything else.
std::span<uint8_t> DestinationOf(const py::object& out, std::optional<void*>* stream);

// What Client.pull_shard_into returns: {shard, version, unchanged, num_scales, scales (bytes),
// fragments: [{tensor, elements, bucket_offset, scale, scale_inv, amax, scale_blocks, scale_offset}]}.
py::dict PulledShardDict(const PulledShard& p);
py::dict StepStatsDict(const StepStats& s);
py::dict PushResultDict(const PushResult& r);

}  // namespace mainstay::python

#endif  // MAINSTAY_CLIENT_PYTHON_PY_COMMON_H_
