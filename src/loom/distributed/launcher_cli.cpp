// `loom launch`: the CLI front of loom::distributed::launch.
#include <CLI/CLI.hpp>

#include <algorithm>

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

namespace {
CheckpointResolver& installed_resolver() {
  static CheckpointResolver resolver;
  return resolver;
}

// The words of the ranks' command as typed: from the first of them in `typed` (the user's argv)
// to the end. CLI11 hands over the positionals ("train", "c.toml") and the unknown options
// ("--config") separately, so joining those would scramble "train --config c.toml".
std::string ranks_words_as_typed(const std::vector<std::string>& typed,
                                 const std::vector<std::string>& positionals,
                                 const std::vector<std::string>& extras) {
  const auto launch = std::find(typed.begin(), typed.end(), "launch");
  size_t first = typed.size();
  for (const std::vector<std::string>* words : {&positionals, &extras}) {
    if (words->empty() || launch == typed.end()) continue;
    const auto it = std::find(launch + 1, typed.end(), words->front());
    if (it != typed.end()) first = std::min(first, static_cast<size_t>(it - typed.begin()));
  }
  std::string given;
  if (first < typed.size()) {
    for (size_t i = first; i < typed.size(); ++i) given += " " + typed[i];
    return given;
  }
  for (const auto& a : positionals) given += " " + a;  // no argv given: the best available order
  for (const auto& a : extras) given += " " + a;
  return given;
}
}  // namespace

void set_checkpoint_resolver(CheckpointResolver resolver) {
  installed_resolver() = std::move(resolver);
}
const CheckpointResolver& checkpoint_resolver() { return installed_resolver(); }


void register_launch_command(CLI::App& app, std::vector<std::string> typed, RankEntry entry) {
  auto options = std::make_shared<distributed::LaunchOptions>();
  options->entry = std::move(entry);
  auto master_port = std::make_shared<int>(0);
  auto grace_seconds = std::make_shared<double>(5.0);
  CLI::App* cmd = app.add_subcommand(
      "launch",
      "Start N local ranks with a torchrun-compatible environment and supervise them: "
      "loom launch --nproc N [--nnodes M --node-rank K --master-addr A --master-port P] "
      "[--max-restarts R [--checkpoint-folder DIR]] [--elastic] [--exec] -- <args>");
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
  cmd->add_option("--start-method,--start_method", options->start_method,
                  "How ranks of this executable start: forkserver (forked from a process that has "
                  "already loaded it: no second load of libtorch per rank) or exec (a fresh process, "
                  "as torchrun starts them)")
      ->transform(CLI::CheckedTransformer(
          std::map<std::string, StartMethod>{{"forkserver", StartMethod::kForkServer}, {"exec", StartMethod::kExec}},
          CLI::ignore_case))
      ->capture_default_str();
  cmd->add_option("--stop-grace", *grace_seconds,
                  "Seconds between SIGTERM and SIGKILL when stopping ranks")
      ->capture_default_str();
  cmd->add_option("--max-restarts,--max_restarts", options->max_restarts,
                  "Restart all ranks up to R times after a rank fails or a collective times out; "
                  "ranks see the attempt in LOOM_RESTART_COUNT (single node)")
      ->capture_default_str();
  cmd->add_flag("--elastic", options->elastic,
                "Elastic training: when a rank is lost the others keep running in a new membership "
                "and, while --max-restarts allows, a replacement joins them (single node; on by "
                "itself for a `train` command whose config sets fault_tolerance.enable)");
  auto checkpoint_folder = std::make_shared<std::string>();
  CLI::Option* folder_opt = cmd->add_option(
      "--checkpoint-folder,--checkpoint_folder", *checkpoint_folder,
      "The job's checkpoint folder: each restart line names the checkpoint the ranks will resume "
      "from (the ranks load it themselves)");
  cmd->add_option("command", options->command, "Arguments for each rank (after '--')");
  // Options meant for the ranks but given without '--' land here, so the error can say so.
  cmd->allow_extras();
  cmd->callback([&app, cmd, options, master_port, grace_seconds, port_opt, checkpoint_folder,
                 folder_opt, typed] {
    std::vector<std::string> extras;
    for (const auto& a : cmd->remaining()) {
      if (a != "--") extras.push_back(a);  // CLI11 passes the separator itself on as an extra
    }
    if (!extras.empty() || options->command.empty()) {
      const std::string given = ranks_words_as_typed(typed, options->command, extras);
      fail_usage(options->command.empty() && extras.empty()
                     ? std::string("loom launch needs the ranks' command after '--'")
                     : c10::str("loom launch does not take '", extras.empty() ? options->command.front()
                                                                              : extras.front(),
                                "'"),
                 "; put the ranks' command after '--', e.g. 'loom launch --nproc ",
                 options->nproc_per_node, " --", given.empty() ? " train --config c.toml" : given,
                 "'");
    }
    if (!options->exec) {
      // Each rank would fail on an unknown command with the same usage error: say it once, here,
      // before any rank starts (exit 2, never restarted).
      const std::string& word = options->command.front();
      std::string known;
      bool found = false;
      for (const CLI::App* sub : app.get_subcommands([](CLI::App* c) { return !c->get_name().empty(); })) {
        // Hidden commands (no group: check-layouts' rank side) run but are not offered.
        if (!sub->get_group().empty()) known += (known.empty() ? "" : ", ") + sub->get_name();
        found = found || sub->check_name(word);
      }
      LOOM_REQUIRE_USAGE(found, "loom launch: '", word, "' is not a loom command the ranks can run; "
                         "available: ", known, " (or --exec to run another program)");
    }
    if (port_opt->count() > 0) options->master_port = *master_port;
    // A `train` command whose configuration asks for fault tolerance runs elastic.
    if (const auto& resolve = checkpoint_resolver(); resolve && !options->exec && !options->elastic) {
      if (const std::optional<RanksCheckpointing> ranks = resolve(options->command);
          ranks && ranks->fault_tolerance) {
        LOOM_REQUIRE_USAGE(options->nnodes == 1, "the ranks' fault_tolerance.enable = true needs "
                           "--nnodes 1 for now (the elastic launcher supervises one node's ranks); "
                           "set --fault_tolerance.enable=false for the ranks of a multi-node job");
        options->elastic = true;
      }
    }
    options->stop_grace = std::chrono::milliseconds(static_cast<int64_t>(*grace_seconds * 1000));
    if (folder_opt->count() > 0) {
      LOOM_REQUIRE_USAGE(!checkpoint_folder->empty(), "--checkpoint-folder is empty; pass the "
                         "folder the ranks checkpoint into (checkpoint.folder)");
      LOOM_REQUIRE_USAGE(options->max_restarts > 0, "--checkpoint-folder only matters with "
                         "--max-restarts R > 0 (it names what a restart resumes from)");
      const std::filesystem::path folder = *checkpoint_folder;
      // The restart line must say what the ranks will do, and they resume from their own
      // configuration's folder: a --checkpoint-folder naming another one is refused here rather
      // than reported as "start from scratch" while they resume.
      if (const auto& resolve = checkpoint_resolver(); resolve && !options->exec) {
        if (const std::optional<RanksCheckpointing> ranks = resolve(options->command)) {
          LOOM_REQUIRE_USAGE(ranks->enabled, "--checkpoint-folder '", folder.string(), "': the "
                             "ranks' checkpoint.enable is false, so a restart starts again from "
                             "step 1; set --checkpoint.enable=true for the ranks, or drop "
                             "--checkpoint-folder");
          std::error_code ec;
          const auto given = std::filesystem::weakly_canonical(folder, ec);
          const auto actual = std::filesystem::weakly_canonical(ranks->folder, ec);
          LOOM_REQUIRE_USAGE(given == actual, "--checkpoint-folder '", folder.string(),
                             "' is not where the ranks checkpoint ('", ranks->folder.string(),
                             "', job.dump_folder/checkpoint.folder of their command); pass "
                             "--checkpoint-folder ", ranks->folder.string(), " or drop it");
        }
      }
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
