// mainstayctl checkpoint create|list|restore|delete (docs/checkpoints.md).
#include "absl/strings/str_cat.h"
#include "cli/command.h"
#include "cli/coordinator_client.h"
#include "cli/output_format.h"
#include "cli/table.h"
#include "common/status.h"

namespace mainstay::cli {
namespace {

std::string CheckpointState(v1::CheckpointState s) { return EnumShort(v1::CheckpointState_Name(s), "CHECKPOINT_STATE_"); }

absl::StatusOr<std::string> OneId(const Args& args, absl::string_view what) {
  if (args.positionals().size() != 1) {
    return absl::InvalidArgumentError(absl::StrCat("expected exactly one ", what, ", got ", args.positionals().size()));
  }
  return args.positionals()[0];
}

void PrintCheckpoint(const v1::CheckpointInfo& c, Output& output) {
  Table t({"FIELD", "VALUE"});
  t.AddRow({"checkpoint", c.checkpoint_id()});
  t.AddRow({"state", CheckpointState(c.state())});
  t.AddRow({"job", absl::StrCat(c.job_id(), " (", c.job_name(), ")")});
  t.AddRow({"version", absl::StrCat(c.version())});
  t.AddRow({"created", Time(c.created_unix_ms())});
  t.AddRow({"size", Bytes(c.size_bytes())});
  t.AddRow({"files", absl::StrCat(c.file_count())});
  t.AddRow({"manifest", c.manifest_uri()});
  if (!c.error().empty()) t.AddRow({"error", c.error()});
  t.Print(output.out);
}

}  // namespace

absl::Status RunCheckpointCreate(const Args& args, Output& output) {
  MAINSTAY_RETURN_IF_ERROR(CheckRemoteFlags(args, {"job", "wait", "yes"}));
  if (!args.Has("job")) return absl::InvalidArgumentError("--job ID is required");
  MAINSTAY_ASSIGN_OR_RETURN(CoordinatorConnection conn, CoordinatorConnection::FromArgs(args));
  v1::CreateCheckpointRequest request;
  request.set_job_id(args.Get("job"));
  request.set_wait(args.Has("wait"));
  v1::CreateCheckpointResponse response;
  MAINSTAY_RETURN_IF_ERROR(conn.Check(conn.admin().CreateCheckpoint(conn.Context().get(), request, &response)));
  if (args.Has("json")) {
    PrintJson(response.checkpoint(), output);
  } else {
    PrintCheckpoint(response.checkpoint(), output);
  }
  return absl::OkStatus();
}

absl::Status RunCheckpointList(const Args& args, Output& output) {
  MAINSTAY_RETURN_IF_ERROR(CheckRemoteFlags(args, {"job"}));
  MAINSTAY_ASSIGN_OR_RETURN(CoordinatorConnection conn, CoordinatorConnection::FromArgs(args));
  v1::ListCheckpointsRequest request;
  request.set_job_id(args.Get("job", ""));
  v1::ListCheckpointsResponse response;
  MAINSTAY_RETURN_IF_ERROR(conn.Check(conn.admin().ListCheckpoints(conn.Context().get(), request, &response)));
  if (args.Has("json")) {
    PrintJson(response, output);
    return absl::OkStatus();
  }
  Table t({"CHECKPOINT", "STATE", "JOB", "VERSION", "CREATED", "SIZE", "FILES", "ERROR"});
  for (const v1::CheckpointInfo& c : response.checkpoints()) {
    t.AddRow({c.checkpoint_id(), CheckpointState(c.state()), c.job_id(), absl::StrCat(c.version()),
              Time(c.created_unix_ms()), Bytes(c.size_bytes()), absl::StrCat(c.file_count()), c.error()});
  }
  t.Print(output.out);
  return absl::OkStatus();
}

absl::Status RunCheckpointRestore(const Args& args, Output& output) {
  MAINSTAY_RETURN_IF_ERROR(CheckRemoteFlags(args, {"job", "yes"}));
  MAINSTAY_ASSIGN_OR_RETURN(std::string id, OneId(args, "checkpoint id"));
  MAINSTAY_ASSIGN_OR_RETURN(CoordinatorConnection conn, CoordinatorConnection::FromArgs(args));
  v1::RestoreCheckpointRequest request;
  request.set_checkpoint_id(id);
  request.set_job_id(args.Get("job", ""));
  v1::RestoreCheckpointResponse response;
  MAINSTAY_RETURN_IF_ERROR(conn.Check(conn.admin().RestoreCheckpoint(conn.Context().get(), request, &response)));
  if (args.Has("json")) {
    PrintJson(response, output);
  } else {
    output.out << "restoring " << (request.job_id().empty() ? "the checkpoint's job" : request.job_id()) << " from "
               << id << ": version " << response.version() << ", placement epoch " << response.placement_epoch()
               << " (trainers resume at the checkpoint's step + 1)\n";
  }
  return absl::OkStatus();
}

absl::Status RunCheckpointDelete(const Args& args, Output& output) {
  MAINSTAY_RETURN_IF_ERROR(CheckRemoteFlags(args, {"yes"}));
  MAINSTAY_ASSIGN_OR_RETURN(std::string id, OneId(args, "checkpoint id"));
  MAINSTAY_ASSIGN_OR_RETURN(CoordinatorConnection conn, CoordinatorConnection::FromArgs(args));
  v1::DeleteCheckpointRequest request;
  request.set_checkpoint_id(id);
  v1::DeleteCheckpointResponse response;
  MAINSTAY_RETURN_IF_ERROR(conn.Check(conn.admin().DeleteCheckpoint(conn.Context().get(), request, &response)));
  if (args.Has("json")) {
    output.out << "{\"deleted\": \"" << id << "\"}\n";
  } else {
    output.out << "deleted " << id << "\n";
  }
  return absl::OkStatus();
}

}  // namespace mainstay::cli
