#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "loom/core/build_paths.h"
#include "loom/core/error.h"
#include "loom/testing/errors.h"
#include "loom/train/compatibility.h"
#include "loom/train/config.h"

namespace loom::train {
namespace {

const std::string kSource = loom::kSourceDir;

// Runs `fn`, which must throw loom::UsageError, and returns its message after checking it is one
// line with exit code 2.
template <typename Fn>
std::string usage_error(Fn&& fn) {
  try {
    fn();
  } catch (const loom::UsageError& e) {
    EXPECT_EQ(e.exit_code(), loom::kExitUsage);
    const std::string message = e.what();
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    return message;
  }
  ADD_FAILURE() << "no loom::UsageError thrown";
  return {};
}

JobConfig parse(const std::string& text) { return parse_config_toml(text, "configs/x.toml"); }

TEST(Config, DefaultsMirrorTorchTitanAndValidate) {
  const JobConfig c;
  EXPECT_EQ(c.model.name, "llama3");
  EXPECT_EQ(c.model.flavor, "debugmodel");
  EXPECT_EQ(c.optimizer.name, "AdamW");
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 8e-4);
  EXPECT_DOUBLE_EQ(c.optimizer.beta2, 0.95);
  EXPECT_EQ(c.optimizer.implementation, loom::optim::AdamWImplementation::kFused);
  EXPECT_EQ(c.lr_scheduler.warmup_steps, 200);
  EXPECT_FALSE(c.lr_scheduler.decay_ratio.has_value());
  EXPECT_EQ(c.lr_scheduler.decay_type, loom::optim::DecayType::kLinear);
  EXPECT_EQ(c.training.dataset_path, "data/default/corpus.jsonl");
  EXPECT_EQ(c.training.global_batch_size, -1);
  EXPECT_EQ(c.parallelism.data_parallel_shard_degree, -1);
  EXPECT_EQ(c.parallelism.fsdp_reshard_after_forward, "default");
  EXPECT_FALSE(c.parallelism.fsdp_accumulate_unsharded);  // off: it holds the whole model gathered
  EXPECT_EQ(c.metrics.peak_flops, 0.0);
  EXPECT_FALSE(c.checkpoint.enable);
  EXPECT_NO_THROW(validate(c));
  EXPECT_EQ(load_job_config(""), c);
}

TEST(Config, LoadsTheDebugConfig) {
  const JobConfig c = load_job_config(kSource + "/configs/llama3_debug.toml");
  EXPECT_EQ(c.model.flavor, "debugmodel");
  EXPECT_EQ(c.model.tokenizer_path, "data/default/tokenizer.json");
  EXPECT_EQ(c.model.vocab_size, 0);
  EXPECT_EQ(c.training.dataset_path, "data/default/corpus.jsonl");
  EXPECT_EQ(c.training.seq_len, 256);
  EXPECT_EQ(c.training.local_batch_size, 4);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 4e-3);
  EXPECT_EQ(c.lr_scheduler.warmup_steps, 10);
  EXPECT_EQ(c.lr_scheduler.decay_type, loom::optim::DecayType::kCosine);
  EXPECT_DOUBLE_EQ(c.training.max_norm, 1.0);
  EXPECT_EQ(c.metrics.log_freq, 10);
  EXPECT_EQ(c.parallelism.data_parallel_shard_degree, -1);
  EXPECT_GT(c.training.steps, 0);
}

TEST(Config, EveryShippedConfigLoads) {
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator(kSource + "/configs")) {
    if (entry.path().extension() != ".toml") continue;
    // A `loom rl` config (an [rl] table next to the job's) is loaded by rl's own loader:
    // RlLoop.ShippedRlConfigsLoad.
    std::ifstream in(entry.path());
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (text.find("\n[rl]") != std::string::npos) continue;
    SCOPED_TRACE(entry.path().string());
    const JobConfig c = load_job_config(entry.path().string());
    EXPECT_FALSE(c.model.flavor.empty());
    ++count;
  }
  EXPECT_GE(count, 4);
  EXPECT_EQ(load_job_config(kSource + "/configs/llama3_70b.toml").parallelism.tensor_parallel_degree,
            8);
}

TEST(Config, OverridesOfEveryType) {
  JobConfig c;
  apply_overrides(c, {"--training.steps=10", "--training.seq_len", "128",
                      "--training.global_batch_size", "-1", "--optimizer.lr=3e-4",
                      "--optimizer.eps", "1", "--job.description=two words",
                      "--training.deterministic", "--checkpoint.enable", "true",
                      "--metrics.enable_jsonl=false", "--lr_scheduler.decay_ratio=0.2",
                      "--parallelism.fsdp_reshard_after_forward=2"});
  EXPECT_EQ(c.training.steps, 10);
  EXPECT_EQ(c.training.seq_len, 128);
  EXPECT_EQ(c.training.global_batch_size, -1);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 3e-4);
  EXPECT_DOUBLE_EQ(c.optimizer.eps, 1.0);  // integers are accepted for numbers
  EXPECT_EQ(c.job.description, "two words");
  EXPECT_TRUE(c.training.deterministic);  // a bare boolean flag means true
  EXPECT_TRUE(c.checkpoint.enable);
  EXPECT_FALSE(c.metrics.enable_jsonl);
  EXPECT_EQ(c.lr_scheduler.decay_ratio, 0.2);
  EXPECT_EQ(c.parallelism.fsdp_reshard_after_forward, "2");

  // Later overrides win; "none" and negative values unset the optional ratio.
  apply_overrides(c, {"--lr_scheduler.decay_ratio", "none", "--training.steps=11",
                      "--parallelism.fsdp_reshard_after_forward", "never"});
  EXPECT_FALSE(c.lr_scheduler.decay_ratio.has_value());
  EXPECT_EQ(c.training.steps, 11);
  EXPECT_EQ(c.parallelism.fsdp_reshard_after_forward, "never");
  apply_overrides(c, {"--lr_scheduler.decay_ratio=0.5", "--lr_scheduler.decay_ratio=-1"});
  EXPECT_FALSE(c.lr_scheduler.decay_ratio.has_value());

  // Overrides apply after the file.
  const JobConfig d = load_job_config(kSource + "/configs/llama3_debug.toml",
                                      {"--training.steps=3", "--model.flavor=tiny"});
  EXPECT_EQ(d.training.steps, 3);
  EXPECT_EQ(d.model.flavor, "tiny");
  EXPECT_EQ(d.training.seq_len, 256);
}

TEST(Config, FileValuesOfEveryType) {
  const JobConfig c = parse(
      "[training]\nsteps = 7\nmax_norm = 2\ndeterministic = true\ndataset_format = \"text\"\n"
      "[lr_scheduler]\ndecay_ratio = 0.25\n"
      "[parallelism]\nfsdp_reshard_after_forward = 4\nfsdp_accumulate_unsharded = true\n");
  EXPECT_EQ(c.training.steps, 7);
  EXPECT_DOUBLE_EQ(c.training.max_norm, 2.0);
  EXPECT_TRUE(c.training.deterministic);
  EXPECT_EQ(c.training.dataset_format, loom::data::DatasetFormat::kText);
  EXPECT_EQ(c.lr_scheduler.decay_ratio, 0.25);
  EXPECT_EQ(c.parallelism.fsdp_reshard_after_forward, "4");
  EXPECT_TRUE(c.parallelism.fsdp_accumulate_unsharded);
  EXPECT_FALSE(parse("[lr_scheduler]\ndecay_ratio = -1\n").lr_scheduler.decay_ratio.has_value());
}

TEST(Config, FileErrorsAreOneLineWithLocationAndSuggestion) {
  EXPECT_EQ(usage_error([] { parse("[training]\nstepz = 10\n"); }),
            "unknown config key 'training.stepz' in configs/x.toml:2:1 (did you mean "
            "'training.steps'?)");
  EXPECT_EQ(usage_error([] { parse("[trainin]\nsteps = 10\n"); }),
            "unknown config section 'trainin' in configs/x.toml:1:2 (did you mean 'training'?)");
  EXPECT_EQ(usage_error([] { parse("steps = 10\n"); }),
            "config key 'steps' in configs/x.toml:1:1 is outside any [section] (did you mean "
            "'training.steps'?)");
  EXPECT_EQ(usage_error([] { parse("[training]\nsteps = \"ten\"\n"); }),
            "config key 'training.steps' expects an integer, got string \"ten\" in "
            "configs/x.toml:2:9");
  EXPECT_EQ(usage_error([] { parse("[training]\nsteps = 10.5\n"); }),
            "config key 'training.steps' expects an integer, got float 10.5 in configs/x.toml:2:9");
  EXPECT_EQ(usage_error([] { parse("[training]\ndeterministic = 1\n"); }),
            "config key 'training.deterministic' expects a boolean, got integer 1 in "
            "configs/x.toml:2:17");
  EXPECT_EQ(usage_error([] { parse("[model]\nname = [\"llama3\"]\n"); }),
            "config key 'model.name' expects a string, got an array in configs/x.toml:2:8");
  EXPECT_EQ(usage_error([] { parse("[lr_scheduler]\ndecay_type = \"cosin\"\n"); }),
            "config key 'lr_scheduler.decay_type' must be \"linear\", \"sqrt\" or \"cosine\", got "
            "\"cosin\" in configs/x.toml:2:14 (did you mean \"cosine\"?)");
  EXPECT_EQ(usage_error([] { parse("[parallelism]\nfsdp_reshard_after_forward = \"sometimes\"\n"); }),
            "config key 'parallelism.fsdp_reshard_after_forward' must be \"default\", \"always\", "
            "\"never\" or a positive integer, got \"sometimes\" in configs/x.toml:2:30 (did you "
            "mean \"never\"?)");

  const std::string malformed = usage_error([] { parse("[training]\nsteps = = 3\n"); });
  EXPECT_EQ(malformed.rfind("malformed TOML in configs/x.toml:2:", 0), 0u) << malformed;

  EXPECT_EQ(usage_error([] { load_config_file("configs/does_not_exist.toml"); }),
            "config file 'configs/does_not_exist.toml' not found; pass an existing TOML file, e.g. "
            "--config configs/llama3_debug.toml");
}

TEST(Config, OverrideErrorsAreOneLine) {
  JobConfig c;
  EXPECT_EQ(usage_error([&] { apply_overrides(c, {"--training.stepz=5"}); }),
            "unknown config key 'training.stepz' in command-line override '--training.stepz=5' "
            "(did you mean 'training.steps'?)");
  EXPECT_EQ(usage_error([&] { apply_overrides(c, {"--trainin.steps", "5"}); }),
            "unknown config key 'trainin.steps' in command-line override '--trainin.steps' (did "
            "you mean 'training.steps'?)");
  EXPECT_EQ(usage_error([&] { apply_overrides(c, {"--training.steps=ten"}); }),
            "config key 'training.steps' expects an integer, got \"ten\" in command-line override "
            "'--training.steps=ten'");
  EXPECT_EQ(usage_error([&] { apply_overrides(c, {"--optimizer.lr", "fast"}); }),
            "config key 'optimizer.lr' expects a number, got \"fast\" in command-line override "
            "'--optimizer.lr fast'");
  EXPECT_EQ(usage_error([&] { apply_overrides(c, {"--training.deterministic=yes"}); }),
            "config key 'training.deterministic' expects a boolean, got \"yes\" in command-line "
            "override '--training.deterministic=yes'");
  EXPECT_EQ(usage_error([&] { apply_overrides(c, {"--training.steps"}); }),
            "config override '--training.steps' needs a value: --training.steps=VALUE or "
            "--training.steps VALUE");
  EXPECT_EQ(usage_error([&] { apply_overrides(c, {"--training.steps", "--training.seq_len=5"}); }),
            "config override '--training.steps' needs a value: --training.steps=VALUE or "
            "--training.steps VALUE");
  EXPECT_EQ(usage_error([&] { apply_overrides(c, {"steps=5"}); }),
            "unexpected argument 'steps=5'; config overrides look like --section.key=value");
  EXPECT_EQ(usage_error([&] { apply_overrides(c, {"--activation_checkpoint.mode=partial"}); }),
            "config key 'activation_checkpoint.mode' must be \"none\", \"full\" or \"selective\", "
            "got \"partial\" in command-line override '--activation_checkpoint.mode=partial' (did "
            "you mean \"full\"?)");
  EXPECT_EQ(c, JobConfig{});  // a rejected override changes nothing
}

TEST(Config, ValidateChecksRangesAndCrossFieldRules) {
  auto invalid = [](const std::vector<std::string>& overrides) {
    return usage_error([&] { load_job_config("", overrides); });
  };
  EXPECT_EQ(invalid({"--training.seq_len=0"}), "config key 'training.seq_len' must be > 0, got 0");
  EXPECT_EQ(invalid({"--optimizer.beta2=1.0"}),
            "config key 'optimizer.beta2' must be in [0, 1), got 1.0");
  EXPECT_EQ(invalid({"--training.local_batch_size=8", "--training.global_batch_size=12"}),
            "config key 'training.global_batch_size' must be -1 or a positive multiple of "
            "training.local_batch_size (8), got 12");
  EXPECT_EQ(invalid({"--parallelism.data_parallel_shard_degree=0"}),
            "config key 'parallelism.data_parallel_shard_degree' must be -1 or >= 1, got 0");
  EXPECT_EQ(invalid({"--checkpoint.keep_latest_k=1"}),
            "config key 'checkpoint.keep_latest_k' must be 0 (keep all) or >= 2, got 1");
  EXPECT_EQ(invalid({"--lr_scheduler.decay_ratio=1.5"}),
            "config key 'lr_scheduler.decay_ratio' must be in [0, 1] or unset, got 1.5");
  // Issue 14: TensorBoard is written now, so asking for it is valid.
  EXPECT_TRUE(load_job_config("", {"--metrics.enable_tensorboard"}).metrics.enable_tensorboard);

  JobConfig c;
  c.training.local_batch_size = 4;
  EXPECT_EQ(gradient_accumulation_steps(c, 2), 1);  // global = -1
  c.training.global_batch_size = 32;
  EXPECT_EQ(gradient_accumulation_steps(c, 2), 4);
  EXPECT_EQ(gradient_accumulation_steps(c, 8), 1);
  EXPECT_EQ(usage_error([&] { gradient_accumulation_steps(c, 3); }),
            "training.global_batch_size (32) is not a multiple of training.local_batch_size x "
            "data-parallel degree (4 x 3 = 12); set it to a multiple of 12 or to -1");
}

TEST(Config, ToTomlRoundTrips) {
  EXPECT_EQ(parse(JobConfig{}.to_toml()), JobConfig{});

  JobConfig c = load_job_config(kSource + "/configs/llama3_debug.toml");
  apply_overrides(c, {"--job.description=quotes \" and \\ backslash\tand tab",
                      "--optimizer.lr=0.1", "--optimizer.eps=1e-12", "--training.max_norm=3",
                      "--lr_scheduler.decay_ratio=0.3", "--parallelism.fsdp_reshard_after_forward=2",
                      "--training.seed=-7", "--checkpoint.initial_load_path=/tmp/ck/step_10"});
  const std::string text = c.to_toml();
  EXPECT_EQ(parse(text), c) << text;
  EXPECT_NE(text.find("[training]\n"), std::string::npos);
  EXPECT_NE(text.find("\nlr = 0.1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("\nmax_norm = 3.0\n"), std::string::npos) << text;
  EXPECT_NE(text.find("\neps = 1e-12\n"), std::string::npos) << text;
  EXPECT_NE(text.find("\nbeta2 = 0.95\n"), std::string::npos) << text;
  EXPECT_NE(text.find("\nfsdp_reshard_after_forward = 2\n"), std::string::npos) << text;

  // An unset optional is written as a comment and read back as unset.
  apply_overrides(c, {"--lr_scheduler.decay_ratio=none"});
  const std::string unset = c.to_toml();
  EXPECT_NE(unset.find("# decay_ratio is unset\n"), std::string::npos) << unset;
  EXPECT_EQ(parse(unset), c);

  // Every schema key is printed exactly once.
  for (const ConfigKey& key : config_schema()) {
    if (key.name() == "lr_scheduler.decay_ratio") continue;
    EXPECT_NE(unset.find("\n" + std::string(key.key) + " = "), std::string::npos) << key.name();
  }
}

// docs/config.md's reference is generated from the schema: a key added, renamed or re-described in
// config.cpp without `make docs` fails here, so the page cannot drift from the code.
TEST(Config, DocsAreGeneratedFromTheSchema) {
  std::ifstream in(kSource + "/docs/config.md");
  ASSERT_TRUE(in.good()) << "docs/config.md missing";
  std::stringstream doc;
  doc << in.rdbuf();
  const std::string marker = "<!-- generated below";
  const size_t at = doc.str().find(marker);
  ASSERT_NE(at, std::string::npos) << "docs/config.md lost its '" << marker << "' line";
  // To the end of the page, or to the next generated part (`loom rl --config-reference`'s [rl]).
  const size_t begin = doc.str().find('\n', at) + 1;
  const size_t next = doc.str().find("\n<!-- ", begin);
  const std::string generated = doc.str().substr(begin, next == std::string::npos ? std::string::npos : next + 1 - begin);
  EXPECT_EQ(generated, config_reference_markdown())
      << "docs/config.md differs from the config schema: run `make docs` (each section's options::Section "
         "holds each key's type, default and meaning)";
  for (const ConfigKey& key : config_schema()) {
    EXPECT_NE(generated.find("| `" + key.name() + "` |"), std::string::npos) << key.name();
    EXPECT_FALSE(key.help.empty()) << key.name() << " has no meaning in the schema";
  }
}

TEST(Config, OptimizerAndScheduleOptions) {
  const JobConfig c = load_job_config(kSource + "/configs/llama3_debug.toml",
                                      {"--optimizer.implementation=foreach",
                                       "--lr_scheduler.decay_ratio=0.3"});
  const optim::AdamWOptions adamw = c.optimizer.request().adamw;
  EXPECT_DOUBLE_EQ(adamw.lr, 4e-3);
  EXPECT_DOUBLE_EQ(adamw.beta2, 0.95);
  EXPECT_DOUBLE_EQ(adamw.eps, 1e-8);
  EXPECT_EQ(adamw.implementation, optim::AdamWImplementation::kForeach);
  const optim::LRScheduleOptions& schedule = c.lr_scheduler;
  EXPECT_EQ(schedule.warmup_steps, 10);
  EXPECT_EQ(schedule.decay_ratio, 0.3);
  EXPECT_EQ(schedule.decay_type, optim::DecayType::kCosine);
  EXPECT_DOUBLE_EQ(schedule.min_lr_factor, 0.0);
}

// Issue 8 F: inf/nan parse as numbers (from_chars and TOML both take them) and passed the range
// checks (inf >= 0); every float key of the schema must reject them.
TEST(Config, NonFiniteNumbersAreRejected) {
  EXPECT_EQ(usage_error([] { load_job_config("", {"--optimizer.lr=inf"}); }),
            "config key 'optimizer.lr' must be a finite number, got inf");
  EXPECT_EQ(usage_error([] { load_job_config("", {"--optimizer.beta1=nan"}); }),
            "config key 'optimizer.beta1' must be a finite number, got nan");
  // TOML's own literals, including -inf for the optional key whose negative values mean unset.
  EXPECT_EQ(usage_error([] { validate(parse("[training]\nmax_norm = inf\n")); }),
            "config key 'training.max_norm' must be a finite number, got inf");
  EXPECT_EQ(usage_error([] { validate(parse("[lr_scheduler]\ndecay_ratio = nan\n")); }),
            "config key 'lr_scheduler.decay_ratio' must be a finite number, got nan");
  EXPECT_EQ(usage_error([] { validate(parse("[lr_scheduler]\ndecay_ratio = -inf\n")); }),
            "config key 'lr_scheduler.decay_ratio' must be a finite number, got -inf");
  EXPECT_EQ(usage_error([] { load_job_config("", {"--lr_scheduler.decay_ratio=-inf"}); }),
            "config key 'lr_scheduler.decay_ratio' must be a finite number, got -inf");
  // Every float key, found through the schema, so a key added later is covered too.
  int float_keys = 0;
  for (const ConfigKey& key : config_schema()) {
    JobConfig probe;
    const ConfigField field = key.field(probe);
    if (!std::holds_alternative<double*>(field) && !std::holds_alternative<std::optional<double>*>(field)) continue;
    ++float_keys;
    for (const char* value : {"inf", "-inf", "nan"}) {
      EXPECT_EQ(usage_error([&] { load_job_config("", {"--" + key.name() + "=" + value}); }),
                "config key '" + key.name() + "' must be a finite number, got " + value);
    }
  }
  // lr, eps, beta1, beta2, weight_decay, decay_ratio, min_lr_factor, max_norm, peak_flops so far.
  EXPECT_GE(float_keys, 9);
  EXPECT_NO_THROW(load_job_config("", {"--optimizer.lr=1e-3", "--lr_scheduler.decay_ratio=-1"}));
}

// Issue 8 E: INT64_MAX seconds became "-1000 ms" and 1e10 an immediate rendezvous failure.
TEST(Config, CommTimeoutHasAnUpperBound) {
  const std::string expected =
      "config key 'comm.timeout_seconds' must be in [1, 604800] (at most one week: larger values "
      "overflow the millisecond timeouts), got ";
  EXPECT_EQ(usage_error([] { load_job_config("", {"--comm.timeout_seconds=9223372036854775807"}); }),
            expected + "9223372036854775807");
  EXPECT_EQ(usage_error([] { load_job_config("", {"--comm.timeout_seconds=10000000000"}); }),
            expected + "10000000000");
  EXPECT_EQ(usage_error([] { load_job_config("", {"--comm.timeout_seconds=0"}); }), expected + "0");
  EXPECT_EQ(load_job_config("", {"--comm.timeout_seconds=604800"}).comm.timeout_seconds, 604800);
}

// Issue 8 G: a key without its section was compared with whole "section.key" names, so
// "--steps=2" suggested "model.name".
TEST(Config, KeyWithoutSectionSuggestsTheFullName) {
  JobConfig c;
  EXPECT_EQ(usage_error([&] { apply_overrides(c, {"--steps=2"}); }),
            "unknown config key 'steps' in command-line override '--steps=2' (did you mean "
            "'training.steps'?)");
  EXPECT_EQ(usage_error([&] { apply_overrides(c, {"--lr", "0.1"}); }),
            "unknown config key 'lr' in command-line override '--lr' (did you mean "
            "'optimizer.lr'?)");
  EXPECT_EQ(usage_error([&] { apply_overrides(c, {"--seqlen=8"}); }),
            "unknown config key 'seqlen' in command-line override '--seqlen=8' (did you mean "
            "'training.seq_len'?)");
}

// Issue 8 I: a directory was reported as "not found".
TEST(Config, ConfigPathThatIsADirectory) {
  EXPECT_EQ(usage_error([] { load_config_file(kSource + "/configs"); }),
            "config file '" + kSource + "/configs' is a directory; pass a TOML file, e.g. --config "
            "configs/llama3_debug.toml");
}

// Issue 8 A/B: the data format is a choice that includes "auto", and the JSONL field is a key.
TEST(Config, DatasetFormatAndJsonlField) {
  const JobConfig defaults;
  EXPECT_EQ(defaults.training.dataset_format, loom::data::DatasetFormat::kJsonl);
  EXPECT_EQ(defaults.training.jsonl_field, "text");
  const JobConfig c = load_job_config("", {"--training.dataset_format=auto", "--training.jsonl_field=body"});
  EXPECT_EQ(c.training.dataset_format, loom::data::DatasetFormat::kAuto);
  EXPECT_EQ(c.training.jsonl_field, "body");
  EXPECT_EQ(parse("[training]\ndataset_format = \"tokens\"\njsonl_field = \"content\"\n").training.jsonl_field,
            "content");
  EXPECT_EQ(usage_error([] { parse("[training]\ndataset_format = \"json\"\n"); }),
            "config key 'training.dataset_format' must be \"jsonl\", \"text\", \"tokens\", \"sft\", \"parquet\", "
            "\"arrow\" or \"auto\", "
            "got \"json\" in configs/x.toml:2:18 (did you mean \"jsonl\"?)");
}

// Issue 30: a weighted mixture is an array of tables, [[training.datasets]] in a file or an inline
// array on the command line; it round-trips through config.toml and its weights are checked.
TEST(Config, DatasetsMixtureAsArrayOfTables) {
  const JobConfig c = parse(
      "[training]\nseed = 3\n[[training.datasets]]\npath = \"web/*.parquet\"\nformat = \"parquet\"\n"
      "weight = 0.7\n[[training.datasets]]\npath = \"code\"\nformat = \"arrow\"\nweight = 0.3\n"
      "text_column = \"content\"\n");
  ASSERT_EQ(c.training.datasets.size(), 2u);
  EXPECT_EQ(c.training.seed, 3);
  EXPECT_EQ(c.training.datasets[0].path, "web/*.parquet");
  EXPECT_EQ(c.training.datasets[0].format, loom::data::DatasetFormat::kParquet);
  EXPECT_DOUBLE_EQ(c.training.datasets[0].weight, 0.7);
  EXPECT_EQ(c.training.datasets[0].text_column, "");
  EXPECT_EQ(c.training.datasets[1].format, loom::data::DatasetFormat::kArrow);
  EXPECT_EQ(c.training.datasets[1].text_column, "content");
  EXPECT_NO_THROW(validate(c));
  // config.toml's form (an inline array) reads back the same.
  const std::string text = c.to_toml();
  EXPECT_NE(text.find("\ndatasets = [{ path = \"web/*.parquet\", format = \"parquet\", weight = 0.7, "
                      "text_column = \"\" }, { path = \"code\""),
            std::string::npos)
      << text;
  EXPECT_EQ(parse(text), c);
  // The command line takes the inline array; a later value replaces the whole array.
  const JobConfig cli = load_job_config("", {"--training.datasets=[{path = \"a.jsonl\", weight = 2}]",
                                             "--training.datasets", "[{ path = \"b\" }, { path = \"c\", weight = 0 }]"});
  ASSERT_EQ(cli.training.datasets.size(), 2u);
  EXPECT_EQ(cli.training.datasets[0].path, "b");
  EXPECT_DOUBLE_EQ(cli.training.datasets[0].weight, 1.0);
  EXPECT_DOUBLE_EQ(cli.training.datasets[1].weight, 0.0);
  // Errors: one line, naming the entry and the fix.
  EXPECT_EQ(usage_error([] { parse("[[training.datasets]]\npth = \"a\"\n"); }),
            "unknown config key 'training.datasets[0].pth' in configs/x.toml:2:1 (did you mean 'path'?)");
  EXPECT_EQ(usage_error([] { parse("[training]\ndatasets = \"a.parquet\"\n"); }),
            "config key 'training.datasets' expects an array of tables ([[training.datasets]] entries), got string "
            "\"a.parquet\" in configs/x.toml:2:12");
  EXPECT_EQ(usage_error([] { parse("[[training.datasets]]\npath = \"a\"\nweight = \"high\"\n"); }),
            "config key 'training.datasets[0].weight' expects a number, got string \"high\" in configs/x.toml:3:10");
  EXPECT_EQ(usage_error([] { load_job_config("", {"--training.datasets=[{path = \"a\", weight = -1}]"}); }),
            "training.datasets[0].weight = -1.0 (a) must be a finite number >= 0; a source's share is weight / sum "
            "of weights");
  EXPECT_EQ(usage_error([] {
              load_job_config("", {"--training.datasets=[{path = \"a\", weight = 0}, {path = \"b\", weight = 0}]"});
            }),
            "every [[training.datasets]] weight is 0; give at least one source a weight above 0");
  EXPECT_EQ(usage_error([] { load_job_config("", {"--training.datasets=[{weight = 1}]"}); }),
            "training.datasets[0] has no path; give each [[training.datasets]] entry a path (a file, a directory "
            "or a glob)");
  EXPECT_NE(usage_error([] { load_job_config("", {"--training.datasets=a.parquet"}); })
                .find("expects an inline array of tables such as"),
            std::string::npos);
}

// Issue 8 L said the keys of features not built yet say so in their help, their docs and the
// README. Pipeline parallelism and activation checkpointing are built now: none of them may still
// call them unavailable.
TEST(Config, BuiltFeaturesNoLongerSayTheyAreNotAvailable) {
  std::ifstream in(kSource + "/docs/config.md");
  std::stringstream doc;
  doc << in.rdbuf();
  const std::string docs = doc.str();
  for (const char* name : {"parallelism.pipeline_parallel_degree", "activation_checkpoint.mode"}) {
    SCOPED_TRACE(name);
    const auto key = std::find_if(config_schema().begin(), config_schema().end(),
                                  [&](const ConfigKey& k) { return k.name() == name; });
    ASSERT_NE(key, config_schema().end());
    EXPECT_EQ(key->help.find("Not available"), std::string_view::npos) << key->help;
    const size_t row = docs.find("| `" + std::string(name) + "` |");
    ASSERT_NE(row, std::string::npos);
    const std::string line = docs.substr(row, docs.find('\n', row) - row);
    EXPECT_EQ(line.find("Not available"), std::string::npos) << line;
  }
  std::ifstream readme_in(kSource + "/README.md");
  std::stringstream readme;
  readme << readme_in.rdbuf();
  for (const char* says : {"pipeline parallelism is not available", "activation checkpointing is not available",
                           "`activation_checkpoint.mode` only", "`pipeline_parallel_degree` accepts only 1"}) {
    EXPECT_EQ(readme.str().find(says), std::string::npos) << says;
  }
}

TEST(Config, EditDistance) {
  EXPECT_EQ(edit_distance("", ""), 0u);
  EXPECT_EQ(edit_distance("steps", "stepz"), 1u);
  EXPECT_EQ(edit_distance("kitten", "sitting"), 3u);
  EXPECT_EQ(edit_distance("abc", ""), 3u);
}

// Issue 22, item 11: a schedule CSV without a pipeline was silently ignored; a memory snapshot
// alone was refused over the profiler's warm-up and active steps, which do not apply without it.
TEST(Config, ScheduleCsvNeedsAPipelineAndMemorySnapshotsNeedNoProfilerWindow) {
  loom::testing::expect_error<loom::UsageError>(
      [] {
        load_job_config(kSource + "/configs/llama3_debug.toml",
                        {"--parallelism.pipeline_parallel_schedule_csv=my.csv"});
      },
      {"parallelism.pipeline_parallel_schedule_csv = 'my.csv' needs pipeline parallelism",
       "pipeline_parallel_degree = 1"});
  const JobConfig snapshot = load_job_config(
      kSource + "/configs/llama3_debug.toml",
      {"--profiling.enable_memory_snapshot=true", "--profiling.profile_freq=1"});
  EXPECT_TRUE(snapshot.profiling.enable_memory_snapshot);
  EXPECT_EQ(snapshot.profiling.profile_freq, 1);
  // With the profiler on, the window must still hold its warm-up and recorded steps.
  loom::testing::expect_error<loom::UsageError>(
      [] {
        load_job_config(kSource + "/configs/llama3_debug.toml",
                        {"--profiling.enable_profiling=true", "--profiling.profile_freq=1",
                         "--profiling.profiler_warmup=1", "--profiling.profiler_active=1"});
      },
      {"profiling.profile_freq = 1 is shorter than"});
}

// Issue 23, item 5: the settings that do not compose are one table (train/compatibility.h), each
// row refused once, at config load or (needing the resolved degrees) before rendezvous; it used to
// be spread over the config check, the model's spec, the Trainer and the TP library.
TEST(Compatibility, EveryRowIsAOneLineUsageErrorBeforeRendezvous) {
  const std::string config = kSource + "/configs/llama3_debug.toml";
  struct Case {
    std::vector<std::string> overrides;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {{"--parallelism.enable_async_tensor_parallel=true", "--parallelism.disable_sequence_parallel=true"},
       "enable_async_tensor_parallel needs sequence parallelism"},
      {{"--float8.enable=true", "--parallelism.tensor_parallel_degree=2", "--parallelism.enable_async_tensor_parallel=true"},
       "float8.enable = true does not compose with parallelism.enable_async_tensor_parallel"},
      {{"--validation.enable=true", "--parallelism.pipeline_parallel_degree=2"},
       "validation.enable = true is not supported with pipeline parallelism"},
      {{"--parallelism.pipeline_parallel_schedule_csv=my.csv"}, "needs pipeline parallelism"},
      {{"--optimizer.name=Muon", "--training.step_readback=log_steps"}, "\"log_steps\" needs AdamW"},
      {{"--parallelism.expert_parallel_degree=2", "--parallelism.tensor_parallel_degree=2",
        "--parallelism.disable_sequence_parallel=true"},
       "with tensor parallelism needs sequence parallelism"},
      {{"--lora.rank=4", "--parallelism.enable_async_tensor_parallel=true"},
       "lora.rank > 0 does not compose with parallelism.enable_async_tensor_parallel"},
      {{"--lora.rank=4", "--lora.dropout=0.1", "--activation_checkpoint.mode=full"},
       "lora.dropout = 0.1 does not compose with activation checkpointing"},
      {{"--fault_tolerance.enable=true", "--parallelism.expert_parallel_degree=2"},
       "fault_tolerance.enable = true does not compose with parallelism.expert_parallel_degree = 2"},
      {{"--fault_tolerance.enable=true", "--optimizer.name=Muon"},
       "fault_tolerance.enable = true does not compose with optimizer.name = \"Muon\""},
  };
  for (const Case& c : cases) {
    const std::string message = usage_error([&] { load_job_config(config, c.overrides); });
    EXPECT_NE(message.find(c.expected), std::string::npos) << message;
  }
  // A bfloat16 reduce needs FSDP, which only the resolved degrees tell: refused with dp_shard 1
  // (the Trainer's check, before any process group), accepted with FSDP over 2 ranks.
  const JobConfig bf16 = load_job_config(config, {"--training.mixed_precision_reduce=bfloat16"});
  const distributed::ParallelDims one_rank({1, 1, 1, 1, 1}, 1, 0), fsdp2({1, 2, 1, 1, 1}, 2, 0);
  EXPECT_NE(usage_error([&] { check_compatibility(bf16, &one_rank); }).find("needs FSDP"), std::string::npos);
  check_compatibility(bf16, &fsdp2);
  // EP without FSDP must be the TP degree: refused at tp 4 / ep 2 on 4 ranks without dp_shard,
  // accepted at tp 2 / ep 2, and with FSDP over the rest.
  const JobConfig ep2 = load_job_config(config, {"--parallelism.expert_parallel_degree=2"});
  distributed::ParallelDegrees tp4{1, 1, 1, 4, 1, 2}, tp2{1, 1, 1, 2, 1, 2}, fsdp2_tp2{1, 2, 1, 2, 1, 2};
  const distributed::ParallelDims tp4_ep2(tp4, 4, 0), tp2_ep2(tp2, 2, 0), fsdp_ep2(fsdp2_tp2, 4, 0);
  EXPECT_NE(usage_error([&] { check_compatibility(ep2, &tp4_ep2); }).find("must equal tensor_parallel_degree"),
            std::string::npos);
  check_compatibility(ep2, &tp2_ep2);
  check_compatibility(ep2, &fsdp_ep2);
  // Every row is listed in docs/config.md's table.
  const std::string table = compatibility_markdown();
  for (const Incompatibility& row : incompatibilities()) {
    EXPECT_NE(table.find("`" + row.first + "` | " + row.second), std::string::npos) << row.first;
  }
  EXPECT_EQ(incompatibilities().size(), cases.size() + 2);
}

}  // namespace
}  // namespace loom::train
