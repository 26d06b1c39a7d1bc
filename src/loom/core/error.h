// User-facing errors. Every bad input becomes one line that names the problem and the fix; the CLI
// prints it as "error: <message>" and exits with the error's code (2 = bad configuration or usage,
// 1 = everything else). Internal invariants use TORCH_CHECK / TORCH_INTERNAL_ASSERT instead.
#pragma once
#include <c10/util/StringUtil.h>

#include <stdexcept>
#include <string>

namespace loom {

inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message, int exit_code = kExitFailure)
      : std::runtime_error(message), exit_code_(exit_code) {}
  int exit_code() const { return exit_code_; }

 private:
  int exit_code_;
};

// A configuration or command-line mistake: exit code 2.
class UsageError : public Error {
 public:
  explicit UsageError(const std::string& message) : Error(message, kExitUsage) {}
};

template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  throw Error(c10::str(args...));
}

template <typename... Args>
[[noreturn]] void fail_usage(const Args&... args) {
  throw UsageError(c10::str(args...));
}

}  // namespace loom

// LOOM_REQUIRE(cond, "what is wrong", "; fix: ...") throws loom::Error when cond is false.
#define LOOM_REQUIRE(cond, ...)          \
  do {                                   \
    if (!(cond)) ::loom::fail(__VA_ARGS__); \
  } while (0)
#define LOOM_REQUIRE_USAGE(cond, ...)          \
  do {                                         \
    if (!(cond)) ::loom::fail_usage(__VA_ARGS__); \
  } while (0)
