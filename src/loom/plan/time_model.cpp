#include "loom/plan/time_model.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <tuple>
#include <thread>

#include <ATen/Parallel.h>

#include "loom/ac/activation_checkpoint.h"
#include "loom/models/common/decoder.h"
#include "loom/models/common/pipeline.h"
#include "loom/core/error.h"
#include "loom/distributed/launch_env.h"
#include "loom/distributed/process_group.h"
#include "loom/pipeline/generators.h"
#include "loom/pipeline/simulator.h"
#include "loom/train/layout_check.h"
#include "loom/train/metrics.h"

namespace loom::plan {
namespace {
// This machine's CPU constants, fitted with bench/plan_time.py (2026-11-27; docs/planner.md has the
// tables; each run also calibrates them on its own rows, which gave the ranges below):
//  - efficiency, on the one-process row: the debug Llama 3's whole step (attention, norms, AdamW
//    with the GEMMs) reached 0.63-0.71 of one thread's measured square-GEMM rate in four runs, but
//    that rate itself moved 47-79 GFLOP/s; against the CPU's own peak (cpu_spec_peak_fp32_flops:
//    78.3 GFLOP/s here, AVX2 FMA at 2.45 GHz, which the best measurements reach) 0.565 and 0.541
//    in two runs (0.55);
//  - shared host, on the FSDP 2 row: ranks sharing the host ran at 0.73-0.83 of a lone process's
//    rate per token while Gloo's threads moved FSDP's bytes over TCP on the same cores; with the
//    shared-memory collectives (comm.shared_memory, below) at 0.923 and 0.919 (two runs, 0.92):
//    memory and cache contention, the ranks' loader and logging threads;
//  - blocking call, fitted on the TP 2 row while its collectives went over Gloo: 52 blocking
//    collectives a step cost 0.15-0.3 s beyond their bytes (2.8-6 ms each, 4 ms; the trainer's
//    own comm_exposed_s counted ~4 ms of waiting per call). It now prices Gloo's exchanges only
//    (CP's ring, PP's receives, EP's all-to-alls), which were within 20 % with it;
//  - Gloo's loopback ring, about 2 GB/s (measured with torchrun, docs/profiling.md);
//  - shared-memory collectives (TP's, FSDP's and HSDP's all-gathers, reduce-scatters and
//    all-reduces since 2026-11-27): 5 GB/s (each byte is copied in once and read out once at a
//    core's ~10 GB/s memcpy rate) and, fitted on the TP 2 row, 0.9 ms per blocking call (0.98 and
//    0.75 ms in two runs: the peer the OS ran last, not the copy).
constexpr double kCpuEfficiency = 0.55;
constexpr double kCpuSharedHostEfficiency = 0.92;
constexpr double kCpuBlockingCallSeconds = 0.004;
constexpr double kCpuLoopbackBandwidth = 2e9;
constexpr double kCpuSharedMemoryBandwidth = 5e9;
constexpr double kCpuSharedMemoryCallSeconds = 0.0009;
// Fitted on TorchTitan's Llama 3.1 8B rows on 8 H100s (compile: 6,667, compile + Float8: 8,532
// tokens/s per GPU, a 1.280x speedup; PlanTime.Float8SpeedupIsFitted... reproduces it), checked on
// the 128-GPU pair (6,514 and 8,380) it was not fitted on.
constexpr double kFloat8GemmSpeedup = 1.434;
// The per-GEMM efficiency curve 1 / (1 / large + call x peak / FLOPs), fitted on 192 bf16 training
// GEMM shapes on one H200 (bench/gemm_efficiency.py, 2026-11-27; mean error 3.3 %, docs/planner.md);
// not on any published row.
constexpr double kGemmLargeEfficiency = 0.698;
// TorchTitan's published peak memory (max reserved) over Loom's predicted allocated peak for the
// same run: Llama 3.1 8B, 8 H100s, FSDP, local batch 2, seq 8192, per-op SAC, 82.4 / 72.08 GiB
// (fitted; the 8-GPU row that fits the preset's efficiency); its 128-GPU row, 67.0 / 58.06 = 1.154,
// is predicted at 1.143 (-0.9 %). Not fitted on any rank or NeMo row.
constexpr double kGpuAllocatorReserve = 1.143;
constexpr double kGemmCallSeconds = 3e-6;
// DeepEP's normal (training) kernels across nodes on H800s with one CX7 400 Gb/s NIC per GPU --
// the DGX H100's NIC -- DeepSeek-V3's setting (4,096 tokens, hidden 7,168, top 8 of 4 groups):
// 43 / 58 / 51 GB/s of RDMA bottleneck bandwidth for dispatch at EP 16 / 32 / 64, 43 / 57 / 50
// for combine (deepseek-ai/DeepEP, docs/legacy.md, "Normal kernels with NVLink and RDMA
// forwarding"): the NIC's line rate, 50 GB/s, at EP 64. Not fitted on any row.
constexpr double kDeepEpRdmaBandwidth = 50e9;
}  // namespace

double linear_flop_fraction(const models::ModelSpec& spec, const models::ModelArgs& args, const ModelShape& shape,
                            int64_t seq_len) {
  return std::min(1.0, 6.0 * shape.linear_elems / spec.flops_per_token(args, seq_len));
}

bool float8_fits(const ModelShape& shape, const Layout& layout) {
  const int64_t tp = layout.tp;
  const int64_t head_dim = shape.n_heads > 0 ? shape.dim / shape.n_heads : shape.dim;
  for (const int64_t d : {shape.dim, shape.ffn / tp, shape.kv_dim / tp, head_dim * shape.n_heads / tp}) {
    if (d <= 0 || d % 16 != 0) return false;
  }
  return true;
}

Cluster Cluster::preset(const std::string& name) {
  Cluster c;
  c.name = name;
  c.peak_flops = 989e12;       // H100 SXM / H200 dense bf16
  c.efficiency = 0.3547;       // fitted on TorchTitan's 8B, 8-GPU FSDP row (docs/planner.md)
  c.intra_node_bw = 350e9;     // NVLink 4: 450 GB/s per direction, ~350 GB/s ring algorithmic
  c.inter_node_bw = 40e9;      // 400 Gb/s InfiniBand per GPU, ~80 % achieved
  c.ep_inter_node_bw = kDeepEpRdmaBandwidth;
  c.intra_latency = 10e-6;
  c.inter_latency = 20e-6;
  c.devices_per_node = 8;
  c.float8_gemm_speedup = kFloat8GemmSpeedup;
  c.allocator_reserve = kGpuAllocatorReserve;
  if (name == "h100") {
    c.memory_gib = 80;
  } else if (name == "h200") {
    c.memory_gib = 141;
  } else {
    fail_usage("unknown cluster '", name, "'; use h100, h200 or cpu");
  }
  return c;
}

std::optional<double> cpu_spec_peak_fp32_flops(const std::string& cpuinfo, const std::string& max_freq_khz) {
  // The first processor's fields ("key\t: value" lines up to the first blank line).
  std::map<std::string, std::string> field;
  std::istringstream in(cpuinfo);
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) {
      if (!field.empty()) break;
      continue;
    }
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string key = line.substr(0, colon);
    while (!key.empty() && (key.back() == ' ' || key.back() == '\t')) key.pop_back();
    std::string value = line.substr(colon + 1);
    if (!value.empty() && value.front() == ' ') value.erase(0, 1);
    field.emplace(key, value);
  }
  const auto flags_it = field.find("flags");
  if (flags_it == field.end()) return std::nullopt;  // not x86: measure instead
  std::set<std::string> flags;
  std::istringstream words(flags_it->second);
  for (std::string w; words >> w;) flags.insert(w);
  const bool amd = field["vendor_id"] == "AuthenticAMD";
  const int family = field.count("cpu family") ? std::atoi(field["cpu family"].c_str()) : 0;
  // fp32 FLOPs per cycle and core: two FMA pipes of the widest vector unit (2 x lanes x 2).
  // AMD's Zen 4 (family 0x19 with AVX-512) runs 512-bit FMAs as two 256-bit halves.
  double per_cycle = 8;                                           // SSE: 4 lanes, add + mul
  if (flags.count("avx")) per_cycle = 16;                         // 8 lanes, add + mul
  if (flags.count("avx2") && flags.count("fma")) per_cycle = 32;  // 2 x 8 lanes x FMA
  if (flags.count("avx512f") && !(amd && family <= 0x19)) per_cycle = 64;
  double hz = 0;
  if (!max_freq_khz.empty()) hz = std::atof(max_freq_khz.c_str()) * 1e3;
  if (hz <= 0 && field.count("cpu MHz")) hz = std::atof(field["cpu MHz"].c_str()) * 1e6;
  if (hz <= 0) return std::nullopt;
  return per_cycle * hz;
}

namespace {
std::string read_text(const char* path) {
  std::ifstream f(path);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}
}  // namespace

Cluster Cluster::this_cpu(double peak_flops, double peak_flops_all_cores) {
  Cluster c;
  c.name = "cpu";
  const int threads = at::get_num_threads();
  // Only where the CPU's own peak cannot be read: longer than a training run's 0.3 s, since on a
  // shared machine the best of 0.3 s moved by 15-30 % between invocations.
  constexpr double kPeakSeconds = 1.5;
  c.cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  // The peak from the CPU's vector units and clock, as a GPU's comes from its data sheet: on this
  // shared machine a measured GEMM peak read 47-79 GFLOP/s within minutes (noisy neighbours), the
  // training rate it predicts moved 4 %; the efficiency is fitted against this steady figure.
  const std::optional<double> spec =
      cpu_spec_peak_fp32_flops(read_text("/proc/cpuinfo"),
                               read_text("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq"));
  if (peak_flops > 0) {
    c.peak_flops = peak_flops;
  } else if (spec) {
    c.peak_flops = *spec;
  } else {
    at::set_num_threads(1);
    c.peak_flops = train::measure_peak_fp32_flops(kPeakSeconds);
  }
  if (peak_flops_all_cores > 0) {
    c.peak_flops_all_cores = peak_flops_all_cores;
  } else if (spec) {
    c.peak_flops_all_cores = *spec * c.cores;
  } else {
    at::set_num_threads(c.cores);
    c.peak_flops_all_cores = train::measure_peak_fp32_flops(kPeakSeconds);
  }
  at::set_num_threads(threads);
  c.efficiency = kCpuEfficiency;
  c.intra_node_bw = kCpuLoopbackBandwidth;
  c.inter_node_bw = kCpuLoopbackBandwidth;
  c.intra_latency = c.inter_latency = 50e-6;
  c.devices_per_node = 1 << 20;  // one host: every group is "inside the node"
  c.memory_gib = 0;
  c.blocking_call_s = kCpuBlockingCallSeconds;
  c.shared_host_efficiency = kCpuSharedHostEfficiency;
  c.shm_bw = kCpuSharedMemoryBandwidth;
  c.shm_call_s = kCpuSharedMemoryCallSeconds;
  return c;
}

Cluster Cluster::with(const Overrides& o) const {
  Cluster c = *this;
  const auto set = [](double& field, double value) {
    if (value >= 0) field = value;
  };
  set(c.peak_flops, o.peak_flops);
  set(c.efficiency, o.efficiency);
  set(c.memory_gib, o.memory_gib);
  set(c.allocator_reserve, o.allocator_reserve);
  set(c.intra_node_bw, o.intra_node_bw);
  set(c.inter_node_bw, o.inter_node_bw);
  set(c.intra_latency, o.intra_latency);
  set(c.inter_latency, o.inter_latency);
  set(c.blocking_call_s, o.blocking_call_s);
  set(c.shared_host_efficiency, o.shared_host_efficiency);
  set(c.peak_flops_all_cores, o.peak_flops_all_cores);
  set(c.shm_bw, o.shm_bw);
  set(c.shm_call_s, o.shm_call_s);
  set(c.float8_gemm_speedup, o.float8_gemm_speedup);
  set(c.ep_inter_node_bw, o.ep_inter_node_bw);
  if (o.devices_per_node > 0) c.devices_per_node = o.devices_per_node;
  LOOM_REQUIRE_USAGE(c.peak_flops > 0 && c.efficiency > 0 && c.efficiency <= 1, "the cluster needs a peak "
                     "FLOP/s > 0 and an efficiency in (0, 1]; got ", c.peak_flops, " and ", c.efficiency);
  LOOM_REQUIRE_USAGE(c.allocator_reserve >= 1, "the cluster's allocator reserve (device memory reserved per byte "
                     "the model counts allocated) must be >= 1; got ", c.allocator_reserve);
  LOOM_REQUIRE_USAGE(c.shared_host_efficiency > 0 && c.shared_host_efficiency <= 1, "the cluster's shared-host "
                     "efficiency must be in (0, 1]; got ", c.shared_host_efficiency);
  LOOM_REQUIRE_USAGE(c.shm_bw >= 0 && c.shm_call_s >= 0, "the cluster's shared-memory bandwidth and call cost "
                     "must be >= 0 (0: no shared-memory transport); got ", c.shm_bw, " and ", c.shm_call_s);
  LOOM_REQUIRE_USAGE(c.float8_gemm_speedup == 0 || c.float8_gemm_speedup >= 1, "the cluster's Float8 GEMM speedup "
                     "must be >= 1 (0: no float8 GEMMs); got ", c.float8_gemm_speedup);
  LOOM_REQUIRE_USAGE(c.intra_node_bw > 0 && c.inter_node_bw > 0, "the cluster's bandwidths must be > 0; got ",
                     c.intra_node_bw, " and ", c.inter_node_bw, " bytes/s");
  return c;
}

TimeEstimate estimate_time(const models::ModelSpec& spec, const models::ModelArgs& args, const ModelShape& shape,
                           const train::JobConfig& config, const Layout& layout, const Cluster& cluster) {
  const auto& t = config.training;
  const auto& p = config.parallelism;
  const double world = static_cast<double>(layout.dp_replicate) * layout.dp_shard * layout.cp * layout.tp * layout.pp;
  const double dp = static_cast<double>(layout.dp_replicate) * layout.dp_shard;
  // training.global_batch_size = -1 means local_batch_size x the data-parallel degree (no
  // accumulation), as the trainer reads it; priced as a count of rows, never as -1.
  const double global_rows = t.global_batch_size > 0 ? static_cast<double>(t.global_batch_size)
                                                     : static_cast<double>(t.local_batch_size) * dp;
  const double global_tokens = global_rows * static_cast<double>(t.seq_len);
  const double c = t.mixed_precision_param == Precision::kBFloat16 ? 2 : 4;
  const double reduce_bytes = t.mixed_precision_reduce == Precision::kBFloat16 ? 2 : 4;
  const double flops_per_token = spec.flops_per_token(args, t.seq_len);
  const double layers = static_cast<double>(shape.n_layers) / layout.pp;
  const double micro_steps = static_cast<double>(layout.grad_accum_steps);

  // Activation checkpointing recomputes the forward (a third of a layer's training FLOPs) of the
  // blocks it wraps.
  const ac::ACOptions ac = ac::ACOptions::from(config.activation_checkpoint);
  double recompute = 1.0;
  if (ac.mode == ac::Mode::kFull) recompute = 4.0 / 3.0;
  if (ac.mode == ac::Mode::kSelective) recompute = ac.per_op ? 1.05 : 1.0 + 1.0 / (3.0 * static_cast<double>(ac.every));

  TimeEstimate e;
  e.compute_s = flops_per_token * global_tokens / world * recompute / (cluster.peak_flops * cluster.efficiency);
  if (config.float8.enable && cluster.float8_gemm_speedup > 0) {
    const double f = linear_flop_fraction(spec, args, shape, t.seq_len);
    e.compute_s *= (1.0 - f) + f / cluster.float8_gemm_speedup;
  }
  // Routed experts on accelerators: each expert's rows are a GEMM of their own inside Loom's
  // grouped GEMM (moe/experts.cpp, at::_grouped_mm), and a GEMM of few rows runs far below the
  // peak. Priced with the per-GEMM curve measured on the H200 (docs/planner.md, "The GEMM
  // efficiency curve": 1 / (1 / 0.698 + 3 us x peak / FLOPs), bench/gemm_efficiency.py): relative
  // to a large GEMM, an expert's forward GEMM of F = 2 x rows x dim x hidden FLOPs takes
  // 1 + 0.698 x 3 us x peak / F times as long. Its rows per micro-batch: the rank's tokens (under
  // CP and sequence-parallel TP, its share), gathered from the EP group, times top-k over the
  // experts -- DeepSeek-V3 at MBS 1 and EP 64: 8,192 (+1 %); a micro-batch of 4,096 tokens split
  // over CP 8 without EP: 16 rows to each of GPT-OSS 120B's 128 experts (about 9x). Not on CPU clusters,
  // whose GEMM rate is a table of their own shapes, not this curve.
  if (cluster.cores == 0) {
    const double mb_rows = layout.pp > 1 ? static_cast<double>(layout.microbatch_size) : static_cast<double>(t.local_batch_size);
    const double mb_tokens = mb_rows * static_cast<double>(t.seq_len) / layout.cp /
                             (p.disable_sequence_parallel ? 1.0 : static_cast<double>(layout.tp));
    for (const auto& g : shape.groups) {
      if (g.moe.experts <= 0 || g.moe.hidden <= 0) continue;
      const double rows = mb_tokens * layout.ep * static_cast<double>(g.moe.top_k) / static_cast<double>(g.moe.experts);
      const double gemm_flops = 2.0 * std::max(1.0, rows) * static_cast<double>(shape.dim) * static_cast<double>(g.moe.hidden);
      const double slowdown = kGemmLargeEfficiency * kGemmCallSeconds * cluster.peak_flops / gemm_flops;
      // The layer's routed-expert FLOPs per token: 6 x k x the three matrices of dim x hidden.
      const double expert_flops = 18.0 * static_cast<double>(g.moe.top_k) * static_cast<double>(shape.dim) *
                                  static_cast<double>(g.moe.hidden);
      e.compute_s += expert_flops * global_tokens / world * recompute / (cluster.peak_flops * cluster.efficiency) * slowdown;
    }
  }
  if (cluster.cores > 0) {
    // CPU runs: each rank runs the intra-op threads the trainer gives it (LOOM_NUM_THREADS,
    // OMP_NUM_THREADS, else the cores shared among the host's ranks: distributed::intra_op_threads,
    // the same function), at the GEMM rate measured with one thread, rising to the all-core rate
    // with as many threads as cores; ranks whose threads outnumber the cores take turns.
    distributed::LaunchEnv env;
    env.world_size = static_cast<int>(world);
    env.local_world_size = static_cast<int>(world);
    const double threads = distributed::intra_op_threads(env);
    const double all_cores = std::max(cluster.peak_flops, cluster.peak_flops_all_cores);
    const double rate = cluster.cores <= 1 || threads <= 1
                            ? cluster.peak_flops
                            : cluster.peak_flops + (all_cores - cluster.peak_flops) *
                                                       (std::min<double>(threads, cluster.cores) - 1) / (cluster.cores - 1);
    e.compute_s *= cluster.peak_flops / rate * std::max(1.0, world * threads / cluster.cores);
    if (world > 1) e.compute_s /= cluster.shared_host_efficiency;
  }

  if (layout.pp > 1) {
    const models::PipelineOptions po = train::pipeline_options(config);
    // The bubble depends on the schedule, the degree and the micro-batches only: simulated once
    // each, with the receives a rank blocks on (activations and gradients from a stage on another
    // rank), the most of any rank.
    struct Simulated {
      double bubble = 0;
      double receives = 0;
    };
    static std::mutex bubble_mutex;
    // Keyed by everything plan_pipeline reads: the split points and a schedule CSV give other
    // stages than the default (before 2026-11-29 they were left out of the key, so a layout with
    // split points could take the bubble of one without, priced earlier in the same process).
    static std::map<std::tuple<std::string, std::string, int, int64_t, int64_t, std::vector<std::string>, int64_t>, Simulated>
        simulated;
    const auto key = std::make_tuple(po.schedule, po.schedule_csv, layout.pp, po.microbatches, po.layers_per_stage,
                                     po.split_points, shape.n_layers);
    std::optional<Simulated> sim;
    {
      std::lock_guard<std::mutex> lock(bubble_mutex);
      if (const auto it = simulated.find(key); it != simulated.end()) sim = it->second;
    }
    if (!sim) {
      // The schedule training runs (models::plan_pipeline): its stages per rank follow from
      // pipeline_parallel_layers_per_stage when set (NeMo's VP), else the schedule's default.
      const pipeline::Schedule schedule =
          models::plan_pipeline(dynamic_cast<const models::DecoderArgs&>(args), layout.pp, po).schedule;
      sim = Simulated{pipeline::simulate(schedule).bubble_fraction, 0.0};
      for (int r = 0; r < schedule.num_ranks; ++r) {
        double receives = 0;
        for (const int stage : schedule.stages_of(r)) {
          if (stage > 0 && schedule.rank_of(stage - 1) != r) receives += 1;                          // activations
          if (stage + 1 < schedule.num_stages() && schedule.rank_of(stage + 1) != r) receives += 1;  // gradients
        }
        sim->receives = std::max(sim->receives, receives * static_cast<double>(schedule.num_microbatches));
      }
      std::lock_guard<std::mutex> lock(bubble_mutex);
      simulated[key] = *sim;
    }
    const double bubble = sim->bubble;
    e.pp_s = sim->receives * micro_steps * cluster.blocking_call_s;
    e.bubble_s = e.compute_s * bubble / std::max(1e-9, 1.0 - bubble);
  }

  // CPU ranks on one host with the shared-memory transport: all-gathers, reduce-scatters and
  // all-reduces are one round through shared memory, not Gloo's ring.
  const bool shm = cluster.shm_bw > 0 && config.comm.shared_memory;
  // A ring collective over n ranks moving `bytes` (the whole buffer's size) per device; `exchange`:
  // point-to-point sends (CP's ring), which stay on Gloo with the shared-memory transport too.
  // A group that crosses nodes with g of its ranks in each node runs over g NICs at once: NCCL
  // builds one ring per NIC (rail), each crossing every node boundary once with 1/g of the data,
  // and NVLink joins the g ranks inside a node; the group's bandwidth per rank is then g NICs'
  // (DGX H100: 8 x 400 Gb/s per node), at most NVLink's. A group with one rank per node (FSDP
  // under TP 8, HSDP's replicas) has its own rank's NIC only.
  const auto ring = [&](double n, double bytes, bool inside_node, bool exchange = false, double per_node = 1) {
    if (n <= 1) return 0.0;
    if (shm && inside_node && !exchange) return (n - 1) / n * bytes / cluster.shm_bw;
    const double bw = inside_node ? cluster.intra_node_bw
                                  : std::min(cluster.intra_node_bw, std::max(1.0, per_node) * cluster.inter_node_bw);
    const double lat = inside_node ? cluster.intra_latency : cluster.inter_latency;
    return (n - 1) / n * bytes / bw + (n - 1) * lat;
  };

  // TP: the activations of every token of the TP group's micro-steps, 8 collectives per layer
  // (4 forward, 4 backward; 4 more when the forward is recomputed).
  if (layout.tp > 1) {
    const double tokens = global_tokens / (dp * layout.cp);
    const double collectives = (ac.mode == ac::Mode::kFull ? 12.0 : 8.0) * layers;
    const double bytes = tokens * static_cast<double>(shape.dim) * c;  // over the whole step
    const double microbatches = layout.pp > 1 ? static_cast<double>(layout.local_batch_size / layout.microbatch_size) : 1.0;
    const double calls = collectives * micro_steps * microbatches;
    e.tp_s = shm ? collectives * (layout.tp - 1.0) / layout.tp * bytes / cluster.shm_bw + calls * cluster.shm_call_s
                 : collectives * (layout.tp - 1.0) / layout.tp * bytes / cluster.intra_node_bw +
                       calls * ((layout.tp - 1.0) * cluster.intra_latency + cluster.blocking_call_s);
  }

  // FSDP over dp_shard x cp: the rank's groups gathered (forward, and again for the backward when
  // resharded after forward: not under PP, which holds stages gathered) and reduced, per
  // micro-step -- or, with Layout::fsdp_accumulate "on", once per step: the groups stay gathered
  // and their gradients unsharded from the first micro-batch to the last, which reduces them.
  // The dense parameters shard over dp_shard x cp; a routed expert's over efsdp = dp_shard x cp x
  // tp / ep (the ranks EP leaves: none under EP 8 of FSDP 8, so its experts move no FSDP bytes).
  // The mesh's innermost dims are tp, then cp and dp_shard: an FSDP group crossing nodes has
  // devices_per_node / tp ranks in each; efsdp ranks are ep apart.
  const double fsdp_ranks = static_cast<double>(layout.dp_shard) * layout.cp;
  // (Without EP the experts, if any, shard over dp_shard x cp like the rest.)
  const double efsdp_ranks = layout.ep > 1 ? std::max(1.0, fsdp_ranks * layout.tp / layout.ep) : fsdp_ranks;
  const double dense_elems = (shape.elems_plain + shape.elems_tp / layout.tp) / layout.pp;
  const double expert_elems =
      (shape.elems_expert / layout.ep + shape.elems_tp_expert / (static_cast<double>(layout.tp) * layout.ep)) / layout.pp;
  const double param_elems = dense_elems + expert_elems;  // a pipeline rank holds about 1/pp of the groups
  const int64_t groups = static_cast<int64_t>(shape.groups.size());
  const double groups_here = std::max(1.0, static_cast<double>(groups) / layout.pp);
  const double node = cluster.devices_per_node;
  const bool fsdp_inside_node = fsdp_ranks * layout.tp <= node;
  const double fsdp_per_node = std::min(fsdp_ranks, std::max(1.0, node / layout.tp));
  const double efsdp_per_node = std::min(efsdp_ranks, std::max(1.0, node / layout.ep));
  const bool accumulate = layout.fsdp_accumulate == "on" && micro_steps > 1;
  if (fsdp_ranks > 1 || efsdp_ranks > 1) {
    const double gathers =
        accumulate || layout.pp > 1 || p.fsdp_reshard_after_forward == "never" ? 1.0 : 2.0;
    const double passes = accumulate ? 1.0 : micro_steps;
    // One all-gather and one reduce-scatter of every group of the rank.
    const double gather = ring(fsdp_ranks, dense_elems * c, fsdp_inside_node, false, fsdp_per_node) +
                          ring(efsdp_ranks, expert_elems * c, fsdp_inside_node, false, efsdp_per_node);
    const double reduce = ring(fsdp_ranks, dense_elems * reduce_bytes, fsdp_inside_node, false, fsdp_per_node) +
                          ring(efsdp_ranks, expert_elems * reduce_bytes, fsdp_inside_node, false, efsdp_per_node);
    const double comm = passes * (gathers * gather + reduce);
    // Prefetch (the next group's gather issued before this one computes) and the reduce-scatters
    // issued as each group's backward ends put everything behind the compute but the first
    // group's gather and the last group's reduce of each pass; beyond the compute it is exposed.
    e.fsdp_exposed_s = std::max(0.0, comm - e.compute_s) + passes * (gather + reduce) / groups_here;
  }
  // Replicas (HSDP's dp_replicate, or DDP): the gradients' all-reduce, 2 (r-1)/r of the shard, across
  // nodes when the replicas are; behind the backward but for the last bucket.
  if (layout.dp_replicate > 1) {
    const double shard = param_elems / std::max(1.0, fsdp_ranks) * reduce_bytes;
    const bool inside = world <= cluster.devices_per_node;
    const double comm = 2.0 * ring(layout.dp_replicate, shard, inside);
    e.dp_exposed_s = std::max(0.0, comm - 2.0 / 3.0 * e.compute_s) + comm / groups_here;
  }
  // CP: each layer passes the keys and values around the ring (3 times: forward, backward and
  // the gradients), mostly behind the attention compute; a fifth is counted as exposed.
  if (layout.cp > 1) {
    const double tokens = global_tokens / (dp * layout.cp);
    const double bytes = tokens * 2.0 * static_cast<double>(shape.kv_dim) / layout.tp * c;
    const bool inside = layout.cp * layout.tp <= cluster.devices_per_node;
    e.cp_exposed_s = 0.2 * 3.0 * layers * ring(layout.cp, bytes * layout.cp, inside, /*exchange=*/true);
    // Each of the cp - 1 exchanges of those passes blocks (one per micro-batch, and a fourth pass
    // when full AC recomputes the forward).
    const double microbatches = layout.pp > 1 ? static_cast<double>(layout.local_batch_size / layout.microbatch_size) : 1.0;
    const double passes = ac.mode == ac::Mode::kFull ? 4.0 : 3.0;
    e.cp_exposed_s += passes * layers * (layout.cp - 1.0) * micro_steps * microbatches * cluster.blocking_call_s;
  }

  // EP: per MoE layer of this rank and micro-batch, 2 all-to-alls in the forward (dispatch,
  // combine), 2 in the backward, 2 more when the forward is recomputed; each moves the rank's
  // tokens' k rows, (ep-1)/ep of them to other ranks. Under TP the tokens are sequence-parallel.
  if (layout.ep > 1) {
    const double tokens = global_tokens / (dp * layout.cp) / (p.disable_sequence_parallel ? 1.0 : layout.tp);
    const double microbatches = layout.pp > 1 ? static_cast<double>(layout.local_batch_size / layout.microbatch_size) : 1.0;
    const double calls_per_layer = ac.mode == ac::Mode::kFull ? 6.0 : 4.0;
    const bool inside = layout.ep <= cluster.devices_per_node;
    const double bw = inside ? cluster.intra_node_bw : cluster.inter_node_bw;
    const double lat = inside ? cluster.intra_latency : cluster.inter_latency;
    double rows_dim = static_cast<double>(shape.moe_top_k_sum) * static_cast<double>(shape.dim);
    double moe_layers = static_cast<double>(shape.moe_layers);
    rows_dim /= layout.pp;  // a pipeline rank holds about 1/pp of the layers
    moe_layers /= layout.pp;
    // Loom's dispatch and combine are blocking all-to-alls between the router and the experts
    // (ep/expert_parallel.cpp): nothing computes while they run, so all of it is on the critical
    // path. An EP group wider than a node sends the rows for its node's ranks over NVLink and the
    // rest over its own NIC at the same time: the slower of the two.
    const double rows_bytes = tokens * rows_dim * c;
    double transfer = (layout.ep - 1.0) / layout.ep * rows_bytes / bw;
    if (!inside) {
      const double in_node = std::min<double>(layout.ep, cluster.devices_per_node);
      double remote = (layout.ep - in_node) / layout.ep * rows_bytes;  // rows bound for other nodes
      if (cluster.ep_node_dedup && shape.moe_layers > 0) {
        // Once per remote node a token's experts are on: the expected number of nodes its k experts
        // land on (uniformly among the experts it may reach), less its own. Group-limited routing
        // (DeepSeek-V3: topk_groups of the groups, then k experts among theirs): with G groups over
        // N nodes, G / N whole groups a node, a node holds j of the token's g groups with the
        // hypergeometric probability C(G/N, j) C(G - G/N, g - j) / C(G, g), and then one of its k
        // experts with probability 1 - (1 - j/g)^k. (Before 2026-11-29 a node was counted
        // reachable as N g / G nodes, which is 1 node of 2 under EP 16 -- no cross-node rows -- where
        // a token's 4 of 8 groups span both nodes 97 % of the time.) A group spanning N / G nodes:
        // the token's experts spread over g N / G of them. No groups: over all N.
        const double nodes = layout.ep / in_node;
        const double k = static_cast<double>(shape.moe_top_k_sum) / static_cast<double>(shape.moe_layers);
        const int64_t groups = shape.moe_groups, picked = shape.moe_topk_groups;
        const int64_t n = static_cast<int64_t>(std::llround(nodes));
        const auto spread = [&](double reachable) { return reachable * (1.0 - std::pow(1.0 - 1.0 / reachable, k)); };
        double touched = spread(nodes);
        if (groups > 1 && picked > 0 && picked < groups && groups >= n && groups % n == 0) {
          const auto choose = [](int64_t a, int64_t b) {
            if (b < 0 || b > a) return 0.0;
            return std::exp(std::lgamma(a + 1.0) - std::lgamma(b + 1.0) - std::lgamma(a - b + 1.0));
          };
          const int64_t per_node = groups / n;
          double p_touched = 0;
          for (int64_t j = 1; j <= std::min(per_node, picked); ++j) {
            const double p_j = choose(per_node, j) * choose(groups - per_node, picked - j) / choose(groups, picked);
            p_touched += p_j * (1.0 - std::pow(1.0 - static_cast<double>(j) / static_cast<double>(picked), k));
          }
          touched = nodes * p_touched;
        } else if (groups > 1 && picked > 0 && picked < groups && n > groups && n % groups == 0) {
          touched = spread(static_cast<double>(picked) * static_cast<double>(n / groups));
        }
        remote = std::min(remote, touched * (nodes - 1.0) / nodes / k * rows_bytes);
      }
      // DeepEP's RDMA kernels run at the NIC's line rate (Cluster::ep_inter_node_bw), NCCL's rings
      // at the preset's achieved share of it.
      const double nic = cluster.ep_node_dedup && cluster.ep_inter_node_bw > 0 ? cluster.ep_inter_node_bw
                                                                               : cluster.inter_node_bw;
      transfer = std::max((in_node - 1.0) / layout.ep * rows_bytes / cluster.intra_node_bw, remote / nic);
    }
    // Each all-to-all's messages to its ep - 1 peers travel at once (NCCL's grouped sends and
    // receives, DeepEP's kernels), not hop by hop around a ring: one latency of the link it
    // crosses per call. (Before 2026-11-29 it was priced (ep - 1) hops, a ring's: 63 x 20 us =
    // 1.26 ms per call under EP 64, 0.88 s of DeepSeek-V3's 256-GPU step and 0.73 s of GPT-OSS
    // 120B's; for ep = 2, the CPU rows, the two are the same.)
    e.ep_s = calls_per_layer * (transfer + moe_layers * micro_steps * microbatches * (lat + cluster.blocking_call_s));
  }

  e.step_s = e.compute_s + e.bubble_s + e.pp_s + e.tp_s + e.fsdp_exposed_s + e.dp_exposed_s + e.cp_exposed_s + e.ep_s;
  e.tokens_per_device_s = global_tokens / e.step_s / world;
  e.mfu = flops_per_token * e.tokens_per_device_s / cluster.peak_flops;
  const std::vector<std::pair<double, const char*>> terms = {
      {e.compute_s, "compute"}, {e.bubble_s, "pipeline bubble"}, {e.pp_s, "pipeline exchanges"}, {e.tp_s, "TP"},
      {e.fsdp_exposed_s, "FSDP"}, {e.dp_exposed_s, "data-parallel all-reduce"}, {e.cp_exposed_s, "CP"},
      {e.ep_s, "EP all-to-all"}};
  e.binding = std::max_element(terms.begin(), terms.end())->second;
  return e;
}

std::vector<Layout> memory_variants(const Layout& layout, const Cluster& cluster, const ModelShape& shape,
                                    const train::JobConfig& config) {
  std::vector<Layout> out;
  const bool fsdp = layout.dp_shard * layout.cp > 1 && layout.pp == 1;
  const bool sharded = layout.dp_shard * layout.cp > 1 || (layout.ep > 1 && layout.dp_shard * layout.cp * layout.tp > layout.ep);
  std::vector<const char*> float8 = {""};
  // Float8 does not compose with async TP (train/compatibility.cpp): only where that is off.
  const bool async_tp = config.parallelism.enable_async_tensor_parallel && layout.tp > 1;
  if (cluster.float8_gemm_speedup > 1 && float8_fits(shape, layout) && !async_tp) float8 = {"off", "on"};
  std::vector<const char*> accumulate = {""};
  if (sharded && layout.grad_accum_steps > 1) accumulate = {"off", "on"};
  // What the layout sets already (a bf16 run's "off", a pinned accumulation) is kept.
  if (!layout.float8.empty()) float8 = {layout.float8.c_str()};
  if (!layout.fsdp_accumulate.empty()) accumulate = {layout.fsdp_accumulate.c_str()};
  for (const char* ac : {"none", "selective", "full"}) {
    for (const char* reshard : {"", "never"}) {
      if (*reshard != '\0' && !fsdp) continue;
      for (const char* acc : accumulate) {
        for (const char* f8 : float8) {
          Layout v = layout;
          v.ac_mode = ac;
          v.reshard_after_forward = reshard;
          v.float8 = f8;
          v.fsdp_accumulate = acc;
          out.push_back(std::move(v));
        }
      }
    }
  }
  return out;
}

Priced fastest_fitting(const models::ModelSpec& spec, const models::ModelArgs& args, const ModelShape& shape,
                       const train::JobConfig& config, const Layout& layout, const Cluster& cluster,
                       double capacity_gib, bool fixed) {
  const std::vector<Layout> variants = fixed ? std::vector<Layout>{layout} : memory_variants(layout, cluster, shape, config);
  train::JobConfig c = config;  // one scratch copy; each variant resets what it sets
  auto configure = [&](const Layout& v) {
    c.activation_checkpoint = config.activation_checkpoint;
    c.parallelism.fsdp_reshard_after_forward = config.parallelism.fsdp_reshard_after_forward;
    c.float8.enable = config.float8.enable;
    v.apply_to(c);
  };
  // The times first (cheap), then the memory from the fastest down, stopping at the first that
  // fits: the same choice as evaluating them all, at a fraction of the memory model's calls.
  std::vector<std::pair<TimeEstimate, const Layout*>> by_speed;
  for (const Layout& v : variants) {
    configure(v);
    by_speed.emplace_back(estimate_time(spec, args, shape, c, v, cluster), &v);
  }
  std::stable_sort(by_speed.begin(), by_speed.end(), [](const auto& a, const auto& b) {
    return a.first.tokens_per_device_s > b.first.tokens_per_device_s;
  });
  const auto fits_in = [&](const MemoryEstimate& m) {
    return capacity_gib <= 0 ||
           static_cast<double>(m.peak) * cluster.allocator_reserve / (1024.0 * 1024.0 * 1024.0) <= capacity_gib;
  };
  // Full AC keeps the least under every other setting (resharding "never" and accumulating
  // unsharded only add buffers; Float8 changes no memory): when none of the full-AC variants fits,
  // none fits, and the smallest is among them -- the other variants' memory is not computed. (Most
  // layouts of a large search fit nowhere: 93,280 of DeepSeek-V3's 143,900 on 1,024 GPUs.)
  if (capacity_gib > 0 && by_speed.size() > 1) {
    std::optional<Priced> least;
    bool some_full_fits = false, any_full = false;
    for (const auto& [time, v] : by_speed) {
      if (v->ac_mode != "full") continue;
      any_full = true;
      configure(*v);
      const MemoryEstimate m = estimate_memory(shape, args, c, *v);
      if (fits_in(m)) {
        some_full_fits = true;
        break;
      }
      if (!least || m.peak < least->memory.peak) least = Priced{*v, time, m, false};
    }
    if (any_full && !some_full_fits) return *least;
  }
  std::optional<Priced> smallest;
  for (const auto& [time, v] : by_speed) {
    configure(*v);
    const MemoryEstimate m = estimate_memory(shape, args, c, *v);
    if (fits_in(m)) return Priced{*v, time, m, true};
    if (!smallest || m.peak < smallest->memory.peak) smallest = Priced{*v, time, m, false};
  }
  return *smallest;
}

}  // namespace loom::plan
