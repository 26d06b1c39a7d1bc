// Test support: bitwise comparison of two runs' checkpoints, file by file.
#pragma once
#include <gtest/gtest.h>

#include <filesystem>
#include <initializer_list>

#include "loom/testing/run.h"

namespace loom::testing {

// Every named file of checkpoint folder `a` exists, is non-empty, and is byte-identical to the
// same file in `b` (e.g. ".../step-12" of an interrupted run against an uninterrupted one).
inline void expect_identical_checkpoint_files(const std::filesystem::path& a,
                                              const std::filesystem::path& b,
                                              std::initializer_list<const char*> files) {
  for (const char* f : files) {
    const std::string x = file_bytes(a / f);
    EXPECT_FALSE(x.empty()) << a / f;
    EXPECT_TRUE(x == file_bytes(b / f)) << (a / f) << " differs from " << (b / f);
  }
}

}  // namespace loom::testing
