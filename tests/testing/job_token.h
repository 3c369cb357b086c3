// The job token the in-process tests use, and its SHA-256 as the coordinator would send it in
// AssignShard (daemons refuse an assignment without one); the SHA-256 of any other token.
#ifndef MAINSTAY_TESTS_TESTING_JOB_TOKEN_H_
#define MAINSTAY_TESTS_TESTING_JOB_TOKEN_H_

#include <openssl/sha.h>

#include <string>

namespace mainstay::testing {

inline constexpr char kToken[] = "test-token";

// The SHA-256 of any token (raw bytes), as AssignShard carries it.
inline std::string Sha256Of(const std::string& token) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(token.data()), token.size(), digest);
  return std::string(reinterpret_cast<const char*>(digest), sizeof(digest));
}

inline std::string TokenSha256() { return Sha256Of(kToken); }

}  // namespace mainstay::testing

#endif  // MAINSTAY_TESTS_TESTING_JOB_TOKEN_H_
