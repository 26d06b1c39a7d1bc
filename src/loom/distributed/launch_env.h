// Where this process sits in a multi-process job: rank, world size, local rank and the rendezvous
// address, read from the environment set by the launcher that started it. Understood launchers:
//   torchrun / `loom launch`: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
//                             MASTER_ADDR, MASTER_PORT
//   mpirun (Open MPI):        OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE
//   srun (Slurm):             SLURM_PROCID, SLURM_NTASKS (SLURM_STEP_NUM_TASKS), SLURM_LOCALID,
//                             SLURM_NODEID, SLURM_NTASKS_PER_NODE or SLURM_STEP_TASKS_PER_NODE
// torchrun variables win when several are present (torchrun inside an sbatch allocation).
// No variables at all means a single process: rank 0 of 1.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace loom::distributed {

// Rendezvous port used by mpirun/srun jobs that do not set MASTER_PORT (single node only) and by
// torchrun's own default; `loom launch` picks a free port instead when none is given.
inline constexpr int kDefaultMasterPort = 29500;
inline constexpr const char* kDefaultMasterAddr = "127.0.0.1";

enum class LauncherKind { kSingleProcess, kTorchrun, kMpirun, kSlurm };
const char* to_string(LauncherKind kind);

struct LaunchEnv {
  LauncherKind launcher = LauncherKind::kSingleProcess;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  int node_rank = 0;
  std::string master_addr = kDefaultMasterAddr;
  int master_port = kDefaultMasterPort;
  // The launcher's restart count and limit (TORCHELASTIC_RESTART_COUNT / _MAX_RESTARTS, set by
  // torchrun and `loom launch`); 0 when not launched so.
  int restart_count = 0;
  int max_restarts = 0;
  // The launcher already serves the rendezvous store at MASTER_ADDR:MASTER_PORT
  // (TORCHELASTIC_USE_AGENT_STORE=True, set by torchrun and `loom launch`): every rank connects to
  // it as a client, under the prefix "/worker/attempt_<restart_count>", and rank 0 serves none.
  bool agent_store = false;

  bool distributed() const { return world_size > 1; }
  // All ranks on this node: loopback transport suffices and no MASTER_ADDR is needed.
  bool single_node() const { return local_world_size == world_size; }
  std::string describe() const;
};

// Reads the process environment. Throws loom::UsageError (one line naming the variable) when the
// variables are incomplete, not integers, or inconsistent (rank >= world size, ...).
LaunchEnv detect_launch_env();

// Expands Slurm's compressed per-node task counts, e.g. "2(x3),1" -> {2, 2, 2, 1}.
std::vector<int> parse_slurm_tasks_per_node(const std::string& value);

}  // namespace loom::distributed
