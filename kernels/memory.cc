// HostStateMemory: shard state in host memory; the CPU kernels read it in place.
#include "kernels/memory.h"

#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace mainstay::kernels {
namespace {

constexpr size_t kAlignment = 256;

class HostMemory final : public StateMemory {
 public:
  HostMemory(CpuExecutor* executor, bool staged) : staged_(staged) { device_.executor = executor; }

  const Device& device() const override { return device_; }
  bool staged() const override { return staged_; }
  std::string Describe() const override { return staged_ ? "cpu (staged, tests only)" : "cpu"; }
  int64_t capacity_bytes() const override {
    return static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
  }

  absl::StatusOr<void*> Allocate(int64_t bytes) override {
    if (bytes <= 0) return absl::InvalidArgumentError(absl::StrCat("Allocate: ", bytes, " bytes (must be > 0)"));
    const size_t rounded = (static_cast<size_t>(bytes) + kAlignment - 1) / kAlignment * kAlignment;
    void* block = std::aligned_alloc(kAlignment, rounded);
    if (block == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("out of host memory allocating ", bytes, " bytes of shard state"));
    }
    std::memset(block, 0, rounded);  // touched here, not in the step
    return block;
  }
  void Free(void* block) override { std::free(block); }
  absl::Status Copy(void* dst, const void* src, int64_t bytes) override {
    if (bytes > 0) std::memcpy(dst, src, static_cast<size_t>(bytes));
    return absl::OkStatus();
  }
  absl::Status Synchronize() override { return kernels::Synchronize(device_); }

 private:
  Device device_;
  const bool staged_;
};

}  // namespace

std::unique_ptr<StateMemory> HostStateMemory(CpuExecutor* executor, bool staged) {
  return std::make_unique<HostMemory>(executor, staged);
}

}  // namespace mainstay::kernels
