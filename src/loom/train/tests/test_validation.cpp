// Validation ([validation], train/validate.h) through `loom train`: the loss it reports is the
// mean token NLL that `loom score` gives the same held-out rows under the same checkpoint, every
// data-parallel / tensor-parallel / context-parallel layout reports the single process's value,
// validating leaves training untouched, and bad settings are one-line errors (exit 2).
//
// The held-out data: the first paragraphs of data/default/validation.jsonl (the default set-up's
// held-out set), as many as make the row count leave a remainder of 1 to 3 rows over a global
// batch of 8 (2 ranks x 4 rows), so the last batch is short on one rank and empty on the other:
// the padding path (an empty rank runs the forward and counts nothing) is exercised.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cmath>
#include <fstream>
#include <sstream>

#include "loom/checkpoint/metadata.h"
#include "loom/core/build_paths.h"
#include "loom/data/loader.h"
#include "loom/data/tokenizer.h"
#include "loom/train/tests/layout_runs.h"

namespace {
using loom::testing::bin_dir;
using loom::testing::layout_train_args;
using loom::testing::loom_command;
using loom::testing::read_jsonl;
using loom::testing::run;
using loom::testing::RunResult;
using loom::testing::source_path;
using loom::testing::TempDir;

constexpr int64_t kValSeqLen = 32;
constexpr int64_t kValBatch = 4;

std::shared_ptr<const loom::data::TokenCorpus> load_jsonl(const std::filesystem::path& path) {
  const auto tokenizer = loom::data::Tokenizer::from_file(source_path("data/default/tokenizer.json"));
  loom::data::SourceOptions source;
  source.format = loom::data::parse_source_format("jsonl");
  return loom::data::TokenCorpus::load({path.string()}, &tokenizer, source);
}

// Writes the held-out file (see the top of the file) into `dir`; returns its path.
std::filesystem::path write_held_out(const TempDir& dir) {
  std::ifstream in(source_path("data/default/validation.jsonl"));
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  const auto path = dir.path() / "held_out.jsonl";
  for (size_t n = 1; n <= lines.size(); ++n) {
    {
      std::ofstream out(path);
      for (size_t i = 0; i < n; ++i) out << lines[i] << "\n";
    }
    const int64_t stream = load_jsonl(path)->stream_length();
    const int64_t rows = stream / (kValSeqLen + 1);
    if (rows >= 9 && rows % 8 >= 1 && rows % 8 <= 3) return path;
  }
  ADD_FAILURE() << "no prefix of data/default/validation.jsonl gives the wanted row count";
  return path;
}

std::string validation_flags(const std::filesystem::path& held_out, int freq) {
  return " --validation.enable=true --validation.dataset_path=" + held_out.string() +
         " --validation.freq=" + std::to_string(freq) + " --validation.steps=-1" +
         " --validation.local_batch_size=" + std::to_string(kValBatch) +
         " --validation.seq_len=" + std::to_string(kValSeqLen);
}

// The run's validation rows of metrics.jsonl, in order.
std::vector<nlohmann::json> validation_rows(const TempDir& dir) {
  std::vector<nlohmann::json> out;
  for (const auto& row : read_jsonl(dir.path() / "metrics.jsonl")) {
    if (row.contains("validation_loss")) out.push_back(row);
  }
  return out;
}

// `loom score`'s "mean NLL" of one token sequence under `checkpoint`.
double score_mean_nll(const std::filesystem::path& checkpoint, const std::vector<int64_t>& ids) {
  std::string list;
  for (const int64_t id : ids) list += (list.empty() ? "" : ",") + std::to_string(id);
  RunResult r = run(bin_dir() + "/loom score --checkpoint " + checkpoint.string() + " --tokens " + list, 120);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  const std::string key = "mean NLL: ";
  const size_t at = r.output.find(key);
  if (at == std::string::npos) {
    ADD_FAILURE() << "no mean NLL in: " << r.output;
    return std::nan("");
  }
  return std::stod(r.output.substr(at + key.size()));
}

}  // namespace

// The acceptance test: train 3 steps (lr 1e-3, so the weights are not the initial ones) with a
// checkpoint and a validation at step 3; `loom score` on each held-out row of seq_len + 1 tokens
// under that checkpoint gives each row's mean NLL over its seq_len predicted tokens, and their mean
// (every row has as many) is the validation loss.
TEST(Validation, LossEqualsLoomScoreOfTheSameHeldOutRows) {
  TempDir dir("val_score");
  const auto held_out = write_held_out(dir);
  TempDir run_dir("val_score_run");
  RunResult r = run(loom_command(1, layout_train_args(run_dir, 3, 4,
                                                      "--parallelism.data_parallel_shard_degree=1"
                                                      " --checkpoint.enable=true --checkpoint.interval=3" +
                                                          validation_flags(held_out, 3))),
                    300);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[validation] step 3: loss "), std::string::npos) << r.output;
  const auto rows = validation_rows(run_dir);
  ASSERT_EQ(rows.size(), 1u);
  ASSERT_EQ(rows[0]["step"], 3);
  const double loss = rows[0]["validation_loss"].get<double>();

  const loom::data::SequencePacker packer(load_jsonl(held_out), kValSeqLen);
  const int64_t n = packer.rows_per_epoch();
  EXPECT_EQ(rows[0]["validation_tokens"].get<int64_t>(), n * kValSeqLen);
  EXPECT_NEAR(rows[0]["validation_perplexity"].get<double>(), std::exp(loss), 1e-9 * std::exp(loss));
  const auto checkpoint = run_dir.path() / "checkpoint" / loom::checkpoint::step_dir_name(3);
  std::vector<int64_t> tokens(kValSeqLen + 1), positions(kValSeqLen + 1), documents(kValSeqLen + 1);
  double sum = 0;
  for (int64_t row = 0; row < n; ++row) {
    packer.read_row(row, tokens.data(), positions.data(), documents.data());
    sum += score_mean_nll(checkpoint, tokens);
  }
  const double scored = sum / static_cast<double>(n);
  const double rel = std::abs(loss - scored) / scored;
  std::printf("validation loss %.8f vs loom score over the same %ld rows %.8f: relative difference %.3g\n",
              loss, static_cast<long>(n), scored, rel);
  EXPECT_LE(rel, 1e-5);
}

// Every layout splits the held-out rows over its data-parallel ranks (one rank's share of the last
// batch is empty), reduces the token-weighted sums and reports the single process's loss; and a
// run that validates trains exactly as one that does not (FSDP 2: bitwise-equal training losses,
// and the same logged communication).
TEST(Validation, EveryLayoutReportsTheSingleProcessLoss) {
  TempDir dir("val_layouts");
  const auto held_out = write_held_out(dir);
  const std::string val = validation_flags(held_out, 1);
  TempDir reference("val_single");
  RunResult ref = run(loom_command(1, layout_train_args(reference, 2, 8, "--parallelism.data_parallel_shard_degree=1" + val)), 300);
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const auto want = validation_rows(reference);
  ASSERT_EQ(want.size(), 2u);  // steps 1 and 2

  const std::vector<loom::testing::Layout> layouts = {
      {"fsdp2", 2, 4, "--parallelism.data_parallel_shard_degree=2"},
      {"ddp2", 2, 4, "--parallelism.data_parallel_replicate_degree=2 --parallelism.data_parallel_shard_degree=1"},
      {"tp2", 2, 8, "--parallelism.tensor_parallel_degree=2 --parallelism.data_parallel_shard_degree=1"},
      {"cp2", 2, 8, "--parallelism.context_parallel_degree=2 --parallelism.data_parallel_shard_degree=1"},
  };
  for (const auto& layout : layouts) {
    TempDir out(std::string("val_") + layout.name);
    RunResult r = run(loom_command(layout.nproc, layout_train_args(out, 2, layout.local_batch,
                                                                   layout.flags + val + loom::testing::layout_breakage())),
                      300);
    ASSERT_EQ(r.exit_code, 0) << layout.name << "\n" << r.output;
    const auto got = validation_rows(out);
    ASSERT_EQ(got.size(), want.size()) << layout.name;
    double worst = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(got[i]["step"], want[i]["step"]) << layout.name;
      EXPECT_EQ(got[i]["validation_tokens"], want[i]["validation_tokens"]) << layout.name;
      const double a = want[i]["validation_loss"].get<double>(), b = got[i]["validation_loss"].get<double>();
      worst = std::max(worst, std::abs(a - b) / a);
    }
    std::printf("%s: validation loss vs single process, steps 1-2: max relative difference %.3g\n", layout.name, worst);
    EXPECT_LE(worst, 1e-5) << layout.name;
    if (std::string(layout.name) == "fsdp2") {
      TempDir plain("val_fsdp2_off");
      RunResult p = run(loom_command(2, layout_train_args(plain, 2, 4, layout.flags)), 300);
      ASSERT_EQ(p.exit_code, 0) << p.output;
      EXPECT_EQ(loom::testing::logged_losses(plain.path()), loom::testing::logged_losses(out.path()))
          << "validating changed the training losses";
      // Step 2's logged traffic is its own, not also step 1's validation forward.
      const auto training_rows = [](const TempDir& d) {
        std::vector<nlohmann::json> rows;
        for (const auto& row : read_jsonl(d.path() / "metrics.jsonl")) {
          if (row.contains("loss")) rows.push_back(row);
        }
        return rows;
      };
      const auto with = training_rows(out), without = training_rows(plain);
      ASSERT_EQ(with.size(), 2u);
      ASSERT_EQ(without.size(), 2u);
      EXPECT_EQ(with[1]["comm_bytes"], without[1]["comm_bytes"]);
    }
  }
}

struct BadValidation {
  const char* name;
  std::string flags;
  const char* expect;
};

class ValidationBadInput : public ::testing::TestWithParam<BadValidation> {};

TEST_P(ValidationBadInput, OneLineErrorExitTwo) {
  const BadValidation& c = GetParam();
  TempDir dir("val_bad");
  // Held-out files that are not usable data (issue 22, items 4 and 9), at "{dir}" in the flags.
  std::ofstream(dir.path() / "empty.jsonl").flush();
  std::ofstream(dir.path() / "short.jsonl") << "{\"text\": \"hi\"}\n";
  ASSERT_EQ(::mkfifo((dir.path() / "fifo.jsonl").c_str(), 0600), 0);
  std::string flags = c.flags, expect = c.expect;
  for (std::string* s : {&flags, &expect}) {
    for (size_t at; (at = s->find("{dir}")) != std::string::npos;) s->replace(at, 5, dir.path().string());
  }
  RunResult r = run(loom_command(1, layout_train_args(dir, 2, 2, "--parallelism.data_parallel_shard_degree=1 " + flags)), 120);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find(expect), std::string::npos) << r.output;
  size_t lines = 0;
  for (size_t p = r.output.find("error:"); p != std::string::npos; p = r.output.find("error:", p + 1)) ++lines;
  EXPECT_EQ(lines, 1u) << r.output;
}

const std::string kHeldOut = " --validation.dataset_path=" + source_path("data/default/validation.jsonl");

INSTANTIATE_TEST_SUITE_P(
    Cases, ValidationBadInput,
    ::testing::Values(
        BadValidation{"no_path", "--validation.enable=true --validation.dataset_path=",
                      "validation.enable = true needs held-out data, but validation.dataset_path is empty"},
        BadValidation{"missing_file", "--validation.enable=true --validation.dataset_path=/nonexistent/held.jsonl",
                      "validation.dataset_path = \"/nonexistent/held.jsonl\" does not exist"},
        // Before the fix: a FIFO hung the run for good; an empty or short file was reported as the
        // training data, with exit 1.
        BadValidation{"fifo", "--validation.enable=true --validation.dataset_path={dir}/fifo.jsonl",
                      "validation.dataset_path = \"{dir}/fifo.jsonl\" is a FIFO (named pipe), not a regular file"},
        BadValidation{"empty_file", "--validation.enable=true --validation.dataset_path={dir}/empty.jsonl",
                      "validation.dataset_path = \"{dir}/empty.jsonl\" holds no documents"},
        BadValidation{"shorter_than_a_row", "--validation.enable=true --validation.dataset_path={dir}/short.jsonl",
                      "validation.dataset_path = \"{dir}/short.jsonl\" packs into"},
        BadValidation{"freq_zero", "--validation.enable=true --validation.freq=0" + kHeldOut,
                      "config key 'validation.freq' must be > 0, got 0"},
        BadValidation{"steps_zero", "--validation.enable=true --validation.steps=0" + kHeldOut,
                      "config key 'validation.steps' must be > 0, or -1 (the whole file once), got 0"},
        BadValidation{"steps_below_minus_one", "--validation.enable=true --validation.steps=-2" + kHeldOut,
                      "config key 'validation.steps' must be > 0, or -1 (the whole file once), got -2"},
        BadValidation{"seq_len_too_long", "--validation.enable=true --validation.seq_len=128" + kHeldOut,
                      "config key 'validation.seq_len' must be in [0, training.seq_len = 64]"},
        BadValidation{"pipeline", "--validation.enable=true --parallelism.pipeline_parallel_degree=2" + kHeldOut,
                      "validation.enable = true is not supported with pipeline parallelism"}),
    [](const ::testing::TestParamInfo<BadValidation>& info) { return std::string(info.param.name); });
