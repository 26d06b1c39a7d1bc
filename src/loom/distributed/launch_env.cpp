#include "loom/distributed/launch_env.h"

#include <charconv>
#include <cstdlib>
#include <optional>

#include "loom/core/error.h"

namespace loom::distributed {
namespace {

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return std::nullopt;
  return std::string(v);
}

int parse_int(const std::string& text, const char* what) {
  int value = 0;
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, value);
  LOOM_REQUIRE_USAGE(ec == std::errc() && ptr == end && !text.empty(), what, "='", text,
                     "' is not an integer; fix the launcher environment");
  return value;
}

std::optional<int> env_int(const char* name) {
  auto v = env(name);
  if (!v) return std::nullopt;
  return parse_int(*v, name);
}

// Nodes holding consecutive blocks of ranks; a bad local size is reported by validate().
int block_node_rank(int rank, int local_world_size) {
  return local_world_size > 0 ? rank / local_world_size : 0;
}

int require_int(const char* name, const char* because) {
  auto v = env_int(name);
  LOOM_REQUIRE_USAGE(v.has_value(), name, " is not set although ", because,
                     "; the launcher environment is incomplete");
  return *v;
}

// MASTER_ADDR/MASTER_PORT: required across nodes, defaulted to loopback on one node.
void read_master(LaunchEnv& e) {
  auto addr = env("MASTER_ADDR");
  auto port = env_int("MASTER_PORT");
  if (!e.single_node()) {
    LOOM_REQUIRE_USAGE(addr.has_value() && !addr->empty(),
                       "MASTER_ADDR is not set for a multi-node ", to_string(e.launcher),
                       " job; export MASTER_ADDR=<host of rank 0>");
    LOOM_REQUIRE_USAGE(port.has_value(), "MASTER_PORT is not set for a multi-node ",
                       to_string(e.launcher), " job; export MASTER_PORT=<free port on rank 0's host>");
  }
  if (addr && !addr->empty()) e.master_addr = *addr;
  if (port) e.master_port = *port;
}

void validate(const LaunchEnv& e) {
  const char* who = to_string(e.launcher);
  LOOM_REQUIRE_USAGE(e.world_size >= 1, who, " world size ", e.world_size, " must be >= 1");
  LOOM_REQUIRE_USAGE(e.rank >= 0 && e.rank < e.world_size, who, " rank ", e.rank,
                     " is outside [0, ", e.world_size, "); the launcher environment is inconsistent");
  LOOM_REQUIRE_USAGE(e.local_world_size >= 1 && e.local_world_size <= e.world_size, who,
                     " local world size ", e.local_world_size, " must be in [1, world size ",
                     e.world_size, "]");
  LOOM_REQUIRE_USAGE(e.local_rank >= 0 && e.local_rank < e.local_world_size, who, " local rank ",
                     e.local_rank, " is outside [0, ", e.local_world_size, ")");
  LOOM_REQUIRE_USAGE(e.local_rank <= e.rank, who, " local rank ", e.local_rank,
                     " exceeds global rank ", e.rank, "; the launcher environment is inconsistent");
  LOOM_REQUIRE_USAGE(e.node_rank >= 0, who, " node rank ", e.node_rank, " must be >= 0");
  LOOM_REQUIRE_USAGE(e.master_port >= 1 && e.master_port <= 65535, "MASTER_PORT=", e.master_port,
                     " is not a TCP port; use 1..65535");
}

LaunchEnv from_torchrun() {
  LaunchEnv e;
  e.launcher = LauncherKind::kTorchrun;
  const bool has_rank = env("RANK").has_value();
  e.rank = has_rank ? require_int("RANK", "WORLD_SIZE is set") : 0;
  e.world_size = require_int("WORLD_SIZE", "RANK is set");
  LOOM_REQUIRE_USAGE(has_rank, "RANK is not set although WORLD_SIZE is set",
                     "; the launcher environment is incomplete");
  // Plain env:// launches (RANK/WORLD_SIZE only) describe a single node.
  const bool has_local = env("LOCAL_RANK") || env("LOCAL_WORLD_SIZE");
  e.local_rank = has_local ? require_int("LOCAL_RANK", "LOCAL_WORLD_SIZE is set") : e.rank;
  e.local_world_size =
      has_local ? require_int("LOCAL_WORLD_SIZE", "LOCAL_RANK is set") : e.world_size;
  if (auto g = env_int("GROUP_RANK")) {
    e.node_rank = *g;
  } else if (auto n = env_int("NODE_RANK")) {
    e.node_rank = *n;
  } else {
    e.node_rank = block_node_rank(e.rank, e.local_world_size);
  }
  return e;
}

LaunchEnv from_mpirun() {
  LaunchEnv e;
  e.launcher = LauncherKind::kMpirun;
  e.rank = require_int("OMPI_COMM_WORLD_RANK", "this is an mpirun job");
  e.world_size = require_int("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK is set");
  e.local_rank = require_int("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_RANK is set");
  e.local_world_size = require_int("OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_RANK is set");
  // Open MPI maps ranks by slot by default, so nodes hold consecutive blocks of ranks.
  e.node_rank = block_node_rank(e.rank, e.local_world_size);
  return e;
}

LaunchEnv from_slurm() {
  LaunchEnv e;
  e.launcher = LauncherKind::kSlurm;
  e.rank = require_int("SLURM_PROCID", "this is an srun job");
  // The step's task count is exact for this srun; SLURM_NTASKS is the allocation's.
  auto step_tasks = env_int("SLURM_STEP_NUM_TASKS");
  e.world_size = step_tasks ? *step_tasks : require_int("SLURM_NTASKS", "SLURM_PROCID is set");
  e.local_rank = require_int("SLURM_LOCALID", "SLURM_PROCID is set");
  e.node_rank = env_int("SLURM_NODEID").value_or(0);
  if (auto list = env("SLURM_STEP_TASKS_PER_NODE")) {
    const auto counts = parse_slurm_tasks_per_node(*list);
    LOOM_REQUIRE_USAGE(e.node_rank < static_cast<int>(counts.size()), "SLURM_NODEID=", e.node_rank,
                       " has no entry in SLURM_STEP_TASKS_PER_NODE='", *list, "'");
    e.local_world_size = counts[e.node_rank];
  } else if (auto per_node = env_int("SLURM_NTASKS_PER_NODE")) {
    e.local_world_size = *per_node;
  } else if (auto list = env("SLURM_TASKS_PER_NODE")) {
    const auto counts = parse_slurm_tasks_per_node(*list);
    LOOM_REQUIRE_USAGE(e.node_rank < static_cast<int>(counts.size()), "SLURM_NODEID=", e.node_rank,
                       " has no entry in SLURM_TASKS_PER_NODE='", *list, "'");
    e.local_world_size = counts[e.node_rank];
  } else {
    LOOM_REQUIRE_USAGE(e.world_size == 1,
                       "srun job with several tasks sets neither SLURM_STEP_TASKS_PER_NODE nor "
                       "SLURM_NTASKS_PER_NODE; run it with srun --ntasks-per-node=<n>");
  }
  return e;
}

}  // namespace

const char* to_string(LauncherKind kind) {
  switch (kind) {
    case LauncherKind::kSingleProcess: return "single-process";
    case LauncherKind::kTorchrun: return "torchrun";
    case LauncherKind::kMpirun: return "mpirun";
    case LauncherKind::kSlurm: return "srun";
  }
  return "unknown";
}

std::string LaunchEnv::describe() const {
  return c10::str(to_string(launcher), ": rank ", rank, "/", world_size, ", local rank ",
                  local_rank, "/", local_world_size, ", node ", node_rank, ", rendezvous ",
                  master_addr, ":", master_port);
}

std::vector<int> parse_slurm_tasks_per_node(const std::string& value) {
  std::vector<int> counts;
  size_t pos = 0;
  auto bad = [&]() {
    fail_usage("Slurm tasks-per-node list '", value,
               "' is malformed; expected e.g. '2(x3),1' (count with optional (xREPEAT))");
  };
  if (value.empty()) bad();
  while (pos < value.size()) {
    size_t end = value.find(',', pos);
    if (end == std::string::npos) end = value.size();
    const std::string item = value.substr(pos, end - pos);
    const size_t paren = item.find("(x");
    int repeat = 1;
    std::string count_text = item;
    if (paren != std::string::npos) {
      if (item.back() != ')') bad();
      count_text = item.substr(0, paren);
      const std::string repeat_text = item.substr(paren + 2, item.size() - paren - 3);
      int r = 0;
      auto [p, ec] = std::from_chars(repeat_text.data(), repeat_text.data() + repeat_text.size(), r);
      if (ec != std::errc() || p != repeat_text.data() + repeat_text.size() || r < 1) bad();
      repeat = r;
    }
    int count = 0;
    auto [p, ec] = std::from_chars(count_text.data(), count_text.data() + count_text.size(), count);
    if (count_text.empty() || ec != std::errc() || p != count_text.data() + count_text.size() ||
        count < 1) {
      bad();
    }
    counts.insert(counts.end(), repeat, count);
    pos = end + 1;
    if (end == value.size() - 1) bad();  // trailing comma
  }
  return counts;
}

LaunchEnv detect_launch_env() {
  LaunchEnv e;
  if (env("RANK") || env("WORLD_SIZE")) {
    e = from_torchrun();
  } else if (env("OMPI_COMM_WORLD_RANK") || env("OMPI_COMM_WORLD_SIZE")) {
    e = from_mpirun();
  } else if (env("SLURM_PROCID")) {
    e = from_slurm();
  }
  // Restarts apply to one process too (`loom launch --nproc 1 --max-restarts R`).
  e.restart_count = std::max(0, env_int("TORCHELASTIC_RESTART_COUNT").value_or(0));
  e.max_restarts = std::max(0, env_int("TORCHELASTIC_MAX_RESTARTS").value_or(0));
  // torch.distributed compares the value with str(True) as well.
  e.agent_store = env("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True";
  if (e.launcher == LauncherKind::kSingleProcess) return e;
  validate(e);
  read_master(e);
  validate(e);
  return e;
}

}  // namespace loom::distributed
