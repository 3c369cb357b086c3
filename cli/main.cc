// mainstayctl: the admin CLI. All logic lives in cli/command.h; this is the thin main.
#include <unistd.h>

#include <iostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "cli/command.h"

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  mainstay::cli::Output output{std::cout, isatty(STDIN_FILENO) == 1};
  absl::Status status = mainstay::cli::RunCommand(args, output);
  std::cout.flush();
  if (!status.ok()) {
    std::cerr << "mainstayctl: " << absl::StatusCodeToString(status.code()) << ": " << status.message() << "\n";
  }
  return mainstay::cli::ExitCode(status);
}
