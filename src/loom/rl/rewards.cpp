#include "loom/rl/rewards.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <algorithm>
#include <regex>
#include <sstream>

#include "loom/core/error.h"

namespace loom::rl {
namespace {

std::string trim(const std::string& s) {
  const auto begin = s.find_first_not_of(" \t\r\n");
  if (begin == std::string::npos) return "";
  return s.substr(begin, s.find_last_not_of(" \t\r\n") - begin + 1);
}

}  // namespace

double exact_match(const std::string& completion, const std::string& answer) {
  return trim(completion) == trim(answer) ? 1.0 : 0.0;
}

std::optional<double> last_number(const std::string& text) {
  static const std::regex number(R"([-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)");
  std::optional<double> last;
  for (auto it = std::sregex_iterator(text.begin(), text.end(), number); it != std::sregex_iterator(); ++it) {
    std::string digits = it->str();
    digits.erase(std::remove(digits.begin(), digits.end(), ','), digits.end());
    last = std::stod(digits);
  }
  return last;
}

double numeric_match(const std::string& completion, const std::string& answer, double tolerance) {
  const std::optional<double> want = last_number(answer);
  LOOM_REQUIRE_USAGE(want.has_value(), "numeric reward: the answer '", answer, "' holds no number");
  const std::optional<double> got = last_number(completion);
  return got && std::abs(*got - *want) <= tolerance ? 1.0 : 0.0;
}

ExternalReward::ExternalReward(std::string command, std::chrono::milliseconds timeout)
    : command_(std::move(command)), timeout_(timeout) {
  LOOM_REQUIRE_USAGE(!command_.empty(), "the reward command is empty; give a shell command that reads JSONL");
  LOOM_REQUIRE_USAGE(timeout_.count() > 0, "the reward command's timeout must be > 0");
}

std::vector<double> ExternalReward::operator()(const std::vector<RewardRequest>& batch) const {
  std::string input;
  for (const RewardRequest& r : batch) {
    // A sampled completion may end inside a multi-byte character (byte-level tokens): such bytes
    // reach the command as U+FFFD rather than stopping the run.
    input += nlohmann::json{{"prompt", r.prompt}, {"completion", r.completion}, {"answer", r.answer}}.dump(
                 -1, ' ', false, nlohmann::json::error_handler_t::replace) +
             "\n";
  }
  // stdin is a socket, not a pipe: a command that exits without reading all of it must not kill
  // this process with SIGPIPE (send's MSG_NOSIGNAL; a pipe's write has no such flag).
  int in[2], out[2];
  LOOM_REQUIRE(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, in) == 0 && pipe2(out, O_CLOEXEC) == 0,
               "reward command: pipe: ", std::strerror(errno));
  const pid_t pid = fork();
  LOOM_REQUIRE(pid >= 0, "reward command: fork: ", std::strerror(errno));
  if (pid == 0) {
    setpgid(0, 0);
    dup2(in[0], STDIN_FILENO);
    dup2(out[1], STDOUT_FILENO);
    execl("/bin/sh", "sh", "-c", command_.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  setpgid(pid, pid);
  close(in[0]);
  close(out[1]);
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  size_t written = 0;
  std::string output;
  bool input_open = true, timed_out = false;
  if (input.empty()) {
    close(in[1]);
    input_open = false;
  }
  while (true) {
    pollfd fds[2] = {{out[0], POLLIN, 0}, {input_open ? in[1] : -1, POLLOUT, 0}};
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      timed_out = true;
      break;
    }
    if (poll(fds, 2, static_cast<int>(std::min<int64_t>(left.count(), 1000))) < 0 && errno != EINTR) break;
    if (input_open && (fds[1].revents & (POLLOUT | POLLERR | POLLHUP))) {
      const ssize_t n = send(in[1], input.data() + written, input.size() - written, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) written += static_cast<size_t>(n);
      if (n < 0 && errno != EAGAIN && errno != EINTR) written = input.size();  // it stopped reading
      if (written == input.size()) {
        close(in[1]);
        input_open = false;
      }
    }
    if (fds[0].revents & (POLLIN | POLLHUP | POLLERR)) {
      char buffer[4096];
      const ssize_t n = read(out[0], buffer, sizeof(buffer));
      if (n > 0) {
        output.append(buffer, static_cast<size_t>(n));
      } else if (n == 0) {
        break;  // the command closed its output
      }
    }
  }
  if (input_open) close(in[1]);
  close(out[0]);
  if (timed_out) kill(-pid, SIGKILL);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  LOOM_REQUIRE(!timed_out, "reward command '", command_, "' did not finish within ", timeout_.count() / 1000.0,
               " s (killed); raise the timeout or make it faster");
  LOOM_REQUIRE(WIFEXITED(status) && WEXITSTATUS(status) == 0, "reward command '", command_, "' ",
               WIFEXITED(status) ? c10::str("exited with code ", WEXITSTATUS(status))
                                 : c10::str("was killed by signal ", WTERMSIG(status)));
  std::vector<double> rewards;
  std::istringstream lines(output);
  std::string line;
  while (std::getline(lines, line)) {
    if (trim(line).empty()) continue;
    double value = NAN;
    try {
      const nlohmann::json j = nlohmann::json::parse(line);
      value = j.is_number() ? j.get<double>() : j.at("reward").get<double>();
    } catch (const std::exception&) {
      fail("reward command '", command_, "' printed '", line.substr(0, 200), "' on line ", rewards.size() + 1,
           "; print one number (or {\"reward\": x}) per input line");
    }
    LOOM_REQUIRE(std::isfinite(value), "reward command '", command_, "' gave a non-finite reward on line ",
                 rewards.size() + 1);
    rewards.push_back(value);
  }
  LOOM_REQUIRE(rewards.size() == batch.size(), "reward command '", command_, "' printed ", rewards.size(),
               " rewards for ", batch.size(), " completions; print one per input line, in order");
  return rewards;
}

}  // namespace loom::rl
