// The rewards GRPO trains on (rl/rewards.h): the built-in verifiers and the external command, its
// JSONL protocol, order, and failures (non-zero exit, too few lines, garbage, a hang past the timeout).
#include <gtest/gtest.h>

#include <chrono>

#include "loom/core/error.h"
#include "loom/rl/rewards.h"
#include "loom/testing/errors.h"

namespace {
using namespace loom::rl;
using namespace std::chrono_literals;

TEST(Rewards, ExactAndNumericMatch) {
  EXPECT_EQ(exact_match("  4321\n", "4321"), 1.0);
  EXPECT_EQ(exact_match("4321 ", "1234"), 0.0);
  EXPECT_EQ(numeric_match("the sum is 1,234.", "1234"), 1.0);
  EXPECT_EQ(numeric_match("first 3 then -7.5", "-7.5"), 1.0);  // the last number counts
  EXPECT_EQ(numeric_match("no number here", "12"), 0.0);
  EXPECT_EQ(numeric_match("12.0000001", "12", 1e-3), 1.0);
  EXPECT_FALSE(last_number("none").has_value());
  loom::testing::expect_error<loom::UsageError>([] { numeric_match("1", "x"); }, {"holds no number"});
}

TEST(Rewards, ExternalCommandReadsJsonlAndAnswersInOrder) {
  // Reward: the completion's length, from a command that sees each JSON line (python-free: awk).
  const ExternalReward reward(
      "awk -F'\"completion\": *\"' '{split($2, a, \"\\\"\"); print length(a[1])}'", 10s);
  const auto got = reward({{"p", "abc", ""}, {"p", "", ""}, {"p", "hello world", ""}});
  EXPECT_EQ(got, (std::vector<double>{3, 0, 11}));
  // A command that answers without reading its input (a megabyte of it) neither blocks nor kills
  // the caller with SIGPIPE.
  std::vector<RewardRequest> big(2, RewardRequest{"p", std::string(1 << 19, 'x'), ""});
  EXPECT_EQ(ExternalReward("echo 1; echo 2", 10s)(big), (std::vector<double>{1, 2}));
  const ExternalReward objects("while read -r line; do echo '{\"reward\": 0.5}'; done", 10s);
  EXPECT_EQ(objects({{"a", "b", "c"}, {"d", "e", "f"}}), (std::vector<double>{0.5, 0.5}));
  // A completion cut inside a multi-byte character (byte-level tokens) reaches the command with
  // U+FFFD in place of the stray bytes.
  EXPECT_EQ(reward({{"p", "a\xe2\x82", ""}, {"p", "ok", ""}}),
            (std::vector<double>{reward({{"p", "a\xef\xbf\xbd", ""}})[0], 2}));
}

TEST(Rewards, ExternalCommandFailuresAreOneLineNamingTheCommand) {
  const std::vector<RewardRequest> two = {{"a", "b", "c"}, {"d", "e", "f"}};
  loom::testing::expect_error<loom::Error>([&] { ExternalReward("cat >/dev/null; exit 3", 10s)(two); },
                                           {"exited with code 3"});
  loom::testing::expect_error<loom::Error>([&] { ExternalReward("cat >/dev/null; echo 1", 10s)(two); },
                                           {"printed 1 rewards for 2 completions"});
  loom::testing::expect_error<loom::Error>([&] { ExternalReward("cat >/dev/null; echo 1; echo oops", 10s)(two); },
                                           {"printed 'oops' on line 2"});
  const auto start = std::chrono::steady_clock::now();
  loom::testing::expect_error<loom::Error>([&] { ExternalReward("sleep 30", 300ms)(two); },
                                           {"did not finish within 0.3 s (killed)"});
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  loom::testing::expect_error<loom::UsageError>([] { ExternalReward("", 1s); }, {"reward command is empty"});
}

}  // namespace
