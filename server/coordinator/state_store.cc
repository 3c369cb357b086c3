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
  absl::StatusOr<v1::CoordinatorState> Load() override { return state_.ToProto(); }
  absl::Status Append(const v1::StateBatch& batch) override {
    state_.Apply(batch);
    return absl::OkStatus();
  }
  absl::Status WriteSnapshot(const v1::CoordinatorState& state) override {
    state_ = State::FromProto(state);
    return absl::OkStatus();
  }

 private:
  State state_;
};

class FileStateStore : public StateStore {
 public:
  explicit FileStateStore(std::string dir)
      : dir_(std::move(dir)), wal_path_(dir_ + "/wal"), snapshot_path_(dir_ + "/snapshot") {}
  ~FileStateStore() override {
    if (wal_fd_ >= 0) ::close(wal_fd_);
  }

  absl::StatusOr<v1::CoordinatorState> Load() override {
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
    // Per Load: a torn tail cut off by an earlier Load must not cut later appends again.
    int64_t torn_tail_at = -1;
    size_t offset = 0;
    while (offset < wal.size()) {
      uint32_t header[3] = {0, 0, 0};
      const bool header_ok = wal.size() - offset >= kHeader;
      if (header_ok) std::memcpy(header, wal.data() + offset, kHeader);
      const bool fits = header_ok && header[0] == kWalMagic && header[1] <= kMaxFrame &&
                        wal.size() - offset - kHeader >= header[1];
      v1::StateBatch batch;
      const bool valid = fits && header[2] == Crc32(wal.data() + offset + kHeader, header[1]) &&
                         batch.ParseFromArray(wal.data() + offset + kHeader, static_cast<int>(header[1]));
      if (!valid) {
        // Only an append cut short by a crash is a torn tail (never acknowledged: appends are
        // fdatasync'ed before they are answered): the final record's header or payload runs
        // past the end of the file, or the file was extended with zeros that were never
        // written. Anything else (a bad magic, length or checksum of a complete record) is
        // corruption of acknowledged data: refuse to start rather than drop it silently.
        const bool short_header = !header_ok;
        const bool short_payload = header_ok && header[0] == kWalMagic && header[1] <= kMaxFrame && !fits;
        const bool zero_tail = std::all_of(wal.begin() + static_cast<std::ptrdiff_t>(offset), wal.end(),
                                           [](char c) { return c == 0; });
        if (!short_header && !short_payload && !zero_tail) {
          return absl::DataLossError(absl::StrCat(
              wal_path_, ": corrupt record at byte ", offset, " of ", wal.size(), " (",
              header[0] != kWalMagic ? "bad magic" : header[1] > kMaxFrame ? "bad length" : "bad checksum",
              "); it is not a torn final append, so the coordinator refuses to start rather than lose "
              "acknowledged changes (restore the state directory from a backup)"));
        }
        torn_tail_at = static_cast<int64_t>(offset);
        break;
      }
      if (batch.sequence() > state.sequence) state.Apply(batch);
      offset += kHeader + header[1];
    }
    MAINSTAY_RETURN_IF_ERROR(OpenWal(torn_tail_at >= 0 ? torn_tail_at : static_cast<int64_t>(wal.size())));
    return state.ToProto();
  }

  absl::Status Append(const v1::StateBatch& batch) override {
    if (broken_) return absl::FailedPreconditionError("state store failed earlier; restart the coordinator");
    if (wal_fd_ < 0) MAINSTAY_RETURN_IF_ERROR(OpenWal(-1));
    const std::string frame = Frame(kWalMagic, batch.SerializeAsString());
    absl::Status status = WriteAll(wal_fd_, frame, wal_path_);
    if (status.ok() && ::fdatasync(wal_fd_) != 0) status = Errno("fdatasync", wal_path_);
    if (!status.ok()) {
      // Take the partial frame back so a later Load cannot replay a batch we reported failed.
      if (::ftruncate(wal_fd_, wal_size_) != 0 || ::lseek(wal_fd_, wal_size_, SEEK_SET) < 0) broken_ = true;
      return absl::UnavailableError(absl::StrCat("state store: ", status.message()));
    }
    wal_size_ += static_cast<int64_t>(frame.size());
    return absl::OkStatus();
  }

  absl::Status WriteSnapshot(const v1::CoordinatorState& state) override {
    const std::string tmp = snapshot_path_ + ".tmp";
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return Errno("open", tmp);
    absl::Status status = WriteAll(fd, Frame(kSnapMagic, state.SerializeAsString()), tmp);
    if (status.ok() && ::fsync(fd) != 0) status = Errno("fsync", tmp);
    ::close(fd);
    if (status.ok() && ::rename(tmp.c_str(), snapshot_path_.c_str()) != 0) status = Errno("rename", tmp);
    if (status.ok()) status = FsyncDir(dir_);
    if (!status.ok()) return status;
    // Batches up to state.sequence() are in the snapshot; Load skips them, so a crash before
    // this truncation is harmless.
    if (wal_fd_ >= 0 && (::ftruncate(wal_fd_, 0) != 0 || ::lseek(wal_fd_, 0, SEEK_SET) < 0 || ::fsync(wal_fd_) != 0)) {
      broken_ = true;
      return Errno("truncate", wal_path_);
    }
    wal_size_ = 0;
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
  // Opens the log for appending; `truncate_to` >= 0 cuts a torn tail first.
  absl::Status OpenWal(int64_t truncate_to) {
    if (wal_fd_ >= 0) ::close(wal_fd_);
    wal_fd_ = ::open(wal_path_.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
    if (wal_fd_ < 0) return Errno("open", wal_path_);
    if (truncate_to >= 0 && ::ftruncate(wal_fd_, truncate_to) != 0) return Errno("ftruncate", wal_path_);
    const off_t end = ::lseek(wal_fd_, 0, SEEK_END);
    if (end < 0) return Errno("lseek", wal_path_);
    wal_size_ = end;
    return FsyncDir(dir_);
  }

  const std::string dir_, wal_path_, snapshot_path_;
  int wal_fd_ = -1;
  int64_t wal_size_ = 0;
  bool broken_ = false;
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
