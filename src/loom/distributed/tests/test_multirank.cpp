// Multi-rank tests: real processes started by `loom launch`, running the scenarios of
// loom_distributed_worker (tests/worker/dist_worker.cpp), plus the launcher's own contract (environment,
// failure propagation, signal forwarding). Binaries are found next to this test binary.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>

#include "loom/testing/run.h"

namespace {

using loom::testing::bin_dir;
using loom::testing::count_occurrences;
using loom::testing::run;
using loom::testing::RunResult;

std::string loom_launch(int nproc) {
  return bin_dir() + "/loom launch --nproc " + std::to_string(nproc);
}

RunResult run_worker(int nproc, const std::vector<std::string>& scenarios) {
  std::string command = loom_launch(nproc) + " --exec -- " + bin_dir() + "/loom_distributed_worker";
  for (const auto& s : scenarios) command += " " + s;
  return run(command);
}

void expect_all_ranks_ok(const RunResult& r, int nproc, const std::vector<std::string>& scenarios) {
  EXPECT_EQ(r.exit_code, 0) << r.output;
  for (const auto& scenario : scenarios) {
    for (int rank = 0; rank < nproc; ++rank) {
      const std::string line = "rank " + std::to_string(rank) + "/" + std::to_string(nproc) + " " +
                               scenario + ": ok";
      EXPECT_EQ(count_occurrences(r.output, line), 1) << "missing '" << line << "' in:\n" << r.output;
    }
  }
}

// One launch runs every collective's scenario (process start-up dominates their cost); each
// scenario is still checked, and named, separately.
const std::vector<std::string> kCollectives = {"all_reduce", "all_gather", "reduce_scatter",
                                               "broadcast",  "all_to_all", "send_recv"};

TEST(MultiRank, CollectivesOn2Ranks) {
  expect_all_ranks_ok(run_worker(2, kCollectives), 2, kCollectives);
}

TEST(MultiRank, CollectivesOn4Ranks) {
  expect_all_ranks_ok(run_worker(4, kCollectives), 4, kCollectives);
}

// The same collectives with shared memory turned off: Gloo's path (what a multi-host world uses).
TEST(MultiRank, CollectivesOn4RanksOverGloo) {
  const std::vector<std::string> scenarios = {"all_reduce", "all_gather", "reduce_scatter"};
  std::string command = "env LOOM_TEST_SHARED_MEMORY=0 " + loom_launch(4) + " --exec -- " + bin_dir() +
                        "/loom_distributed_worker";
  for (const auto& s : scenarios) command += " " + s;
  expect_all_ranks_ok(run(command), 4, scenarios);
}

TEST(MultiRank, SharedMemoryCollectivesMatchGloo) {
  expect_all_ranks_ok(run_worker(3, {"shared_memory"}), 3, {"shared_memory"});
}

// Issue 46 (9): a /dev/shm with no room for a collective's contribution (here: rank 1's segment
// limited to 2 MiB, so its 4 MiB all-gather shard and later ones do not fit) moved to Gloo at that
// collective on every rank, instead of ending the job; every result still equals Gloo's.
TEST(MultiRank, SharedMemoryWithoutRoomMovesTheGroupToGlooMidRun) {
  const RunResult r = run("env LOOM_FAULT_SHM_LIMIT=2097152@1 " + loom_launch(3) + " --exec -- " + bin_dir() +
                          "/loom_distributed_worker shared_memory");
  expect_all_ranks_ok(r, 3, {"shared_memory"});
  EXPECT_EQ(count_occurrences(r.output, "continue on Gloo from this one on"), 3) << r.output;
  EXPECT_EQ(count_occurrences(r.output, "cannot grow this rank's segment"), 1) << r.output;
  // The same collective on every rank.
  std::smatch m;
  std::string first;
  for (int rank = 0; rank < 3; ++rank) {
    const std::regex line("rank " + std::to_string(rank) + ": on Gloo from collective #([0-9]+)");
    ASSERT_TRUE(std::regex_search(r.output, m, line)) << r.output;
    if (rank == 0) first = m[1];
    EXPECT_EQ(m[1], first) << r.output;
  }
}

TEST(MultiRank, Mesh2x2SubGroupsAndFlattenedDims) {
  expect_all_ranks_ok(run_worker(4, {"mesh_2x2"}), 4, {"mesh_2x2"});
}

TEST(MultiRank, ByteAccountingMatchesRingFormulas) {
  // Three ranks: 2(W-1)/W is not an integer, so exactness is exercised.
  expect_all_ranks_ok(run_worker(3, {"accounting"}), 3, {"accounting"});
}

TEST(MultiRank, ExposedCommunicationIsTheTimeSpentWaiting) {
  expect_all_ranks_ok(run_worker(2, {"exposed_wait"}), 2, {"exposed_wait"});
}

TEST(MultiRank, FlightRecorderNamesPendingCollective) {
  const RunResult r = run_worker(2, {"flight_recorder"});
  expect_all_ranks_ok(r, 2, {"flight_recorder"});
  EXPECT_NE(r.output.find("barrier world[0,1]"), std::string::npos) << r.output;
}

TEST(Launcher, FailingRankStopsTheOthersAndIsNamed) {
  const RunResult r = run_worker(2, {"fail_rank1"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("error: rank 1 (local rank 1, pid "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(") exited with code 3; stopped the other 1 running rank(s)"),
            std::string::npos)
      << r.output;
  // Rank 0 blocks for an hour unless the launcher stops it; SIGTERM ends it at once.
  EXPECT_LT(r.seconds, 15.0) << r.output;
}

TEST(Launcher, RankKilledBySignalIsReported) {
  const RunResult r = run(loom_launch(3) +
                          " --exec -- sh -c 'if [ \"$RANK\" = 2 ]; then kill -9 $$; fi; sleep 30'");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("error: rank 2 (local rank 2, pid "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("was killed by signal 9 (SIGKILL); stopped the other 2 running rank(s)"),
            std::string::npos)
      << r.output;
  EXPECT_LT(r.seconds, 10.0);
}

TEST(Launcher, SetsTorchrunEnvironment) {
  const RunResult r = run(loom_launch(3) + " --master-port 29612 --exec -- sh -c "
                          "'echo \"R=$RANK L=$LOCAL_RANK W=$WORLD_SIZE LW=$LOCAL_WORLD_SIZE "
                          "G=$GROUP_RANK N=$NODE_RANK A=$MASTER_ADDR P=$MASTER_PORT\"'");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  for (int rank = 0; rank < 3; ++rank) {
    const std::string line = "R=" + std::to_string(rank) + " L=" + std::to_string(rank) +
                             " W=3 LW=3 G=0 N=0 A=127.0.0.1 P=29612";
    EXPECT_NE(r.output.find(line), std::string::npos) << line << "\n" << r.output;
  }
}

TEST(Launcher, PicksAFreePortAndRunsItselfWithoutExec) {
  // Without --exec each rank runs this loom binary with the given arguments: forked from the
  // launcher's fork server (the default) or exec'd.
  for (const std::string method : {"", " --start-method exec", " --start-method forkserver"}) {
    const RunResult r = run(loom_launch(2) + method + " -- launch --help");
    EXPECT_EQ(r.exit_code, 0) << method << "\n" << r.output;
    EXPECT_EQ(count_occurrences(r.output, "Ranks to start on this node"), 2) << method << "\n" << r.output;
    // `loom` is single-threaded when it starts, so the fork server runs (a library that starts a
    // thread at load time, as libarrow does, must be dlopen'ed, not linked).
    EXPECT_EQ(r.output.find("no fork server"), std::string::npos) << method << "\n" << r.output;
  }
  const RunResult bad = run(loom_launch(2) + " --start-method spawn -- launch --help");
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("--start-method"), std::string::npos) << bad.output;
  const RunResult port = run(loom_launch(1) + " --exec -- sh -c 'echo port=$MASTER_PORT'");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(port.output, m, std::regex("port=([0-9]+)"))) << port.output;
  EXPECT_GT(std::stoi(m[1]), 0);
}

TEST(Launcher, ForwardsSigtermAndExitsWith143) {
  // The ranks trap SIGTERM and report it; the script signals the launcher only once both ranks are
  // up (so the launcher's handlers are certainly installed).
  const std::string dir = ::testing::TempDir() + "loom_forward_" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string script = dir + "/forward.sh";
  std::ofstream(script) << R"(#!/bin/sh
"$1" launch --nproc 2 --exec -- sh -c 'trap "echo got-term-$RANK; exit 0" TERM; touch "'"$2"'/ready-$RANK"; sleep 30 & wait' &
pid=$!
i=0
while [ ! -e "$2/ready-0" ] || [ ! -e "$2/ready-1" ]; do
  i=$((i + 1)); [ $i -gt 300 ] && break
  sleep 0.1
done
kill -TERM $pid
wait $pid
echo launcher=$?
)";
  const RunResult r = run("sh " + script + " " + bin_dir() + "/loom " + dir);
  std::filesystem::remove_all(dir);
  EXPECT_NE(r.output.find("launcher=143"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("interrupted by signal 15 (SIGTERM); stopped 2 running rank(s)"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("got-term-0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("got-term-1"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 20.0);
}

TEST(Launcher, UsageErrorsAreOneLine) {
  RunResult r = run(loom_launch(0) + " --exec -- true");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("error: --nproc 0 must be >= 1"), std::string::npos) << r.output;
  r = run(bin_dir() + "/loom launch --nproc 2 --nnodes 2 --node-rank 0 --exec -- true");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("needs --master-port"), std::string::npos) << r.output;
  r = run(loom_launch(1) + " --exec -- /nonexistent/program");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("cannot execute '/nonexistent/program' for rank 0: No such file"),
            std::string::npos)
      << r.output;
}

}  // namespace
