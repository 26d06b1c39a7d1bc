// The schedule IR: action strings, layouts, CSV, validation, schedule names.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <fstream>
#include <map>

#include "loom/pipeline/generators.h"
#include "loom/pipeline/schedule.h"
#include "loom/testing/errors.h"
#include "loom/testing/run.h"

namespace {
using namespace loom::pipeline;
using loom::testing::expect_error;

TEST(PipelineAction, PrintsAndParsesPyTorchsTextForm) {
  const std::vector<std::pair<Action, std::string>> cases = {
      {F(0, 3), "0F3"},
      {B(1, 2), "1B2"},
      {I(2, 0), "2I0"},
      {W(2, 0), "2W0"},
      {{ActionKind::kSendF, 0, 3}, "0SEND_F3"},
      {{ActionKind::kRecvF, 1, 3}, "1RECV_F3"},
      {{ActionKind::kSendB, 12, 10}, "12SEND_B10"},
      {{ActionKind::kRecvB, 0, 2}, "0RECV_B2"},
      {{ActionKind::kUnshard, 1, -1}, "1UNSHARD"},
      {{ActionKind::kReshard, 7, -1}, "7RESHARD"},
      {{ActionKind::kReduceGrad, 3, -1}, "3REDUCE_GRAD"},
  };
  for (const auto& [action, text] : cases) {
    EXPECT_EQ(action.str(), text);
    EXPECT_EQ(Action::parse(text), action) << text;
    EXPECT_EQ(Action::parse(" " + text + "\t"), action) << text;
  }
}

TEST(PipelineAction, RefusesWhatIsNoAction) {
  using loom::UsageError;
  expect_error<UsageError>([] { Action::parse("F3"); }, {"'F3' is not a pipeline action", "0F3"});
  expect_error<UsageError>([] { Action::parse("0X3"); }, {"'0X3' is not a pipeline action"});
  expect_error<UsageError>([] { Action::parse("0F"); }, {"F needs a micro-batch index"});
  expect_error<UsageError>([] { Action::parse("0F3x"); }, {"'0F3x'"});
  expect_error<UsageError>([] { Action::parse("1UNSHARD2"); }, {"UNSHARD takes no micro-batch", "1UNSHARD"});
  expect_error<UsageError>([] { Action::parse("0REDUCE_GRAD1"); }, {"REDUCE_GRAD takes no micro-batch"});
  expect_error<UsageError>([] { Action::parse("0OVERLAP_F_B"); }, {"OVERLAP_F_B actions are not part"});
}

TEST(PipelineLayout, LoopedAndVShape) {
  EXPECT_EQ(stage_to_rank_map(4, 1, StageLayout::kLoop), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(stage_to_rank_map(4, 2, StageLayout::kLoop), (std::vector<int>{0, 1, 2, 3, 0, 1, 2, 3}));
  EXPECT_EQ(stage_to_rank_map(4, 2, StageLayout::kV), (std::vector<int>{0, 1, 2, 3, 3, 2, 1, 0}));
  EXPECT_EQ(stage_to_rank_map(2, 3, StageLayout::kV), (std::vector<int>{0, 1, 1, 0, 0, 1}));
  // V-shape: rank r holds stages r and 2pp-1-r.
  const Schedule s = generate_compute({"ZBVZeroBubble", 4, 8, 2});
  for (int r = 0; r < 4; ++r) EXPECT_EQ(s.stages_of(r), (std::vector<int>{r, 7 - r}));
}

TEST(PipelineNames, CaseInsensitiveAndNearestSuggestion) {
  EXPECT_EQ(canonical_schedule_name("interleaved1f1b"), "Interleaved1F1B");
  EXPECT_EQ(canonical_schedule_name("1f1b"), "1F1B");
  EXPECT_EQ(canonical_schedule_name("zbvzerobubble"), "ZBVZeroBubble");
  using loom::UsageError;
  expect_error<UsageError>([] { canonical_schedule_name("Interleaved1FB"); },
                           {"unknown pipeline schedule 'Interleaved1FB'", "did you mean 'Interleaved1F1B'?",
                            "valid: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV"});
  expect_error<UsageError>([] { canonical_schedule_name("GPip"); }, {"did you mean 'GPipe'?"});
  expect_error<UsageError>([] { canonical_schedule_name("DualPipe"); }, {"did you mean 'DualPipeV'?"});
  expect_error<UsageError>([] { canonical_schedule_name("ZBV"); }, {"did you mean 'ZBVZeroBubble'?"});
}

TEST(PipelineCsv, RoundTripOfEveryGeneratedSchedule) {
  for (const std::string& n : schedule_names()) {
    for (const bool lowered : {false, true}) {
      SCOPED_TRACE(n + (lowered ? " lowered" : " compute-only"));
      Schedule s = lowered ? build_schedule({n, 4, 8, 0}, /*fsdp=*/true) : generate_compute({n, 4, 8, 0});
      const std::string csv = to_csv(s);
      const Schedule back = schedule_from_csv_text(csv, s.name);
      EXPECT_EQ(back.ranks, s.ranks);
      EXPECT_EQ(back.stage_to_rank, s.stage_to_rank);
      EXPECT_EQ(back.num_ranks, s.num_ranks);
      EXPECT_EQ(back.stages_per_rank, s.stages_per_rank);
      EXPECT_EQ(back.num_microbatches, s.num_microbatches);
      EXPECT_EQ(back.layout, s.layout);
      EXPECT_EQ(to_csv(back), csv);
    }
  }
}

TEST(PipelineCsv, ReadsPyTorchsFormatFromAFile) {
  const loom::testing::TempDir dir("pp-csv");
  const std::string path = dir.str() + "/schedule.csv";
  // Empty cells (PyTorch writes None as '') are skipped; spaces and CRLF are tolerated.
  std::ofstream(path) << "0F0,0F1,,0B0, 0B1\r\n1F0,1B0,1F1,1B1\r\n";
  const Schedule s = load_csv(path);
  EXPECT_EQ(s.num_ranks, 2);
  EXPECT_EQ(s.num_stages(), 2);
  EXPECT_EQ(s.num_microbatches, 2);
  EXPECT_EQ(s.layout, StageLayout::kLoop);
  EXPECT_EQ(s.ranks[0], (std::vector<Action>{F(0, 0), F(0, 1), B(0, 0), B(0, 1)}));
  expect_error<loom::UsageError>([&] { load_csv(dir.str() + "/missing.csv"); }, {"cannot read", "missing.csv"});
}

TEST(PipelineCsv, RefusesMalformedSchedules) {
  using loom::UsageError;
  // Line and rank of a bad cell.
  expect_error<UsageError>([] { schedule_from_csv_text("0F0,0B0\n1F0,1X0\n", "s.csv"); },
                           {"s.csv line 2 (rank 1)", "'1X0' is not a pipeline action"});
  // A stage on two rows.
  expect_error<UsageError>([] { schedule_from_csv_text("0F0,0B0\n0F1,1F0,1B0\n", "s.csv"); },
                           {"0F1 is on stage 0, which rank 0 already runs"});
  // Incomplete: stage 1 micro-batch 1 has no backward.
  expect_error<UsageError>([] { schedule_from_csv_text("0F0,0F1,0B0,0B1\n1F0,1F1,1B0\n", "s.csv"); },
                           {"stage 1, micro-batch 1 has no complete backward", "1B1", "1I1 and 1W1"});
  // A missing forward.
  expect_error<UsageError>([] { schedule_from_csv_text("0F0,0F1,0B0,0B1\n1F0,1B0,1B1\n", "s.csv"); },
                           {"backward before the forward 1F1"});
  // W before I, a second forward.
  expect_error<UsageError>([] { schedule_from_csv_text("0F0,0W0,0I0\n", "s.csv"); },
                           {"weight gradient before its input gradient 0I0"});
  expect_error<UsageError>([] { schedule_from_csv_text("0F0,0F0,0B0\n", "s.csv"); },
                           {"a second forward of stage/micro-batch 0/0"});
  // Uneven stages per rank.
  expect_error<UsageError>([] { schedule_from_csv_text("0F0,0B0,2F0,2B0\n1F0,1B0\n", "s.csv"); },
                           {"3 stages on 2 ranks"});
  expect_error<UsageError>([] { schedule_from_csv_text("\n\n", "s.csv"); }, {"s.csv holds no actions"});
}

// Issue 22, item 11: a directory as the schedule CSV said "holds no actions", a FIFO would block
// the open forever, and absurd indices allocated gigabytes or ended in std::bad_alloc.
TEST(PipelineCsv, OnlyRegularFilesAndBoundedIndicesAreRead) {
  using loom::UsageError;
  loom::testing::TempDir dir("schedule_csv");
  expect_error<UsageError>([&] { load_csv(dir.str()); },
                           {"the pipeline schedule CSV '" + dir.str() + "' is a directory"});
  const std::string fifo = (dir.path() / "fifo.csv").string();
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  expect_error<UsageError>([&] { load_csv(fifo); }, {"is not a regular file"});  // returns at once
  expect_error<UsageError>([&] { load_csv((dir.path() / "missing.csv").string()); },
                           {"cannot read the pipeline schedule CSV", "No such file or directory"});
  expect_error<UsageError>([] { schedule_from_csv_text("0F0,0B0\n999999999F0\n", "s.csv"); },
                           {"s.csv line 2 (rank 1): 999999999F0 names stage 999999999",
                            "0 to 4095 at most"});
  expect_error<UsageError>([] { schedule_from_csv_text("0F0,0F100000000,0B0\n", "s.csv"); },
                           {"names micro-batch 100000000", "0 to 65535 at most"});
  // A real CSV on disk still loads.
  const auto csv = dir.path() / "ok.csv";
  std::ofstream(csv) << "0F0,0B0\n";
  EXPECT_EQ(load_csv(csv.string()).num_microbatches, 1);
}

TEST(PipelineValidate, CommunicationAndFsdpRules) {
  using loom::UsageError;
  // A forward whose input comes from another rank needs its RECV_F first, once communication is in.
  expect_error<UsageError>(
      [] { schedule_from_csv_text("0F0,0SEND_F0,0RECV_B0,0B0\n1F0,1B0,1SEND_B0\n", "s.csv"); },
      {"rank 1, action 0 (1F0): no 1RECV_F0 before it (its input comes from rank 0)"});
  // Compute while sharded.
  expect_error<UsageError>([] { schedule_from_csv_text("0UNSHARD,0F0,0RESHARD,0B0\n", "s.csv"); },
                           {"(0B0): stage 0 computes while sharded"});
  expect_error<UsageError>([] { schedule_from_csv_text("0UNSHARD,0F0,0B0\n", "s.csv"); },
                           {"leaves stage 0 unsharded"});
  // Every stage reduces its gradients once, after its last backward.
  expect_error<UsageError>([] { schedule_from_csv_text("0UNSHARD,0F0,0B0,0RESHARD\n", "s.csv"); },
                           {"never reduces stage 0's gradients", "0REDUCE_GRAD"});
  expect_error<UsageError>(
      [] { schedule_from_csv_text("0UNSHARD,0F0,0F1,0B0,0REDUCE_GRAD,0B1,0RESHARD\n", "s.csv"); },
      {"(0B1): backward of stage 0 after its REDUCE_GRAD"});
  // The FSDP pass: each stage gathered once per step, one compute action before its first use;
  // its gradients reduced once, right after its last backward (the last W under a split).
  for (const char* name : {"Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"}) {
    const Schedule compute = generate_compute({name, 2, 4, 2});
    for (const Schedule& s : {add_fsdp_actions(compute), add_fsdp_actions(add_communication(compute))}) {
      for (const auto& list : s.ranks) {
        int unshards = 0, reshards = 0, reduces = 0;
        std::map<int, size_t> last_backward, reduce_at;
        for (size_t i = 0; i < list.size(); ++i) {
          const Action& a = list[i];
          unshards += a.kind == ActionKind::kUnshard;
          reshards += a.kind == ActionKind::kReshard;
          reduces += a.kind == ActionKind::kReduceGrad;
          if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardWeight) last_backward[a.stage] = i;
          if (a.kind == ActionKind::kReduceGrad) reduce_at[a.stage] = i;
        }
        EXPECT_EQ(unshards, 2) << name;
        EXPECT_EQ(reshards, 2) << name;
        EXPECT_EQ(reduces, 2) << name;
        for (const auto& [stage, i] : last_backward) EXPECT_EQ(reduce_at[stage], i + 1) << name << " stage " << stage;
      }
      EXPECT_EQ(s.ranks[0][0].str(), "0UNSHARD") << name;
    }
  }
  expect_error<UsageError>([] { add_fsdp_actions(build_schedule({"1F1B", 2, 2, 0}, true)); },
                           {"already has FSDP actions"});
}

TEST(PipelineFormat, TableHasOneColumnPerRank) {
  const Schedule s = generate_compute({"1F1B", 2, 2, 0});
  EXPECT_EQ(format_table(s),
            "step  rank 0  rank 1\n"
            "0     0F0     1F0\n"
            "1     0F1     1B0\n"
            "2     0B0     1F1\n"
            "3     0B1     1B1\n");
  EXPECT_EQ(format_actions(s), "rank 0: 0F0 0F1 0B0 0B1\nrank 1: 1F0 1B0 1F1 1B1\n");
}

}  // namespace
