#include "loom/plan/plan_cli.h"

#include <cmath>
#include <c10/util/StringUtil.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>

#include "loom/core/error.h"
#include "loom/core/timer.h"
#include "loom/data/tokenizer.h"
#include "loom/plan/memory_model.h"
#include "loom/plan/published.h"
#include "loom/plan/ranking.h"
#include "loom/plan/search.h"
#include "loom/plan/time_model.h"
#include "loom/train/config.h"
#include "loom/train/layout_check.h"

namespace loom::plan {
namespace {

struct PlanOptions {
  std::string config = "configs/llama3_debug.toml";
  int world_size = 1;
  int devices_per_node = 8;
  double memory_gib = 0;  // 0: no capacity filter
  int top = 10;
  bool explain = false;
  bool json = false;
  std::string cluster;  // "h100" / "h200": rank by predicted tokens/s; empty: by peak memory
  bool fixed_memory_settings = false;  // keep the config's AC and resharding (else chosen per layout)
  Cluster::Overrides cluster_overrides;  // explicit constants over the preset's or the measured ones
  std::string fsdp_accumulate;  // --fsdp-accumulate: "on" / "off" for --explain's layout (Layout::fsdp_accumulate)
  bool ep_node_dedup = false;   // --ep-node-dedup: price EP's dispatch as DeepEP's (Cluster::ep_node_dedup)
};

// The cluster named by --cluster (measured for "cpu"), with the constants given explicitly.
Cluster cluster_of(const PlanOptions& o) {
  const Cluster::Overrides& given = o.cluster_overrides;
  Cluster c = o.cluster == "cpu" ? Cluster::this_cpu(given.peak_flops, given.peak_flops_all_cores)
                                 : Cluster::preset(o.cluster);
  Cluster::Overrides over = o.cluster_overrides;
  // --devices-per-node shapes the search (TP inside a node) and the links the time model prices
  // (NVLink inside a node, InfiniBand across); a CPU host is one node whatever it says.
  over.devices_per_node = o.cluster == "cpu" ? -1 : o.devices_per_node;
  c = c.with(over);
  c.ep_node_dedup = o.ep_node_dedup;
  return c;
}

nlohmann::json cluster_json(const Cluster& c) {
  return {{"name", c.name}, {"peak_flops", c.peak_flops}, {"peak_flops_all_cores", c.peak_flops_all_cores},
          {"efficiency", c.efficiency}, {"allocator_reserve", c.allocator_reserve}, {"intra_node_bw", c.intra_node_bw}, {"inter_node_bw", c.inter_node_bw},
          {"intra_latency", c.intra_latency}, {"inter_latency", c.inter_latency},
          {"blocking_call_s", c.blocking_call_s}, {"shared_host_efficiency", c.shared_host_efficiency},
          {"shm_bw", c.shm_bw}, {"shm_call_s", c.shm_call_s}, {"float8_gemm_speedup", c.float8_gemm_speedup},
          {"ep_node_dedup", c.ep_node_dedup}, {"ep_inter_node_bw", c.ep_inter_node_bw},
          {"cores", c.cores}};
}

double as_gib(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0); }

nlohmann::json estimate_json(const MemoryEstimate& m) {
  return {{"parameters_gib", as_gib(m.parameters)},   {"gradients_gib", as_gib(m.gradients)},
          {"optimizer_gib", as_gib(m.optimizer_state)}, {"activations_gib", as_gib(m.activations)},
          {"buffers_gib", as_gib(m.buffers_in_flight)}, {"peak_gib", as_gib(m.peak)},
          {"pipeline_rank", m.pipeline_rank}, {"rank_peaks_gib", [&] {
            std::vector<double> out;
            for (int64_t b : m.rank_peaks) out.push_back(as_gib(b));
            return out;
          }()}};
}

// The model's embedding rows as the run would have them: model.vocab_size, else the tokenizer's
// vocabulary when its file is there, else the flavor's.
int64_t vocab_of(const train::JobConfig& config) {
  if (config.model.vocab_size > 0) return config.model.vocab_size;
  if (!config.model.tokenizer_path.empty() && std::filesystem::is_regular_file(config.model.tokenizer_path)) {
    return data::Tokenizer::from_file(config.model.tokenizer_path).vocab_size();
  }
  return 0;
}

// --explain with --cluster: the layout with the fastest of its memory settings that fits, its rank
// among every layout training accepts for the same model, devices and batch (each at its own
// fastest fitting settings), and the nearest published row.
template <typename PrintStep>
void explain_ranking(const PlanOptions& o, const train::JobConfig& config, const models::ModelSpec& spec,
                     const models::ModelArgs& args, const ModelShape& shape, const Layout& layout, const Cluster& cluster,
                     int64_t vocab, const PrintStep& print_step) {
  const double capacity = o.memory_gib > 0 ? o.memory_gib : cluster.memory_gib;
  // The config's precision holds for every layout compared: Float8 as the config sets it.
  Layout given = layout;
  given.float8 = config.float8.enable ? "on" : "off";
  const Priced mine = fastest_fitting(spec, args, shape, config, given, cluster, capacity, o.fixed_memory_settings);
  if (!o.fixed_memory_settings) {
    std::printf("with the fastest memory settings that fit%s: %s\n",
                capacity > 0 ? c10::str(" ", capacity, " GiB").c_str() : "", mine.layout.describe().c_str());
    print_step(mine.fits ? "  predicted step" : "  predicted step (does not fit)", mine.time);
  }
  if (config.training.global_batch_size > 0) {
    const Ranking ranking = rank_layout(spec, args, shape, config, given, cluster, capacity, o.world_size,
                                        o.devices_per_node, vocab, o.fixed_memory_settings);
    if (!ranking.fitting.empty()) {
      const Priced& best = ranking.fitting.front();
      std::printf("rank among the %zu layouts that fit (of %lld training accepts): %lld (top %.1f %%); the fastest: "
                  "%.0f tokens/s per device, %s\n",
                  ranking.fitting.size(), static_cast<long long>(ranking.accepted), static_cast<long long>(ranking.rank),
                  100.0 * ranking.top_fraction(), best.time.tokens_per_device_s, best.layout.describe().c_str());
      print_step("  its step", best.time);
    }
  }
  if (const PublishedRow* row = nearest_published(config.model.name, config.model.flavor, o.world_size,
                                                  config.training.seq_len, config.training.global_batch_size,
                                                  mine.layout.float8 == "on" ||
                                                      (mine.layout.float8.empty() && config.float8.enable))) {
    std::printf("nearest published row: %s %s on %d GPUs, seq %lld, global batch %lld, %s: %.0f tokens/s per GPU "
                "(%s); this layout predicted %.0f (%+.1f %%)\n",
                row->model.c_str(), row->flavor.c_str(), row->gpus, static_cast<long long>(row->seq_len),
                static_cast<long long>(row->global_batch), row->layout.c_str(), row->tokens_per_gpu_s, row->source.c_str(),
                mine.time.tokens_per_device_s,
                100 * (mine.time.tokens_per_device_s - row->tokens_per_gpu_s) / row->tokens_per_gpu_s);
  }
}

void run_plan(const PlanOptions& o, const std::vector<std::string>& overrides) {
  Timer timer;
  LOOM_REQUIRE_USAGE(o.world_size >= 1, "--world-size must be at least 1, got ", o.world_size);
  LOOM_REQUIRE_USAGE(o.top >= 1, "--top must be at least 1, got ", o.top);
  LOOM_REQUIRE_USAGE(o.memory_gib >= 0, "--memory-gib must be >= 0 (0: no limit), got ", o.memory_gib);
  LOOM_REQUIRE_USAGE(o.devices_per_node >= 1, "--devices-per-node must be at least 1, got ", o.devices_per_node);
  // `loom launch` starts the same number of ranks on every node.
  LOOM_REQUIRE_USAGE(o.world_size <= o.devices_per_node || o.world_size % o.devices_per_node == 0, "--world-size ",
                     o.world_size, " is not a multiple of --devices-per-node ", o.devices_per_node,
                     ": every node runs the same number of ranks; use a world size that is a multiple of ",
                     o.devices_per_node, " or a --devices-per-node that divides ", o.world_size);
  train::JobConfig config = train::load_job_config(o.config, overrides);
  const int64_t vocab = vocab_of(config);
  const models::ModelSpec& spec = models::get_spec(config.model.name);
  const auto args = spec.build_args(models::model_request(config.model, config.checkpoint.initial_load_path, vocab, config.training.seq_len));
  const ModelShape shape = ModelShape::of(spec, *args);

  if (o.explain) {
    // The config's own layout, checked as training checks it.
    const train::CheckedLayout checked = train::check_layout(config, o.world_size, 0, spec, [&]() -> const models::ModelArgs& { return *args; });
    const auto& d = *checked.dims;
    Layout layout;
    layout.dp_replicate = d.dp_replicate();
    layout.dp_shard = d.dp_shard();
    layout.cp = d.cp();
    layout.tp = d.tp();
    layout.pp = d.pp();
    layout.ep = d.ep();
    layout.schedule = d.pp() > 1 ? config.parallelism.pipeline_parallel_schedule : "";
    layout.microbatch_size = config.parallelism.pipeline_parallel_microbatch_size;
    layout.local_batch_size = config.training.local_batch_size;
    layout.grad_accum_steps = checked.grad_accum_steps;
    layout.fsdp_accumulate = o.fsdp_accumulate;
    const train::JobConfig requested = config;  // before the layout's settings
    layout.apply_to(config);
    const MemoryEstimate m = estimate_memory(shape, *args, config, layout);
    TimeEstimate time;
    Cluster cluster;
    if (!o.cluster.empty()) {
      cluster = cluster_of(o);
      time = estimate_time(spec, *args, shape, config, layout, cluster);
    }
    if (o.json) {
      nlohmann::json j = estimate_json(m);
      j["layout"] = layout.describe();
      if (!o.cluster.empty()) {
        j["tokens_per_device_s"] = time.tokens_per_device_s;
        j["step_s"] = time.step_s;
        j["compute_s"] = time.compute_s;
        j["bubble_s"] = time.bubble_s;
        j["pp_s"] = time.pp_s;
        j["tp_s"] = time.tp_s;
        j["fsdp_exposed_s"] = time.fsdp_exposed_s;
        j["dp_exposed_s"] = time.dp_exposed_s;
        j["cp_exposed_s"] = time.cp_exposed_s;
        j["ep_s"] = time.ep_s;
        j["binding"] = time.binding;
        j["cluster"] = cluster_json(cluster);
      }
      std::printf("%s\n", j.dump().c_str());
      return;
    }
    std::printf("%s %s on %d devices: %s\n", config.model.name.c_str(), config.model.flavor.c_str(), o.world_size,
                layout.describe().c_str());
    std::printf("predicted memory per device (pipeline rank %d, the highest): %s\n", m.pipeline_rank,
                m.describe().c_str());
    if (!o.cluster.empty()) {
      const auto print_step = [&](const char* what, const TimeEstimate& t) {
        std::printf("%s on %s: %.3f s = compute %.3f + bubble %.3f + pipeline exchanges %.3f + TP %.3f + "
                    "FSDP %.3f + replicas %.3f + CP %.3f + EP %.3f; %.0f tokens/s per device, MFU %.1f %%; bound by %s\n",
                    what, o.cluster.c_str(), t.step_s, t.compute_s, t.bubble_s, t.pp_s, t.tp_s, t.fsdp_exposed_s,
                    t.dp_exposed_s, t.cp_exposed_s, t.ep_s, t.tokens_per_device_s, 100 * t.mfu, t.binding.c_str());
      };
      print_step("predicted step", time);
      explain_ranking(o, requested, spec, *args, shape, layout, cluster, vocab, print_step);
    }
    return;
  }

  SearchRequest request;
  request.base = config;
  request.world_size = o.world_size;
  request.devices_per_node = o.devices_per_node;
  request.vocab_size = vocab;
  LOOM_REQUIRE_USAGE(config.training.global_batch_size > 0, "loom plan needs the global batch: set "
                     "--training.global_batch_size (rows of training.seq_len tokens per optimizer step)");
  const SearchResult found = enumerate_layouts(request);
  struct Row {
    Layout layout;
    MemoryEstimate memory;
    TimeEstimate time;
  };
  const bool timed = !o.cluster.empty();
  const Cluster cluster = !timed ? Cluster{} : cluster_of(o);
  const double capacity = o.memory_gib > 0 ? o.memory_gib : timed ? cluster.memory_gib : 0;
  std::vector<Row> rows;
  std::optional<Row> smallest;  // the least memory of every variant, for "nothing fits"
  for (const Layout& layout : found.layouts) {
    // Ranked by time, each layout runs with the fastest of its memory settings that fits
    // (fastest_fitting); by memory, as the config sets it.
    if (timed) {
      const Priced priced = fastest_fitting(spec, *args, shape, config, layout, cluster, capacity, o.fixed_memory_settings);
      if (!smallest || priced.memory.peak < smallest->memory.peak) smallest = Row{priced.layout, priced.memory, priced.time};
      if (priced.fits) rows.push_back(Row{priced.layout, priced.memory, priced.time});
      continue;
    }
    train::JobConfig c = config;
    layout.apply_to(c);
    const MemoryEstimate m = estimate_memory(shape, *args, c, layout);
    if (!smallest || m.peak < smallest->memory.peak) smallest = Row{layout, m, TimeEstimate{}};
    if (capacity > 0 && as_gib(m.peak) > capacity) continue;
    rows.push_back(Row{layout, m, TimeEstimate{}});
  }
  // Nothing to print is no result: say why, and what would fit.
  LOOM_REQUIRE_USAGE(!found.layouts.empty(), "no layout of ", config.model.name, " ", config.model.flavor, " on ",
                     o.world_size, " devices passes training's checks (", found.candidates,
                     " tried); try another --world-size or training.global_batch_size");
  LOOM_REQUIRE_USAGE(!rows.empty(), "no layout of ", config.model.name, " ", config.model.flavor, " on ", o.world_size,
                     " devices fits in ", capacity, " GiB per device: the smallest needs ",
                     c10::str(std::round(as_gib(smallest->memory.peak) * 100) / 100), " GiB",
                     timed && cluster.allocator_reserve > 1 ? c10::str(" x the allocator reserve ", cluster.allocator_reserve) : "",
                     " (", smallest->layout.describe(), "); raise --memory-gib, add devices, or shorten training.seq_len");
  if (timed) {
    std::stable_sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) {
      return a.time.tokens_per_device_s > b.time.tokens_per_device_s;
    });
  } else {
    std::stable_sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) { return a.memory.peak < b.memory.peak; });
  }
  if (o.json) {
    nlohmann::json j = nlohmann::json::array();
    for (const Row& row : rows) {
      nlohmann::json e = estimate_json(row.memory);
      e["layout"] = row.layout.describe();
      if (timed) {
        e["tokens_per_device_s"] = row.time.tokens_per_device_s;
        e["mfu"] = row.time.mfu;
        e["binding"] = row.time.binding;
      }
      e["overrides"] = row.layout.overrides();
      j.push_back(e);
    }
    std::printf("%s\n", j.dump().c_str());
    return;
  }
  std::printf("%s %s, seq %lld, global batch %lld rows, on %d devices (%d per node): %zu layouts training accepts "
              "(of %lld tried), %zu within %s; ranked by %s (%.2f s)\n",
              config.model.name.c_str(), config.model.flavor.c_str(), static_cast<long long>(config.training.seq_len),
              static_cast<long long>(config.training.global_batch_size), o.world_size, o.devices_per_node,
              found.layouts.size(), static_cast<long long>(found.candidates), rows.size(),
              capacity > 0 ? c10::str(capacity, " GiB").c_str() : "any memory",
              timed ? c10::str("predicted tokens/s per device on ", cluster.name).c_str()
                    : "predicted peak memory per device (give --cluster to rank by time)",
              timer.seconds());
  if (timed) {
    std::printf("%4s  %10s  %6s  %9s  %-24s  %s\n", "#", "tokens/s", "MFU", "peak GiB", "binding", "layout");
  } else {
    std::printf("%4s  %9s  %9s  %9s  %9s  %s\n", "#", "peak GiB", "params", "optim", "activ.", "layout");
  }
  for (size_t i = 0; i < rows.size() && static_cast<int>(i) < o.top; ++i) {
    const MemoryEstimate& m = rows[i].memory;
    if (timed) {
      std::printf("%4zu  %10.0f  %5.1f%%  %9.2f  %-24s  %s\n", i + 1, rows[i].time.tokens_per_device_s,
                  100 * rows[i].time.mfu, as_gib(m.peak), rows[i].time.binding.c_str(),
                  rows[i].layout.describe().c_str());
    } else {
      std::printf("%4zu  %9.2f  %9.2f  %9.2f  %9.2f  %s\n", i + 1, as_gib(m.peak), as_gib(m.parameters),
                  as_gib(m.optimizer_state), as_gib(m.activations), rows[i].layout.describe().c_str());
    }
  }
  if (!rows.empty()) {
    // One node: its ranks; several: the same command on every node, each with its --node-rank.
    const int per_node = std::min(o.world_size, o.devices_per_node);
    const int nodes = (o.world_size + per_node - 1) / per_node;
    std::string cmd = nodes > 1 ? c10::str("loom launch --nproc ", per_node, " --nnodes ", nodes,
                                           " --node-rank <0..", nodes - 1, "> --master-addr <node 0>")
                                : c10::str("loom launch --nproc ", per_node);
    cmd += " -- train --config " + o.config;
    for (const std::string& flag : overrides) cmd += " " + flag;
    for (const std::string& flag : rows.front().layout.overrides()) cmd += " " + flag;
    std::printf("first: %s\n", cmd.c_str());
  }
}

}  // namespace

void register_plan_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("plan", "Parallel layouts of a run on N devices, with their memory per device");
  auto o = std::make_shared<PlanOptions>();
  cmd->add_option("--config", o->config, "TOML job config: the model, seq_len, global batch, optimizer, precision")
      ->capture_default_str();
  cmd->add_option("--world-size", o->world_size, "Devices in all")->capture_default_str();
  cmd->add_option("--devices-per-node", o->devices_per_node, "Devices per node (TP stays inside one)")
      ->capture_default_str();
  cmd->add_option("--memory-gib", o->memory_gib, "Keep layouts whose predicted peak fits (0: no filter, or "
                  "with --cluster the device's memory)")
      ->capture_default_str();
  cmd->add_option("--top", o->top, "Rows to print")->capture_default_str();
  cmd->add_flag("--explain", o->explain, "Break down the memory of the config's own layout");
  cmd->add_option("--cluster", o->cluster, "h100, h200 or cpu (this machine, one thread per rank): rank by "
                  "predicted tokens/s per device (memory capacity from the device unless --memory-gib)");
  cmd->add_flag("--fixed-memory-settings", o->fixed_memory_settings,
                "With --cluster: keep the config's activation checkpointing and FSDP resharding instead of "
                "choosing, per layout, the fastest that fits (AC none / selective per op / full; reshard "
                "after forward as configured or never; Float8 on or off where the devices have float8 GEMMs)");
  // The cluster's constants given explicitly (-1: the preset's, or for cpu the measured ones):
  // a cluster the presets do not describe, or one `--explain --json` measured, reused as is. A
  // given value must be a finite number > 0 (>= 0 for the latencies and per-call costs): a
  // negative one would otherwise read as "not given" and be silently replaced.
  auto& co = o->cluster_overrides;
  const auto finite = [](bool allow_zero) {
    return CLI::Validator(
        [allow_zero](std::string& text) -> std::string {
          double v = 0;
          try {
            size_t used = 0;
            v = std::stod(text, &used);
            if (used != text.size()) return "'" + text + "' is not a number";
          } catch (const std::exception&) {
            return "'" + text + "' is not a number";
          }
          if (!std::isfinite(v) || v < 0 || (!allow_zero && v == 0)) {
            return c10::str("must be a finite number ", allow_zero ? ">= 0" : "> 0", ", got ", text);
          }
          return {};
        },
        allow_zero ? "NUMBER >= 0" : "NUMBER > 0");
  };
  const CLI::Validator positive = finite(false), non_negative = finite(true);
  cmd->add_option("--peak-flops", co.peak_flops, "With --cluster: dense FLOP/s per device (cpu: one thread's)")->check(positive);
  cmd->add_option("--peak-flops-all-cores", co.peak_flops_all_cores, "With --cluster cpu: the GEMM rate with every core")->check(positive);
  cmd->add_option("--efficiency", co.efficiency, "With --cluster: the share of the peak the model's compute reaches")->check(positive);
  cmd->add_option("--allocator-reserve", co.allocator_reserve, "With --cluster: device memory reserved per byte "
                  "the memory model counts allocated (a layout fits when peak x this <= the memory)")->check(positive);
  cmd->add_option("--intra-node-bw", co.intra_node_bw, "With --cluster: ring bandwidth per device inside a node, bytes/s")->check(positive);
  cmd->add_option("--inter-node-bw", co.inter_node_bw, "With --cluster: bandwidth per device across nodes, bytes/s")->check(positive);
  cmd->add_option("--intra-latency", co.intra_latency, "With --cluster: seconds per ring hop inside a node")->check(non_negative);
  cmd->add_option("--inter-latency", co.inter_latency, "With --cluster: seconds per ring hop across nodes")->check(non_negative);
  cmd->add_option("--blocking-call-s", co.blocking_call_s,
                  "With --cluster: seconds a blocking collective costs beyond its bytes (CPU ranks sharing cores)")->check(non_negative);
  cmd->add_option("--shared-host-efficiency", co.shared_host_efficiency,
                  "With --cluster: the rate per token of ranks sharing a host, relative to one process alone")->check(positive);
  cmd->add_option("--shm-bw", co.shm_bw,
                  "With --cluster cpu: bytes/s of the shared-memory collectives between a host's ranks")->check(positive);
  cmd->add_option("--shm-call-s", co.shm_call_s,
                  "With --cluster cpu: seconds a blocking shared-memory collective costs beyond its bytes")->check(non_negative);
  cmd->add_option("--float8-speedup", co.float8_gemm_speedup,
                  "With --cluster: how much faster the blocks' linears run under Float8 than in bf16 (the GPU "
                  "presets: 1.434, torchao's Float8 as Loom runs it; Transformer Engine's FP8: 2, the H100's "
                  "FP8/BF16 peak ratio; 0: no float8 GEMMs)")->check(non_negative);
  cmd->add_option("--fsdp-accumulate", o->fsdp_accumulate,
                  "With --explain: price FSDP keeping the gathered parameters and unsharded gradients across the "
                  "step's micro-batches, one gather and one reduce per step (on), or per micro-batch (off); unset: "
                  "the planner tries both")
      ->check(CLI::IsMember({"on", "off"}));
  cmd->add_flag("--ep-node-dedup", o->ep_node_dedup,
                "With --cluster: price expert parallelism's dispatch as DeepEP's (a token crosses to each remote "
                "node once, at --ep-inter-node-bw) instead of Loom's all-to-all (a row per token and expert)");
  cmd->add_option("--ep-inter-node-bw", co.ep_inter_node_bw,
                  "With --ep-node-dedup: DeepEP's bytes/s per device across nodes (the GPU presets: 50e9, its "
                  "published line rate on a 400 Gb/s NIC)")->check(positive);
  cmd->add_flag("--json", o->json, "Print JSON");
  cmd->allow_extras();
  cmd->footer("Config keys can be overridden: --section.key=value (see docs/config.md).");
  cmd->callback([cmd, o] { run_plan(*o, cmd->remaining()); });
}

}  // namespace loom::plan
