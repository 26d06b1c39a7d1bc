#include "loom/layouts/rank_run.h"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>

#include <nlohmann/json.hpp>

#include "loom/core/error.h"
#include "loom/layouts/activations.h"
#include "loom/train/trainer.h"

namespace loom::layouts {
namespace fs = std::filesystem;
namespace {

// Divides out the clipping train_step applied: the coefficient as optim::clip_grads_with_norm_
// computes it, from the reported norm (the float32 norm's value). training.max_norm = 0: no
// clipping happened.
void unclip_gradients(train::Trainer& trainer, double grad_norm) {
  const double max_norm = trainer.config().training.max_norm;
  if (max_norm <= 0) return;
  torch::NoGradGuard no_grad;
  const torch::Tensor norm = torch::tensor(static_cast<float>(grad_norm), torch::kFloat32);
  const torch::Tensor coef = at::clamp_max(max_norm / (norm + 1e-6), 1.0);
  if (coef.item<float>() == 1.0f) return;
  for (auto& [name, g] : trainer.parallelized_model().local_gradients()) {
    if (g.defined() && g.numel() > 0) g.div_(coef.to(g.device(), g.scalar_type()));
  }
}

ActivationGeometry geometry_of(const train::Trainer& trainer) {
  const auto& dims = trainer.parallel_dims();
  const auto& config = trainer.config();
  ActivationGeometry g;
  g.local_batch = config.training.local_batch_size;
  g.microbatches = dims.pp() > 1 ? g.local_batch / config.parallelism.pipeline_parallel_microbatch_size : 1;
  g.seq_len = config.training.seq_len;
  g.dp_degree = dims.dp_degree();
  g.dp_rank = dims.dp_rank();
  g.cp_degree = dims.cp();
  g.cp_rank = dims.cp_rank();
  g.tp_degree = dims.tp();
  g.tp_rank = dims.tp_rank();
  return g;
}

}  // namespace

void run_rank(const RankRunOptions& o, const std::vector<std::string>& overrides) {
  LOOM_REQUIRE_USAGE(!o.out.empty() && o.steps >= 1 && o.probe_step >= 0 && o.probe_step <= o.steps,
                     kRankCommand, " needs --out, --steps >= 1 and 0 <= --probe-step <= --steps");
  train::Trainer trainer(train::load_job_config(o.config, overrides));
  const int rank = trainer.parallel_dims().rank();
  const fs::path out(o.out);
  std::ofstream steps;
  if (rank == 0 && o.probe_step == 0) {
    fs::create_directories(out);
    steps.open(out / "steps.jsonl");
    LOOM_REQUIRE(steps.good(), "cannot write ", out / "steps.jsonl");
  }
  const int64_t last = o.probe_step > 0 ? o.probe_step : o.steps;
  for (int64_t s = 1; s <= last; ++s) {
    std::unique_ptr<ActivationRecorder> recorder;
    if (s == o.probe_step) {
      recorder = std::make_unique<ActivationRecorder>(trainer.parallelized_model().modules(), geometry_of(trainer));
    }
    const train::StepResult r = trainer.train_step();
    LOOM_REQUIRE(!r.pending, "step ", s, "'s result is pending (training.step_readback must be every_step)");
    LOOM_REQUIRE(!r.skipped, "step ", s, " was skipped: its loss or gradient norm is not finite");
    if (recorder) {
      recorder->remove_hooks();
      recorder->write(out / "probe" / ("rank-" + std::to_string(rank) + ".safetensors"));
      break;
    }
    if (o.probe_step > 0) continue;
    unclip_gradients(trainer, r.grad_norm);
    trainer.save_gradients_to(out / "gradients");
    trainer.save_checkpoint_to(out / "checkpoint");
    if (rank == 0) {
      steps << nlohmann::json{{"step", r.step}, {"loss", r.loss}, {"grad_norm", r.grad_norm}}.dump() << "\n";
      steps.flush();
    }
  }
}

void register_rank_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(kRankCommand, "");
  cmd->group("");  // hidden
  auto o = std::make_shared<RankRunOptions>();
  cmd->add_option("--out", o->out)->required();
  cmd->add_option("--config", o->config)->required();
  cmd->add_option("--steps", o->steps)->required();
  cmd->add_option("--probe-step", o->probe_step);
  cmd->allow_extras();
  cmd->callback([cmd, o] { run_rank(*o, cmd->remaining()); });
}

}  // namespace loom::layouts
