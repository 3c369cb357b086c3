#include "cli/command.h"

#include <algorithm>
#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/match.h"
#include "absl/strings/str_split.h"

namespace mainstay::cli {
namespace {

std::string CommandList() {
  std::string text = "usage: mainstayctl COMMAND [FLAGS]\n\ncommands:\n";
  size_t width = 0;
  for (const Command& c : Commands()) width = std::max(width, c.path.size());
  for (const Command& c : Commands()) {
    absl::StrAppend(&text, "  ", c.path, std::string(width + 2 - c.path.size(), ' '), c.summary,
                    c.mutating ? " (mutating)" : " (read-only)", "\n");
  }
  absl::StrAppend(&text, "\nRun 'mainstayctl help COMMAND' for its flags.\n");
  return text;
}

std::string CommandHelp(const Command& c) {
  return absl::StrCat("usage: mainstayctl ", c.path, " ", c.usage, "\n\n", c.summary,
                      c.mutating ? " (mutating: needs --yes when not interactive)" : " (read-only)", "\n");
}

const Command* FindCommand(const std::vector<std::string>& args, size_t* consumed) {
  // Longest match first: "daemons list" before "daemons".
  const Command* best = nullptr;
  size_t best_words = 0;
  for (const Command& c : Commands()) {
    std::vector<std::string> words = absl::StrSplit(c.path, ' ');
    if (words.size() > args.size() || words.size() <= best_words) continue;
    if (std::equal(words.begin(), words.end(), args.begin())) {
      best = &c;
      best_words = words.size();
    }
  }
  *consumed = best_words;
  return best;
}

}  // namespace

absl::StatusOr<Args> Args::Parse(const std::vector<std::string>& argv, const std::vector<std::string>& bool_flags) {
  Args args;
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& a = argv[i];
    if (!absl::StartsWith(a, "--") || a == "--") {
      args.positionals_.push_back(a);
      continue;
    }
    std::string name = a.substr(2), value;
    const size_t eq = name.find('=');
    if (eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    } else if (std::find(bool_flags.begin(), bool_flags.end(), name) == bool_flags.end()) {
      if (i + 1 >= argv.size()) return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a value"));
      value = argv[++i];
    }
    args.flags_[name] = value;
  }
  return args;
}

bool Args::Has(absl::string_view flag) const { return flags_.find(flag) != flags_.end(); }

std::string Args::Get(absl::string_view flag, absl::string_view fallback) const {
  auto it = flags_.find(flag);
  return it == flags_.end() ? std::string(fallback) : it->second;
}

absl::StatusOr<int64_t> Args::GetInt(absl::string_view flag, int64_t fallback) const {
  auto it = flags_.find(flag);
  if (it == flags_.end()) return fallback;
  int64_t value = 0;
  if (!absl::SimpleAtoi(it->second, &value)) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, ": expected an integer, got '", it->second, "'"));
  }
  return value;
}

absl::Status Args::CheckKnown(const std::vector<std::string>& known) const {
  for (const auto& [name, value] : flags_) {
    if (std::find(known.begin(), known.end(), name) == known.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown flag --", name, "; this command takes --", absl::StrJoin(known, ", --")));
    }
  }
  return absl::OkStatus();
}

constexpr char kRemoteHelp[] =
    "\n  --coordinator ADDR  coordinator host:port, or a comma-separated list of the coordinators\n"
    "                      sharing one etcd (default $MAINSTAY_COORDINATOR, else 127.0.0.1:7070)"
    "\n  --timeout-ms N      deadline of each call (default 10000)"
    "\n  --tls-ca-file F     connect with TLS, verifying the coordinator with the PEM CA in F"
    "\n                      (default $MAINSTAY_TLS_CA_FILE)"
    "\n  --tls-cert-file F   client certificate for mutual TLS (default $MAINSTAY_TLS_CERT_FILE)"
    "\n  --tls-key-file F    its private key (default $MAINSTAY_TLS_KEY_FILE)"
    "\n  --tls-server-name N verify the coordinator's certificate against N instead of its address"
    "\n  --admin-token-file F  the coordinator's admin token (default $MAINSTAY_ADMIN_TOKEN_FILE)"
    "\n  --cluster-secret-file F  the cluster secret, for `kv get` (default $MAINSTAY_CLUSTER_SECRET_FILE)";

const std::vector<Command>& Commands() {
  static const std::vector<Command>* commands = new std::vector<Command>{
      {"layout", "print the layout of a job spec (offline) or of a live job",
       "(--spec FILE [--dp N] [--policy flat|whole_tensor] [--bucket-numel N] | --job ID) [--summary] [--json]\n"
       "  --spec FILE         job spec (JSON, see docs/job_spec.md), computed offline\n"
       "  --job ID            a live job's layout, from the coordinator\n"
       "  --dp N              data-parallel size D (default: the spec's data_parallel_size)\n"
       "  --policy P          layout policy (default: the spec's layout_policy)\n"
       "  --bucket-numel N    bucket size threshold in elements (default: the spec's, else max(40e6, 1e6*D))\n"
       "  --summary           only the totals and the bucket table\n"
       "  --json              the whole layout as JSON" + std::string(kRemoteHelp),
       false, RunLayout},
      {"daemons list", "list the registered daemons", "[--all] [--json]\n  --all  include DOWN daemons" + std::string(kRemoteHelp),
       false, RunDaemonsList},
      {"daemons show", "one daemon in detail", "DAEMON_ID [--json]" + std::string(kRemoteHelp), false, RunDaemonsShow},
      {"daemons cordon", "stop placing new shards on a daemon (--undo: make it READY again)",
       "DAEMON_ID [--undo] [--yes]" + std::string(kRemoteHelp), true, RunDaemonsCordon},
      {"daemons drain", "cordon a daemon and move all of its shards to others, state and all",
       "DAEMON_ID [--yes] [--json]" + std::string(kRemoteHelp), true, RunDaemonsDrain},
      {"shards move", "move one rank of a job (every bucket's shard of it) to another daemon, state and all",
       "--job ID --rank R --to DAEMON_ID [--yes] [--json]\n"
       "  --job ID            the job\n"
       "  --rank R            the rank whose shards move\n"
       "  --to DAEMON_ID      a READY daemon; it copies the state from the current owner, which then drops it" +
           std::string(kRemoteHelp),
       true, RunShardsMove},
      {"connections", "trainers' data-plane connections and the transport each uses (grpc, ucx, nccl)",
       "[--job ID] [--json]\n  --job ID  only this job's" + std::string(kRemoteHelp), false, RunConnections},
      {"jobs list", "list jobs", "[--json]" + std::string(kRemoteHelp), false, RunJobsList},
      {"jobs show", "one job in detail", "JOB_ID [--json]" + std::string(kRemoteHelp), false, RunJobsShow},
      {"jobs create", "create a job from a spec; prints its id and token",
       "--spec FILE [--dp N] [--name NAME] [--request-id ID] [--yes] [--json]\n"
       "  --request-id ID     idempotency key: a retry returns the same job" + std::string(kRemoteHelp),
       true, RunJobsCreate},
      {"jobs delete", "delete a job and drop its shards on the daemons", "JOB_ID [--yes]" + std::string(kRemoteHelp), true,
       RunJobsDelete},
      {"jobs reader-token", "print the job's read-only reader token (created on first use), or rotate it",
       "JOB_ID [--rotate --yes] [--json]\n"
       "  --rotate            replace the token: readers holding the old one are refused from then on\n"
       "                      (a rotation changes state: it needs --yes)" +
           std::string(kRemoteHelp),
       false, RunJobsReaderToken},
      {"export", "write one published version of a job as safetensors files (model-space names)",
       "--job ID --out DIR [--version V] [--as published|bf16|fp32] [--max-file-bytes N] [--transport T] [--json]\n"
       "  --version V         a published version (default: the newest, pinned while it is read)\n"
       "  --as A              published: data and scales as the daemons hold them (default);\n"
       "                      bf16 / fp32: dequantized values\n"
       "  --max-file-bytes N  split into model-NNNNN-of-NNNNN.safetensors + an index beyond N bytes\n"
       "                      (default 5 GiB)\n"
       "  --transport T       auto (default), grpc or ucx, to the daemons\n"
       "  Uses the job's reader token (created if the job has none)." +
           std::string(kRemoteHelp),
       false, RunExport},
      {"placement", "which daemon owns each rank's shards of a job", "--job ID [--json]" + std::string(kRemoteHelp),
       false, RunPlacement},
      {"kv get", "read a key (or keys under a prefix) of the coordinator's KV", "KEY [--prefix] [--json]" + std::string(kRemoteHelp),
       false, RunKvGet},
      {"health", "check the coordinator's gRPC health service", "[--json]" + std::string(kRemoteHelp), false, RunHealth},
      {"checkpoint create", "checkpoint a job's optimizer state at its newest step (training goes on)",
       "--job ID [--wait] [--yes] [--json]\n"
       "  --wait              return once the checkpoint is committed (bounded by --timeout-ms)" +
           std::string(kRemoteHelp),
       true, RunCheckpointCreate},
      {"checkpoint list", "list checkpoints, newest first", "[--job ID] [--json]" + std::string(kRemoteHelp), false,
       RunCheckpointList},
      {"checkpoint restore", "load a checkpoint into a job (any D or layout); its trainers rewind to it",
       "CHECKPOINT_ID [--job ID] [--yes] [--json]\n"
       "  --job ID            the job to load into (default: the job the checkpoint was taken from)" +
           std::string(kRemoteHelp),
       true, RunCheckpointRestore},
      {"checkpoint delete", "delete a checkpoint's files", "CHECKPOINT_ID [--yes] [--json]" + std::string(kRemoteHelp),
       true, RunCheckpointDelete},
  };
  return *commands;
}

absl::Status RunCommand(const std::vector<std::string>& args, Output& output) {
  if (args.empty() || args[0] == "help" || args[0] == "--help" || args[0] == "-h") {
    if (args.size() >= 2) {
      size_t consumed = 0;
      std::vector<std::string> rest(args.begin() + 1, args.end());
      if (const Command* c = FindCommand(rest, &consumed)) {
        output.out << CommandHelp(*c);
        return absl::OkStatus();
      }
      return absl::InvalidArgumentError(absl::StrCat("unknown command '", absl::StrJoin(rest, " "), "'\n", CommandList()));
    }
    output.out << CommandList();
    return args.empty() ? absl::InvalidArgumentError("no command given") : absl::OkStatus();
  }
  size_t consumed = 0;
  const Command* command = FindCommand(args, &consumed);
  if (command == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("unknown command '", args[0], "'\n", CommandList()));
  }
  std::vector<std::string> rest(args.begin() + consumed, args.end());
  if (std::find(rest.begin(), rest.end(), "--help") != rest.end()) {
    output.out << CommandHelp(*command);
    return absl::OkStatus();
  }
  absl::StatusOr<Args> parsed =
      Args::Parse(rest, {"json", "yes", "summary", "all", "undo", "prefix", "wait", "rotate"});
  if (!parsed.ok()) return absl::InvalidArgumentError(absl::StrCat(parsed.status().message(), "\n", CommandHelp(*command)));
  if (command->mutating && !parsed->Has("yes") && !output.stdin_is_terminal) {
    return absl::FailedPreconditionError(absl::StrCat("'", command->path, "' changes state; pass --yes to confirm"));
  }
  absl::Status status = command->run(*parsed, output);
  if (status.code() == absl::StatusCode::kInvalidArgument && absl::StartsWith(status.message(), "--")) {
    return absl::InvalidArgumentError(absl::StrCat(status.message(), "\n", CommandHelp(*command)));
  }
  return status;
}

int ExitCode(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kOk:
      return 0;
    case absl::StatusCode::kInvalidArgument:
      return 2;
    case absl::StatusCode::kNotFound:
      return 3;
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kAlreadyExists:
      return 4;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
      return 5;
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kUnauthenticated:
      return 6;
    default:
      return 1;
  }
}

}  // namespace mainstay::cli
