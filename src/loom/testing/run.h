// Test support shared by every folder's multi-process tests: run a command with a hard time limit
// and capture its output, and find the binaries that sit next to the running test binary.
#pragma once
#include <sys/wait.h>

#include <array>
#include <cstdlib>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "loom/core/build_paths.h"

namespace loom::testing {

struct RunResult {
  int exit_code = -1;  // -1 when killed by a signal (including the time limit)
  std::string output;  // stdout and stderr interleaved
  double seconds = 0;
};

// A file of the source tree (e.g. configs/llama3_debug.toml), as an absolute path.
inline std::string source_path(const std::string& rel) { return std::string(loom::kSourceDir) + "/" + rel; }

// <build>/bin: every Loom executable (loom, loom_*_tests, loom_*_worker) lands there.
inline std::string bin_dir() {
  return std::filesystem::read_symlink("/proc/self/exe").parent_path().string();
}

inline std::string loom_bin() { return bin_dir() + "/loom"; }

// Runs `command` through the shell; a hang fails the test instead of blocking ctest.
inline RunResult run(const std::string& command, int limit_seconds = 120) {
  const std::string full =
      "timeout -k 5 " + std::to_string(limit_seconds) + " " + command + " 2>&1";
  const auto start = std::chrono::steady_clock::now();
  RunResult result;
  FILE* pipe = popen(full.c_str(), "r");
  if (pipe == nullptr) return result;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) result.output.append(buf.data(), n);
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

// A fresh temporary directory, removed when the object goes out of scope.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "loom-test") {
    std::string templ = (std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")).string();
    path_ = mkdtemp(templ.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }
  std::string str() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

// Every JSON object of a JSONL file (e.g. metrics.jsonl).
inline std::vector<nlohmann::json> read_jsonl(const std::filesystem::path& path) {
  std::vector<nlohmann::json> rows;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) rows.push_back(nlohmann::json::parse(line));
  }
  return rows;
}

// The loss of every logged step in a run folder's metrics.jsonl, in order (resume markers and
// other events, and rows without a training loss such as validation's, skipped).
inline std::vector<double> logged_losses(const std::filesystem::path& dump_folder) {
  std::vector<double> out;
  for (const auto& row : read_jsonl(dump_folder / "metrics.jsonl")) {
    if (!row.contains("event") && row.contains("loss")) out.push_back(row["loss"]);
  }
  return out;
}

// The gradient norm (before clipping) of every logged step, in the order of logged_losses.
inline std::vector<double> logged_grad_norms(const std::filesystem::path& dump_folder) {
  std::vector<double> out;
  for (const auto& row : read_jsonl(dump_folder / "metrics.jsonl")) {
    if (!row.contains("event") && row.contains("loss") && row.contains("grad_norm")) out.push_back(row["grad_norm"]);
  }
  return out;
}

// The logged losses of a run in `dir` (see logged_losses).
inline std::vector<double> losses(const TempDir& dir) { return logged_losses(dir.path()); }

// Flags a parity test appends to every run it checks (never to its reference): empty in the suite.
// A mutation check sets them to break what the test checks, e.g.
//   LOOM_TEST_BREAK_LAYOUTS="--optimizer.lr=1.01e-3" build/bin/loom_train_tests --gtest_filter='TrainerTP.*'
// and every layout of the table must then fail: the smaller model and the fewer steps still see
// a 1 % change of one layout's update.
inline std::string layout_breakage() {
  const char* flags = std::getenv("LOOM_TEST_BREAK_LAYOUTS");
  return flags == nullptr ? std::string() : std::string(" ") + flags;
}

// A file's whole content (empty when it cannot be read): e.g. to compare checkpoints bitwise.
inline std::string file_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// How many times `needle` occurs in `haystack` (overlapping matches count): e.g. how many ranks
// printed a line in a launcher's combined output.
inline int count_occurrences(const std::string& haystack, const std::string& needle) {
  int n = 0;
  for (size_t pos = haystack.find(needle); pos != std::string::npos;
       pos = haystack.find(needle, pos + 1)) {
    ++n;
  }
  return n;
}

}  // namespace loom::testing
