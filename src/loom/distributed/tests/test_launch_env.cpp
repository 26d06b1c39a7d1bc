// Launcher-environment detection for torchrun, mpirun and srun styles, and the thread policy.
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <optional>
#include <string>

#include "loom/core/error.h"
#include "loom/distributed/launch_env.h"
#include "loom/distributed/process_group.h"
#include "loom/testing/errors.h"

namespace loom::distributed {
namespace {

// Clears every launcher variable for the test's duration, sets the given ones, and restores the
// original environment afterwards (tests may themselves run under a launcher).
using Vars = std::map<std::string, std::string>;

class ScopedEnv {
 public:
  explicit ScopedEnv(const Vars& vars) {
    for (const char* name : kManaged) {
      const char* v = std::getenv(name);
      saved_[name] = v ? std::optional<std::string>(v) : std::nullopt;
      unsetenv(name);
    }
    for (const auto& [k, v] : vars) {
      EXPECT_TRUE(saved_.count(k)) << k << " is not a managed variable";
      setenv(k.c_str(), v.c_str(), 1);
    }
  }
  ~ScopedEnv() {
    for (const auto& [k, v] : saved_) {
      if (v) {
        setenv(k.c_str(), v->c_str(), 1);
      } else {
        unsetenv(k.c_str());
      }
    }
  }

 private:
  static constexpr const char* kManaged[] = {
      "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
      "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
      "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_PROCID", "SLURM_NTASKS",
      "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS_PER_NODE",
      "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "LOOM_NUM_THREADS", "OMP_NUM_THREADS"};
  std::map<std::string, std::optional<std::string>> saved_;
};

using loom::testing::usage_error_of;

TEST(LaunchEnv, NoVariablesIsSingleProcess) {
  ScopedEnv env(Vars{});
  const LaunchEnv e = detect_launch_env();
  EXPECT_EQ(e.launcher, LauncherKind::kSingleProcess);
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.world_size, 1);
  EXPECT_EQ(e.local_world_size, 1);
  EXPECT_FALSE(e.distributed());
  EXPECT_EQ(e.master_addr, "127.0.0.1");
  EXPECT_EQ(e.master_port, kDefaultMasterPort);
}

TEST(LaunchEnv, Torchrun) {
  ScopedEnv env(Vars{{"RANK", "5"}, {"LOCAL_RANK", "1"}, {"WORLD_SIZE", "8"},
                 {"LOCAL_WORLD_SIZE", "4"}, {"GROUP_RANK", "1"}, {"MASTER_ADDR", "node0"},
                 {"MASTER_PORT", "1234"}});
  const LaunchEnv e = detect_launch_env();
  EXPECT_EQ(e.launcher, LauncherKind::kTorchrun);
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 4);
  EXPECT_EQ(e.node_rank, 1);
  EXPECT_EQ(e.master_addr, "node0");
  EXPECT_EQ(e.master_port, 1234);
  EXPECT_FALSE(e.single_node());
}

TEST(LaunchEnv, TorchrunWinsOverSlurmAllocation) {
  ScopedEnv env(Vars{{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"},
                 {"LOCAL_WORLD_SIZE", "2"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}});
  const LaunchEnv e = detect_launch_env();
  EXPECT_EQ(e.launcher, LauncherKind::kTorchrun);
  EXPECT_EQ(e.rank, 1);
  // One node: the rendezvous defaults to loopback and the documented port.
  EXPECT_EQ(e.master_addr, "127.0.0.1");
  EXPECT_EQ(e.master_port, kDefaultMasterPort);
}

TEST(LaunchEnv, PlainEnvInitMeansOneNode) {
  ScopedEnv env(Vars{{"RANK", "2"}, {"WORLD_SIZE", "3"}});
  const LaunchEnv e = detect_launch_env();
  EXPECT_EQ(e.local_rank, 2);
  EXPECT_EQ(e.local_world_size, 3);
  EXPECT_TRUE(e.single_node());
}

TEST(LaunchEnv, Mpirun) {
  ScopedEnv env(Vars{{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                 {"OMPI_COMM_WORLD_LOCAL_RANK", "3"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
  const LaunchEnv e = detect_launch_env();
  EXPECT_EQ(e.launcher, LauncherKind::kMpirun);
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.local_rank, 3);
  EXPECT_EQ(e.node_rank, 0);
  EXPECT_EQ(e.master_addr, "127.0.0.1");
  EXPECT_EQ(e.master_port, kDefaultMasterPort);
}

TEST(LaunchEnv, MpirunAcrossNodesNeedsMasterAddr) {
  ScopedEnv env(Vars{{"OMPI_COMM_WORLD_RANK", "5"}, {"OMPI_COMM_WORLD_SIZE", "8"},
                 {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
  EXPECT_NE(usage_error_of([] { detect_launch_env(); }).find("MASTER_ADDR is not set"),
            std::string::npos);
  setenv("MASTER_ADDR", "10.0.0.1", 1);
  setenv("MASTER_PORT", "29511", 1);
  const LaunchEnv e = detect_launch_env();
  EXPECT_EQ(e.node_rank, 1);
  EXPECT_EQ(e.master_addr, "10.0.0.1");
  EXPECT_EQ(e.master_port, 29511);
}

TEST(LaunchEnv, Srun) {
  ScopedEnv env(Vars{{"SLURM_PROCID", "6"}, {"SLURM_NTASKS", "7"}, {"SLURM_LOCALID", "2"},
                 {"SLURM_NODEID", "1"}, {"SLURM_STEP_TASKS_PER_NODE", "4,3"},
                 {"MASTER_ADDR", "n0"}, {"MASTER_PORT", "4000"}});
  const LaunchEnv e = detect_launch_env();
  EXPECT_EQ(e.launcher, LauncherKind::kSlurm);
  EXPECT_EQ(e.rank, 6);
  EXPECT_EQ(e.world_size, 7);
  EXPECT_EQ(e.local_rank, 2);
  EXPECT_EQ(e.local_world_size, 3);
  EXPECT_EQ(e.node_rank, 1);
}

TEST(LaunchEnv, SrunSingleNodeWithNtasksPerNode) {
  ScopedEnv env(Vars{{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "1"},
                 {"SLURM_NTASKS_PER_NODE", "2"}});
  const LaunchEnv e = detect_launch_env();
  EXPECT_EQ(e.world_size, 2);
  EXPECT_EQ(e.local_world_size, 2);
  EXPECT_EQ(e.master_addr, "127.0.0.1");
  EXPECT_EQ(e.master_port, kDefaultMasterPort);
}

TEST(LaunchEnv, SlurmTasksPerNodeList) {
  EXPECT_EQ(parse_slurm_tasks_per_node("2(x3),1"), (std::vector<int>{2, 2, 2, 1}));
  EXPECT_EQ(parse_slurm_tasks_per_node("8"), (std::vector<int>{8}));
  EXPECT_EQ(parse_slurm_tasks_per_node("1,4(x2)"), (std::vector<int>{1, 4, 4}));
  for (const char* bad : {"", "2(x", "x", "2,", "0", "2(x0)"}) {
    EXPECT_NE(usage_error_of([&] { parse_slurm_tasks_per_node(bad); }).find("malformed"),
              std::string::npos)
        << bad;
  }
}

TEST(LaunchEnv, InconsistentValuesAreOneLineErrors) {
  struct Case {
    Vars vars;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{{"RANK", "2"}, {"WORLD_SIZE", "2"}}, "rank 2 is outside [0, 2)"},
      {{{"RANK", "0"}}, "WORLD_SIZE is not set although RANK is set"},
      {{{"WORLD_SIZE", "2"}}, "RANK is not set although WORLD_SIZE is set"},
      {{{"RANK", "x"}, {"WORLD_SIZE", "2"}}, "RANK='x' is not an integer"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "0"}}, "world size 0 must be >= 1"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}},
       "LOCAL_WORLD_SIZE is not set although LOCAL_RANK is set"},
      {{{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}},
       "local rank 2 is outside [0, 2)"},
      {{{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}},
       "MASTER_PORT=70000 is not a TCP port"},
      {{{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"},
        {"MASTER_ADDR", "n0"}},
       "MASTER_PORT is not set for a multi-node torchrun job"},
      {{{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}},
       "OMPI_COMM_WORLD_LOCAL_RANK is not set"},
      {{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "0"}},
       "sets neither SLURM_STEP_TASKS_PER_NODE nor SLURM_NTASKS_PER_NODE"},
      {{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "0"},
        {"SLURM_NODEID", "2"}, {"SLURM_STEP_TASKS_PER_NODE", "2(x2)"}},
       "SLURM_NODEID=2 has no entry in SLURM_STEP_TASKS_PER_NODE='2(x2)'"},
  };
  for (const auto& c : cases) {
    ScopedEnv env(c.vars);
    const std::string message = usage_error_of([] { detect_launch_env(); });
    EXPECT_NE(message.find(c.message), std::string::npos)
        << "got: " << message << "\nexpected to contain: " << c.message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
}

TEST(IntraOpThreads, DividesCoresAmongLocalRanksUnlessOverridden) {
  LaunchEnv e;
  e.world_size = e.local_world_size = 64;  // more ranks than cores: still one thread each
  {
    ScopedEnv env(Vars{});
    EXPECT_EQ(intra_op_threads(e), 1);
    e.local_world_size = 1;
    EXPECT_GE(intra_op_threads(e), 1);
  }
  {
    ScopedEnv env(Vars{{"OMP_NUM_THREADS", "3"}});
    EXPECT_EQ(intra_op_threads(e), 3);
  }
  {
    ScopedEnv env(Vars{{"OMP_NUM_THREADS", "3"}, {"LOOM_NUM_THREADS", "5"}});
    EXPECT_EQ(intra_op_threads(e), 5);
  }
  {
    ScopedEnv env(Vars{{"LOOM_NUM_THREADS", "0"}});
    EXPECT_NE(usage_error_of([&] { intra_op_threads(e); }).find("LOOM_NUM_THREADS='0'"),
              std::string::npos);
  }
}

}  // namespace
}  // namespace loom::distributed
