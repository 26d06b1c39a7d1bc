// TEMPORARY (bootstrap only, removed once every command exists): weak no-op registrations so the
// `loom` binary links while the concept folders are written in parallel.
#include "loom/apps/commands.h"

namespace loom::apps {
__attribute__((weak)) void register_launch_command(CLI::App&) {}
__attribute__((weak)) void register_train_command(CLI::App&) {}
__attribute__((weak)) void register_score_command(CLI::App&) {}
__attribute__((weak)) void register_tokenizer_command(CLI::App&) {}
__attribute__((weak)) void register_info_command(CLI::App&) {}
}  // namespace loom::apps
