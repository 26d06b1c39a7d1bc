// `loom launch`: the CLI front of loom::distributed::launch.
#include <CLI/CLI.hpp>

#include "loom/distributed/launcher_cli.h"
#include "loom/core/error.h"
#include "loom/distributed/launcher.h"

namespace loom::distributed {
namespace {
ResumeDescriber& installed_describer() {
  static ResumeDescriber describer;
  return describer;
}
}  // namespace

void set_resume_describer(ResumeDescriber describer) {
  installed_describer() = std::move(describer);
}
const ResumeDescriber& resume_describer() { return installed_describer(); }


void register_launch_command(CLI::App& app) {
  auto options = std::make_shared<distributed::LaunchOptions>();
  auto master_port = std::make_shared<int>(0);
  auto grace_seconds = std::make_shared<double>(5.0);
  CLI::App* cmd = app.add_subcommand(
      "launch",
      "Start N local ranks with a torchrun-compatible environment and supervise them: "
      "loom launch --nproc N [--nnodes M --node-rank K --master-addr A --master-port P] "
      "[--max-restarts R [--checkpoint-folder DIR]] [--exec] -- <args>");
  cmd->add_option("--nproc,--nproc-per-node,--nproc_per_node", options->nproc_per_node,
                  "Ranks to start on this node")
      ->required();
  cmd->add_option("--nnodes", options->nnodes, "Nodes in the job")->capture_default_str();
  cmd->add_option("--node-rank,--node_rank", options->node_rank, "This node's index")
      ->capture_default_str();
  cmd->add_option("--master-addr,--master_addr", options->master_addr,
                  "Address of node 0, where rank 0 hosts the rendezvous store")
      ->capture_default_str();
  CLI::Option* port_opt = cmd->add_option("--master-port,--master_port", *master_port,
                                          "Rendezvous port (default: a free port, single node)");
  cmd->add_flag("--exec", options->exec,
                "Run <args> as a program instead of as arguments to this loom executable");
  cmd->add_option("--stop-grace", *grace_seconds,
                  "Seconds between SIGTERM and SIGKILL when stopping ranks")
      ->capture_default_str();
  cmd->add_option("--max-restarts,--max_restarts", options->max_restarts,
                  "Restart all ranks up to R times after a rank fails or a collective times out; "
                  "ranks see the attempt in LOOM_RESTART_COUNT (single node)")
      ->capture_default_str();
  auto checkpoint_folder = std::make_shared<std::string>();
  CLI::Option* folder_opt = cmd->add_option(
      "--checkpoint-folder,--checkpoint_folder", *checkpoint_folder,
      "The job's checkpoint folder: each restart line names the checkpoint the ranks will resume "
      "from (the ranks load it themselves)");
  cmd->add_option("command", options->command, "Arguments for each rank (after '--')");
  // Options meant for the ranks but given without '--' land here, so the error can say so.
  cmd->allow_extras();
  cmd->callback([cmd, options, master_port, grace_seconds, port_opt, checkpoint_folder, folder_opt] {
    std::vector<std::string> extras;
    for (const auto& a : cmd->remaining()) {
      if (a != "--") extras.push_back(a);  // CLI11 passes the separator itself on as an extra
    }
    if (!extras.empty() || options->command.empty()) {
      std::string given;
      for (const auto& a : options->command) given += " " + a;
      for (const auto& a : extras) given += " " + a;
      fail_usage(options->command.empty() && extras.empty()
                     ? std::string("loom launch needs the ranks' command after '--'")
                     : c10::str("loom launch does not take '", extras.empty() ? options->command.front()
                                                                              : extras.front(),
                                "'"),
                 "; put the ranks' command after '--', e.g. 'loom launch --nproc ",
                 options->nproc_per_node, " --", given.empty() ? " train --config c.toml" : given,
                 "'");
    }
    if (port_opt->count() > 0) options->master_port = *master_port;
    options->stop_grace = std::chrono::milliseconds(static_cast<int64_t>(*grace_seconds * 1000));
    if (folder_opt->count() > 0) {
      LOOM_REQUIRE_USAGE(!checkpoint_folder->empty(), "--checkpoint-folder is empty; pass the "
                         "folder the ranks checkpoint into (checkpoint.folder)");
      LOOM_REQUIRE_USAGE(options->max_restarts > 0, "--checkpoint-folder only matters with "
                         "--max-restarts R > 0 (it names what a restart resumes from)");
      const std::filesystem::path folder = *checkpoint_folder;
      const distributed::ResumeDescriber& describe = distributed::resume_describer();
      options->restart_note = [folder, describe](int restarts_done, int max_restarts) {
        if (describe) return describe(folder, restarts_done, max_restarts);
        return c10::str("ranks resume from the newest complete checkpoint in '", folder.string(),
                        "', if any");
      };
    }
    distributed::launch(*options);
  });
}

}  // namespace loom::distributed
