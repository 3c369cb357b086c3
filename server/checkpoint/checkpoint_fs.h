// The file system checkpoints are written to and read from (DESIGN.md section 8), behind an
// interface so tests can use an in-memory fake that fails on demand (leveldb's Env).
//
// Paths are plain strings joined with '/'. Every file is written whole through an
// AtomicWriter: the bytes go to "<path>.tmp", Commit() fsyncs it, renames it over <path> and
// fsyncs the directory, so a reader sees either no file or the complete one. A writer
// destroyed without Commit() removes its temporary file.
//
// Errors: NOT_FOUND for a missing file or directory, DATA_LOSS for a file shorter than a read
// asks for, INTERNAL (with errno's text and the path) for anything the OS refuses.
// Thread safety: implementations are thread-safe; a writer is used by one thread.
#ifndef MAINSTAY_SERVER_CHECKPOINT_CHECKPOINT_FS_H_
#define MAINSTAY_SERVER_CHECKPOINT_CHECKPOINT_FS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace mainstay::checkpoint {

class AtomicWriter {
 public:
  virtual ~AtomicWriter() = default;
  virtual absl::Status Append(std::span<const uint8_t> data) = 0;
  // fsync, rename into place, fsync the directory. The writer is spent afterwards.
  virtual absl::Status Commit() = 0;
};

class CheckpointFs {
 public:
  virtual ~CheckpointFs() = default;
  virtual absl::StatusOr<std::unique_ptr<AtomicWriter>> NewAtomicWriter(const std::string& path) = 0;
  virtual absl::Status CreateDirs(const std::string& path) = 0;
  virtual absl::StatusOr<int64_t> FileSize(const std::string& path) = 0;
  // Fills `out` from `offset`; DATA_LOSS when the file ends first.
  virtual absl::Status ReadAt(const std::string& path, int64_t offset, std::span<uint8_t> out) = 0;
  // Names (not paths) of the entries of a directory, sorted.
  virtual absl::StatusOr<std::vector<std::string>> ListDir(const std::string& path) = 0;
  // Removes a file or a directory tree; OK when it does not exist.
  virtual absl::Status RemoveAll(const std::string& path) = 0;
};

// The real file system (POSIX calls). A process-wide instance; never deleted.
CheckpointFs* PosixFs();

// An in-memory file system for tests. `FailWritesAfter(n)` makes every Append fail once n more
// bytes have been written (a full disk); `Corrupt` flips a byte of a committed file.
class MemFs : public CheckpointFs {
 public:
  absl::StatusOr<std::unique_ptr<AtomicWriter>> NewAtomicWriter(const std::string& path) override;
  absl::Status CreateDirs(const std::string& path) override;
  absl::StatusOr<int64_t> FileSize(const std::string& path) override;
  absl::Status ReadAt(const std::string& path, int64_t offset, std::span<uint8_t> out) override;
  absl::StatusOr<std::vector<std::string>> ListDir(const std::string& path) override;
  absl::Status RemoveAll(const std::string& path) override;

  void FailWritesAfter(int64_t bytes);
  void Corrupt(const std::string& path, int64_t offset);
  void Truncate(const std::string& path, int64_t size);
  bool Exists(const std::string& path);

 private:
  friend class MemWriter;
  absl::Mutex mu_;
  std::map<std::string, std::vector<uint8_t>> files_ ABSL_GUARDED_BY(mu_);
  int64_t write_budget_ ABSL_GUARDED_BY(mu_) = -1;  // -1: unlimited
};

}  // namespace mainstay::checkpoint

#endif  // MAINSTAY_SERVER_CHECKPOINT_CHECKPOINT_FS_H_
