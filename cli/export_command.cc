// mainstayctl export: one published version of a job, written as safetensors files in model
// space (docs/weight_serving.md, "Export"). The version is pulled like a reader pulls it (the
// job's reader token, every daemon in parallel, pinned while it is read), then written to
// temporary files that are renamed into place once complete.
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cli/command.h"
#include "cli/coordinator_client.h"
#include "common/status.h"
#include "mainstay/client.h"
#include "mainstay/published.h"

namespace mainstay::cli {
namespace {

// One safetensors file: an 8-byte little-endian header length, the JSON header (padded with
// spaces to a multiple of 8), then the tensors' bytes back to back in header order.
class SafetensorsFile {
 public:
  void Add(NamedTensor t) {
    bytes_ += static_cast<int64_t>(t.bytes().size());
    tensors_.push_back(std::move(t));
  }
  int64_t bytes() const { return bytes_; }
  bool empty() const { return tensors_.empty(); }
  const std::vector<NamedTensor>& tensors() const { return tensors_; }

  // Writes `path` through `path`.tmp and a rename: a failed export leaves no partial file.
  absl::Status Write(const std::filesystem::path& path, const std::map<std::string, std::string>& metadata) const {
    nlohmann::ordered_json header;
    header["__metadata__"] = metadata;
    int64_t offset = 0;
    for (const NamedTensor& t : tensors_) {
      const int64_t end = offset + static_cast<int64_t>(t.bytes().size());
      header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, end}}};
      offset = end;
    }
    std::string text = header.dump();
    text.append((8 - text.size() % 8) % 8, ' ');
    const std::filesystem::path tmp = path.string() + ".tmp";
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      if (!out) return absl::FailedPreconditionError(absl::StrCat("cannot write ", tmp.string(), ": ", std::strerror(errno)));
      uint8_t length[8];
      const uint64_t n = text.size();
      for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(n >> (8 * i));
      out.write(reinterpret_cast<const char*>(length), 8);
      out.write(text.data(), static_cast<std::streamsize>(text.size()));
      for (const NamedTensor& t : tensors_) {
        const std::span<const uint8_t> bytes = t.bytes();
        out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
      }
      out.flush();
      if (!out) {
        std::filesystem::remove(tmp);
        return absl::DataLossError(absl::StrCat("writing ", tmp.string(), " failed: ", std::strerror(errno)));
      }
    }
    std::error_code ec;
    std::filesystem::rename(tmp, path, ec);
    if (ec) return absl::FailedPreconditionError(absl::StrCat("renaming ", tmp.string(), ": ", ec.message()));
    return absl::OkStatus();
  }

 private:
  std::vector<NamedTensor> tensors_;
  int64_t bytes_ = 0;
};

}  // namespace

absl::Status RunExport(const Args& args, Output& output) {
  MAINSTAY_RETURN_IF_ERROR(CheckRemoteFlags(args, {"job", "version", "out", "as", "max-file-bytes", "transport"}));
  if (!args.Has("job") || !args.Has("out")) return absl::InvalidArgumentError("--job ID and --out DIR are required");
  const std::string as = args.Get("as", "published");
  if (as != "published" && as != "bf16" && as != "fp32") {
    return absl::InvalidArgumentError(absl::StrCat("--as must be published, bf16 or fp32, got '", as, "'"));
  }
  MAINSTAY_ASSIGN_OR_RETURN(const int64_t max_file_bytes, args.GetInt("max-file-bytes", int64_t{5} << 30));
  if (max_file_bytes < (1 << 20)) return absl::InvalidArgumentError("--max-file-bytes must be >= 1 MiB");
  MAINSTAY_ASSIGN_OR_RETURN(int64_t version, args.GetInt("version", -1));
  const std::filesystem::path dir(args.Get("out"));
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InvalidArgumentError(absl::StrCat("--out ", dir.string(), ": ", ec.message()));

  // The job's reader token (the admin may ask for it; created if the job has none yet).
  MAINSTAY_ASSIGN_OR_RETURN(CoordinatorConnection conn, CoordinatorConnection::FromArgs(args));
  v1::GetReaderTokenRequest token_request;
  token_request.set_job_id(args.Get("job"));
  v1::GetReaderTokenResponse token;
  MAINSTAY_RETURN_IF_ERROR(conn.Check(conn.coordinator().GetReaderToken(conn.Context().get(), token_request, &token)));
  ClientOptions options;
  options.coordinator = conn.address();
  options.job_id = args.Get("job");
  options.reader_token = token.reader_token();
  options.tls = conn.tls();
  options.transport = args.Get("transport", "auto");
  options.timeout = std::chrono::minutes(10);
  MAINSTAY_ASSIGN_OR_RETURN(std::unique_ptr<Client> client, Client::Connect(options));
  const Layout& layout = client->layout();

  // The newest version unless one was named; pinned while its buckets are pulled.
  MAINSTAY_ASSIGN_OR_RETURN(const VersionPin pin, args.Has("version")
                                                      ? client->PinVersion(version, std::chrono::minutes(10))
                                                      : client->PinNewestVersion(std::chrono::minutes(10)));
  version = pin.version;
  std::vector<PullHandle> handles;
  for (const Bucket& b : layout.buckets) handles.push_back(client->PullBucket(b.index, version));
  std::vector<PulledBucket> pulled;
  int64_t pulled_bytes = 0;
  for (size_t b = 0; b < handles.size(); ++b) {
    absl::StatusOr<PulledBucket> p = handles[b].Wait();
    if (!p.ok()) {
      (void)client->ReleasePin(pin);
      return p.status();
    }
    if (p->unchanged()) {
      (void)client->ReleasePin(pin);
      return absl::FailedPreconditionError(absl::StrCat("version ", version, " was never published (its step was skipped)"));
    }
    pulled_bytes += static_cast<int64_t>(p->data().size());
    pulled.push_back(*std::move(p));
    std::cerr << absl::StrFormat("pulled bucket %d of %d (%.1f MB)\n", b + 1, handles.size(), pulled_bytes / 1e6);
  }
  (void)client->ReleasePin(pin);

  // Tensors in layout order, into files of at most --max-file-bytes (a larger tensor alone).
  std::vector<SafetensorsFile> files(1);
  for (size_t t = 0; t < layout.tensors.size(); ++t) {
    const PulledBucket& p = pulled[static_cast<size_t>(layout.tensors[t].bucket)];
    std::vector<NamedTensor> named;
    if (as == "published") {
      MAINSTAY_ASSIGN_OR_RETURN(named, PublishedTensors(p, static_cast<int32_t>(t)));
    } else {
      MAINSTAY_ASSIGN_OR_RETURN(NamedTensor one, DequantizedTensor(p, static_cast<int32_t>(t), as == "bf16"));
      named.push_back(std::move(one));
    }
    int64_t size = 0;
    for (const NamedTensor& n : named) size += static_cast<int64_t>(n.bytes().size());
    if (!files.back().empty() && files.back().bytes() + size > max_file_bytes) files.emplace_back();
    for (NamedTensor& n : named) files.back().Add(std::move(n));
  }
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"}, {"mainstay_job", client->job_id()}, {"mainstay_version", std::to_string(version)},
      {"mainstay_as", as}};
  std::vector<std::string> names;
  int64_t total = 0;
  for (size_t i = 0; i < files.size(); ++i) {
    names.push_back(files.size() == 1 ? "model.safetensors"
                                      : absl::StrFormat("model-%05d-of-%05d.safetensors", i + 1, files.size()));
    MAINSTAY_RETURN_IF_ERROR(files[i].Write(dir / names.back(), metadata));
    total += files[i].bytes();
  }
  if (files.size() > 1) {  // the index Hugging Face loaders read: tensor name -> file
    nlohmann::ordered_json index;
    index["metadata"] = {{"total_size", total}};
    for (size_t i = 0; i < files.size(); ++i) {
      for (const NamedTensor& t : files[i].tensors()) index["weight_map"][t.name] = names[i];
    }
    const std::filesystem::path path = dir / "model.safetensors.index.json";
    std::ofstream out(path.string() + ".tmp", std::ios::trunc);
    out << index.dump(2) << "\n";
    out.close();
    if (!out) return absl::DataLossError(absl::StrCat("writing ", path.string(), " failed"));
    std::filesystem::rename(path.string() + ".tmp", path, ec);
    if (ec) return absl::FailedPreconditionError(absl::StrCat("renaming ", path.string(), ".tmp: ", ec.message()));
  }
  if (args.Has("json")) {
    nlohmann::ordered_json j = {{"job_id", client->job_id()}, {"version", version}, {"as", as}, {"bytes", total},
                                {"files", names}};
    output.out << j.dump() << "\n";
  } else {
    output.out << "exported version " << version << " of " << client->job_id() << " (" << as << ", "
               << layout.tensors.size() << " tensors, " << total << " bytes) to " << dir.string() << ": "
               << absl::StrJoin(names, ", ") << "\n";
  }
  return absl::OkStatus();
}

}  // namespace mainstay::cli
