// A fork server for `loom launch`: ranks that run the launcher's own executable start as forks of
// a process that has already loaded it, instead of exec'ing it again. Loading libtorch and running
// its static initialisers costs ~0.45 s of CPU per process on the CI machine (a `main` that
// returns at once, linked against libtorch_cpu: 0.49 s), which every rank of every launch and
// every restart paid again: an 8-rank launch on 2 cores spent ~1.8 s before any rank read its
// config.
//
// Why a separate server process rather than fork() in the launcher: the launcher serves the
// rendezvous store (a TCPStore server thread), and a fork of a multi-threaded process may only call
// async-signal-safe functions before exec. The server is forked at the start of the launch, while
// the launcher still has one thread, and stays single-threaded: each rank it forks is a copy of a
// single-threaded process, free to run the `loom` entry point.
//
// The launcher supervises the ranks as before (waitpid, SIGCHLD, PR_SET_PDEATHSIG, process groups),
// so each rank must be the launcher's child: the server forks an intermediate that forks the rank
// and exits, and the launcher, a child subreaper (PR_SET_CHILD_SUBREAPER) while it spawns, adopts
// the orphaned rank. The rank waits until it has been adopted before arming PR_SET_PDEATHSIG.
#pragma once
#include <sys/types.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace loom::distributed {

// The executable's own entry point (`main` of the loom binary), run in each forked rank with the
// rank's argv; its return value is the rank's exit code.
using RankEntry = std::function<int(int argc, char** argv)>;

class RankForkServer {
 public:
  // Forks the server. Returns nullptr, and the caller execs its ranks instead, where the calling
  // process already runs several threads (the server would be a copy of a multi-threaded process)
  // or the fork fails.
  static std::unique_ptr<RankForkServer> start(RankEntry entry);
  ~RankForkServer();  // closes the connection: the server exits; waits for it
  RankForkServer(const RankForkServer&) = delete;
  RankForkServer& operator=(const RankForkServer&) = delete;

  // Starts one rank with exactly `environment` (KEY=VALUE entries) and `argv` (argv[0] the
  // executable), as a child of the calling process in a process group of its own, killed by the
  // kernel when the calling process dies. Returns its pid; throws loom::Error when the server
  // cannot start it.
  pid_t spawn(const std::vector<std::string>& environment, const std::vector<std::string>& argv);
  // Whether a spawn found the server gone (killed, e.g. by the OOM killer): the caller then execs
  // its ranks, as when there is no server.
  bool gone() const { return gone_; }
  pid_t pid() const { return pid_; }

 private:
  RankForkServer(pid_t pid, int socket) : pid_(pid), socket_(socket) {}
  pid_t pid_;
  int socket_;
  bool gone_ = false;
};

}  // namespace loom::distributed
