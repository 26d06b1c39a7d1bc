// Test support: a fresh folder per test and files written into it.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <c10/util/StringUtil.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace loom::testing {

// An empty folder under the system temp folder, named after the process and the running test.
inline std::filesystem::path temp_dir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    c10::str("loom_test_", ::getpid(), "_", info->test_suite_name(), "_", info->name());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// Writes `text` to `path` as it is (binary).
inline void write(const std::filesystem::path& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

}  // namespace loom::testing
