#include <gtest/gtest.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>

#include "loom/core/error.h"
#include "loom/core/timer.h"
#include "loom/train/metrics.h"

namespace loom::train {
namespace {

namespace fs = std::filesystem;

class MetricsLoggerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("loom_metrics_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::vector<nlohmann::ordered_json> read_lines() const {
    std::ifstream in(dir_ / "metrics.jsonl");
    std::vector<nlohmann::ordered_json> lines;
    std::string line;
    while (std::getline(in, line)) lines.push_back(nlohmann::ordered_json::parse(line));
    return lines;
  }

  fs::path dir_;
};

StepMetrics sample(int64_t step) {
  return StepMetrics{.step = step,
                     .loss = 7.25,
                     .grad_norm = 1.5,
                     .lr = 8e-4,
                     .tps = 12345.6,
                     .mfu = 12.345,
                     .mem_peak_gib = 1.25,
                     .extra = {}};
}

TEST_F(MetricsLoggerTest, JsonlLinesHaveExactlyTheStandardKeysAndAreFlushed) {
  MetricsLogger logger({.dump_folder = dir_, .enable_jsonl = true, .rank = 0});
  EXPECT_EQ(logger.jsonl_path(), dir_ / "metrics.jsonl");
  logger.log(sample(10));
  StepMetrics with_extra = sample(20);
  with_extra.extra = {{"comm_bytes", 4096.0}};
  logger.log(with_extra);

  // Read while the logger is still open: each line is flushed when logged.
  const auto lines = read_lines();
  ASSERT_EQ(lines.size(), 2u);
  std::vector<std::string> keys;
  for (const auto& [key, value] : lines[0].items()) keys.push_back(key);
  EXPECT_EQ(keys, (std::vector<std::string>{"step", "loss", "grad_norm", "lr", "tps", "mfu",
                                            "mem_peak_gib"}));
  EXPECT_EQ(lines[0]["step"].get<int64_t>(), 10);
  EXPECT_DOUBLE_EQ(lines[0]["loss"].get<double>(), 7.25);
  EXPECT_DOUBLE_EQ(lines[0]["lr"].get<double>(), 8e-4);
  EXPECT_DOUBLE_EQ(lines[0]["mfu"].get<double>(), 12.345);
  EXPECT_EQ(lines[1].size(), 8u);
  EXPECT_DOUBLE_EQ(lines[1]["comm_bytes"].get<double>(), 4096.0);
}

TEST_F(MetricsLoggerTest, ResumeAppendsAfterAMarkerAndAFreshRunNeverOverwrites) {
  { MetricsLogger({.dump_folder = dir_}).log(sample(1)); }
  {
    MetricsLogger resumed({.dump_folder = dir_, .resumed_from_step = 1, .attempt = 2});
    EXPECT_TRUE(resumed.rotated_to().empty());
    resumed.log(sample(2));
  }
  auto lines = read_lines();
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0]["step"].get<int64_t>(), 1);
  EXPECT_EQ(lines[1]["event"], "resume");
  EXPECT_EQ(lines[1]["step"].get<int64_t>(), 1);
  EXPECT_EQ(lines[1]["attempt"].get<int>(), 2);
  EXPECT_EQ(lines[2]["step"].get<int64_t>(), 2);
  // A fresh run moves the earlier metrics aside (first free metrics.K.jsonl), then starts anew.
  {
    MetricsLogger fresh({.dump_folder = dir_});
    EXPECT_EQ(fresh.rotated_to(), dir_ / "metrics.1.jsonl");
    fresh.log(sample(3));
  }
  lines = read_lines();
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0]["step"].get<int64_t>(), 3);
  { MetricsLogger({.dump_folder = dir_}).log(sample(4)); }
  EXPECT_TRUE(fs::exists(dir_ / "metrics.2.jsonl"));
  std::ifstream first(dir_ / "metrics.1.jsonl");
  std::string line;
  int n = 0;
  while (std::getline(first, line)) ++n;
  EXPECT_EQ(n, 3);  // the first run's rows and the resume marker, untouched
}

TEST_F(MetricsLoggerTest, OnlyRankZeroWrites) {
  MetricsLogger logger({.dump_folder = dir_, .rank = 1});
  logger.log(sample(1));
  EXPECT_FALSE(fs::exists(dir_));
  MetricsLogger disabled({.dump_folder = dir_, .enable_jsonl = false});
  disabled.log(sample(1));
  EXPECT_FALSE(fs::exists(dir_ / "metrics.jsonl"));
}

TEST_F(MetricsLoggerTest, NonFiniteValuesBecomeNullAndReservedExtrasAreRejected) {
  StepMetrics m = sample(5);
  m.loss = std::numeric_limits<double>::quiet_NaN();
  m.grad_norm = std::numeric_limits<double>::infinity();
  const auto j = nlohmann::json::parse(MetricsLogger::json_line(m));
  EXPECT_TRUE(j["loss"].is_null());
  EXPECT_TRUE(j["grad_norm"].is_null());
  m.extra = {{"loss", 1.0}};
  EXPECT_THROW(MetricsLogger::json_line(m), loom::Error);
}

TEST(Metrics, ConsoleLine) {
  StepMetrics m = sample(10);
  m.extra = {{"comm_bytes", 4096.0}};
  EXPECT_EQ(MetricsLogger::console_line(m),
            "step:    10  loss:   7.2500  grad_norm:   1.5000  lr: 8.00e-04  tps: 12,346  "
            "mfu: 12.35%  memory: 1.25GiB  comm_bytes: 4096");
}

TEST(Metrics, ThroughputAndMfuArithmetic) {
  EXPECT_DOUBLE_EQ(tokens_per_second(4096, 2.0), 2048.0);
  // 1000 tokens/s x 6e6 FLOPs/token = 6 GFLOP/s of a 100 GFLOP/s peak = 6%.
  EXPECT_DOUBLE_EQ(mfu_percent(1000.0, 6e6, 1e11), 6.0);
  EXPECT_THROW(mfu_percent(1000.0, 6e6, 0.0), loom::Error);
  EXPECT_THROW(tokens_per_second(10, 0.0), loom::Error);
  // 6 x 1e6 + 12 x 2 layers x 4 heads x 16 head_dim x 256 tokens.
  EXPECT_DOUBLE_EQ(dense_transformer_flops_per_token(1'000'000, 2, 4, 16, 256),
                   6e6 + 12.0 * 2 * 4 * 16 * 256);
}

TEST(Metrics, MeasuredPeakFlopsIsPlausibleAndCached) {
  const double peak = measure_peak_fp32_flops();
  EXPECT_GT(peak, 1e9);    // any CPU that runs this does > 1 GFLOP/s of sgemm
  EXPECT_LT(peak, 1e14);   // and no CPU core here does 100 TFLOP/s
  const Timer timer;
  EXPECT_EQ(measure_peak_fp32_flops(), peak);
  EXPECT_LT(timer.seconds(), 0.05);
}

}  // namespace
}  // namespace loom::train
