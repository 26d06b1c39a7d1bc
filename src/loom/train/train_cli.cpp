// `loom train --config FILE [--section.key=value ...]`: one rank of a training job (run it under
// `loom launch`, torchrun, mpirun or srun for several ranks).
#include <CLI/CLI.hpp>

#include "loom/apps/commands.h"
#include "loom/train/config.h"
#include "loom/train/trainer.h"

namespace loom::apps {

void register_train_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("train", "Train a model (one rank; use 'loom launch' for several)");
  auto config_path = std::make_shared<std::string>("configs/llama3_debug.toml");
  cmd->add_option("--config", *config_path, "TOML job config")->capture_default_str();
  cmd->allow_extras();
  cmd->footer("Any config key can be overridden: --section.key=value (see docs/config.md).");
  cmd->callback([cmd, config_path] {
    train::JobConfig config = train::load_job_config(*config_path, cmd->remaining());
    train::Trainer trainer(std::move(config));
    trainer.train();
  });
}

}  // namespace loom::apps
