#include <gtest/gtest.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <cstring>
#include <algorithm>

#include "loom/core/error.h"
#include "loom/core/timer.h"
#include "loom/train/metrics.h"
#include "loom/train/summary.h"
#include "loom/train/tensorboard.h"

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
            "mfu: 12.35%  memory: 1.25GiB  comm: 4.1 kB");
}

// Issue 21: bytes human-readably; the mesh dimensions only when more than one carries traffic (1 %
// of the total or more): a scalar all-reduce's 8 bytes on dp_cp is no column of its own.
TEST(Metrics, ConsoleLineShowsCommBytesHumanReadablyAndOnlyBusyDimensions) {
  StepMetrics m = sample(10);
  m.extra = {{"comm_bytes", 33179660.0}, {"comm_bytes/dp_shard", 33179652.0}, {"comm_bytes/dp_cp", 8.0}};
  const std::string line = MetricsLogger::console_line(m);
  EXPECT_NE(line.find("  comm: 33.2 MB"), std::string::npos) << line;
  EXPECT_EQ(line.find("dp_cp"), std::string::npos) << line;
  EXPECT_EQ(line.find("dp_shard"), std::string::npos) << line;  // the total says it all
  m.extra = {{"comm_bytes", 3.0e6}, {"comm_bytes/dp_shard", 1.0e6}, {"comm_bytes/tp", 2.0e6}, {"comm_bytes/pp", 8.0}};
  EXPECT_NE(MetricsLogger::console_line(m).find("  comm: 3.0 MB (dp_shard 1.0 MB, tp 2.0 MB)"), std::string::npos)
      << MetricsLogger::console_line(m);
  EXPECT_EQ(human_bytes(0), "0 B");
  EXPECT_EQ(human_bytes(999), "999 B");
  EXPECT_EQ(human_bytes(1500), "1.5 kB");
  EXPECT_EQ(human_bytes(2.5e9), "2.5 GB");
}

TEST(Metrics, ConsoleLineWithProgressReplacesTheStepField) {
  EXPECT_EQ(MetricsLogger::console_line(sample(120), "[step 120/400 · 1m32s · eta 3m35s]"),
            "[step 120/400 · 1m32s · eta 3m35s]  loss:   7.2500  grad_norm:   1.5000  lr: 8.00e-04  "
            "tps: 12,346  mfu: 12.35%  memory: 1.25GiB");
}

// Issue 14: the console's durations.
TEST(Progress, FormatDuration) {
  EXPECT_EQ(format_duration(0.0), "0.0s");
  EXPECT_EQ(format_duration(0.84), "0.8s");
  EXPECT_EQ(format_duration(9.94), "9.9s");
  EXPECT_EQ(format_duration(9.96), "10s");
  EXPECT_EQ(format_duration(45.4), "45s");
  EXPECT_EQ(format_duration(59.6), "1m00s");  // rounded once: never "60s"
  EXPECT_EQ(format_duration(92.0), "1m32s");
  EXPECT_EQ(format_duration(215.0), "3m35s");
  EXPECT_EQ(format_duration(3599.6), "1h00m");
  EXPECT_EQ(format_duration(3900.0), "1h05m");
  EXPECT_EQ(format_duration(26.5 * 3600), "26h30m");
  EXPECT_EQ(format_duration(-1.0), "?");
  EXPECT_EQ(format_duration(std::numeric_limits<double>::quiet_NaN()), "?");
}

// Issue 14: the ETA is the mean of the recent steps (the first, warm-up step left out) times the
// steps left, and the prefix reads "[step 120/400 · 1m32s · eta 3m35s]".
TEST(Progress, EtaExcludesWarmUpAndFollowsRecentSteps) {
  RunProgress progress({.total_steps = 400, .eta_window = 4});
  progress.record_step(1, 8.0, /*step_seconds=*/30.0, /*elapsed=*/30.0);  // warm-up: slow
  EXPECT_FALSE(progress.eta_seconds().has_value());
  EXPECT_EQ(progress.prefix(), "[step 1/400 · 30s]");  // no ETA before a step past warm-up
  progress.record_step(2, 7.9, 0.5, 30.5);
  ASSERT_TRUE(progress.eta_seconds().has_value());
  EXPECT_DOUBLE_EQ(*progress.eta_seconds(), 0.5 * 398);  // 30 s of warm-up do not count
  double elapsed = 30.5;
  for (int64_t step = 3; step <= 119; ++step) progress.record_step(step, 7.0, 0.5, elapsed += 0.5);
  // The window holds the last 4 step times: three of 0.5 s and one of 1.5 s.
  progress.record_step(120, 6.5, 1.5, 92.0);
  EXPECT_DOUBLE_EQ(*progress.eta_seconds(), (0.5 * 3 + 1.5) / 4 * 280);
  EXPECT_EQ(progress.prefix(), "[step 120/400 · 1m32s · eta 3m30s]");
  EXPECT_EQ(progress.status_line(6.5), "[step 120/400 · 1m32s · eta 3m30s]  loss:   6.5000");
  // Four more 1.5 s steps fill the window: the ETA follows the slower pace.
  for (int64_t step = 121; step <= 124; ++step) progress.record_step(step, 6.4, 1.5, 92.0 + 1.5 * (step - 120));
  EXPECT_DOUBLE_EQ(*progress.eta_seconds(), 1.5 * 276);
  for (int64_t step = 125; step <= 400; ++step) progress.record_step(step, 6.0, 1.5, 98.0 + 1.5 * (step - 124));
  EXPECT_DOUBLE_EQ(*progress.eta_seconds(), 0.0);
}

// A resumed run: steps count from the checkpoint, and its first step (not step 1) is the warm-up.
TEST(Progress, ResumedRunWarmsUpOnItsFirstStep) {
  RunProgress progress({.total_steps = 100, .start_step = 50, .global_tokens_per_step = 2048,
                        .rank_tokens_per_step = 1024.0});
  progress.record_step(51, 5.0, 10.0, 10.0);
  EXPECT_FALSE(progress.eta_seconds().has_value());
  progress.record_step(52, 4.0, 2.0, 12.0);
  EXPECT_DOUBLE_EQ(*progress.eta_seconds(), 2.0 * 48);
  const RunSummary s = progress.summary();
  EXPECT_EQ(s.first_step, 51);
  EXPECT_EQ(s.last_step, 52);
  EXPECT_EQ(s.tokens, 2 * 2048);
}

TEST(Progress, SummaryFiguresAndLines) {
  RunProgress progress({.total_steps = 4, .global_tokens_per_step = 2048, .rank_tokens_per_step = 1024.0,
                        .flops_per_token = 1e6, .peak_flops = 1e10});
  progress.record_step(1, 7.5, 1.0, 1.0);
  progress.record_step(2, std::numeric_limits<double>::quiet_NaN(), 0.25, 1.25);  // skipped
  progress.record_step(3, 6.25, 0.25, 1.5);
  progress.record_step(4, 6.5, 0.5, 2.0);
  StepMetrics logged = sample(4);
  logged.mem_peak_gib = 1.5;
  progress.record_log(logged);
  logged.mem_peak_gib = 0.75;  // a later window's lower peak leaves the run's peak alone
  progress.record_log(logged);
  RunSummary s = progress.summary();
  EXPECT_EQ(s.tokens, 4 * 2048);
  EXPECT_DOUBLE_EQ(s.wall_seconds, 2.0);
  EXPECT_DOUBLE_EQ(s.rank_tokens_per_second, 4 * 1024.0 / 2.0);    // over the steps' own time
  EXPECT_DOUBLE_EQ(s.global_tokens_per_second, 4 * 2048.0 / 2.0);  // over the wall clock
  EXPECT_DOUBLE_EQ(s.mfu, 100.0 * 2048.0 * 1e6 / 1e10);
  EXPECT_DOUBLE_EQ(s.first_loss, 7.5);
  EXPECT_DOUBLE_EQ(s.last_loss, 6.5);
  EXPECT_DOUBLE_EQ(s.best_loss, 6.25);
  EXPECT_EQ(s.best_step, 3);
  EXPECT_EQ(s.skipped_steps, 1);
  EXPECT_DOUBLE_EQ(s.peak_memory_gib, 1.5);

  s.run_folder = "outputs/run";
  s.metrics_path = "outputs/run/metrics.jsonl";
  s.checkpoint_folder = "outputs/run/checkpoint";
  s.last_checkpoint = "outputs/run/checkpoint/step-4";
  s.tokenizer_path = "tok.json";
  s.tensorboard_folder = "outputs/run/tb/20261124-101500";
  s.plot_path = "outputs/run/loss.svg";
  EXPECT_EQ(format_run_summary(s),
            (std::vector<std::string>{
                "run summary: steps 1-4 of 4, 8,192 tokens in 2.0s",
                "  throughput:   2,048 tokens/s per rank (4,096 on all ranks, wall clock), MFU 20.48%",
                "  loss:         first 7.5000, last 6.5000, best 6.2500 (step 3); 1 non-finite step(s) skipped",
                "  peak memory:  1.50 GiB (rank 0)",
                "  run folder:   outputs/run",
                "  metrics:      outputs/run/metrics.jsonl",
                "  checkpoints:  outputs/run/checkpoint",
                "  tensorboard:  outputs/run/tb/20261124-101500",
                "  plot:         outputs/run/loss.svg (loss, learning rate and tokens/s against step)",
                "next:",
                "  loom plot outputs/run OTHER_RUN_DIR --out compare.svg   # overlay runs",
                "  tensorboard --logdir outputs/run/tb   # (.venv/bin/tensorboard after make setup)",
                "  loom generate --checkpoint outputs/run/checkpoint/step-4 --tokenizer tok.json "
                "--prompt \"Once upon a time\"   # sample from the trained model",
                "  loom score --checkpoint outputs/run/checkpoint/step-4 --tokenizer tok.json --text-file FILE"
                "   # per-token loss and perplexity of a text"}));

  // A run without checkpoints, TensorBoard or metrics says how to get them and offers no command
  // that cannot work.
  RunSummary bare = progress.summary();
  bare.run_folder = "outputs/run";
  bare.mfu = std::numeric_limits<double>::quiet_NaN();
  const auto lines = format_run_summary(bare);
  const auto has = [&](const std::string& text) {
    return std::any_of(lines.begin(), lines.end(), [&](const std::string& l) { return l == text; });
  };
  EXPECT_TRUE(has("  throughput:   2,048 tokens/s per rank (4,096 on all ranks, wall clock), MFU n/a"));
  EXPECT_TRUE(has("  metrics:      not written (metrics.enable_jsonl = false)"));
  EXPECT_TRUE(has("  checkpoints:  none (checkpoint.enable = false)"));
  EXPECT_TRUE(has("  tensorboard:  off (set metrics.enable_tensorboard = true)"));
  for (const std::string& line : lines) {
    EXPECT_EQ(line.find("loom plot"), std::string::npos) << line;
    EXPECT_EQ(line.find("tensorboard --logdir"), std::string::npos) << line;
    EXPECT_EQ(line.find("loom generate --checkpoint"), std::string::npos) << line;  // nothing to load
  }
}

std::string hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (const unsigned char c : bytes) {
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  return out;
}

// The expected bytes come from TensorBoard's own Python protobuf classes (event_pb2, summary_pb2)
// and its masked_crc32c: Event(wall_time=1.5, file_version="brain.Event:2"), and
// Event(wall_time=1700000000.25, step=300, summary={loss: 7.25, lr: 8e-4}).
TEST(TensorBoard, EventsAndRecordsMatchTensorBoardsEncoding) {
  EXPECT_EQ(tensorboard::masked_crc32c("123456789", 9), 0xc78ab0e5u);
  EXPECT_EQ(hex(tensorboard::file_version_event(1.5)), "09000000000000f83f1a0d627261696e2e4576656e743a32");
  EXPECT_EQ(hex(tensorboard::scalars_event(1700000000.25, 300, {{"loss", 7.25f}, {"lr", 8e-4f}})),
            "0900001040fc54d94110ac022a180a0b0a046c6f7373150000e8400a090a026c721517b7513a");
  EXPECT_EQ(hex(tensorboard::tfrecord(tensorboard::file_version_event(1.5))),
            "1800000000000000a37f4b22"                                  // length 24, its masked CRC
            "09000000000000f83f1a0d627261696e2e4576656e743a32"          // the event
            "2a28646c");                                                // the event's masked CRC
  EXPECT_EQ(tensorboard::event_file_name(1700000000, "node1", 42), "events.out.tfevents.1700000000.node1.42");
}

// TFRecords read back: each framed record's length and both CRCs check.
std::vector<std::string> read_records(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<std::string> records;
  while (true) {
    char header[12];
    if (!in.read(header, 12)) break;
    uint64_t length = 0;
    std::memcpy(&length, header, 8);
    uint32_t length_crc = 0;
    std::memcpy(&length_crc, header + 8, 4);
    EXPECT_EQ(length_crc, tensorboard::masked_crc32c(header, 8));
    std::string data(length, '\0');
    uint32_t data_crc = 0;
    EXPECT_TRUE(in.read(data.data(), static_cast<std::streamsize>(length)));
    EXPECT_TRUE(in.read(reinterpret_cast<char*>(&data_crc), 4));
    EXPECT_EQ(data_crc, tensorboard::masked_crc32c(data.data(), data.size()));
    records.push_back(data);
  }
  return records;
}

TEST_F(MetricsLoggerTest, TensorBoardFileHasAVersionRecordThenOnePerLoggedStep) {
  fs::path event_file;
  {
    MetricsLogger logger({.dump_folder = dir_, .enable_tensorboard = true});
    event_file = logger.tensorboard_file();
    ASSERT_FALSE(event_file.empty());
    EXPECT_EQ(logger.tensorboard_folder().parent_path(), dir_ / "tb");
    EXPECT_EQ(event_file.filename().string().rfind("events.out.tfevents.", 0), 0u) << event_file;
    StepMetrics m = sample(10);
    m.mfu = std::numeric_limits<double>::quiet_NaN();  // null in the JSON: no TensorBoard point
    m.extra = {{"comm_bytes", 4096.0}};
    EXPECT_EQ(MetricsLogger::tensorboard_scalars(m),
              (std::vector<std::pair<std::string, float>>{{"loss", 7.25f}, {"grad_norm", 1.5f},
                                                          {"lr", 8e-4f}, {"tps", 12345.6f},
                                                          {"mem_peak_gib", 1.25f},
                                                          {"comm_bytes", 4096.0f}}));
    logger.log(m);
    logger.log(sample(20));
    // Flushed as logged: readable while the run goes on.
    EXPECT_EQ(read_records(event_file).size(), 3u);
  }
  const auto records = read_records(event_file);
  ASSERT_EQ(records.size(), 3u);
  EXPECT_NE(records[0].find("brain.Event:2"), std::string::npos);
  EXPECT_NE(records[1].find("comm_bytes"), std::string::npos);
  EXPECT_EQ(records[1].find("mfu"), std::string::npos);
  EXPECT_NE(records[2].find("mfu"), std::string::npos);
  // A resumed run continues the newest run folder with a new event file; a fresh run would start
  // its own folder.
  MetricsLogger resumed({.dump_folder = dir_, .resumed_from_step = 20, .enable_tensorboard = true});
  EXPECT_EQ(resumed.tensorboard_folder(), event_file.parent_path());
  MetricsLogger off({.dump_folder = dir_ / "off"});
  EXPECT_TRUE(off.tensorboard_file().empty());
  EXPECT_FALSE(fs::exists(dir_ / "off" / "tb"));
}

// Validation's rows (train/validate.h): {"step", <scalars>} in metrics.jsonl after the training row,
// the same scalars as one TensorBoard record at that step; a non-finite value is null / no point.
TEST_F(MetricsLoggerTest, ScalarRowsGoToJsonlAndTensorBoard) {
  fs::path event_file;
  {
    MetricsLogger logger({.dump_folder = dir_, .enable_tensorboard = true});
    event_file = logger.tensorboard_file();
    logger.log(sample(10));
    logger.log_scalars(10, {{"validation_loss", 4.5}, {"validation_perplexity", std::exp(4.5)},
                            {"validation_tokens", std::numeric_limits<double>::infinity()}},
                       "[validation] step 10");
  }
  const auto lines = read_lines();
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[1].size(), 4u);
  EXPECT_EQ(lines[1]["step"].get<int64_t>(), 10);
  EXPECT_DOUBLE_EQ(lines[1]["validation_loss"].get<double>(), 4.5);
  EXPECT_DOUBLE_EQ(lines[1]["validation_perplexity"].get<double>(), std::exp(4.5));
  EXPECT_TRUE(lines[1]["validation_tokens"].is_null());
  const auto records = read_records(event_file);
  ASSERT_EQ(records.size(), 3u);  // version, training step, validation
  EXPECT_NE(records[2].find("validation_loss"), std::string::npos);
  EXPECT_NE(records[2].find("validation_perplexity"), std::string::npos);
  EXPECT_EQ(records[2].find("validation_tokens"), std::string::npos);
  EXPECT_EQ(records[2].find("grad_norm"), std::string::npos);
}

// Issue 14: communication per mesh dim besides the total.
TEST(Metrics, CommBytesInTotalAndPerMeshDim) {
  distributed::CommSnapshot snapshot;
  using distributed::ByteCount;
  using distributed::CommOp;
  snapshot.counters[{CommOp::kAllGather, "dp_shard"}] = {4, 4096, ByteCount::exact(2048)};
  snapshot.counters[{CommOp::kReduceScatter, "dp_shard"}] = {2, 4096, ByteCount::exact(2048)};
  snapshot.counters[{CommOp::kAllReduce, "tp"}] = {2, 300, ByteCount::fraction(900, 2)};
  snapshot.counters[{CommOp::kAllGather, "dp_shard"}].wait_seconds = 0.25;
  snapshot.counters[{CommOp::kAllReduce, "tp"}].wait_seconds = 0.75;
  StepMetrics m = sample(10);
  add_comm_metrics(m, snapshot, /*steps=*/2, /*step_seconds=*/5.0);
  // Exposed: (0.25 + 0.75) s over 2 steps = 0.5 s per step, 10 % of a 5 s step.
  EXPECT_EQ(m.extra, (std::map<std::string, double>{{"comm_bytes", (2048 + 2048 + 450) / 2.0},
                                                    {"comm_bytes/dp_shard", 4096 / 2.0},
                                                    {"comm_bytes/tp", 450 / 2.0},
                                                    {"comm_exposed_pct", 10.0},
                                                    {"comm_exposed_s", 0.5}}));
  EXPECT_EQ(m.file_only.at("comm_exposed_s/dp_shard"), 0.125);
  EXPECT_EQ(m.file_only.at("comm_exposed_s/tp"), 0.375);
  EXPECT_EQ(m.file_only.at("comm_exposed_s/all_gather@dp_shard"), 0.125);
  EXPECT_EQ(m.file_only.at("comm_exposed_s/reduce_scatter@dp_shard"), 0.0);
  StepMetrics none = sample(10);
  add_comm_metrics(none, distributed::CommSnapshot{}, 1);  // one process: no traffic, no dims
  EXPECT_EQ(none.extra, (std::map<std::string, double>{{"comm_bytes", 0.0}}));
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
