// The `loom` dispatcher, through the binary: what a mistyped or missing command answers.
#include <gtest/gtest.h>

#include <string>

#include "loom/testing/run.h"

namespace {
using loom::testing::count_occurrences;
using loom::testing::loom_bin;
using loom::testing::run;

const std::string kAvailable =
    "; available: launch, train, score, tokenizer, info, convert (see 'loom --help')";

// Issue 8 H: these printed only "A subcommand is required".
TEST(LoomCli, UnknownCommandsAndOptionsListTheCommands) {
  struct Case {
    std::string args, expected;
  };
  const Case cases[] = {
      {"frobnicate", "error: unknown command 'frobnicate'" + kAvailable},
      {"generate", "error: unknown command 'generate' (text generation is not available yet)" + kAvailable},
      {"--frob", "error: unknown option '--frob'" + kAvailable},
      {"", "error: no command given" + kAvailable},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args);
    const auto r = run(loom_bin() + " " + c.args, 60);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_EQ(r.output, c.expected + "\n");
    EXPECT_EQ(count_occurrences(r.output, "\n"), 1);
  }
  // Commands and help still reach CLI11.
  const auto help = run(loom_bin() + " --help", 60);
  EXPECT_EQ(help.exit_code, 0) << help.output;
  EXPECT_NE(help.output.find("tokenizer"), std::string::npos) << help.output;
  const auto info = run(loom_bin() + " info --flavor debugmodel", 60);
  EXPECT_EQ(info.exit_code, 0) << info.output;
}

}  // namespace
