// The `loom` command line: a thin dispatcher. Every subcommand is implemented by its concept folder.
#include <cstdio>
#include <exception>

#include "loom/apps/commands.h"
#include "loom/apps/restart_policy.h"
#include "loom/core/error.h"

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
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return e.exit_code();
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what_without_backtrace());
    return loom::kExitFailure;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return loom::kExitFailure;
  }
  return 0;
}
