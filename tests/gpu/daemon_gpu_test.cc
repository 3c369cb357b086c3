// The daemon's step with its shard state on a GPU (mainstayd --device cuda:0): CUDA managed
// memory resident on the device, the CUDA kernels on the memory's stream. Daemons in process
// (tests/testing/daemon_cluster.h), the unsharded reference on the CPU kernels: masters, moments
// and published bytes must equal it bit for bit for every recipe, with and without clipping
// (the probe's bet), for SGD, and with replicas. Skipped without a device.
#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/device.h"
#include "kernels/memory.h"
#include "tests/testing/daemon_cluster.h"
#include "tests/testing/reference_model.h"
#include "tests/testing/status_matchers.h"

namespace mainstay::daemon {
namespace {

using ::mainstay::testing::Cluster;
using ::mainstay::testing::ExpectMatchesReference;
using ::mainstay::testing::IsOk;
using ::mainstay::testing::MakeSpec;
using Reference = ::mainstay::testing::ReferenceModel;

struct Case {
  std::string recipe;
  LayoutPolicy policy;
  OptimizerType optimizer = OptimizerType::kAdamW;
  bool clip = false;  // gradients x4 on some steps, max_grad_norm set: the bet lost and won
  int replication = 1;
};

class DaemonGpuTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    // MAINSTAY_DAEMON_GPU_TEST_MEMORY=cpu-staged checks this test itself on a machine without a
    // GPU: the same staging through host memory, the CPU kernels.
    if (const char* m = std::getenv("MAINSTAY_DAEMON_GPU_TEST_MEMORY");
        m != nullptr && std::string(m) == "cpu-staged") {
      memory_ = kernels::HostStateMemory(nullptr, /*staged=*/true);
      return;
    }
    absl::StatusOr<std::vector<cuda::DeviceInfo>> devices = cuda::ListDevices();
    ASSERT_THAT(devices, IsOk());
    if (devices->empty()) GTEST_SKIP() << "no CUDA device";
    absl::StatusOr<std::unique_ptr<kernels::StateMemory>> memory = kernels::CudaStateMemory(0);
    ASSERT_THAT(memory, IsOk());
    memory_ = *std::move(memory);
  }
  std::unique_ptr<kernels::StateMemory> memory_;
};

TEST_P(DaemonGpuTest, StepsOnTheGpuEqualTheCpuReferenceBitForBit) {
  const Case& p = GetParam();
  JobSpec spec = MakeSpec(p.recipe, p.policy, 2);
  spec.replication_factor = p.replication;
  if (p.optimizer == OptimizerType::kSGD) {
    spec.optimizer.type = OptimizerType::kSGD;
    spec.optimizer.momentum = 0.9f;
  }
  std::vector<float> scales = {1, 1, 1, 1};
  if (p.clip) {
    spec.optimizer.eps = 0.1f;  // so that a clipped step's amaxes differ from the bet's
    scales = {1, 4, 4, 1, 1, 4};
    spec.optimizer.max_grad_norm = static_cast<float>(2 * Reference(*ResolveJob(spec)).GradNorm(0));
  }
  Cluster cluster(spec, p.replication > 1 ? 3 : 2, nullptr, {}, true, memory_.get());
  Reference ref(cluster.resolved());
  cluster.PushInitial(ref);
  ExpectMatchesReference(cluster, ref, 0);
  for (int64_t step = 0; step < static_cast<int64_t>(scales.size()); ++step) {
    const float lr = p.clip ? 5.0f : 1e-3f * static_cast<float>(step + 1);
    const float scale = scales[static_cast<size_t>(step)];
    ref.SetGradScale(scale);
    cluster.PushGrads(step, 0.0f, scale);
    double clip = 1.0;
    for (const auto& stats : cluster.Finish(step, lr)) {
      ASSERT_THAT(stats.status(), IsOk());
      EXPECT_EQ(stats->version(), step + 1);
      clip = stats->clip_factor();
    }
    ref.Step(step, lr, 0.0f, 0, static_cast<float>(clip));
    ExpectMatchesReference(cluster, ref, step + 1);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Recipes, DaemonGpuTest,
    ::testing::Values(Case{"bf16_mixed", LayoutPolicy::kFlat}, Case{"bf16_with_fp8_mixed", LayoutPolicy::kFlat},
                      Case{"bf16_with_fp8_current_scaling_mixed", LayoutPolicy::kFlat},
                      Case{"bf16_with_fp8_current_scaling_mixed", LayoutPolicy::kWholeTensor},
                      Case{"bf16_with_mxfp8_mixed", LayoutPolicy::kFlat},
                      Case{"bf16_with_fp8_subchannel_scaling_mixed", LayoutPolicy::kFlat},
                      Case{"bf16_with_nvfp4_mixed", LayoutPolicy::kFlat},
                      Case{"bf16_with_nvfp4_mixed", LayoutPolicy::kWholeTensor},
                      Case{"bf16_with_fp8_current_scaling_mixed", LayoutPolicy::kFlat, OptimizerType::kAdamW, true},
                      Case{"bf16_with_nvfp4_mixed", LayoutPolicy::kWholeTensor, OptimizerType::kAdamW, true},
                      Case{"bf16_with_mxfp8_mixed", LayoutPolicy::kFlat, OptimizerType::kSGD},
                      Case{"bf16_with_nvfp4_mixed", LayoutPolicy::kFlat, OptimizerType::kSGD},
                      Case{"bf16_with_fp8_mixed", LayoutPolicy::kFlat, OptimizerType::kAdamW, false, 2}),
    [](const ::testing::TestParamInfo<Case>& info) {
      const Case& c = info.param;
      return absl::StrCat(c.recipe, "_", LayoutPolicyName(c.policy), c.optimizer == OptimizerType::kSGD ? "_sgd" : "",
                          c.clip ? "_clip" : "", c.replication > 1 ? absl::StrCat("_r", c.replication) : "");
    });

}  // namespace
}  // namespace mainstay::daemon
