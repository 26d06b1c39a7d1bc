// Multi-rank test workers. A folder's worker executable (tests/worker/<folder>_worker.cpp) runs
// named scenarios on every rank started by `loom launch --nproc N --exec -- <worker> <scenario>`;
// its gtest side starts it and checks that every rank reported "rank R/N <scenario>: ok".
#pragma once
#include <gtest/gtest.h>

#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "loom/core/error.h"
#include "loom/distributed/launch_env.h"
#include "loom/distributed/process_group.h"
#include "loom/testing/run.h"

namespace loom::testing {

using Scenario = std::function<void(const std::shared_ptr<distributed::Comm>& world)>;

// main() of a worker: rendezvous (60 s timeout), one intra-op thread, then each scenario named on
// the command line, printing "rank R/N <name>: ok" after it. Returns 0, or 1 after printing
// "rank R: error: <what>" on stderr (an unknown scenario is such an error).
inline int worker_main(int argc, char** argv, const std::map<std::string, Scenario>& scenarios) {
  int rank = -1;
  try {
    const auto env = distributed::detect_launch_env();
    rank = env.rank;
    torch::set_num_threads(1);
    auto d = distributed::init_distributed(env, std::chrono::seconds(60));
    for (int i = 1; i < argc; ++i) {
      auto it = scenarios.find(argv[i]);
      LOOM_REQUIRE(it != scenarios.end(), "unknown scenario '", argv[i], "'");
      it->second(d->world());
      std::printf("rank %d/%d %s: ok\n", env.rank, env.world_size, argv[i]);
      std::fflush(stdout);
    }
    d->shutdown();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: error: %s\n", rank, e.what());
  }
  return 1;
}

// Runs `worker scenario` on `nproc` ranks and expects every rank's "ok"; prints the output (the
// workers print their measured differences).
inline void expect_workers(const std::string& worker, const std::string& scenario, int nproc,
                           int limit_seconds = 300) {
  const RunResult r = run(bin_dir() + "/loom launch --nproc " + std::to_string(nproc) + " --exec -- " + bin_dir() +
                              "/" + worker + " " + scenario,
                          limit_seconds);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  for (int rank = 0; rank < nproc; ++rank) {
    const std::string ok = "rank " + std::to_string(rank) + "/" + std::to_string(nproc) + " " + scenario + ": ok";
    EXPECT_NE(r.output.find(ok), std::string::npos) << r.output;
  }
  std::printf("%s", r.output.c_str());
}

}  // namespace loom::testing
