#include "kernels/cuda/stream_call.h"

#include <map>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace mainstay::kernels::cuda {

struct StreamEntry {
  std::mutex call_mu;      // held by the StreamCall enqueueing on this stream
  void* buffer = nullptr;  // the workspace; guarded by call_mu
  size_t capacity = 0;     // guarded by call_mu
  std::string last;        // the last call's name and kernels; guarded by RegistryMutex()
};

namespace {

// The workspace grows in steps of this much at least, so calls of slowly rising sizes do not
// each reallocate.
constexpr size_t kGrowthBytes = size_t{1} << 20;

std::mutex& RegistryMutex() {
  static std::mutex mu;
  return mu;
}

using Registry = std::map<std::pair<int, cudaStream_t>, std::unique_ptr<StreamEntry>>;

Registry& Entries() {
  static Registry* entries = new Registry();  // never destroyed: calls may run at exit
  return *entries;
}

int CurrentDevice() {
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) device = -1;
  return device;
}

StreamEntry* EntryFor(cudaStream_t stream, bool create) {
  const std::pair<int, cudaStream_t> key{CurrentDevice(), stream};
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto it = Entries().find(key);
  if (it != Entries().end()) return it->second.get();
  if (!create) return nullptr;
  return Entries().emplace(key, std::make_unique<StreamEntry>()).first->second.get();
}

std::string LastCall(StreamEntry* entry) {
  if (entry == nullptr) return "none";
  std::lock_guard<std::mutex> lock(RegistryMutex());
  return entry->last.empty() ? "none" : entry->last;
}

std::string ErrorText(cudaError_t error) {
  return absl::StrCat(cudaGetErrorName(error), " (", cudaGetErrorString(error), ")");
}

absl::Status ErrorStatus(cudaError_t error, const std::string& message) {
  if (error == cudaErrorNoDevice || error == cudaErrorInsufficientDriver) return absl::UnavailableError(message);
  return absl::InternalError(message);
}

}  // namespace

StreamCall::StreamCall(cudaStream_t stream, std::string what)
    : stream_(stream), what_(std::move(what)), entry_(EntryFor(stream, /*create=*/true)), lock_(entry_->call_mu) {}

StreamCall::~StreamCall() {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  entry_->last = absl::StrCat(what_, " (", kernels_.empty() ? "no kernel" : absl::StrJoin(kernels_, ", "), ")");
}

std::string StreamCall::Describe(cudaError_t error, const std::string& where) const {
  return absl::StrCat(what_, ": ", where, ": ", ErrorText(error),
                      "; a fault of earlier work on this stream also shows here: the call before this one was ",
                      LastCall(entry_));
}

absl::StatusOr<void*> StreamCall::Workspace(size_t bytes) {
  if (bytes <= entry_->capacity) return entry_->buffer;
  const size_t grown = (bytes + kGrowthBytes - 1) / kGrowthBytes * kGrowthBytes;
  void* fresh = nullptr;
  if (cudaError_t e = cudaMallocAsync(&fresh, grown, stream_); e != cudaSuccess) {
    return ErrorStatus(e, Describe(e, absl::StrCat("growing the stream's workspace to ", grown, " bytes")));
  }
  if (entry_->buffer != nullptr) (void)cudaFreeAsync(entry_->buffer, stream_);  // after the work using it
  entry_->buffer = fresh;
  entry_->capacity = grown;
  return fresh;
}

absl::Status StreamCall::Launched(const char* kernel) {
  kernels_.push_back(kernel);
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return absl::OkStatus();
  return ErrorStatus(e, Describe(e, absl::StrCat("launching ", kernel)));
}

absl::Status StreamCall::Check(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return ErrorStatus(error, Describe(error, what));
}

absl::Status SynchronizeStream(cudaStream_t stream) {
  const cudaError_t e = cudaStreamSynchronize(stream);
  if (e == cudaSuccess) return absl::OkStatus();
  return ErrorStatus(e, absl::StrCat("work on the CUDA stream failed: ", ErrorText(e),
                                     "; the last kernels.h call enqueued there: ", LastCall(EntryFor(stream, false))));
}

}  // namespace mainstay::kernels::cuda
