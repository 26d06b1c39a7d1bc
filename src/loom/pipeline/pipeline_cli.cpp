// `loom pipeline {schedule,compare}`.
#include "loom/pipeline/pipeline_cli.h"

#include <cstdio>
#include <fstream>
#include <memory>

#include "loom/core/error.h"
#include "loom/pipeline/generators.h"
#include "loom/pipeline/simulator.h"

namespace loom::pipeline {

namespace {

void write_stdout(const std::string& s) {
  if (std::fwrite(s.data(), 1, s.size(), stdout) != s.size()) fail("cannot write to standard output");
}

const char* layout_name(StageLayout l) {
  switch (l) {
    case StageLayout::kLoop: return "looped";
    case StageLayout::kV: return "V-shape";
    case StageLayout::kCustom: return "custom";
  }
  return "?";
}

SendMode parse_send_mode(const std::string& s) {
  if (s == "async") return SendMode::kAsync;
  LOOM_REQUIRE_USAGE(s == "rendezvous", "--send-mode '", s, "' is not async or rendezvous");
  return SendMode::kRendezvous;
}

std::string join_ints(const std::vector<int>& v) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? " " : "") + std::to_string(v[i]);
  return out;
}

void register_schedule(CLI::App* parent) {
  struct Args {
    std::string schedule, csv, trace, dump_csv, costs, send_mode = "async";
    int pp = 0, microbatches = 0, stages_per_rank = 0;
    bool fsdp = false, compute_only = false;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = parent->add_subcommand(
      "schedule", "Print one pipeline schedule per rank and simulate it: bubble fraction, peak activations");
  auto* name = cmd->add_option("--schedule", args->schedule,
                               "GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV");
  auto* csv = cmd->add_option("--csv", args->csv,
                              "A hand-written schedule instead: one row per rank of actions such as 0F0,0F1,0B0 "
                              "(PyTorch's _load_csv format; send/recv are added unless present)");
  name->excludes(csv);
  cmd->add_option("--pp", args->pp, "Pipeline degree (ranks); with --csv, checked against its rows");
  cmd->add_option("--microbatches", args->microbatches, "Micro-batches per step");
  cmd->add_option("--stages-per-rank", args->stages_per_rank,
                  "Stages per rank v (default 1 for GPipe/1F1B, 2 otherwise)");
  cmd->add_option("--costs", args->costs,
                  "Action costs, e.g. F=1,B=2,I=1,W=1,send=0,recv=0,transfer=0,unshard=0,reshard=0,reduce_grad=0 (those are the "
                  "defaults)");
  cmd->add_option("--send-mode", args->send_mode,
                  "async: sends never block (PyTorch's runtime); rendezvous: a batch of sends waits for the "
                  "receiver to post its receives")
      ->capture_default_str();
  cmd->add_flag("--fsdp", args->fsdp, "Add FSDP UNSHARD/REDUCE_GRAD/RESHARD actions (each stage once per step)");
  cmd->add_flag("--compute-only", args->compute_only, "Print only F/B/I/W actions (the simulation still uses all)");
  cmd->add_option("--trace", args->trace, "Write the simulated timeline as Chrome-trace JSON (open in Perfetto)");
  cmd->add_option("--dump-csv", args->dump_csv, "Write the lowered schedule as CSV (loadable with --csv)");
  cmd->callback([args, name, csv] {
    LOOM_REQUIRE_USAGE(name->count() + csv->count() == 1, "pipeline schedule needs --schedule NAME or --csv FILE");
    Schedule s;
    if (csv->count()) {
      s = load_csv(args->csv);
      LOOM_REQUIRE_USAGE(args->pp == 0 || args->pp == s.num_ranks, "--pp ", args->pp, " but ", args->csv, " has ",
                         s.num_ranks, " rows (one per rank)");
      LOOM_REQUIRE_USAGE(args->microbatches == 0 || args->microbatches == s.num_microbatches, "--microbatches ",
                         args->microbatches, " but ", args->csv, " runs ", s.num_microbatches);
      if (args->fsdp && !s.has_fsdp_actions()) s = add_fsdp_actions(s);
      if (!s.has_communication() && s.num_ranks > 1) s = add_communication(s);
    } else {
      LOOM_REQUIRE_USAGE(args->pp >= 1 && args->microbatches >= 1,
                         "pipeline schedule --schedule needs --pp and --microbatches (>= 1)");
      s = build_schedule({args->schedule, args->pp, args->microbatches, args->stages_per_rank}, args->fsdp);
    }
    SimulationOptions options;
    if (!args->costs.empty()) options.costs = Costs::parse(args->costs);
    options.send_mode = parse_send_mode(args->send_mode);
    const SimulationResult r = simulate(s, options);

    std::string out = "schedule " + s.name + ": pp " + std::to_string(s.num_ranks) + ", " +
                      std::to_string(s.stages_per_rank) + " stage" + (s.stages_per_rank > 1 ? "s" : "") +
                      " per rank (" + std::to_string(s.num_stages()) + " stages, " + layout_name(s.layout) + "), " +
                      std::to_string(s.num_microbatches) + " micro-batches\n";
    out += "stages of each rank:";
    for (int k = 0; k < s.num_ranks; ++k) out += " [" + join_ints(s.stages_of(k)) + "]";
    out += "\n\n";
    Schedule shown = s;
    if (args->compute_only) {
      for (auto& list : shown.ranks) std::erase_if(list, [](const Action& a) { return !is_compute(a.kind); });
    }
    out += format_table(shown) + "\n";
    out += "costs: " + options.costs.str() + " (" + args->send_mode + " sends)\n";
    out += format_summary(r);
    write_stdout(out);
    if (!args->trace.empty()) {
      write_chrome_trace(r, args->trace);
      std::printf("trace: %s\n", args->trace.c_str());
    }
    if (!args->dump_csv.empty()) {
      std::ofstream f(args->dump_csv, std::ios::binary | std::ios::trunc);
      LOOM_REQUIRE_USAGE(f.good(), "cannot write '", args->dump_csv, "'");
      f << to_csv(s);
      std::printf("csv: %s\n", args->dump_csv.c_str());
    }
  });
}

void register_compare(CLI::App* parent) {
  struct Args {
    int pp = 4, microbatches = 8, stages_per_rank = 0;
    std::string costs;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = parent->add_subcommand("compare", "Simulate every schedule at one pp and micro-batch count");
  cmd->add_option("--pp", args->pp, "Pipeline degree (ranks)")->capture_default_str();
  cmd->add_option("--microbatches", args->microbatches, "Micro-batches per step")->capture_default_str();
  cmd->add_option("--stages-per-rank", args->stages_per_rank,
                  "v for the multi-stage schedules (default 2; the V schedules always use 2)");
  cmd->add_option("--costs", args->costs, "Action costs, e.g. F=1,B=2,I=1,W=1 (the defaults)");
  cmd->callback([args] {
    SimulationOptions options;
    if (!args->costs.empty()) options.costs = Costs::parse(args->costs);
    std::string out = "pp " + std::to_string(args->pp) + ", " + std::to_string(args->microbatches) +
                      " micro-batches, costs " + options.costs.str() + "\n";
    char line[512];
    // makespan is in units of one stage's forward; a rank's v stages share its layers, so
    // makespan / v is the step time in units of the forward of all of a rank's layers.
    std::snprintf(line, sizeof line, "%-22s %2s %9s %10s %8s  %s\n", "schedule", "v", "makespan", "makespan/v",
                  "bubble", "peak activations per rank");
    out += line;
    for (const std::string& n : schedule_names()) {
      int v = 1;
      if (is_multi_stage(n)) v = (n == "ZBVZeroBubble" || n == "DualPipeV") ? 2 : (args->stages_per_rank > 0 ? args->stages_per_rank : 2);
      try {
        const Schedule s = build_schedule({n, args->pp, args->microbatches, v});
        const SimulationResult r = simulate(s, options);
        std::snprintf(line, sizeof line, "%-22s %2d %9g %10g %8.4f  %s\n", n.c_str(), v, r.makespan, r.makespan / v,
                      r.bubble_fraction, join_ints(r.peak_activations).c_str());
      } catch (const UsageError& e) {
        std::snprintf(line, sizeof line, "%-22s %2d  not available: %s\n", n.c_str(), v, e.what());
      }
      out += line;
    }
    out += "(makespan: unit costs per stage action; makespan/v: in forwards of a rank's whole share of the layers; "
           "peak activations: (stage, micro-batch) pairs held at once)\n";
    write_stdout(out);
  });
}

}  // namespace

void register_pipeline_command(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand("pipeline", "Pipeline-parallel schedules: print, check and simulate them");
  cmd->require_subcommand(1);
  register_schedule(cmd);
  register_compare(cmd);
}

}  // namespace loom::pipeline
