// `loom launch`: the CLI front of loom::dist::launch.
#include <CLI/CLI.hpp>

#include "loom/apps/commands.h"
#include "loom/dist/launcher.h"

namespace loom::apps {

void register_launch_command(CLI::App& app) {
  auto options = std::make_shared<dist::LaunchOptions>();
  auto master_port = std::make_shared<int>(0);
  auto grace_seconds = std::make_shared<double>(5.0);
  CLI::App* cmd = app.add_subcommand(
      "launch",
      "Start N local ranks with a torchrun-compatible environment and supervise them: "
      "loom launch --nproc N [--nnodes M --node-rank K --master-addr A --master-port P] "
      "[--exec] -- <args>");
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
  cmd->add_option("command", options->command, "Arguments for each rank (after '--')")
      ->required();
  cmd->callback([options, master_port, grace_seconds, port_opt] {
    if (port_opt->count() > 0) options->master_port = *master_port;
    options->stop_grace = std::chrono::milliseconds(static_cast<int64_t>(*grace_seconds * 1000));
    dist::launch(*options);
  });
}

}  // namespace loom::apps
