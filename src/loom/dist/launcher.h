// `loom launch`: starts the local ranks of a job with a torchrun-compatible environment (RANK,
// LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, NODE_RANK, MASTER_ADDR, MASTER_PORT,
// TORCHELASTIC_RESTART_COUNT) and supervises them: when a rank exits non-zero or dies by a signal,
// the others are stopped (SIGTERM, SIGKILL after a grace period) and the launch fails with one line
// naming that rank. SIGINT/SIGTERM to the launcher are forwarded to the ranks.
//
// Each rank runs in its own process group (so stopping it also stops anything it spawned) and is
// killed by the kernel if the launcher itself dies (PR_SET_PDEATHSIG).
#pragma once
#include <chrono>
#include <optional>
#include <string>
#include <vector>

namespace loom::dist {

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  std::optional<int> master_port;  // single node: a free port when unset
  // false: each rank runs this executable (/proc/self/exe) with `command` as its arguments;
  // true: `command` is a program (looked up in PATH) and its arguments.
  bool exec = false;
  std::vector<std::string> command;
  std::chrono::milliseconds stop_grace{std::chrono::seconds(5)};
};

// Validates the options (one-line loom::UsageError), runs the job, and returns 0 when every rank
// exited 0. Otherwise throws loom::Error: exit code 1 naming the first failed rank, or 128+signal
// when the launcher was interrupted.
int launch(const LaunchOptions& options);

// A TCP port that was free on this host a moment ago (bound to port 0, then released).
int pick_free_port();

}  // namespace loom::dist
