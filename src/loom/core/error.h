// User-facing errors. Every bad input becomes one line that names the problem and the fix; the CLI
// prints it as "error: <message>" and exits with the error's code. Internal invariants use
// TORCH_CHECK / TORCH_INTERNAL_ASSERT instead.
//
// Exit codes: one classification for every command, and what `loom launch` does with each (a
// restart repeats the same run from the newest checkpoint, so it only helps where the cause can go
// away). The launcher ends with the code of the rank that failed first.
//   1    an error (I/O, a crashed peer, ...)                     restarted
//   2    bad configuration or usage, or a checkpoint that this   never restarted
//        configuration cannot load (another model shape,
//        optimizer, vocabulary, sequence length or corpus)
//   3    training diverged (non-finite loss or gradient norm)    never restarted
//   4    stopped because another rank failed first               restarted
//   124  a collective outlived comm.timeout_seconds (watchdog)   restarted
#pragma once
#include <c10/util/StringUtil.h>

#include <stdexcept>
#include <string>

namespace loom {

inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;
inline constexpr int kExitDiverged = 3;
inline constexpr int kExitPeerFailed = 4;
// What coreutils `timeout` uses for "timed out" (distributed/watchdog.h exits with it).
inline constexpr int kExitWatchdog = 124;

// Whether a restart of the same job can succeed where this exit code failed.
inline bool exit_code_is_retryable(int code) { return code != kExitUsage && code != kExitDiverged; }

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

// A checkpoint saved by another configuration (model shape, optimizer, vocabulary, sequence length,
// corpus): exit code 2 like a configuration error, since a restart would read the same checkpoint
// with the same configuration and fail the same way.
class IncompatibleCheckpointError : public Error {
 public:
  explicit IncompatibleCheckpointError(const std::string& message) : Error(message, kExitUsage) {}
};

// An allocation that did not fit (memory::rethrow_with_allocation_context names what and how
// much): exit code 1 like any failure, and its own type so that callers turning their input's
// errors into usage errors (models/common/model_dir.cpp) leave it as it is.
class MemoryError : public Error {
 public:
  using Error::Error;
};

// Training produced a non-finite loss or gradient norm: exit code 3.
class DivergedError : public Error {
 public:
  explicit DivergedError(const std::string& message) : Error(message, kExitDiverged) {}
};

template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  throw Error(c10::str(args...));
}

template <typename... Args>
[[noreturn]] void fail_incompatible_checkpoint(const Args&... args) {
  throw IncompatibleCheckpointError(c10::str(args...));
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
// LOOM_REQUIRE_COMPATIBLE(cond, ...): the same for a checkpoint this configuration cannot load
// (IncompatibleCheckpointError, exit code 2).
#define LOOM_REQUIRE_COMPATIBLE(cond, ...)                        \
  do {                                                            \
    if (!(cond)) ::loom::fail_incompatible_checkpoint(__VA_ARGS__); \
  } while (0)
#define LOOM_REQUIRE_USAGE(cond, ...)          \
  do {                                         \
    if (!(cond)) ::loom::fail_usage(__VA_ARGS__); \
  } while (0)
