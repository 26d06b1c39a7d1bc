// Issue 14: `loom plot` / loss.svg. The SVG is parsed back: one polyline per run and metric with a
// point per logged step, x growing with the step, y ordered as the values (SVG's y points down).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include "loom/core/error.h"
#include "loom/testing/run.h"
#include "loom/train/plot.h"

namespace loom::train {
namespace {

namespace fs = std::filesystem;

struct Point {
  double x = 0.0, y = 0.0;
};

struct Polyline {
  std::string run, metric;
  std::vector<Point> points;
};

// Every <polyline class="series" ...> of the document, attributes in any order.
std::vector<Polyline> polylines(const std::string& svg) {
  std::vector<Polyline> out;
  const std::regex element(R"(<polyline\b([^>]*)/>)");
  const std::regex attribute(R"re(([\w-]+)="([^"]*)")re");
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), element); it != std::sregex_iterator(); ++it) {
    std::map<std::string, std::string> attrs;
    const std::string body = (*it)[1];
    for (auto a = std::sregex_iterator(body.begin(), body.end(), attribute); a != std::sregex_iterator(); ++a) {
      attrs[(*a)[1]] = (*a)[2];
    }
    if (attrs["class"] != "series") continue;
    Polyline line{attrs["data-run"], attrs["data-metric"], {}};
    std::istringstream points(attrs["points"]);
    std::string pair;
    while (points >> pair) {
      const size_t comma = pair.find(',');
      line.points.push_back({std::stod(pair.substr(0, comma)), std::stod(pair.substr(comma + 1))});
    }
    out.push_back(line);
  }
  return out;
}

const Polyline& find_line(const std::vector<Polyline>& lines, const std::string& run, const std::string& metric) {
  for (const Polyline& l : lines) {
    if (l.run == run && l.metric == metric) return l;
  }
  ADD_FAILURE() << "no polyline for " << run << " / " << metric;
  static const Polyline none;
  return none;
}

void write_metrics(const fs::path& dir, const std::vector<std::string>& lines) {
  fs::create_directories(dir);
  std::ofstream out(dir / "metrics.jsonl");
  for (const std::string& line : lines) out << line << "\n";
}

std::string row(int64_t step, double loss, double lr, double tps) {
  return "{\"step\":" + std::to_string(step) + ",\"loss\":" + std::to_string(loss) +
         ",\"grad_norm\":1.0,\"lr\":" + std::to_string(lr) + ",\"tps\":" + std::to_string(tps) +
         ",\"mfu\":1.0,\"mem_peak_gib\":0.5,\"comm_bytes\":100.0}";
}

// y must order the points as the values do (larger value = smaller y), x as the steps.
void expect_monotone_mapping(const Polyline& line, const std::vector<int64_t>& steps,
                             const std::vector<double>& values) {
  ASSERT_EQ(line.points.size(), values.size()) << line.run << " " << line.metric;
  for (size_t i = 0; i < values.size(); ++i) {
    for (size_t j = 0; j < values.size(); ++j) {
      if (steps[i] < steps[j]) EXPECT_LT(line.points[i].x, line.points[j].x);
      if (values[i] < values[j]) EXPECT_GT(line.points[i].y, line.points[j].y) << i << " " << j;
      if (values[i] == values[j]) EXPECT_NEAR(line.points[i].y, line.points[j].y, 0.011);
    }
  }
}

TEST(Plot, OneSeriesPerRunAndMetricWithAPointPerLoggedStep) {
  const loom::testing::TempDir tmp("plot");
  const fs::path a = tmp.path() / "run_a";
  const fs::path b = tmp.path() / "run_b";
  const std::vector<int64_t> steps_a = {1, 10, 20, 30, 40};
  const std::vector<double> loss_a = {7.6, 6.1, 5.2, 5.4, 4.8};  // not monotone: a bump at 30
  const std::vector<double> lr_a = {4e-4, 4e-3, 3e-3, 1.5e-3, 0.0};
  const std::vector<double> tps_a = {800, 5200, 5100, 5300, 5250};
  std::vector<std::string> lines;
  for (size_t i = 0; i < steps_a.size(); ++i) lines.push_back(row(steps_a[i], loss_a[i], lr_a[i], tps_a[i]));
  write_metrics(a, lines);
  write_metrics(b, {row(1, 7.7, 1e-3, 900), row(10, 6.9, 1e-3, 4000), row(20, 6.0, 1e-3, 4100)});

  const fs::path out = tmp.path() / "compare.svg";
  write_plot({a, b}, out);
  std::ifstream in(out);
  const std::string svg((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_EQ(svg.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  EXPECT_FALSE(fs::exists(out.string() + ".tmp"));
  // Self-contained: nothing fetched, nothing run.
  EXPECT_EQ(svg.find("<script"), std::string::npos);
  EXPECT_EQ(svg.find("href"), std::string::npos);

  const auto series = polylines(svg);
  EXPECT_EQ(series.size(), 6u);  // 2 runs x (loss, lr, tps)
  expect_monotone_mapping(find_line(series, "run_a", "loss"), steps_a, loss_a);
  expect_monotone_mapping(find_line(series, "run_a", "lr"), steps_a, lr_a);
  expect_monotone_mapping(find_line(series, "run_a", "tps"), steps_a, tps_a);
  expect_monotone_mapping(find_line(series, "run_b", "loss"), {1, 10, 20}, {7.7, 6.9, 6.0});
  // Runs share the axes: run_b's step 20 is where run_a's is, and the same loss lies at the same
  // height (both runs are on one scale).
  EXPECT_DOUBLE_EQ(find_line(series, "run_b", "loss").points[2].x, find_line(series, "run_a", "loss").points[2].x);
  // The x axis spans the logged steps: the first and last points sit on the plot frame's edges.
  const auto& loss = find_line(series, "run_a", "loss");
  EXPECT_LT(loss.points.front().x, loss.points.back().x);
  // Legend, panel titles and axis labels.
  for (const char* text : {">run_a</text>", ">run_b</text>", ">loss</text>", ">learning rate</text>",
                           ">tokens/s per rank</text>", ">step</text>"}) {
    EXPECT_NE(svg.find(text), std::string::npos) << text;
  }
  // Tick labels on both axes of every panel.
  const std::regex x_tick(R"(class="x-tick")"), y_tick(R"(class="y-tick")");
  EXPECT_GE(std::distance(std::sregex_iterator(svg.begin(), svg.end(), x_tick), std::sregex_iterator()), 3 * 3);
  EXPECT_GE(std::distance(std::sregex_iterator(svg.begin(), svg.end(), y_tick), std::sregex_iterator()), 3 * 3);
}

// A resumed run's rows after its checkpoint are superseded by the rows after the marker; a null
// (skipped step's loss) has no point; names that end alike get their parent folders.
TEST(Plot, ResumeMarkersNullsAndRunNames) {
  const loom::testing::TempDir tmp("plot");
  const fs::path run = tmp.path() / "x" / "llama3_debug";
  write_metrics(run, {row(10, 6.0, 1e-3, 10), row(20, 5.0, 1e-3, 10), row(30, 4.0, 1e-3, 10),
                      R"({"event":"resume","step":20,"attempt":1})",
                      R"({"step":30,"loss":4.5,"lr":0.001,"tps":10})",
                      R"({"step":40,"loss":null,"lr":0.001,"tps":10})"});
  const RunCurves curves = read_run_curves(run, "r");
  EXPECT_EQ(curves.steps, (std::vector<int64_t>{10, 20, 30, 40}));
  const auto& loss = curves.values.at("loss");
  EXPECT_DOUBLE_EQ(loss[2], 4.5);  // the resumed run's step 30, not the interrupted one's
  EXPECT_TRUE(std::isnan(loss[3]));
  const auto series = polylines(render_plot_svg({curves}));
  EXPECT_EQ(find_line(series, "r", "loss").points.size(), 3u);
  EXPECT_EQ(find_line(series, "r", "lr").points.size(), 4u);
  // A .jsonl file can be named directly.
  EXPECT_EQ(read_run_curves(run / "metrics.jsonl", "r").steps.size(), 4u);

  const fs::path other = tmp.path() / "y" / "llama3_debug";
  EXPECT_EQ(run_names({run, other}), (std::vector<std::string>{"x/llama3_debug", "y/llama3_debug"}));
  EXPECT_EQ(run_names({run, tmp.path() / "z"}), (std::vector<std::string>{"llama3_debug", "z"}));
  EXPECT_EQ(run_names({run, run}), (std::vector<std::string>{"llama3_debug", "llama3_debug (2)"}));
}

// Validation writes its own row for a step after the training row: the rows merge, so the step
// keeps its training values and gains validation_loss.
TEST(Plot, RowsOfOneStepMerge) {
  const loom::testing::TempDir tmp("plot");
  write_metrics(tmp.path(), {row(10, 6.0, 1e-3, 10), R"({"step":10,"validation_loss":6.5})",
                             row(20, 5.0, 1e-3, 10), R"({"step":20,"validation_loss":5.5})"});
  const RunCurves curves = read_run_curves(tmp.path(), "r");
  EXPECT_EQ(curves.steps, (std::vector<int64_t>{10, 20}));
  EXPECT_EQ(curves.values.at("loss"), (std::vector<double>{6.0, 5.0}));
  EXPECT_EQ(curves.values.at("validation_loss"), (std::vector<double>{6.5, 5.5}));
}

TEST(Plot, MissingOrEmptyMetricsAreUsageErrors) {
  const loom::testing::TempDir tmp("plot");
  EXPECT_THROW(read_run_curves(tmp.path() / "nothing", "n"), loom::UsageError);
  write_metrics(tmp.path() / "empty", {R"({"event":"resume","step":0,"attempt":0})"});
  EXPECT_THROW(read_run_curves(tmp.path() / "empty", "e"), loom::UsageError);
  write_metrics(tmp.path() / "bad", {"{\"step\": 1,"});
  EXPECT_THROW(read_run_curves(tmp.path() / "bad", "b"), loom::Error);
}

}  // namespace
}  // namespace loom::train
