// `loom train --config FILE [--section.key=value ...]`: one rank of a training job (run it under
// `loom launch`, torchrun, mpirun or srun for several ranks).
#include <CLI/CLI.hpp>

#include "loom/apps/commands.h"
#include "loom/core/error.h"
#include "loom/train/config.h"
#include "loom/train/trainer.h"

namespace loom::apps {
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

}  // namespace

void register_train_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("train", "Train a model (one rank; use 'loom launch' for several)");
  auto config_path = std::make_shared<std::string>("configs/llama3_debug.toml");
  cmd->add_option("--config", *config_path, "TOML job config")->capture_default_str();
  cmd->allow_extras();
  cmd->footer("Any config key can be overridden: --section.key=value (see docs/config.md).");
  cmd->callback([cmd, config_path] {
    check_misspelt_options(*cmd, cmd->remaining());
    train::JobConfig config = train::load_job_config(*config_path, cmd->remaining());
    train::Trainer trainer(std::move(config));
    trainer.train();
  });
}

}  // namespace loom::apps
