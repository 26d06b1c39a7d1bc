#include "loom/train/elastic_run.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <filesystem>
#include <optional>
#include <set>
#include <cstdlib>
#include <memory>
#include <csignal>
#include <thread>

#include <unistd.h>

#include "loom/core/device.h"
#include "loom/core/error.h"
#include "loom/core/logging.h"
#include "loom/core/timer.h"
#include "loom/distributed/comm.h"
#include "loom/distributed/elastic_protocol.h"
#include "loom/distributed/launch_env.h"
#include "loom/distributed/parallel_dims.h"
#include "loom/distributed/process_group.h"
#include "loom/elastic/generation.h"
#include "loom/elastic/host_snapshot.h"
#include "loom/elastic/membership.h"
#include "loom/elastic/state_pieces.h"
#include "loom/train/trainer.h"

namespace loom::train {

namespace {

// Thrown at a step boundary when replacements wait to join: every trainer of the membership
// stops after the same step.
struct MembershipYields {};

elastic::BaseLayout base_layout(const JobConfig& config, const distributed::LaunchEnv& env) {
  const distributed::ParallelDegrees degrees = parallel::parallel_degrees(config.parallelism);
  const distributed::ParallelDims dims(degrees, env.world_size, 0);
  LOOM_REQUIRE_USAGE(dims.ep() == 1, "fault_tolerance.enable does not combine with expert parallel "
                     "(parallelism.expert_parallel_degree = ", dims.ep(), "): a smaller data-parallel "
                     "degree would not divide the experts; set fault_tolerance.enable = false");
  elastic::BaseLayout base;
  base.dp_replicate = dims.dp_replicate();
  base.dp_shard = dims.dp_shard();
  base.cp = dims.cp();
  base.tp = dims.tp();
  base.pp = dims.pp();
  base.local_batch_size = config.training.local_batch_size;
  base.global_batch_size = config.training.global_batch_size > 0
                               ? config.training.global_batch_size
                               : config.training.local_batch_size * dims.dp_degree();
  return base;
}

std::string join_ids(const std::vector<int64_t>& ids) {
  std::string out;
  for (int64_t id : ids) out += (out.empty() ? "" : ",") + std::to_string(id);
  return out;
}

// The host copies this rank reads for a restore: those of the old ranks o with o % world == rank
// (each region then has one reader), all at the newest step every old rank has a copy of.
std::vector<elastic::PieceSet> read_host_copies(const std::string& job, const elastic::GenerationLayout& previous,
                                                int rank, int world) {
  std::optional<int64_t> common;
  std::vector<std::set<int64_t>> steps(previous.trainers.size());
  for (size_t o = 0; o < previous.trainers.size(); ++o) {
    for (const auto& slot : elastic::read_snapshot_slots(elastic::HostSnapshot::path_of(job, previous.trainers[o]))) {
      if (slot.generation == previous.generation && slot.rank == static_cast<int64_t>(o)) steps[o].insert(slot.step);
    }
  }
  int64_t best = -1;
  for (int64_t candidate : steps.empty() ? std::set<int64_t>{} : steps[0]) {
    bool everywhere = true;
    for (const auto& s : steps) everywhere = everywhere && s.count(candidate) > 0;
    if (everywhere) best = std::max(best, candidate);
  }
  if (best < 0) {
    throw elastic::StateLost(c10::str("no step has a host copy from every rank of generation ", previous.generation,
                                      " (a rank's copy in /dev/shm is missing or was cut short)"));
  }
  std::vector<elastic::PieceSet> out;
  for (size_t o = 0; o < previous.trainers.size(); ++o) {
    if (static_cast<int>(o % static_cast<size_t>(world)) != rank) continue;
    auto set = elastic::read_snapshot(elastic::HostSnapshot::path_of(job, previous.trainers[o]), best);
    if (set) out.push_back(std::move(*set));
  }
  return out;
}

}  // namespace

void run_elastic_training(const JobConfig& config) {
  const distributed::LaunchEnv env = distributed::detect_launch_env();
  const char* member_env = std::getenv(distributed::kElasticMemberEnv);
  LOOM_REQUIRE_USAGE(env.agent_store && member_env != nullptr,
                     "fault_tolerance.enable = true needs `loom launch` (its store outlives every rank "
                     "and it keeps the membership); start the job with `loom launch`, or set "
                     "fault_tolerance.enable = false");
  const int64_t member = std::atoll(member_env);
  const bool joiner = std::getenv(distributed::kElasticJoinerEnv) != nullptr;
  const elastic::BaseLayout base = base_layout(config, env);
  const auto& ft = config.fault_tolerance;
  log::set_rank(static_cast<int>(member));

  c10d::TCPStoreOptions options;
  options.port = static_cast<uint16_t>(env.master_port);
  options.isServer = false;
  options.timeout = std::chrono::seconds(config.comm.timeout_seconds);
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::PrefixStore>(c10::str("/worker/attempt_", env.restart_count),
                                                   c10::make_intrusive<c10d::TCPStore>(env.master_addr, options));
  } catch (const c10::Error& e) {
    fail("fault tolerance: member ", member, " cannot reach the launcher's store at ", env.master_addr, ":",
         env.master_port, ": ", e.what_without_backtrace());
  }
  elastic::MembershipClient membership(store, member);
  distributed::set_collectives_interruptible(true);
  const int threads = distributed::intra_op_threads(env);
  const c10::Device device = select_device(config.training.device, env.local_rank, "training.device",
                                           config.comm.device_transport == distributed::DeviceTransport::kHost);

  // This member's host copy of its state (fault_tolerance.shard_copy = "host_memory"), and the
  // name every member of this launch finds the others' by.
  const std::string job = c10::str(env.master_port, "-", env.restart_count);
  elastic::HostSnapshot snapshot(job, member);
  const bool host_copies = ft.shard_copy == elastic::ShardCopy::kHostMemory;
  int64_t last_member = 0;
  elastic::GenerationLayout previous;
  elastic::PieceSet own;      // this member's pieces when its last membership ended
  elastic::PieceSet replica;  // its neighbour's, refreshed every step (FSDP shards without a replica)
  int64_t seen = -1;
  if (joiner) membership.set_ready();
  for (;;) {
    const elastic::Generation gen =
        membership.wait_newer(seen, std::chrono::seconds(ft.join_timeout_seconds));
    if (gen.number < 0) {
      log::info("fault tolerance: training finished; member ", member, " leaves");
      return;
    }
    seen = gen.number;
    // A replacement waits for the membership that takes it in.
    if (std::find(gen.members.begin(), gen.members.end(), member) == gen.members.end()) continue;
    // Every member of it alive and here, or a newer one.
    if (!membership.assemble(gen, std::chrono::seconds(config.comm.timeout_seconds))) continue;
    previous = membership.trained_layout();
    elastic::GenerationLayout layout = plan_generation(base, previous, gen.members);
    layout.generation = gen.number;
    for (int64_t m : gen.members) last_member = std::max(last_member, m);
    const int64_t replicas = layout.trainers.empty() ? 0 : layout.replicas();
    if (replicas == 0 && base.replicas() == 1) {
      // A model-parallel job without data parallelism: no other replica holds the lost rank's
      // pieces, and none is kept (copies are kept for FSDP shards only).
      throw Error(c10::str("fault tolerance: generation ", gen.number, " lost a rank of the only replica (",
                           gen.reason.empty() ? "members " + join_ids(gen.members) : gen.reason,
                           ") and no data-parallel replica holds its state; every rank restarts from the "
                           "newest checkpoint"),
                  distributed::kExitElasticRestart);
    }
    if (replicas < ft.min_replicas) {
      log::warn("fault tolerance: generation ", gen.number, " (members ", join_ids(gen.members), ") has ",
                replicas, " whole replica(s), fewer than fault_tolerance.min_replicas = ", ft.min_replicas,
                "; waiting for replacements");
      continue;
    }
    const auto at = std::find(layout.trainers.begin(), layout.trainers.end(), member);
    if (at == layout.trainers.end()) {
      log::info("fault tolerance: member ", member, " waits in generation ", gen.number,
                " (the rest of its model-parallel group is gone); ", layout.describe());
      continue;
    }
    const int rank = static_cast<int>(at - layout.trainers.begin());
    const int64_t g = gen.number;
    log::info("fault tolerance: member ", member, " (pid ", ::getpid(), ") is rank ", rank, " of ",
              layout.trainers.size(), " in generation ", g);
    distributed::LaunchEnv genv = env;
    genv.rank = rank;
    genv.world_size = static_cast<int>(layout.trainers.size());
    genv.local_world_size = genv.world_size;
    genv.node_rank = 0;
    if (rank == 0 && g > 0) {
      log::info("fault tolerance: generation ", g, ": ", gen.reason, "; members ", join_ids(gen.members),
                "; ", layout.describe());
    }
    JobConfig gconfig = config;
    gconfig.parallelism.data_parallel_replicate_degree = layout.dp_replicate;
    gconfig.parallelism.data_parallel_shard_degree = layout.dp_shard;
    gconfig.training.local_batch_size = layout.local_batch_size;
    gconfig.training.global_batch_size = base.global_batch_size;

    distributed::clear_collectives_interrupt();
    membership.watch(g);
    const Timer formed;
    std::shared_ptr<distributed::Distributed> dist;
    std::unique_ptr<Trainer> trainer;
    const bool replicate = layout.shards_need_copies() && !host_copies;
    const bool write_host_copy = layout.shards_need_copies() && host_copies;
    std::unique_ptr<elastic::ShardReplicator> replicator;
    auto refresh_replica = [&](Trainer& t) {
      if (write_host_copy) snapshot.write(t.training_state(), g, rank, t.applied_step());
      if (!replicate) return;
      if (!replicator) {
        auto ring = t.mesh().comm("dp_shard");
        std::vector<int64_t> ranks(ring->world_ranks().begin(), ring->world_ranks().end());
        replicator = std::make_unique<elastic::ShardReplicator>(ring, g, ranks);
      }
      replicator->replicate(t.training_state(), t.applied_step(), replica);
    };
    try {
      // Test-only fault: this member dies after assembling generation g, before its state moves.
      if (const char* f = std::getenv("LOOM_FAULT_KILL_FORMING"); f && std::atoll(f) == member && g > 0) {
        log::warn("LOOM_FAULT_KILL_FORMING: member ", member, " kills itself while generation ", g, " forms");
        std::raise(SIGKILL);
      }
      dist = distributed::init_distributed_over(
          genv, config.comm, device,
          elastic::interruptible_prefix_store(c10::str("loom/elastic/world/", g), store), threads);
      // Which process is which rank, for the membership event (and whoever checks that the
      // survivors kept theirs).
      torch::Tensor pid = torch::full({1}, static_cast<int64_t>(::getpid()), torch::kInt64);
      torch::Tensor pids = torch::empty({genv.world_size}, torch::kInt64);
      if (genv.world_size > 1) {
        dist->world()->all_gather_into_tensor(pids, pid);
      } else {
        pids.copy_(pid);
      }
      TrainerHooks hooks;
      hooks.world = dist;
      hooks.row_ledger = true;
      hooks.metrics_events.push_back({{"event", "membership"},
                                      {"generation", g},
                                      {"members", gen.members},
                                      {"trainers", layout.trainers},
                                      {"pids", std::vector<int64_t>(pids.data_ptr<int64_t>(),
                                                                    pids.data_ptr<int64_t>() + pids.numel())},
                                      {"lost", gen.lost},
                                      {"joined", gen.joined},
                                      {"reason", gen.number == 0 ? std::string("start") : gen.reason},
                                      {"dp_replicate", layout.dp_replicate},
                                      {"dp_shard", layout.dp_shard},
                                      {"local_batch_size", layout.local_batch_size}});
      if (g > 0) {
        hooks.restore_state = [&](checkpoint::ShardedStateDict& state) {
          std::vector<elastic::PieceSet> copies;
          if (host_copies && previous.shards_need_copies()) {
            // Every rank of the layout the state was trained in left a host copy; the newest step
            // all of them have is the state (a rank killed while writing left the one before).
            copies = read_host_copies(job, previous, rank, genv.world_size);
          }
          std::vector<const elastic::PieceSet*> held = {&own, &replica};
          if (!copies.empty() || (host_copies && previous.shards_need_copies())) {
            held.clear();
            for (const auto& c : copies) held.push_back(&c);
          }
          const int64_t step = elastic::restore_state(dist->world(), held, state);
          if (rank == 0) log::info("fault tolerance: state of step ", step, " re-sharded over ", genv.world_size,
                                   " rank(s) from the members' memory");
          return true;
        };
      }
      hooks.after_update = refresh_replica;
      hooks.at_step_boundary = [&](Trainer&) {
        torch::Tensor flag = torch::zeros({1}, torch::kInt64);
        if (rank == 0 && membership.join_requested(g)) flag.fill_(1);
        if (dist->world_size() > 1) dist->world()->all_reduce(flag, distributed::ReduceOp::kMax);
        if (flag.item<int64_t>() != 0) throw MembershipYields{};
      };
      trainer = std::make_unique<Trainer>(gconfig, hooks);
      refresh_replica(*trainer);  // the copies of this layout's shards before its first step
      if (rank == 0) membership.record_layout(g, layout);
      if (rank == 0 && g > 0) {
        log::info("fault tolerance: generation ", g, " formed and restored in ", formed.seconds(), " s");
      }
      trainer->train();
      if (rank == 0) {
        membership.set_done(trainer->step());
        std::error_code ec;  // every member's host copy: the run is over
        for (int64_t m = 0; m <= last_member; ++m) std::filesystem::remove(elastic::HostSnapshot::path_of(job, m), ec);
      }
      membership.stop_watch();
      trainer.reset();  // the closing barrier
      distributed::set_collectives_interruptible(false);
      return;
    } catch (const MembershipYields&) {
      own = elastic::take_pieces(trainer->training_state(), g, rank, trainer->applied_step());
      if (rank == 0) membership.yield(g, trainer->applied_step());
      log::info("fault tolerance: generation ", g, " stops after step ", trainer->applied_step(),
                " to take in replacements");
    } catch (const elastic::StateLost& e) {
      throw Error(c10::str("fault tolerance: ", e.what(), "; every rank restarts from the newest checkpoint"),
                  distributed::kExitElasticRestart);
    } catch (const std::exception& e) {
      // A lost peer: the launcher writes the next membership (its watch interrupted us, or a
      // collective with the dead rank failed first: give the launcher a moment).
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (membership.newest() <= g && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      if (membership.newest() <= g) throw;  // not a membership change: a real error
      if (trainer && !trainer->updating()) {
        own = elastic::take_pieces(trainer->training_state(), g, rank, trainer->applied_step());
      } else if (trainer) {
        own = elastic::PieceSet{};  // torn by an update cut short
      }
      log::warn("fault tolerance: generation ", g, " ends (", e.what(), ")");
    }
    membership.stop_watch();
    if (trainer) {
      trainer->abandon();
    } else if (dist) {
      dist->abandon();
    }
    trainer.reset();
  }
}

}  // namespace loom::train
