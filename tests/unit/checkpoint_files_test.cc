// Checkpoint files (server/checkpoint): what is written reads back in model space across
// files and sections, and every kind of damage is DATA_LOSS naming the file, never data.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <numeric>

#include "server/checkpoint/checkpoint_files.h"
#include "tests/testing/status_matchers.h"

namespace mainstay::checkpoint {
namespace {

using ::mainstay::testing::IsOk;
using ::mainstay::testing::StatusIs;
using ::testing::HasSubstr;

constexpr char kDir[] = "/c";

// Tensor "w" of 10 elements split [0, 6) into b0.s0 and [6, 10) into b0.s1, plus tensor "b"
// of 3 elements in b0.s1. Masters are the element index (+100 for "b"), m = 2x, v = 3x.
v1::CheckpointManifest WriteTwoFiles(CheckpointFs& fs) {
  auto section = [](const std::string& name, int64_t begin, int64_t end, float base, std::vector<float>& keep) {
    keep.clear();
    for (int64_t i = begin; i < end; ++i) keep.push_back(base + static_cast<float>(i));
    for (int64_t i = begin; i < end; ++i) keep.push_back(2 * (base + static_cast<float>(i)));
    for (int64_t i = begin; i < end; ++i) keep.push_back(3 * (base + static_cast<float>(i)));
    const size_t n = static_cast<size_t>(end - begin);
    SectionData s;
    s.tensor_name = name;
    s.begin = begin;
    s.end = end;
    s.master = {keep.data(), n};
    s.m = {reinterpret_cast<const uint8_t*>(keep.data() + n), n * 4};
    s.v = {reinterpret_cast<const uint8_t*>(keep.data() + 2 * n), n * 4};
    return s;
  };
  std::vector<float> k1, k2, k3;
  v1::CheckpointManifest manifest;
  manifest.set_checkpoint_id("c");
  manifest.set_moment_type(v1::ELEMENT_TYPE_FP32);
  manifest.set_has_second_moment(true);
  absl::StatusOr<v1::CheckpointFile> f0 = WriteDataFile(fs, kDir, 0, 0, {section("w", 0, 6, 0, k1)});
  absl::StatusOr<v1::CheckpointFile> f1 =
      WriteDataFile(fs, kDir, 0, 1, {section("w", 6, 10, 0, k2), section("b", 0, 3, 100, k3)});
  EXPECT_THAT(f0.status(), IsOk());
  EXPECT_THAT(f1.status(), IsOk());
  *manifest.add_files() = *f0;
  *manifest.add_files() = *f1;
  EXPECT_THAT(WriteManifest(fs, kDir, manifest), IsOk());
  return manifest;
}

TEST(CheckpointFilesTest, ARangeAcrossTwoFilesReadsBackExactly) {
  MemFs fs;
  WriteTwoFiles(fs);
  absl::StatusOr<v1::CheckpointManifest> manifest = ReadManifest(fs, kDir);
  ASSERT_THAT(manifest.status(), IsOk());
  EXPECT_THAT(VerifyDataFiles(fs, kDir, *manifest).status(), IsOk());
  CheckpointReader reader(fs, kDir, *manifest);
  std::vector<float> master(5), m(5), v(5);
  ASSERT_THAT(reader.ReadRange("w", 4, 9, master.data(), reinterpret_cast<uint8_t*>(m.data()),
                               reinterpret_cast<uint8_t*>(v.data())),
              IsOk());
  EXPECT_THAT(master, ::testing::ElementsAre(4, 5, 6, 7, 8));
  EXPECT_THAT(m, ::testing::ElementsAre(8, 10, 12, 14, 16));
  EXPECT_THAT(v, ::testing::ElementsAre(12, 15, 18, 21, 24));
  ASSERT_THAT(reader.ReadRange("b", 1, 3, master.data(), reinterpret_cast<uint8_t*>(m.data()),
                               reinterpret_cast<uint8_t*>(v.data())),
              IsOk());
  EXPECT_EQ(master[0], 101);
  EXPECT_EQ(v[1], 306);
}

TEST(CheckpointFilesTest, ARangeTheFilesDoNotCoverIsDataLoss) {
  MemFs fs;
  v1::CheckpointManifest manifest = WriteTwoFiles(fs);
  manifest.mutable_files()->RemoveLast();  // as if b0.s1 were missing
  CheckpointReader reader(fs, kDir, manifest);
  std::vector<float> master(10), m(10), v(10);
  absl::Status s = reader.ReadRange("w", 0, 10, master.data(), reinterpret_cast<uint8_t*>(m.data()),
                                    reinterpret_cast<uint8_t*>(v.data()));
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(std::string(s.message()), HasSubstr("[6, 10)"));
  EXPECT_THAT(reader.ReadRange("nope", 0, 1, master.data(), nullptr, nullptr), StatusIs(absl::StatusCode::kNotFound));
}

TEST(CheckpointFilesTest, AFlippedByteIsDataLossNamingTheFile) {
  MemFs fs;
  v1::CheckpointManifest manifest = WriteTwoFiles(fs);
  fs.Corrupt("/c/b0.s1.state", 30);
  absl::StatusOr<int64_t> verified = VerifyDataFiles(fs, kDir, manifest);
  EXPECT_THAT(verified.status(), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(std::string(verified.status().message()), HasSubstr("/c/b0.s1.state"));
  CheckpointReader reader(fs, kDir, manifest);
  std::vector<float> master(4), m(4), v(4);
  absl::Status s = reader.ReadRange("w", 6, 10, master.data(), reinterpret_cast<uint8_t*>(m.data()),
                                    reinterpret_cast<uint8_t*>(v.data()));
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(std::string(s.message()), HasSubstr("CRC-32C mismatch"));
}

TEST(CheckpointFilesTest, ATruncatedDataFileIsDataLoss) {
  MemFs fs;
  v1::CheckpointManifest manifest = WriteTwoFiles(fs);
  fs.Truncate("/c/b0.s0.state", 20);
  absl::StatusOr<int64_t> verified = VerifyDataFiles(fs, kDir, manifest);
  EXPECT_THAT(verified.status(), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(std::string(verified.status().message()), HasSubstr("truncated"));
}

TEST(CheckpointFilesTest, ADamagedOrMissingManifestIsRefused) {
  MemFs fs;
  EXPECT_THAT(ReadManifest(fs, kDir).status(), StatusIs(absl::StatusCode::kNotFound));
  WriteTwoFiles(fs);
  {
    MemFs copy;
    WriteTwoFiles(copy);
    copy.Truncate("/c/MANIFEST", 30);
    absl::StatusOr<v1::CheckpointManifest> m = ReadManifest(copy, kDir);
    EXPECT_THAT(m.status(), StatusIs(absl::StatusCode::kDataLoss));
    EXPECT_THAT(std::string(m.status().message()), HasSubstr("truncated"));
  }
  fs.Corrupt("/c/MANIFEST", 25);
  absl::StatusOr<v1::CheckpointManifest> m = ReadManifest(fs, kDir);
  EXPECT_THAT(m.status(), StatusIs(absl::StatusCode::kDataLoss));
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("/c/MANIFEST"));
}

TEST(CheckpointFilesTest, PosixWritesAreAtomicAndAnAbandonedWriteLeavesNothing) {
  const std::string dir = ::testing::TempDir() + "/mainstay_ckpt_posix";
  CheckpointFs& fs = *PosixFs();
  ASSERT_THAT(fs.RemoveAll(dir), IsOk());
  ASSERT_THAT(fs.CreateDirs(dir), IsOk());
  {
    absl::StatusOr<std::unique_ptr<AtomicWriter>> w = fs.NewAtomicWriter(dir + "/f");
    ASSERT_THAT(w.status(), IsOk());
    const uint8_t bytes[3] = {1, 2, 3};
    ASSERT_THAT((*w)->Append(bytes), IsOk());
    EXPECT_THAT(fs.FileSize(dir + "/f").status(), StatusIs(absl::StatusCode::kNotFound));  // not before Commit
  }  // abandoned
  absl::StatusOr<std::vector<std::string>> names = fs.ListDir(dir);
  ASSERT_THAT(names.status(), IsOk());
  EXPECT_TRUE(names->empty()) << (*names)[0];
  absl::StatusOr<std::unique_ptr<AtomicWriter>> w = fs.NewAtomicWriter(dir + "/f");
  ASSERT_THAT(w.status(), IsOk());
  const uint8_t bytes[3] = {1, 2, 3};
  ASSERT_THAT((*w)->Append(bytes), IsOk());
  ASSERT_THAT((*w)->Commit(), IsOk());
  EXPECT_EQ(*fs.FileSize(dir + "/f"), 3);
  std::vector<uint8_t> back(4);
  EXPECT_THAT(fs.ReadAt(dir + "/f", 0, back), StatusIs(absl::StatusCode::kDataLoss));
  ASSERT_THAT(fs.RemoveAll(dir), IsOk());
}

TEST(CheckpointFilesTest, OnlyPathsUnderTheRootPass) {
  EXPECT_THAT(CheckPathUnder("/ck", "/ck/job-1-s5/MANIFEST", "uri"), IsOk());
  EXPECT_THAT(CheckPathUnder("/ck/", "/ck/job-1-s5", "uri"), IsOk());
  EXPECT_THAT(CheckPathUnder("/ck", "/ck", "uri"), IsOk());
  EXPECT_THAT(CheckPathUnder("rel/ck", "rel/ck/x", "uri"), IsOk());
  EXPECT_THAT(CheckPathUnder("/ck", "/ck/../etc/MANIFEST", "uri"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'..' component")));
  EXPECT_THAT(CheckPathUnder("/ck", "/ckx/MANIFEST", "uri"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("outside the checkpoint directory '/ck'")));
  EXPECT_THAT(CheckPathUnder("/ck", "/etc/passwd", "uri"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(CheckPathUnder("/ck", "ck/x", "uri"), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(CheckPathUnder("", "/ck/x", "uri"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no --checkpoint-dir")));
}

}  // namespace
}  // namespace mainstay::checkpoint
