#include "server/coordinator/state_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"
#include "common/status.h"
#include "server/coordinator/state.h"

namespace mainstay::coordinator {
namespace {

// ---- CRC-32 (IEEE 802.3), for frames and snapshots.
uint32_t Crc32(const void* data, size_t n) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  uint32_t c = 0xFFFFFFFFu;
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

// Frame: magic, payload length, CRC-32 of the payload, payload. Little-endian u32s.
constexpr uint32_t kWalMagic = 0x4C57534D;   // "MSWL"
constexpr uint32_t kSnapMagic = 0x4E53534D;  // "MSSN"
constexpr size_t kHeader = 12;
constexpr uint32_t kMaxFrame = 1u << 30;

std::string Frame(uint32_t magic, const std::string& payload) {
  std::string out(kHeader, '\0');
  const uint32_t header[3] = {magic, static_cast<uint32_t>(payload.size()), Crc32(payload.data(), payload.size())};
  std::memcpy(out.data(), header, kHeader);
  return out + payload;
}

absl::Status Errno(absl::string_view what, const std::string& path) {
  return absl::InternalError(absl::StrCat(what, " ", path, ": ", std::strerror(errno)));
}

absl::StatusOr<std::string> ReadFile(const std::string& path, bool* exists) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) {
      *exists = false;
      return std::string();
    }
    return Errno("open", path);
  }
  *exists = true;
  std::string data;
  char buf[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      ::close(fd);
      return Errno("read", path);
    }
    if (n == 0) break;
    data.append(buf, n);
  }
  ::close(fd);
  return data;
}

absl::Status WriteAll(int fd, const std::string& data, const std::string& path) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Errno("write", path);
    }
    done += n;
  }
  return absl::OkStatus();
}

absl::Status FsyncDir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Errno("open", dir);
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) return Errno("fsync", dir);
  return absl::OkStatus();
}

class MemoryStateStore : public StateStore {
 public:
  absl::StatusOr<v1::CoordinatorState> Load() override {
    absl::MutexLock lock(&mu_);
    return state_.ToProto();
  }
  absl::Status Write(const v1::StateBatch& batch) override {
    absl::MutexLock lock(&mu_);
    state_.Apply(batch);
    return absl::OkStatus();
  }
  absl::Status Sync() override { return absl::OkStatus(); }
  absl::Status StartSnapshot(const v1::CoordinatorState& state) override {
    absl::MutexLock lock(&mu_);
    state_ = State::FromProto(state);
    return absl::OkStatus();
  }

 private:
  absl::Mutex mu_;
  State state_ ABSL_GUARDED_BY(mu_);
};

// Replays the frames of one log file onto `state`. Sets `*valid_end` to the end of the last
// whole frame; a torn final frame sets `*torn`. Any other bad frame is DATA_LOSS.
absl::Status ReplayLog(const std::string& path, const std::string& wal, State& state, int64_t* valid_end, bool* torn) {
  *torn = false;
  size_t offset = 0;
  while (offset < wal.size()) {
    uint32_t header[3] = {0, 0, 0};
    const bool header_ok = wal.size() - offset >= kHeader;
    if (header_ok) std::memcpy(header, wal.data() + offset, kHeader);
    const bool fits =
        header_ok && header[0] == kWalMagic && header[1] <= kMaxFrame && wal.size() - offset - kHeader >= header[1];
    v1::StateBatch batch;
    const bool valid = fits && header[2] == Crc32(wal.data() + offset + kHeader, header[1]) &&
                       batch.ParseFromArray(wal.data() + offset + kHeader, static_cast<int>(header[1]));
    if (!valid) {
      // Only an append cut short by a crash is a torn tail (never acknowledged: appends are
      // synced before they are answered): the final record's header or payload runs past the
      // end of the file, or the file was extended with zeros that were never written. Anything
      // else (a bad magic, length or checksum of a complete record) is corruption of
      // acknowledged data: refuse to start rather than drop it silently.
      const bool short_header = !header_ok;
      const bool short_payload = header_ok && header[0] == kWalMagic && header[1] <= kMaxFrame && !fits;
      const bool zero_tail =
          std::all_of(wal.begin() + static_cast<std::ptrdiff_t>(offset), wal.end(), [](char c) { return c == 0; });
      if (!short_header && !short_payload && !zero_tail) {
        return absl::DataLossError(absl::StrCat(
            path, ": corrupt record at byte ", offset, " of ", wal.size(), " (",
            header[0] != kWalMagic ? "bad magic" : header[1] > kMaxFrame ? "bad length" : "bad checksum",
            "); it is not a torn final append, so the coordinator refuses to start rather than lose "
            "acknowledged changes (restore the state directory from a backup)"));
      }
      *torn = true;
      break;
    }
    if (batch.sequence() > state.sequence) state.Apply(batch);
    offset += kHeader + header[1];
  }
  *valid_end = static_cast<int64_t>(offset);
  return absl::OkStatus();
}

class FileStateStore : public StateStore {
 public:
  explicit FileStateStore(std::string dir)
      : dir_(std::move(dir)), wal_path_(dir_ + "/wal"), next_path_(dir_ + "/wal.next"),
        snapshot_path_(dir_ + "/snapshot") {}
  ~FileStateStore() override {
    if (wal_fd_ >= 0) ::close(wal_fd_);
    if (next_fd_ >= 0) ::close(next_fd_);
  }

  absl::StatusOr<v1::CoordinatorState> Load() override {
    absl::MutexLock lock(&mu_);
    State state;
    bool exists = false;
    MAINSTAY_ASSIGN_OR_RETURN(std::string snap, ReadFile(snapshot_path_, &exists));
    if (exists) {
      uint32_t header[3];
      if (snap.size() < kHeader) return absl::DataLossError(absl::StrCat(snapshot_path_, ": truncated header"));
      std::memcpy(header, snap.data(), kHeader);
      const std::string payload = snap.substr(kHeader);
      v1::CoordinatorState proto;
      if (header[0] != kSnapMagic || header[1] != payload.size() ||
          header[2] != Crc32(payload.data(), payload.size()) || !proto.ParseFromString(payload)) {
        return absl::DataLossError(absl::StrCat(snapshot_path_, ": corrupt snapshot (bad magic, size or checksum)"));
      }
      state = State::FromProto(proto);
    }
    MAINSTAY_ASSIGN_OR_RETURN(std::string wal, ReadFile(wal_path_, &exists));
    int64_t wal_end = 0;
    bool wal_torn = false;
    MAINSTAY_RETURN_IF_ERROR(ReplayLog(wal_path_, wal, state, &wal_end, &wal_torn));
    bool next_exists = false;
    MAINSTAY_ASSIGN_OR_RETURN(std::string next, ReadFile(next_path_, &next_exists));
    MAINSTAY_RETURN_IF_ERROR(OpenWal(wal_torn ? wal_end : -1));
    if (next_exists) {
      // A crash while a snapshot was written: the log after it continues this one, unless this
      // one was cut short (then nothing in the next one was ever synced: a Sync covers both).
      // Its whole records go back into this one, and it goes.
      if (!wal_torn) {
        int64_t next_end = 0;
        bool next_torn = false;
        MAINSTAY_RETURN_IF_ERROR(ReplayLog(next_path_, next, state, &next_end, &next_torn));
        next.resize(static_cast<size_t>(next_end));
        MAINSTAY_RETURN_IF_ERROR(WriteAll(wal_fd_, next, wal_path_));
        if (::fdatasync(wal_fd_) != 0) return Errno("fdatasync", wal_path_);
        wal_size_ += next_end;
      }
      if (::unlink(next_path_.c_str()) != 0) return Errno("unlink", next_path_);
      MAINSTAY_RETURN_IF_ERROR(FsyncDir(dir_));
    }
    return state.ToProto();
  }

  absl::Status Write(const v1::StateBatch& batch) override {
    absl::MutexLock lock(&mu_);
    if (broken_) return Broken();
    if (wal_fd_ < 0) MAINSTAY_RETURN_IF_ERROR(OpenWal(-1));
    const bool next = next_fd_ >= 0;
    const int fd = next ? next_fd_ : wal_fd_;
    int64_t& size = next ? next_size_ : wal_size_;
    const std::string& path = next ? next_path_ : wal_path_;
    const std::string frame = Frame(kWalMagic, batch.SerializeAsString());
    if (absl::Status status = WriteAll(fd, frame, path); !status.ok()) {
      // Take the partial frame back so a later Load cannot replay a batch we reported failed.
      if (::ftruncate(fd, size) != 0 || ::lseek(fd, size, SEEK_SET) < 0) broken_ = true;
      return absl::UnavailableError(absl::StrCat("state store: ", status.message()));
    }
    size += static_cast<int64_t>(frame.size());
    return absl::OkStatus();
  }

  absl::Status StartSnapshot(const v1::CoordinatorState& state) override {
    absl::MutexLock lock(&mu_);
    if (broken_) return Broken();
    if (next_fd_ >= 0) return absl::FailedPreconditionError("state store: a snapshot is being written already");
    if (wal_fd_ < 0) MAINSTAY_RETURN_IF_ERROR(OpenWal(-1));
    const int fd = ::open(next_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return Errno("open", next_path_);
    next_fd_ = fd;
    next_size_ = 0;
    snapshot_ = state.SerializeAsString();
    return absl::OkStatus();
  }

  absl::Status Sync() override {
    int wal_fd, next_fd;
    std::string snapshot;
    {
      absl::MutexLock lock(&mu_);
      if (broken_) return Broken();
      wal_fd = wal_fd_;
      next_fd = next_fd_;
      snapshot = snapshot_;  // (a copy: Writes go on meanwhile, and the snapshot is rare)
    }
    // Without the lock: Writes go on into the log while this one is synced; they are synced by
    // the next Sync.
    for (const auto& [fd, path] : {std::pair{wal_fd, &wal_path_}, std::pair{next_fd, &next_path_}}) {
      if (fd >= 0 && ::fdatasync(fd) != 0) {
        const absl::Status error = Errno("fdatasync", *path);
        absl::MutexLock lock(&mu_);
        broken_ = true;
        return absl::UnavailableError(absl::StrCat("state store: ", error.message()));
      }
    }
    if (next_fd < 0) return absl::OkStatus();
    // The snapshot, then the next log in place of the old one (both renames atomic; Load
    // handles a crash between them, and a directory whose fsync has not landed yet).
    absl::Status written = WriteSnapshotFile(snapshot);
    if (written.ok() && ::rename(next_path_.c_str(), wal_path_.c_str()) != 0) written = Errno("rename", next_path_);
    if (written.ok()) {
      const absl::Status dir = FsyncDir(dir_);
      if (!dir.ok()) Log(LogLevel::kWarning, "state-store", absl::StrCat("after a snapshot: ", dir.message()));
      absl::MutexLock lock(&mu_);
      ::close(wal_fd_);
      wal_fd_ = next_fd_;
      wal_size_ = next_size_;
      next_fd_ = -1;
      next_size_ = 0;
      snapshot_.clear();
      return absl::OkStatus();
    }
    // The snapshot could not be written (a full disk?): the log is durable all the same. The
    // next log's records go back into the old one, so that a later snapshot can start over.
    absl::MutexLock lock(&mu_);
    if (absl::Status merged = MergeNextBackLocked(); !merged.ok()) {
      broken_ = true;
      return absl::UnavailableError(absl::StrCat("state store: after a failed snapshot (", written.message(),
                                                 "), the log could not be put back together: ", merged.message()));
    }
    Log(LogLevel::kWarning, "state-store",
        absl::StrCat("snapshot not written (", written.message(), "); the log keeps growing and a later snapshot "
                     "tries again"));
    return absl::OkStatus();
  }

  absl::Status Init() {
    if (::mkdir(dir_.c_str(), 0700) != 0 && errno != EEXIST) return Errno("mkdir", dir_);
    struct stat st;
    if (::stat(dir_.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
      return absl::FailedPreconditionError(absl::StrCat("state dir ", dir_, " is not a directory"));
    }
    return absl::OkStatus();
  }

 private:
  static absl::Status Broken() {
    return absl::FailedPreconditionError("state store failed earlier; restart the coordinator");
  }

  // Opens the log for appending; `truncate_to` >= 0 cuts it there first (a torn tail, or 0).
  absl::Status OpenWal(int64_t truncate_to) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (wal_fd_ >= 0) ::close(wal_fd_);
    wal_fd_ = ::open(wal_path_.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
    if (wal_fd_ < 0) return Errno("open", wal_path_);
    if (truncate_to >= 0 && (::ftruncate(wal_fd_, truncate_to) != 0 || ::fdatasync(wal_fd_) != 0)) {
      return Errno("ftruncate", wal_path_);
    }
    const off_t end = ::lseek(wal_fd_, 0, SEEK_END);
    if (end < 0) return Errno("lseek", wal_path_);
    wal_size_ = end;
    return FsyncDir(dir_);
  }

  // snapshot.tmp, fsync, renamed over snapshot, the directory fsynced.
  absl::Status WriteSnapshotFile(const std::string& payload) {
    const std::string tmp = snapshot_path_ + ".tmp";
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return Errno("open", tmp);
    absl::Status status = WriteAll(fd, Frame(kSnapMagic, payload), tmp);
    if (status.ok() && ::fsync(fd) != 0) status = Errno("fsync", tmp);
    ::close(fd);
    if (status.ok() && ::rename(tmp.c_str(), snapshot_path_.c_str()) != 0) status = Errno("rename", tmp);
    if (status.ok()) status = FsyncDir(dir_);
    return status;
  }

  // A snapshot failed: the next log's frames are appended to the log and the next log goes.
  absl::Status MergeNextBackLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    bool exists = false;
    MAINSTAY_ASSIGN_OR_RETURN(std::string next, ReadFile(next_path_, &exists));
    next.resize(static_cast<size_t>(std::min<int64_t>(next_size_, static_cast<int64_t>(next.size()))));
    MAINSTAY_RETURN_IF_ERROR(WriteAll(wal_fd_, next, wal_path_));
    if (::fdatasync(wal_fd_) != 0) return Errno("fdatasync", wal_path_);
    wal_size_ += static_cast<int64_t>(next.size());
    ::close(next_fd_);
    next_fd_ = -1;
    next_size_ = 0;
    snapshot_.clear();
    if (::unlink(next_path_.c_str()) != 0) return Errno("unlink", next_path_);
    return FsyncDir(dir_);
  }

  const std::string dir_, wal_path_, next_path_, snapshot_path_;
  absl::Mutex mu_;  // the fds and sizes; never held across an fdatasync of the logs
  int wal_fd_ ABSL_GUARDED_BY(mu_) = -1;
  int64_t wal_size_ ABSL_GUARDED_BY(mu_) = 0;
  int next_fd_ ABSL_GUARDED_BY(mu_) = -1;  // >= 0 while a snapshot is being written
  int64_t next_size_ ABSL_GUARDED_BY(mu_) = 0;
  std::string snapshot_ ABSL_GUARDED_BY(mu_);  // the started snapshot, serialized
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

std::unique_ptr<StateStore> NewMemoryStateStore() { return std::make_unique<MemoryStateStore>(); }

absl::StatusOr<std::unique_ptr<StateStore>> OpenFileStateStore(const std::string& dir) {
  if (dir.empty()) return absl::InvalidArgumentError("state_dir: must not be empty");
  auto store = std::make_unique<FileStateStore>(dir);
  MAINSTAY_RETURN_IF_ERROR(store->Init());
  return std::unique_ptr<StateStore>(std::move(store));
}

}  // namespace mainstay::coordinator
