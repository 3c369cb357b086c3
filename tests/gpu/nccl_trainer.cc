// A trainer process for nccl_transport_gpu_test: creates a job on the coordinator, pushes the
// initial parameters and a few steps of gradients through the public client library
// (libmainstay_client.so) over one transport, pulls every bucket of the last version and writes
// what it pulled (versions, packed data, block scales, per-tensor scales) to --out, so that two
// runs over different transports can be compared byte for byte. Over cuda_ipc it also pulls
// every bucket into device memory (Client::PullBucketInto) and checks it against those bytes.
//
//   nccl_trainer --coordinator HOST:PORT --transport nccl|cuda_ipc|grpc --out FILE [--chunk-bytes N]
//
// With --transport nccl or cuda_ipc, gradients are pushed from device buffers on CUDA device 0
// (for cuda_ipc, parts of one cudaMalloc allocation, at offsets in it), except at step 1, which
// pushes from host memory (nccl stages it, cuda_ipc sends it by gRPC). The inputs are the same
// for every transport.
//
// Exit codes: 0 done; 77 NCCL refused the channel because this process and the daemon share a
// CUDA device (the reason is printed: the test reports a skip); 2 bad flags; 1 anything else.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "mainstay/buffers.h"
#include "mainstay/client.h"

namespace {

constexpr int kSteps = 3;
constexpr int kExitSkip = 77;

// bf16 weights with MXFP8 block scales, so that pulls carry data and scale payloads; shapes of
// whole 32-element blocks, several buckets, many chunks per shard.
// (Job names are unique: the transport is appended to "nccl-gpu-test-".)
constexpr char kSpecAfterName[] = R"(,
  "recipe": "bf16_with_mxfp8_mixed",
  "optimizer": {"type": "adamw", "beta1": 0.9, "beta2": 0.95, "eps": 1e-08, "weight_decay": 0.0,
                "max_grad_norm": 0.0},
  "data_parallel_size": 1,
  "bucket_numel": 65536,
  "tensors": [
    {"name": "layers.0.attn.qkv.weight", "shape": [192, 128]},
    {"name": "layers.0.attn.proj.weight", "shape": [128, 128]},
    {"name": "layers.0.norm.weight", "shape": [128]},
    {"name": "layers.0.mlp.fc1.weight", "shape": [256, 128]},
    {"name": "layers.0.mlp.fc2.weight", "shape": [128, 256]},
    {"name": "layers.1.mlp.fc1.weight", "shape": [512, 128]}
  ]
})";

int Fail(const std::string& what, const absl::Status& status) {
  std::fprintf(stderr, "nccl_trainer: %s: %s\n", what.c_str(), status.ToString().c_str());
  return 1;
}

float InitialValue(int32_t bucket, int64_t i) {
  return 0.02f * static_cast<float>(((i * 7919 + bucket * 104729) % 2001) - 1000) / 1000.0f;
}
float GradValue(int64_t step, int32_t bucket, int64_t i) {
  return 0.001f * static_cast<float>(((i * 48271 + step * 16807 + bucket * 65537) % 4001) - 2000) / 2000.0f;
}

template <typename T>
void Put(std::string& out, const T& v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(v));
}
void PutBytes(std::string& out, std::span<const uint8_t> bytes) {
  Put(out, static_cast<uint64_t>(bytes.size()));
  out.append(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

// `pulled`, pulled again with PullBucketInto (every shard with PullShardInto) into device memory
// at an offset inside one allocation, copied back and compared with what PullBucket got: data,
// versions and block scales.
absl::Status CheckDevicePulls(mainstay::Client& client, const mainstay::PulledBucket& pulled) {
  const mainstay::Bucket& b = pulled.bucket_info();
  const std::span<const uint8_t> expected = pulled.data();
  uint8_t* block = nullptr;
  constexpr size_t kOffset = 4096 + 16;
  if (cudaMalloc(reinterpret_cast<void**>(&block), expected.size() + kOffset) != cudaSuccess) {
    return absl::ResourceExhaustedError(cudaGetErrorString(cudaGetLastError()));
  }
  absl::Status result;
  absl::StatusOr<std::vector<mainstay::PulledShard>> got =
      client.PullBucketInto(b.index, pulled.version(), block + kOffset, static_cast<int64_t>(expected.size())).Wait();
  std::vector<uint8_t> back(expected.size());
  if (!got.ok()) {
    result = got.status();
  } else if (cudaMemcpy(back.data(), block + kOffset, back.size(), cudaMemcpyDeviceToHost) != cudaSuccess) {
    result = absl::InternalError(cudaGetErrorString(cudaGetLastError()));
  } else if (!std::equal(back.begin(), back.end(), expected.begin())) {
    result = absl::DataLossError("the bucket pulled into device memory differs from PullBucket's");
  } else {
    for (size_t k = 0; k < got->size() && result.ok(); ++k) {
      const mainstay::PulledShard& want = pulled.shards()[k];
      if ((*got)[k].scales != want.scales || (*got)[k].version != want.version) {
        result =
            absl::DataLossError(absl::StrCat("shard ", want.shard, "'s scales or version differ from PullBucket's"));
      }
    }
  }
  cudaFree(block);
  return result;
}

int Run(const std::map<std::string, std::string>& flags) {
  const std::string transport = flags.at("--transport");
  const bool nccl = transport == "nccl";
  const bool from_device = nccl || transport == "cuda_ipc";
  if (from_device && cudaSetDevice(0) != cudaSuccess) {
    return Fail("cudaSetDevice(0)", absl::UnavailableError(cudaGetErrorString(cudaGetLastError())));
  }
  mainstay::ClientOptions options;
  options.coordinator = flags.at("--coordinator");
  options.job_spec_json = absl::StrCat(R"({"name": "nccl-gpu-test-)", transport, "\"", kSpecAfterName);
  options.transport = transport;
  options.timeout = std::chrono::milliseconds(120000);
  if (auto it = flags.find("--chunk-bytes"); it != flags.end()) options.chunk_bytes = std::atoll(it->second.c_str());
  absl::StatusOr<std::unique_ptr<mainstay::Client>> connected = mainstay::Client::Connect(options);
  if (!connected.ok()) {
    const std::string message(connected.status().message());
    if (nccl && connected.status().code() == absl::StatusCode::kFailedPrecondition &&
        (absl::StrContains(message, "Duplicate GPU detected") || absl::StrContains(message, "same GPU"))) {
      std::printf("SKIP: NCCL refuses a trainer and a daemon on the same CUDA device: %s\n", message.c_str());
      return kExitSkip;
    }
    return Fail("Connect", connected.status());
  }
  mainstay::Client& client = **connected;
  for (const mainstay::DataConnection& c : client.connections()) {
    std::printf("daemon %s at %s: transport %s\n", c.daemon_id.c_str(), c.address.c_str(), c.transport.c_str());
    if (c.transport != transport) return Fail("connections", absl::InternalError("not the transport asked for"));
  }
  const mainstay::Layout& layout = client.layout();

  std::vector<mainstay::PushHandle> pushes;
  std::vector<std::vector<float>> initial;
  for (const mainstay::Bucket& b : layout.buckets) {
    std::vector<float>& v = initial.emplace_back(static_cast<size_t>(b.numel));
    for (int64_t i = 0; i < b.numel; ++i) v[static_cast<size_t>(i)] = InitialValue(b.index, i);
    pushes.push_back(client.PushInitialParams(b.index, v, /*all_shards=*/true));
  }
  for (mainstay::PushHandle& p : pushes) {
    if (!p.Wait().ok()) return Fail("PushInitialParams", p.Wait().status());
  }

  std::vector<float*> device(layout.buckets.size(), nullptr);
  // cuda_ipc: one allocation holds every bucket's gradient, 256 bytes apart, as a caching
  // allocator hands out parts of its blocks (the daemon maps it once, reads at offsets).
  float* block = nullptr;
  if (transport == "cuda_ipc") {
    size_t floats = 0;
    for (const mainstay::Bucket& b : layout.buckets) floats += static_cast<size_t>(b.shard_numel) + 64;
    if (cudaMalloc(reinterpret_cast<void**>(&block), floats * sizeof(float)) != cudaSuccess) {
      return Fail("cudaMalloc", absl::ResourceExhaustedError(cudaGetErrorString(cudaGetLastError())));
    }
    size_t offset = 64;
    for (const mainstay::Bucket& b : layout.buckets) {
      device[static_cast<size_t>(b.index)] = block + offset;
      offset += static_cast<size_t>(b.shard_numel) + 64;
    }
  }
  for (int64_t step = 0; step < kSteps; ++step) {
    pushes.clear();
    std::vector<std::vector<float>> grads;
    for (const mainstay::Bucket& b : layout.buckets) {
      std::vector<float>& g = grads.emplace_back(static_cast<size_t>(b.shard_numel));
      for (int64_t i = 0; i < b.shard_numel; ++i) g[static_cast<size_t>(i)] = GradValue(step, b.index, i);
      const float* source = g.data();
      if (from_device && step != 1) {
        float*& d = device[static_cast<size_t>(b.index)];
        if (d == nullptr && cudaMalloc(reinterpret_cast<void**>(&d), g.size() * sizeof(float)) != cudaSuccess) {
          return Fail("cudaMalloc", absl::ResourceExhaustedError(cudaGetErrorString(cudaGetLastError())));
        }
        if (cudaMemcpy(d, g.data(), g.size() * sizeof(float), cudaMemcpyHostToDevice) != cudaSuccess) {
          return Fail("cudaMemcpy", absl::InternalError(cudaGetErrorString(cudaGetLastError())));
        }
        source = d;
      }
      // The copy above may still be in flight when cudaMemcpy returns (pageable memory): the push
      // waits for the legacy default stream it went on.
      mainstay::PushOptions push_options;
      if (source != g.data()) push_options.cuda_stream = nullptr;
      pushes.push_back(
          client.PushGrad(b.index, step, {source, mainstay::ElementType::kFloat32, b.shard_numel}, push_options));
    }
    for (mainstay::PushHandle& p : pushes) {
      if (!p.Wait().ok()) return Fail(absl::StrCat("PushGrad step ", step), p.Wait().status());
    }
    absl::StatusOr<mainstay::StepStats> stats = client.FinishStep(step, 1e-3, 0.01);
    if (!stats.ok()) return Fail(absl::StrCat("FinishStep ", step), stats.status());
    std::printf("step %lld: version %lld, grad norm %.9g\n", static_cast<long long>(step),
                static_cast<long long>(stats->version), stats->grad_norm);
  }
  if (block != nullptr) {
    cudaFree(block);
  } else {
    for (float* d : device) cudaFree(d);
  }

  std::string out = "mainstay-nccl-gpu-test-v1";
  for (const mainstay::Bucket& b : layout.buckets) {
    absl::StatusOr<mainstay::PulledBucket> pulled = client.PullBucket(b.index, kSteps).Wait();
    if (!pulled.ok()) return Fail(absl::StrCat("PullBucket ", b.index), pulled.status());
    Put(out, pulled->bucket());
    Put(out, pulled->version());
    Put(out, pulled->unchanged());
    PutBytes(out, pulled->data());
    // cuda_ipc: the bucket again, written by the daemon straight into device memory (at an
    // offset inside one allocation), must be the bytes PullBucket got over gRPC.
    if (transport == "cuda_ipc" && !pulled->unchanged()) {
      if (absl::Status same = CheckDevicePulls(client, *pulled); !same.ok()) {
        return Fail(absl::StrCat("PullBucketInto bucket ", b.index), same);
      }
    }
    for (const mainstay::PulledShard& s : pulled->shards()) {
      Put(out, s.version);
      PutBytes(out, s.scales);
      for (const mainstay::FragmentQuantInfo& f : s.fragments) {
        Put(out, f.tensor);
        Put(out, f.scale);
        Put(out, f.scale_inv);
        Put(out, f.amax);
      }
    }
  }
  std::ofstream file(flags.at("--out"), std::ios::binary | std::ios::trunc);
  file.write(out.data(), static_cast<std::streamsize>(out.size()));
  if (!file.good()) return Fail("writing " + flags.at("--out"), absl::InternalError("write failed"));
  std::printf("pulled %zu bytes of %zu buckets at version %d over %s\n", out.size(), layout.buckets.size(), kSteps,
              transport.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> flags;
  for (int i = 1; i + 1 < argc; i += 2) flags[argv[i]] = argv[i + 1];
  if (argc % 2 == 0 || !flags.count("--coordinator") || !flags.count("--transport") || !flags.count("--out")) {
    std::fprintf(stderr,
                 "usage: nccl_trainer --coordinator HOST:PORT --transport nccl|cuda_ipc|grpc --out FILE "
                 "[--chunk-bytes N]\n");
    return 2;
  }
  return Run(flags);
}
