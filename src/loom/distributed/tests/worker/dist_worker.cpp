// Per-rank scenarios for the dist multi-rank tests. Started as
//   loom launch --nproc N [--max-restarts R] --exec -- loom_distributed_worker <scenario> [<scenario>...]
// Every rank checks its own results; a failed check exits 1 with one line naming the rank and the
// mismatch. On success each rank prints "rank R/W <scenario>: ok".
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <thread>

#include <unistd.h>

#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "loom/core/error.h"
#include "loom/core/error_report.h"
#include "loom/distributed/comm.h"
#include "loom/distributed/elastic_protocol.h"
#include "loom/distributed/shm_collectives.h"
#include "loom/distributed/device_mesh.h"
#include "loom/distributed/launch_env.h"
#include "loom/distributed/parallel_dims.h"
#include "loom/distributed/process_group.h"

namespace {

using namespace loom::distributed;

void expect_equal(const at::Tensor& actual, const at::Tensor& expected, const std::string& what) {
  LOOM_REQUIRE(actual.sizes() == expected.sizes() && at::equal(actual, expected), what,
               ": got ", actual.to(at::kDouble).flatten(), " expected ",
               expected.to(at::kDouble).flatten());
}

// rank r contributes (r + 1) * [1, 2, ..., n]
at::Tensor ramp(int64_t n, int r, at::ScalarType dtype) {
  return (at::arange(1, n + 1, at::kDouble) * (r + 1)).to(dtype);
}

// Whether this launch asked for shared-memory collectives (LOOM_TEST_SHARED_MEMORY=0 turns them
// off, so the same scenarios also run over Gloo).
bool shared_memory_requested() {
  const char* v = std::getenv("LOOM_TEST_SHARED_MEMORY");
  return v == nullptr || std::string(v) != "0";
}

void scenario_all_reduce(const std::shared_ptr<Distributed>& dist) {
  Comm& world = *dist->world();
  LOOM_REQUIRE(world.uses_shared_memory() == shared_memory_requested(), "the world group ",
               world.uses_shared_memory() ? "uses" : "does not use", " shared memory");
  const int w = world.size(), r = world.rank();
  const double sum_factor = w * (w + 1) / 2.0;
  for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kLong, at::kInt}) {
    at::Tensor t = ramp(6, r, dtype);
    world.all_reduce(t);
    expect_equal(t, (at::arange(1, 7, at::kDouble) * sum_factor).to(dtype),
                 c10::str("all_reduce sum ", dtype));
    t = ramp(6, r, dtype);
    world.all_reduce(t, ReduceOp::kMax);
    expect_equal(t, ramp(6, w - 1, dtype), c10::str("all_reduce max ", dtype));
  }
  at::Tensor avg = ramp(5, r, at::kFloat).reshape({5, 1});
  world.all_reduce(avg, ReduceOp::kAvg);
  expect_equal(avg, (at::arange(1, 6, at::kDouble) * (sum_factor / w)).to(at::kFloat).reshape({5, 1}),
               "all_reduce avg");
  // Async: the result is in place once wait() returns, and the work then reports completion.
  at::Tensor a = ramp(4, r, at::kFloat);
  WorkHandle work = world.all_reduce_async(a, ReduceOp::kAvg);
  work->wait();
  LOOM_REQUIRE(work->isCompleted() && work->isSuccess(), "async all_reduce not completed after wait");
  expect_equal(a, (at::arange(1, 5, at::kDouble) * (sum_factor / w)).to(at::kFloat),
               "async all_reduce avg");
}

void scenario_all_gather(const std::shared_ptr<Distributed>& dist) {
  Comm& world = *dist->world();
  const int w = world.size(), r = world.rank();
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kLong}) {
    at::Tensor in = (at::arange(3, at::kDouble) + 10 * r).to(dtype);
    at::Tensor out = at::empty({3 * w}, in.options());
    world.all_gather_into_tensor(out, in);
    at::Tensor expected = (at::arange(3, at::kDouble).repeat({w}) +
                           10 * at::arange(w, at::kDouble).repeat_interleave(3)).to(dtype);
    expect_equal(out, expected, c10::str("all_gather ", dtype));
  }
  // 2-D shards gathered along dim 0, asynchronously.
  at::Tensor in2 = at::full({2, 3}, static_cast<double>(r), at::kFloat);
  at::Tensor out2 = at::empty({2 * w, 3}, at::kFloat);
  WorkHandle work = world.all_gather_into_tensor_async(out2, in2);
  work->wait();
  LOOM_REQUIRE(work->isCompleted(), "async all_gather not completed after wait");
  expect_equal(out2, at::arange(w, at::kFloat).repeat_interleave(2).unsqueeze(1).expand({2 * w, 3}),
               "all_gather 2-D");
}

void scenario_reduce_scatter(const std::shared_ptr<Distributed>& dist) {
  Comm& world = *dist->world();
  const int w = world.size(), r = world.rank();
  const double sum_factor = w * (w + 1) / 2.0;
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kLong}) {
    at::Tensor in = ramp(4 * w, r, dtype);
    at::Tensor out = at::empty({4}, in.options());
    world.reduce_scatter_tensor(out, in);
    at::Tensor full = at::arange(1, 4 * w + 1, at::kDouble) * sum_factor;
    expect_equal(out, full.narrow(0, 4 * r, 4).to(dtype), c10::str("reduce_scatter sum ", dtype));
    world.reduce_scatter_tensor(out, in, ReduceOp::kMax);
    expect_equal(out, ramp(4 * w, w - 1, dtype).narrow(0, 4 * r, 4),
                 c10::str("reduce_scatter max ", dtype));
  }
  at::Tensor in = ramp(2 * w, r, at::kFloat).reshape({w, 2});
  at::Tensor out = at::empty({1, 2}, at::kFloat);
  WorkHandle work = world.reduce_scatter_tensor_async(out, in, ReduceOp::kAvg);
  work->wait();
  LOOM_REQUIRE(work->isCompleted(), "async reduce_scatter not completed after wait");
  expect_equal(out, (at::arange(1, 2 * w + 1, at::kDouble) * (sum_factor / w))
                        .narrow(0, 2 * r, 2).to(at::kFloat).reshape({1, 2}),
               "reduce_scatter avg");
}

void scenario_broadcast(const std::shared_ptr<Distributed>& dist) {
  Comm& world = *dist->world();
  const int w = world.size(), r = world.rank();
  for (int root : {0, w - 1}) {
    at::Tensor t = r == root ? at::arange(8, at::kFloat) * (root + 1) : at::zeros({8}, at::kFloat);
    world.broadcast(t, root);
    expect_equal(t, at::arange(8, at::kFloat) * (root + 1), c10::str("broadcast from ", root));
  }
  at::Tensor t = r == 1 ? at::full({2, 2}, 7, at::kLong) : at::zeros({2, 2}, at::kLong);
  world.broadcast_async(t, 1)->wait();
  expect_equal(t, at::full({2, 2}, 7, at::kLong), "async broadcast");
}

void scenario_all_to_all(const std::shared_ptr<Distributed>& dist) {
  Comm& world = *dist->world();
  const int w = world.size(), r = world.rank();
  // Even: rank r sends rows {100r + j, 100r + j} to rank j.
  at::Tensor in = (100 * r + at::arange(w, at::kFloat)).repeat_interleave(2).reshape({w, 2});
  at::Tensor out = at::empty({w, 2}, at::kFloat);
  world.all_to_all(out, in);
  expect_equal(out, (100 * at::arange(w, at::kFloat) + r).repeat_interleave(2).reshape({w, 2}),
               "all_to_all even");
  // Uneven: rank r sends r + j + 1 rows of value 100r + j to rank j.
  std::vector<int64_t> in_splits, out_splits;
  std::vector<at::Tensor> in_parts, expected_parts;
  for (int j = 0; j < w; ++j) {
    in_splits.push_back(r + j + 1);
    out_splits.push_back(j + r + 1);
    in_parts.push_back(at::full({r + j + 1, 3}, 100 * r + j, at::kLong));
    expected_parts.push_back(at::full({j + r + 1, 3}, 100 * j + r, at::kLong));
  }
  at::Tensor uneven_in = at::cat(in_parts);
  at::Tensor expected = at::cat(expected_parts);
  at::Tensor uneven_out = at::empty_like(expected);
  world.all_to_all_async(uneven_out, uneven_in, out_splits, in_splits)->wait();
  expect_equal(uneven_out, expected, "all_to_all uneven");
}

void scenario_send_recv(const std::shared_ptr<Distributed>& dist) {
  Comm& world = *dist->world();
  const int w = world.size(), r = world.rank();
  at::Tensor mine = at::full({5}, r, at::kFloat);
  at::Tensor from_prev = at::empty({5}, at::kFloat);
  WorkHandle sent = world.send_async(mine, (r + 1) % w, /*tag=*/7);
  world.recv(from_prev, (r + w - 1) % w, /*tag=*/7);
  sent->wait();
  expect_equal(from_prev, at::full({5}, (r + w - 1) % w, at::kFloat), "ring send/recv");
}

// Checks every named dim of `mesh` against the layout arithmetic: group membership, local rank, and
// an all_reduce / all_gather over the group.
void check_mesh_dims(const DeviceMesh& mesh, const std::vector<std::string>& names,
                     const std::map<std::string, std::vector<int>>& expected_groups) {
  const int r = mesh.rank();
  for (const auto& name : names) {
    const std::vector<int> expected = expected_groups.at(name);
    Comm& comm = *mesh.comm(name);
    LOOM_REQUIRE(mesh.group_ranks(name) == expected, "dim ", name, " group ", comm.describe(),
                 " differs from the expected layout");
    const int local = static_cast<int>(std::find(expected.begin(), expected.end(), r) - expected.begin());
    LOOM_REQUIRE(mesh.local_rank(name) == local && mesh.size(name) == static_cast<int>(expected.size()),
                 "dim ", name, ": local rank ", mesh.local_rank(name), "/", mesh.size(name),
                 " expected ", local, "/", expected.size());
    at::Tensor t = at::full({3}, r, at::kLong);
    comm.all_reduce(t);
    int64_t sum = 0;
    for (int m : expected) sum += m;
    expect_equal(t, at::full({3}, sum, at::kLong), c10::str("all_reduce over ", name));
    at::Tensor gathered = at::empty({static_cast<int64_t>(expected.size())}, at::kLong);
    comm.all_gather_into_tensor(gathered, at::full({1}, r, at::kLong));
    expect_equal(gathered, at::tensor(std::vector<int64_t>(expected.begin(), expected.end())),
                 c10::str("all_gather over ", name));
  }
}

void scenario_mesh_2x2(const std::shared_ptr<Distributed>& dist) {
  const int r = dist->rank();
  LOOM_REQUIRE(dist->world_size() == 4, "mesh_2x2 needs 4 ranks");
  // HSDP: dp_replicate=2 x dp_shard=2 -> dims [dp_replicate, dp_shard], flattened dp, dp_shard_cp,
  // dp_cp. Row-major: dp_shard groups {0,1},{2,3}; dp_replicate groups {0,2},{1,3}.
  ParallelDims hsdp({.dp_replicate = 2, .dp_shard = 2}, 4, r);
  DeviceMesh mesh = hsdp.build_mesh(dist);
  const std::vector<int> inner = r < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3};
  const std::vector<int> outer = r % 2 == 0 ? std::vector<int>{0, 2} : std::vector<int>{1, 3};
  check_mesh_dims(mesh, {"dp_replicate", "dp_shard", "dp", "dp_shard_cp", "dp_cp"},
                  {{"dp_replicate", outer}, {"dp_shard", inner}, {"dp", {0, 1, 2, 3}},
                   {"dp_shard_cp", inner}, {"dp_cp", {0, 1, 2, 3}}});
  LOOM_REQUIRE(hsdp.dp_rank() == r && mesh.local_rank("dp") == r, "dp rank of ", r, " is ",
               hsdp.dp_rank());
  // FSDP x TP: dims [dp_shard, tp]; tp is innermost (neighbouring ranks), reusing the groups above.
  ParallelDims fsdp_tp({.dp_shard = -1, .tp = 2}, 4, r);
  DeviceMesh mesh2 = fsdp_tp.build_mesh(dist);
  check_mesh_dims(mesh2, {"dp_shard", "tp", "dp", "dp_shard_cp", "dp_cp"},
                  {{"dp_shard", outer}, {"tp", inner}, {"dp", outer}, {"dp_shard_cp", outer},
                   {"dp_cp", outer}});
  LOOM_REQUIRE(fsdp_tp.tp_rank() == r % 2 && fsdp_tp.dp_rank() == r / 2, "fsdp x tp ranks of ", r);
  // A reduce-scatter on one dim then an all-gather on the other compose like the real layouts do.
  at::Tensor grad = at::arange(4, at::kFloat) + 10 * r;
  at::Tensor shard = at::empty({2}, at::kFloat);
  mesh.comm("dp_shard")->reduce_scatter_tensor(shard, grad);
  mesh.comm("dp_replicate")->all_reduce(shard, ReduceOp::kAvg);
  at::Tensor full = at::empty({4}, at::kFloat);
  mesh.comm("dp_shard")->all_gather_into_tensor(full, shard);
  // sum over dp_shard then mean over dp_replicate == mean over all 4 ranks x 2.
  expect_equal(full, (at::arange(4, at::kFloat) * 2 + 10 * (0 + 1 + 2 + 3) / 2.0), "HSDP round trip");
}

void scenario_accounting(const std::shared_ptr<Distributed>& dist) {
  Comm& world = *dist->world();
  const int64_t w = world.size();
  comm_stats().reset();
  flight_recorder().clear();
  // int8 payloads keep byte counts small and make the all-reduce fraction non-integral.
  at::Tensor ar = at::ones({5}, at::kChar);
  world.all_reduce(ar);
  world.all_reduce(ar);
  at::Tensor ag_in = at::ones({3}, at::kFloat);
  at::Tensor ag_out = at::empty({3 * w}, at::kFloat);
  world.all_gather_into_tensor(ag_out, ag_in);
  at::Tensor rs_in = at::ones({5 * w}, at::kFloat);
  at::Tensor rs_out = at::empty({5}, at::kFloat);
  world.reduce_scatter_tensor(rs_out, rs_in);
  at::Tensor bc = at::ones({7}, at::kDouble);
  world.broadcast(bc, 0);
  at::Tensor a2a_in = at::ones({2 * w, 1}, at::kLong);
  at::Tensor a2a_out = at::empty({2 * w, 1}, at::kLong);
  world.all_to_all(a2a_out, a2a_in);
  world.barrier();
  const CommSnapshot s = comm_stats().snapshot();

  auto expect_counter = [&](CommOp op, int64_t calls, int64_t payload, ByteCount wire) {
    const CommCounter c = s.get(op, "world");
    LOOM_REQUIRE(c.calls == calls && c.payload_bytes == payload && c.wire_bytes == wire,
                 to_string(op), "@world: calls=", c.calls, " payload=", c.payload_bytes, " wire=",
                 c.wire_bytes.numerator, "/", c.wire_bytes.denominator, "; expected calls=", calls,
                 " payload=", payload, " wire=", wire.numerator, "/", wire.denominator);
  };
  // all_reduce: 2(W-1)/W x 5 bytes per call, two calls -> 20(W-1)/W.
  expect_counter(CommOp::kAllReduce, 2, 10, ByteCount::fraction(20 * (w - 1), w));
  // all_gather: (W-1)/W x full size (12W bytes) = 12(W-1).
  expect_counter(CommOp::kAllGather, 1, 12 * w, ByteCount::exact(12 * (w - 1)));
  // reduce_scatter: (W-1)/W x input size (20W bytes) = 20(W-1).
  expect_counter(CommOp::kReduceScatter, 1, 20 * w, ByteCount::exact(20 * (w - 1)));
  expect_counter(CommOp::kBroadcast, 1, 56, ByteCount::exact(56));
  // all_to_all: everything but the local 2 rows of 8 bytes.
  expect_counter(CommOp::kAllToAll, 1, 16 * w, ByteCount::exact(16 * (w - 1)));
  expect_counter(CommOp::kBarrier, 1, 0, ByteCount{});
  const CommCounter total = s.total();
  LOOM_REQUIRE(total.calls == 7, "total calls ", total.calls, " expected 7");
  // Exact rational sum of the per-op wire bytes.
  ByteCount expected_total = ByteCount::fraction(20 * (w - 1), w);
  expected_total += ByteCount::exact(12 * (w - 1) + 20 * (w - 1) + 56 + 16 * (w - 1));
  LOOM_REQUIRE(total.wire_bytes == expected_total, "total wire ", total.wire_bytes.numerator, "/",
               total.wire_bytes.denominator);
  comm_stats().reset();
  LOOM_REQUIRE(comm_stats().snapshot().counters.empty(), "reset left counters behind");

  // Every collective above is in the flight recorder, completed, in issue order.
  const auto records = flight_recorder().records();
  LOOM_REQUIRE(records.size() == 7, "flight recorder holds ", records.size(), " records, expected 7");
  const CommOp order[] = {CommOp::kAllReduce, CommOp::kAllReduce, CommOp::kAllGather,
                          CommOp::kReduceScatter, CommOp::kBroadcast, CommOp::kAllToAll,
                          CommOp::kBarrier};
  for (size_t i = 0; i < records.size(); ++i) {
    LOOM_REQUIRE(records[i].op == order[i] && records[i].state == FlightRecord::State::kCompleted,
                 "flight record ", i, " is ", to_string(records[i].op), " state ",
                 static_cast<int>(records[i].state));
    LOOM_REQUIRE(i == 0 || records[i].group_seq == records[i - 1].group_seq + 1,
                 "group sequence numbers are not consecutive");
  }
  LOOM_REQUIRE(records[2].input_shape == std::vector<int64_t>{3} &&
                   records[2].output_shape == std::vector<int64_t>{3 * w} &&
                   records[2].dtype == at::kFloat,
               "all_gather record shapes/dtype wrong");
}

void scenario_flight_recorder(const std::shared_ptr<Distributed>& dist) {
  Comm& world = *dist->world();
  LOOM_REQUIRE(world.size() == 2, "flight_recorder needs 2 ranks");
  flight_recorder().clear();
  flight_recorder().set_capacity(4);
  at::Tensor t = at::zeros({3}, at::kFloat);
  at::Tensor go = at::zeros({1}, at::kFloat);
  if (world.rank() == 0) {
    // Rank 1 sends only after it hears from us, so this recv is provably pending for now.
    WorkHandle pending = world.recv_async(t, 1);
    const auto oldest = flight_recorder().oldest_pending();
    LOOM_REQUIRE(oldest && oldest->op == CommOp::kRecv && oldest->peer == 1,
                 "pending recv not reported by the flight recorder");
    const std::string dump = flight_recorder().dump();
    LOOM_REQUIRE(dump.find("recv world[0,1]") != std::string::npos &&
                     dump.find("PENDING") != std::string::npos,
                 "dump does not name the pending recv: ", dump);
    LOOM_REQUIRE(!pending->isCompleted(), "recv completed before its send");
    world.send(go, 1);
    pending->wait();
    expect_equal(t, at::full({3}, 5.0, at::kFloat), "recv payload");
    LOOM_REQUIRE(!flight_recorder().oldest_pending(), "completed recv still pending");
  } else {
    world.recv(go, 0);
    world.send(at::full({3}, 5.0, at::kFloat), 0);
  }
  // The ring keeps only the newest `capacity` records.
  for (int i = 0; i < 6; ++i) world.barrier();
  const auto records = flight_recorder().records();
  LOOM_REQUIRE(records.size() == 4 && records.back().op == CommOp::kBarrier,
               "ring buffer holds ", records.size(), " records, expected the last 4");
  std::printf("rank %d flight recorder:\n%s", world.rank(), flight_recorder().dump().c_str());
}

// Rank 1 fails; the others block in a collective that can never complete. The launcher must
// report rank 1 and stop the rest.
void scenario_fail_rank1(const std::shared_ptr<Distributed>& dist) {
  Comm& world = *dist->world();
  world.barrier();
  if (world.rank() == 1) {
    std::printf("rank 1 exiting with code 3\n");
    std::fflush(stdout);
    std::_Exit(3);
  }
  at::Tensor t = at::ones({4}, at::kFloat);
  try {
    world.all_reduce(t);
  } catch (const std::exception&) {
    // Gloo may notice the closed connection; a hung rank would not, so stay blocked like one.
  }
  std::this_thread::sleep_for(std::chrono::hours(1));
}

// Which attempt of a `loom launch --max-restarts` job this is (0 = the first).
int restart_count() {
  const char* v = std::getenv("LOOM_RESTART_COUNT");
  LOOM_REQUIRE(v != nullptr, "LOOM_RESTART_COUNT is not set; run this scenario under loom launch");
  return std::atoi(v);
}

// After a barrier, rank 1 SIGKILLs itself on the first attempt only; rank 0 is then inside an
// all_reduce that can never complete. A restarted attempt (fresh rendezvous) must succeed.
void scenario_die_once(const std::shared_ptr<Distributed>& dist) {
  Comm& world = *dist->world();
  const int attempt = restart_count();
  world.barrier();
  if (attempt == 0 && world.rank() == 1) {
    std::printf("rank 1 attempt 0: killing itself\n");
    std::fflush(stdout);
    raise(SIGKILL);
  }
  at::Tensor t = at::full({4}, world.rank() + 1, at::kFloat);
  world.all_reduce(t);
  expect_equal(t, at::full({4}, world.size() * (world.size() + 1) / 2, at::kFloat),
               "all_reduce after the restart");
  std::printf("rank %d attempt %d: all_reduce ok\n", world.rank(), attempt);
}

// With a 2 s collective timeout, rank 1 never joins rank 0's all_reduce on the first attempt (it
// sleeps); rank 0's watchdog must name the all_reduce and end the process with code 124. Later
// attempts run the all_reduce normally.
void scenario_stall_once(const std::shared_ptr<Distributed>& dist) {
  Comm& world = *dist->world();
  const int attempt = restart_count();
  world.barrier();  // under the generous start-up timeout: both ranks are up
  dist->set_timeout(std::chrono::seconds(2));
  if (attempt == 0 && world.rank() == 1) {
    std::printf("rank 1 attempt 0: not joining the all_reduce\n");
    std::fflush(stdout);
    std::this_thread::sleep_for(std::chrono::hours(1));
  }
  at::Tensor t = at::ones({4}, at::kFloat);
  world.all_reduce(t);
  expect_equal(t, at::full({4}, world.size(), at::kFloat), "all_reduce");
  std::printf("rank %d attempt %d: all_reduce ok\n", world.rank(), attempt);
}

// Issue 22, item 6: rank 1 SIGKILLs itself; rank 0's all_reduce then fails with the transport's
// secondary error, which it reports (LOOM_ERROR_FILE) before lingering with SIGTERM ignored, as a
// rank slow to exit would. The launcher must name rank 1, which failed first, not rank 0's echo.
void scenario_killed_peer(const std::shared_ptr<Distributed>& dist) {
  Comm& world = *dist->world();
  world.barrier();
  if (world.rank() == 1) raise(SIGKILL);
  signal(SIGTERM, SIG_IGN);
  at::Tensor t = at::ones({4}, at::kFloat);
  try {
    world.all_reduce(t);
  } catch (...) {
    loom::report_error(loom::describe_exception(std::current_exception()));
    std::this_thread::sleep_for(std::chrono::hours(1));
  }
  loom::fail("all_reduce with a killed peer succeeded");
}

// Issue 22, item 11: rank 1 stops itself (SIGSTOP) before an all_reduce with a 2 s timeout; rank
// 0's watchdog ends it with code 124. The launcher must name the stopped rank as the cause.
void scenario_stopped_peer(const std::shared_ptr<Distributed>& dist) {
  Comm& world = *dist->world();
  world.barrier();
  dist->set_timeout(std::chrono::seconds(2));
  if (world.rank() == 1) raise(SIGSTOP);
  at::Tensor t = at::ones({4}, at::kFloat);
  world.all_reduce(t);
  loom::fail("all_reduce with a stopped peer succeeded");
}

// A peer that has exited breaks the group: the collective's error names it (op, group, sequence)
// instead of only quoting the transport.
void scenario_peer_exit(const std::shared_ptr<Distributed>& dist) {
  Comm& world = *dist->world();
  LOOM_REQUIRE(world.size() == 2, "peer_exit needs 2 ranks");
  world.barrier();
  if (world.rank() == 1) {
    std::printf("rank 1/2 peer_exit: ok\n");
    std::fflush(stdout);
    std::_Exit(0);
  }
  at::Tensor t = at::ones({4}, at::kFloat);
  try {
    world.all_reduce(t);
  } catch (const loom::Error& e) {
    const std::string message = e.what();
    LOOM_REQUIRE(message.rfind("all_reduce world[0,1] gseq=2 in=[4] out=[4] Float 16B failed on "
                               "group rank 0: ", 0) == 0,
                 "the error does not name the collective first: ", message);
    const auto record = flight_recorder().records().back();
    LOOM_REQUIRE(record.op == CommOp::kAllReduce && record.state == FlightRecord::State::kFailed,
                 "the failed all_reduce is not recorded as failed");
    std::printf("rank 0 peer_exit error: %s\n", message.c_str());
    std::printf("rank 0/2 peer_exit: ok\n");
    std::fflush(stdout);
    std::_Exit(0);  // the world group is broken: no shutdown barrier
  }
  loom::fail("all_reduce with an exited peer succeeded");
}

// An async collective whose result is ready but not yet waited for is not pending: the watchdog
// must leave the rank alone even when the wait comes long after the timeout.
void scenario_unwaited_async(const std::shared_ptr<Distributed>& dist) {
  Comm& world = *dist->world();
  world.barrier();
  dist->set_timeout(std::chrono::seconds(1));
  at::Tensor t = at::ones({8}, at::kFloat);
  at::Tensor out = at::empty({8 * world.size()}, at::kFloat);
  WorkHandle reduce = world.all_reduce_async(t);
  WorkHandle gather = world.all_gather_into_tensor_async(out, t.clone());
  std::this_thread::sleep_for(std::chrono::milliseconds(1600));
  LOOM_REQUIRE(!flight_recorder().oldest_pending(),
               "finished async collectives still pending: ", flight_recorder().dump());
  reduce->wait();
  gather->wait();
  expect_equal(t, at::full({8}, world.size(), at::kFloat), "async all_reduce");
  dist->set_timeout(std::chrono::seconds(60));
}

// Exposed communication (CommCounter::wait_seconds): the time the caller blocks in a collective's
// wait. A rank that reaches a synchronous all-reduce 300 ms before its peer waits those 300 ms; the
// late rank hardly waits; an async all-reduce waited after 300 ms of (simulated) compute on every
// rank is hidden behind it and waits next to nothing.
void scenario_exposed_wait(const std::shared_ptr<Distributed>& dist) {
  Comm& world = *dist->world();
  world.barrier();
  comm_stats().reset();
  const auto waited = [] { return comm_stats().snapshot().get(CommOp::kAllReduce, "world").wait_seconds; };
  at::Tensor t = at::ones({1024}, at::kFloat);
  if (world.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  world.all_reduce(t);
  const double sync = waited();
  if (world.rank() == 0) {
    LOOM_REQUIRE(sync >= 0.2, "the early rank waited ", sync, " s for a peer 300 ms late; expected >= 0.2 s");
  } else {
    LOOM_REQUIRE(sync < 0.15, "the late rank waited ", sync, " s for a peer that was there already");
  }
  world.barrier();
  comm_stats().reset();
  WorkHandle work = world.all_reduce_async(t);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  work->wait();
  const double hidden = waited();
  LOOM_REQUIRE(hidden < 0.1, "an async all-reduce behind 300 ms of compute left ", hidden, " s exposed");
  std::printf("rank %d: exposed %.3f s in the synchronous all-reduce, %.4f s in the hidden async one\n", world.rank(),
              sync, hidden);
}

// Shared-memory collectives (shm_collectives.h) against Gloo on the same group: random tensors of
// growing and shrinking sizes (each rank's segment regrows), three in flight at once around a
// synchronous Gloo broadcast, waited out of order. All-gathers must equal Gloo's bitwise; sums may
// differ from Gloo's (differently ordered) fp32 sums by rounding only, bf16 averages by one bf16 ulp.
void scenario_shared_memory(const std::shared_ptr<Distributed>& dist) {
  Comm& world = *dist->world();
  // With LOOM_FAULT_SHM_LIMIT=<bytes>@<rank> one rank has no room past <bytes>: the group must
  // move to Gloo at the same collective on every rank and give the same results (issue 46, 9).
  const bool limited = std::getenv("LOOM_FAULT_SHM_LIMIT") != nullptr;
  LOOM_REQUIRE(world.uses_shared_memory() == shared_memory_requested(), "the world group ",
               world.uses_shared_memory() ? "uses" : "does not use", " shared memory");
  LOOM_REQUIRE(world.uses_shared_memory(), "this scenario compares shared memory with Gloo: run it "
               "without LOOM_TEST_SHARED_MEMORY=0");
  Comm gloo(world.backend(), "gloo", world.world_ranks(), world.rank());
  LOOM_REQUIRE(!gloo.uses_shared_memory(), "a Comm built on the backend alone uses shared memory");
  const int w = world.size(), r = world.rank();
  at::manual_seed(1234 + r);
  for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{1} << 16, int64_t{1} << 20, int64_t{3} << 20,
                    int64_t{1} << 18}) {
    at::Tensor shard = at::randn({n});
    at::Tensor gathered = at::empty({n * w});
    at::Tensor grads = at::randn({n * w});
    at::Tensor scattered = at::empty({n});
    at::Tensor half = at::randn({n}).to(at::kBFloat16);
    const at::Tensor half_in = half.clone();
    WorkHandle gather = world.all_gather_into_tensor_async(gathered, shard);
    WorkHandle scatter = world.reduce_scatter_tensor_async(scattered, grads, ReduceOp::kSum);
    at::Tensor root = at::full({4}, static_cast<double>(r), at::kFloat);
    gloo.broadcast(root, 0);
    WorkHandle average = world.all_reduce_async(half, ReduceOp::kAvg);
    average->wait();
    scatter->wait();
    gather->wait();
    expect_equal(root, at::zeros({4}, at::kFloat), "Gloo broadcast between shared-memory collectives");

    at::Tensor gathered_ref = at::empty_like(gathered);
    gloo.all_gather_into_tensor(gathered_ref, shard);
    expect_equal(gathered, gathered_ref, c10::str("all_gather of ", n, " per rank"));
    // The sums' reference: every rank's input gathered over Gloo and added here in rank order,
    // as the shared-memory path adds them (fp32; bf16 accumulated in fp32 and rounded once).
    at::Tensor all_grads = at::empty({w, n * w});
    gloo.all_gather_into_tensor(all_grads, grads);
    at::Tensor scattered_ref = all_grads[0].narrow(0, r * n, n) + all_grads[1].narrow(0, r * n, n);
    for (int i = 2; i < w; ++i) scattered_ref.add_(all_grads[i].narrow(0, r * n, n));
    expect_equal(scattered, scattered_ref, c10::str("reduce_scatter of ", n, " per rank"));
    at::Tensor all_half = at::empty({w, n}, at::kBFloat16);
    gloo.all_gather_into_tensor(all_half, half_in);
    at::Tensor half_ref = all_half[0].to(at::kFloat);
    for (int i = 1; i < w; ++i) half_ref.add_(all_half[i]);
    expect_equal(half, half_ref.div_(w).to(at::kBFloat16), c10::str("bf16 all_reduce avg of ", n));
  }
  // Integer max, in place, equals Gloo's exactly.
  at::Tensor ints = at::randint(-1000, 1000, {777}, at::kLong);
  at::Tensor ints_ref = ints.clone();
  world.all_reduce(ints, ReduceOp::kMax);
  gloo.all_reduce(ints_ref, ReduceOp::kMax);
  expect_equal(ints, ints_ref, "all_reduce max of int64");
  const uint32_t on_gloo_since = world.shared_memory()->on_gloo_since();
  LOOM_REQUIRE((on_gloo_since != 0) == limited, "the group ", on_gloo_since != 0 ? "moved" : "did not move",
               " to Gloo", limited ? " with LOOM_FAULT_SHM_LIMIT set" : "");
  if (limited) std::printf("rank %d: on Gloo from collective #%u\n", world.rank(), on_gloo_since);
  // Every segment was unlinked once its peers had opened it: nothing of this process in /dev/shm.
  const std::string mine = c10::str("loom-", ::getpid(), "-");
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    LOOM_REQUIRE(entry.path().filename().string().rfind(mine, 0) != 0, "segment ", entry.path(),
                 " is still linked");
  }
}

// ----------------------------------------------------------------------------------------------
// Elastic scenarios (`loom launch --elastic`): the ranks form no process group; each member talks
// to the launcher's store the way an elastic rank does (elastic_protocol.h) and appends what it
// saw to <LOOM_TEST_ELASTIC_DIR>/member-<id>.log ("start pid=P ...", "gen G members=[...]",
// "done pid=P").

struct ElasticMember {
  int id = -1;
  bool joiner = false;
  int world_size = 0;
  int attempt = 0;
  int max_restarts = 0;
  c10::intrusive_ptr<c10d::Store> store;
  std::filesystem::path log;
};

int env_int(const char* name) {
  const char* v = std::getenv(name);
  LOOM_REQUIRE(v != nullptr, name, " is not set; run this scenario under loom launch --elastic");
  return std::atoi(v);
}

void note(const ElasticMember& m, const std::string& line) {
  FILE* f = std::fopen(m.log.c_str(), "a");
  LOOM_REQUIRE(f != nullptr, "cannot open ", m.log.string());
  std::fprintf(f, "%s\n", line.c_str());
  std::fclose(f);
}

ElasticMember connect_member() {
  ElasticMember m;
  const LaunchEnv env = detect_launch_env();
  m.id = env_int(kElasticMemberEnv);
  const char* joiner = std::getenv(kElasticJoinerEnv);
  m.joiner = joiner != nullptr && std::string(joiner) == "1";
  m.world_size = env.world_size;
  m.attempt = env.restart_count;
  m.max_restarts = env.max_restarts;
  c10d::TCPStoreOptions options;
  options.port = static_cast<uint16_t>(env.master_port);
  options.isServer = false;
  options.waitWorkers = false;
  options.timeout = std::chrono::seconds(30);
  auto tcp = c10::make_intrusive<c10d::TCPStore>(env.master_addr, options);
  m.store = c10::make_intrusive<c10d::PrefixStore>(c10::str("/worker/attempt_", m.attempt), tcp);
  const char* dir = std::getenv("LOOM_TEST_ELASTIC_DIR");
  LOOM_REQUIRE(dir != nullptr, "LOOM_TEST_ELASTIC_DIR is not set");
  m.log = std::filesystem::path(dir) / c10::str("member-", m.id, ".log");
  note(m, c10::str("start pid=", getpid(), " member=", m.id, " rank=", env.rank, " joiner=",
                   m.joiner ? 1 : 0, " attempt=", m.attempt));
  return m;
}

std::string get_text(const ElasticMember& m, const std::string& key) {
  const std::vector<uint8_t> v = m.store->get(key);
  return std::string(v.begin(), v.end());
}

// Waits (up to 30 s) for `key` to exist; returns its value.
std::string wait_key(const ElasticMember& m, const std::string& key) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!m.store->check({key})) {
    LOOM_REQUIRE(std::chrono::steady_clock::now() < deadline, "member ", m.id,
                 ": timed out waiting for ", key);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return get_text(m, key);
}

// Waits for kGenerationKey to reach at least `generation`; returns the newest generation's
// membership (`exact`: that of `generation` itself), noted in the log.
nlohmann::json wait_generation(const ElasticMember& m, int generation, bool exact = false) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  int current = -1;
  while (true) {
    if (m.store->check({kGenerationKey})) current = std::stoi(get_text(m, kGenerationKey));
    if (current >= generation) break;
    LOOM_REQUIRE(std::chrono::steady_clock::now() < deadline, "member ", m.id,
                 ": timed out waiting for generation ", generation, " (at ", current, ")");
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (exact) current = generation;
  nlohmann::json g = nlohmann::json::parse(get_text(m, c10::str(kGenerationKeyPrefix, current)));
  g["generation"] = current;
  note(m, c10::str("gen ", current, " members=", g["members"].dump(), " reason=", g["reason"].dump()));
  return g;
}

bool has_member(const nlohmann::json& g, int id) {
  for (const auto& x : g["members"]) {
    if (x.get<int>() == id) return true;
  }
  return false;
}

void finish(const ElasticMember& m, const nlohmann::json& newest) {
  if (newest["members"][0].get<int>() == m.id) {
    m.store->set(kDoneKey, std::string("7"));
  } else {
    wait_key(m, kDoneKey);
  }
  note(m, c10::str("done pid=", getpid()));
}

// Members 0..W-1 see generation 0; member 1 then SIGKILLs itself. The others wait for generation
// 1 without it. With --max-restarts > 0 the launcher starts a replacement (the first one SIGKILLs
// itself before it is ready when LOOM_TEST_ELASTIC_KILL_JOINER=1); once one is ready, rank 0 of
// generation 1 answers the join request by yielding, and everyone waits for generation 2 = the
// members of 1 followed by the replacement. Rank 0 of the newest generation then sets kDoneKey and
// all exit 0.
void scenario_elastic_membership() {
  const ElasticMember m = connect_member();
  const bool expect_join = m.max_restarts > 0;
  if (m.joiner) {
    const char* kill = std::getenv("LOOM_TEST_ELASTIC_KILL_JOINER");
    if (kill != nullptr && std::string(kill) == "1" && m.id == m.world_size) {
      std::printf("member %d: replacement killing itself before it is ready\n", m.id);
      std::fflush(stdout);
      raise(SIGKILL);
    }
    m.store->set(c10::str(kReadyKeyPrefix, m.id), std::string("1"));
    const nlohmann::json g = wait_generation(m, 2);
    LOOM_REQUIRE(has_member(g, m.id), "member ", m.id, ": generation 2 lacks it: ", g.dump());
    LOOM_REQUIRE(g.value("joined", nlohmann::json()) == nlohmann::json::array({m.id}), "member ",
                 m.id, ": generation 2 is ", g.dump());
    finish(m, g);
    std::printf("member %d: elastic_membership ok (joined)\n", m.id);
    return;
  }
  const nlohmann::json g0 = wait_generation(m, 0, /*exact=*/true);
  LOOM_REQUIRE(g0["generation"] == 0 && g0["reason"] == "start" && g0["members"].size() ==
                   static_cast<size_t>(m.world_size),
               "member ", m.id, ": generation 0 is ", g0.dump());
  if (m.id == 1) {
    std::printf("member 1: killing itself after generation 0\n");
    std::fflush(stdout);
    raise(SIGKILL);
  }
  const nlohmann::json g1 = wait_generation(m, 1);
  LOOM_REQUIRE(g1["generation"] == 1 && !has_member(g1, 1) &&
                   g1["members"].size() == static_cast<size_t>(m.world_size - 1) &&
                   g1.value("lost", nlohmann::json()) == nlohmann::json::array({1}),
               "member ", m.id, ": generation 1 is ", g1.dump());
  nlohmann::json newest = g1;
  if (expect_join) {
    if (g1["members"][0].get<int>() == m.id) {
      const std::string request = wait_key(m, kJoinRequestKey);
      LOOM_REQUIRE(request == "1", "member ", m.id, ": join request names generation ", request);
      note(m, "yield 1");
      m.store->set(c10::str(kYieldKeyPrefix, 1), std::string("7"));
    }
    newest = wait_generation(m, 2);
    nlohmann::json expected = g1["members"];
    for (const auto& j : newest.value("joined", nlohmann::json::array())) expected.push_back(j);
    LOOM_REQUIRE(newest["generation"] == 2 && newest.contains("joined") &&
                     newest["joined"].size() == 1 && newest["joined"][0].get<int>() >= m.world_size &&
                     newest["members"] == expected,
                 "member ", m.id, ": generation 2 is ", newest.dump());
  }
  finish(m, newest);
  std::printf("member %d: elastic_membership ok\n", m.id);
}

// A death while a join is pending. Member 1 SIGKILLs itself after generation 0; once its
// replacement (member 3) is ready the launcher asks generation 1 to yield, and member 2 SIGKILLs
// itself on seeing that request. Member 0, rank 0 throughout, holds its yield back until member 2
// is gone, so the launcher must handle the death first and move the join request to generation 2.
// Member 0 then yields to every request naming its generation until a generation has W members
// again (member 4, member 2's replacement, joins with member 3 or after it), and sets kDoneKey.
void scenario_elastic_churn() {
  const ElasticMember m = connect_member();
  if (m.joiner) {
    m.store->set(c10::str(kReadyKeyPrefix, m.id), std::string("1"));
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!m.store->check({kDoneKey})) {
      LOOM_REQUIRE(std::chrono::steady_clock::now() < deadline, "member ", m.id, ": no kDoneKey");
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    note(m, c10::str("done pid=", getpid()));
    std::printf("member %d: elastic_churn ok (joined)\n", m.id);
    return;
  }
  wait_generation(m, 0, /*exact=*/true);
  if (m.id == 1) raise(SIGKILL);
  if (m.id == 2) {
    wait_generation(m, 1);
    LOOM_REQUIRE(wait_key(m, kJoinRequestKey) == "1", "member 2: the first join request is not "
                 "for generation 1");
    note(m, "saw the join request for generation 1");
    raise(SIGKILL);
  }
  // Member 0.
  int seen = -1;
  int yielded = -1;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (true) {
    LOOM_REQUIRE(std::chrono::steady_clock::now() < deadline, "member 0: timed out at generation ",
                 seen);
    const int current = std::stoi(get_text(m, kGenerationKey));
    if (current != seen) {
      const nlohmann::json g = wait_generation(m, current, /*exact=*/true);
      LOOM_REQUIRE(g["members"][0] == 0, "member 0 is not rank 0 of ", g.dump());
      seen = current;
      if (g["members"].size() == static_cast<size_t>(m.world_size) && current > 0) {
        finish(m, g);
        break;
      }
    }
    const bool member_2_gone = seen >= 2;
    if (member_2_gone && yielded < seen && m.store->check({kJoinRequestKey}) &&
        get_text(m, kJoinRequestKey) == std::to_string(seen)) {
      note(m, c10::str("yield ", seen));
      m.store->set(c10::str(kYieldKeyPrefix, seen), std::string("7"));
      yielded = seen;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::printf("member 0: elastic_churn ok\n");
}

// Attempt 0: member 1 exits kExitElasticRestart after generation 0, the others wait to be
// stopped. Attempt 1 (a restart of the whole group) must find a fresh generation 0 under its own
// prefix, members 0..W-1, and nothing newer.
void scenario_elastic_restart() {
  const ElasticMember m = connect_member();
  const nlohmann::json g0 = wait_generation(m, 0, /*exact=*/true);
  nlohmann::json all = nlohmann::json::array();
  for (int i = 0; i < m.world_size; ++i) all.push_back(i);
  LOOM_REQUIRE(g0["generation"] == 0 && g0["members"] == all && g0["reason"] == "start",
               "member ", m.id, " attempt ", m.attempt, ": generation 0 is ", g0.dump());
  std::printf("member %d attempt %d: generation 0 members=%s\n", m.id, m.attempt,
              g0["members"].dump().c_str());
  std::fflush(stdout);
  if (m.attempt == 0) {
    // Member 1 asks for the restart once every member has seen generation 0.
    m.store->set(c10::str("test/seen/", m.id), std::string("1"));
    if (m.id == 1) {
      for (int i = 0; i < m.world_size; ++i) wait_key(m, c10::str("test/seen/", i));
      std::printf("member 1 attempt 0: asking for a restart of the group\n");
      std::fflush(stdout);
      std::_Exit(kExitElasticRestart);
    }
    std::this_thread::sleep_for(std::chrono::seconds(60));  // stopped by the launcher
    return;
  }
  LOOM_REQUIRE(!m.store->check({c10::str(kGenerationKeyPrefix, 1)}), "member ", m.id,
               ": attempt ", m.attempt, " sees a generation 1");
  finish(m, g0);
  std::printf("member %d attempt %d: elastic_restart ok\n", m.id, m.attempt);
}

// Scenarios that form no process group.
const std::map<std::string, std::function<void()>>& store_scenarios() {
  static const std::map<std::string, std::function<void()>> all = {
      {"elastic_membership", scenario_elastic_membership},
      {"elastic_restart", scenario_elastic_restart},
      {"elastic_churn", scenario_elastic_churn},
  };
  return all;
}

const std::map<std::string, std::function<void(const std::shared_ptr<Distributed>&)>>& scenarios() {
  static const std::map<std::string, std::function<void(const std::shared_ptr<Distributed>&)>> all = {
      {"all_reduce", scenario_all_reduce},       {"all_gather", scenario_all_gather},
      {"reduce_scatter", scenario_reduce_scatter}, {"broadcast", scenario_broadcast},
      {"all_to_all", scenario_all_to_all},       {"send_recv", scenario_send_recv},
      {"mesh_2x2", scenario_mesh_2x2},           {"accounting", scenario_accounting},
      {"flight_recorder", scenario_flight_recorder}, {"fail_rank1", scenario_fail_rank1},
      {"die_once", scenario_die_once},           {"stall_once", scenario_stall_once},
      {"peer_exit", scenario_peer_exit},         {"unwaited_async", scenario_unwaited_async},
      {"killed_peer", scenario_killed_peer},     {"stopped_peer", scenario_stopped_peer},
      {"exposed_wait", scenario_exposed_wait},   {"shared_memory", scenario_shared_memory},
  };
  return all;
}

}  // namespace

int main(int argc, char** argv) {
  // Several scenarios may run in one launch (sharing the process groups), saving process start-up.
  std::vector<std::string> names(argv + 1, argv + argc);
  if (names.empty()) names.push_back("");
  if (names.size() == 1 && store_scenarios().count(names.front())) {
    try {
      store_scenarios().at(names.front())();
      std::fflush(stdout);
      return 0;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s: error: %s\n", names.front().c_str(), e.what());
      return 1;
    }
  }
  for (const auto& name : names) {
    if (!scenarios().count(name)) {
      std::string known;
      for (const auto& [n, f] : scenarios()) known += " " + n;
      std::fprintf(stderr, "error: unknown scenario '%s'; known:%s\n", name.c_str(), known.c_str());
      return 2;
    }
  }
  int rank = -1;
  std::string current = "init";
  try {
    const LaunchEnv env = detect_launch_env();
    rank = env.rank;
    auto dist = init_distributed(env, std::chrono::seconds(60), c10::Device(c10::kCPU),
                                 shared_memory_requested());
    for (const auto& name : names) {
      current = name;
      scenarios().at(name)(dist);
      std::printf("rank %d/%d %s: ok\n", env.rank, env.world_size, name.c_str());
      std::fflush(stdout);
    }
    dist->shutdown();
    return 0;
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "rank %d %s: error: %s\n", rank, current.c_str(), e.what());
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "rank %d %s: error: %s\n", rank, current.c_str(),
                 e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d %s: error: %s\n", rank, current.c_str(), e.what());
  }
  return 1;
}
