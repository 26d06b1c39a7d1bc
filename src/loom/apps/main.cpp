// The `loom` command line: a thin dispatcher. Every subcommand is implemented by its concept folder.
#include <cstdio>
#include <cstring>
#include <iostream>
#include <unistd.h>
#include <exception>
#include <string>
#include <vector>

#include "loom/data/tokenizer_cli.h"
#include "loom/distributed/launcher_cli.h"
#include "loom/layouts/check_layouts_cli.h"
#include "loom/models/cli/cli.h"
#include "loom/pipeline/pipeline_cli.h"
#include "loom/plan/plan_cli.h"
#include "loom/rl/rl_cli.h"
#include "loom/train/row_ledger.h"
#include "loom/train/train_cli.h"
#include "loom/apps/restart_policy.h"
#include "loom/core/error.h"
#include "loom/core/strings.h"
#include "loom/core/error_report.h"

namespace {

// The registered subcommands (CLI11 keeps option groups there too, without a name).
std::vector<CLI::App*> commands(CLI::App& app) {
  return app.get_subcommands([](CLI::App* sub) { return !sub->get_name().empty(); });
}

// "launch, train, ...": from the registered commands, so the list cannot drift from them (hidden
// ones, in no group, left out: check-layouts' rank command).
std::string command_list(CLI::App& app) {
  std::string out;
  for (const CLI::App* sub : commands(app)) {
    if (!sub->get_group().empty()) out += (out.empty() ? "" : ", ") + sub->get_name();
  }
  return out;
}

// CLI11 answers a first argument that is neither a command nor --help with only "A subcommand is
// required": name the word it did not know and list the commands instead. Returns the message, or
// an empty string when argv starts with a command or a help flag.
std::string unknown_command(CLI::App& app, int argc, char** argv) {
  const std::string see = "; available: " + command_list(app) + " (see 'loom --help')";
  if (argc < 2) return "no command given" + see;
  const std::string first = argv[1];
  if (first == "-h" || first == "--help" || first == "--help-all") return {};
  if (!first.empty() && first[0] == '-') return "unknown option '" + first + "'" + see;
  for (const CLI::App* sub : commands(app)) {
    if (sub->check_name(first)) return {};
  }
  // Users of LLM tools expect it: say it is missing on purpose rather than treat it as a typo.
  const char* planned = first == "generate" ? " (text generation is not available yet)" : "";
  return "unknown command '" + first + "'" + planned + see;
}

// The whole command line; also what ranks forked by `loom launch` run (distributed/rank_fork_server.h).
int run_loom(int argc, char** argv) {
  CLI::App app{"Loom: LLM pre-training with composable N-D parallelism (C++ on libtorch)", "loom"};
  app.require_subcommand(1);
  loom::apps::install_checkpoint_restart_policy();
  // Each command lives beside the concept it drives; main only registers them, in this order.
  loom::distributed::register_launch_command(app, std::vector<std::string>(argv, argv + argc), run_loom);
  loom::train::register_train_command(app);
  loom::train::register_plot_command(app);
  loom::train::register_ledger_command(app);
  loom::rl::register_rl_command(app);
  loom::models::register_score_command(app);
  loom::models::register_generate_command(app);
  loom::data::register_tokenizer_command(app);
  loom::models::register_info_command(app);
  loom::models::register_convert_command(app);
  loom::pipeline::register_pipeline_command(app);
  loom::plan::register_plan_command(app);
  loom::layouts::register_check_layouts_command(app);
  // Usage errors go through report_error like every other error: under `loom launch` the rank's
  // LOOM_ERROR_FILE then says exit code 2, so the launcher does not restart a command line that
  // cannot work (an unreported exit 2 could be anything's and would be retried).
  if (const std::string unknown = unknown_command(app, argc, argv); !unknown.empty()) {
    return loom::report_error({unknown, loom::kExitUsage}).exit_code;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);
    // report_error caps the line (CLI11 quotes the offending value, which can be huge) and, under
    // loom launch, hands the code to the launcher.
    return loom::report_error({std::string(e.what()) + " (see 'loom --help')", loom::kExitUsage})
        .exit_code;
  } catch (const loom::ReportedError& e) {
    return e.exit_code();  // printed (and propagated to the other ranks) where it happened
  } catch (...) {
    return loom::report_error(loom::describe_exception(std::current_exception())).exit_code;
  }
  return 0;
}

}  // namespace

// Ends with _exit once the output is flushed: a normal exit runs libtorch's static destructors,
// which deregister every operator kernel (~0.15 s of CPU on the CI machine, paid again by every rank
// of every launch). Nothing of Loom's own is left to its static destructors: commands close their
// files and join their threads before they return.
int main(int argc, char** argv) {
  const int code = run_loom(argc, argv);
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  _exit(code);
}
