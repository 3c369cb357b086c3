// mainstayctl as a library: a table of subcommands and RunCommand, which tests call
// in-process and main() wraps.
//
// Each subcommand declares its help text and whether it is read-only or mutating;
// mutating commands require --yes when standard input is not a terminal. Output goes to
// Output::out (tables by default, JSON with --json); nothing is printed on error, the
// caller prints the returned status.
//
// Thread safety: RunCommand keeps no state between calls.
#ifndef MAINSTAY_CLI_COMMAND_H_
#define MAINSTAY_CLI_COMMAND_H_

#include <functional>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace mainstay::cli {

struct Output {
  std::ostream& out;
  bool stdin_is_terminal = false;  // mutating commands without --yes are refused when false
};

// Parsed "--name value", "--name=value" and bare "--flag" arguments plus positionals.
class Args {
 public:
  // `bool_flags` are the flags that take no value. Unknown flags are accepted here and
  // rejected by CheckKnown, so the error can list the command's flags.
  static absl::StatusOr<Args> Parse(const std::vector<std::string>& argv,
                                    const std::vector<std::string>& bool_flags);

  bool Has(absl::string_view flag) const;
  // Value of `--flag`, or `fallback` when absent.
  std::string Get(absl::string_view flag, absl::string_view fallback = "") const;
  // Integer value of `--flag`; INVALID_ARGUMENT naming the flag when it is not an integer.
  absl::StatusOr<int64_t> GetInt(absl::string_view flag, int64_t fallback) const;
  // INVALID_ARGUMENT naming the first flag outside `known`.
  absl::Status CheckKnown(const std::vector<std::string>& known) const;
  const std::vector<std::string>& positionals() const { return positionals_; }

 private:
  std::map<std::string, std::string, std::less<>> flags_;
  std::vector<std::string> positionals_;
};

struct Command {
  std::string path;      // "layout", "daemons list", ...
  std::string summary;   // one line for the command list
  std::string usage;     // flags and what they do
  bool mutating = false; // changes state somewhere: needs --yes when not interactive
  std::function<absl::Status(const Args&, Output&)> run;
};

// Every subcommand, in the order `mainstayctl help` lists them.
const std::vector<Command>& Commands();

// Runs `mainstayctl ARGS...` (argv without the program name). "help" and "--help" print
// usage. Unknown command / flag / bad value -> INVALID_ARGUMENT with the usage in the message.
absl::Status RunCommand(const std::vector<std::string>& args, Output& output);

// Process exit code for a status: 0 OK, 2 INVALID_ARGUMENT (usage), 3 NOT_FOUND,
// 4 FAILED_PRECONDITION / ALREADY_EXISTS, 5 UNAVAILABLE / DEADLINE_EXCEEDED,
// 6 PERMISSION_DENIED / UNAUTHENTICATED, 1 anything else.
int ExitCode(const absl::Status& status);

// ---- Subcommand entry points.
absl::Status RunLayout(const Args& args, Output& output);  // layout_command.cc
// remote_commands.cc
absl::Status RunDaemonsList(const Args& args, Output& output);
absl::Status RunConnections(const Args& args, Output& output);
absl::Status RunDaemonsShow(const Args& args, Output& output);
absl::Status RunDaemonsCordon(const Args& args, Output& output);
absl::Status RunDaemonsDrain(const Args& args, Output& output);
absl::Status RunShardsMove(const Args& args, Output& output);
absl::Status RunJobsList(const Args& args, Output& output);
absl::Status RunJobsShow(const Args& args, Output& output);
absl::Status RunJobsCreate(const Args& args, Output& output);
absl::Status RunJobsDelete(const Args& args, Output& output);
absl::Status RunJobsReaderToken(const Args& args, Output& output);
absl::Status RunExport(const Args& args, Output& output);  // export_command.cc
absl::Status RunPlacement(const Args& args, Output& output);
absl::Status RunKvGet(const Args& args, Output& output);
absl::Status RunHealth(const Args& args, Output& output);
absl::Status RunCheckpointCreate(const Args& args, Output& output);  // checkpoint_commands.cc
absl::Status RunCheckpointList(const Args& args, Output& output);
absl::Status RunCheckpointRestore(const Args& args, Output& output);
absl::Status RunCheckpointDelete(const Args& args, Output& output);

}  // namespace mainstay::cli

#endif  // MAINSTAY_CLI_COMMAND_H_
