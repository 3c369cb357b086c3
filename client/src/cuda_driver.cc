#include "client/src/cuda_driver.h"

#include <dlfcn.h>

#include <atomic>
#include <cstdint>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace mainstay::client_internal {
namespace {

// The few driver API declarations used here (values as cuda.h documents them), so that the
// client builds without CUDA.
using CUresult = int;
using CUdeviceptr = unsigned long long;  // NOLINT(runtime/int): the driver's own type
constexpr CUresult kCudaSuccess = 0;
constexpr int kAttributeContext = 1;         // CU_POINTER_ATTRIBUTE_CONTEXT
constexpr int kAttributeMemoryType = 2;      // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
constexpr int kAttributeIsManaged = 8;       // CU_POINTER_ATTRIBUTE_IS_MANAGED
constexpr int kAttributeDeviceOrdinal = 9;   // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
constexpr unsigned kMemoryTypeDevice = 2;    // CU_MEMORYTYPE_DEVICE
constexpr unsigned kEventDisableTiming = 2;  // CU_EVENT_DISABLE_TIMING
constexpr size_t kIpcHandleBytes = 64;       // CU_IPC_HANDLE_SIZE
// CU_STREAM_LEGACY: the legacy default stream, whichever default the caller was compiled for.
void* const kLegacyStream = reinterpret_cast<void*>(uintptr_t{1});

struct DriverApi {
  CUresult (*pointer_get_attribute)(void* data, int attribute, CUdeviceptr ptr) = nullptr;
  CUresult (*ctx_get_current)(void** ctx) = nullptr;
  CUresult (*ctx_set_current)(void* ctx) = nullptr;
  CUresult (*event_create)(void** event, unsigned flags) = nullptr;
  CUresult (*event_record)(void* event, void* stream) = nullptr;
  CUresult (*event_synchronize)(void* event) = nullptr;
  CUresult (*event_destroy)(void* event) = nullptr;
  CUresult (*get_error_name)(CUresult error, const char** name) = nullptr;
  bool loaded = false;
  // For the cuda_ipc transport (null where the driver lacks them).
  CUresult (*mem_get_address_range)(CUdeviceptr* base, size_t* size, CUdeviceptr p) = nullptr;
  CUresult (*ipc_get_mem_handle)(void* handle, CUdeviceptr p) = nullptr;
  CUresult (*device_get)(int* device, int ordinal) = nullptr;
  CUresult (*primary_ctx_retain)(void** ctx, int device) = nullptr;
  CUresult (*primary_ctx_release)(int device) = nullptr;
};

template <typename F>
bool Load(void* lib, const char* name, F& out) {
  out = reinterpret_cast<F>(dlsym(lib, name));
  return out != nullptr;
}

const DriverApi& Api() {
  static const DriverApi api = [] {
    DriverApi a;
    // RTLD_NOLOAD first: the driver a CUDA program already loaded; else load it (it stays).
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) return a;
    a.loaded = Load(lib, "cuPointerGetAttribute", a.pointer_get_attribute) &&
               Load(lib, "cuCtxGetCurrent", a.ctx_get_current) && Load(lib, "cuCtxSetCurrent", a.ctx_set_current) &&
               Load(lib, "cuEventCreate", a.event_create) && Load(lib, "cuEventRecord", a.event_record) &&
               Load(lib, "cuEventSynchronize", a.event_synchronize) &&
               Load(lib, "cuEventDestroy_v2", a.event_destroy) && Load(lib, "cuGetErrorName", a.get_error_name);
    if (!Load(lib, "cuMemGetAddressRange_v2", a.mem_get_address_range) ||
        !Load(lib, "cuIpcGetMemHandle", a.ipc_get_mem_handle) || !Load(lib, "cuDeviceGet", a.device_get) ||
        !Load(lib, "cuDevicePrimaryCtxRetain", a.primary_ctx_retain) ||
        !Load(lib, "cuDevicePrimaryCtxRelease_v2", a.primary_ctx_release)) {
      a.ipc_get_mem_handle = nullptr;  // CanExportIpc: no
    }
    return a;
  }();
  return api;
}

std::string ErrorName(CUresult r) {
  const char* name = nullptr;
  if (Api().get_error_name != nullptr && Api().get_error_name(r, &name) == kCudaSuccess && name != nullptr) {
    return name;
  }
  return absl::StrCat("CUresult ", r);
}

void DestroyEvent(void* event) { (void)Api().event_destroy(event); }

class SystemDriver final : public CudaDriver {
 public:
  std::optional<int> DeviceOf(const void* p) const override {
    const DriverApi& api = Api();
    if (!api.loaded || p == nullptr) return std::nullopt;
    const auto ptr = static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(p));
    unsigned type = 0;
    // Not initialized, no context, or memory CUDA does not know: not device memory.
    if (api.pointer_get_attribute(&type, kAttributeMemoryType, ptr) != kCudaSuccess || type != kMemoryTypeDevice) {
      return std::nullopt;
    }
    unsigned managed = 0;
    if (api.pointer_get_attribute(&managed, kAttributeIsManaged, ptr) == kCudaSuccess && managed != 0) {
      return std::nullopt;  // managed memory: the CPU may read it
    }
    int ordinal = 0;
    if (api.pointer_get_attribute(&ordinal, kAttributeDeviceOrdinal, ptr) != kCudaSuccess) ordinal = 0;
    return ordinal;
  }

  absl::StatusOr<PendingCudaWork> Capture(std::optional<void*> stream, void* event) const override {
    if (event == nullptr && !stream.has_value()) return PendingCudaWork();
    const DriverApi& api = Api();
    if (!api.loaded) {
      return absl::FailedPreconditionError(
          absl::StrCat("PushOptions names a CUDA ", event != nullptr ? "event" : "stream",
                       " but this process has no CUDA driver (libcuda.so.1 could not be loaded)"));
    }
    void* context = nullptr;
    if (CUresult r = api.ctx_get_current(&context); r != kCudaSuccess) {
      return absl::InternalError(absl::StrCat("cuCtxGetCurrent: ", ErrorName(r)));
    }
    if (event != nullptr) return PendingCudaWork(event, context, nullptr);
    void* recorded = nullptr;
    if (CUresult r = api.event_create(&recorded, kEventDisableTiming); r != kCudaSuccess) {
      return absl::InternalError(absl::StrCat("cuEventCreate for PushOptions::cuda_stream: ", ErrorName(r)));
    }
    PendingCudaWork work(recorded, context, &DestroyEvent);
    void* s = *stream == nullptr ? kLegacyStream : *stream;
    if (CUresult r = api.event_record(recorded, s); r != kCudaSuccess) {
      return absl::InternalError(absl::StrCat("cuEventRecord on PushOptions::cuda_stream: ", ErrorName(r)));
    }
    return work;
  }

  absl::Status Wait(PendingCudaWork work) const override {
    if (work.empty()) return absl::OkStatus();
    const DriverApi& api = Api();
    // The push runs on a pool thread: make the caller's context current there, as the driver
    // requires of an event of that context.
    if (work.context() != nullptr) {
      if (CUresult r = api.ctx_set_current(work.context()); r != kCudaSuccess) {
        return absl::InternalError(
            absl::StrCat("cuCtxSetCurrent before waiting for the push's CUDA work: ", ErrorName(r)));
      }
    }
    if (CUresult r = api.event_synchronize(work.event()); r != kCudaSuccess) {
      return absl::InternalError(
          absl::StrCat("the CUDA work that produces the pushed buffer failed (cuEventSynchronize: ", ErrorName(r),
                       "); nothing was sent"));
    }
    return absl::OkStatus();
  }

  absl::Status CanExportIpc() const override {
    const DriverApi& api = Api();
    if (!api.loaded || api.ipc_get_mem_handle == nullptr) {
      return absl::FailedPreconditionError(
          "this process has no CUDA driver with IPC (libcuda.so.1 with cuIpcGetMemHandle could not be loaded)");
    }
    return absl::OkStatus();
  }

  absl::StatusOr<IpcRegion> ExportIpc(const void* p) const override {
    MAINSTAY_RETURN_IF_ERROR(CanExportIpc());
    const DriverApi& api = Api();
    const std::optional<int> ordinal = DeviceOf(p);
    if (!ordinal.has_value()) return absl::InvalidArgumentError("not device memory: nothing to export");
    const auto ptr = static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(p));
    // The calls below act in the allocation's context (the push runs on a pool thread): the one
    // the pointer names, else (virtual-memory allocations name none) its device's primary context.
    void* context = nullptr;
    int device = -1;  // whose primary context this call retained
    if (CUresult r = api.pointer_get_attribute(&context, kAttributeContext, ptr); r != kCudaSuccess || !context) {
      context = nullptr;
      if (api.device_get(&device, *ordinal) != kCudaSuccess ||
          api.primary_ctx_retain(&context, device) != kCudaSuccess) {
        return absl::InternalError(absl::StrCat("no CUDA context for the buffer on device ", *ordinal));
      }
    }
    const absl::Cleanup release = [&api, device] {
      if (device >= 0) api.primary_ctx_release(device);
    };
    if (CUresult set = api.ctx_set_current(context); set != kCudaSuccess) {
      return absl::InternalError(absl::StrCat("cuCtxSetCurrent to the buffer's context: ", ErrorName(set)));
    }
    CUdeviceptr base = 0;
    size_t size = 0;
    if (CUresult r = api.mem_get_address_range(&base, &size, ptr); r != kCudaSuccess) {
      return absl::FailedPreconditionError(absl::StrCat("cuMemGetAddressRange: ", ErrorName(r)));
    }
    IpcRegion region;
    region.handle.resize(kIpcHandleBytes);
    if (CUresult r = api.ipc_get_mem_handle(region.handle.data(), base); r != kCudaSuccess) {
      return absl::FailedPreconditionError(absl::StrCat(
          "cuIpcGetMemHandle: ", ErrorName(r),
          " (memory from cudaMalloc can be exported; virtual-memory allocations such as PyTorch's expandable "
          "segments cannot: set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False, or use the nccl transport)"));
    }
    region.offset = static_cast<uint64_t>(ptr - base);
    region.allocation_bytes = static_cast<uint64_t>(size);
    return region;
  }
};

std::atomic<const CudaDriver*> g_override{nullptr};

}  // namespace

const CudaDriver& ClientCudaDriver() {
  static const SystemDriver system;
  const CudaDriver* o = g_override.load();
  return o != nullptr ? *o : system;
}

ScopedCudaDriverForTesting::ScopedCudaDriverForTesting(const CudaDriver* driver)
    : previous_(g_override.exchange(driver)) {}

ScopedCudaDriverForTesting::~ScopedCudaDriverForTesting() { g_override.store(previous_); }

}  // namespace mainstay::client_internal
