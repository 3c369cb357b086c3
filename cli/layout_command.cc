// mainstayctl layout: computes a job spec's layout offline and prints it.
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cli/command.h"
#include "cli/coordinator_client.h"
#include "common/layout_proto.h"
#include "cli/table.h"
#include "common/job_spec.h"
#include "common/status.h"

namespace mainstay::cli {
namespace {

using Json = nlohmann::json;

std::string Range(const IndexRange& r) { return absl::StrCat("[", r.begin, ", ", r.end, ")"); }

std::string Shape(const std::vector<int64_t>& shape) { return absl::StrCat("[", absl::StrJoin(shape, ", "), "]"); }

double Percent(int64_t part, int64_t whole) { return whole > 0 ? 100.0 * part / whole : 0.0; }

Json RangeJson(const IndexRange& r) { return Json::array({r.begin, r.end}); }

// What the tables show: a layout, and where known, why each tensor has its format.
struct LayoutView {
  std::string job;
  std::string recipe;
  const Layout* layout;
  std::vector<ResolvedFormat> formats;  // empty for a live job (the coordinator keeps only the result)
};

std::string Reason(const LayoutView& v, size_t i) {
  if (v.formats.empty()) return "-";
  return (v.formats[i].fell_back ? "fallback: " : "") + v.formats[i].reason;
}

Json LayoutJson(const LayoutView& view) {
  const Layout& layout = *view.layout;
  Json j;
  j["job"] = view.job;
  j["recipe"] = view.recipe;
  j["policy"] = std::string(LayoutPolicyName(layout.policy));
  j["data_parallel_size"] = layout.data_parallel_size;
  j["bucket_numel"] = layout.bucket_numel;
  j["total_numel"] = TotalNumel(layout);
  j["data_numel"] = TotalDataNumel(layout);
  j["padding_numel"] = TotalNumel(layout) - TotalDataNumel(layout);
  Json tensors = Json::array();
  for (size_t i = 0; i < layout.tensors.size(); ++i) {
    const LayoutTensor& t = layout.tensors[i];
    tensors.push_back({{"index", i},
                       {"name", t.name},
                       {"shape", t.shape},
                       {"numel", t.numel},
                       {"format", std::string(FormatName(t.format))},
                       {"format_reason", view.formats.empty() ? "" : view.formats[i].reason},
                       {"fell_back", !view.formats.empty() && view.formats[i].fell_back},
                       {"bucket", t.bucket},
                       {"bucket_offset", t.bucket_offset}});
  }
  j["tensors"] = tensors;
  Json buckets = Json::array();
  for (const Bucket& b : layout.buckets) {
    Json shards = Json::array();
    for (const Shard& s : b.shards) {
      Json fragments = Json::array();
      for (const TensorFragment& f : s.fragments) {
        fragments.push_back({{"tensor", f.tensor},
                             {"elements", RangeJson(f.elements)},
                             {"bucket_offset", f.bucket_offset},
                             {"shard_bytes", RangeJson(FragmentShardByteRange(b, s, f))},
                             {"scale_blocks", RangeJson(FragmentScaleBlocks(layout, f))}});
      }
      shards.push_back({{"rank", s.rank},
                        {"elements", RangeJson(s.elements)},
                        {"bytes", RangeJson(ShardByteRange(b, s.rank))},
                        {"load", s.load()},
                        {"fragments", fragments}});
    }
    const ShardLoadStats stats = LoadStats(b);
    buckets.push_back({{"index", b.index},
                       {"format", std::string(FormatName(b.format))},
                       {"numel", b.numel},
                       {"shard_numel", b.shard_numel},
                       {"data_numel", b.data_numel},
                       {"padding", b.padding()},
                       {"bytes", DataBytes(b.format, b.numel)},
                       {"max_shard_load", stats.max},
                       {"mean_shard_load", stats.mean},
                       {"tensors", b.tensors},
                       {"shards", shards}});
  }
  j["buckets"] = buckets;
  return j;
}

void PrintTables(const LayoutView& view, bool summary_only, std::ostream& out) {
  const Layout& layout = *view.layout;
  const int64_t total = TotalNumel(layout), data = TotalDataNumel(layout);
  int64_t bytes = 0;
  for (const Bucket& b : layout.buckets) bytes += DataBytes(b.format, b.numel);
  out << absl::StrFormat(
      "job %s  recipe %s  policy %s  D=%d  bucket threshold %s elements\n"
      "%d tensors, %s elements (%s with padding, overhead %.3f%%), %d buckets, published %s bytes\n\n",
      view.job, view.recipe, LayoutPolicyName(layout.policy), layout.data_parallel_size,
      HumanCount(layout.bucket_numel), layout.tensors.size(), HumanCount(data), HumanCount(total),
      Percent(total - data, data), layout.buckets.size(), HumanCount(bytes));

  Table buckets({"BUCKET", "FORMAT", "TENSORS", "NUMEL", "SHARD_NUMEL", "SHARD_BYTES", "PADDING", "PAD%",
                 "MAX_LOAD", "MEAN_LOAD"});
  for (const Bucket& b : layout.buckets) {
    const ShardLoadStats stats = LoadStats(b);
    buckets.AddRow({absl::StrCat(b.index), std::string(FormatName(b.format)), absl::StrCat(b.tensors.size()),
                    absl::StrCat(b.numel), absl::StrCat(b.shard_numel), absl::StrCat(DataBytes(b.format, b.shard_numel)),
                    absl::StrCat(b.padding()), absl::StrFormat("%.3f", Percent(b.padding(), b.numel)),
                    absl::StrCat(stats.max), absl::StrFormat("%.0f", stats.mean)});
  }
  buckets.Print(out);
  if (summary_only) return;

  out << "\n";
  Table tensors({"TENSOR", "SHAPE", "FORMAT", "WHY", "BUCKET", "OFFSET", "SHARDS"});
  for (size_t i = 0; i < layout.tensors.size(); ++i) {
    const LayoutTensor& t = layout.tensors[i];
    const Bucket& b = layout.buckets[t.bucket];
    const int64_t first = t.bucket_offset / b.shard_numel;
    const int64_t last = (t.bucket_offset + t.numel - 1) / b.shard_numel;
    tensors.AddRow({t.name, Shape(t.shape), std::string(FormatName(t.format)), Reason(view, i), absl::StrCat(t.bucket),
                    absl::StrCat(t.bucket_offset), first == last ? absl::StrCat(first) : absl::StrCat(first, "-", last)});
  }
  tensors.Print(out);

  out << "\n";
  Table fragments({"BUCKET", "SHARD", "TENSOR", "TENSOR_ELEMENTS", "SHARD_OFFSET", "SHARD_BYTES", "SCALE_BLOCKS"});
  for (const Bucket& b : layout.buckets) {
    for (const Shard& s : b.shards) {
      if (s.fragments.empty()) fragments.AddRow({absl::StrCat(b.index), absl::StrCat(s.rank), "(padding only)"});
      for (const TensorFragment& f : s.fragments) {
        const IndexRange scales = FragmentScaleBlocks(layout, f);
        fragments.AddRow({absl::StrCat(b.index), absl::StrCat(s.rank), layout.tensors[f.tensor].name, Range(f.elements),
                          absl::StrCat(f.bucket_offset - s.elements.begin), Range(FragmentShardByteRange(b, s, f)),
                          scales.empty() ? "-" : Range(scales)});
      }
    }
  }
  fragments.Print(out);
}

absl::Status PrintLayout(const LayoutView& view, const Args& args, Output& output) {
  if (args.Has("json")) {
    output.out << LayoutJson(view).dump(2) << "\n";
  } else {
    PrintTables(view, args.Has("summary"), output.out);
  }
  return absl::OkStatus();
}

// The layout of a live job, from the coordinator.
absl::Status RunLiveLayout(const Args& args, Output& output) {
  MAINSTAY_ASSIGN_OR_RETURN(CoordinatorConnection conn, CoordinatorConnection::FromArgs(args));
  v1::GetJobRequest job_request;
  job_request.set_job_id(args.Get("job"));
  v1::GetJobResponse job;
  MAINSTAY_RETURN_IF_ERROR(conn.Check(conn.coordinator().GetJob(conn.Context().get(), job_request, &job)));
  v1::GetLayoutRequest request;
  request.set_job_id(args.Get("job"));
  v1::GetLayoutResponse response;
  MAINSTAY_RETURN_IF_ERROR(conn.Check(conn.coordinator().GetLayout(conn.Context().get(), request, &response)));
  MAINSTAY_ASSIGN_OR_RETURN(Layout layout, LayoutFromProto(response.layout()));
  return PrintLayout({job.job().spec().name(), job.job().spec().recipe(), &layout, {}}, args, output);
}

}  // namespace

absl::Status RunLayout(const Args& args, Output& output) {
  std::vector<std::string> known = {"spec", "dp", "policy", "bucket-numel", "summary", "job"};
  known.insert(known.end(), kRemoteFlags.begin(), kRemoteFlags.end());
  MAINSTAY_RETURN_IF_ERROR(args.CheckKnown(known));
  if (args.Has("job")) {
    if (args.Has("spec")) return absl::InvalidArgumentError("--spec and --job: give one, not both");
    return RunLiveLayout(args, output);
  }
  if (!args.Has("spec")) return absl::InvalidArgumentError("--spec FILE (offline) or --job ID (live) is required");
  MAINSTAY_ASSIGN_OR_RETURN(JobSpec spec, LoadJobSpecFile(args.Get("spec")));
  MAINSTAY_ASSIGN_OR_RETURN(spec.data_parallel_size, args.GetInt("dp", spec.data_parallel_size));
  MAINSTAY_ASSIGN_OR_RETURN(spec.bucket_numel, args.GetInt("bucket-numel", spec.bucket_numel));
  if (args.Has("policy")) {
    absl::StatusOr<LayoutPolicy> policy = ParseLayoutPolicy(args.Get("policy"));
    if (!policy.ok()) return Annotate(policy.status(), "--policy");
    spec.layout_policy = *policy;
  }
  MAINSTAY_ASSIGN_OR_RETURN(ResolvedJob job, ResolveJob(spec));
  return PrintLayout({job.spec.name, job.recipe.name, &job.layout, job.formats}, args, output);
}

}  // namespace mainstay::cli
