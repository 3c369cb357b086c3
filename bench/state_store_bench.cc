// The coordinator's commit latency on its two state stores (docs/benchmarks.md, "Coordinator
// state"): one durable StateStore::Append (Write + Sync) of a batch the size of a job's
// placement, on the file WAL (--state-dir: write + fdatasync) and on etcd (one fenced
// transaction to a one-member etcd on this host), one at a time, as CreateJob, a placement
// commit or a drain step waits for it.
//
//   state_store_bench [--n 300] [--batch-bytes 4096] [--etcd http://127.0.0.1:2379]
//
// Without --etcd it starts its own etcd (Debian's etcd-server, $MAINSTAY_ETCD_BIN) on loopback
// ports, with its data under $TMPDIR, as the file store's directory is.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/coordinator/etcd_state_store.h"
#include "server/coordinator/state_store.h"
#include "tests/testing/etcd_server.h"

namespace mainstay::coordinator {
namespace {

struct Latency {
  double p50, p99, mean;
};

Latency Measure(StateStore& store, int n, size_t bytes) {
  if (!store.Load().ok()) std::abort();
  std::vector<double> ms;
  const std::string value(bytes, 'x');
  for (int i = 1; i <= n; ++i) {
    v1::StateBatch batch;
    batch.set_sequence(i);
    v1::KvEntry* e = batch.add_records()->mutable_put_kv();
    e->set_key(absl::StrCat("bench/", i % 16));
    e->set_value(value);
    e->set_version(1);
    const absl::Time start = absl::Now();
    if (absl::Status s = store.Append(batch); !s.ok()) {
      std::fprintf(stderr, "state_store_bench: %s\n", s.ToString().c_str());
      std::exit(1);
    }
    ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
  }
  std::sort(ms.begin(), ms.end());
  double sum = 0;
  for (double x : ms) sum += x;
  return {ms[ms.size() / 2], ms[ms.size() * 99 / 100], sum / static_cast<double>(ms.size())};
}

int Main(int argc, char** argv) {
  int n = 300;
  size_t bytes = 4096;
  std::string endpoint;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--n") absl::SimpleAtoi(argv[i + 1], &n);
    if (flag == "--batch-bytes") absl::SimpleAtoi(argv[i + 1], &bytes);
    if (flag == "--etcd") endpoint = argv[i + 1];
  }
  std::unique_ptr<testing::EtcdServer> own;
  if (endpoint.empty()) {
    absl::StatusOr<std::unique_ptr<testing::EtcdServer>> started = testing::EtcdServer::Start();
    if (!started.ok()) {
      std::fprintf(stderr, "state_store_bench: %s\n", started.status().ToString().c_str());
      return 1;
    }
    own = *std::move(started);
    endpoint = own->endpoint();
  }
  std::printf("state_store_bench: %d durable appends of a %zu-byte batch, one at a time\n", n, bytes);

  absl::StatusOr<std::unique_ptr<testing::TempDir>> dir = testing::TempDir::Create("mainstay-bench-wal");
  absl::StatusOr<std::unique_ptr<StateStore>> file = OpenFileStateStore((*dir)->path());
  if (!file.ok()) return 1;
  const Latency wal = Measure(**file, n, bytes);

  EtcdOptions options;
  options.endpoints = {endpoint};
  options.prefix = absl::StrCat("/mainstay-bench-", absl::ToUnixNanos(absl::Now()), "/");
  absl::StatusOr<std::unique_ptr<EtcdClient>> etcd = EtcdClient::Create(options);
  if (!etcd.ok()) return 1;
  std::string holder;
  absl::StatusOr<std::unique_ptr<EtcdLeadership>> leader = EtcdLeadership::TryAcquire(etcd->get(), "bench", &holder);
  if (!leader.ok() || *leader == nullptr) {
    std::fprintf(stderr, "state_store_bench: cannot lead at %s: %s\n", endpoint.c_str(),
                 leader.ok() ? holder.c_str() : leader.status().ToString().c_str());
    return 1;
  }
  std::unique_ptr<StateStore> on_etcd = NewEtcdStateStore(etcd->get(), leader->get());
  const Latency e = Measure(*on_etcd, n, bytes);

  std::printf("%-22s %10s %10s %10s\n", "store", "p50 ms", "p99 ms", "mean ms");
  std::printf("%-22s %10.3f %10.3f %10.3f\n", "file WAL (fdatasync)", wal.p50, wal.p99, wal.mean);
  std::printf("%-22s %10.3f %10.3f %10.3f\n", "etcd (1 member, local)", e.p50, e.p99, e.mean);
  std::printf("etcd / file WAL, p50: %.2fx\n", e.p50 / wal.p50);
  return 0;
}

}  // namespace
}  // namespace mainstay::coordinator

int main(int argc, char** argv) { return mainstay::coordinator::Main(argc, argv); }
