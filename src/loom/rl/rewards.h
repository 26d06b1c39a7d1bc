// Rewards for GRPO (issue 51): built-in verifiers a person can check by eye, and an external
// command for anything else.
//
//   exact_match    1 when the completion, trimmed of surrounding whitespace, equals the answer
//                  (trimmed); else 0.
//   numeric_match  1 when the last number in the completion (an optional sign, digits, an optional
//                  decimal part; "1,234" reads as 1234) equals the answer's number within `tolerance`;
//                  0 when it differs or the completion holds no number.
//   ExternalReward runs `command` through /bin/sh once per batch: one JSON object per line on its
//                  stdin ({"prompt", "completion", "answer"}), one reward per line on its stdout (a
//                  number, or an object with "reward"), in order; text that is not valid UTF-8 (a
//                  completion cut inside a character) is sent with U+FFFD in its place. A command
//                  that exits non-zero, prints too few or non-numeric lines, or outlives `timeout`
//                  (its process group is killed) is a loom::Error naming what went wrong and the
//                  command.
#pragma once
#include <chrono>
#include <optional>
#include <string>
#include <vector>

namespace loom::rl {

double exact_match(const std::string& completion, const std::string& answer);
// The last number in `text`, if any.
std::optional<double> last_number(const std::string& text);
double numeric_match(const std::string& completion, const std::string& answer, double tolerance = 1e-6);

struct RewardRequest {
  std::string prompt, completion, answer;
};

class ExternalReward {
 public:
  ExternalReward(std::string command, std::chrono::milliseconds timeout);
  std::vector<double> operator()(const std::vector<RewardRequest>& batch) const;

 private:
  std::string command_;
  std::chrono::milliseconds timeout_;
};

}  // namespace loom::rl
