// Profiling and the flight recorder under real 2-rank FSDP jobs through the `loom` binary (issue
// 14, item 4): the Kineto traces of both ranks hold Loom's named ranges, each rank writes its RSS
// timeline, and a hang on one rank leaves a flight-recorder file on every rank that together name
// the collective the job stalled in and the rank that never joined it.
#include <gtest/gtest.h>

#include <fstream>

#include <nlohmann/json.hpp>

#include "loom/core/build_paths.h"
#include "loom/testing/run.h"

namespace {
namespace fs = std::filesystem;
using loom::testing::bin_dir;
using loom::testing::run;
using loom::testing::RunResult;
using loom::testing::TempDir;

using loom::testing::source_path;

// `loom launch --nproc 2 -- train ...`: the debug model under FSDP over 2 ranks, seq 64.
std::string fsdp_job(const TempDir& dir, int steps, const std::string& extra) {
  return bin_dir() + "/loom launch --nproc 2 -- train --config " + source_path("configs/llama3_debug.toml") +
         " --model.tokenizer_path=" + source_path("data/default/tokenizer.json") +
         " --training.dataset_path=" + source_path("data/default/corpus.jsonl") +
         " --job.dump_folder=" + dir.str() +
         " --parallelism.data_parallel_shard_degree=2 --training.seq_len=64"
         " --training.local_batch_size=2 --training.steps=" + std::to_string(steps) +
         " --lr_scheduler.warmup_steps=2 --metrics.log_freq=1 --metrics.peak_flops=1e11"
         " --validation.enable=false" + extra;
}

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

struct Range {
  double begin = 0, end = 0;
};

// The user-annotation ranges (RecordFunction, user scope) of a Chrome trace, by name.
std::multimap<std::string, Range> user_ranges(const nlohmann::json& trace) {
  std::multimap<std::string, Range> out;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.value("cat", "") != "user_annotation" || e.value("ph", "") != "X") continue;
    const double ts = e.at("ts").get<double>();
    out.emplace(e.at("name").get<std::string>(), Range{ts, ts + e.at("dur").get<double>()});
  }
  return out;
}

// Whether some range named `inner` lies inside some range named `outer`.
bool nested(const std::multimap<std::string, Range>& ranges, const std::string& inner,
            const std::string& outer) {
  auto [ib, ie] = ranges.equal_range(inner);
  auto [ob, oe] = ranges.equal_range(outer);
  for (auto i = ib; i != ie; ++i) {
    for (auto o = ob; o != oe; ++o) {
      if (i->second.begin >= o->second.begin && i->second.end <= o->second.end) return true;
    }
  }
  return false;
}

}  // namespace

// The acceptance run: 4 steps in windows of 2 (step 1 warm-up, step 2 recorded; steps 3 and 4
// likewise), an async checkpoint at steps 2 and 4, and the CPU memory timeline.
TEST(TrainerProfiling, FsdpTwoRankTracesHoldLoomRangesOnBothRanks) {
  TempDir dir("profile");
  const RunResult r = run(fsdp_job(dir, 4,
                                   " --profiling.enable_profiling=true --profiling.profile_freq=2"
                                   " --profiling.profiler_warmup=1 --profiling.profiler_active=1"
                                   " --profiling.enable_memory_snapshot=true"
                                   " --checkpoint.enable=true --checkpoint.interval=2"
                                   " --checkpoint.async_mode=async"),
                          300);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<std::string> expected = {
      "loom::forward",  "loom::backward",       "loom::fsdp::all_gather", "loom::fsdp::reduce_scatter",
      "loom::optimizer_step", "loom::clip_grad_norm", "loom::block_forward layers.0",
      "loom::checkpoint::stage"};
  for (int step : {2, 4}) {
    for (int rank : {0, 1}) {
      const fs::path path = dir.path() / "profile_traces" / ("iteration_" + std::to_string(step)) /
                            ("rank" + std::to_string(rank) + "_trace.json");
      ASSERT_TRUE(fs::exists(path)) << path << "\n" << r.output;
      const nlohmann::json trace = read_json(path);
      EXPECT_EQ(trace.at("distributedInfo").at("rank"), rank);
      EXPECT_EQ(trace.at("distributedInfo").at("world_size"), 2);
      const auto ranges = user_ranges(trace);
      for (const std::string& name : expected) {
        EXPECT_GT(ranges.count(name), 0u) << name << " missing from " << path;
      }
      // Only the recorded step: its ProfilerStep range, not the warm-up step's.
      EXPECT_EQ(ranges.count("ProfilerStep#" + std::to_string(step)), 1u) << path;
      EXPECT_EQ(ranges.count("ProfilerStep#" + std::to_string(step - 1)), 0u) << path;
      // FSDP's all-gathers happen inside the forward, its reduce-scatters inside the backward.
      EXPECT_TRUE(nested(ranges, "loom::fsdp::all_gather", "loom::forward")) << path;
      EXPECT_TRUE(nested(ranges, "loom::fsdp::reduce_scatter", "loom::backward")) << path;
      if (rank == 0 && step == 2) {
        std::printf("rank 0 iteration_2 trace: %zu events, %zu Loom ranges, %.1f KiB\n",
                    trace.at("traceEvents").size(), ranges.size(),
                    static_cast<double>(fs::file_size(path)) / 1024.0);
      }
    }
  }
  EXPECT_FALSE(fs::exists(dir.path() / "profile_traces" / "iteration_1"));
  EXPECT_FALSE(fs::exists(dir.path() / "profile_traces" / "iteration_3"));
  // The CPU memory record: every step's time, RSS and peak RSS, on each rank.
  for (int rank : {0, 1}) {
    const fs::path path =
        dir.path() / "memory_snapshot" / ("rank" + std::to_string(rank) + "_rss_timeline.json");
    ASSERT_TRUE(fs::exists(path)) << path;
    const nlohmann::json timeline = read_json(path);
    ASSERT_EQ(timeline.at("steps").size(), 4u) << timeline.dump();
    for (const auto& s : timeline.at("steps")) {
      EXPECT_GT(s.at("seconds").get<double>(), 0.0);
      EXPECT_GT(s.at("rss_bytes").get<int64_t>(), 10 << 20);
      EXPECT_GE(s.at("peak_rss_bytes").get<int64_t>(), s.at("rss_bytes").get<int64_t>());
    }
    if (rank == 0) {
      std::printf("rank 0 RSS timeline: step 4 rss %.1f MiB, peak %.1f MiB, %.3f s\n",
                  timeline["steps"][3]["rss_bytes"].get<double>() / (1 << 20),
                  timeline["steps"][3]["peak_rss_bytes"].get<double>() / (1 << 20),
                  timeline["steps"][3]["seconds"].get<double>());
    }
  }
  std::printf("profiled FSDP run: %.1f s\n", r.seconds);
}

// Rank 1 hangs after step 2 (LOOM_FAULT_HANG). Rank 0 waits in its next collective until its
// watchdog fires (comm.timeout_seconds = 5), dumps and exits 124; the launcher then stops rank 1
// with SIGTERM, and rank 1 dumps too. Rank 0's file names the pending collective; rank 1's shows
// it never issued it: its last collective on that group is the one before.
TEST(TrainerProfiling, HangOnOneRankLeavesAFlightRecordOnEveryRank) {
  TempDir dir("hang");
  const RunResult r = run("env LOOM_FAULT_HANG=1:2 " + fsdp_job(dir, 6, " --comm.timeout_seconds=5"), 120);
  EXPECT_EQ(r.exit_code, 124) << r.output;  // the launcher ends with the watchdog's code (issue 22)
  EXPECT_NE(r.output.find("exited with code 124 (collective watchdog timeout"), std::string::npos)
      << r.output;
  const fs::path folder = dir.path() / "flight_recorder";
  ASSERT_TRUE(fs::exists(folder / "rank0.json")) << r.output;
  ASSERT_TRUE(fs::exists(folder / "rank1.json")) << r.output;
  const nlohmann::json rank0 = read_json(folder / "rank0.json");
  const nlohmann::json rank1 = read_json(folder / "rank1.json");
  EXPECT_EQ(rank0.at("rank"), 0);
  EXPECT_EQ(rank1.at("rank"), 1);

  // Rank 0: stopped by its watchdog on its oldest pending collective (an FSDP all-gather of step
  // 3; the prefetched next one may be pending behind it), which the reason names.
  const std::string reason0 = rank0.at("reason");
  EXPECT_EQ(reason0.rfind("collective watchdog: ", 0), 0u) << reason0;
  const auto& records0 = rank0.at("records");
  size_t first_pending = 0;
  while (first_pending < records0.size() && records0[first_pending].at("state") == "completed") ++first_pending;
  ASSERT_LT(first_pending, records0.size()) << rank0.dump(1);
  const nlohmann::json& stuck = records0[first_pending];
  EXPECT_EQ(stuck.at("state"), "pending") << rank0.dump(1);
  EXPECT_GE(stuck.at("pending_ms").get<double>(), 5000.0);
  EXPECT_NE(reason0.find(stuck.at("description").get<std::string>() + " has been pending"),
            std::string::npos) << reason0;
  EXPECT_EQ(stuck.at("op"), "all_gather") << stuck.dump();
  EXPECT_EQ(stuck.at("group"), "dp_shard[0,1]") << stuck.dump();

  // Rank 1: stopped by the launcher; everything it issued completed, and on the stuck collective's
  // group it got exactly one collective short of rank 0.
  const std::string reason1 = rank1.at("reason");
  EXPECT_NE(reason1.find("SIGTERM"), std::string::npos) << reason1;
  int64_t last_seq_on_group = 0;
  for (const auto& rec : rank1.at("records")) {
    EXPECT_EQ(rec.at("state"), "completed") << rec.dump();
    if (rec.at("group") == stuck.at("group")) {
      last_seq_on_group = std::max(last_seq_on_group, rec.at("group_seq").get<int64_t>());
    }
  }
  EXPECT_EQ(last_seq_on_group + 1, stuck.at("group_seq").get<int64_t>()) << rank1.dump(1);
  std::printf("hang: rank 0 stuck in '%s'; rank 1's last on that group gseq=%lld; %.1f s\n",
              stuck.at("description").get<std::string>().c_str(),
              static_cast<long long>(last_seq_on_group), r.seconds);
}
