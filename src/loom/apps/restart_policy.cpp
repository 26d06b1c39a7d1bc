#include "loom/apps/restart_policy.h"

#include <CLI/CLI.hpp>

#include "loom/checkpoint/metadata.h"
#include "loom/distributed/launcher.h"
#include "loom/train/config.h"

namespace loom::apps {

namespace {

// Where a `loom train` command line checkpoints and whether it is elastic, read the way `loom
// train` reads it (--config, then the --section.key overrides). Nothing for other commands, or when the configuration does not
// load: the ranks then report that error themselves.
std::optional<distributed::RanksCheckpointing> train_checkpointing(
    const std::vector<std::string>& command) {
  if (command.empty() || command.front() != "train") return std::nullopt;
  try {
    CLI::App parser;
    parser.allow_extras();
    std::string config_path = "configs/llama3_debug.toml";  // `loom train`'s default
    parser.add_option("--config", config_path);
    std::vector<std::string> args(command.begin() + 1, command.end());
    std::reverse(args.begin(), args.end());  // CLI11 parses a vector from its back
    parser.parse(args);
    const train::JobConfig config = train::load_job_config(config_path, parser.remaining());
    return distributed::RanksCheckpointing{
        config.checkpoint.enable,
        std::filesystem::path(config.job.dump_folder) / config.checkpoint.folder,
        config.fault_tolerance.enable};
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

}  // namespace

void install_checkpoint_restart_policy() {
  distributed::set_checkpoint_resolver(train_checkpointing);
  distributed::set_resume_describer([](const std::filesystem::path& folder, int restarts_done,
                                int max_restarts) -> std::string {
    // Structure-level verification (markers, metadata, file sizes) is quick; the ranks verify
    // checksums when they load and fall back to an older checkpoint themselves if needed.
    const checkpoint::RestartDecision d =
        checkpoint::decide_restart(folder, restarts_done, max_restarts);
    if (d.resume_from) {
      return c10::str("ranks resume from checkpoint '", d.resume_from->path.string(), "' (step ",
                      d.resume_from->step, ")");
    }
    return c10::str("no complete checkpoint in '", folder.string(),
                    "' yet; ranks start from scratch");
  });
}

}  // namespace loom::apps
