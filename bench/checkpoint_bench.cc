// Checkpoint throughput on the real file system (docs/benchmarks.md, "Checkpoints").
//
// 1. Write: a job of --params parameters (AdamW, FP32 masters and moments: 12 bytes of state
//    per parameter) held by --write-dp in-process ShardDaemons (one rank each, as
//    tests/testing/daemon_cluster.h does), initial parameters pushed and one step run; then
//    what the coordinator does for a checkpoint: WriteCheckpoint on every daemon in parallel,
//    then the MANIFEST. Baseline in the same run: the same bytes (one file per data file of the
//    checkpoint, same sizes) written with plain write() + fsync() by one thread per daemon, into
//    the same directory tree. ratio = checkpoint GB/s / baseline GB/s.
//    While a checkpoint is written, a probe thread per daemon calls ShardDaemon::Progress(),
//    which takes the job's lock, every 0.2 ms: its longest call is how long the snapshot copy
//    held the lock (what a step committing at that moment would wait).
// 2. Restore: a new job with --restore-dp ranks on the same daemons restored from that
//    checkpoint (AssignShard from_checkpoint), timed until every shard's version is pullable.
//    Baseline: the checkpoint's files read with read() by one thread per daemon. The page cache
//    of the files is dropped (posix_fadvise DONTNEED) before each read unless --cached.
// 3. Restart (with --coordinator-bin and --daemon-bin): checkpoint_bench_restart.cc.
//
//   checkpoint_bench [--params 64M] [--dir DIR] [--reps 3] [--write-dp 2] [--restore-dp 4]
//                    [--cached] [--coordinator-bin PATH --daemon-bin PATH] [--lease-ttl-ms 1000]
#include <fcntl.h>
#include <openssl/sha.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "bench/checkpoint_bench.h"
#include "common/job_spec_proto.h"
#include "common/layout_proto.h"
#include "common/status.h"
#include "server/checkpoint/checkpoint_files.h"
#include "server/daemon/shard_daemon.h"
#include "server/peer/fake_peer_group.h"

namespace mainstay::bench {

JobSpec MakeSpec(const Flags& flags, int64_t dp, const std::string& name) {
  JobSpec spec;
  spec.name = name;
  spec.recipe = flags.recipe;
  spec.data_parallel_size = dp;
  const int64_t cols = 4096;
  const int64_t layers = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(flags.params / double(1 << 24))));
  const int64_t rows = std::max<int64_t>(
      128, static_cast<int64_t>(std::ceil(flags.params / double(layers * cols) / 128.0)) * 128);
  for (int64_t l = 0; l < layers; ++l) spec.tensors.push_back({absl::StrCat("layers.", l, ".mlp.fc.weight"), {rows, cols}});
  return spec;
}

namespace {

constexpr char kJobId[] = "bench-job";
constexpr char kToken[] = "bench-token";

std::string TokenSha256() {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(kToken), sizeof(kToken) - 1, digest);
  return std::string(reinterpret_cast<const char*>(digest), sizeof(digest));
}

[[noreturn]] void Die(const std::string& message) {
  std::fprintf(stderr, "checkpoint_bench: %s\n", message.c_str());
  std::exit(1);
}
void Check(const absl::Status& s, const std::string& what) {
  if (!s.ok()) Die(absl::StrCat(what, ": ", s.ToString()));
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Rank r's shards on daemon r % daemons; the in-process peer group joins the daemons.
class InProcessCluster {
 public:
  InProcessCluster(const JobSpec& spec, int daemons) : spec_(spec) {
    absl::StatusOr<ResolvedJob> resolved = ResolveJob(spec);
    Check(resolved.status(), "ResolveJob");
    resolved_ = *std::move(resolved);
    for (int i = 0; i < daemons; ++i) {
      daemon::ShardDaemonOptions o;
      o.peers = &peers_;
      o.peer_timeout = absl::Minutes(5);
      o.retained_versions = 2;
      daemons_.push_back(std::make_unique<daemon::ShardDaemon>(o));
      daemons_.back()->set_daemon_id(absl::StrCat("d", i));
    }
    base_.set_job_id(kJobId);
    base_.set_job_token_sha256(TokenSha256());
    JobSpecToProto(spec, base_.mutable_spec());
    LayoutToProto(resolved_.layout, base_.mutable_layout());
    for (const Bucket& b : layout().buckets) {
      for (const Shard& s : b.shards) {
        v1::ShardPlacement* p = base_.mutable_placement()->add_shards();
        p->mutable_shard()->set_bucket(b.index);
        p->mutable_shard()->set_shard(s.rank);
        p->set_daemon_id(absl::StrCat("d", Owner(s.rank)));
      }
    }
    Check(Assign(nullptr), "AssignShard");
  }

  const Layout& layout() const { return resolved_.layout; }
  int num_daemons() const { return static_cast<int>(daemons_.size()); }
  daemon::ShardDaemon& daemon(int i) { return *daemons_[static_cast<size_t>(i)]; }
  int Owner(int32_t rank) const { return rank % num_daemons(); }

  // Every shard pushed with `value` (initial parameters at step -1, gradients otherwise).
  void PushAll(int64_t step, float value) {
    const v1::PushKind kind = step < 0 ? v1::PUSH_KIND_INITIAL_PARAMS : v1::PUSH_KIND_GRADIENT;
    constexpr int64_t kChunk = int64_t{4} << 20;  // elements
    const std::string chunk(static_cast<size_t>(kChunk) * 4, '\0');
    std::string data = chunk;
    for (size_t i = 0; i < data.size(); i += 4) std::memcpy(&data[i], &value, 4);
    for (const Bucket& b : layout().buckets) {
      for (const Shard& s : b.shards) {
        v1::PushGradHeader h;
        h.set_job_id(kJobId);
        h.set_job_token(kToken);
        h.set_placement_epoch(epoch_);
        h.set_bucket(b.index);
        h.set_shard(s.rank);
        h.set_step(step);
        h.set_rank(s.rank);
        h.set_kind(kind);
        h.set_dtype(v1::ELEMENT_TYPE_FP32);
        h.set_total_bytes(b.shard_numel * 4);
        h.set_num_contributors(1);
        absl::StatusOr<std::unique_ptr<daemon::PushSession>> session = daemon(Owner(s.rank)).BeginPush(h);
        Check(session.status(), "BeginPush");
        for (int64_t off = 0; off < b.shard_numel; off += kChunk) {
          const int64_t n = std::min(kChunk, b.shard_numel - off);
          Check((*session)->AddChunk(off, n == kChunk ? data : data.substr(0, static_cast<size_t>(n) * 4)), "AddChunk");
        }
        Check((*session)->Finish().status(), "push Finish");
      }
    }
  }

  void FinishStep(int64_t step) {
    std::vector<absl::Status> out(static_cast<size_t>(layout().data_parallel_size));
    std::vector<std::thread> threads;
    for (int32_t r = 0; r < layout().data_parallel_size; ++r) {
      threads.emplace_back([&, r] {
        v1::FinishStepRequest req;
        req.set_job_id(kJobId);
        req.set_job_token(kToken);
        req.set_placement_epoch(epoch_);
        req.set_step(step);
        req.set_rank(r);
        req.set_lr(1e-4);
        out[static_cast<size_t>(r)] = daemon(Owner(r)).FinishStep(req, absl::Now() + absl::Minutes(10)).status();
      });
    }
    for (std::thread& t : threads) t.join();
    for (const absl::Status& s : out) Check(s, "FinishStep");
  }

  // What the coordinator does: WriteCheckpoint on every daemon in parallel, then the manifest.
  // `lock_max_s[i]`: the longest Progress() call on daemon i while it wrote.
  absl::StatusOr<v1::CheckpointManifest> Checkpoint(const std::string& dir, const std::string& id, int64_t step,
                                                    std::vector<double>& lock_max_s) {
    v1::CheckpointManifest manifest;
    manifest.set_checkpoint_id(id);
    manifest.set_job_id(kJobId);
    JobSpecToProto(spec_, manifest.mutable_spec());
    std::vector<absl::StatusOr<v1::WriteCheckpointResponse>> responses(daemons_.size(), absl::UnknownError("not run"));
    lock_max_s.assign(daemons_.size(), 0.0);
    std::atomic<int> writing{num_daemons()};
    std::vector<std::thread> threads;
    for (int i = 0; i < num_daemons(); ++i) {
      threads.emplace_back([&, i] {
        v1::WriteCheckpointRequest req;
        req.set_job_id(kJobId);
        req.set_placement_epoch(epoch_);
        req.set_checkpoint_id(id);
        req.set_directory_uri(dir);
        req.set_committed_step(step);
        responses[static_cast<size_t>(i)] = daemon(i).WriteCheckpoint(req, absl::Now() + absl::Minutes(10));
        --writing;
      });
      threads.emplace_back([&, i] {  // the lock probe
        while (writing.load() > 0) {
          const Clock::time_point t0 = Clock::now();
          daemon(i).Progress();
          lock_max_s[static_cast<size_t>(i)] = std::max(lock_max_s[static_cast<size_t>(i)], Seconds(t0, Clock::now()));
          std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
      });
    }
    for (std::thread& t : threads) t.join();
    for (auto& r : responses) {
      MAINSTAY_RETURN_IF_ERROR(r.status());
      manifest.set_version(r->version());
      manifest.set_committed_step(r->committed_step());
      manifest.set_moment_type(r->moment_type());
      manifest.set_has_second_moment(r->has_second_moment());
      *manifest.mutable_scaling() = r->scaling();
      for (const v1::CheckpointFile& f : r->files()) *manifest.add_files() = f;
    }
    MAINSTAY_RETURN_IF_ERROR(checkpoint::WriteManifest(*checkpoint::PosixFs(), dir, manifest));
    return manifest;
  }

  // Every shard assigned again at the next epoch from the checkpoint in `dir`.
  absl::Status Restore(const std::string& dir, const std::string& id) {
    ++epoch_;
    v1::SourceCheckpoint source;
    source.set_checkpoint_id(id);
    source.set_manifest_uri(checkpoint::JoinPath(dir, checkpoint::kManifestName));
    return Assign(&source);
  }

  // Waits until every shard serves `version`.
  absl::Status WaitPullable(int64_t version) {
    for (const Bucket& b : layout().buckets) {
      for (const Shard& s : b.shards) {
        v1::PullParamsRequest req;
        req.set_job_id(kJobId);
        req.set_job_token(kToken);
        req.set_placement_epoch(epoch_);
        req.set_bucket(b.index);
        req.set_shard(s.rank);
        req.set_version(version);
        MAINSTAY_RETURN_IF_ERROR(daemon(Owner(s.rank)).PullParams(req, absl::Now() + absl::Minutes(10)).status());
      }
    }
    return absl::OkStatus();
  }

 private:
  absl::Status Assign(const v1::SourceCheckpoint* source) {
    for (int i = 0; i < num_daemons(); ++i) {
      v1::AssignShardRequest req = base_;
      req.set_placement_epoch(epoch_);
      req.mutable_placement()->set_epoch(epoch_);
      if (source != nullptr) {
        *req.mutable_from_checkpoint() = *source;
      } else {
        req.mutable_from_trainer();
      }
      for (const Bucket& b : layout().buckets) {
        for (const Shard& s : b.shards) {
          if (Owner(s.rank) != i) continue;
          v1::ShardRef* ref = req.add_shards();
          ref->set_bucket(b.index);
          ref->set_shard(s.rank);
        }
      }
      MAINSTAY_RETURN_IF_ERROR(daemon(i).AssignShard(req).status());
    }
    return absl::OkStatus();
  }

  JobSpec spec_;
  ResolvedJob resolved_;
  int64_t epoch_ = 1;
  v1::AssignShardRequest base_;  // the assignment without shards or epoch
  peer::InProcessPeerGroupFactory peers_;
  std::vector<std::unique_ptr<daemon::ShardDaemon>> daemons_;
};

// One file per entry of `sizes[t]` written by thread t with write() + fsync(). Returns seconds.
double WriteBaseline(const std::string& dir, const std::vector<std::vector<int64_t>>& sizes, const std::vector<uint8_t>& data) {
  std::filesystem::create_directories(dir);
  const Clock::time_point t0 = Clock::now();
  std::vector<std::thread> threads;
  for (size_t t = 0; t < sizes.size(); ++t) {
    threads.emplace_back([&, t] {
      for (size_t f = 0; f < sizes[t].size(); ++f) {
        const std::string path = absl::StrCat(dir, "/t", t, ".f", f, ".plain");
        const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0640);
        if (fd < 0) Die(absl::StrCat("create ", path, ": ", std::strerror(errno)));
        size_t left = static_cast<size_t>(sizes[t][f]);
        const uint8_t* p = data.data();
        while (left > 0) {
          const ssize_t n = ::write(fd, p, std::min<size_t>(left, size_t{1} << 30));
          if (n < 0 && errno == EINTR) continue;
          if (n <= 0) Die(absl::StrCat("write ", path, ": ", std::strerror(errno)));
          p += n;
          left -= static_cast<size_t>(n);
        }
        if (::fsync(fd) != 0 || ::close(fd) != 0) Die(absl::StrCat("fsync ", path, ": ", std::strerror(errno)));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  return Seconds(t0, Clock::now());
}

// posix_fadvise(DONTNEED) on every file under `dir` (clean pages only: the writers fsynced).
void DropCache(const std::string& dir) {
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    const int fd = ::open(e.path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) Die(absl::StrCat("open ", e.path().string(), ": ", std::strerror(errno)));
    const int rc = ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
    if (rc != 0) Die(absl::StrCat("posix_fadvise ", e.path().string(), ": ", std::strerror(rc)));
  }
}

// Files read whole with read() (8 MiB at a time), split round-robin over `threads`. Returns
// seconds; `bytes` the total.
double ReadBaseline(const std::vector<std::string>& files, int threads, int64_t& bytes) {
  std::atomic<int64_t> total{0};
  const Clock::time_point t0 = Clock::now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      std::vector<uint8_t> buffer(size_t{8} << 20);
      for (size_t f = static_cast<size_t>(t); f < files.size(); f += static_cast<size_t>(threads)) {
        const int fd = ::open(files[f].c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0) Die(absl::StrCat("open ", files[f], ": ", std::strerror(errno)));
        for (;;) {
          const ssize_t n = ::read(fd, buffer.data(), buffer.size());
          if (n < 0 && errno == EINTR) continue;
          if (n < 0) Die(absl::StrCat("read ", files[f], ": ", std::strerror(errno)));
          if (n == 0) break;
          total += n;
        }
        ::close(fd);
      }
    });
  }
  for (std::thread& t : pool) t.join();
  bytes = total.load();
  return Seconds(t0, Clock::now());
}

// The snapshot's copy on its own, best of 3 each: `bytes` copied into freshly allocated
// memory (page faults included) and memcpy'd into memory already touched.
std::pair<double, double> CopySeconds(int64_t bytes) {
  std::vector<uint8_t> src(static_cast<size_t>(bytes), 1), touched(static_cast<size_t>(bytes), 0);
  double fresh = 1e30, warm = 1e30;
  for (int r = 0; r < 3; ++r) {
    Clock::time_point t0 = Clock::now();
    std::vector<uint8_t> copy = src;
    fresh = std::min(fresh, Seconds(t0, Clock::now()));
    t0 = Clock::now();
    std::memcpy(touched.data(), src.data(), src.size());
    warm = std::min(warm, Seconds(t0, Clock::now()));
    if (copy[copy.size() / 2] != 1 || touched[touched.size() / 2] != 1) Die("copy");
  }
  return {fresh, warm};
}

void Row(const std::string& what, double gbps, double base_gbps, const std::string& note) {
  std::printf("| %-44s | %8.3f | %8.3f | **%5.2f** | %s |\n", what.c_str(), gbps, base_gbps, gbps / base_gbps, note.c_str());
}

Flags ParseFlags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string name = argv[i];
    if (name == "--cached") {
      f.drop_cache = false;
      continue;
    }
    if (i + 1 >= argc) Die("missing value of " + name);
    const std::string value = argv[++i];
    if (name == "--params") {
      char* end = nullptr;
      f.params = std::strtod(value.c_str(), &end);
      if (*end == 'M') f.params *= 1 << 20;
      else if (*end == 'G') f.params *= 1 << 30;
      else if (*end != '\0') Die("bad --params " + value);
    } else if (name == "--dir") f.dir = value;
    else if (name == "--reps") f.reps = std::atoi(value.c_str());
    else if (name == "--write-dp") f.write_dp = std::atoi(value.c_str());
    else if (name == "--restore-dp") f.restore_dp = std::atoi(value.c_str());
    else if (name == "--recipe") f.recipe = value;
    else if (name == "--coordinator-bin") f.coordinator_bin = value;
    else if (name == "--daemon-bin") f.daemon_bin = value;
    else if (name == "--lease-ttl-ms") f.lease_ttl_ms = std::atoi(value.c_str());
    else Die("unknown flag " + name);
  }
  if (f.params < 1 << 20 || f.reps < 1 || f.write_dp < 1 || f.restore_dp < 1) Die("bad --params, --reps or --*-dp");
  if (f.coordinator_bin.empty() != f.daemon_bin.empty()) Die("give both --coordinator-bin and --daemon-bin, or neither");
  return f;
}

int Main(int argc, char** argv) {
  const Flags flags = ParseFlags(argc, argv);
  std::string base = flags.dir;
  if (base.empty()) {
    char tmpl[] = "/tmp/mainstay-checkpoint-bench.XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) Die(absl::StrCat("mkdtemp: ", std::strerror(errno)));
    base = tmpl;
  } else {
    base = absl::StrCat(flags.dir, "/mainstay-checkpoint-bench.", ::getpid());
    std::filesystem::create_directories(base);
  }
  struct Cleanup {
    std::string dir;
    ~Cleanup() { std::filesystem::remove_all(dir); }
  } cleanup{base};

  const JobSpec spec = MakeSpec(flags, flags.write_dp, "checkpoint-bench");
  auto writer = std::make_unique<InProcessCluster>(spec, flags.write_dp);
  int64_t params = 0;
  for (const LayoutTensor& t : writer->layout().tensors) params += t.numel;
  std::printf("model: %zu weights [%lld x 4096], %.1fM parameters (%.0f MB of master + AdamW moments), recipe %s\n",
              writer->layout().tensors.size(), static_cast<long long>(spec.tensors[0].shape[0]), params / 1e6,
              params * 12 / 1e6, flags.recipe.c_str());
  std::printf("directory: %s; write: D=%d on %d in-process daemons; restore: D=%d on the same daemons; %d reps\n",
              base.c_str(), flags.write_dp, flags.write_dp, flags.restore_dp, flags.reps);
  std::fflush(stdout);
  writer->PushAll(-1, 0.01f);
  writer->PushAll(0, 0.001f);
  writer->FinishStep(0);

  // 1. Writes, alternating baseline and checkpoint.
  std::vector<double> ckpt_s, plain_s, lock_s;
  v1::CheckpointManifest manifest;
  int64_t written = 0;
  std::string kept;
  for (int rep = 0; rep < flags.reps; ++rep) {
    const std::string dir = absl::StrCat(base, "/ckpt-", rep);
    std::vector<double> lock;
    const Clock::time_point t0 = Clock::now();
    absl::StatusOr<v1::CheckpointManifest> m = writer->Checkpoint(dir, absl::StrCat("ckpt-", rep), 0, lock);
    ckpt_s.push_back(Seconds(t0, Clock::now()));
    Check(m.status(), "checkpoint");
    lock_s.push_back(*std::max_element(lock.begin(), lock.end()));
    manifest = *m;
    written = 0;
    std::vector<std::vector<int64_t>> sizes(static_cast<size_t>(flags.write_dp));
    int64_t largest = 0;
    for (const v1::CheckpointFile& f : manifest.files()) {
      written += f.size_bytes();
      largest = std::max(largest, f.size_bytes());
      sizes[static_cast<size_t>(f.shard().shard() % flags.write_dp)].push_back(f.size_bytes());
    }
    written += static_cast<int64_t>(std::filesystem::file_size(checkpoint::JoinPath(dir, checkpoint::kManifestName)));
    std::vector<uint8_t> data(static_cast<size_t>(largest), 0x5a);
    const std::string plain = absl::StrCat(base, "/plain-", rep);
    plain_s.push_back(WriteBaseline(plain, sizes, data));
    std::filesystem::remove_all(plain);
    if (rep + 1 < flags.reps) {
      std::filesystem::remove_all(dir);
    } else {
      kept = dir;
    }
  }
  const int64_t per_daemon_state = params * 12 / flags.write_dp;
  const auto [fresh_copy, warm_copy] = CopySeconds(per_daemon_state);

  writer.reset();  // frees its state before the restored job allocates its own

  // 2. Restores into D' ranks, alternating baseline reads and restores.
  InProcessCluster restorer(MakeSpec(flags, flags.restore_dp, "checkpoint-bench"), flags.write_dp);
  std::vector<std::string> files;
  for (const v1::CheckpointFile& f : manifest.files()) files.push_back(checkpoint::JoinPath(kept, f.path()));
  std::vector<double> restore_s, read_s;
  int64_t read_bytes = 0;
  for (int rep = 0; rep < flags.reps; ++rep) {
    if (flags.drop_cache) DropCache(kept);
    read_s.push_back(ReadBaseline(files, flags.write_dp, read_bytes));
    if (flags.drop_cache) DropCache(kept);
    const Clock::time_point t0 = Clock::now();
    Check(restorer.Restore(kept, manifest.checkpoint_id()), "restore");
    Check(restorer.WaitPullable(manifest.version()), "pull after restore");
    restore_s.push_back(Seconds(t0, Clock::now()));
  }

  const double gb = static_cast<double>(written) / 1e9;
  std::printf("\nstate written per checkpoint: %.3f GB in %d data files + MANIFEST; medians of %d reps\n\n", gb,
              manifest.files_size(), flags.reps);
  std::printf("| measurement | GB/s | baseline GB/s | ratio | baseline |\n|---|---:|---:|---:|---|\n");
  Row("checkpoint write (WriteCheckpoint + MANIFEST)", gb / Median(ckpt_s), gb / Median(plain_s),
      absl::StrCat("write()+fsync() of the same file sizes, ", flags.write_dp, " threads"));
  Row(absl::StrCat("restore into D=", flags.restore_dp, " until pullable"), gb / Median(restore_s),
      static_cast<double>(read_bytes) / 1e9 / Median(read_s),
      absl::StrCat("read() of the checkpoint's files, ", flags.write_dp, " threads, ",
                   flags.drop_cache ? "page cache dropped" : "cached"));
  std::printf("\n| time | median s | all reps s |\n|---|---:|---|\n");
  auto times = [](const std::vector<double>& v) {
    std::string s;
    for (double x : v) absl::StrAppend(&s, s.empty() ? "" : " ", absl::StrFormat("%.3f", x));
    return s;
  };
  std::printf("| checkpoint write | %.3f | %s |\n", Median(ckpt_s), times(ckpt_s).c_str());
  std::printf("| baseline write | %.3f | %s |\n", Median(plain_s), times(plain_s).c_str());
  std::printf("| job lock held by the snapshot (longest Progress() call) | %.3f | %s |\n", Median(lock_s),
              times(lock_s).c_str());
  std::printf("| reference: one daemon's %.0f MB copied into fresh memory | %.3f | best of 3 |\n",
              per_daemon_state / 1e6, fresh_copy);
  std::printf("| reference: one daemon's %.0f MB memcpy'd into touched memory | %.3f | best of 3 |\n",
              per_daemon_state / 1e6, warm_copy);
  std::printf("| restore until pullable | %.3f | %s |\n", Median(restore_s), times(restore_s).c_str());
  std::printf("| baseline read | %.3f | %s |\n", Median(read_s), times(read_s).c_str());
  std::fflush(stdout);

  if (!flags.coordinator_bin.empty()) Check(RunRestart(flags, base), "restart");
  return 0;
}

}  // namespace
}  // namespace mainstay::bench

int main(int argc, char** argv) { return mainstay::bench::Main(argc, argv); }
