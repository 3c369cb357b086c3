#include "server/checkpoint/checkpoint_files.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/crc32c.h"
#include "common/layout_proto.h"
#include "common/status.h"

namespace mainstay::checkpoint {
namespace {

constexpr char kDataMagic[8] = {'M', 'S', 'T', 'Y', 'D', 'A', 'T', '1'};
constexpr char kManifestMagic[8] = {'M', 'S', 'T', 'Y', 'M', 'A', 'N', '1'};
constexpr int64_t kMaxManifestBytes = int64_t{1} << 30;
constexpr size_t kVerifyChunk = size_t{8} << 20;

std::span<const uint8_t> Bytes(const void* p, size_t n) { return {static_cast<const uint8_t*>(p), n}; }

void PutLe(std::vector<uint8_t>& out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<uint8_t>(value >> (8 * i)));
}

uint64_t GetLe(const uint8_t* p, int bytes) {
  uint64_t value = 0;
  for (int i = 0; i < bytes; ++i) value |= static_cast<uint64_t>(p[i]) << (8 * i);
  return value;
}

int MomentBytes(v1::ElementType type) { return type == v1::ELEMENT_TYPE_BF16 ? 2 : 4; }

}  // namespace

absl::Status CheckPathUnder(const std::string& root, const std::string& path, absl::string_view what) {
  if (root.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(what, " '", path, "': the coordinator has no --checkpoint-dir, "
                                                   "so this daemon reads and writes no checkpoint"));
  }
  std::string base = root;
  while (base.size() > 1 && base.back() == '/') base.pop_back();
  for (absl::string_view part : absl::StrSplit(path, '/')) {
    if (part == "..") {
      return absl::InvalidArgumentError(absl::StrCat(what, " '", path, "' has a '..' component"));
    }
  }
  const bool under = path == base || (base == "/" ? !path.empty() && path[0] == '/'
                                                  : absl::StartsWith(path, base + "/"));
  if (!under) {
    return absl::InvalidArgumentError(absl::StrCat(what, " '", path, "' is outside the checkpoint directory '",
                                                   base, "'"));
  }
  return absl::OkStatus();
}

std::string DataFileName(int32_t bucket, int32_t shard) { return absl::StrCat("b", bucket, ".s", shard, ".state"); }

absl::StatusOr<v1::CheckpointFile> WriteDataFile(CheckpointFs& fs, const std::string& dir, int32_t bucket,
                                                 int32_t shard, const std::vector<SectionData>& sections) {
  v1::CheckpointFile file;
  file.set_path(DataFileName(bucket, shard));
  file.mutable_shard()->set_bucket(bucket);
  file.mutable_shard()->set_shard(shard);
  const std::string path = JoinPath(dir, file.path());
  MAINSTAY_ASSIGN_OR_RETURN(std::unique_ptr<AtomicWriter> writer, fs.NewAtomicWriter(path));
  int64_t offset = sizeof(kDataMagic);
  uint32_t file_crc = Crc32c(kDataMagic, sizeof(kDataMagic));
  MAINSTAY_RETURN_IF_ERROR(writer->Append(Bytes(kDataMagic, sizeof(kDataMagic))));
  for (const SectionData& s : sections) {
    const size_t n = static_cast<size_t>(s.end - s.begin);
    if (s.master.size() != n || s.m.size() % n != 0 || (!s.v.empty() && s.v.size() != s.m.size())) {
      return absl::InternalError(absl::StrCat("checkpoint section of ", s.tensor_name, " has inconsistent sizes"));
    }
    v1::CheckpointSection& section = *file.add_sections();
    section.set_tensor_name(s.tensor_name);
    section.set_begin(s.begin);
    section.set_end(s.end);
    section.set_offset(offset);
    uint32_t crc = 0;
    for (std::span<const uint8_t> part : {Bytes(s.master.data(), n * 4), s.m, s.v}) {
      if (part.empty()) continue;
      crc = Crc32cExtend(crc, part.data(), part.size());
      file_crc = Crc32cExtend(file_crc, part.data(), part.size());
      MAINSTAY_RETURN_IF_ERROR(writer->Append(part));
      offset += static_cast<int64_t>(part.size());
    }
    section.set_crc32c(crc);
  }
  MAINSTAY_RETURN_IF_ERROR(writer->Commit());
  file.set_size_bytes(offset);
  file.set_crc32c(file_crc);
  return file;
}

absl::Status WriteManifest(CheckpointFs& fs, const std::string& dir, const v1::CheckpointManifest& manifest) {
  std::string payload;
  if (!manifest.SerializeToString(&payload)) return absl::InternalError("cannot serialize the checkpoint manifest");
  std::vector<uint8_t> framed(kManifestMagic, kManifestMagic + sizeof(kManifestMagic));
  PutLe(framed, payload.size(), 8);
  framed.insert(framed.end(), payload.begin(), payload.end());
  PutLe(framed, Crc32c(payload.data(), payload.size()), 4);
  MAINSTAY_ASSIGN_OR_RETURN(std::unique_ptr<AtomicWriter> writer,
                            fs.NewAtomicWriter(JoinPath(dir, kManifestName)));
  MAINSTAY_RETURN_IF_ERROR(writer->Append(framed));
  return writer->Commit();
}

absl::StatusOr<v1::CheckpointManifest> ReadManifest(CheckpointFs& fs, const std::string& dir) {
  const std::string path = JoinPath(dir, kManifestName);
  absl::StatusOr<int64_t> size = fs.FileSize(path);
  if (absl::IsNotFound(size.status())) {
    return absl::NotFoundError(absl::StrCat(dir, " holds no ", kManifestName, ": not a committed checkpoint"));
  }
  MAINSTAY_RETURN_IF_ERROR(size.status());
  if (*size < 20 || *size > kMaxManifestBytes) {
    return absl::DataLossError(absl::StrCat(path, ": ", *size, " bytes is not a manifest (truncated?)"));
  }
  std::vector<uint8_t> bytes(static_cast<size_t>(*size));
  MAINSTAY_RETURN_IF_ERROR(fs.ReadAt(path, 0, bytes));
  if (std::memcmp(bytes.data(), kManifestMagic, sizeof(kManifestMagic)) != 0) {
    return absl::DataLossError(absl::StrCat(path, ": bad magic, not a Mainstay manifest"));
  }
  const uint64_t length = GetLe(bytes.data() + 8, 8);
  if (length != bytes.size() - 20) {
    return absl::DataLossError(absl::StrCat(path, ": the frame says ", length, " payload bytes but the file holds ",
                                            bytes.size() - 20, " (truncated or appended to)"));
  }
  const uint32_t crc = static_cast<uint32_t>(GetLe(bytes.data() + 16 + length, 4));
  if (Crc32c(bytes.data() + 16, length) != crc) {
    return absl::DataLossError(absl::StrCat(path, ": CRC-32C mismatch (the manifest is corrupt)"));
  }
  v1::CheckpointManifest manifest;
  if (!manifest.ParseFromArray(bytes.data() + 16, static_cast<int>(length))) {
    return absl::DataLossError(absl::StrCat(path, ": the payload does not parse"));
  }
  return manifest;
}

absl::StatusOr<int64_t> VerifyDataFiles(CheckpointFs& fs, const std::string& dir,
                                        const v1::CheckpointManifest& manifest) {
  int64_t total = 0;
  std::vector<uint8_t> buffer;
  for (const v1::CheckpointFile& file : manifest.files()) {
    const std::string path = JoinPath(dir, file.path());
    absl::StatusOr<int64_t> size = fs.FileSize(path);
    if (!size.ok()) return absl::DataLossError(absl::StrCat(path, ": ", size.status().message()));
    if (*size != file.size_bytes()) {
      return absl::DataLossError(absl::StrCat(path, ": ", *size, " bytes but the manifest says ", file.size_bytes(),
                                              " (truncated or replaced)"));
    }
    uint32_t crc = 0;
    for (int64_t at = 0; at < *size;) {
      const size_t n = static_cast<size_t>(std::min<int64_t>(*size - at, static_cast<int64_t>(kVerifyChunk)));
      buffer.resize(n);
      absl::Status read = fs.ReadAt(path, at, buffer);
      if (!read.ok()) return absl::DataLossError(absl::StrCat(path, ": ", read.message()));
      crc = Crc32cExtend(crc, buffer.data(), n);
      at += static_cast<int64_t>(n);
    }
    if (crc != file.crc32c()) return absl::DataLossError(absl::StrCat(path, ": CRC-32C mismatch (the file is corrupt)"));
    total += *size;
  }
  return total;
}

CheckpointReader::CheckpointReader(CheckpointFs& fs, std::string dir, v1::CheckpointManifest manifest)
    : fs_(fs), dir_(std::move(dir)), manifest_(std::move(manifest)), moment_bytes_(MomentBytes(manifest_.moment_type())) {
  for (const v1::CheckpointFile& file : manifest_.files()) {
    for (const v1::CheckpointSection& section : file.sections()) {
      by_tensor_[section.tensor_name()].push_back({&file, &section});
    }
  }
  for (auto& [name, list] : by_tensor_) {
    std::sort(list.begin(), list.end(),
              [](const Located& a, const Located& b) { return a.section->begin() < b.section->begin(); });
  }
}

absl::Status CheckpointReader::ReadRange(const std::string& tensor, int64_t begin, int64_t end, float* master,
                                         uint8_t* m, uint8_t* v) {
  auto it = by_tensor_.find(tensor);
  if (it == by_tensor_.end()) {
    return absl::NotFoundError(absl::StrCat("checkpoint ", manifest_.checkpoint_id(), " has no tensor '", tensor, "'"));
  }
  const bool has_v = manifest_.has_second_moment();
  const int mb = moment_bytes_;
  int64_t covered = begin;  // every element before this one is filled
  for (const Located& at : it->second) {
    const v1::CheckpointSection& s = *at.section;
    if (s.end() <= covered || s.begin() >= end) continue;
    if (s.begin() > covered) break;  // a gap
    const int64_t n = s.end() - s.begin();
    const std::string path = JoinPath(dir_, at.file->path());
    const int64_t from = std::max(covered, s.begin());
    const int64_t to = std::min(end, s.end());
    const size_t k = static_cast<size_t>(to - from);
    const size_t dst = static_cast<size_t>(from - begin);
    // The section is read once, in file order, for its CRC: the wanted elements of each part
    // (master, m, v) straight into the outputs, the others through a small chunk buffer.
    const size_t src = static_cast<size_t>(from - s.begin());
    struct Part {
      size_t elem_bytes;
      uint8_t* out;  // where element `from` goes; null: not wanted (SGD's absent v)
    };
    const Part parts[3] = {{4, reinterpret_cast<uint8_t*>(master + dst)},
                           {static_cast<size_t>(mb), m + dst * static_cast<size_t>(mb)},
                           {has_v ? static_cast<size_t>(mb) : 0, v == nullptr ? nullptr : v + dst * static_cast<size_t>(mb)}};
    uint32_t crc = 0;
    int64_t offset = s.offset();
    auto read = [&](size_t bytes, uint8_t* out) -> absl::Status {
      for (size_t done = 0; done < bytes;) {
        const size_t step = out != nullptr ? bytes - done : std::min(bytes - done, kVerifyChunk);
        if (out == nullptr) chunk_.resize(std::max(chunk_.size(), step));
        uint8_t* into = out != nullptr ? out + done : chunk_.data();
        absl::Status status = fs_.ReadAt(path, offset, std::span<uint8_t>(into, step));
        if (!status.ok()) return absl::DataLossError(absl::StrCat(path, ": ", status.message()));
        crc = Crc32cExtend(crc, into, step);
        offset += static_cast<int64_t>(step);
        done += step;
      }
      return absl::OkStatus();
    };
    for (const Part& p : parts) {
      if (p.elem_bytes == 0) continue;
      MAINSTAY_RETURN_IF_ERROR(read(src * p.elem_bytes, nullptr));
      MAINSTAY_RETURN_IF_ERROR(read(k * p.elem_bytes, p.out));
      MAINSTAY_RETURN_IF_ERROR(read((static_cast<size_t>(n) - src - k) * p.elem_bytes, nullptr));
    }
    if (crc != s.crc32c()) {
      return absl::DataLossError(absl::StrCat(path, ": CRC-32C mismatch in the section of ", tensor, " [", s.begin(),
                                              ", ", s.end(), ") (the file is corrupt)"));
    }
    covered = to;
    if (covered >= end) break;
  }
  if (covered < end) {
    return absl::DataLossError(absl::StrCat("checkpoint ", manifest_.checkpoint_id(), " does not cover elements [",
                                            covered, ", ", end, ") of tensor '", tensor, "' (a data file is missing)"));
  }
  return absl::OkStatus();
}

absl::Status CheckFitsJob(const ResolvedJob& job, const v1::CheckpointManifest& manifest) {
  const std::string id = manifest.checkpoint_id();
  std::map<std::string, int64_t> saved;  // name -> numel
  for (const v1::TensorSpec& t : manifest.spec().tensors()) {
    int64_t numel = 1;
    for (int64_t d : t.shape()) numel *= d;
    saved[t.name()] = numel;
  }
  for (const LayoutTensor& t : job.layout.tensors) {
    auto it = saved.find(t.name);
    if (it == saved.end()) {
      return absl::InvalidArgumentError(absl::StrCat("checkpoint ", id, " has no tensor '", t.name, "' of this job"));
    }
    if (it->second != t.numel) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "' has ", t.numel,
                                                     " elements in this job but ", it->second, " in checkpoint ", id));
    }
    saved.erase(it);
  }
  if (!saved.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint ", id, " has tensor '", saved.begin()->first,
                                                   "' that this job does not (", saved.size(), " in all)"));
  }
  const OptimizerSpec& opt = job.spec.optimizer;
  if (ElementTypeToProto(opt.moment_dtype) != manifest.moment_type()) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint ", id, " keeps moments as ",
                                                   v1::ElementType_Name(manifest.moment_type()), " but this job as ",
                                                   ElementTypeName(opt.moment_dtype)));
  }
  if ((opt.type == OptimizerType::kAdamW) != manifest.has_second_moment()) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint ", id, " was written by ",
                                                   manifest.has_second_moment() ? "AdamW" : "SGD",
                                                   "; this job's optimizer differs"));
  }
  return absl::OkStatus();
}

}  // namespace mainstay::checkpoint
