#include "loom/layouts/check_layouts_cli.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <thread>

#include "loom/checkpoint/loader.h"
#include "loom/checkpoint/metadata.h"
#include "loom/checkpoint/state_dict.h"
#include "loom/core/device.h"
#include "loom/core/error.h"
#include "loom/core/error_report.h"
#include "loom/data/tokenizer.h"
#include "loom/layouts/activations.h"
#include "loom/layouts/compare.h"
#include "loom/layouts/layout_spec.h"
#include "loom/layouts/rank_run.h"
#include "loom/models/spec.h"
#include "loom/train/config.h"
#include "loom/train/layout_check.h"
#include "loom/train/training_data.h"

namespace loom::layouts {
namespace fs = std::filesystem;
namespace {

// How many ranks this machine runs: one per GPU on CUDA; on the CPU at most 4 per core (the
// suite's 8-rank jobs on 2 cores), and no more than fit in its memory at about
// 0.5 GiB per rank (a process with libtorch and the step's buffers) + 16 bytes per parameter
// (weights, gradients, AdamW's two moments, as if unsharded).
struct MachineLimits {
  bool cuda = false;
  int max_ranks = 1;
  int cores = 1;
  double memory_gib = 0;
};

MachineLimits machine_limits(const train::JobConfig& config) {
  MachineLimits m;
  const c10::Device device = select_device(config.training.device, 0, "training.device");
  m.cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  m.memory_gib = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE)) /
                 (1024.0 * 1024.0 * 1024.0);
  if (device.is_cuda()) {
    m.cuda = true;
    m.max_ranks = static_cast<int>(torch::cuda::device_count());
  } else {
    m.max_ranks = 4 * m.cores;
  }
  return m;
}

void check_machine_runs(const LayoutSpec& layout, const MachineLimits& m, int64_t parameters) {
  const int w = layout.world_size();
  if (m.cuda) {
    LOOM_REQUIRE_USAGE(w <= m.max_ranks, "layout '", layout.text, "' needs ", w, " ranks, one GPU each; this machine "
                       "has ", m.max_ranks, " GPUs");
    return;
  }
  LOOM_REQUIRE_USAGE(w <= m.max_ranks, "layout '", layout.text, "' needs ", w, " ranks; check-layouts runs at most 4 "
                     "ranks per core on the CPU (", m.cores, " cores here: ", m.max_ranks, " ranks)");
  const double need = w * (0.5 + 16.0 * static_cast<double>(parameters) / (1024.0 * 1024.0 * 1024.0));
  LOOM_REQUIRE_USAGE(need <= m.memory_gib, "layout '", layout.text, "' needs about ", need, " GiB for its ", w,
                     " ranks (0.5 GiB + 16 bytes per parameter each), more than this machine's ", m.memory_gib,
                     " GiB");
}

// The model's embedding rows as the run will have them (model.vocab_size, or the tokenizer's).
int64_t vocab_of(const train::JobConfig& config) {
  if (config.model.vocab_size > 0) return config.model.vocab_size;
  return data::Tokenizer::from_file(config.model.tokenizer_path).vocab_size();
}

// One run: the reference or a layout.
struct Run {
  LayoutSpec layout;
  std::string label;  // "reference" or "layout-<i>"
  fs::path dir;
  std::vector<std::string> overrides;  // after the config
  train::JobConfig config;
};

// The overrides every run gets after the user's and the layout's: deterministic mode, the step's
// values read back at every step, nothing but the training step (no checkpoints of its own, no
// validation, no TensorBoard), and the config's steps (at least `steps`), so the LR schedule is the
// one the config trains with. (The run folder is added when the run starts.)
std::vector<std::string> forced_overrides(int64_t steps, int64_t config_steps) {
  return {"--training.deterministic=true",
          "--training.step_readback=every_step",
          "--checkpoint.enable=false",
          "--validation.enable=false",
          "--metrics.enable_tensorboard=false",
          c10::str("--training.steps=", std::max(steps, config_steps))};
}

// The last line of a run's log that reports an error, else its last non-empty line.
std::string error_line(const fs::path& log) {
  std::ifstream in(log);
  std::string line, last, error;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    last = line;
    if (line.find("error:") != std::string::npos) error = line;
  }
  return error.empty() ? last : error;
}

// Runs `args` (this executable's arguments) with stdout and stderr in `log`; returns the exit code.
int run_child(const std::vector<std::string>& args, const fs::path& log) {
  const std::string exe = fs::read_symlink("/proc/self/exe").string();
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(exe.c_str()));
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::fflush(nullptr);
  const pid_t pid = fork();
  LOOM_REQUIRE(pid >= 0, "cannot start a run: fork failed");
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      ::close(fd);
    }
    // cuBLAS needs a fixed workspace to be deterministic; PyTorch's deterministic mode refuses its
    // matmuls without one. (The CPU ignores it.)
    setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", 0);
    execv(exe.c_str(), argv.data());
    _exit(127);
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

// Starts `run` (under `loom launch` when it has several ranks); with `probe_step` > 0 it records that
// step's activations instead. Throws loom::Error (UsageError for exit code 2) naming the run.
void start(const Run& run, const CheckOptions& o, int64_t probe_step) {
  const int w = run.layout.world_size();
  std::vector<std::string> args;
  if (w > 1) args = {"launch", "--nproc", std::to_string(w), "--"};
  args.insert(args.end(), {kRankCommand, "--out", run.dir.string(), "--steps", std::to_string(o.steps), "--config",
                           o.config});
  if (probe_step > 0) args.insert(args.end(), {"--probe-step", std::to_string(probe_step)});
  args.insert(args.end(), run.overrides.begin(), run.overrides.end());
  args.push_back("--job.dump_folder=" + run.dir.string());
  fs::create_directories(run.dir);
  if (probe_step > 0) fs::remove_all(run.dir / "probe");  // another step's records
  const fs::path log = run.dir / (probe_step > 0 ? "probe.log" : "run.log");
  const auto begin = std::chrono::steady_clock::now();
  std::printf("%s %s (%s, %d %s)", probe_step > 0 ? "re-running" : "running", run.label.c_str(),
              run.layout.text.c_str(), w, w == 1 ? "process" : "ranks");
  if (probe_step > 0) std::printf(" with hooks at step %lld", static_cast<long long>(probe_step));
  std::printf("...");
  std::fflush(stdout);
  const int code = run_child(args, log);
  std::printf(" %.1f s\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count());
  if (code == 0) return;
  const std::string what = c10::str(run.label, " (", run.layout.text, ") failed with exit code ", code, ": ",
                                    error_line(log), " (log: ", log.string(), ")");
  if (code == kExitUsage) throw UsageError(what);
  throw Error(what);
}

// Every tensor of component "model" of a checkpoint step folder, whole.
TensorMap load_whole(const fs::path& dir) {
  const auto meta = checkpoint::CheckpointMetadata::read(dir);
  checkpoint::ShardedStateDict state;
  TensorMap out;
  for (const auto& [name, t] : meta.tensors) {
    if (t.component != checkpoint::kModelComponent) continue;
    torch::Tensor whole = torch::empty(t.shape, torch::TensorOptions().dtype(t.dtype));
    state.add_full(name, t.component, whole);
    out[name] = whole;
  }
  checkpoint::load_checkpoint(dir, state, 0);
  return out;
}

std::vector<StepValues> read_steps(const fs::path& dir) {
  std::vector<StepValues> out;
  std::ifstream in(dir / "steps.jsonl");
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const auto j = nlohmann::json::parse(line);
    out.push_back({j.at("step").get<int64_t>(), j.at("loss").get<double>(), j.at("grad_norm").get<double>()});
  }
  return out;
}

std::string step_dir(int64_t step) { return "step-" + std::to_string(step); }

StepComparison compare_step(const Run& ref, const Run& got, const StepValues& r, const StepValues& g,
                            double tolerance) {
  StepComparison c;
  c.step = r.step;
  c.ref = r;
  c.got = g;
  c.loss_difference = relative_difference(r.loss, g.loss);
  c.norm_difference = relative_difference(r.grad_norm, g.grad_norm);
  c.gradient = worst_tensor(load_whole(ref.dir / "gradients" / step_dir(r.step)),
                            load_whole(got.dir / "gradients" / step_dir(r.step)));
  c.parameter = worst_tensor(load_whole(ref.dir / "checkpoint" / step_dir(r.step)),
                             load_whole(got.dir / "checkpoint" / step_dir(r.step)));
  c.verdict = verdict_of(c, tolerance);
  return c;
}

std::string short_number(double v) { return std::isnan(v) ? "nan" : c10::str(v); }

void print_header(const Run& run, const Run& ref, const CheckOptions& o) {
  std::printf("\nlayout %s (%d ranks) against the reference %s (%d %s); tolerance %g relative\n",
              run.layout.text.c_str(), run.layout.world_size(), ref.layout.text.c_str(), ref.layout.world_size(),
              ref.layout.world_size() == 1 ? "process" : "ranks", o.tolerance);
  std::printf("%4s  %-12s %-12s %-9s  %-12s %-12s %-9s  %-9s %-34s  %-9s %-34s  %s\n", "step", "loss ref", "loss",
              "diff", "norm ref", "norm", "diff", "grad diff", "worst gradient", "param diff", "worst updated parameter",
              "verdict");
}

void print_row(const StepComparison& c) {
  std::printf("%4lld  %-12.8g %-12.8g %-9.2e  %-12.8g %-12.8g %-9.2e  %-9.2e %-34s  %-9.2e %-34s  %s\n",
              static_cast<long long>(c.step), c.ref.loss, c.got.loss, c.loss_difference, c.ref.grad_norm,
              c.got.grad_norm, c.norm_difference, c.gradient.difference, c.gradient.name.c_str(),
              c.parameter.difference, c.parameter.name.c_str(), verdict_name(c.verdict));
}

nlohmann::json number(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(short_number(v)); }

nlohmann::json step_json(const StepComparison& c) {
  return {{"step", c.step},
          {"loss_ref", number(c.ref.loss)},
          {"loss", number(c.got.loss)},
          {"loss_diff", number(c.loss_difference)},
          {"grad_norm_ref", number(c.ref.grad_norm)},
          {"grad_norm", number(c.got.grad_norm)},
          {"grad_norm_diff", number(c.norm_difference)},
          {"worst_gradient", {{"name", c.gradient.name}, {"diff", number(c.gradient.difference)}}},
          {"worst_parameter", {{"name", c.parameter.name}, {"diff", number(c.parameter.difference)}}},
          {"verdict", verdict_name(c.verdict)}};
}

// Re-runs step `step` of `run` with hooks and returns its activations gathered whole.
StepActivations probe(const Run& run, const CheckOptions& o, int64_t step, int64_t rows,
                      std::vector<std::string>& notes) {
  start(run, o, step);
  std::vector<std::string> incomplete;
  StepActivations a = assemble(read_pieces(run.dir / "probe"), rows, run.config.training.seq_len, &incomplete);
  for (const auto& m : incomplete) notes.push_back(c10::str(run.label, ": ", m, "'s pieces do not tile [rows, seq]"));
  return a;
}

// Every module both runs recorded, in forward order: its output's and its output gradient's
// differences (printed, and returned for the JSON).
nlohmann::json module_table(const std::string& name, const StepActivations& ref, const StepActivations& got,
                            int64_t step, double tolerance) {
  std::printf("%s, step %lld with hooks: each recorded module's output and the gradient at it\n", name.c_str(),
              static_cast<long long>(step));
  std::printf("  %-28s %-12s %-12s\n", "module", "output diff", "grad diff");
  nlohmann::json rows = nlohmann::json::array();
  for (const std::string& m : ref.order) {
    if (!got.outputs.count(m)) {
      std::printf("  %-28s (not recorded in the layout)\n", m.c_str());
      continue;
    }
    const double out = relative_difference(ref.outputs.at(m), got.outputs.at(m));
    const bool has_grad = ref.grads.count(m) && got.grads.count(m);
    const double grad = has_grad ? relative_difference(ref.grads.at(m), got.grads.at(m)) : 0.0;
    const bool bad = !(out <= tolerance) || !(grad <= tolerance);
    char grad_text[32] = "-";
    if (has_grad) std::snprintf(grad_text, sizeof(grad_text), "%.2e", grad);
    std::printf("  %-28s %-12.2e %-12s%s\n", m.c_str(), out, grad_text, bad ? "  differs" : "");
    rows.push_back({{"module", m}, {"output_diff", number(out)}, {"grad_diff", has_grad ? number(grad) : nullptr}});
  }
  return rows;
}

}  // namespace

int check_layouts(const CheckOptions& o, const std::vector<std::string>& given) {
  // ---- Everything checked before anything runs ----
  LOOM_REQUIRE_USAGE(!o.layouts.empty(), "give at least one --layout, e.g. --layout \"pp=2,tp=2\"");
  LOOM_REQUIRE_USAGE(o.steps >= 1 && o.steps <= 1000, "--steps must be between 1 and 1000, got ", o.steps);
  LOOM_REQUIRE_USAGE(std::isfinite(o.tolerance) && o.tolerance > 0, "--tolerance must be a positive number, got ",
                     o.tolerance);
  LOOM_REQUIRE_USAGE(o.probe_step >= 0 && o.probe_step <= o.steps, "--probe-step must be a step from 1 to --steps (",
                     o.steps, "), got ", o.probe_step);
  std::vector<std::string> overrides;
  for (const auto& a : given) {
    if (a != "--") overrides.push_back(a);
  }
  check_extra_overrides(overrides);
  if (!o.work_dir.empty()) {
    std::error_code ec;
    LOOM_REQUIRE_USAGE(!fs::exists(o.work_dir, ec) || fs::is_empty(o.work_dir, ec), "--work-dir ", o.work_dir,
                       " is not empty; give a new or empty folder");
  }
  const LayoutSpec reference = parse_layout(o.reference);
  std::vector<LayoutSpec> layouts;
  for (const auto& text : o.layouts) layouts.push_back(parse_layout(text));

  const train::JobConfig base = train::load_job_config(o.config, overrides);
  const int64_t global_rows = base.training.local_batch_size * reference.dp_degree();
  const models::ModelSpec& spec = models::get_spec(base.model.name);
  std::unique_ptr<models::ModelArgs> args;
  auto model_args = [&]() -> const models::ModelArgs& {
    if (!args) args = spec.build_args(models::model_request(base.model, base.checkpoint.initial_load_path, vocab_of(base), base.training.seq_len));
    return *args;
  };
  const MachineLimits machine = machine_limits(base);

  std::vector<Run> runs;
  for (size_t i = 0; i <= layouts.size(); ++i) {
    Run run;
    run.layout = i == 0 ? reference : layouts[i - 1];
    run.label = i == 0 ? "reference" : c10::str("layout ", i);
    const int64_t local = i == 0 ? base.training.local_batch_size : local_batch_for(run.layout, global_rows);
    run.overrides = overrides;
    for (auto& s : run.layout.overrides(local)) run.overrides.push_back(std::move(s));
    for (auto& s : forced_overrides(o.steps, base.training.steps)) run.overrides.push_back(std::move(s));
    // Exactly what `loom train` checks before rendezvous (and `loom plan` for every layout).
    try {
      run.config = train::load_job_config(o.config, run.overrides);
      train::check_layout(run.config, run.layout.world_size(), 0, spec, model_args);
      train::check_training_inputs(run.config.training);  // what the Trainer checks next, before rendezvous
    } catch (const UsageError& e) {
      throw UsageError(c10::str(i == 0 ? "reference" : "layout", " '", run.layout.text, "': ", e.what()));
    }
    check_machine_runs(run.layout, machine, spec.count_parameters(model_args()).total);
    runs.push_back(std::move(run));
  }

  // The work folder (only now: bad input leaves nothing behind): the user's, or a temporary one.
  fs::path work;
  if (o.work_dir.empty()) {
    std::string templ = (fs::temp_directory_path() / "loom-check-layouts-XXXXXX").string();
    LOOM_REQUIRE(mkdtemp(templ.data()) != nullptr, "cannot create a temporary folder in ", fs::temp_directory_path());
    work = templ;
  } else {
    work = fs::absolute(o.work_dir);
  }
  const bool remove_work = o.work_dir.empty() && !o.keep;
  // Kept after a failed run: its error names its log there.
  struct RemoveWork {
    fs::path dir;
    bool active;
    ~RemoveWork() {
      std::error_code ec;
      if (active && std::uncaught_exceptions() == 0) fs::remove_all(dir, ec);
    }
  } cleanup{work, remove_work};
  for (size_t i = 0; i < runs.size(); ++i) runs[i].dir = work / (i == 0 ? std::string("reference") : c10::str("layout-", i));

  // ---- The runs ----
  std::printf("loom check-layouts: %lld step%s of %s (%s), %lld rows of %lld tokens per batch; work folder %s%s\n",
              static_cast<long long>(o.steps), o.steps == 1 ? "" : "s", o.config.c_str(), base.model.flavor.c_str(),
              static_cast<long long>(global_rows), static_cast<long long>(base.training.seq_len), work.c_str(),
              remove_work ? " (removed at the end; --keep keeps it)" : "");
  for (const Run& run : runs) start(run, o, 0);

  const Run& ref = runs.front();
  const std::vector<StepValues> ref_steps = read_steps(ref.dir);
  LOOM_REQUIRE(static_cast<int64_t>(ref_steps.size()) == o.steps, "the reference reported ", ref_steps.size(),
               " of ", o.steps, " steps (", ref.dir / "steps.jsonl", ")");
  // The reference's activations per re-run step, shared by the layouts that diverge there.
  std::map<int64_t, StepActivations> ref_probes;
  const int64_t accumulation = train::gradient_accumulation_steps(ref.config, reference.dp_degree());
  const int64_t step_rows = global_rows * accumulation;

  nlohmann::json report = {{"config", o.config},
                           {"steps", o.steps},
                           {"tolerance", o.tolerance},
                           {"tolerance_rule", "losses and norms |a-b|/|a|; tensors ||a-b||/||a|| (Frobenius)"},
                           {"reference", {{"layout", reference.text}, {"ranks", reference.world_size()}}},
                           {"layouts", nlohmann::json::array()}};
  bool all_match = true;
  std::vector<std::string> summary;
  for (size_t i = 1; i < runs.size(); ++i) {
    const Run& run = runs[i];
    const std::vector<StepValues> got_steps = read_steps(run.dir);
    LOOM_REQUIRE(got_steps.size() == ref_steps.size(), run.label, " reported ", got_steps.size(), " of ", o.steps,
                 " steps");
    print_header(run, ref, o);
    nlohmann::json steps = nlohmann::json::array();
    std::optional<StepComparison> first;
    for (size_t s = 0; s < ref_steps.size(); ++s) {
      const StepComparison c = compare_step(ref, run, ref_steps[s], got_steps[s], o.tolerance);
      print_row(c);
      steps.push_back(step_json(c));
      if (!first && c.verdict != Verdict::kMatch) first = c;
    }
    nlohmann::json entry = {{"layout", run.layout.text}, {"ranks", run.layout.world_size()},
                            {"matches", !first.has_value()}, {"steps", steps}, {"first_divergence", nullptr}};
    if (!first) {
      std::printf("%s matches the reference on all %lld step%s\n", run.layout.text.c_str(),
                  static_cast<long long>(o.steps), o.steps == 1 ? "" : "s");
      summary.push_back(c10::str(run.layout.text, ": matches"));
    } else {
      all_match = false;
      std::string line = explain(*first, o.tolerance);
      nlohmann::json divergence = {{"step", first->step}, {"kind", verdict_name(first->verdict)}, {"message", line}};
      if (first->verdict == Verdict::kGradient) {
        divergence["name"] = first->gradient.name;
        divergence["diff"] = number(first->gradient.difference);
      } else if (first->verdict == Verdict::kParameter) {
        divergence["name"] = first->parameter.name;
        divergence["diff"] = number(first->parameter.difference);
      } else if (first->verdict == Verdict::kNorm) {
        divergence["diff"] = number(first->norm_difference);
      } else {
        divergence["diff"] = number(first->loss_difference);
      }
      std::printf("%s DIVERGES: %s\n", run.layout.text.c_str(), line.c_str());
      if (first->verdict == Verdict::kGradient) {
        // Which module: the step again, with hooks, in the reference and in the layout.
        std::vector<std::string> notes;
        try {
          if (!ref_probes.count(first->step)) ref_probes[first->step] = probe(ref, o, first->step, step_rows, notes);
          const StepActivations got = probe(run, o, first->step, step_rows, notes);
          const auto found = first_differing_module(ref_probes.at(first->step), got, o.tolerance);
          if (found) {
            const std::string where =
                c10::str("first module that differs: ", found->module, " (its ", found->what, "; ", found->at,
                         " differs by ", short_number(found->difference), ")");
            std::printf("%s %s\n", run.layout.text.c_str(), where.c_str());
            divergence["module"] = {{"name", found->module}, {"what", found->what}, {"at", found->at},
                                    {"diff", number(found->difference)}};
            line += "; " + where;
          } else {
            const std::string where = c10::str("every recorded activation and its gradient agree: the difference "
                                               "arises in ", first->gradient.name, "'s own gradient reduction");
            std::printf("%s %s\n", run.layout.text.c_str(), where.c_str());
            divergence["module"] = nullptr;
            divergence["module_note"] = where;
            line += "; " + where;
          }
        } catch (const std::exception& e) {
          const std::string where = c10::str("could not re-run step ", first->step, " with hooks: ", e.what());
          std::printf("%s %s\n", run.layout.text.c_str(), where.c_str());
          divergence["module_error"] = where;
        }
        for (const auto& n : notes) std::printf("note: %s\n", n.c_str());
        if (!notes.empty()) divergence["notes"] = notes;
      }
      entry["first_divergence"] = divergence;
      summary.push_back(c10::str(run.layout.text, ": ", line));
    }
    if (o.probe_step > 0) {
      std::vector<std::string> notes;
      if (!ref_probes.count(o.probe_step)) ref_probes[o.probe_step] = probe(ref, o, o.probe_step, step_rows, notes);
      const StepActivations got = probe(run, o, o.probe_step, step_rows, notes);
      entry["activations"] = {{"step", o.probe_step},
                              {"modules", module_table(run.layout.text, ref_probes.at(o.probe_step), got, o.probe_step,
                                                       o.tolerance)}};
      for (const auto& n : notes) std::printf("note: %s\n", n.c_str());
      if (!notes.empty()) entry["activations"]["notes"] = notes;
    }
    report["layouts"].push_back(entry);
  }
  report["matches"] = all_match;
  if (!o.json.empty()) {
    std::ofstream out(o.json);
    LOOM_REQUIRE(out.good(), "cannot write ", o.json);
    out << report.dump(2) << "\n";
  }
  std::printf("\n");
  for (const auto& s : summary) std::printf("%s\n", s.c_str());
  if (!remove_work) std::printf("runs kept in %s\n", work.c_str());
  std::fflush(stdout);
  return all_match ? 0 : 1;
}

void register_check_layouts_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("check-layouts",
                                 "Check that parallel layouts train the model one process trains (per step: loss, "
                                 "gradient norm, every gradient and updated parameter)");
  auto o = std::make_shared<CheckOptions>();
  cmd->add_option("--config", o->config, "TOML job config")->required();
  cmd->add_option("--layout", o->layouts,
                  "A layout to check, e.g. \"pp=2,tp=2\" (keys: fsdp, hsdp|dp, tp, async_tp, cp, pp, pp_schedule, "
                  "microbatch, ep, section.key); repeatable")
      ->required();
  cmd->add_option("--reference", o->reference, "The layout the others are compared with")->capture_default_str();
  cmd->add_option("--steps", o->steps, "Training steps to compare")->capture_default_str();
  cmd->add_option("--tolerance", o->tolerance,
                  "Largest relative difference accepted: |a-b|/|a| for losses and norms, ||a-b||/||a|| (Frobenius) "
                  "for tensors")
      ->capture_default_str();
  cmd->add_option("--json", o->json, "Also write the report as JSON to this file");
  cmd->add_option("--work-dir", o->work_dir, "Folder for the runs (kept); default: a temporary one, removed");
  cmd->add_flag("--keep", o->keep, "Keep the temporary work folder");
  cmd->add_option("--probe-step", o->probe_step,
                  "Also re-run this step with hooks and print every recorded module's output and gradient "
                  "difference (0: only on a gradient divergence, for its first step)")
      ->capture_default_str();
  cmd->add_option("overrides", o->after_dash, "Train overrides (--section.key=value), after --");
  cmd->allow_extras();
  cmd->footer("Train overrides after --, e.g. -- --training.seq_len=64 (docs/check_layouts.md).");
  cmd->callback([cmd, o] {
    std::vector<std::string> overrides = cmd->remaining();
    overrides.insert(overrides.end(), o->after_dash.begin(), o->after_dash.end());
    const int code = check_layouts(*o, overrides);
    if (code != 0) throw ReportedError(code);
  });
  register_rank_command(app);
}

}  // namespace loom::layouts
