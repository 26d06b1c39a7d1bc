// Per-rank scenarios for the multi-rank checkpoint tests, started by `loom launch --exec`:
//   save <folder> <layout> <step> <salt> [async]   save version <salt> of the test state
//   load <folder> <layout> <step> <salt>           load the newest usable checkpoint; it must be
//                                                  <step> and hold version <salt>
// <layout>: fsdp (flat shards over all ranks), hsdp (2 replicas of flat shards over half the
// ranks) or full (every rank holds everything). Exit code 0 = the scenario held on this rank.
#include <cstdio>
#include <string>

#include "loom/checkpoint/group.h"
#include "loom/checkpoint/loader.h"
#include "loom/checkpoint/saver.h"
#include "loom/checkpoint/tests/layouts.h"
#include "loom/core/error.h"
#include "loom/distributed/launch_env.h"
#include "loom/distributed/process_group.h"

namespace {
using namespace loom;
using namespace loom::checkpoint;
using namespace loom::checkpoint::testing;

Layout layout_named(const std::string& name, const std::vector<Spec>& specs, int world, int rank) {
  if (name == "fsdp") return fsdp_layout(specs, world, rank);
  if (name == "hsdp") {
    LOOM_REQUIRE(world % 2 == 0, "hsdp needs an even number of ranks, got ", world);
    return hsdp_layout(specs, world / 2, rank);
  }
  if (name == "full") return full_layout();
  fail("unknown layout '", name, "'; use fsdp, hsdp or full");
}

int run(int argc, char** argv) {
  LOOM_REQUIRE_USAGE(argc >= 6, "usage: loom_checkpoint_worker save|load <folder> <layout> <step> "
                     "<salt> [async]");
  const std::string mode = argv[1];
  const std::string folder = argv[2];
  const std::string layout_name = argv[3];
  const int64_t step = std::stoll(argv[4]);
  const int salt = std::stoi(argv[5]);
  const bool async = argc > 6 && std::string(argv[6]) == "async";

  auto env = distributed::detect_launch_env();
  auto world = distributed::init_distributed(env);
  const int rank = world->rank(), size = world->world_size();
  auto group = comm_group(world->world());
  const auto specs = training_specs();
  const Layout layout = layout_named(layout_name, specs, size, rank);

  if (mode == "save") {
    ShardedStateDict state = make_state(specs, layout, salt);
    state.rank_json()["rng"] = rank * 100 + salt;
    ShardedSaver saver(group);
    if (async) {
      saver.save_async(state, folder, step);
      for (const auto& [name, t] : state.tensors()) {
        for (const LocalChunk& c : t.chunks) c.data.fill_(0);  // training goes on
      }
      saver.wait();
    } else {
      saver.save(state, folder, step);
    }
    std::printf("rank %d: saved step %lld (%s, %s)\n", rank, static_cast<long long>(step),
                layout_name.c_str(), async ? "async" : "sync");
  } else if (mode == "load") {
    ShardedStateDict dest = make_state(specs, layout, -1);
    const auto result = load_latest(folder, dest, *group);
    LOOM_REQUIRE(result.has_value(), "rank ", rank, ": no checkpoint in '", folder, "'");
    LOOM_REQUIRE(result->step == step, "rank ", rank, ": loaded step ", result->step,
                 ", expected ", step);
    const std::string mismatch = check_state(specs, dest, salt);
    LOOM_REQUIRE(mismatch.empty(), "rank ", rank, ": ", mismatch);
    LOOM_REQUIRE(result->json.at("loader").at("offset") == 1000 + salt, "rank ", rank,
                 ": loader state not restored");
    if (rank < result->saved_world_size) {
      LOOM_REQUIRE(result->rank_json && result->rank_json->at("rng") == rank * 100 + salt,
                   "rank ", rank, ": per-rank state not restored");
    }
    std::printf("rank %d: loaded step %lld saved by %d ranks (%s layout over %d)\n", rank,
                static_cast<long long>(result->step), result->saved_world_size,
                layout_name.c_str(), size);
  } else {
    fail_usage("unknown mode '", mode, "'; use save or load");
  }
  std::fflush(stdout);
  world->shutdown();
  return 0;
}
}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return e.exit_code();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
