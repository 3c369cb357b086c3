// libFuzzer target: the coordinator's durable state directory (server/coordinator/state_store.h,
// docs/coordinator.md "Durability"). The input becomes the files `wal` and/or `snapshot` of a
// fresh directory, which is opened with OpenFileStateStore and loaded, as the coordinator does
// at start. The first byte chooses how the rest is laid out:
//   0: the rest is `wal` (no snapshot);  1: the rest is `snapshot` (no log);
//   2: a u16 (little endian) n, then n bytes of `snapshot`, then `wal`;
//   3: built from operations, each [op u8][n u16 LE][n bytes]: op % 8 = 0 appends a correctly
//      framed WAL record of the bytes, 1 makes them the framed snapshot, 2 appends them raw,
//      3 appends a framed record with one bit flipped, 4 cuts n bytes off the log's end,
//      5 appends n zero bytes, 6 makes them the raw snapshot, 7 appends a framed record whose
//      length field is off. This mode gets fuzzed payloads past the checksums, into the
//      protobuf parser and State::Apply.
//
// Invariants (a violation aborts, so libFuzzer reports it with the input):
//  - no crash, leak or UB (built with -fsanitize=fuzzer,address,undefined by scripts/fuzz.sh);
//  - Load is OK or DATA_LOSS, and which one is what the file format says (the rules are restated
//    below, independently of state_store.cc): a snapshot must be whole; a WAL record that is
//    cut short at the end of the file (its header or payload runs past the end), or a tail of
//    zeros, is a torn final append and is dropped; any other bad record is DATA_LOSS naming the
//    file and the record's byte offset. When OK, the state is the snapshot with the log's
//    newer batches applied in order, and the log has been cut back to its valid records;
//  - loading the directory again (a new store) gives the same state;
//  - a batch appended after the load is there on the next Load, both through the same store
//    and through a new one, and a snapshot of that state written by WriteSnapshot loads back
//    to the same state with an empty log.
#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "mainstay/v1/state.pb.h"
#include "server/coordinator/state.h"
#include "server/coordinator/state_store.h"
#include "tests/fuzz/fuzz_check.h"

namespace mainstay::coordinator {
namespace {

using fuzz::Check;
using fuzz::Fail;

// The file format as docs/coordinator.md gives it: magic | length | CRC-32 | payload,
// little-endian u32s; "MSWL" frames in `wal`, one "MSSN" frame in `snapshot`.
constexpr uint32_t kWalMagic = 0x4C57534D;
constexpr uint32_t kSnapMagic = 0x4E53534D;
constexpr size_t kHeaderBytes = 12;
constexpr uint32_t kMaxFrame = 1u << 30;

// CRC-32 (IEEE 802.3, reflected), bit by bit: slow and obviously right.
uint32_t Crc32(const char* data, size_t n) {
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) {
    c ^= static_cast<uint8_t>(data[i]);
    for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
  }
  return c ^ 0xFFFFFFFFu;
}

void PutU32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

uint32_t GetU32(const std::string& s, size_t at) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<uint8_t>(s[at + i])) << (8 * i);
  return v;
}

std::string Frame(uint32_t magic, const std::string& payload) {
  std::string out;
  PutU32(out, magic);
  PutU32(out, static_cast<uint32_t>(payload.size()));
  PutU32(out, Crc32(payload.data(), payload.size()));
  return out + payload;
}

// Byte-for-byte comparable: map fields (DaemonInfo.labels) serialize in a fixed order.
std::string Canonical(const google::protobuf::MessageLite& m) {
  std::string out;
  {
    google::protobuf::io::StringOutputStream stream(&out);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.SetSerializationDeterministic(true);
    m.SerializeToCodedStream(&coded);
  }
  return out;
}

struct Files {
  std::optional<std::string> snapshot;
  std::optional<std::string> wal;
};

// A little-endian u16 at `at`, or what is left of it.
size_t GetU16(const uint8_t* data, size_t size, size_t at) {
  size_t v = 0;
  if (at < size) v |= data[at];
  if (at + 1 < size) v |= static_cast<size_t>(data[at + 1]) << 8;
  return v;
}

Files Decode(const uint8_t* data, size_t size) {
  Files f;
  if (size == 0) return f;  // an empty directory
  const char* rest = reinterpret_cast<const char*>(data + 1);
  const size_t rest_size = size - 1;
  switch (data[0] % 4) {
    case 0: f.wal.emplace(rest, rest_size); break;
    case 1: f.snapshot.emplace(rest, rest_size); break;
    case 2: {
      const size_t n = std::min(GetU16(data, size, 1), size > 3 ? size - 3 : 0);
      const size_t at = std::min<size_t>(3, size);
      f.snapshot.emplace(reinterpret_cast<const char*>(data + at), n);
      f.wal.emplace(reinterpret_cast<const char*>(data + at + n), size - at - n);
      break;
    }
    default: {
      f.wal.emplace();
      std::string& wal = *f.wal;
      size_t at = 1;
      while (at < size) {
        const uint8_t op = data[at];
        const size_t n = GetU16(data, size, at + 1);
        at = std::min(at + 3, size);
        switch (op % 8) {
          case 4: wal.resize(wal.size() - std::min(n, wal.size())); continue;
          case 5: wal.append(std::min<size_t>(n, 4096), '\0'); continue;
          default: break;
        }
        const std::string bytes(reinterpret_cast<const char*>(data + at), std::min(n, size - at));
        at += bytes.size();
        switch (op % 8) {
          case 0: wal += Frame(kWalMagic, bytes); break;
          case 1: f.snapshot = Frame(kSnapMagic, bytes); break;
          case 2: wal += bytes; break;
          case 3: {
            std::string frame = Frame(kWalMagic, bytes);
            const size_t bit = (static_cast<size_t>(op >> 3) * 13) % (8 * frame.size());
            frame[bit / 8] = static_cast<char>(frame[bit / 8] ^ (1 << (bit % 8)));
            wal += frame;
            break;
          }
          case 6: f.snapshot = bytes; break;
          case 7: {
            std::string frame = Frame(kWalMagic, bytes);
            const uint32_t length = static_cast<uint32_t>(bytes.size()) + (op >> 3) - 16;
            std::string field;
            PutU32(field, length);
            frame.replace(4, 4, field);
            wal += frame;
            break;
          }
        }
      }
    }
  }
  return f;
}

// What Load must answer for `files`, by the rules in the header comment.
struct Expected {
  bool data_loss = false;
  std::string file;            // with data_loss: "snapshot" or "wal"
  size_t offset = 0;           // with data_loss in the log: the bad record's first byte
  size_t valid_wal_bytes = 0;  // without: the log's length once a torn tail is cut off
  v1::CoordinatorState state;  // without: the state Load returns
};

Expected Replay(const Files& files) {
  Expected e;
  State state;
  if (files.snapshot.has_value()) {
    const std::string& snap = *files.snapshot;
    v1::CoordinatorState proto;
    const bool whole = snap.size() >= kHeaderBytes && GetU32(snap, 0) == kSnapMagic &&
                       GetU32(snap, 4) == snap.size() - kHeaderBytes &&
                       GetU32(snap, 8) == Crc32(snap.data() + kHeaderBytes, snap.size() - kHeaderBytes) &&
                       proto.ParseFromArray(snap.data() + kHeaderBytes, static_cast<int>(snap.size() - kHeaderBytes));
    if (!whole) {
      e.data_loss = true;
      e.file = "snapshot";
      return e;
    }
    state = State::FromProto(proto);
  }
  const std::string wal = files.wal.value_or("");
  size_t offset = 0;
  while (offset < wal.size()) {
    const size_t left = wal.size() - offset;
    if (left < kHeaderBytes) break;  // torn: the header runs past the end
    const uint32_t magic = GetU32(wal, offset), length = GetU32(wal, offset + 4), crc = GetU32(wal, offset + 8);
    const bool plausible = magic == kWalMagic && length <= kMaxFrame;
    if (plausible && left - kHeaderBytes < length) break;  // torn: the payload runs past the end
    v1::StateBatch batch;
    if (plausible && crc == Crc32(wal.data() + offset + kHeaderBytes, length) &&
        batch.ParseFromArray(wal.data() + offset + kHeaderBytes, static_cast<int>(length))) {
      if (batch.sequence() > state.sequence) state.Apply(batch);
      offset += kHeaderBytes + length;
      continue;
    }
    if (std::all_of(wal.begin() + static_cast<std::ptrdiff_t>(offset), wal.end(), [](char c) { return c == 0; })) {
      break;  // torn: zeros the file system added but the append never wrote
    }
    e.data_loss = true;
    e.file = "wal";
    e.offset = offset;
    return e;
  }
  e.valid_wal_bytes = offset;
  e.state = state.ToProto();
  return e;
}

// One directory per process (libFuzzer's -fork runs several), on tmpfs when there is one: a
// Load fsyncs the directory and an Append fdatasyncs the log.
const std::string& Dir() {
  static const std::string* dir = [] {
    std::string base =
        std::filesystem::exists("/dev/shm") ? "/dev/shm" : std::filesystem::temp_directory_path().string();
    std::string pattern = base + "/mainstay-state-fuzz-XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) Fail("mkdtemp " + pattern + ": " + std::strerror(errno));
    auto* d = new std::string(pattern);
    std::atexit([] {
      std::error_code ignored;
      std::filesystem::remove_all(Dir(), ignored);
    });
    return d;
  }();
  return *dir;
}

void WriteFile(const std::string& path, const std::string& data) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) Fail("open " + path + ": " + std::strerror(errno));
  const bool ok = std::fwrite(data.data(), 1, data.size(), f) == data.size();
  if (std::fclose(f) != 0 || !ok) Fail("write " + path);
}

std::string ReadFile(const std::string& path) {
  std::string data;
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return data;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) data.append(buf, n);
  std::fclose(f);
  return data;
}

int64_t FileSize(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
}

void ClearDir(const std::string& dir) {
  for (const char* name : {"wal", "snapshot", "snapshot.tmp"}) ::unlink((dir + "/" + name).c_str());
}

std::unique_ptr<StateStore> Open(const std::string& dir) {
  absl::StatusOr<std::unique_ptr<StateStore>> store = OpenFileStateStore(dir);
  if (!store.ok()) Fail("OpenFileStateStore(" + dir + "): " + store.status().ToString());
  return *std::move(store);
}

v1::CoordinatorState LoadOk(StateStore& store, const char* when) {
  absl::StatusOr<v1::CoordinatorState> state = store.Load();
  if (!state.ok()) Fail(std::string("Load ") + when + " failed: " + state.status().ToString());
  return *std::move(state);
}

void CheckSame(const v1::CoordinatorState& got, const v1::CoordinatorState& want, const std::string& when) {
  if (Canonical(got) == Canonical(want)) return;
  Fail("Load " + when + " returned a different state:\n got:  " + got.ShortDebugString().substr(0, 2000) +
       "\n want: " + want.ShortDebugString().substr(0, 2000));
}

// The batch appended after a successful load: a change of every kind, keyed off what is there.
v1::StateBatch NextBatch(const v1::CoordinatorState& loaded) {
  v1::StateBatch batch;
  batch.set_sequence(loaded.sequence() + 1);
  v1::KvEntry* put = batch.add_records()->mutable_put_kv();
  put->set_key("fuzz/appended");
  put->set_value("after load");
  put->set_version(1);
  v1::DaemonInfo* daemon = batch.add_records()->mutable_put_daemon();
  daemon->mutable_endpoint()->set_daemon_id("fuzz-daemon");
  daemon->mutable_endpoint()->set_address("localhost:1");
  (*daemon->mutable_labels())["zone"] = "a";
  if (loaded.jobs_size() > 0) batch.add_records()->set_delete_job(loaded.jobs(0).info().job_id());
  if (loaded.kv_size() > 0) batch.add_records()->set_delete_kv(loaded.kv(0).key());
  *batch.mutable_counters() = loaded.counters();
  return batch;
}

void RunOne(const uint8_t* data, size_t size) {
  const std::string& dir = Dir();
  const std::string wal_path = dir + "/wal", snapshot_path = dir + "/snapshot";
  ClearDir(dir);
  const Files files = Decode(data, size);
  if (files.wal.has_value()) WriteFile(wal_path, *files.wal);
  if (files.snapshot.has_value()) WriteFile(snapshot_path, *files.snapshot);
  const Expected expected = Replay(files);

  std::unique_ptr<StateStore> store = Open(dir);
  absl::StatusOr<v1::CoordinatorState> loaded = store->Load();
  if (!loaded.ok()) {
    Check(loaded.status().code() == absl::StatusCode::kDataLoss,
          "Load failed with an unexpected code: " + loaded.status().ToString());
    Check(expected.data_loss, "Load refused files the format accepts: " + loaded.status().ToString());
    const std::string message(loaded.status().message());
    Check(expected.file == (message.rfind(wal_path, 0) == 0        ? "wal"
                            : message.rfind(snapshot_path, 0) == 0 ? "snapshot"
                                                                   : "?"),
          "DATA_LOSS names the wrong file (expected " + expected.file + "): " + message);
    if (expected.file == "wal") {
      Check(message.find(absl::StrCat("at byte ", expected.offset, " ")) != std::string::npos,
            absl::StrCat("DATA_LOSS does not name the bad record's offset ", expected.offset, ": ", message));
    }
    return;
  }
  Check(!expected.data_loss,
        absl::StrCat("Load accepted a corrupt ", expected.file,
                     expected.file == "wal" ? absl::StrCat(" (bad record at byte ", expected.offset, ")") : ""));
  CheckSame(*loaded, expected.state, "of the fuzzed files");
  if (files.wal.has_value()) {
    Check(FileSize(wal_path) == static_cast<int64_t>(expected.valid_wal_bytes),
          absl::StrCat("after Load the log has ", FileSize(wal_path), " bytes, its valid records ",
                       expected.valid_wal_bytes));
  }

  // The same directory again, as after a restart.
  CheckSame(LoadOk(*Open(dir), "of the same directory again"), *loaded, "of the same directory again");

  // A change made after the load survives the next loads.
  if (loaded->sequence() == std::numeric_limits<int64_t>::max()) return;  // no next sequence
  const v1::StateBatch batch = NextBatch(*loaded);
  if (absl::Status s = store->Append(batch); !s.ok()) Fail("Append after a successful Load: " + s.ToString());
  State next = State::FromProto(*loaded);
  next.Apply(batch);
  const v1::CoordinatorState want = next.ToProto();
  CheckSame(LoadOk(*store, "through the store that appended"), want, "through the store that appended");
  std::unique_ptr<StateStore> reopened = Open(dir);
  CheckSame(LoadOk(*reopened, "after an Append"), want, "after an Append");

  // Compaction: the snapshot alone holds the state.
  if (absl::Status s = reopened->WriteSnapshot(want); !s.ok()) Fail("WriteSnapshot: " + s.ToString());
  Check(FileSize(wal_path) == 0, "WriteSnapshot left records in the log");
  CheckSame(LoadOk(*Open(dir), "after WriteSnapshot"), want, "after WriteSnapshot");
}

// ---- Seeds: MAINSTAY_FUZZ_WRITE_SEEDS=DIR writes the checked-in corpus (files the real store
// wrote, in the layouts above) to DIR and exits.

v1::StateBatch SeedBatch(int64_t sequence) {
  v1::StateBatch b;
  b.set_sequence(sequence);
  v1::StateCounters& c = *b.mutable_counters();
  c.set_next_daemon(2);
  c.set_next_job(sequence >= 2 ? 2 : 1);
  c.set_kv_revision(sequence >= 3 ? sequence - 2 : 0);
  switch (sequence) {
    case 1: {
      v1::DaemonInfo* d = b.add_records()->mutable_put_daemon();
      d->mutable_endpoint()->set_daemon_id("d-1");
      d->mutable_endpoint()->set_address("10.0.0.7:7100");
      d->mutable_endpoint()->set_node_name("node-7");
      d->mutable_resources()->set_host_memory_bytes(int64_t{64} << 30);
      d->set_version("0.1.0");
      (*d->mutable_labels())["rack"] = "r1";
      d->set_state(v1::DAEMON_STATE_READY);
      d->set_registered_unix_ms(1700000000000);
      d->set_lease_expires_unix_ms(1700000010000);
      d->set_key_sha256(std::string(32, '\x5a'));
      break;
    }
    case 2: {
      v1::StoredJob* j = b.add_records()->mutable_put_job();
      j->mutable_info()->set_job_id("job-1");
      j->mutable_info()->mutable_spec()->set_name("tiny");
      j->mutable_info()->set_state(v1::JOB_STATE_READY);
      j->mutable_info()->set_placement_epoch(1);
      j->mutable_info()->set_committed_step(-1);
      j->mutable_info()->set_num_buckets(1);
      j->mutable_placement()->set_job_id("job-1");
      j->mutable_placement()->set_epoch(1);
      for (int s = 0; s < 2; ++s) {
        v1::ShardPlacement* p = j->mutable_placement()->add_shards();
        p->mutable_shard()->set_shard(s);
        p->set_daemon_id("d-1");
      }
      j->set_job_token_sha256(std::string(32, '\x11'));
      j->set_request_id("req-1");
      j->set_bytes_per_rank(4096);
      break;
    }
    case 3: {
      v1::KvEntry* e = b.add_records()->mutable_put_kv();
      e->set_key("mainstay/peer/job-1/1");
      e->set_value("gen-0");
      e->set_version(1);
      e->set_mod_revision(1);
      break;
    }
    default: {
      v1::KvEntry* e = b.add_records()->mutable_put_kv();
      e->set_key("user/flag");
      e->set_value(std::string("\x00\x01\xff", 3));
      e->set_version(1);
      e->set_mod_revision(2);
      e->set_expires_unix_ms(1700000060000);
      b.add_records()->set_delete_kv("mainstay/peer/job-1/1");
      break;
    }
  }
  return b;
}

void WriteSeeds(const std::string& out) {
  const std::string gen = Dir() + "/seedgen";
  std::filesystem::create_directories(out);
  std::filesystem::remove_all(gen);
  auto seed = [&](const std::string& name, const std::string& bytes) {
    if (bytes.size() >= 4096) Fail("seed " + name + " is over 4 KB");
    WriteFile(out + "/" + name, bytes);
  };
  // The log of four appends.
  std::string wal;
  {
    std::unique_ptr<StateStore> store = Open(gen);
    (void)LoadOk(*store, "of an empty directory");
    for (int64_t seq = 1; seq <= 4; ++seq) {
      if (absl::Status s = store->Append(SeedBatch(seq)); !s.ok()) Fail("seed Append: " + s.ToString());
    }
    wal = ReadFile(gen + "/wal");
  }
  seed("wal_four_batches", std::string(1, '\0') + wal);
  // A crash mid-append (a cut payload), and one after the file grew but before the data landed.
  seed("wal_torn_final_record", std::string(1, '\0') + wal.substr(0, wal.size() - 5));
  seed("wal_zero_tail", std::string(1, '\0') + wal + std::string(40, '\0'));
  // Acknowledged data damaged: one bit of the second record's payload (DATA_LOSS).
  std::string damaged = wal;
  const size_t second = kHeaderBytes + GetU32(wal, 4);
  damaged[second + kHeaderBytes + 3] = static_cast<char>(damaged[second + kHeaderBytes + 3] ^ 0x10);
  seed("wal_bit_flip_second_record", std::string(1, '\0') + damaged);
  // A snapshot at sequence 2 next to the whole log: a crash after the snapshot's rename and
  // before the log was cut (batches 1 and 2 are skipped).
  std::string snapshot;
  {
    State two;
    two.Apply(SeedBatch(1));
    two.Apply(SeedBatch(2));
    std::unique_ptr<StateStore> store = Open(gen);
    if (absl::Status s = store->WriteSnapshot(two.ToProto()); !s.ok()) Fail("seed WriteSnapshot: " + s.ToString());
    snapshot = ReadFile(gen + "/snapshot");
  }
  seed("snapshot_only", std::string(1, '\1') + snapshot);
  std::string both(1, '\2');
  both.push_back(static_cast<char>(snapshot.size() & 0xFF));
  both.push_back(static_cast<char>(snapshot.size() >> 8));
  seed("snapshot_and_stale_wal", both + snapshot + wal);
  // Layout 3: the same snapshot and records as operations (the fuzzer frames them).
  std::string ops(1, '\3');
  auto op = [&](uint8_t code, const std::string& bytes) {
    ops.push_back(static_cast<char>(code));
    ops.push_back(static_cast<char>(bytes.size() & 0xFF));
    ops.push_back(static_cast<char>(bytes.size() >> 8));
    ops += bytes;
  };
  op(1, snapshot.substr(kHeaderBytes));
  for (int64_t seq = 3; seq <= 4; ++seq) op(0, SeedBatch(seq).SerializeAsString());
  op(2, wal.substr(0, 7));  // a torn header
  seed("ops_snapshot_records_torn_header", ops);
  std::filesystem::remove_all(gen);
}

}  // namespace
}  // namespace mainstay::coordinator

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* out = std::getenv("MAINSTAY_FUZZ_WRITE_SEEDS")) {
    mainstay::coordinator::WriteSeeds(out);
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mainstay::coordinator::RunOne(data, size);
  return 0;
}
