// The checkpoint's files (proto/mainstay/v1/checkpoint.proto, docs/checkpoints.md): data files
// written by the daemons, one per (bucket, shard), and the MANIFEST the coordinator commits
// last. Every file is written through CheckpointFs::AtomicWriter, so it appears whole or not
// at all; the manifest's presence is what makes a checkpoint loadable.
//
// Integrity: a data file starts with an 8-byte magic; each section carries the CRC-32C of its
// bytes and each file that of the whole file. The manifest is framed as
// "MSTYMAN1" | u64 length | CheckpointManifest bytes | u32 CRC-32C of those bytes (little
// endian). Anything that does not match is DATA_LOSS naming the file and what is wrong;
// nothing is ever returned from a damaged file.
//
// Thread safety: free functions are thread-safe; a CheckpointReader is used by one thread.
#ifndef MAINSTAY_SERVER_CHECKPOINT_CHECKPOINT_FILES_H_
#define MAINSTAY_SERVER_CHECKPOINT_CHECKPOINT_FILES_H_

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/job_spec.h"
#include "mainstay/v1/checkpoint.pb.h"
#include "server/checkpoint/checkpoint_fs.h"

namespace mainstay::checkpoint {

inline constexpr char kManifestName[] = "MANIFEST";

std::string DataFileName(int32_t bucket, int32_t shard);
inline std::string JoinPath(const std::string& dir, const std::string& name) { return dir + "/" + name; }
// OK when `path` is `root` or lies below it, compared lexically: INVALID_ARGUMENT naming `what`
// for a path elsewhere, one with a ".." component, or an empty `root` (no checkpoint directory
// configured). Symbolic links inside `root` are not resolved: the directory is the operator's.
absl::Status CheckPathUnder(const std::string& root, const std::string& path, absl::string_view what);

// One tensor fragment's optimizer state, to be written.
struct SectionData {
  std::string tensor_name;
  int64_t begin = 0, end = 0;          // elements of the flattened tensor
  std::span<const float> master;       // end - begin elements
  std::span<const uint8_t> m, v;       // raw moments; v empty without a second moment
};

// Writes dir/DataFileName(bucket, shard) atomically and describes it for the manifest.
absl::StatusOr<v1::CheckpointFile> WriteDataFile(CheckpointFs& fs, const std::string& dir, int32_t bucket,
                                                 int32_t shard, const std::vector<SectionData>& sections);

absl::Status WriteManifest(CheckpointFs& fs, const std::string& dir, const v1::CheckpointManifest& manifest);
// NOT_FOUND when dir has no manifest (not a committed checkpoint); DATA_LOSS when it is damaged.
absl::StatusOr<v1::CheckpointManifest> ReadManifest(CheckpointFs& fs, const std::string& dir);

// Reads every data file whole and checks its size and CRC against the manifest. Returns the
// total bytes checked. DATA_LOSS naming the first bad file.
absl::StatusOr<int64_t> VerifyDataFiles(CheckpointFs& fs, const std::string& dir,
                                        const v1::CheckpointManifest& manifest);

// OK when the checkpoint can be restored into `job`: the same tensors by name and element
// count (order, shapes' factoring, D, layout and formats may differ), the same optimizer and
// moment type. INVALID_ARGUMENT naming the first mismatch otherwise.
absl::Status CheckFitsJob(const ResolvedJob& job, const v1::CheckpointManifest& manifest);

// Model-space reads from a committed checkpoint: any element range of any tensor, whatever
// layout wrote it. Each section it touches is read whole and its CRC checked.
class CheckpointReader {
 public:
  // `moment_bytes`: bytes per moment element in the files (from manifest.moment_type).
  CheckpointReader(CheckpointFs& fs, std::string dir, v1::CheckpointManifest manifest);

  const v1::CheckpointManifest& manifest() const { return manifest_; }
  int moment_bytes() const { return moment_bytes_; }

  // Fills elements [begin, end) of `tensor`: master (end - begin floats) and the raw moments
  // (m and v: (end - begin) * moment_bytes() bytes each; v ignored without a second moment).
  // DATA_LOSS when a section is damaged or the checkpoint does not cover the whole range;
  // NOT_FOUND when it has no such tensor; the outputs' contents are then unspecified. The
  // wanted bytes of each section are read straight into the outputs (no staging copy); the
  // rest of a section partly inside the range is read only for its CRC.
  absl::Status ReadRange(const std::string& tensor, int64_t begin, int64_t end, float* master, uint8_t* m,
                         uint8_t* v);

 private:
  struct Located {
    const v1::CheckpointFile* file;
    const v1::CheckpointSection* section;
  };
  CheckpointFs& fs_;
  const std::string dir_;
  const v1::CheckpointManifest manifest_;
  int moment_bytes_ = 4;
  std::map<std::string, std::vector<Located>> by_tensor_;  // sorted by begin
  std::vector<uint8_t> chunk_;  // the bytes of a section read only for its CRC, a chunk at a time
};

}  // namespace mainstay::checkpoint

#endif  // MAINSTAY_SERVER_CHECKPOINT_CHECKPOINT_FILES_H_
