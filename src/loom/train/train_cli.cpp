// `loom train --config FILE [--section.key=value ...]`: one rank of a training job (run it under
// `loom launch`, torchrun, mpirun or srun for several ranks).
#include <CLI/CLI.hpp>

#include <cstdio>
#include <cstdlib>
#include <memory>

#include "loom/train/train_cli.h"
#include "loom/core/error.h"
#include "loom/core/error_report.h"
#include "loom/train/config.h"
#include "loom/train/elastic_run.h"
#include "loom/train/plot.h"
#include "loom/train/trainer.h"

namespace loom::train {
namespace {

// Every unknown argument reaches the config overrides, which would answer a misspelt option of
// the command itself ("--confg") with the nearest config key. A dotless name within two edits of
// one of the command's own options is that option misspelt: say so first.
void check_misspelt_options(const CLI::App& cmd, const std::vector<std::string>& args) {
  for (const std::string& arg : args) {
    if (arg.size() < 3 || arg.compare(0, 2, "--") != 0) continue;
    const std::string name = arg.substr(2, arg.find('=') == std::string::npos ? std::string::npos
                                                                               : arg.find('=') - 2);
    if (name.find('.') != std::string::npos) continue;
    for (const CLI::Option* option : cmd.get_options()) {
      for (const std::string& long_name : option->get_lnames()) {
        if (train::edit_distance(name, long_name) <= 2) {
          fail_usage("unknown option '--", name, "' for 'loom train' (did you mean '--", long_name,
                     "'?); its options are --config FILE and config overrides --section.key=value");
        }
      }
    }
  }
}

// Runs the job. An error is reported at once, before the Trainer's destructors run: those could
// wait on peers (a barrier, an async save's finalization) and hide the error behind a hang. In a
// world of several ranks the process then ends without unwinding further; the report has already
// told the other ranks to stop (distributed/peer_abort.h), and every checkpoint on disk is complete or
// marked incomplete, so nothing is lost.
void run_training(train::JobConfig config) {
  std::unique_ptr<train::Trainer> trainer;
  try {
    if (config.fault_tolerance.enable) {
      train::run_elastic_training(config);  // one member of an elastic job (train/elastic_run.h)
      return;
    }
    trainer = std::make_unique<train::Trainer>(std::move(config));
    trainer->train();
  } catch (...) {
    report_current_exception_and_exit();
  }
}

}  // namespace

void register_train_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("train", "Train a model (one rank; use 'loom launch' for several)");
  auto config_path = std::make_shared<std::string>("configs/llama3_debug.toml");
  cmd->add_option("--config", *config_path, "TOML job config")->capture_default_str();
  auto reference = std::make_shared<bool>(false);
  cmd->add_flag("--config-reference", *reference,
                "Print every config key (type, default, meaning) as Markdown and exit");
  cmd->allow_extras();
  cmd->footer("Any config key can be overridden: --section.key=value (see docs/config.md).");
  cmd->callback([cmd, config_path, reference] {
    if (*reference) {
      std::fputs(train::config_reference_markdown().c_str(), stdout);
      return;
    }
    check_misspelt_options(*cmd, cmd->remaining());
    run_training(train::load_job_config(*config_path, cmd->remaining()));
  });
}

void register_plot_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "plot", "Draw loss, learning rate and tokens/s against step from runs' metrics.jsonl as SVG");
  auto runs = std::make_shared<std::vector<std::string>>();
  auto out = std::make_shared<std::string>("loss.svg");
  cmd->add_option("runs", *runs, "Run folders (job.dump_folder) or metrics .jsonl files; several "
                                 "are overlaid, one colour each")
      ->required();
  cmd->add_option("--out", *out, "SVG file to write")->capture_default_str();
  cmd->callback([runs, out] {
    std::vector<std::filesystem::path> paths(runs->begin(), runs->end());
    train::write_plot(paths, *out);
    std::printf("wrote %s (%zu run%s)\n", out->c_str(), paths.size(), paths.size() == 1 ? "" : "s");
  });
}

}  // namespace loom::train
