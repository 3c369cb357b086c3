// main() of the GPU test binaries: exit 77 (CTest's SKIP_RETURN_CODE) when every test that ran
// was skipped (no device), otherwise googletest's own result. A binary with one skipped case and
// one failed case fails: a skip never hides a failure (a regular expression on "SKIPPED" in the
// output, which these tests used before, marked such a run skipped).
#include <gtest/gtest.h>

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const int result = RUN_ALL_TESTS();
  if (result != 0) return result;
  const ::testing::UnitTest& unit = *::testing::UnitTest::GetInstance();
  if (unit.test_to_run_count() > 0 && unit.skipped_test_count() == unit.test_to_run_count()) return 77;
  return 0;
}
