// ParallelDims validation, mesh rank arithmetic, and the comm layer without any network: exact
// byte accounting, the flight recorder ring, and single-rank groups; and which backend serves which
// device, with two ranks as two threads of this process.
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <functional>
#include <thread>

#include "loom/core/error.h"
#include "loom/distributed/comm.h"
#include "loom/distributed/device_mesh.h"
#include "loom/distributed/parallel_dims.h"
#include "loom/distributed/process_group.h"
#include "loom/testing/errors.h"

namespace loom::distributed {
namespace {

using loom::testing::usage_error_of;

// ---------------------------------------------------------------------------------------------
// ParallelDims

TEST(ParallelDims, ResolvesRemainingRanksIntoDpShard) {
  ParallelDims d({.dp_replicate = 1, .dp_shard = -1, .cp = 1, .tp = 2, .pp = 2}, 8);
  EXPECT_EQ(d.dp_shard(), 2);
  EXPECT_TRUE(d.dp_enabled());
  EXPECT_TRUE(d.fsdp_enabled());
  EXPECT_FALSE(d.dp_replicate_enabled());
  EXPECT_TRUE(d.tp_enabled());
  EXPECT_TRUE(d.pp_enabled());
  EXPECT_FALSE(d.cp_enabled());
  EXPECT_EQ(d.dp_degree(), 2);
  EXPECT_EQ(d.non_data_parallel_size(), 4);
  EXPECT_EQ(d.seq_len_divisor(), 4);
}

TEST(ParallelDims, CpAloneEnablesFsdp) {
  ParallelDims d({.dp_shard = 1, .cp = 2}, 2);
  EXPECT_FALSE(d.dp_enabled());
  EXPECT_TRUE(d.fsdp_enabled());
  EXPECT_TRUE(d.dp_cp_enabled());
}

TEST(ParallelDims, ValidationErrorsNameTheDegrees) {
  const std::string mismatch = usage_error_of(
      [] { ParallelDims({.dp_replicate = 2, .dp_shard = 3}, 8); });
  EXPECT_NE(mismatch.find("dp_replicate 2 x dp_shard 3 x cp 1 x tp 1 x pp 1 = 6 != world size 8"),
            std::string::npos)
      << mismatch;
  const std::string two_minus_one = usage_error_of([] { ParallelDims({.dp_shard = -1, .tp = -1}, 8); });
  EXPECT_NE(two_minus_one.find("is set for dp_shard, tp; only dp_shard may be -1"),
            std::string::npos)
      << two_minus_one;
  const std::string zero = usage_error_of([] { ParallelDims({.dp_shard = -1, .tp = 0}, 8); });
  EXPECT_NE(zero.find("tp = 0 is not a valid parallel degree"), std::string::npos) << zero;
  const std::string negative = usage_error_of([] { ParallelDims({.dp_shard = -2}, 8); });
  EXPECT_NE(negative.find("dp_shard = -2 is not a valid parallel degree"), std::string::npos)
      << negative;
  const std::string indivisible = usage_error_of([] { ParallelDims({.dp_shard = -1, .tp = 3}, 8); });
  EXPECT_NE(indivisible.find("dp_shard = -1 cannot fill world size 8"), std::string::npos)
      << indivisible;
  for (const auto& m : {mismatch, two_minus_one, zero, negative, indivisible}) {
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
}

TEST(ParallelDims, MeshKeepsEnabledDimsInTitanOrder) {
  ParallelDims d({.dp_replicate = 2, .dp_shard = 2, .cp = 1, .tp = 2, .pp = 2}, 16);
  const MeshLayout layout = d.mesh_layout();
  EXPECT_EQ(layout.dim_names(), (std::vector<std::string>{"pp", "dp_replicate", "dp_shard", "tp"}));
  EXPECT_EQ(layout.dim_sizes(), (std::vector<int>{2, 2, 2, 2}));
  const auto flat = d.flattened_dims();
  ASSERT_EQ(flat.size(), 3u);
  EXPECT_EQ(flat[0].first, "dp");
  EXPECT_EQ(flat[0].second, (std::vector<std::string>{"dp_replicate", "dp_shard"}));
  EXPECT_EQ(flat[1].first, "dp_shard_cp");
  EXPECT_EQ(flat[1].second, (std::vector<std::string>{"dp_shard"}));
  EXPECT_EQ(flat[2].first, "dp_cp");
  EXPECT_EQ(flat[2].second, (std::vector<std::string>{"dp_replicate", "dp_shard"}));

  ParallelDims only_tp({.dp_shard = 1, .tp = 4}, 4);
  EXPECT_TRUE(only_tp.flattened_dims().empty());
  EXPECT_EQ(only_tp.mesh_layout().dim_names(), (std::vector<std::string>{"tp"}));
}

TEST(ParallelDims, RankCoordinatesFollowTheMesh) {
  // pp2 x dp_shard2 x tp2, rank 6 = (pp 1, dp_shard 1, tp 0).
  ParallelDims d({.dp_shard = 2, .tp = 2, .pp = 2}, 8, 6);
  EXPECT_EQ(d.pp_rank(), 1);
  EXPECT_EQ(d.dp_shard_rank(), 1);
  EXPECT_EQ(d.dp_rank(), 1);
  EXPECT_EQ(d.tp_rank(), 0);
  EXPECT_EQ(d.cp_rank(), 0);
  EXPECT_EQ(d.dp_replicate_rank(), 0);
  // HSDP dp rank = replicate index x dp_shard + shard index.
  ParallelDims hsdp({.dp_replicate = 2, .dp_shard = 3}, 6, 4);
  EXPECT_EQ(hsdp.dp_replicate_rank(), 1);
  EXPECT_EQ(hsdp.dp_shard_rank(), 1);
  EXPECT_EQ(hsdp.dp_rank(), 4);
}

// ---------------------------------------------------------------------------------------------
// Mesh layout arithmetic

TEST(MeshLayout, EightRanksPp2Dp2Tp2) {
  MeshLayout m({"pp", "dp", "tp"}, {2, 2, 2});
  EXPECT_EQ(m.world_size(), 8);
  EXPECT_EQ(m.coordinates(5), (std::vector<int>{1, 0, 1}));
  EXPECT_EQ(m.rank_at({1, 1, 0}), 6);
  for (int r = 0; r < 8; ++r) EXPECT_EQ(m.rank_at(m.coordinates(r)), r);
  // tp is innermost: neighbouring ranks.
  EXPECT_EQ(m.all_groups({"tp"}),
            (std::vector<std::vector<int>>{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(m.all_groups({"dp"}),
            (std::vector<std::vector<int>>{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(m.all_groups({"pp"}),
            (std::vector<std::vector<int>>{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(m.group_ranks(5, {"dp", "tp"}), (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ(m.group_ranks(3, {"pp", "dp"}), (std::vector<int>{1, 3, 5, 7}));
  EXPECT_EQ(m.local_rank(7, {"pp", "dp"}), 3);
  EXPECT_EQ(m.local_rank(6, {"tp"}), 0);
  EXPECT_EQ(m.local_rank(6, {"pp"}), 1);
  EXPECT_EQ(m.all_groups({"pp", "dp", "tp"}), (std::vector<std::vector<int>>{{0, 1, 2, 3, 4, 5, 6, 7}}));
}

TEST(MeshLayout, BadDimsAreErrors) {
  MeshLayout m({"dp", "tp"}, {2, 2});
  auto message = [](const std::function<void()>& fn) {
    try {
      fn();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("<no error>");
  };
  EXPECT_NE(message([&] { m.size("cp"); }).find("no dim 'cp' (dims: dp, tp)"), std::string::npos);
  EXPECT_NE(message([&] { m.group_ranks(0, {"tp", "dp"}); }).find("in mesh order"),
            std::string::npos);
  EXPECT_NE(message([] { MeshLayout({"dp", "dp"}, {2, 2}); }).find("appears twice"),
            std::string::npos);
  EXPECT_NE(message([] { MeshLayout({"dp"}, {0}); }).find("has size 0"), std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// Accounting

TEST(CommAccounting, RingFormulasAreExact) {
  EXPECT_EQ(ring_wire_bytes(CommOp::kAllGather, 4096, 4), ByteCount::exact(3072));
  EXPECT_EQ(ring_wire_bytes(CommOp::kReduceScatter, 4096, 4), ByteCount::exact(3072));
  EXPECT_EQ(ring_wire_bytes(CommOp::kAllReduce, 4096, 4), ByteCount::exact(6144));
  // 2 x 2/3 x 10 = 40/3: not an integer, kept exact.
  const ByteCount third = ring_wire_bytes(CommOp::kAllReduce, 10, 3);
  EXPECT_EQ(third.numerator, 40);
  EXPECT_EQ(third.denominator, 3);
  EXPECT_EQ(ring_wire_bytes(CommOp::kBroadcast, 100, 8), ByteCount::exact(100));
  EXPECT_EQ(ring_wire_bytes(CommOp::kAllReduce, 100, 1), ByteCount{});
  EXPECT_EQ(ring_wire_bytes(CommOp::kBarrier, 0, 4), ByteCount{});

  ByteCount sum = ByteCount::fraction(40, 3);
  sum += ByteCount::fraction(5, 6);
  EXPECT_EQ(sum, ByteCount::fraction(85, 6));
  sum += ByteCount::fraction(5, 6);
  EXPECT_EQ(sum, ByteCount::exact(15));
  EXPECT_DOUBLE_EQ(ByteCount::fraction(3, 2).value(), 1.5);
}

TEST(CommAccounting, StatsAggregateByOpAndDim) {
  CommStats stats;
  stats.record(CommOp::kAllGather, "dp_shard", 1000, ByteCount::exact(500));
  stats.record(CommOp::kAllGather, "dp_shard", 1000, ByteCount::exact(500));
  stats.record(CommOp::kAllReduce, "dp_replicate", 10, ByteCount::fraction(40, 3));
  stats.record(CommOp::kAllReduce, "tp", 9, ByteCount::fraction(27, 2));
  const CommSnapshot s = stats.snapshot();
  EXPECT_EQ(s.get(CommOp::kAllGather, "dp_shard").calls, 2);
  EXPECT_EQ(s.get(CommOp::kAllGather, "dp_shard").payload_bytes, 2000);
  EXPECT_EQ(s.get(CommOp::kAllGather, "dp_shard").wire_bytes, ByteCount::exact(1000));
  EXPECT_EQ(s.get(CommOp::kReduceScatter, "dp_shard").calls, 0);
  EXPECT_EQ(s.total_for_dim("tp").payload_bytes, 9);
  EXPECT_EQ(s.total().wire_bytes, ByteCount::fraction(6000 + 80 + 81, 6));
  EXPECT_NE(s.format().find("all_gather@dp_shard calls=2"), std::string::npos) << s.format();
  stats.reset();
  EXPECT_TRUE(stats.snapshot().counters.empty());
}

TEST(FlightRecorder, KeepsTheLastNAndNamesPendingOnes) {
  FlightRecorder rec(3);
  std::vector<uint64_t> seqs;
  for (int i = 0; i < 5; ++i) {
    FlightRecord r;
    r.op = i == 4 ? CommOp::kReduceScatter : CommOp::kAllGather;
    r.group = "dp_shard[0,1]";
    r.group_seq = i + 1;
    r.input_shape = {8};
    r.output_shape = {16};
    r.dtype = at::kFloat;
    r.payload_bytes = 64;
    r.started_at = std::chrono::system_clock::now();
    r.started_steady = std::chrono::steady_clock::now();
    seqs.push_back(rec.start(r));
  }
  rec.finish(seqs[2], true);
  rec.finish(seqs[3], false);
  rec.finish(seqs[0], true);  // rotated out: ignored
  const auto records = rec.records();
  ASSERT_EQ(records.size(), 3u);
  EXPECT_EQ(records.front().seq, seqs[2]);
  EXPECT_EQ(records[0].state, FlightRecord::State::kCompleted);
  EXPECT_EQ(records[1].state, FlightRecord::State::kFailed);
  EXPECT_EQ(records[2].state, FlightRecord::State::kPending);
  ASSERT_TRUE(rec.oldest_pending().has_value());
  EXPECT_EQ(rec.oldest_pending()->op, CommOp::kReduceScatter);
  const std::string dump = rec.dump();
  EXPECT_NE(dump.find("reduce_scatter dp_shard[0,1] gseq=5 in=[8] out=[16] Float 64B"),
            std::string::npos) << dump;
  EXPECT_NE(dump.find("PENDING for"), std::string::npos) << dump;
  EXPECT_NE(dump.find("FAILED after"), std::string::npos) << dump;
  EXPECT_EQ(std::count(dump.begin(), dump.end(), '\n'), 3);
  rec.set_capacity(1);
  EXPECT_EQ(rec.records().size(), 1u);
}

// ---------------------------------------------------------------------------------------------
// A world of one rank: no network, every collective local, nothing counted.

TEST(SingleRank, WorldAndMeshNeedNoNetwork) {
  LaunchEnv env;  // single process
  auto dist = init_distributed(env, std::chrono::seconds(5));
  EXPECT_EQ(dist->world_size(), 1);
  EXPECT_FALSE(dist->store());
  ParallelDims dims({}, 1);
  EXPECT_EQ(dims.dp_shard(), 1);
  EXPECT_FALSE(dims.dp_enabled());
  DeviceMesh mesh = dims.build_mesh(dist);
  EXPECT_EQ(mesh.layout().ndim(), 0);
  EXPECT_FALSE(mesh.has("dp"));

  // An explicit 1-sized mesh dim still gets a (local) comm.
  DeviceMesh named(dist, {"dp_shard"}, {1});
  named.flatten({"dp_shard"}, "dp");
  EXPECT_EQ(named.size("dp"), 1);
  EXPECT_EQ(named.local_rank("dp_shard"), 0);

  comm_stats().reset();
  flight_recorder().clear();
  Comm& comm = *named.comm("dp");
  at::Tensor t = at::arange(6, at::kFloat);
  comm.all_reduce(t, ReduceOp::kAvg);
  EXPECT_TRUE(at::equal(t, at::arange(6, at::kFloat)));
  at::Tensor gathered = at::empty({6}, at::kFloat);
  comm.all_gather_into_tensor(gathered, t);
  EXPECT_TRUE(at::equal(gathered, t));
  at::Tensor scattered = at::empty({2, 3}, at::kFloat);
  comm.reduce_scatter_tensor(scattered, t);
  EXPECT_TRUE(at::equal(scattered.flatten(), t));
  at::Tensor a2a = at::empty({6}, at::kFloat);
  comm.all_to_all(a2a, t);
  EXPECT_TRUE(at::equal(a2a, t));
  comm.broadcast(t, 0);
  comm.barrier();
  WorkHandle work = comm.all_reduce_async(t);
  EXPECT_TRUE(work->isCompleted());
  EXPECT_TRUE(work->wait());
  EXPECT_TRUE(comm_stats().snapshot().counters.empty());
  EXPECT_TRUE(flight_recorder().records().empty());
  EXPECT_THROW(comm.send(t, 0), Error);
  EXPECT_THROW(comm.broadcast(t, 1), Error);
  dist->shutdown();
}

TEST(SingleRank, BadCollectiveArgumentsAreErrors) {
  auto comm = Comm::single("tp", 0);
  auto message = [](const std::function<void()>& fn) {
    try {
      fn();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("<no error>");
  };
  at::Tensor t = at::ones({4, 4}, at::kFloat);
  EXPECT_NE(message([&] { comm->all_reduce(t.t()); }).find("must be dense and contiguous"),
            std::string::npos);
  EXPECT_NE(message([&] { comm->all_reduce(at::ones({2}, at::kLong), ReduceOp::kAvg); })
                .find("avg needs a floating-point tensor"),
            std::string::npos);
  EXPECT_NE(message([&] { comm->all_gather_into_tensor(at::empty({3}), at::ones({4})); })
                .find("output has 3 elements, expected 1 x 4"),
            std::string::npos);
  EXPECT_NE(message([&] { comm->reduce_scatter_tensor(at::empty({4}, at::kDouble), at::ones({4})); })
                .find("output dtype Double differs from input dtype Float"),
            std::string::npos);
  EXPECT_NE(message([&] { comm->all_to_all(at::empty({4}), at::ones({4}), {3}, {4}); })
                .find("output split sizes sum to 3 but the tensor has 4 rows"),
            std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// Backends per device

TEST(Backends, KindFollowsTheDevice) {
  EXPECT_EQ(backend_kind_for(c10::Device(c10::kCPU)), BackendKind::kGloo);
#ifdef USE_C10D_NCCL
  EXPECT_EQ(backend_kind_for(c10::Device(c10::kCUDA, 0)), BackendKind::kNccl);
#else
  const std::string no_nccl = usage_error_of([] { (void)backend_kind_for(c10::Device(c10::kCUDA, 0)); });
  EXPECT_NE(no_nccl.find("NCCL, which is not compiled into this Loom build"), std::string::npos)
      << no_nccl;
  EXPECT_NE(usage_error_of([] {
              (void)new_nccl_backend(c10::make_intrusive<c10d::HashStore>(), 0, 1,
                                     std::chrono::seconds(5), c10::Device(c10::kCUDA, 0));
            }).find("NCCL is not compiled into this Loom build"),
            std::string::npos);
#endif
  const std::string meta = usage_error_of([] { (void)backend_kind_for(c10::Device(c10::kMeta)); });
  EXPECT_NE(meta.find("no process-group backend for tensors on meta"), std::string::npos) << meta;
  EXPECT_STREQ(to_string(BackendKind::kNccl), "nccl");
}

// Runs `rank_main(rank)` for ranks 0 and 1 on two threads; a rank's exception fails the test.
void run_two_ranks(const std::function<void(int)>& rank_main) {
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        rank_main(rank);
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int rank = 0; rank < 2; ++rank) EXPECT_EQ(errors[rank], "") << "rank " << rank;
}

// A world built for the CPU has Gloo groups and no device backend (a CUDA world adds NCCL per
// group, tests/cuda); sub-groups over the same ranks share the world's backend.
TEST(Backends, CpuWorldUsesGlooAlone) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  run_two_ranks([&](int rank) {
    LaunchEnv env;
    env.rank = env.local_rank = rank;
    env.world_size = env.local_world_size = 2;
    Distributed dist(env, std::chrono::seconds(60), c10::Device(c10::kCPU), store);
    EXPECT_EQ(dist.device(), c10::Device(c10::kCPU));
    EXPECT_EQ(dist.device_backend_kind(), BackendKind::kGloo);
    const Comm& world = *dist.world();
    EXPECT_EQ(world.backend()->getBackendName(), "gloo");
    EXPECT_FALSE(world.device_backend());
    EXPECT_TRUE(world.device().is_cpu());
    at::Tensor t = at::full({3}, rank + 1.0, at::kFloat);
    EXPECT_EQ(world.backend_for(t).get(), world.backend().get());
    dist.world()->all_reduce(t);
    EXPECT_TRUE(at::equal(t, at::full({3}, 3.0, at::kFloat)));
    auto dp = dist.new_group({0, 1}, "dp");
    EXPECT_EQ(dp->backend().get(), world.backend().get());
    dist.shutdown();
  });
}

// Each collective goes to the backend of its tensors' device: CPU tensors to the host backend,
// tensors on the group's device to the device backend, any other device is an error naming what
// the group serves. A second Gloo pair stands in for the device backend: routing needs no GPU.
TEST(Backends, CommRoutesEachTensorToItsDevicesBackend) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto gloo = [&](const std::string& prefix, int rank) {
    auto options = c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(60));
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    return c10::make_intrusive<c10d::ProcessGroupGloo>(
        c10::make_intrusive<c10d::PrefixStore>(prefix, store), rank, 2, options);
  };
  const c10::Device gpu(c10::kCUDA, 0);
  run_two_ranks([&](int rank) {
    c10::intrusive_ptr<c10d::Backend> host = gloo("host/", rank), device = gloo("device/", rank);
    Comm comm(host, "dp", {0, 1}, rank, device, gpu);
    EXPECT_EQ(comm.device(), gpu);
    EXPECT_EQ(comm.device_backend().get(), device.get());
    at::Tensor t = at::full({2}, rank + 1.0, at::kFloat);
    EXPECT_EQ(comm.backend_for(t).get(), host.get());
    comm.all_reduce(t);
    EXPECT_TRUE(at::equal(t, at::full({2}, 3.0, at::kFloat)));
    comm.barrier();  // the host backend's, whatever the device
    const at::Tensor meta = at::empty({2}, at::TensorOptions().device(c10::kMeta));
    std::string routed;
    try {
      comm.backend_for(meta);
    } catch (const Error& e) {
      routed = e.what();
    }
    EXPECT_NE(routed.find("dp[0,1]: a tensor on meta but this group serves the CPU and cuda:0"),
              std::string::npos)
        << routed;
    Comm cpu_only(host, "dp", {0, 1}, rank);
    EXPECT_THROW(cpu_only.all_reduce(meta.clone()), Error);
    EXPECT_THROW(Comm(host, "dp", {0, 1}, rank, device, c10::Device(c10::kCPU)), c10::Error);
  });
}

}  // namespace
}  // namespace loom::distributed
