// ClusterSecret (common/cluster_secret.h): made once with mode 0600 and read back, refused when
// short or missing (naming the path, never the content), matched only by the same value; and
// which listen addresses count as loopback.
#include "common/cluster_secret.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdio>
#include <string>

#include "tests/testing/status_matchers.h"
#include "tests/testing/subprocess.h"

namespace mainstay {
namespace {

using ::mainstay::testing::IsOk;
using ::mainstay::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::Not;

void Write(const std::string& path, const std::string& text) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fputs(text.c_str(), f);
  std::fclose(f);
}

TEST(ClusterSecretTest, CreatedOnceWithMode0600AndReadBackTheSame) {
  auto dir = testing::TempDir::Create("secret").value();
  const std::string path = dir->File("cluster.secret");
  absl::StatusOr<ClusterSecret> made = ClusterSecret::Load(path, /*create=*/true);
  ASSERT_THAT(made.status(), IsOk());
  struct stat st;
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(made->value().size(), 64u);
  absl::StatusOr<ClusterSecret> again = ClusterSecret::Load(path, /*create=*/true);
  ASSERT_THAT(again.status(), IsOk());
  EXPECT_EQ(again->value(), made->value()) << "a second start must not replace the secret";
  EXPECT_TRUE(made->Matches(again->value()));
  absl::StatusOr<ClusterSecret> other = ClusterSecret::Load(dir->File("other.secret"), /*create=*/true);
  ASSERT_THAT(other.status(), IsOk());
  EXPECT_NE(other->value(), made->value());
  EXPECT_FALSE(made->Matches(other->value()));
  EXPECT_FALSE(made->Matches(""));
  EXPECT_FALSE(made->Matches(made->value().substr(0, 63)));
  EXPECT_FALSE(made->Matches(made->value() + "0"));
}

TEST(ClusterSecretTest, MissingShortOrEmptyFilesAreInvalidArgumentNamingThePath) {
  auto dir = testing::TempDir::Create("secret").value();
  EXPECT_THAT(ClusterSecret::Load(dir->File("missing"), /*create=*/false).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(dir->File("missing") + ": cannot read")));
  Write(dir->File("short"), "hunter2hunter2\n");
  EXPECT_THAT(ClusterSecret::Load(dir->File("short"), false).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, Not(HasSubstr("hunter2"))));
  Write(dir->File("empty"), "\n");
  EXPECT_THAT(ClusterSecret::Load(dir->File("empty"), true).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("empty")));
  EXPECT_THAT(ClusterSecret::Load(dir->path(), false).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a regular file")));
  // A hand-made secret of enough bytes is taken as written (its newline dropped).
  Write(dir->File("mine"), std::string(40, 'k') + "\n");
  absl::StatusOr<ClusterSecret> mine = ClusterSecret::Load(dir->File("mine"), false);
  ASSERT_THAT(mine.status(), IsOk());
  EXPECT_EQ(mine->value(), std::string(40, 'k'));
  EXPECT_FALSE(ClusterSecret().enabled());
  EXPECT_FALSE(ClusterSecret().Matches(""));
}

TEST(ClusterSecretTest, LoopbackListenAddresses) {
  for (const char* a : {"127.0.0.1:0", "127.0.0.1:7070", "127.1.2.3:1", "localhost:7071", "[::1]:7070", "unix:/run/x"}) {
    EXPECT_TRUE(IsLoopbackListenAddress(a)) << a;
  }
  for (const char* a : {"0.0.0.0:7070", "[::]:7070", "10.0.0.1:7071", "127.0.0.1.evil.com:1", "127.0.0:1",
                        "host.example:7070", "128.0.0.1:1", "127.0.0.256:1"}) {
    EXPECT_FALSE(IsLoopbackListenAddress(a)) << a;
  }
}

}  // namespace
}  // namespace mainstay
