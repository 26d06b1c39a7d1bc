// `loom launch`: starts the local ranks of a job with a torchrun-compatible environment (RANK,
// LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, NODE_RANK, MASTER_ADDR, MASTER_PORT,
// TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS, plus LOOM_RESTART_COUNT and
// LOOM_MAX_RESTARTS) and supervises them: when a rank exits non-zero or dies by a signal (a rank
// whose collective hangs exits with kExitCollectiveTimeout through its watchdog), the others are
// stopped (SIGTERM, SIGKILL after a grace period). Then, while restarts are left (max_restarts),
// the whole group is started again, with a fresh rendezvous: a new free master port, or the same
// --master-port once the old store (rank 0) is gone. Each restart logs one line to stderr
//   loom launch: restart 1 of 3 (attempt 2 of 4) after attempt 1 failed: rank 1 (local rank 1,
//   pid 4242) was killed by signal 9 (SIGKILL); stopped the other 1 running rank(s)
// Ranks resume on their own (the trainer loads the newest complete checkpoint when checkpointing
// is enabled); the launcher only restarts, and only what a restart can fix: a rank that reports
// exit code 2 (configuration or usage error) or 3 (training diverged) ends the launch at once with
// that code (core/error.h lists the codes). Each rank gets LOOM_ERROR_FILE, a file where a Loom rank writes
// the error line that ended it (core/error_report.h); the failure line quotes it:
//   error: rank 1 (local rank 1, pid 4242) exited with code 1: [rank1] error: token id 9000 ... Once no restarts are left the launch fails with one
// line naming the last failure. SIGINT/SIGTERM to the launcher are forwarded to the ranks and end
// the launch without a restart.
//
// Each rank runs in its own process group (so stopping it also stops anything it spawned) and is
// killed by the kernel if the launcher itself dies (PR_SET_PDEATHSIG).
//
// Elastic mode (LaunchOptions::elastic: `--elastic`, or a `train` command whose configuration has
// fault_tolerance.enable; single node only): the launcher is the only writer of memberships and
// keeps the survivors running (elastic_protocol.h is the contract; its keys live in the launcher's
// store under the attempt's prefix "/worker/attempt_<restart_count>"). Each rank process is a
// *member* with an id that is never reused (LOOM_ELASTIC_MEMBER; the first ranks' ids are their
// RANK). Before the ranks start it writes generation 0 = members 0..W-1. A member that dies (a
// signal, or an exit code other than 0, 2, 3 and kExitElasticRestart) is dropped: the launcher
// writes the next generation without it and, while restarts are left, starts a replacement
// (LOOM_ELASTIC_JOINER=1, a new member id, the lost member's RANK/LOCAL_RANK, the same attempt), each
// replacement counting as one restart. One line to stderr says so:
//   loom launch: member 2 (local rank 2, pid 4242) was killed by signal 9 (SIGKILL); 3 member(s)
//   continue in generation 1; starting member 4 as its replacement (restart 1 of 3)
// Once a replacement says it is ready, the launcher asks the current generation to yield
// (kJoinRequestKey) and on its yield writes the next generation with the replacement appended
// ("loom launch: member 4 (local rank 2, pid 4343) joined: 4 member(s) in generation 2"). A
// replacement that dies before it joined is dropped (and replaced while restarts are left); a death
// while a join is pending is handled first and the join request moves to the newer generation.
// Members exiting 0 are fine (spares exit 0 once training is done); the launch succeeds when every
// member still alive has exited 0. A member exiting kExitElasticRestart, 2 or 3 ends the attempt as
// without elastic mode (stop every rank; restart the whole group with a fresh generation 0 under a
// new attempt prefix while restarts are left, never after 2 or 3 reported by the rank), and so does
// a loss that leaves no member running (unless training was already done, kDoneKey). Because
// replacements count as restarts, the restart count of a whole-group restart (its
// TORCHELASTIC_RESTART_COUNT, its attempt prefix, "restart N of R (attempt N+1 of R+1)") counts
// the replacements started before it.
#pragma once
#include <chrono>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "loom/distributed/rank_fork_server.h"

namespace loom::distributed {

// How ranks that run this executable (LaunchOptions::exec false) start: forked from a server that
// has already loaded it (rank_fork_server.h: no second load of libtorch per rank), or by exec'ing
// it afresh, as torchrun does.
enum class StartMethod { kForkServer, kExec };

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
  StartMethod start_method = StartMethod::kForkServer;
  // The executable's main, which forked ranks run; without it ranks are exec'd whatever
  // start_method says. Ranks are exec'd too where the launcher already runs several threads.
  RankEntry entry;
  std::chrono::milliseconds stop_grace{std::chrono::seconds(5)};
  // Restarts of the whole group after a failure (TorchElastic's --max-restarts); single node only.
  int max_restarts = 0;
  // Optional: called before each restart with the restarts done so far and the allowed maximum;
  // its text is appended to the restart line (e.g. which checkpoint the ranks will resume from).
  std::function<std::string(int restarts_done, int max_restarts)> restart_note;
  // Elastic mode (see above): survivors keep running when a member is lost; single node only.
  bool elastic = false;
};

// Validates the options (one-line loom::UsageError), runs the job, and returns 0 when every rank
// of an attempt exited 0. Otherwise throws loom::Error naming the rank that failed first in the
// last attempt (a rank killed by a signal before its peers, a rank stopped while its peers waited,
// else the lowest rank that reported an error of its own) and the others, with that rank's exit
// code where core/error.h classifies it (2 and 3 never restarted, 124 the watchdog), else 1; or
// 128+signal when the launcher was interrupted. Elastic mode returns 0 when every member still
// alive exited 0, whatever members were lost on the way.
int launch(const LaunchOptions& options);

// `loom launch --checkpoint-folder DIR` notes on each restart what the ranks will resume from. The
// dist layer cannot read checkpoints (checkpoint/ sits above it), so the `loom` executable installs
// the describer (apps/restart_policy.cpp); without one the note just names the folder.
using ResumeDescriber = std::function<std::string(const std::filesystem::path& folder,
                                                  int restarts_done, int max_restarts)>;
void set_resume_describer(ResumeDescriber describer);
const ResumeDescriber& resume_describer();  // empty when none was installed

// Where the ranks' own command checkpoints, so that `--checkpoint-folder` can be checked against
// what the ranks will actually do (a restart line naming another folder would say "start from
// scratch" while they resume), and whether it is elastic (fault_tolerance.enable turns on
// LaunchOptions::elastic). The `loom` executable installs a resolver that reads a `train`
// command's configuration; it returns nothing for commands it cannot tell about.
struct RanksCheckpointing {
  bool enabled = false;          // checkpoint.enable
  std::filesystem::path folder;  // job.dump_folder / checkpoint.folder
  bool fault_tolerance = false;  // fault_tolerance.enable: `loom launch` runs in elastic mode
};
using CheckpointResolver =
    std::function<std::optional<RanksCheckpointing>(const std::vector<std::string>& command)>;
void set_checkpoint_resolver(CheckpointResolver resolver);
const CheckpointResolver& checkpoint_resolver();  // empty when none was installed

// A TCP port that was free on this host a moment ago (bound to port 0, then released).
int pick_free_port();

}  // namespace loom::distributed
