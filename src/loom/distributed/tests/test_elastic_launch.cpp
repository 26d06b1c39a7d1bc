// Elastic mode of `loom launch` (launcher.h, elastic_protocol.h), through the real launcher: the
// survivors of a lost member keep running in a new generation, a replacement joins once the
// generation yields, a replacement lost before it joined is replaced, kExitElasticRestart restarts
// the whole group under a fresh generation 0, and the usage errors. The members are
// loom_distributed_worker's elastic scenarios (tests/worker/dist_worker.cpp), which talk to the
// launcher's store as elastic ranks do and log what they saw to member-<id>.log.
#include <gtest/gtest.h>

#include <fstream>
#include <regex>
#include <sstream>

#include "loom/distributed/elastic_protocol.h"
#include "loom/testing/run.h"

namespace {

using loom::testing::bin_dir;
using loom::testing::count_occurrences;
using loom::testing::RunResult;
using loom::testing::TempDir;

RunResult run_elastic(const std::string& command) { return loom::testing::run(command, 90); }

// `loom launch --nproc N <flags> --exec -- loom_distributed_worker <scenario>`, the members
// logging into `dir`.
std::string elastic_launch(const TempDir& dir, int nproc, const std::string& flags,
                           const std::string& scenario, const std::string& env = "") {
  return c10::str("env LOOM_TEST_ELASTIC_DIR=", dir.str(), " ", env, " ", bin_dir(),
                  "/loom launch --nproc ", nproc, " ", flags, " --exec -- ", bin_dir(),
                  "/loom_distributed_worker ", scenario);
}

std::string member_log(const TempDir& dir, int id) {
  std::ifstream in(dir.path() / c10::str("member-", id, ".log"));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool has_text(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// A survivor's log: started once (the same process throughout), saw `generations` in order, and
// finished in that process.
void expect_survivor(const TempDir& dir, int id, const std::vector<std::string>& generations) {
  const std::string log = member_log(dir, id);
  EXPECT_EQ(count_occurrences(log, "start pid="), 1) << "member " << id << ":\n" << log;
  std::smatch start, done;
  ASSERT_TRUE(std::regex_search(log, start, std::regex("start pid=([0-9]+) member=([0-9]+) "
                                                       "rank=([0-9]+) joiner=0 attempt=0")))
      << log;
  EXPECT_EQ(start[2].str(), std::to_string(id)) << log;
  EXPECT_EQ(start[3].str(), std::to_string(id)) << log;
  ASSERT_TRUE(std::regex_search(log, done, std::regex("done pid=([0-9]+)"))) << log;
  EXPECT_EQ(start[1].str(), done[1].str()) << log;
  size_t at = 0;
  for (const std::string& g : generations) {
    const size_t found = log.find(g, at);
    EXPECT_NE(found, std::string::npos) << "member " << id << " lacks '" << g << "' in order:\n"
                                        << log;
    if (found != std::string::npos) at = found;
  }
}

TEST(Launcher, ElasticSurvivorsKeepRunningAndAReplacementJoins) {
  TempDir dir("loom-elastic");
  const RunResult r =
      run_elastic(elastic_launch(dir, 3, "--elastic --max-restarts 1", "elastic_membership"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(std::regex_search(
      r.output, std::regex("(^|\n)loom launch: member 1 \\(local rank 1, pid [0-9]+\\) was killed "
                           "by signal 9 \\(SIGKILL\\); 2 member\\(s\\) continue in generation 1; "
                           "starting member 3 as its replacement \\(restart 1 of 1\\)\n")))
      << r.output;
  EXPECT_TRUE(std::regex_search(
      r.output, std::regex("(^|\n)loom launch: member 3 \\(local rank 1, pid [0-9]+\\) joined: 3 "
                           "member\\(s\\) in generation 2\n")))
      << r.output;
  EXPECT_FALSE(has_text(r.output, "loom launch: restart")) << r.output;
  EXPECT_FALSE(has_text(r.output, "error")) << r.output;
  for (int id : {0, 2}) {
    EXPECT_EQ(count_occurrences(r.output, c10::str("member ", id, ": elastic_membership ok\n")), 1)
        << r.output;
    expect_survivor(dir, id,
                    {"gen 0 members=[0,1,2] reason=\"start\"",
                     "gen 1 members=[0,2] reason=\"member 1 (pid ",
                     ") was killed by signal 9 (SIGKILL)\"",
                     "gen 2 members=[0,2,3] reason=\"member 3 joined\""});
  }
  EXPECT_TRUE(has_text(member_log(dir, 0), "yield 1")) << member_log(dir, 0);
  EXPECT_FALSE(has_text(member_log(dir, 2), "yield")) << member_log(dir, 2);
  // The lost member saw generation 0 only; its replacement has its rank, the same attempt.
  EXPECT_FALSE(has_text(member_log(dir, 1), "gen 1")) << member_log(dir, 1);
  const std::string joiner = member_log(dir, 3);
  EXPECT_TRUE(std::regex_search(joiner, std::regex("^start pid=[0-9]+ member=3 rank=1 joiner=1 "
                                                   "attempt=0\ngen 2 members=\\[0,2,3\\] ")))
      << joiner;
  EXPECT_TRUE(has_text(joiner, "done pid=")) << joiner;
  EXPECT_EQ(count_occurrences(r.output, "member 3: elastic_membership ok (joined)"), 1) << r.output;
  EXPECT_LT(r.seconds, 30.0) << r.output;
}

TEST(Launcher, ElasticWithoutRestartsTheSurvivorsContinueAlone) {
  TempDir dir("loom-elastic");
  const RunResult r = run_elastic(elastic_launch(dir, 3, "--elastic", "elastic_membership"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(std::regex_search(
      r.output, std::regex("(^|\n)loom launch: member 1 \\(local rank 1, pid [0-9]+\\) was killed "
                           "by signal 9 \\(SIGKILL\\); 2 member\\(s\\) continue in generation 1; "
                           "not replaced: no restarts are left \\(--max-restarts 0\\)\n")))
      << r.output;
  for (int id : {0, 2}) {
    expect_survivor(dir, id, {"gen 0 members=[0,1,2]", "gen 1 members=[0,2]"});
    EXPECT_FALSE(has_text(member_log(dir, id), "gen 2")) << member_log(dir, id);
  }
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "member-3.log"));
  EXPECT_FALSE(has_text(r.output, "joined")) << r.output;
}

TEST(Launcher, ElasticReplacementLostBeforeItJoinedIsReplaced) {
  TempDir dir("loom-elastic");
  const RunResult r = run_elastic(elastic_launch(dir, 3, "--elastic --max-restarts 2",
                                                 "elastic_membership",
                                                 "LOOM_TEST_ELASTIC_KILL_JOINER=1"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has_text(r.output, "continue in generation 1; starting member 3 as its replacement "
                                 "(restart 1 of 2)\n"))
      << r.output;
  EXPECT_TRUE(std::regex_search(
      r.output, std::regex("(^|\n)loom launch: replacement member 3 \\(local rank 1, pid [0-9]+\\) "
                           "was killed by signal 9 \\(SIGKILL\\) before it joined; starting "
                           "member 4 as its replacement \\(restart 2 of 2\\)\n")))
      << r.output;
  EXPECT_TRUE(std::regex_search(
      r.output, std::regex("(^|\n)loom launch: member 4 \\(local rank 1, pid [0-9]+\\) joined: 3 "
                           "member\\(s\\) in generation 2\n")))
      << r.output;
  for (int id : {0, 2}) {
    expect_survivor(dir, id, {"gen 0 members=[0,1,2]", "gen 1 members=[0,2]",
                              "gen 2 members=[0,2,4] reason=\"member 4 joined\""});
  }
  EXPECT_TRUE(has_text(member_log(dir, 4), "member=4 rank=1 joiner=1 attempt=0")) << member_log(dir, 4);
}

TEST(Launcher, ElasticDeathWhileAJoinIsPendingMovesTheRequestToTheNewGeneration) {
  TempDir dir("loom-elastic");
  const RunResult r =
      run_elastic(elastic_launch(dir, 3, "--elastic --max-restarts 2", "elastic_churn"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has_text(r.output, "continue in generation 1; starting member 3 as its replacement "
                                 "(restart 1 of 2)\n"))
      << r.output;
  EXPECT_TRUE(std::regex_search(
      r.output, std::regex("(^|\n)loom launch: member 2 \\(local rank 2, pid [0-9]+\\) was killed "
                           "by signal 9 \\(SIGKILL\\); 1 member\\(s\\) continue in generation 2; "
                           "starting member 4 as its replacement \\(restart 2 of 2\\)\n")))
      << r.output;
  EXPECT_TRUE(has_text(member_log(dir, 2), "saw the join request for generation 1"))
      << member_log(dir, 2);
  // Member 0 answered the request only once it named generation 2 (it held back before), and the
  // run ends with member 0 and both replacements, in id order.
  const std::string log0 = member_log(dir, 0);
  EXPECT_TRUE(has_text(log0, "gen 2 members=[0] reason=\"member 2 (pid ")) << log0;
  EXPECT_TRUE(has_text(log0, "yield 2\n")) << log0;
  EXPECT_FALSE(has_text(log0, "yield 1\n")) << log0;
  EXPECT_TRUE(std::regex_search(log0, std::regex("members=\\[0,3,4\\] reason=\"members? [34]"))) << log0;
  EXPECT_TRUE(has_text(log0, "done pid=")) << log0;
  for (int id : {3, 4}) {
    EXPECT_TRUE(has_text(member_log(dir, id), "done pid=")) << member_log(dir, id);
  }
  EXPECT_EQ(count_occurrences(r.output, "elastic_churn ok"), 3) << r.output;
}

TEST(Launcher, ElasticRestartExitRestartsTheWholeGroup) {
  TempDir dir("loom-elastic");
  const RunResult r =
      run_elastic(elastic_launch(dir, 2, "--elastic --max-restarts 1", "elastic_restart"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  for (int attempt : {0, 1}) {
    for (int id : {0, 1}) {
      EXPECT_EQ(count_occurrences(r.output, c10::str("member ", id, " attempt ", attempt,
                                                     ": generation 0 members=[0,1]\n")),
                1)
          << r.output;
    }
  }
  EXPECT_TRUE(std::regex_search(
      r.output, std::regex("(^|\n)loom launch: restart 1 of 1 \\(attempt 2 of 2\\) after attempt "
                           "1 failed: rank 1 \\(local rank 1, pid [0-9]+\\) exited with code 5; "
                           "stopped the other 1 running rank\\(s\\)\n")))
      << r.output;
  EXPECT_EQ(count_occurrences(r.output, "elastic_restart ok"), 2) << r.output;
  EXPECT_FALSE(has_text(r.output, "continue in generation")) << r.output;
  // Each member started twice (the whole group was restarted), the second time in attempt 1.
  for (int id : {0, 1}) {
    const std::string log = member_log(dir, id);
    EXPECT_EQ(count_occurrences(log, "start pid="), 2) << log;
    EXPECT_EQ(count_occurrences(log, " attempt=1\n"), 1) << log;
  }
}

TEST(Launcher, ElasticMembersGetTheirIdsAndNoInheritedJoinerFlag) {
  // A launcher started from inside an elastic rank does not pass LOOM_ELASTIC_JOINER on.
  const RunResult r = run_elastic(c10::str(
      "env ", loom::distributed::kElasticJoinerEnv, "=1 ", bin_dir(),
      "/loom launch --nproc 2 --elastic --exec -- sh -c 'echo \"rank=$RANK member=$",
      loom::distributed::kElasticMemberEnv, " joiner=${", loom::distributed::kElasticJoinerEnv,
      ":-unset}\"'"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count_occurrences(r.output, "rank=0 member=0 joiner=unset\n"), 1) << r.output;
  EXPECT_EQ(count_occurrences(r.output, "rank=1 member=1 joiner=unset\n"), 1) << r.output;
  // Without --elastic neither is set.
  const RunResult plain = run_elastic(c10::str(
      bin_dir(), "/loom launch --nproc 1 --exec -- sh -c 'echo \"member=${",
      loom::distributed::kElasticMemberEnv, ":-unset}\"'"));
  EXPECT_EQ(plain.exit_code, 0) << plain.output;
  EXPECT_TRUE(has_text(plain.output, "member=unset\n")) << plain.output;
}

TEST(Launcher, ElasticNeedsOneNode) {
  const RunResult r = run_elastic(c10::str(
      bin_dir(), "/loom launch --nproc 1 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 "
                 "--master-port 29500 --elastic --exec -- true"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(count_occurrences(r.output, "\n"), 1) << r.output;
  EXPECT_TRUE(has_text(r.output, "error: --elastic needs --nnodes 1")) << r.output;
}

TEST(Launcher, FaultToleranceInTheRanksConfigTurnsOnElasticMode) {
  // Refused for two nodes, which shows the launcher read fault_tolerance.enable from the
  // `train` command's configuration (and overrides).
  const std::string base = c10::str(
      bin_dir(), "/loom launch --nproc 1 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 "
                 "--master-port 29500 -- train --config ",
      loom::testing::source_path("configs/llama3_debug.toml"));
  const RunResult r = run_elastic(base + " --fault_tolerance.enable=true");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(count_occurrences(r.output, "\n"), 1) << r.output;
  EXPECT_TRUE(has_text(r.output, "error: the ranks' fault_tolerance.enable = true needs --nnodes 1"))
      << r.output;
}

}  // namespace
