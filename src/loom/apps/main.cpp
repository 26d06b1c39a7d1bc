// The `loom` command line: a thin dispatcher. Every subcommand is implemented by its concept folder.
#include <cstdio>
#include <exception>

#include "loom/apps/commands.h"
#include "loom/apps/restart_policy.h"
#include "loom/core/error.h"
#include "loom/core/error_report.h"

int main(int argc, char** argv) {
  CLI::App app{"Loom: LLM pre-training with composable N-D parallelism (C++ on libtorch)", "loom"};
  app.require_subcommand(1);
  loom::apps::install_checkpoint_restart_policy();
  loom::apps::register_launch_command(app);
  loom::apps::register_train_command(app);
  loom::apps::register_score_command(app);
  loom::apps::register_tokenizer_command(app);
  loom::apps::register_info_command(app);
  loom::apps::register_convert_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);
    std::fprintf(stderr, "error: %s (see 'loom --help')\n", e.what());
    return loom::kExitUsage;
  } catch (const loom::ReportedError& e) {
    return e.exit_code();  // printed (and propagated to the other ranks) where it happened
  } catch (...) {
    return loom::report_error(loom::describe_exception(std::current_exception())).exit_code;
  }
  return 0;
}
