// mainstayctl layout: computes a job spec's layout offline and prints it.
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cli/command.h"
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

Json LayoutJson(const ResolvedJob& job) {
  const Layout& layout = job.layout;
  Json j;
  j["job"] = job.spec.name;
  j["recipe"] = job.recipe.name;
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
                       {"format_reason", job.formats[i].reason},
                       {"fell_back", job.formats[i].fell_back},
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

void PrintTables(const ResolvedJob& job, bool summary_only, std::ostream& out) {
  const Layout& layout = job.layout;
  const int64_t total = TotalNumel(layout), data = TotalDataNumel(layout);
  int64_t bytes = 0;
  for (const Bucket& b : layout.buckets) bytes += DataBytes(b.format, b.numel);
  out << absl::StrFormat(
      "job %s  recipe %s  policy %s  D=%d  bucket threshold %s elements\n"
      "%d tensors, %s elements (%s with padding, overhead %.3f%%), %d buckets, published %s bytes\n\n",
      job.spec.name, job.recipe.name, LayoutPolicyName(layout.policy), layout.data_parallel_size,
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
    tensors.AddRow({t.name, Shape(t.shape), std::string(FormatName(t.format)),
                    (job.formats[i].fell_back ? "fallback: " : "") + job.formats[i].reason, absl::StrCat(t.bucket),
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

}  // namespace

absl::Status RunLayout(const Args& args, Output& output) {
  MAINSTAY_RETURN_IF_ERROR(args.CheckKnown({"spec", "dp", "policy", "bucket-numel", "summary", "json"}));
  if (!args.Has("spec")) return absl::InvalidArgumentError("--spec FILE is required");
  MAINSTAY_ASSIGN_OR_RETURN(JobSpec spec, LoadJobSpecFile(args.Get("spec")));
  MAINSTAY_ASSIGN_OR_RETURN(spec.data_parallel_size, args.GetInt("dp", spec.data_parallel_size));
  MAINSTAY_ASSIGN_OR_RETURN(spec.bucket_numel, args.GetInt("bucket-numel", spec.bucket_numel));
  if (args.Has("policy")) {
    absl::StatusOr<LayoutPolicy> policy = ParseLayoutPolicy(args.Get("policy"));
    if (!policy.ok()) return Annotate(policy.status(), "--policy");
    spec.layout_policy = *policy;
  }
  MAINSTAY_ASSIGN_OR_RETURN(ResolvedJob job, ResolveJob(spec));
  if (args.Has("json")) {
    output.out << LayoutJson(job).dump(2) << "\n";
  } else {
    PrintTables(job, args.Has("summary"), output.out);
  }
  return absl::OkStatus();
}

}  // namespace mainstay::cli
