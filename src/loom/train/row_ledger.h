// The rows ledger of an elastic run (metrics.jsonl's {"event": "rows"} lines, TrainerHooks::
// row_ledger): which global rows each step trained on. check_row_ledger reads it the way the run
// happened -- a "resume" marker (a new membership, or a restart from a checkpoint) supersedes the
// lines of the steps after it -- and says whether every row from the first to the last was trained
// exactly once, in order.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>

#include <CLI/CLI.hpp>

namespace loom::train {

struct RowLedger {
  int64_t steps = 0;         // steps in the final record
  int64_t rows = 0;          // rows they trained on: [0, rows)
  int64_t memberships = 0;   // "membership" events
  int64_t superseded = 0;    // ledger lines dropped by a later resume (steps re-run)
  std::string problem;       // empty: every row exactly once; else the first problem, one line
  bool ok() const { return problem.empty(); }
  std::string describe() const;
};

// Reads `path` (a metrics.jsonl, or a run folder holding one). loom::Error when it cannot be read.
RowLedger check_row_ledger(const std::filesystem::path& path);

// `loom ledger RUN`: prints describe(); exit 1 when a row was skipped or trained twice.
void register_ledger_command(CLI::App& app);

}  // namespace loom::train
