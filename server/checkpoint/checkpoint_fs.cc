#include "server/checkpoint/checkpoint_fs.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace mainstay::checkpoint {
namespace {

absl::Status Errno(const std::string& what, const std::string& path, int err) {
  const std::string message = absl::StrCat(what, " ", path, ": ", std::strerror(err));
  if (err == ENOENT) return absl::NotFoundError(message);
  if (err == ENOSPC || err == EDQUOT) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

std::string Parent(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

absl::Status SyncDir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Errno("open directory", dir, errno);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return Errno("fsync directory", dir, err);
  return absl::OkStatus();
}

class PosixWriter : public AtomicWriter {
 public:
  PosixWriter(std::string path, int fd) : path_(std::move(path)), tmp_(path_ + ".tmp"), fd_(fd) {}
  ~PosixWriter() override {
    if (fd_ >= 0) {
      ::close(fd_);
      ::unlink(tmp_.c_str());
    }
  }
  absl::Status Append(std::span<const uint8_t> data) override {
    if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat("writer of ", path_, " is spent"));
    const uint8_t* p = data.data();
    size_t left = data.size();
    while (left > 0) {
      const ssize_t n = ::write(fd_, p, std::min<size_t>(left, size_t{1} << 30));
      if (n < 0) {
        if (errno == EINTR) continue;
        return Errno("write", tmp_, errno);
      }
      p += n;
      left -= static_cast<size_t>(n);
    }
    return absl::OkStatus();
  }
  absl::Status Commit() override {
    if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat("writer of ", path_, " is spent"));
    if (::fsync(fd_) != 0) return Errno("fsync", tmp_, errno);
    if (::close(fd_) != 0) {
      fd_ = -1;
      ::unlink(tmp_.c_str());
      return Errno("close", tmp_, errno);
    }
    fd_ = -1;
    if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
      const int err = errno;
      ::unlink(tmp_.c_str());
      return Errno("rename to", path_, err);
    }
    return SyncDir(Parent(path_));
  }

 private:
  const std::string path_, tmp_;
  int fd_;
};

class PosixCheckpointFs : public CheckpointFs {
 public:
  absl::StatusOr<std::unique_ptr<AtomicWriter>> NewAtomicWriter(const std::string& path) override {
    const std::string tmp = path + ".tmp";
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0640);
    if (fd < 0) return Errno("create", tmp, errno);
    return std::unique_ptr<AtomicWriter>(new PosixWriter(path, fd));
  }
  absl::Status CreateDirs(const std::string& path) override {
    // The directories made here are fsynced into their parents: a checkpoint whose manifest
    // was committed must not vanish with its directory's entry in a crash, after retention
    // deleted the older ones.
    std::vector<std::string> made;
    for (std::filesystem::path p(path); !p.empty() && !std::filesystem::exists(p); p = p.parent_path()) {
      made.push_back(p.string());
      if (p == p.parent_path()) break;
    }
    std::error_code ec;
    std::filesystem::create_directories(path, ec);
    if (ec) return Errno("create directory", path, ec.value());
    for (const std::string& dir : made) MAINSTAY_RETURN_IF_ERROR(SyncDir(Parent(dir)));
    return absl::OkStatus();
  }
  absl::StatusOr<int64_t> FileSize(const std::string& path) override {
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) return Errno("stat", path, errno);
    return static_cast<int64_t>(st.st_size);
  }
  absl::Status ReadAt(const std::string& path, int64_t offset, std::span<uint8_t> out) override {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return Errno("open", path, errno);
    size_t done = 0;
    absl::Status status;
    while (done < out.size()) {
      const ssize_t n = ::pread(fd, out.data() + done, std::min<size_t>(out.size() - done, size_t{1} << 30),
                                static_cast<off_t>(offset + static_cast<int64_t>(done)));
      if (n < 0) {
        if (errno == EINTR) continue;
        status = Errno("read", path, errno);
        break;
      }
      if (n == 0) {
        status = absl::DataLossError(absl::StrCat(path, " ends at byte ", offset + static_cast<int64_t>(done),
                                                  " but ", offset + static_cast<int64_t>(out.size()), " are needed"));
        break;
      }
      done += static_cast<size_t>(n);
    }
    ::close(fd);
    return status;
  }
  absl::StatusOr<std::vector<std::string>> ListDir(const std::string& path) override {
    DIR* dir = ::opendir(path.c_str());
    if (dir == nullptr) return Errno("list", path, errno);
    std::vector<std::string> names;
    while (const dirent* e = ::readdir(dir)) {
      const std::string name = e->d_name;
      if (name != "." && name != "..") names.push_back(name);
    }
    ::closedir(dir);
    std::sort(names.begin(), names.end());
    return names;
  }
  absl::Status RemoveAll(const std::string& path) override {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
    if (ec) return Errno("remove", path, ec.value());
    return absl::OkStatus();
  }
};

}  // namespace

CheckpointFs* PosixFs() {
  static CheckpointFs* fs = new PosixCheckpointFs();
  return fs;
}

// ---- MemFs

class MemWriter : public AtomicWriter {
 public:
  MemWriter(MemFs* fs, std::string path) : fs_(fs), path_(std::move(path)) {}
  absl::Status Append(std::span<const uint8_t> data) override {
    absl::MutexLock lock(&fs_->mu_);
    if (fs_->write_budget_ >= 0) {
      if (static_cast<int64_t>(data.size()) > fs_->write_budget_) {
        fs_->write_budget_ = 0;
        return absl::ResourceExhaustedError(absl::StrCat("write ", path_, ".tmp: No space left on device (fake)"));
      }
      fs_->write_budget_ -= static_cast<int64_t>(data.size());
    }
    bytes_.insert(bytes_.end(), data.begin(), data.end());
    return absl::OkStatus();
  }
  absl::Status Commit() override {
    absl::MutexLock lock(&fs_->mu_);
    fs_->files_[path_] = std::move(bytes_);
    return absl::OkStatus();
  }

 private:
  MemFs* fs_;
  std::string path_;
  std::vector<uint8_t> bytes_;
};

absl::StatusOr<std::unique_ptr<AtomicWriter>> MemFs::NewAtomicWriter(const std::string& path) {
  return std::unique_ptr<AtomicWriter>(new MemWriter(this, path));
}

absl::Status MemFs::CreateDirs(const std::string&) { return absl::OkStatus(); }

absl::StatusOr<int64_t> MemFs::FileSize(const std::string& path) {
  absl::MutexLock lock(&mu_);
  auto it = files_.find(path);
  if (it == files_.end()) return absl::NotFoundError(absl::StrCat("stat ", path, ": No such file (fake)"));
  return static_cast<int64_t>(it->second.size());
}

absl::Status MemFs::ReadAt(const std::string& path, int64_t offset, std::span<uint8_t> out) {
  absl::MutexLock lock(&mu_);
  auto it = files_.find(path);
  if (it == files_.end()) return absl::NotFoundError(absl::StrCat("open ", path, ": No such file (fake)"));
  if (offset < 0 || offset + static_cast<int64_t>(out.size()) > static_cast<int64_t>(it->second.size())) {
    return absl::DataLossError(absl::StrCat(path, " ends at byte ", it->second.size(), " but ",
                                            offset + static_cast<int64_t>(out.size()), " are needed"));
  }
  std::memcpy(out.data(), it->second.data() + offset, out.size());
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> MemFs::ListDir(const std::string& path) {
  absl::MutexLock lock(&mu_);
  const std::string prefix = path + "/";
  std::vector<std::string> names;
  for (const auto& [name, bytes] : files_) {
    if (!absl::StartsWith(name, prefix)) continue;
    const std::string rest = name.substr(prefix.size());
    const std::string first = rest.substr(0, rest.find('/'));
    if (names.empty() || names.back() != first) names.push_back(first);
  }
  if (names.empty()) return absl::NotFoundError(absl::StrCat("list ", path, ": No such directory (fake)"));
  return names;
}

absl::Status MemFs::RemoveAll(const std::string& path) {
  absl::MutexLock lock(&mu_);
  for (auto it = files_.begin(); it != files_.end();) {
    if (it->first == path || absl::StartsWith(it->first, path + "/")) {
      it = files_.erase(it);
    } else {
      ++it;
    }
  }
  return absl::OkStatus();
}

void MemFs::FailWritesAfter(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  write_budget_ = bytes;
}

void MemFs::Corrupt(const std::string& path, int64_t offset) {
  absl::MutexLock lock(&mu_);
  files_.at(path).at(static_cast<size_t>(offset)) ^= 0x10;
}

void MemFs::Truncate(const std::string& path, int64_t size) {
  absl::MutexLock lock(&mu_);
  files_.at(path).resize(static_cast<size_t>(size));
}

bool MemFs::Exists(const std::string& path) {
  absl::MutexLock lock(&mu_);
  return files_.count(path) > 0;
}

}  // namespace mainstay::checkpoint
