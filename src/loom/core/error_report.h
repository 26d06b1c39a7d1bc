// How a process reports the error that ends it, in one place for every subcommand:
//   - one line on stderr, "error: <message>" ("[rankN] error: ..." in a world of several ranks, so
//     a launcher's merged output says who failed);
//   - the same line in the file named by LOOM_ERROR_FILE, when set (`loom launch` sets one per rank
//     and quotes it in its failure line, as TorchElastic does with TORCHELASTIC_ERROR_FILE);
//   - the abort hooks, which higher layers install (distributed/ tells the other ranks to stop, so their
//     collectives do not wait for a rank that is gone). They run first and may rewrite the report:
//     an error that is only the echo of another rank's failure (a collective broken by a peer that
//     left) is reported as "stopping: rank R: <R's error>" with exit code 4.
// The report happens before any destructor runs, so a shutdown that could block never hides it.
#pragma once
#include <exception>
#include <functional>
#include <string>

namespace loom {

struct ErrorReport {
  std::string message;  // one line, without the "error: " prefix
  int exit_code = 1;
  // How long report_error waits after printing, set by a hook (rank 0 keeps the rendezvous store
  // up a moment so the other ranks can read why they must stop).
  int linger_ms = 0;
};

// The report for an exception: loom::Error keeps its exit code; c10::Error is shown without its
// C++ backtrace; anything else is exit code 1.
ErrorReport describe_exception(std::exception_ptr error);

// Thrown after report_error() by code that reported an error itself (before unwinding through
// destructors that might block); main() only returns its exit code.
class ReportedError : public std::exception {
 public:
  explicit ReportedError(int exit_code) : exit_code_(exit_code) {}
  int exit_code() const { return exit_code_; }
  const char* what() const noexcept override { return "error already reported"; }

 private:
  int exit_code_;
};

// Runs the abort hooks (newest first; they may rewrite `report`), then prints the line and writes
// LOOM_ERROR_FILE. Safe to call more than once; only the first report of a process is written and
// propagated. Returns the report as printed.
ErrorReport report_error(ErrorReport report);

// A command that streams text to stdout without a newline yet (`loom generate` prints tokens as
// they come) says so here; report_error then ends that line first, so the error starts a line of
// its own ("hi\nerror: ..." where stdout and stderr share a terminal, not "hierror: ...").
void set_stdout_line_open(bool open);

// Whether the launcher's environment says this process is one of several ranks.
bool several_ranks_launched();

// For a command's catch (...) block (`loom train`, `loom rl`): reports the exception in flight at
// once, then, with several ranks, ends the process without unwinding into collectives the peers may
// never join (the report tells them to stop); alone, throws ReportedError with its exit code.
[[noreturn]] void report_current_exception_and_exit();

// `hook(report)` runs inside report_error. Returns an id for remove_abort_hook.
int add_abort_hook(std::function<void(ErrorReport&)> hook);
void remove_abort_hook(int id);

}  // namespace loom
