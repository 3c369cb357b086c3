// The job token the in-process tests use, and its SHA-256 as the coordinator would send it in
// AssignShard (daemons refuse an assignment without one).
#ifndef MAINSTAY_TESTS_TESTING_JOB_TOKEN_H_
#define MAINSTAY_TESTS_TESTING_JOB_TOKEN_H_

#include <openssl/sha.h>

#include <string>

namespace mainstay::testing {

inline constexpr char kToken[] = "test-token";

inline std::string TokenSha256() {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(kToken), sizeof(kToken) - 1, digest);
  return std::string(reinterpret_cast<const char*>(digest), sizeof(digest));
}

}  // namespace mainstay::testing

#endif  // MAINSTAY_TESTS_TESTING_JOB_TOKEN_H_
