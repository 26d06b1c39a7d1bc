// `loom check-layouts`: is a loss gap between parallel layouts a bug? Runs a reference (one process
// by default) and each layout on the same data, seed and global batch in deterministic mode, and
// compares every step's loss, gradient norm, gradients and updated parameters; on the first step
// where something differs beyond the tolerance it names what (a parameter, the norm alone, the
// loss) and, for a gradient, re-runs that step with hooks to name the first module whose output or
// input gradient differs. Exit 0 when every layout matches, 1 on a divergence, 2 on bad input.
// See docs/check_layouts.md.
#pragma once
#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace loom::layouts {

struct CheckOptions {
  std::string config;
  std::vector<std::string> layouts;
  std::string reference = "fsdp=1";
  int64_t steps = 3;
  double tolerance = 1e-5;
  std::string json;      // where to write the JSON report; empty: none
  std::string work_dir;  // empty: a temporary folder, removed at the end unless `keep`
  bool keep = false;
  // > 0: also re-run this step of the reference and every layout with hooks and print each recorded
  // module's output and gradient difference, whatever the verdict.
  int64_t probe_step = 0;
  std::vector<std::string> after_dash;  // the train overrides given after `--`
};

// Runs the check; returns the exit code (0 every layout matches, 1 a divergence). Bad input throws
// loom::UsageError before anything is launched; a run that fails throws loom::Error.
int check_layouts(const CheckOptions& options, const std::vector<std::string>& overrides);

// Registers `loom check-layouts` and its hidden rank command.
void register_check_layouts_command(CLI::App& app);

}  // namespace loom::layouts
