// Step time and tokens/s per device of one layout on a cluster, from the model's FLOPs, Loom's
// communication volumes and the pipeline schedule's bubble (issue 29, first version):
//   compute    FLOPs per token (the model's spec, TorchTitan's formula) x tokens per device x the
//              recompute of activation checkpointing, at peak x efficiency (one fitted number per
//              device kind); on accelerators, routed experts' GEMMs of few rows (tokens x ep x
//              top-k / experts per micro-batch) slowed by the per-GEMM curve measured on the H200;
//   TP         per layer and micro-step, sequence parallel's all-gathers and reduce-scatters of the
//              activations (8 per layer forward + backward, 4 more under full recompute), ring time
//              (t-1)/t x bytes / bandwidth + latency per hop, on the critical path;
//   FSDP       all-gathers (forward, and backward when resharded after forward) and reduce-scatters
//              of the rank's groups per micro-step; what the compute does not cover is exposed, plus
//              the first gather and the last reduce, which nothing covers;
//   HSDP/DDP   the all-reduce of the (sharded) gradients across replicas, behind the backward;
//   CP         the ring's key/value exchange per layer, mostly behind the attention;
//   EP         each MoE layer's dispatch and combine all-to-alls, forward and backward (and the
//              recomputed forward's under full AC): every token's k rows of dim, the (ep-1)/ep of
//              them bound for other ranks, on the critical path;
//   PP         the bubble of the schedule the run would execute (pipeline::simulate), and on CPU
//              ranks the cost of each blocking receive between stages;
//   blocking   on CPU ranks sharing a host, every blocking exchange over Gloo (CP's ring, PP's
//              receives, EP's all-to-alls) also costs Cluster::blocking_call_s: the ranks wait for
//              whichever the OS ran last; TP's all-gathers and reduce-scatters (and FSDP's, HSDP's)
//              go through shared memory (comm.shared_memory): Cluster::shm_bw and shm_call_s;
//   Float8     the blocks' linear layers (their share of the FLOPs: 6 x their weights per token)
//              run Cluster::float8_gemm_speedup times faster; the rest of the compute as before.
// Links: inside a node (NVLink) when a group fits in one, else across nodes (InfiniBand).
#pragma once
#include <optional>
#include <string>

#include "loom/models/spec.h"
#include "loom/plan/memory_model.h"
#include "loom/plan/search.h"
#include "loom/train/config.h"

namespace loom::plan {

struct Cluster {
  std::string name;
  double peak_flops = 0;        // dense bf16 FLOP/s per device
  double efficiency = 0.5;      // fraction of the peak the model's compute reaches (fitted)
  double memory_gib = 0;        // per device
  // What a run reserves on the device over the peak the memory model counts allocated (the caching
  // allocator's segments and fragmentation, the CUDA context, NCCL's buffers): a layout fits when
  // peak x allocator_reserve <= memory_gib. GPUs: 1.143, fitted on TorchTitan's Llama 3.1 8B,
  // 8-GPU row (82.4 GiB max reserved, Loom's model 72.08 GiB allocated) and checked on its
  // 128-GPU row (67.0 GiB against 58.06 x 1.143 = 66.4, -0.9 %) (docs/planner.md); 1 on the CPU,
  // where the model is checked against Loom's own tracker (bench/plan_memory.py).
  double allocator_reserve = 1;
  double intra_node_bw = 0;     // bytes/s per device, ring (algorithmic) bandwidth inside a node
  double inter_node_bw = 0;     // bytes/s per device across nodes
  double intra_latency = 0;     // seconds per ring hop
  double inter_latency = 0;
  int devices_per_node = 8;
  int cores = 0;                // CPU runs: ranks beyond this many share the cores (0: accelerators)
  double peak_flops_all_cores = 0;  // CPU: the GEMM rate with every core (a lone rank uses them all)
  // How much faster the blocks' linear layers run under Float8 (float8.enable: scaled float8 GEMMs
  // and their casts) than in bf16; 0: the devices have no float8 GEMMs (the CPU emulates them),
  // so the planner does not choose Float8 and the model does not price it. H100/H200: fitted on
  // TorchTitan's published 8B, 8-GPU Float8 row against the row without it (docs/planner.md): the
  // torchao class of Float8 that Loom's own runs have. Transformer Engine's FP8 (Megatron-Bridge's
  // published rows) is priced at 2, the H100's dense FP8 / BF16 peak ratio (1,979 / 989 TFLOP/s):
  // its FP8 GEMMs reaching the share of the FP8 peak its BF16 GEMMs reach of theirs, the casts
  // fused into the neighbouring kernels (`--float8-speedup 2`).
  double float8_gemm_speedup = 0;
  // CPU ranks that share a host's cores: what one blocking collective (a TP or CP exchange, a
  // pipeline send/recv, an EP all-to-all) costs beyond its bytes -- every rank waits for the one
  // the OS ran last, and Gloo's threads wake and copy on the same cores. Fitted on this machine's
  // TP 2 run (docs/planner.md); 0 for accelerators, whose per-call cost is the link latency.
  double blocking_call_s = 0;
  // CPU: the rate per token of ranks sharing the host, relative to one process alone (memory and
  // cache contention, the ranks' communication, loader and logging threads on the same cores).
  // Fitted on this machine's FSDP 2 run; 1 for accelerators.
  double shared_host_efficiency = 1;
  // CPU ranks of one host with comm.shared_memory on: their all-gathers, reduce-scatters and
  // all-reduces (TP, FSDP, HSDP/DDP) go through shared memory (distributed/shm_collectives.h), one
  // round per collective: priced at shm_bw (memcpy-bound, bytes/s per rank in the ring formula)
  // plus shm_call_s per blocking call (TP's: the hand-off between peers through a futex, and the
  // wait for the peer the OS ran last), instead of the Gloo terms above. 0: no such transport
  // (accelerators, or comm.shared_memory = false: Gloo's terms apply).
  double shm_bw = 0;
  double shm_call_s = 0;
  // How expert parallelism's dispatch and combine cross nodes. false: Loom's all-to-all
  // (ep/expert_parallel.cpp), one row per (token, chosen expert) to the expert's rank, every
  // remote node's rows over the sender's NIC. true: DeepEP's (the published NeMo AutoModel and
  // Megatron MoE runs): a token crosses to each node holding any of its experts once, over RDMA
  // to the same-rail GPU, and NVLink fans it out there -- with group-limited routing (DeepSeek-V3:
  // 4 of 8 groups) to at most that many nodes. Both are priced on the critical path: neither
  // Loom's schedule nor the published configurations overlap them with compute.
  bool ep_node_dedup = false;
  // DeepEP's bytes/s per device across nodes (with ep_node_dedup): its RDMA kernels reach the
  // NIC's line rate where NCCL's rings reach inter_node_bw -- 50 GB/s on a 400 Gb/s CX7, DeepEP's
  // published internode measurement at EP 64 (docs/planner.md). 0: inter_node_bw.
  double ep_inter_node_bw = 0;
  // "h100" (SXM, 80 GB, NVLink 4, 400 Gb/s InfiniBand per GPU) or "h200" (141 GB); a UsageError
  // lists the known ones. Efficiency: fitted on TorchTitan's published Llama 3.1 8B row
  // (docs/planner.md).
  static Cluster preset(const std::string& name);
  // This machine's CPU cores as the devices of a run with one intra-op thread per rank: the peak
  // is the CPU's own (cpu_spec_peak_fp32_flops, times the cores for all of them), measured as the
  // best fp32 GEMM rate (train::measure_peak_fp32_flops) only where it cannot be read (not x86);
  // efficiency, shared host and the per-call costs are fitted on this machine (docs/planner.md).
  // Peaks given (> 0) are taken as they are.
  static Cluster this_cpu(double peak_flops = -1, double peak_flops_all_cores = -1);
  // The preset or measured cluster with the constants given explicitly (`loom plan --peak-flops
  // ...`): a negative field keeps the cluster's own.
  struct Overrides {
    double peak_flops = -1, efficiency = -1, memory_gib = -1, allocator_reserve = -1, intra_node_bw = -1, inter_node_bw = -1,
           intra_latency = -1, inter_latency = -1, blocking_call_s = -1, peak_flops_all_cores = -1,
           shared_host_efficiency = -1, shm_bw = -1, shm_call_s = -1, float8_gemm_speedup = -1,
           ep_inter_node_bw = -1;
    int devices_per_node = -1;
  };
  Cluster with(const Overrides& o) const;
};

// An x86 CPU's fp32 peak per core from its /proc/cpuinfo text (the first processor's flags, vendor,
// family and "cpu MHz") and, when non-empty, cpufreq's cpuinfo_max_freq (kHz), which wins over
// the MHz: two FMA pipes of the widest vector unit (AVX2 + FMA: 32 FLOPs a cycle; AVX-512: 64,
// except AMD's Zen 4, which splits them: 32; AVX: 16; SSE: 8) times the clock. nullopt without x86
// flags or a clock (the caller measures instead).
std::optional<double> cpu_spec_peak_fp32_flops(const std::string& cpuinfo, const std::string& max_freq_khz);

struct TimeEstimate {
  double compute_s = 0;
  double bubble_s = 0;
  double pp_s = 0;  // the pipeline's blocking receives (CPU ranks: Cluster::blocking_call_s each)
  double tp_s = 0;
  double fsdp_exposed_s = 0;
  double dp_exposed_s = 0;
  double cp_exposed_s = 0;
  double ep_s = 0;
  double step_s = 0;
  double tokens_per_device_s = 0;
  double mfu = 0;
  std::string binding;  // the largest term: "compute", "pipeline bubble", "TP", "FSDP", ...
};

// The share of a token's training FLOPs in the blocks' dense linear layers (what Float8 converts:
// not the embedding, the output head or routed experts), from the model's shapes.
double linear_flop_fraction(const models::ModelSpec& spec, const models::ModelArgs& args, const ModelShape& shape,
                            int64_t seq_len);
// Whether every converted linear's local dims are multiples of 16 under the layout's TP split
// (float8 GEMMs need it; float8::convert refuses the model otherwise).
bool float8_fits(const ModelShape& shape, const Layout& layout);

TimeEstimate estimate_time(const models::ModelSpec& spec, const models::ModelArgs& args, const ModelShape& shape,
                           const train::JobConfig& config, const Layout& layout, const Cluster& cluster);

// The memory-for-speed settings tried on a layout when ranking by time: activation checkpointing
// none / per-op selective / full; where FSDP shards within one pipeline stage, resharding after
// forward as configured or never; where FSDP runs several micro-batches a step, accumulating
// unsharded (Layout::fsdp_accumulate) off or on; with float8 GEMMs on the cluster's devices (and
// linears whose dims allow them), Float8 off or on.
std::vector<Layout> memory_variants(const Layout& layout, const Cluster& cluster, const ModelShape& shape,
                                    const train::JobConfig& config);

// One layout priced: its time and memory under the settings chosen, and whether it fits.
struct Priced {
  Layout layout;
  TimeEstimate time;
  MemoryEstimate memory;
  bool fits = false;
};
// The fastest of the layout's memory variants (only the layout as given with `fixed`) whose peak
// fits `capacity_gib` (0: any) with the cluster's allocator reserve (peak x allocator_reserve);
// when none fits, the one with the least memory, fits false.
// `config`: the run's settings; each variant is applied to a copy.
Priced fastest_fitting(const models::ModelSpec& spec, const models::ModelArgs& args, const ModelShape& shape,
                       const train::JobConfig& config, const Layout& layout, const Cluster& cluster,
                       double capacity_gib, bool fixed = false);

}  // namespace loom::plan
