// A fake Mainstay cluster (coordinator + daemons, fake_services.h) in one process, for the
// Python module's end-to-end test. Prints "coordinator=<host:port>" on stdout, then serves
// until stdin closes.
//   mainstay_client_fake_server [num_daemons] [unavailable_calls] [admin_token]
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

#include "client/src/testing/fake_services.h"

int main(int argc, char** argv) {
  mainstay::testing_fakes::FakeClusterOptions options;
  if (argc > 1) options.num_daemons = std::atoi(argv[1]);
  if (argc > 2) options.unavailable_calls = std::atoi(argv[2]);
  if (argc > 3) options.admin_token = argv[3];
  auto cluster = mainstay::testing_fakes::FakeCluster::Start(options);
  if (!cluster.ok()) {
    std::cerr << cluster.status() << "\n";
    return 1;
  }
  std::cout << "coordinator=" << (*cluster)->coordinator_address() << std::endl;
  std::string line;
  while (std::getline(std::cin, line)) {
  }
  return 0;
}
