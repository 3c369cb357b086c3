// mainstayctl commands that talk to a live coordinator: daemons, jobs, placement, kv, health.
#include <google/protobuf/util/json_util.h>

#include <map>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "cli/command.h"
#include "cli/coordinator_client.h"
#include "cli/output_format.h"
#include "cli/table.h"
#include "common/job_spec.h"
#include "common/job_spec_proto.h"
#include "common/status.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace mainstay::cli {
namespace {

absl::StatusOr<std::string> OnePositional(const Args& args, absl::string_view what) {
  if (args.positionals().size() != 1) {
    return absl::InvalidArgumentError(absl::StrCat("expected exactly one ", what, ", got ", args.positionals().size()));
  }
  return args.positionals()[0];
}

std::string LeaseLeft(int64_t expires_ms) {
  if (expires_ms == 0) return "-";
  const int64_t left = expires_ms - absl::ToUnixMillis(absl::Now());
  return left > 0 ? absl::StrFormat("%.1fs", left / 1000.0) : "expired";
}

std::string DaemonState(v1::DaemonState s) { return EnumShort(v1::DaemonState_Name(s), "DAEMON_STATE_"); }
std::string JobState(v1::JobState s) { return EnumShort(v1::JobState_Name(s), "JOB_STATE_"); }

void PrintDaemonDetails(const v1::DaemonInfo& d, Output& output) {
  Table t({"FIELD", "VALUE"});
  t.AddRow({"id", d.endpoint().daemon_id()});
  t.AddRow({"state", DaemonState(d.state())});
  t.AddRow({"address", d.endpoint().address()});
  t.AddRow({"node", d.endpoint().node_name()});
  std::string transports;
  for (int tr : d.endpoint().transports()) {
    absl::StrAppend(&transports, transports.empty() ? "" : ",",
                    EnumShort(v1::Transport_Name(static_cast<v1::Transport>(tr)), "TRANSPORT_"));
  }
  t.AddRow({"transports", transports});
  t.AddRow({"host memory", Bytes(d.resources().host_memory_bytes())});
  t.AddRow({"device memory", Bytes(d.resources().device_memory_bytes())});
  t.AddRow({"devices", absl::StrCat(d.resources().device_count())});
  t.AddRow({"used", Bytes(d.used_bytes())});
  t.AddRow({"shards", absl::StrCat(d.shard_count())});
  t.AddRow({"version", d.version()});
  t.AddRow({"registered", Time(d.registered_unix_ms())});
  t.AddRow({"lease left", LeaseLeft(d.lease_expires_unix_ms())});
  for (const auto& [k, v] : d.labels()) t.AddRow({absl::StrCat("label ", k), v});
  t.Print(output.out);
}

absl::StatusOr<v1::DaemonInfo> FindDaemon(CoordinatorConnection& conn, const std::string& id) {
  v1::ListDaemonsRequest request;
  request.set_include_down(true);
  v1::ListDaemonsResponse response;
  MAINSTAY_RETURN_IF_ERROR(conn.Check(conn.coordinator().ListDaemons(conn.Context().get(), request, &response)));
  for (const v1::DaemonInfo& d : response.daemons()) {
    if (d.endpoint().daemon_id() == id) return d;
  }
  return absl::NotFoundError(absl::StrCat("no daemon '", id, "'"));
}

}  // namespace

absl::Status RunDaemonsList(const Args& args, Output& output) {
  MAINSTAY_RETURN_IF_ERROR(CheckRemoteFlags(args, {"all"}));
  MAINSTAY_ASSIGN_OR_RETURN(CoordinatorConnection conn, CoordinatorConnection::FromArgs(args));
  v1::ListDaemonsRequest request;
  request.set_include_down(args.Has("all"));
  v1::ListDaemonsResponse response;
  MAINSTAY_RETURN_IF_ERROR(conn.Check(conn.coordinator().ListDaemons(conn.Context().get(), request, &response)));
  if (args.Has("json")) {
    PrintJson(response, output);
    return absl::OkStatus();
  }
  Table t({"DAEMON", "STATE", "NODE", "ADDRESS", "MEMORY", "USED", "SHARDS", "LEASE"});
  for (const v1::DaemonInfo& d : response.daemons()) {
    // A daemon started with --device cuda:N offers device memory ("GPU" beside it).
    const bool device = d.resources().memory_kind() == v1::MEMORY_KIND_DEVICE;
    const int64_t memory = device ? d.resources().device_memory_bytes() : d.resources().host_memory_bytes();
    t.AddRow({d.endpoint().daemon_id(), DaemonState(d.state()), d.endpoint().node_name(), d.endpoint().address(),
              absl::StrCat(Bytes(memory), device ? " GPU" : ""), Bytes(d.used_bytes()), absl::StrCat(d.shard_count()),
              LeaseLeft(d.lease_expires_unix_ms())});
  }
  t.Print(output.out);
  return absl::OkStatus();
}

// Every daemon's view of its trainers' connections, as of its last heartbeat.
absl::Status RunConnections(const Args& args, Output& output) {
  MAINSTAY_RETURN_IF_ERROR(CheckRemoteFlags(args, {"job"}));
  MAINSTAY_ASSIGN_OR_RETURN(CoordinatorConnection conn, CoordinatorConnection::FromArgs(args));
  v1::ListDaemonsRequest request;
  v1::ListDaemonsResponse response;
  MAINSTAY_RETURN_IF_ERROR(conn.Check(conn.coordinator().ListDaemons(conn.Context().get(), request, &response)));
  const std::string job = args.Get("job");
  v1::ListDaemonsResponse filtered;  // daemons with only the matching connections (for --json)
  Table t({"DAEMON", "JOB", "RANK", "TRANSPORT", "PEER", "PUSHED", "PULLED", "LAST ACTIVE"});
  for (const v1::DaemonInfo& d : response.daemons()) {
    v1::DaemonInfo* kept = filtered.add_daemons();
    *kept->mutable_endpoint() = d.endpoint();
    for (const v1::DataConnection& c : d.connections()) {
      if (!job.empty() && c.job_id() != job) continue;
      *kept->add_connections() = c;
      t.AddRow({d.endpoint().daemon_id(), c.job_id(), absl::StrCat(c.rank()),
                EnumShort(v1::Transport_Name(c.transport()), "TRANSPORT_"), c.peer(), Bytes(c.pushed_bytes()),
                Bytes(c.pulled_bytes()), Time(c.last_active_unix_ms())});
    }
  }
  if (args.Has("json")) {
    PrintJson(filtered, output);
    return absl::OkStatus();
  }
  t.Print(output.out);
  return absl::OkStatus();
}

absl::Status RunDaemonsShow(const Args& args, Output& output) {
  MAINSTAY_RETURN_IF_ERROR(CheckRemoteFlags(args, {}));
  MAINSTAY_ASSIGN_OR_RETURN(std::string id, OnePositional(args, "daemon id"));
  MAINSTAY_ASSIGN_OR_RETURN(CoordinatorConnection conn, CoordinatorConnection::FromArgs(args));
  MAINSTAY_ASSIGN_OR_RETURN(v1::DaemonInfo d, FindDaemon(conn, id));
  if (args.Has("json")) {
    PrintJson(d, output);
  } else {
    PrintDaemonDetails(d, output);
  }
  return absl::OkStatus();
}

absl::Status RunDaemonsCordon(const Args& args, Output& output) {
  MAINSTAY_RETURN_IF_ERROR(CheckRemoteFlags(args, {"undo"}));
  MAINSTAY_ASSIGN_OR_RETURN(std::string id, OnePositional(args, "daemon id"));
  MAINSTAY_ASSIGN_OR_RETURN(CoordinatorConnection conn, CoordinatorConnection::FromArgs(args));
  v1::CordonDaemonRequest request;
  request.set_daemon_id(id);
  request.set_uncordon(args.Has("undo"));
  v1::CordonDaemonResponse response;
  MAINSTAY_RETURN_IF_ERROR(conn.Check(conn.admin().CordonDaemon(conn.Context().get(), request, &response)));
  if (args.Has("json")) {
    PrintJson(response, output);
  } else {
    output.out << "daemon " << id << " is now " << DaemonState(response.daemon().state()) << "\n";
  }
  return absl::OkStatus();
}

absl::Status RunDaemonsDrain(const Args& args, Output& output) {
  MAINSTAY_RETURN_IF_ERROR(CheckRemoteFlags(args, {}));
  MAINSTAY_ASSIGN_OR_RETURN(std::string id, OnePositional(args, "daemon id"));
  MAINSTAY_ASSIGN_OR_RETURN(CoordinatorConnection conn, CoordinatorConnection::FromArgs(args));
  v1::DrainDaemonRequest request;
  request.set_daemon_id(id);
  v1::DrainDaemonResponse response;
  MAINSTAY_RETURN_IF_ERROR(conn.Check(conn.admin().DrainDaemon(conn.Context().get(), request, &response)));
  if (args.Has("json")) {
    PrintJson(response, output);
    return absl::OkStatus();
  }
  // One line per (job, rank): every bucket's shard of a rank moves together.
  std::map<std::pair<std::string, int>, std::pair<std::string, int64_t>> moves;
  std::map<std::pair<std::string, int>, int> buckets;
  for (const v1::ShardMove& m : response.moves()) {
    moves[{m.job_id(), m.shard().shard()}] = {m.to_daemon_id(), m.placement_epoch()};
    buckets[{m.job_id(), m.shard().shard()}]++;
  }
  output.out << "daemon " << id << " is DRAINING; " << moves.size() << " rank(s) moving";
  if (moves.empty()) {
    output.out << "\n";
    return absl::OkStatus();
  }
  // The targets copy the state now: a rank has moved once the coordinator logs it and the
  // daemon no longer lists it.
  output.out << " (each has moved once `daemons show " << id << "` no longer lists it)\n";
  Table t({"JOB", "RANK", "BUCKETS", "TO", "EPOCH"});
  for (const auto& [key, to] : moves) {
    t.AddRow({key.first, absl::StrCat(key.second), absl::StrCat(buckets[key]), to.first, absl::StrCat(to.second)});
  }
  t.Print(output.out);
  return absl::OkStatus();
}

absl::Status RunShardsMove(const Args& args, Output& output) {
  MAINSTAY_RETURN_IF_ERROR(CheckRemoteFlags(args, {"job", "rank", "to"}));
  if (args.Get("job").empty() || args.Get("to").empty() || args.Get("rank").empty()) {
    return absl::InvalidArgumentError("shards move: --job, --rank and --to are required");
  }
  MAINSTAY_ASSIGN_OR_RETURN(int64_t rank, args.GetInt("rank", -1));
  MAINSTAY_ASSIGN_OR_RETURN(CoordinatorConnection conn, CoordinatorConnection::FromArgs(args));
  v1::MoveShardRequest request;
  request.set_job_id(args.Get("job"));
  request.mutable_shard()->set_shard(static_cast<int32_t>(rank));
  request.set_to_daemon_id(args.Get("to"));
  v1::MoveShardResponse response;
  MAINSTAY_RETURN_IF_ERROR(conn.Check(conn.admin().MoveShard(conn.Context().get(), request, &response)));
  if (args.Has("json")) {
    PrintJson(response, output);
    return absl::OkStatus();
  }
  const v1::ShardMove& m = response.move();
  output.out << "rank " << rank << " of job " << m.job_id() << " (" << response.moves_size() << " bucket(s)) moves from "
             << m.from_daemon_id() << " to " << m.to_daemon_id() << " at placement epoch " << m.placement_epoch()
             << "; " << m.to_daemon_id() << " copies its state, then " << m.from_daemon_id() << " drops it\n";
  return absl::OkStatus();
}

absl::Status RunJobsList(const Args& args, Output& output) {
  MAINSTAY_RETURN_IF_ERROR(CheckRemoteFlags(args, {}));
  MAINSTAY_ASSIGN_OR_RETURN(CoordinatorConnection conn, CoordinatorConnection::FromArgs(args));
  v1::ListJobsResponse response;
  MAINSTAY_RETURN_IF_ERROR(conn.Check(conn.coordinator().ListJobs(conn.Context().get(), {}, &response)));
  if (args.Has("json")) {
    PrintJson(response, output);
    return absl::OkStatus();
  }
  Table t({"JOB", "NAME", "STATE", "D", "RECIPE", "BUCKETS", "ELEMENTS", "EPOCH", "VERSION", "CREATED"});
  for (const v1::JobInfo& j : response.jobs()) {
    t.AddRow({j.job_id(), j.spec().name(), JobState(j.state()), absl::StrCat(j.spec().data_parallel_size()),
              j.spec().recipe(), absl::StrCat(j.num_buckets()), HumanCount(j.data_numel()),
              absl::StrCat(j.placement_epoch()), j.progress_known() ? absl::StrCat(j.version()) : "?",
              Time(j.created_unix_ms())});
  }
  t.Print(output.out);
  return absl::OkStatus();
}

absl::Status RunJobsShow(const Args& args, Output& output) {
  MAINSTAY_RETURN_IF_ERROR(CheckRemoteFlags(args, {}));
  MAINSTAY_ASSIGN_OR_RETURN(std::string id, OnePositional(args, "job id"));
  MAINSTAY_ASSIGN_OR_RETURN(CoordinatorConnection conn, CoordinatorConnection::FromArgs(args));
  v1::GetJobRequest request;
  request.set_job_id(id);
  v1::GetJobResponse response;
  MAINSTAY_RETURN_IF_ERROR(conn.Check(conn.coordinator().GetJob(conn.Context().get(), request, &response)));
  if (args.Has("json")) {
    PrintJson(response, output);
    return absl::OkStatus();
  }
  const v1::JobInfo& j = response.job();
  Table t({"FIELD", "VALUE"});
  t.AddRow({"id", j.job_id()});
  t.AddRow({"name", j.spec().name()});
  t.AddRow({"state", JobState(j.state())});
  t.AddRow({"recipe", j.spec().recipe()});
  t.AddRow({"optimizer", j.spec().optimizer().type()});
  t.AddRow({"data parallel size", absl::StrCat(j.spec().data_parallel_size())});
  t.AddRow({"layout policy", j.spec().layout_policy()});
  t.AddRow({"tensors", absl::StrCat(j.spec().tensors_size())});
  t.AddRow({"buckets", absl::StrCat(j.num_buckets())});
  t.AddRow({"elements", absl::StrCat(j.data_numel(), " (", j.total_numel(), " with padding)")});
  t.AddRow({"placement epoch", absl::StrCat(j.placement_epoch())});
  // Not known for a few heartbeats after a coordinator restart (JobInfo.progress_known).
  constexpr absl::string_view kUnknown = "unknown (its daemons have not all reported since the coordinator started)";
  t.AddRow({"committed step", j.progress_known() ? absl::StrCat(j.committed_step()) : std::string(kUnknown)});
  t.AddRow({"version", j.progress_known() ? absl::StrCat(j.version()) : std::string(kUnknown)});
  if (response.has_last_step_stats()) {
    const v1::StepStats& st = response.last_step_stats();
    t.AddRow({"last step", absl::StrCat(st.step(), st.skipped() ? " (skipped: non-finite gradients)" : "")});
    t.AddRow({"grad norm", absl::StrFormat("%.6g (clip factor %.4g)", st.grad_norm(), st.clip_factor())});
    if (st.groups_size() > 1) {  // one pair per param group
      std::string groups;
      for (int g = 0; g < st.groups_size(); ++g) {
        absl::StrAppend(&groups, g ? " | " : "", absl::StrFormat("%.6g, %.6g", st.groups(g).lr(),
                                                                st.groups(g).weight_decay()));
      }
      t.AddRow({"lr, weight decay", groups + " (per param group)"});
    } else {
      t.AddRow({"lr, weight decay", absl::StrFormat("%.6g, %.6g", st.lr(), st.weight_decay())});
    }
    t.AddRow({"step time", absl::StrCat(st.step_time_ms(), " ms (amax probe ", absl::StrFormat("%.1f", st.phases().update_ms()),
                                        " ms, update and cast ", absl::StrFormat("%.1f", st.phases().quantize_ms()), " ms)")});
  }
  for (const v1::PendingMove& m : j.moves()) {
    t.AddRow({"moving", absl::StrCat("rank ", m.rank(), " from ", m.source_daemon_id(), " to ", m.target_daemon_id(),
                                     " (placement epoch ", m.epoch(), ")")});
  }
  for (const v1::DaemonLoadError& e : j.load_errors()) {
    t.AddRow({"load error", absl::StrCat(e.daemon_id(), ": ", e.error())});
  }
  t.AddRow({"created", Time(j.created_unix_ms())});
  t.Print(output.out);
  return absl::OkStatus();
}

absl::Status RunJobsCreate(const Args& args, Output& output) {
  MAINSTAY_RETURN_IF_ERROR(CheckRemoteFlags(args, {"spec", "dp", "name", "request-id"}));
  if (!args.Has("spec")) return absl::InvalidArgumentError("--spec FILE is required");
  MAINSTAY_ASSIGN_OR_RETURN(JobSpec spec, LoadJobSpecFile(args.Get("spec")));
  MAINSTAY_ASSIGN_OR_RETURN(spec.data_parallel_size, args.GetInt("dp", spec.data_parallel_size));
  if (args.Has("name")) spec.name = args.Get("name");
  MAINSTAY_ASSIGN_OR_RETURN(CoordinatorConnection conn, CoordinatorConnection::FromArgs(args));
  v1::CreateJobRequest request;
  JobSpecToProto(spec, request.mutable_spec());
  request.set_request_id(args.Get("request-id"));
  v1::CreateJobResponse response;
  MAINSTAY_RETURN_IF_ERROR(conn.Check(conn.coordinator().CreateJob(conn.Context().get(), request, &response)));
  if (args.Has("json")) {
    PrintJson(response, output);
  } else {
    output.out << "created " << response.job_id() << " '" << spec.name << "': " << response.job().num_buckets()
               << " bucket(s), D=" << spec.data_parallel_size << ", placement epoch "
               << response.job().placement_epoch() << "\n"
               << "job token (shown once; give it to every trainer rank): " << response.job_token() << "\n";
  }
  return absl::OkStatus();
}

absl::Status RunJobsDelete(const Args& args, Output& output) {
  MAINSTAY_RETURN_IF_ERROR(CheckRemoteFlags(args, {}));
  MAINSTAY_ASSIGN_OR_RETURN(std::string id, OnePositional(args, "job id"));
  MAINSTAY_ASSIGN_OR_RETURN(CoordinatorConnection conn, CoordinatorConnection::FromArgs(args));
  v1::DeleteJobRequest request;
  request.set_job_id(id);
  v1::DeleteJobResponse response;
  MAINSTAY_RETURN_IF_ERROR(conn.Check(conn.coordinator().DeleteJob(conn.Context().get(), request, &response)));
  if (args.Has("json")) {
    output.out << "{\"deleted\": \"" << id << "\"}\n";
  } else {
    output.out << "deleted " << id << "\n";
  }
  return absl::OkStatus();
}

absl::Status RunJobsReaderToken(const Args& args, Output& output) {
  MAINSTAY_RETURN_IF_ERROR(CheckRemoteFlags(args, {"rotate"}));
  MAINSTAY_ASSIGN_OR_RETURN(std::string id, OnePositional(args, "job id"));
  const bool rotate = args.Has("rotate");
  if (rotate && !args.Has("yes")) {
    return absl::FailedPreconditionError(
        "'jobs reader-token --rotate' stops the current token for every reader of the job; pass --yes to confirm");
  }
  MAINSTAY_ASSIGN_OR_RETURN(CoordinatorConnection conn, CoordinatorConnection::FromArgs(args));
  v1::GetReaderTokenRequest request;
  request.set_job_id(id);
  request.set_rotate(rotate);
  v1::GetReaderTokenResponse response;
  MAINSTAY_RETURN_IF_ERROR(conn.Check(conn.coordinator().GetReaderToken(conn.Context().get(), request, &response)));
  if (args.Has("json")) {
    output.out << "{\"job_id\": \"" << id << "\", \"reader_token\": \"" << response.reader_token() << "\"}\n";
  } else {
    output.out << response.reader_token() << "\n";
  }
  return absl::OkStatus();
}

absl::Status RunPlacement(const Args& args, Output& output) {
  MAINSTAY_RETURN_IF_ERROR(CheckRemoteFlags(args, {"job"}));
  if (!args.Has("job")) return absl::InvalidArgumentError("--job ID is required");
  MAINSTAY_ASSIGN_OR_RETURN(CoordinatorConnection conn, CoordinatorConnection::FromArgs(args));
  v1::GetPlacementRequest request;
  request.set_job_id(args.Get("job"));
  v1::GetPlacementResponse response;
  MAINSTAY_RETURN_IF_ERROR(conn.Check(conn.coordinator().GetPlacement(conn.Context().get(), request, &response)));
  if (args.Has("json")) {
    PrintJson(response, output);
    return absl::OkStatus();
  }
  const v1::Placement& p = response.placement();
  std::map<std::string, v1::DaemonEndpoint> endpoints;
  for (const v1::DaemonEndpoint& e : p.daemons()) endpoints[e.daemon_id()] = e;
  std::map<int, std::set<std::string>> owners;  // rank -> daemons
  std::map<int, int> buckets;
  for (const v1::ShardPlacement& s : p.shards()) {
    owners[s.shard().shard()].insert(s.daemon_id());
    buckets[s.shard().shard()]++;
  }
  output.out << "job " << p.job_id() << "  placement epoch " << p.epoch() << "\n";
  Table t({"RANK", "DAEMON", "NODE", "ADDRESS", "BUCKETS"});
  for (const auto& [rank, daemons] : owners) {
    for (const std::string& d : daemons) {
      t.AddRow({absl::StrCat(rank), d, endpoints[d].node_name(), endpoints[d].address(), absl::StrCat(buckets[rank])});
    }
  }
  t.Print(output.out);
  return absl::OkStatus();
}

absl::Status RunKvGet(const Args& args, Output& output) {
  MAINSTAY_RETURN_IF_ERROR(CheckRemoteFlags(args, {"prefix"}));
  MAINSTAY_ASSIGN_OR_RETURN(std::string key, OnePositional(args, "key"));
  MAINSTAY_ASSIGN_OR_RETURN(CoordinatorConnection conn, CoordinatorConnection::FromArgs(args));
  v1::KvGetRequest request;
  request.set_key(key);
  request.set_prefix(args.Has("prefix"));
  v1::KvGetResponse response;
  MAINSTAY_RETURN_IF_ERROR(conn.Check(conn.coordinator().KvGet(conn.Context().get(), request, &response)));
  if (args.Has("json")) {
    PrintJson(response, output);
    return absl::OkStatus();
  }
  Table t({"KEY", "VERSION", "REVISION", "EXPIRES", "VALUE"});
  for (const v1::KvEntry& e : response.entries()) {
    bool printable = true;
    for (char c : e.value()) printable &= c >= 32 && c < 127;
    t.AddRow({e.key(), absl::StrCat(e.version()), absl::StrCat(e.mod_revision()), Time(e.expires_unix_ms()),
              printable ? e.value() : absl::StrCat("<", e.value().size(), " bytes>")});
  }
  t.Print(output.out);
  return absl::OkStatus();
}

absl::Status RunHealth(const Args& args, Output& output) {
  MAINSTAY_RETURN_IF_ERROR(CheckRemoteFlags(args, {}));
  MAINSTAY_ASSIGN_OR_RETURN(CoordinatorConnection conn, CoordinatorConnection::FromArgs(args));
  auto stub = grpc::health::v1::Health::NewStub(conn.channel());
  std::string worst;
  Table t({"SERVICE", "STATUS"});
  for (const std::string service : {"", "mainstay.v1.Coordinator"}) {
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(service);
    grpc::health::v1::HealthCheckResponse response;
    MAINSTAY_RETURN_IF_ERROR(conn.Check(stub->Check(conn.Context().get(), request, &response)));
    const std::string status = grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status());
    t.AddRow({service.empty() ? "(server)" : service, status});
    if (response.status() != grpc::health::v1::HealthCheckResponse::SERVING) worst = status;
  }
  if (args.Has("json")) {
    output.out << "{\"coordinator\": \"" << conn.address() << "\", \"serving\": " << (worst.empty() ? "true" : "false")
               << "}\n";
  } else {
    output.out << "coordinator " << conn.address() << "\n";
    t.Print(output.out);
  }
  if (!worst.empty()) return absl::UnavailableError(absl::StrCat("coordinator ", conn.address(), " is ", worst));
  return absl::OkStatus();
}

}  // namespace mainstay::cli
