// `loom plot`: training curves from metrics.jsonl as one self-contained SVG (no script, no
// external fonts or styles, so any browser, viewer or Markdown page shows it as it is): a panel
// per metric (loss, learning rate, tokens/s per rank) against step, each run one colour in every
// panel, a legend with the run names, so several runs can be compared on the same axes.
#pragma once
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace loom::train {

// One run's logged rows, in step order.
struct RunCurves {
  std::string name;            // the legend's label
  std::vector<int64_t> steps;  // ascending, each once
  // metric key (metrics.jsonl's: "loss", "lr", "tps", ...) -> one value per step (NaN where the
  // row had null or lacked the key).
  std::map<std::string, std::vector<double>> values;
};

// Reads `<run_dir>/metrics.jsonl` (or `run`, when it names a .jsonl file). A resumed run's marker
// {"event":"resume","step":N} drops the rows after step N logged before it: the rows that follow
// supersede them, as they do for every reader of metrics.jsonl. loom::UsageError when the file is
// missing or holds no rows; loom::Error naming the line when one is not JSON, except a cut last
// line (no '\n' after it: a crash or a full disk while logging), which is skipped with a warning.
RunCurves read_run_curves(const std::filesystem::path& run, const std::string& name);

// The panels drawn, top to bottom: metric key and its axis title.
struct PlotPanel {
  std::string key;
  std::string title;
};
const std::vector<PlotPanel>& plot_panels();

// The SVG document. Each series is one <polyline> with data-run="<name>" and
// data-metric="<key>" (one point per step with a finite value; a run with one such point also gets
// a <circle>), so tests and scripts can find them.
std::string render_plot_svg(const std::vector<RunCurves>& runs);

// Legend names for run folders: the last path component, or as many trailing components as it
// takes to tell them apart (two runs both called ".../llama3_debug").
std::vector<std::string> run_names(const std::vector<std::filesystem::path>& runs);

// Reads every run and writes the SVG to `out` (atomically: a temporary file renamed over it).
void write_plot(const std::vector<std::filesystem::path>& runs, const std::filesystem::path& out);

}  // namespace loom::train
