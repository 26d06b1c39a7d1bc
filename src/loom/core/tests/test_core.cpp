#include <gtest/gtest.h>

#include <vector>

#include "loom/core/error.h"
#include "loom/core/memory.h"

TEST(Error, CarriesMessageAndExitCode) {
  try {
    loom::fail_usage("bad key 'x'", "; did you mean 'y'?");
    FAIL() << "no throw";
  } catch (const loom::Error& e) {
    EXPECT_EQ(std::string(e.what()), "bad key 'x'; did you mean 'y'?");
    EXPECT_EQ(e.exit_code(), loom::kExitUsage);
  }
  EXPECT_THROW(LOOM_REQUIRE(1 == 2, "one is not two"), loom::Error);
}

TEST(Memory, PeakTracksAllocationAndResets) {
  const int64_t before = loom::memory::peak_rss_bytes();
  EXPECT_GT(before, 0);
  {
    std::vector<char> big(64 << 20, 1);  // touch 64 MiB
    EXPECT_GE(loom::memory::peak_rss_bytes(), before + (60 << 20));
  }
  if (loom::memory::reset_peak_rss()) {
    EXPECT_LT(loom::memory::peak_rss_bytes(), before + (60 << 20));
  }
}
