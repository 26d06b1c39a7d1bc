#include "loom/train/plot.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

#include "loom/core/error.h"
#include "loom/core/logging.h"
#include "loom/core/strings.h"

namespace loom::train {
namespace fs = std::filesystem;
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Geometry in SVG user units (= CSS pixels at 100 % zoom).
constexpr double kWidth = 960;
constexpr double kLeft = 90;          // room for y tick labels
constexpr double kRight = 30;
constexpr double kPanelHeight = 220;  // plot area of one panel
constexpr double kPanelGap = 75;      // x tick labels, "step", the next panel's title
constexpr double kLegendRow = 22;
constexpr int kLegendColumns = 4;

// matplotlib's default cycle (tab10): distinct for colour-blind readers, familiar to ML users.
constexpr const char* kColours[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};

std::string xml_escape(const std::string& text) {
  std::string out;
  for (const char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string num(double v) {  // coordinates: two decimals are finer than any screen pixel
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f", v);
  return buf;
}

// Ticks at 1, 2 or 5 x 10^k covering [lo, hi] with about `target` intervals (the usual "nice
// numbers" choice: labels a reader can add up in their head).
struct Ticks {
  double lo = 0.0, hi = 1.0, step = 1.0;
  std::vector<double> values;
};

Ticks nice_ticks(double lo, double hi, int target) {
  if (!(hi > lo)) {  // one value (or a constant curve): a band around it
    const double pad = lo == 0.0 ? 1.0 : std::abs(lo) * 0.1;
    lo -= pad;
    hi += pad;
  }
  const double raw = (hi - lo) / target;
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  double step = 10.0 * magnitude;
  for (const double m : {1.0, 2.0, 5.0}) {
    if (m * magnitude >= raw) {
      step = m * magnitude;
      break;
    }
  }
  Ticks t;
  t.lo = lo;
  t.hi = hi;
  t.step = step;
  for (double v = std::ceil(lo / step - 1e-9) * step; v <= hi + step * 1e-9; v += step) {
    t.values.push_back(std::abs(v) < step * 1e-9 ? 0.0 : v);  // no "-0"
  }
  return t;
}

// A tick label with as many digits as the tick spacing needs: "0.5", "1500", "2.0e-04".
std::string tick_label(double v, double step, double largest) {
  char buf[32];
  if (largest >= 1e5 || step < 1e-3) {
    const int digits = std::clamp(static_cast<int>(std::floor(std::log10(largest)) -
                                                   std::floor(std::log10(step))),
                                  0, 6);
    std::snprintf(buf, sizeof(buf), "%.*e", digits, v);
  } else {
    const int decimals = std::max(0, static_cast<int>(-std::floor(std::log10(step) + 1e-9)));
    std::snprintf(buf, sizeof(buf), "%.*f", decimals, v);
  }
  return buf;
}

int64_t row_step(const nlohmann::json& row) { return row.at("step").get<int64_t>(); }

}  // namespace

const std::vector<PlotPanel>& plot_panels() {
  static const std::vector<PlotPanel> panels = {
      {"loss", "loss"}, {"lr", "learning rate"}, {"tps", "tokens/s per rank"}};
  return panels;
}

RunCurves read_run_curves(const fs::path& run, const std::string& name) {
  const fs::path file = run.extension() == ".jsonl" ? run : run / "metrics.jsonl";
  // Regular files only: opening a FIFO would wait for a writer, perhaps forever.
  std::error_code ec;
  const bool regular = fs::is_regular_file(file, ec);
  std::ifstream in;
  if (regular) in.open(file);
  LOOM_REQUIRE_USAGE(regular && in.good(), "cannot read '", file.string(), "': give a run folder (job.dump_folder) "
                     "that holds metrics.jsonl, or the .jsonl file itself");
  std::map<int64_t, nlohmann::json> rows;  // by step: rows of one step merged, later keys win
  std::string line;
  for (int64_t number = 1; std::getline(in, line); ++number) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json row;
    try {
      row = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      // getline stopped at the end of the file, not at a '\n': the last line is cut (a crash or
      // a full disk while logging, or a run still writing it). The rows before it are whole.
      if (in.eof()) {
        log::warn("plot: skipping the cut last line ", number, " of ", file.string(), " (", line.size(),
                  " bytes without a line end)");
        break;
      }
      // Damage in the middle is not what a crash leaves: say where, quoting only the start.
      fail(file.string(), ":", number, " is not a JSON object (", excerpt(e.what(), 160),
           "); repair or delete that line");
    }
    LOOM_REQUIRE(row.is_object(), file.string(), ":", number, " is not a JSON object");
    if (row.contains("event")) {
      if (row["event"] == "resume" && row.contains("step")) {
        // The checkpoint the run resumed from: what the interrupted run logged after it is redone.
        rows.erase(rows.upper_bound(row_step(row)), rows.end());
      }
      continue;
    }
    if (!row.contains("step") || !row["step"].is_number_integer()) continue;
    // Rows of one step merge (the training row, then e.g. validation's); a later value of the same
    // key wins (a resumed run's row replaces the interrupted run's).
    const int64_t step = row_step(row);
    rows[step].update(row);
  }
  LOOM_REQUIRE_USAGE(!rows.empty(), file.string(), " holds no logged steps yet");
  RunCurves curves;
  curves.name = name;
  std::set<std::string> keys;
  for (const auto& [step, row] : rows) {
    for (const auto& [key, value] : row.items()) {
      if (key != "step" && (value.is_number() || value.is_null())) keys.insert(key);
    }
  }
  for (const std::string& key : keys) curves.values[key].reserve(rows.size());
  for (const auto& [step, row] : rows) {
    curves.steps.push_back(step);
    for (const std::string& key : keys) {
      const auto it = row.find(key);
      curves.values[key].push_back(it != row.end() && it->is_number() ? it->get<double>() : kNaN);
    }
  }
  return curves;
}

std::vector<std::string> run_names(const std::vector<fs::path>& runs) {
  std::vector<std::vector<std::string>> parts;  // each run's path components, last first
  for (const fs::path& run : runs) {
    fs::path dir = fs::absolute(run).lexically_normal();
    if (dir.extension() == ".jsonl") dir = dir.parent_path();
    if (!dir.has_filename()) dir = dir.parent_path();  // "outputs/run/" -> "outputs/run"
    std::vector<std::string> components;
    for (const auto& c : dir) {
      if (!c.empty() && c != "/") components.push_back(c.string());
    }
    std::reverse(components.begin(), components.end());
    parts.push_back(components);
  }
  std::vector<std::string> names(runs.size());
  for (size_t depth = 1;; ++depth) {
    for (size_t i = 0; i < runs.size(); ++i) {
      std::string name;
      for (size_t k = std::min(depth, parts[i].size()); k-- > 0;) {
        name += (name.empty() ? "" : "/") + parts[i][k];
      }
      names[i] = name;
    }
    // Only different folders need telling apart; the same folder twice is numbered below.
    bool distinct = true;
    for (size_t i = 0; i < runs.size(); ++i) {
      for (size_t j = i + 1; j < runs.size(); ++j) {
        if (names[i] == names[j] && parts[i] != parts[j]) distinct = false;
      }
    }
    size_t longest = 0;
    for (const auto& p : parts) longest = std::max(longest, p.size());
    if (distinct || depth >= longest) break;
  }
  // The same folder given twice: number the repeats rather than show two identical labels.
  const std::vector<std::string> base = names;
  for (size_t i = 0; i < names.size(); ++i) {
    int repeat = 1;
    for (size_t j = 0; j < i; ++j) repeat += base[j] == base[i] ? 1 : 0;
    if (repeat > 1) names[i] += " (" + std::to_string(repeat) + ")";
  }
  return names;
}

std::string render_plot_svg(const std::vector<RunCurves>& runs) {
  const auto& panels = plot_panels();
  const int legend_rows = std::max<int>(1, (static_cast<int>(runs.size()) + kLegendColumns - 1) / kLegendColumns);
  const double top = 44 + legend_rows * kLegendRow;
  const double height = top + static_cast<double>(panels.size()) * (kPanelHeight + kPanelGap);
  const double x0 = kLeft;
  const double x1 = kWidth - kRight;

  int64_t first_step = std::numeric_limits<int64_t>::max();
  int64_t last_step = std::numeric_limits<int64_t>::min();
  for (const RunCurves& run : runs) {
    if (run.steps.empty()) continue;
    first_step = std::min(first_step, run.steps.front());
    last_step = std::max(last_step, run.steps.back());
  }
  if (first_step > last_step) first_step = last_step = 0;
  const Ticks xt = nice_ticks(static_cast<double>(first_step), static_cast<double>(last_step), 8);
  // The x axis spans exactly the logged steps (ticks inside it), so curves start at the left edge.
  const double xlo = first_step == last_step ? xt.lo : static_cast<double>(first_step);
  const double xhi = first_step == last_step ? xt.hi : static_cast<double>(last_step);
  const auto xmap = [&](double step) { return x0 + (step - xlo) / (xhi - xlo) * (x1 - x0); };

  std::ostringstream svg;
  svg << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << num(kWidth) << "\" height=\""
      << num(height) << "\" viewBox=\"0 0 " << num(kWidth) << " " << num(height)
      << "\" font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\" font-size=\"12\">\n";
  svg << "<title>Loom training curves</title>\n";
  svg << "<rect x=\"0\" y=\"0\" width=\"100%\" height=\"100%\" fill=\"#ffffff\"/>\n";
  svg << "<text x=\"" << num(x0) << "\" y=\"24\" font-size=\"16\" font-weight=\"bold\">"
      << "Training curves against step</text>\n";
  // Legend: a short stroke in the run's colour and its name, kLegendColumns to a row.
  svg << "<g class=\"legend\">\n";
  for (size_t i = 0; i < runs.size(); ++i) {
    const double lx = x0 + static_cast<double>(i % kLegendColumns) * ((x1 - x0) / kLegendColumns);
    const double ly = 44 + static_cast<double>(i / kLegendColumns) * kLegendRow;
    const char* colour = kColours[i % std::size(kColours)];
    svg << "<line x1=\"" << num(lx) << "\" y1=\"" << num(ly - 4) << "\" x2=\"" << num(lx + 24)
        << "\" y2=\"" << num(ly - 4) << "\" stroke=\"" << colour << "\" stroke-width=\"3\"/>"
        << "<text class=\"legend-label\" x=\"" << num(lx + 30) << "\" y=\"" << num(ly) << "\">"
        << xml_escape(runs[i].name) << "</text>\n";
  }
  svg << "</g>\n";

  for (size_t p = 0; p < panels.size(); ++p) {
    const PlotPanel& panel = panels[p];
    const double y0 = top + static_cast<double>(p) * (kPanelHeight + kPanelGap) + 20;  // under the title
    const double y1 = y0 + kPanelHeight;
    double lo = std::numeric_limits<double>::infinity();
    double hi = -lo;
    for (const RunCurves& run : runs) {
      const auto it = run.values.find(panel.key);
      if (it == run.values.end()) continue;
      for (const double v : it->second) {
        if (!std::isfinite(v)) continue;
        lo = std::min(lo, v);
        hi = std::max(hi, v);
      }
    }
    svg << "<g class=\"panel\" data-metric=\"" << panel.key << "\">\n";
    svg << "<text x=\"" << num(x0) << "\" y=\"" << num(y0 - 8) << "\" font-size=\"14\" "
        << "font-weight=\"bold\">" << xml_escape(panel.title) << "</text>\n";
    svg << "<rect x=\"" << num(x0) << "\" y=\"" << num(y0) << "\" width=\"" << num(x1 - x0)
        << "\" height=\"" << num(kPanelHeight) << "\" fill=\"none\" stroke=\"#444444\"/>\n";
    // x ticks and labels (every panel: each reads on its own)
    for (const double s : xt.values) {
      if (s < xlo - 1e-9 || s > xhi + 1e-9) continue;
      const double x = xmap(s);
      svg << "<line x1=\"" << num(x) << "\" y1=\"" << num(y1) << "\" x2=\"" << num(x) << "\" y2=\""
          << num(y1 + 5) << "\" stroke=\"#444444\"/><text class=\"x-tick\" x=\"" << num(x)
          << "\" y=\"" << num(y1 + 18) << "\" text-anchor=\"middle\">"
          << tick_label(s, xt.step, std::max(std::abs(xhi), std::abs(xlo))) << "</text>\n";
    }
    svg << "<text x=\"" << num((x0 + x1) / 2) << "\" y=\"" << num(y1 + 34)
        << "\" text-anchor=\"middle\">step</text>\n";
    if (!std::isfinite(lo)) {
      svg << "<text x=\"" << num((x0 + x1) / 2) << "\" y=\"" << num((y0 + y1) / 2)
          << "\" text-anchor=\"middle\" fill=\"#888888\">no " << xml_escape(panel.key)
          << " values logged</text>\n</g>\n";
      continue;
    }
    // 5 % headroom so the extremes do not sit on the frame.
    const double pad = hi > lo ? 0.05 * (hi - lo) : 0.0;
    const Ticks yt = nice_ticks(lo - pad, hi + pad, 5);
    const auto ymap = [&](double v) { return y1 - (v - yt.lo) / (yt.hi - yt.lo) * (y1 - y0); };
    const double largest = std::max(std::abs(yt.lo), std::abs(yt.hi));
    for (const double v : yt.values) {
      const double y = ymap(v);
      svg << "<line x1=\"" << num(x0) << "\" y1=\"" << num(y) << "\" x2=\"" << num(x1)
          << "\" y2=\"" << num(y) << "\" stroke=\"#e5e5e5\"/><line x1=\"" << num(x0 - 5)
          << "\" y1=\"" << num(y) << "\" x2=\"" << num(x0) << "\" y2=\"" << num(y)
          << "\" stroke=\"#444444\"/><text class=\"y-tick\" x=\"" << num(x0 - 8) << "\" y=\""
          << num(y + 4) << "\" text-anchor=\"end\">" << tick_label(v, yt.step, largest) << "</text>\n";
    }
    for (size_t i = 0; i < runs.size(); ++i) {
      const auto it = runs[i].values.find(panel.key);
      if (it == runs[i].values.end()) continue;
      const char* colour = kColours[i % std::size(kColours)];
      std::string points;
      size_t count = 0;
      for (size_t k = 0; k < runs[i].steps.size(); ++k) {
        const double v = it->second[k];
        if (!std::isfinite(v)) continue;  // a skipped step's null loss: the line joins its neighbours
        points += (points.empty() ? "" : " ") + num(xmap(static_cast<double>(runs[i].steps[k]))) +
                  "," + num(ymap(v));
        ++count;
      }
      if (count == 0) continue;
      svg << "<polyline class=\"series\" data-run=\"" << xml_escape(runs[i].name)
          << "\" data-metric=\"" << panel.key << "\" fill=\"none\" stroke=\"" << colour
          << "\" stroke-width=\"1.8\" stroke-linejoin=\"round\" points=\"" << points << "\"/>\n";
      if (count == 1) {  // a one-point polyline draws nothing
        const std::string& xy = points;
        const size_t comma = xy.find(',');
        svg << "<circle cx=\"" << xy.substr(0, comma) << "\" cy=\"" << xy.substr(comma + 1)
            << "\" r=\"3\" fill=\"" << colour << "\"/>\n";
      }
    }
    svg << "</g>\n";
  }
  svg << "</svg>\n";
  return svg.str();
}

void write_plot(const std::vector<fs::path>& runs, const fs::path& out) {
  LOOM_REQUIRE_USAGE(!runs.empty(), "loom plot needs at least one run folder");
  const std::vector<std::string> names = run_names(runs);
  std::vector<RunCurves> curves;
  for (size_t i = 0; i < runs.size(); ++i) curves.push_back(read_run_curves(runs[i], names[i]));
  const std::string svg = render_plot_svg(curves);
  // Written beside the target and renamed over it: a browser reloading the file while training
  // ends never sees half a document.
  const fs::path tmp = out.string() + ".tmp";
  {
    std::ofstream file(tmp, std::ios::binary | std::ios::trunc);
    LOOM_REQUIRE_USAGE(file.good(), "cannot write '", tmp.string(), "'; choose another --out");
    file << svg;
    file.close();
    LOOM_REQUIRE(!file.fail(), "cannot write '", tmp.string(), "'");
  }
  std::error_code ec;
  fs::rename(tmp, out, ec);
  LOOM_REQUIRE(!ec, "cannot move '", tmp.string(), "' to '", out.string(), "': ", ec.message());
}

}  // namespace loom::train
