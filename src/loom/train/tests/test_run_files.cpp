// Issue 22, items 5 and 11: what a crash or a full disk leaves in the run folder. A metrics.jsonl
// cut mid-line is repaired when the run resumes (the cut bytes kept in a side file), `loom plot`
// skips a cut last line but still names a damaged line in the middle, and a file the run writes at
// start (config.toml) fails there, naming the path and the reason, instead of being left empty.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "loom/core/error.h"
#include "loom/testing/errors.h"
#include "loom/testing/files.h"
#include "loom/testing/run.h"
#include "loom/train/metrics.h"
#include "loom/train/plot.h"
#include "loom/train/run_folder.h"

namespace fs = std::filesystem;

namespace test_run_files {

// Two whole rows and a third cut after its loss key started: what a crash mid-write leaves.
const std::string kWholeRows = "{\"step\":1,\"loss\":5.0,\"lr\":0.001,\"tps\":100}\n"
                               "{\"step\":2,\"loss\":4.0,\"lr\":0.001,\"tps\":100}\n";
const std::string kCutRow = "{\"step\":3,\"lo";

loom::train::StepMetrics step_row(int64_t step, double loss) {
  loom::train::StepMetrics m;
  m.step = step;
  m.loss = loss;
  m.lr = 1e-3;
  m.tps = 100;
  return m;
}

}  // namespace test_run_files

using namespace loom::train;
using namespace test_run_files;
using loom::testing::file_bytes;

TEST(RunFiles, ResumeMovesACutLastLineAsideAndAppendsAfterTheLastWholeOne) {
  const fs::path dir = loom::testing::temp_dir();
  loom::testing::write(dir / "metrics.jsonl", kWholeRows + kCutRow);
  {
    MetricsLoggerOptions options{dir, true, 0};
    options.resumed_from_step = 2;
    MetricsLogger logger(options);
    logger.log(step_row(3, 3.0));
  }
  // Nothing lost: the cut bytes are in the side file, the log continues on a line of its own.
  EXPECT_EQ(file_bytes(dir / "metrics.jsonl.partial"), kCutRow + "\n");
  const std::string text = file_bytes(dir / "metrics.jsonl");
  EXPECT_EQ(text.rfind(kWholeRows + "{\"event\":\"resume\",\"step\":2,\"attempt\":0}\n{\"step\":3,", 0), 0u) << text;
  // And every reader sees whole rows: step 3 is the resumed run's.
  const RunCurves curves = read_run_curves(dir, "run");
  EXPECT_EQ(curves.steps, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(curves.values.at("loss"), (std::vector<double>{5.0, 4.0, 3.0}));

  // A file that ends with a whole line is left as it is; one that lacks only the '\n' gets it.
  EXPECT_EQ(repair_cut_last_line(dir / "metrics.jsonl"), fs::path());
  loom::testing::write(dir / "whole.jsonl", kWholeRows + "{\"step\":3}");
  EXPECT_EQ(repair_cut_last_line(dir / "whole.jsonl"), fs::path());
  EXPECT_EQ(file_bytes(dir / "whole.jsonl"), kWholeRows + "{\"step\":3}\n");
  EXPECT_EQ(repair_cut_last_line(dir / "absent.jsonl"), fs::path());
  fs::remove_all(dir);
}

TEST(RunFiles, PlotSkipsACutLastLineButNamesDamageInTheMiddle) {
  const fs::path dir = loom::testing::temp_dir();
  // A run that crashed mid-line: loom plot (and the run's own loss.svg) draws the whole rows.
  loom::testing::write(dir / "metrics.jsonl", kWholeRows + kCutRow);
  const RunCurves curves = read_run_curves(dir, "run");
  EXPECT_EQ(curves.steps, (std::vector<int64_t>{1, 2}));
  write_plot({dir}, dir / "loss.svg");
  EXPECT_TRUE(fs::exists(dir / "loss.svg"));
  // The same bytes followed by more lines are damage, not a crash's cut: an error naming line 3.
  loom::testing::write(dir / "metrics.jsonl", kWholeRows + kCutRow + "\n{\"step\":4,\"loss\":2.0}\n");
  loom::testing::expect_error([&] { read_run_curves(dir, "run"); },
                              {(dir / "metrics.jsonl").string() + ":3 is not a JSON object", "repair or delete"});
  fs::remove_all(dir);
}

TEST(RunFiles, AWriteAtStartFailsNamingThePathAndTheReason) {
  const fs::path dir = loom::testing::temp_dir();
  write_file_atomically(dir / "config.toml", "a = 1\n");
  EXPECT_EQ(file_bytes(dir / "config.toml"), "a = 1\n");
  // A full disk, deterministically: the file being written is /dev/full, where every write fails
  // with ENOSPC.
  fs::create_symlink("/dev/full", dir / "config.toml.tmp");
  loom::testing::expect_error([&] { write_file_atomically(dir / "config.toml", "b = 2\n"); },
                              {"cannot write '" + (dir / "config.toml").string() + "'", "No space left on device"});
  EXPECT_EQ(file_bytes(dir / "config.toml"), "a = 1\n");  // the previous one is intact
  EXPECT_FALSE(fs::exists(fs::symlink_status(dir / "config.toml.tmp")));
  // A path that cannot become a file.
  fs::create_directories(dir / "dir.toml");
  fs::create_directories(dir / "dir.toml" / "inside");
  loom::testing::expect_error([&] { write_file_atomically(dir / "dir.toml", "c = 3\n"); },
                              {"cannot write '" + (dir / "dir.toml").string() + "'"});
  fs::remove_all(dir);
}
