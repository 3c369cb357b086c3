// The nccl transport end to end: the real mainstay-coordinator, a real mainstayd started with
// --transports nccl, and two runs of a trainer process (nccl_trainer, through the public client
// library) with the same inputs: one over grpc, one over nccl pushing from device buffers. What
// they pull must be the same, byte for byte.
//
// NCCL refuses two ranks of one communicator on the same CUDA device ("Duplicate GPU detected";
// see docs/transports.md, NCCL). With one GPU, the trainer and the daemon share it: the test then
// sets NCCL_MULTI_RANK_GPU_ENABLE=1 (an experimental setting of newer NCCL releases; older ones
// ignore it) and, when NCCL still refuses, reports a skip with NCCL's reason, never a pass. With
// two or more GPUs the daemon runs on the second one. Without a GPU: skipped.
//
// The cuda_ipc transport the same way, with the daemon's shard state on the trainer's GPU
// (mainstayd --device cuda:0 --transports cuda_ipc): one GPU is enough, as it is no NCCL.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/device.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/subprocess.h"

namespace mainstay {
namespace {

using ::mainstay::testing::IsOk;
using ::mainstay::testing::BinaryPath;
using ::mainstay::testing::ReadFileOrEmpty;
using ::mainstay::testing::Subprocess;
using ::mainstay::testing::TempDir;

constexpr absl::Duration kStartTimeout = absl::Seconds(120);
constexpr absl::Duration kTrainerTimeout = absl::Seconds(300);
constexpr int kExitSkip = 77;

// Sets an environment variable for the children started while it lives (they inherit it).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name); old != nullptr) old_ = old;
    setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (old_.has_value()) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

class NcclTransportGpuTest : public ::testing::Test {
 protected:
  std::string Logs() const {
    if (dir_ == nullptr) return "";
    std::string out;
    for (const char* name :
         {"coordinator.log", "daemon.log", "trainer-grpc.log", "trainer-nccl.log", "trainer-cuda_ipc.log"}) {
      absl::StrAppend(&out, "--- ", name, "\n", ReadFileOrEmpty(dir_->File(name)));
    }
    return out;
  }

  // A temporary folder and a coordinator in it; its address.
  std::string StartCoordinator() {
    absl::StatusOr<std::unique_ptr<TempDir>> dir = TempDir::Create("mainstay-transport-gpu");
    EXPECT_THAT(dir.status(), IsOk());
    if (!dir.ok()) return "";
    dir_ = *std::move(dir);
    auto coordinator = Subprocess::Start(
        {{BinaryPath("MAINSTAY_COORDINATOR_BIN", MAINSTAY_COORDINATOR_BIN), "--listen", "127.0.0.1:0", "--state-dir",
          dir_->File("state"), "--port-file", dir_->File("cport"), "--metrics-listen", "off"},
         dir_->File("coordinator.log")});
    EXPECT_THAT(coordinator.status(), IsOk());
    if (!coordinator.ok()) return "";
    coordinator_ = *std::move(coordinator);
    absl::StatusOr<int> cport = testing::WaitForPortFile(dir_->File("cport"), *coordinator_, kStartTimeout);
    EXPECT_THAT(cport.status(), IsOk()) << Logs();
    return cport.ok() ? absl::StrCat("127.0.0.1:", *cport) : "";
  }

  // A mainstayd registered with `coordinator`, with `flags` added; false if it did not come up.
  bool StartDaemon(const std::string& coordinator, const std::vector<std::string>& flags) {
    std::vector<std::string> args = {BinaryPath("MAINSTAYD_BIN", MAINSTAYD_BIN),
                                     "--coordinator",
                                     coordinator,
                                     "--listen",
                                     "127.0.0.1:0",
                                     "--node-name",
                                     "node0",
                                     "--threads",
                                     "2",
                                     "--memory-bytes",
                                     "4000000000",
                                     "--port-file",
                                     dir_->File("dport"),
                                     "--metrics-listen",
                                     "off"};
    args.insert(args.end(), flags.begin(), flags.end());
    auto daemon = Subprocess::Start({args, dir_->File("daemon.log")});
    EXPECT_THAT(daemon.status(), IsOk());
    if (!daemon.ok()) return false;
    daemon_ = *std::move(daemon);
    absl::Status up = testing::WaitForPortFile(dir_->File("dport"), *daemon_, kStartTimeout).status();
    EXPECT_THAT(up, IsOk()) << Logs();
    return up.ok();
  }

  // Runs nccl_trainer over `transport`; returns its exit code (-1 when it did not exit).
  int RunTrainer(const std::string& transport, const std::string& coordinator) {
    auto trainer = Subprocess::Start(
        {{BinaryPath("MAINSTAY_NCCL_TRAINER_BIN", MAINSTAY_NCCL_TRAINER_BIN), "--coordinator", coordinator,
          "--transport", transport, "--out", dir_->File("pulled-" + transport), "--chunk-bytes", "8192"},
         dir_->File("trainer-" + transport + ".log")});
    EXPECT_THAT(trainer.status(), IsOk());
    if (!trainer.ok()) return -1;
    absl::StatusOr<int> status = (*trainer)->Wait(kTrainerTimeout);
    EXPECT_THAT(status.status(), IsOk()) << "the " << transport << " trainer did not finish\n" << Logs();
    if (!status.ok() || !WIFEXITED(*status)) return -1;
    return WEXITSTATUS(*status);
  }

  // What the `transport` run pulled equals the grpc run's, byte for byte.
  void ExpectPulledAsOverGrpc(const std::string& transport) {
    const std::string over_grpc = ReadFileOrEmpty(dir_->File("pulled-grpc"));
    const std::string other = ReadFileOrEmpty(dir_->File("pulled-" + transport));
    ASSERT_GT(over_grpc.size(), 1000u) << Logs();
    ASSERT_EQ(over_grpc.size(), other.size()) << Logs();
    size_t first_difference = over_grpc.size();
    for (size_t i = 0; i < over_grpc.size(); ++i) {
      if (over_grpc[i] != other[i]) {
        first_difference = i;
        break;
      }
    }
    EXPECT_EQ(first_difference, over_grpc.size())
        << "the " << transport << " run pulled other bytes than the grpc run\n"
        << Logs();
    EXPECT_THAT(ReadFileOrEmpty(dir_->File("trainer-" + transport + ".log")),
                ::testing::HasSubstr("transport " + transport));
  }

  std::unique_ptr<TempDir> dir_;
  std::unique_ptr<Subprocess> coordinator_;
  std::unique_ptr<Subprocess> daemon_;
};

TEST_F(NcclTransportGpuTest, PushFromDevicePullMatchesGrpcBitForBit) {
  absl::StatusOr<std::vector<cuda::DeviceInfo>> devices = cuda::ListDevices();
  ASSERT_THAT(devices.status(), IsOk());
  if (devices->empty()) GTEST_SKIP() << "no CUDA device";
  const std::string address = StartCoordinator();
  ASSERT_FALSE(address.empty());

  // One GPU: both processes on it (see the file comment). More: the daemon on the second.
  std::optional<ScopedEnv> shared_gpu, daemon_gpu;
  if (devices->size() == 1) {
    shared_gpu.emplace("NCCL_MULTI_RANK_GPU_ENABLE", "1");
  } else {
    daemon_gpu.emplace("CUDA_VISIBLE_DEVICES", std::to_string((*devices)[1].ordinal));
  }
  const bool up = StartDaemon(address, {"--transports", "nccl"});
  daemon_gpu.reset();  // the trainers see every device and use device 0
  ASSERT_TRUE(up);
  EXPECT_THAT(ReadFileOrEmpty(dir_->File("daemon.log")), ::testing::HasSubstr("NCCL data plane: NCCL"));

  ASSERT_EQ(RunTrainer("grpc", address), 0) << Logs();
  const int nccl = RunTrainer("nccl", address);
  if (nccl == kExitSkip) {
    GTEST_SKIP() << "NCCL refused the trainer/daemon pair on one CUDA device ("
                 << (*devices)[0].name << "): " << ReadFileOrEmpty(dir_->File("trainer-nccl.log"));
  }
  ASSERT_EQ(nccl, 0) << Logs();
  ExpectPulledAsOverGrpc("nccl");
  EXPECT_THAT(ReadFileOrEmpty(dir_->File("daemon.log")), ::testing::HasSubstr("channel "));
}

// The daemon on the trainers' GPU (state in its memory, the step on its kernels); cuda_ipc pushes
// read straight out of the trainer's allocation.
TEST_F(NcclTransportGpuTest, CudaIpcPushFromDeviceOnTheDaemonsGpuMatchesGrpcBitForBit) {
  absl::StatusOr<std::vector<cuda::DeviceInfo>> devices = cuda::ListDevices();
  ASSERT_THAT(devices.status(), IsOk());
  if (devices->empty()) GTEST_SKIP() << "no CUDA device";
  const std::string address = StartCoordinator();
  ASSERT_FALSE(address.empty());
  ASSERT_TRUE(StartDaemon(address, {"--device", "cuda:0", "--transports", "cuda_ipc"}));
  EXPECT_THAT(ReadFileOrEmpty(dir_->File("daemon.log")), ::testing::HasSubstr("cuda_ipc data plane: CUDA IPC on"));

  ASSERT_EQ(RunTrainer("grpc", address), 0) << Logs();
  ASSERT_EQ(RunTrainer("cuda_ipc", address), 0) << Logs();
  ExpectPulledAsOverGrpc("cuda_ipc");
  EXPECT_THAT(ReadFileOrEmpty(dir_->File("daemon.log")), ::testing::HasSubstr("cuda-ipc: session "));
}

}  // namespace
}  // namespace mainstay
