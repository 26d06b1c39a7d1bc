#include "loom/distributed/launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <set>

#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "loom/core/error.h"
#include "loom/distributed/elastic_protocol.h"
#include "loom/distributed/watchdog.h"

extern char** environ;

namespace loom::distributed {
namespace {

// ----------------------------------------------------------------------------------------------
// Signals reach the monitor loop through a self-pipe: handlers only write the signal number, so
// they work whatever threads the process has, and poll() wakes at once on a child's exit.

int g_signal_pipe[2] = {-1, -1};

void on_signal(int sig) {
  const int saved = errno;
  const unsigned char byte = static_cast<unsigned char>(sig);
  [[maybe_unused]] ssize_t n = write(g_signal_pipe[1], &byte, 1);
  errno = saved;
}

class SignalScope {
 public:
  SignalScope() {
    if (pipe2(g_signal_pipe, O_NONBLOCK | O_CLOEXEC) != 0) {
      fail("loom launch: cannot create a pipe: ", std::strerror(errno));
    }
    for (int sig : kSignals) {
      struct sigaction sa {};
      sa.sa_handler = on_signal;
      sigemptyset(&sa.sa_mask);
      sa.sa_flags = SA_RESTART | (sig == SIGCHLD ? SA_NOCLDSTOP : 0);
      sigaction(sig, &sa, &previous_[sig]);
    }
  }
  ~SignalScope() {
    for (int sig : kSignals) sigaction(sig, &previous_[sig], nullptr);
    close(g_signal_pipe[0]);
    close(g_signal_pipe[1]);
    g_signal_pipe[0] = g_signal_pipe[1] = -1;
  }
  SignalScope(const SignalScope&) = delete;
  SignalScope& operator=(const SignalScope&) = delete;

  // Waits up to `timeout_ms` (-1: forever) for a signal; returns the launcher-directed signals
  // (SIGINT/SIGTERM) received, ignoring SIGCHLD wake-ups.
  std::vector<int> wait(int timeout_ms) {
    pollfd pfd{g_signal_pipe[0], POLLIN, 0};
    const int rc = poll(&pfd, 1, timeout_ms);
    std::vector<int> received;
    if (rc <= 0) return received;
    unsigned char buf[64];
    ssize_t n;
    while ((n = read(g_signal_pipe[0], buf, sizeof(buf))) > 0) {
      for (ssize_t i = 0; i < n; ++i) {
        if (buf[i] != SIGCHLD) received.push_back(buf[i]);
      }
    }
    return received;
  }

 private:
  static constexpr int kSignals[] = {SIGCHLD, SIGINT, SIGTERM};
  struct sigaction previous_[NSIG] {};
};

std::string describe_signal(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return c10::str(sig, " (", abbrev ? std::string("SIG") + abbrev : std::string("unknown"), ")");
}

// ----------------------------------------------------------------------------------------------

struct ResolvedLaunch {
  LaunchOptions options;
  RankForkServer* fork_server = nullptr;  // set by launch() when ranks are forked
  std::string program;  // absolute path, or a name looked up in PATH (--exec)
  std::vector<std::string> argv;
};

struct RankProcess {
  int rank = 0;
  int local_rank = 0;
  pid_t pid = -1;
  bool running = false;
  int wait_status = 0;
  std::string error_line;  // what the rank reported in its LOOM_ERROR_FILE, if anything
  int reported_code = 0;   // the exit code it reported there (0: no report)
  // Elastic mode: the member id (LOOM_ELASTIC_MEMBER), whether it was started as a replacement
  // (LOOM_ELASTIC_JOINER), whether it is in a generation yet (the first ranks are; a replacement
  // once it joined), whether it said it is ready to join, and whether its end was already
  // handled (a lost member: it names no failure of the attempt).
  int member = -1;
  bool joiner = false;
  bool admitted = true;
  bool ready = false;
  bool lost = false;
};

// Whether a running rank is stopped (SIGSTOP, SIGTSTP, a debugger): state T or t in
// /proc/<pid>/stat. A stopped rank never reaches its next collective, so the peers that wait for it
// are the ones that fail (watchdog, exit 124); the stopped one is the cause.
bool is_stopped(pid_t pid) {
  std::ifstream in(c10::str("/proc/", pid, "/stat"));
  std::string stat;
  std::getline(in, stat);
  // "pid (comm) S ...": comm may hold spaces and parentheses, so read after the last ')'.
  const size_t close = stat.rfind(')');
  if (close == std::string::npos || close + 2 >= stat.size()) return false;
  const char state = stat[close + 2];
  return state == 'T' || state == 't';
}

// The exit code a rank ended with (128+signal when killed).
int exit_code_of(const RankProcess& r) {
  if (WIFSIGNALED(r.wait_status)) return 128 + WTERMSIG(r.wait_status);
  return WEXITSTATUS(r.wait_status);
}

struct GroupOutcome {
  enum class Kind { kSucceeded, kRankFailed, kInterrupted } kind = Kind::kSucceeded;
  // kRankFailed: the ranks found failed when the launcher first noticed a failure. Usually one;
  // several when they exited before the launcher could tell them apart (e.g. a peer hit by the
  // first one's death), so all are named.
  std::vector<RankProcess> failed;
  // kInterrupted, or kRankFailed when SIGINT/SIGTERM reached the launcher while it was stopping
  // the ranks: either way the launch ends without a restart.
  int launcher_signal = 0;
  int stopped = 0;  // ranks still running that had to be stopped
  int replacements = 0;  // elastic mode: replacements started (each one a restart)
  // kRankFailed: the rank that failed first (see WorkerGroup::find_root_cause), and how it failed.
  // Empty when none stands out (then the ranks in `failed` are named in rank order).
  std::optional<RankProcess> root_cause;
  enum class Cause {
    kReported,  // its own error report (LOOM_ERROR_FILE); it may have been stopped while lingering
    kSignal,    // it died by a signal the launcher had not sent (SIGKILL, a crash) before any peer
    kStopped,   // it was stopped (SIGSTOP) while its peers failed waiting for it
  } cause = Cause::kReported;
  // kSignal / kStopped: the exit code that stands for the attempt (a peer's report, e.g. 124 from
  // the watchdog of the rank that waited for a stopped one), else kExitFailure.
  int cause_code = kExitFailure;
};

// `reported`: the rank reported its error through LOOM_ERROR_FILE, so Loom's exit codes apply (a
// foreign program's 2 or 3 means whatever it means there).
std::string describe_exit(int wait_status, bool reported) {
  if (WIFSIGNALED(wait_status)) {
    return c10::str("was killed by signal ", describe_signal(WTERMSIG(wait_status)));
  }
  const int code = WEXITSTATUS(wait_status);
  switch (code) {
    case kExitCollectiveTimeout:
      return c10::str("exited with code ", code, " (collective watchdog timeout; its log names the "
                      "stalled collective)");
    case kExitUsage:
      if (reported) return c10::str("exited with code ", code, " (configuration or usage error)");
      break;
    case kExitDiverged:
      if (reported) return c10::str("exited with code ", code, " (training diverged)");
      break;
    case kExitPeerFailed:
      if (reported) return c10::str("exited with code ", code, " (stopped: another rank failed)");
      break;
    default:
      break;
  }
  return c10::str("exited with code ", code);
}

// Names the rank that failed first (the root cause) before the ranks the launcher saw exit: when a
// peer stopped by the root cause exits before it (exit 4 races the root cause's linger), the line
// still leads with the error that matters.
std::string failure_message(const GroupOutcome& o, const LaunchOptions& opts) {
  auto who = [&](const RankProcess& r) {
    std::string s = c10::str("rank ", r.rank, " (");
    if (opts.nnodes > 1) s += c10::str("node ", opts.node_rank, ", ");
    return s + c10::str("local rank ", r.local_rank, ", pid ", r.pid, ")");
  };
  std::string message;
  if (o.root_cause) {
    const RankProcess& root = *o.root_cause;
    switch (o.cause) {
      case GroupOutcome::Cause::kReported:
        // Its reported code is the one it was exiting with, even if it was stopped while lingering.
        message += who(root) + " " +
                   describe_exit(W_EXITCODE(root.reported_code, 0), /*reported=*/true) + ": " +
                   root.error_line;
        break;
      case GroupOutcome::Cause::kSignal:
        message += who(root) + " " + describe_exit(root.wait_status, /*reported=*/false);
        break;
      case GroupOutcome::Cause::kStopped:
        message += who(root) + " was stopped (SIGSTOP or a debugger) and stalled the ranks waiting "
                               "for it";
        break;
    }
  }
  // A rank that failed with the same report as the root cause (a configuration error every rank
  // finds) is counted, not quoted again: one line, whatever the number of ranks.
  auto without_rank = [](const std::string& line) {
    return line.rfind("[rank", 0) == 0 && line.find("] ") != std::string::npos
               ? line.substr(line.find("] ") + 2)
               : line;
  };
  std::vector<int> same, echoes;
  const bool quotes_root = o.root_cause && o.cause == GroupOutcome::Cause::kReported;
  const std::string root_text = quotes_root ? without_rank(o.root_cause->error_line) : "";
  for (const RankProcess& r : o.failed) {
    if (o.root_cause && r.rank == o.root_cause->rank) continue;
    if (quotes_root && r.reported_code == o.root_cause->reported_code &&
        without_rank(r.error_line) == root_text) {
      same.push_back(r.rank);
      continue;
    }
    // "stopping: rank R: <the root cause's line>" (distributed/peer_abort.h): it only repeats it.
    if (quotes_root && r.reported_code == kExitPeerFailed &&
        r.error_line.find(root_text) != std::string::npos) {
      echoes.push_back(r.rank);
      continue;
    }
    message += message.empty() ? "" : (o.root_cause ? "; then " : " and ");
    message += who(r) + " " + describe_exit(r.wait_status, r.reported_code != 0);
    if (!r.error_line.empty()) message += c10::str(": ", r.error_line);
  }
  auto list = [](const std::vector<int>& ranks) {
    std::string out = ranks.size() > 1 ? "ranks " : "rank ";
    for (size_t i = 0; i < ranks.size(); ++i) {
      out += (i == 0 ? "" : i + 1 == ranks.size() ? " and " : ", ") + std::to_string(ranks[i]);
    }
    return out;
  };
  if (!same.empty()) message += "; " + list(same) + " failed with the same error";
  if (!echoes.empty()) message += "; " + list(echoes) + " stopped because of it (exit code 4)";
  message += c10::str("; stopped the other ", o.stopped, " running rank(s)");
  return message;
}

// The exit code that stands for an attempt: the one the root-cause rank reported through
// LOOM_ERROR_FILE. Exit codes of programs that report nothing there (--exec of a foreign program, a
// rank killed before it could report) carry no agreed meaning: 1, which may be restarted.
// Whether one of `failed` exited with the watchdog's code: the watchdog exits at once, without a
// report (its thread cannot unwind the stalled one), so its 124 stands on its own.
bool watchdog_fired(const std::vector<RankProcess>& failed) {
  for (const RankProcess& r : failed) {
    if (WIFEXITED(r.wait_status) && WEXITSTATUS(r.wait_status) == kExitWatchdog) return true;
  }
  return false;
}

int attempt_exit_code(const GroupOutcome& o) {
  if (!o.root_cause) return watchdog_fired(o.failed) ? kExitWatchdog : kExitFailure;
  return o.cause == GroupOutcome::Cause::kReported ? o.root_cause->reported_code : o.cause_code;
}

[[noreturn]] void throw_interrupted(int sig, int stopped) {
  throw Error(c10::str("loom launch interrupted by signal ", describe_signal(sig), "; stopped ",
                       stopped, " running rank(s)"),
              128 + sig);
}

// The local ranks of one attempt. The destructor kills whatever still runs, so no rank outlives
// the launcher even when it unwinds through an exception.
class WorkerGroup {
 public:
  // `elastic_store`: elastic mode's store (the launcher's, under the attempt's prefix), else null.
  WorkerGroup(const ResolvedLaunch& plan, int restart_count, int master_port,
              std::filesystem::path error_dir,
              c10::intrusive_ptr<c10d::Store> elastic_store = {})
      : plan_(plan), restart_count_(restart_count), master_port_(master_port),
        error_dir_(std::move(error_dir)), store_(std::move(elastic_store)) {}
  ~WorkerGroup() {
    for (auto& p : procs_) {
      if (p.running) {
        kill_rank(p, SIGKILL);
        waitpid(p.pid, &p.wait_status, 0);
        p.running = false;
      }
    }
  }
  WorkerGroup(const WorkerGroup&) = delete;
  WorkerGroup& operator=(const WorkerGroup&) = delete;

  void start() {
    const auto& o = plan_.options;
    if (store_) {
      // Generation 0, before any rank can look for it: members 0..W-1, the first ranks.
      nlohmann::json members = nlohmann::json::array();
      for (int local = 0; local < o.nproc_per_node; ++local) {
        members.push_back(o.node_rank * o.nproc_per_node + local);
        members_.push_back(o.node_rank * o.nproc_per_node + local);
      }
      write_generation(0, nlohmann::json{{"members", members}, {"reason", "start"}});
      next_member_ = o.nnodes * o.nproc_per_node;
    }
    for (int local = 0; local < o.nproc_per_node; ++local) {
      RankProcess p;
      p.local_rank = local;
      p.rank = o.node_rank * o.nproc_per_node + local;
      p.member = p.rank;
      std::error_code ec;
      std::filesystem::remove(error_file(p), ec);  // a previous attempt's report
      p.pid = spawn(p);
      p.running = true;
      procs_.push_back(p);
    }
  }

  GroupOutcome monitor(SignalScope& signals) {
    while (true) {
      if (auto failed = reap(); !failed.empty()) {
        GroupOutcome out;
        out.kind = GroupOutcome::Kind::kRankFailed;
        out.failed = std::move(failed);
        // Before the launcher's own signals change the picture: which ranks are stopped.
        std::vector<RankProcess> stopped_ranks;
        for (const auto& p : procs_) {
          if (p.running && is_stopped(p.pid)) stopped_ranks.push_back(p);
        }
        out.stopped = stop_all(SIGTERM, signals, &out.launcher_signal);
        find_root_cause(out, stopped_ranks);
        return out;
      }
      if (running_count() == 0) return {};
      const auto received = signals.wait(-1);
      if (!received.empty()) {
        GroupOutcome out;
        out.kind = GroupOutcome::Kind::kInterrupted;
        out.launcher_signal = received.front();
        out.stopped = stop_all(received.front(), signals, nullptr);
        return out;
      }
    }
  }

  // Elastic mode's monitor (launcher.h; the protocol is elastic_protocol.h). `restarts_done`: the
  // restarts of the launch so far, replacements included; the outcome counts the replacements
  // this attempt started.
  GroupOutcome monitor_elastic(SignalScope& signals, int restarts_done) {
    const int max_restarts = plan_.options.max_restarts;
    int replacements = 0;
    // Since when no member of the generation runs while replacements that never joined still do.
    std::optional<std::chrono::steady_clock::time_point> orphans_since;
    while (true) {
      std::vector<size_t> exited = reap_elastic();
      // Exit 2, 3 or kExitElasticRestart ends the attempt as without elastic mode; so does a loss
      // that leaves no member running (below).
      bool ends_attempt = false;
      for (size_t i : exited) {
        const RankProcess& p = procs_[i];
        if (!WIFEXITED(p.wait_status)) continue;
        const int code = WEXITSTATUS(p.wait_status);
        ends_attempt = ends_attempt || code == kExitUsage || code == kExitDiverged ||
                       code == kExitElasticRestart;
      }
      if (ends_attempt) {
        std::vector<RankProcess> failed;
        for (size_t i : exited) {
          if (!exited_ok(procs_[i])) failed.push_back(procs_[i]);
        }
        return end_attempt(std::move(failed), signals, replacements);
      }
      for (size_t i : exited) {
        if (exited_ok(procs_[i])) continue;  // a member done, or a spare told training is done
        read_error_report(procs_[i]);
        const RankProcess lost = procs_[i];  // a copy: a replacement may grow procs_
        const std::string exit_words =
            describe_exit(lost.wait_status, lost.reported_code != 0) +
            (lost.error_line.empty() ? "" : ": " + lost.error_line);
        const std::string who = c10::str("member ", lost.member, " (local rank ", lost.local_rank,
                                         ", pid ", lost.pid, ")");
        const bool done = store_->check({kDoneKey});
        if (!lost.admitted) {
          // A replacement that never joined: dropped, and replaced while restarts are left.
          procs_[i].lost = true;
          std::string line = c10::str("loom launch: replacement ", who, " ", exit_words,
                                      " before it joined");
          if (done) {
            line += "; training is done: not replaced";
          } else if (restarts_done + replacements < max_restarts) {
            ++replacements;
            const int id = spawn_replacement(lost);
            line += c10::str("; starting member ", id, " as its replacement (restart ",
                             restarts_done + replacements, " of ", max_restarts, ")");
          } else {
            line += c10::str("; not replaced: no restarts are left (--max-restarts ",
                             max_restarts, ")");
          }
          say(line);
          continue;
        }
        std::vector<int> alive;
        for (int id : members_) {
          if (const RankProcess* m = find_member(id); m != nullptr && m->running) {
            alive.push_back(id);
          }
        }
        if (done) {
          procs_[i].lost = true;
          say(c10::str("loom launch: ", who, " ", exit_words, " after training was done (",
                       kDoneKey, "); not replaced"));
          continue;
        }
        if (alive.empty()) {
          // No member left to carry on (or to let a replacement join): as without elastic mode.
          return end_attempt({lost}, signals, replacements);
        }
        procs_[i].lost = true;
        const int generation = generation_ + 1;
        write_generation(generation,
                         nlohmann::json{{"members", alive},
                                        {"lost", nlohmann::json::array({lost.member})},
                                        {"reason", c10::str("member ", lost.member, " (pid ",
                                                            lost.pid, ") ", exit_words)}});
        generation_ = generation;
        members_ = alive;
        std::string line = c10::str("loom launch: ", who, " ", exit_words, "; ", alive.size(),
                                    " member(s) continue in generation ", generation);
        if (restarts_done + replacements < max_restarts) {
          ++replacements;
          const int id = spawn_replacement(lost);
          line += c10::str("; starting member ", id, " as its replacement (restart ",
                           restarts_done + replacements, " of ", max_restarts, ")");
        } else {
          line += c10::str("; not replaced: no restarts are left (--max-restarts ", max_restarts,
                           ")");
        }
        say(line);
        // A join asked of the generation before: the newer one is asked instead.
        if (join_requested_) request_join();
      }
      if (running_count() == 0) {
        GroupOutcome out;
        out.replacements = replacements;
        return out;
      }
      poll_joins();
      // Replacements that never joined, while no member is left to admit them (each exits 0 once
      // training is done): given the grace period, then stopped.
      bool member_running = false, orphans = false;
      for (const auto& p : procs_) {
        if (!p.running) continue;
        member_running = member_running || p.admitted;
        orphans = orphans || !p.admitted;
      }
      if (member_running || !orphans) {
        orphans_since.reset();
      } else if (!orphans_since) {
        orphans_since = std::chrono::steady_clock::now();
      } else if (std::chrono::steady_clock::now() - *orphans_since > plan_.options.stop_grace) {
        for (auto& p : procs_) {
          if (!p.running) continue;
          say(c10::str("loom launch: stopping replacement member ", p.member, " (local rank ",
                       p.local_rank, ", pid ", p.pid, "): no member is left to admit it"));
          kill_rank(p, SIGKILL);
          waitpid(p.pid, &p.wait_status, 0);
          p.running = false;
          p.lost = true;
        }
        continue;
      }
      const auto received = signals.wait(kElasticPollMs);
      if (!received.empty()) {
        GroupOutcome out;
        out.kind = GroupOutcome::Kind::kInterrupted;
        out.launcher_signal = received.front();
        out.stopped = stop_all(received.front(), signals, nullptr);
        out.replacements = replacements;
        return out;
      }
    }
  }

 private:
  static constexpr int kElasticPollMs = 20;

  static bool exited_ok(const RankProcess& p) {
    return WIFEXITED(p.wait_status) && WEXITSTATUS(p.wait_status) == 0;
  }

  static void say(const std::string& line) {
    std::fprintf(stderr, "%s\n", line.c_str());
    std::fflush(stderr);
  }

  // The attempt ends as without elastic mode: `failed` named, the other ranks stopped.
  GroupOutcome end_attempt(std::vector<RankProcess> failed, SignalScope& signals,
                           int replacements) {
    GroupOutcome out;
    out.kind = GroupOutcome::Kind::kRankFailed;
    out.failed = std::move(failed);
    out.stopped = stop_all(SIGTERM, signals, &out.launcher_signal);
    find_root_cause(out, {});
    out.replacements = replacements;
    return out;
  }

  RankProcess* find_member(int id) {
    for (auto& p : procs_) {
      if (p.member == id) return &p;
    }
    return nullptr;
  }

  void write_generation(int generation, const nlohmann::json& membership) {
    store_->set(c10::str(kGenerationKeyPrefix, generation), membership.dump());
    store_->set(kGenerationKey, std::to_string(generation));
  }

  // Asks the current generation to yield to the ready replacements.
  void request_join() {
    store_->set(kJoinRequestKey, std::to_string(generation_));
    join_requested_ = generation_;
  }

  // A replacement for `lost`: the next member id, its RANK and LOCAL_RANK, the same attempt.
  int spawn_replacement(const RankProcess& lost) {
    RankProcess p;
    p.rank = lost.rank;
    p.local_rank = lost.local_rank;
    p.member = next_member_++;
    p.joiner = true;
    p.admitted = false;
    std::error_code ec;
    std::filesystem::remove(error_file(p), ec);
    p.pid = spawn(p);
    p.running = true;
    procs_.push_back(p);
    return p.member;
  }

  // Replacements that said they are ready; the join request once some are; the next generation
  // once the current one yielded.
  void poll_joins() {
    bool any_ready = false;
    for (auto& p : procs_) {
      if (!p.running || p.admitted) continue;
      if (!p.ready) p.ready = store_->check({c10::str(kReadyKeyPrefix, p.member)});
      any_ready = any_ready || p.ready;
    }
    if (!join_requested_) {
      if (any_ready) request_join();
      return;
    }
    if (!store_->check({c10::str(kYieldKeyPrefix, *join_requested_)})) return;
    std::vector<int> members;
    for (int id : members_) {
      if (const RankProcess* m = find_member(id); m != nullptr && m->running) members.push_back(id);
    }
    std::vector<RankProcess*> joining;
    for (auto& p : procs_) {
      if (p.running && !p.admitted && p.ready) joining.push_back(&p);
    }
    std::sort(joining.begin(), joining.end(),
              [](const RankProcess* a, const RankProcess* b) { return a->member < b->member; });
    std::vector<int> joined;
    std::string names;
    for (size_t k = 0; k < joining.size(); ++k) {
      joined.push_back(joining[k]->member);
      members.push_back(joining[k]->member);
      names += (k == 0 ? "" : k + 1 == joining.size() ? " and " : ", ") +
               std::to_string(joining[k]->member);
    }
    const int generation = generation_ + 1;
    const std::string reason =
        joined.empty() ? "no member joined: the ready replacement(s) were lost"
                       : c10::str(joined.size() > 1 ? "members " : "member ", names, " joined");
    write_generation(generation, nlohmann::json{{"members", members},
                                                {"joined", joined},
                                                {"reason", reason}});
    generation_ = generation;
    members_ = members;
    join_requested_.reset();
    std::string who;
    for (size_t k = 0; k < joining.size(); ++k) {
      joining[k]->admitted = true;
      who += c10::str(k == 0 ? "" : k + 1 == joining.size() ? " and " : ", ", "member ",
                      joining[k]->member, " (local rank ", joining[k]->local_rank, ", pid ",
                      joining[k]->pid, ")");
    }
    say(joined.empty() ? c10::str("loom launch: ", reason, "; ", members.size(),
                                  " member(s) in generation ", generation)
                       : c10::str("loom launch: ", who, " joined: ", members.size(),
                                  " member(s) in generation ", generation));
  }

  // Collects exited processes (any exit) and returns their indices in procs_.
  std::vector<size_t> reap_elastic() {
    std::vector<size_t> exited;
    for (size_t i = 0; i < procs_.size(); ++i) {
      RankProcess& p = procs_[i];
      if (!p.running) continue;
      int status = 0;
      if (waitpid(p.pid, &status, WNOHANG) != p.pid) continue;
      p.running = false;
      p.wait_status = status;
      exited.push_back(i);
    }
    return exited;
  }

  int running_count() const {
    int n = 0;
    for (const auto& p : procs_) n += p.running ? 1 : 0;
    return n;
  }

  std::filesystem::path error_file(const RankProcess& p) const {
    // Elastic mode: a replacement has its lost member's rank, not its report.
    if (store_) return error_dir_ / c10::str("member-", p.member, ".error");
    return error_dir_ / c10::str("rank-", p.rank, ".error");
  }

  // The report a rank wrote through loom::report_error: its exit code, then its line. Leaves
  // both unset when it wrote none (killed before reporting, or not a Loom program).
  void read_error_report(RankProcess& p) const {
    std::ifstream in(error_file(p));
    std::string code, line;
    if (!std::getline(in, code) || !std::getline(in, line)) return;
    p.error_line = line;
    p.reported_code = std::atoi(code.c_str());
  }

  // After an attempt has ended: the rank that failed first, in this order.
  //  1. A rank of the first failures the launcher saw (`out.failed`, before it sent any signal)
  //     that died by a signal: a SIGKILL or a crash is never the echo of a peer's failure, while
  //     the survivors' errors (Gloo's "connection closed by peer", written while the launcher was
  //     stopping them) are. Naming a survivor's secondary error would hide the real cause.
  //  2. A rank that was stopped (SIGSTOP) while the others failed: the waiting ranks time out
  //     (watchdog, 124) because of it. The attempt keeps the waiting rank's exit code.
  //  3. The lowest rank that reported an error of its own (not exit 4, "stopped: another rank
  //     failed"); it may have reported and still been stopped while it lingered.
  void find_root_cause(GroupOutcome& out, const std::vector<RankProcess>& stopped_ranks) {
    std::optional<RankProcess> reported;
    for (auto& p : procs_) {
      if (p.lost) continue;  // elastic mode: a loss the attempt survived
      read_error_report(p);
      if (!reported && p.reported_code != 0 && p.reported_code != kExitPeerFailed) reported = p;
    }
    for (const RankProcess& r : out.failed) {
      // SIGPIPE is the exception: a write to a peer that is gone, i.e. an echo.
      if (WIFSIGNALED(r.wait_status) && WTERMSIG(r.wait_status) != SIGPIPE && r.reported_code == 0) {
        out.root_cause = r;
        out.cause = GroupOutcome::Cause::kSignal;
        out.cause_code = kExitFailure;
        return;
      }
    }
    if (!stopped_ranks.empty()) {
      out.root_cause = stopped_ranks.front();
      out.cause = GroupOutcome::Cause::kStopped;
      out.cause_code = reported          ? reported->reported_code
                       : watchdog_fired(out.failed) ? kExitWatchdog
                                                  : kExitFailure;
      return;
    }
    out.root_cause = reported;
    out.cause = GroupOutcome::Cause::kReported;
  }

  static void kill_rank(const RankProcess& p, int sig) {
    if (kill(-p.pid, sig) != 0) kill(p.pid, sig);  // whole process group, else the rank itself
  }

  // Collects exited ranks; returns those that failed, in rank order.
  std::vector<RankProcess> reap() {
    std::vector<RankProcess> failed;
    for (auto& p : procs_) {
      if (!p.running) continue;
      int status = 0;
      const pid_t r = waitpid(p.pid, &status, WNOHANG);
      if (r != p.pid) continue;
      p.running = false;
      p.wait_status = status;
      const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
      if (!ok) {
        read_error_report(p);
        failed.push_back(p);
      }
    }
    return failed;
  }

  // Sends `sig` to every running rank, waits up to the grace period (a SIGINT/SIGTERM to the
  // launcher cuts it short and is stored in `*interrupted_by` when given), then SIGKILLs the rest.
  // Returns how many ranks were running.
  int stop_all(int sig, SignalScope& signals, int* interrupted_by) {
    const int running = running_count();
    for (const auto& p : procs_) {
      if (p.running) kill_rank(p, sig);
    }
    const auto deadline = std::chrono::steady_clock::now() + plan_.options.stop_grace;
    while (running_count() > 0) {
      reap();
      if (running_count() == 0) break;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) break;
      const auto received = signals.wait(static_cast<int>(std::min<int64_t>(left.count(), 100)));
      if (!received.empty()) {
        if (interrupted_by != nullptr) *interrupted_by = received.front();
        break;
      }
    }
    for (auto& p : procs_) {
      if (!p.running) continue;
      kill_rank(p, SIGKILL);
      waitpid(p.pid, &p.wait_status, 0);
      p.running = false;
    }
    return running;
  }

  std::vector<std::string> environment(const RankProcess& p) const {
    const auto& o = plan_.options;
    const std::vector<std::pair<std::string, std::string>> vars = {
        {"RANK", std::to_string(p.rank)},
        {"LOCAL_RANK", std::to_string(p.local_rank)},
        {"WORLD_SIZE", std::to_string(o.nnodes * o.nproc_per_node)},
        {"LOCAL_WORLD_SIZE", std::to_string(o.nproc_per_node)},
        {"GROUP_RANK", std::to_string(o.node_rank)},
        {"NODE_RANK", std::to_string(o.node_rank)},
        {"GROUP_WORLD_SIZE", std::to_string(o.nnodes)},
        {"ROLE_RANK", std::to_string(p.rank)},
        {"ROLE_WORLD_SIZE", std::to_string(o.nnodes * o.nproc_per_node)},
        {"MASTER_ADDR", o.master_addr},
        {"MASTER_PORT", std::to_string(master_port_)},
        {"TORCHELASTIC_RESTART_COUNT", std::to_string(restart_count_)},
        {"TORCHELASTIC_USE_AGENT_STORE", "True"},
        {"TORCHELASTIC_MAX_RESTARTS", std::to_string(o.max_restarts)},
        {"LOOM_RESTART_COUNT", std::to_string(restart_count_)},
        {"LOOM_MAX_RESTARTS", std::to_string(o.max_restarts)},
        {"LOOM_ERROR_FILE", error_file(p).string()},
    };
    std::set<std::string> ours;
    for (const auto& [k, v] : vars) ours.insert(k);
    std::vector<std::pair<std::string, std::string>> elastic_vars;
    if (store_) {
      // Never inherited: only a replacement is a joiner.
      ours.insert(kElasticMemberEnv);
      ours.insert(kElasticJoinerEnv);
      elastic_vars.emplace_back(kElasticMemberEnv, std::to_string(p.member));
      if (p.joiner) elastic_vars.emplace_back(kElasticJoinerEnv, "1");
    }
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string entry(*e);
      const std::string key = entry.substr(0, entry.find('='));
      if (!ours.count(key)) env.push_back(entry);
    }
    for (const auto& [k, v] : vars) env.push_back(k + "=" + v);
    for (const auto& [k, v] : elastic_vars) env.push_back(k + "=" + v);
    return env;
  }

  pid_t spawn(const RankProcess& p) {
    // Everything the child needs is prepared before fork: after it, only async-signal-safe calls.
    std::vector<std::string> env_strings = environment(p);
    if (plan_.fork_server != nullptr && !plan_.fork_server->gone()) {
      try {
        const pid_t pid = plan_.fork_server->spawn(env_strings, plan_.argv);
        setpgid(pid, pid);  // also from here, so signals sent right away reach the group
        return pid;
      } catch (const Error& e) {
        if (!plan_.fork_server->gone()) throw;
        // A server that died (the OOM killer's choice, a stray signal) must not end a launch
        // that can still exec its ranks, as it does when there never was a server.
        log::warn("loom launch: the rank fork server (pid ", plan_.fork_server->pid(),
                  ") has gone; this and every later rank is exec'd and loads loom anew");
      }
    }
    std::vector<char*> envp;
    for (auto& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::vector<std::string> arg_strings = plan_.argv;
    std::vector<char*> argv;
    for (auto& s : arg_strings) argv.push_back(s.data());
    argv.push_back(nullptr);
    const char* program = plan_.program.c_str();
    const bool search_path = plan_.options.exec;

    // exec failures come back as the child's errno through a close-on-exec pipe.
    int err_pipe[2];
    if (pipe2(err_pipe, O_CLOEXEC) != 0) fail("loom launch: cannot create a pipe: ", std::strerror(errno));
    const pid_t parent = getpid();
    const pid_t pid = fork();
    if (pid < 0) {
      close(err_pipe[0]);
      close(err_pipe[1]);
      fail("loom launch: cannot fork rank ", p.rank, ": ", std::strerror(errno));
    }
    if (pid == 0) {
      close(err_pipe[0]);
      setpgid(0, 0);
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(1);  // the launcher died before prctl took effect
      sigset_t none;
      sigemptyset(&none);
      sigprocmask(SIG_SETMASK, &none, nullptr);
      signal(SIGINT, SIG_DFL);
      signal(SIGTERM, SIG_DFL);
      signal(SIGCHLD, SIG_DFL);
      if (search_path) {
        execvpe(program, argv.data(), envp.data());
      } else {
        execve(program, argv.data(), envp.data());
      }
      const int err = errno;
      [[maybe_unused]] ssize_t n = write(err_pipe[1], &err, sizeof(err));
      _exit(127);
    }
    setpgid(pid, pid);  // also from the parent, so signals sent right away reach the group
    close(err_pipe[1]);
    int child_errno = 0;
    ssize_t n;
    do {
      n = read(err_pipe[0], &child_errno, sizeof(child_errno));
    } while (n < 0 && errno == EINTR);
    close(err_pipe[0]);
    if (n == static_cast<ssize_t>(sizeof(child_errno))) {
      int status = 0;
      waitpid(pid, &status, 0);
      fail("loom launch: cannot execute '", plan_.program, "' for rank ", p.rank, ": ",
           std::strerror(child_errno));
    }
    return pid;
  }

  const ResolvedLaunch& plan_;
  int restart_count_;
  int master_port_;
  std::filesystem::path error_dir_;
  std::vector<RankProcess> procs_;
  // Elastic mode: the store under the attempt's prefix (null otherwise), the current generation
  // and its members, the next unused member id, and the generation a pending join request names.
  c10::intrusive_ptr<c10d::Store> store_;
  int generation_ = 0;
  std::vector<int> members_;
  int next_member_ = 0;
  std::optional<int> join_requested_;
};

// A private folder for the ranks' error reports (LOOM_ERROR_FILE), removed with the launch.
class ErrorFolder {
 public:
  ErrorFolder() {
    std::string templ = (std::filesystem::temp_directory_path() / "loom-launch-XXXXXX").string();
    LOOM_REQUIRE(mkdtemp(templ.data()) != nullptr, "loom launch: cannot create a temporary folder "
                 "in ", std::filesystem::temp_directory_path().string(), ": ", std::strerror(errno),
                 "; set TMPDIR to a writable folder");
    path_ = templ;
  }
  ~ErrorFolder() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

ResolvedLaunch resolve(const LaunchOptions& o) {
  LOOM_REQUIRE_USAGE(o.nproc_per_node >= 1, "--nproc ", o.nproc_per_node, " must be >= 1");
  LOOM_REQUIRE_USAGE(o.nnodes >= 1, "--nnodes ", o.nnodes, " must be >= 1");
  LOOM_REQUIRE_USAGE(o.node_rank >= 0 && o.node_rank < o.nnodes, "--node-rank ", o.node_rank,
                     " must be in [0, --nnodes ", o.nnodes, ")");
  LOOM_REQUIRE_USAGE(!o.command.empty(), "loom launch needs a command after '--', e.g. "
                     "'loom launch --nproc 2 -- train --config c.toml'");
  LOOM_REQUIRE_USAGE(o.stop_grace.count() >= 0, "--stop-grace must be >= 0 seconds");
  if (o.master_port) {
    LOOM_REQUIRE_USAGE(*o.master_port >= 1 && *o.master_port <= 65535, "--master-port ",
                       *o.master_port, " is not a TCP port; use 1..65535");
  }
  LOOM_REQUIRE_USAGE(o.nnodes == 1 || o.master_port.has_value(),
                     "--nnodes ", o.nnodes, " needs --master-port (the same free port on every "
                     "node; it cannot be picked automatically across nodes)");
  LOOM_REQUIRE_USAGE(o.nnodes == 1 || o.master_addr != "127.0.0.1",
                     "--nnodes ", o.nnodes, " needs --master-addr set to node 0's address "
                     "(reachable from every node), not the loopback default");
  LOOM_REQUIRE_USAGE(o.max_restarts >= 0, "--max-restarts ", o.max_restarts, " must be >= 0");
  // Restarting one node's ranks alone would race the other nodes' launchers to the rendezvous
  // (stale store keys, diverging attempt counts); that needs a rendezvous among the launchers.
  LOOM_REQUIRE_USAGE(!o.elastic || o.nnodes == 1, "--elastic needs --nnodes 1: the elastic "
                     "launcher supervises the memberships of one node's ranks (multi-node elastic "
                     "training needs a rendezvous among the launchers)");
  LOOM_REQUIRE_USAGE(o.max_restarts == 0 || o.nnodes == 1, "--max-restarts ", o.max_restarts,
                     " needs --nnodes 1: restarting a multi-node job needs every node's launcher "
                     "to restart together; let the scheduler requeue the job instead (e.g. Slurm "
                     "--requeue) and resume from the checkpoint");
  ResolvedLaunch plan;
  plan.options = o;
  if (o.exec) {
    plan.program = o.command.front();
    plan.argv = o.command;
  } else {
    std::error_code ec;
    const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
    LOOM_REQUIRE(!ec, "loom launch: cannot resolve /proc/self/exe: ", ec.message());
    plan.program = self.string();
    plan.argv.push_back(plan.program);
    plan.argv.insert(plan.argv.end(), o.command.begin(), o.command.end());
  }
  return plan;
}

}  // namespace

int pick_free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  LOOM_REQUIRE(fd >= 0, "cannot open a socket to pick a free port: ", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  const int err = errno;
  close(fd);
  LOOM_REQUIRE(ok, "cannot bind a socket to pick a free port: ", std::strerror(err),
               "; pass --master-port");
  return ntohs(addr.sin_port);
}

int launch(const LaunchOptions& options) {
  ResolvedLaunch plan = resolve(options);
  // First, while this process has one thread (before the store's server thread starts).
  std::unique_ptr<RankForkServer> fork_server;
  if (!plan.options.exec && plan.options.start_method == StartMethod::kForkServer) {
    fork_server = RankForkServer::start(plan.options.entry);
    plan.fork_server = fork_server.get();
    // Said, because it costs every rank a fresh libtorch load: some library linked into `loom`
    // started a thread before main (libarrow's jemalloc did; arrow_reader/arrow_reader.h).
    if (!fork_server && plan.options.entry) {
      log::warn("loom launch: no fork server (this process already runs more than one thread at start); ",
                "every rank is exec'd and loads loom anew (as --start-method exec)");
    }
  }
  const int max_restarts = plan.options.max_restarts;
  const int attempts = max_restarts + 1;
  SignalScope signals;
  const ErrorFolder errors;
  // The rendezvous store, served by the launcher of node 0 for the whole launch (as torchrun's agent
  // does): it listens before any rank starts, so no rank waits out c10d's connect backoff for rank
  // 0's process to come up, and rank 0 dying does not take it down. Without --master-port it binds
  // a free port itself (no window between picking a port and binding it). Each attempt's ranks
  // use their own key prefix (init_distributed), so a restart's rendezvous is fresh.
  const int master_port = plan.options.master_port.value_or(0);
  c10::intrusive_ptr<c10d::TCPStore> store;
  if (plan.options.node_rank == 0) {
    c10d::TCPStoreOptions store_options;
    store_options.port = static_cast<uint16_t>(master_port);
    store_options.isServer = true;
    store_options.waitWorkers = false;
    try {
      store = c10::make_intrusive<c10d::TCPStore>(plan.options.master_addr, store_options);
    } catch (const c10::Error& e) {
      throw UsageError(c10::str("loom launch cannot serve the rendezvous store on port ", master_port, ": ",
                                e.what_without_backtrace(), "; pass a free --master-port"));
    }
  }
  const int store_port = store ? static_cast<int>(store->getPort()) : master_port;
  // One iteration per attempt: start every local rank, monitor until they all finish or one fails.
  // A failed attempt has been fully stopped and reaped before the next one starts. `restart` counts
  // the restarts done so far, the attempt's own (its TORCHELASTIC_RESTART_COUNT) and, in elastic
  // mode, the replacements it started; `attempt_restart` is the attempt's own.
  for (int restart = 0;; ++restart) {
    const int attempt_restart = restart;
    GroupOutcome outcome;
    {
      // Elastic mode: the protocol's keys live under the attempt's prefix, as the ranks' own.
      c10::intrusive_ptr<c10d::Store> elastic_store;
      if (plan.options.elastic) {
        elastic_store = c10::make_intrusive<c10d::PrefixStore>(
            c10::str("/worker/attempt_", attempt_restart), store);
      }
      WorkerGroup group(plan, attempt_restart, store_port, errors.path(), elastic_store);
      group.start();
      outcome = elastic_store ? group.monitor_elastic(signals, restart) : group.monitor(signals);
    }
    restart += outcome.replacements;
    switch (outcome.kind) {
      case GroupOutcome::Kind::kSucceeded:
        return 0;
      case GroupOutcome::Kind::kInterrupted:
        throw_interrupted(outcome.launcher_signal, outcome.stopped);
      case GroupOutcome::Kind::kRankFailed:
        break;
    }
    if (outcome.launcher_signal != 0) throw_interrupted(outcome.launcher_signal, outcome.stopped);
    const std::string failure = failure_message(outcome, plan.options);
    // The launch ends with the code of the rank that failed first where it classifies the failure
    // (core/error.h: 2 configuration, usage or incompatible checkpoint; 3 diverged; 124 watchdog),
    // else 1. Never 4: the rank that failed first did not stop because of another.
    const int code = attempt_exit_code(outcome);
    const int launch_code =
        code == kExitUsage || code == kExitDiverged || code == kExitWatchdog ? code : kExitFailure;
    if (!exit_code_is_retryable(code)) {
      // A restart would meet the same configuration error or diverge the same way again.
      std::string why = code == kExitUsage ? "a configuration or usage error (or a checkpoint this "
                                             "configuration cannot load)"
                                           : "a divergence (non-finite loss or gradient norm)";
      if (max_restarts == 0) throw Error(failure, launch_code);
      throw Error(c10::str(failure, "; not restarted: ", why, " does not go away with a restart"),
                  launch_code);
    }
    if (restart >= max_restarts) {
      if (max_restarts == 0) throw Error(failure, launch_code);
      throw Error(c10::str(failure, "; attempt ", attempt_restart + 1, " of ", attempts,
                           " failed and no restarts are left (--max-restarts ", max_restarts, ")"),
                  launch_code);
    }
    std::string line = c10::str("loom launch: restart ", restart + 1, " of ", max_restarts,
                                " (attempt ", restart + 2, " of ", attempts, ") after attempt ",
                                attempt_restart + 1, " failed: ", failure);
    if (plan.options.restart_note) {
      const std::string note = plan.options.restart_note(restart, max_restarts);
      if (!note.empty()) line += "; " + note;
    }
    std::fprintf(stderr, "%s\n", line.c_str());
    std::fflush(stderr);
    // Test-only fault: the fork server dies between attempts.
    if (fork_server && std::getenv("LOOM_FAULT_KILL_FORK_SERVER") != nullptr) ::kill(fork_server->pid(), SIGKILL);
  }
}

}  // namespace loom::distributed
