#include "loom/rl/parallel_policy.h"

#include <cmath>
#include <exception>

#include "loom/checkpoint/checkpointer.h"
#include "loom/checkpoint/group.h"
#include "loom/core/autocast.h"
#include "loom/core/device.h"
#include "loom/core/error.h"
#include "loom/core/logging.h"
#include "loom/distributed/launch_env.h"
#include "loom/lora/lora.h"
#include "loom/models/common/adapter_dir.h"
#include "loom/parallel/optimizer_registry.h"
#include "loom/train/layout_check.h"
#include "loom/train/trainer.h"

namespace loom::rl {
namespace fs = std::filesystem;

double global_loss_scale(LossAggregation aggregation, double local_rows, double local_tokens, double local_width,
                         double global_rows, double global_tokens, double global_width) {
  switch (aggregation) {
    case LossAggregation::kSequenceMean: return local_rows / global_rows;
    case LossAggregation::kTokenMean: return local_tokens / global_tokens;
    case LossAggregation::kDrGrpo: return (local_rows * local_width) / (global_rows * global_width);
  }
  return 1.0;
}

namespace {
// rl's own refusals of a layout the Trainer would take, before any process group.
void check_rl_layout(const train::JobConfig& job, const RlConfig& rl, const distributed::ParallelDims& dims) {
  const auto refuse = [](bool on, const char* what, const char* key) {
    LOOM_REQUIRE_USAGE(!on, "loom rl does not run under ", what, " yet; set ", key,
                       " = 1 (data parallelism (FSDP, DDP) and tensor parallelism are supported)");
  };
  refuse(dims.pp_enabled(), "pipeline parallelism", "parallelism.pipeline_parallel_degree");
  refuse(dims.cp_enabled(), "context parallelism", "parallelism.context_parallel_degree");
  refuse(dims.ep_enabled(), "expert parallelism", "parallelism.expert_parallel_degree");
  if (dims.tp_enabled()) {
    LOOM_REQUIRE_USAGE(job.parallelism.disable_sequence_parallel && job.parallelism.disable_loss_parallel,
                       "loom rl under tensor parallelism needs parallelism.disable_sequence_parallel = true and "
                       "parallelism.disable_loss_parallel = true (decoding feeds one token at a time, and the "
                       "log-probabilities need whole logits)");
  }
  LOOM_REQUIRE_USAGE(rl.prompts_per_step % dims.dp_degree() == 0, "rl.prompts_per_step = ", rl.prompts_per_step,
                     " does not split over the ", dims.dp_degree(),
                     " data-parallel ranks (each prompt's group stays on one rank); make it a multiple of ",
                     dims.dp_degree());
}
}  // namespace

ParallelPolicy::ParallelPolicy(const train::JobConfig& job, const RlConfig& rl, int64_t vocab_size) : job_(job) {
  spec_ = &models::get_spec(job.model.name);
  const distributed::LaunchEnv env = distributed::detect_launch_env();
  // The Trainer's step 1: the layout checked before any process group, so a bad one is the same
  // line on every rank.
  dims_ = train::check_layout(job, env.world_size, env.rank, *spec_,
                              [&]() -> const models::ModelArgs& {
                                args_ = spec_->build_args(models::model_request(
                                    job.model, job.checkpoint.initial_load_path, vocab_size, job.training.seq_len));
                                return *args_;
                              })
              .dims;
  check_rl_layout(job, rl, *dims_);
  device_ = select_device(job.training.device, env.local_rank);
  set_current_device(device_);
  dist_ = distributed::init_distributed(env, job.comm, device_);
  mesh_ = std::make_unique<distributed::DeviceMesh>(dims_->build_mesh(dist_));
  if (dims_->dp_enabled()) dp_ = mesh_->comm("dp");
  if (dims_->tp_enabled()) tp_ = mesh_->comm("tp");
  log::info("rl: parallelism: ", dims_->describe(), "; device: ", device_.str());

  torch::manual_seed(static_cast<uint64_t>(job.training.seed));
  std::shared_ptr<nn::Module> model = spec_->build_model(*args_, torch::TensorOptions().device(torch::kMeta));
  decoder_ = std::dynamic_pointer_cast<models::Decoder>(model);
  LOOM_REQUIRE(decoder_ != nullptr, "loom rl: model '", spec_->name, "' is not a decoder");
  const models::ParallelizeOptions options = train::parallelize_options(job, *dims_, device_);
  autocast_dtype_ = options.autocast_dtype;
  parallel_model_ = spec_->parallelize(model, *args_, *dims_, *mesh_, options);
  log::info("rl: parallelized: ", parallel_model_->describe());
  train::load_initial_weights(*parallel_model_, *spec_, job.checkpoint.initial_load_path, dist_->rank());
  // Sampling and the update see the same function: no dropout.
  decoder_->eval();
  optimizer_ = parallel_model_->build_optimizer(parallel::optimizer_spec(job.optimizer.name),
                                                job.optimizer.request(), device_);
  schedule_ = std::make_unique<optim::LRScheduler>(*optimizer_, job.lr_scheduler,
                                                   job.training.steps * rl.updates_per_rollout);
}

ParallelPolicy::~ParallelPolicy() {
  if (dist_ && std::uncaught_exceptions() == 0) dist_->shutdown();
}

int ParallelPolicy::rank() const { return dist_->rank(); }
int ParallelPolicy::world_size() const { return dist_->world_size(); }

std::pair<int64_t, int64_t> ParallelPolicy::prompt_range(int64_t prompts_per_step) const {
  const int64_t per_rank = prompts_per_step / dims_->dp_degree();
  const int64_t first = per_rank * dims_->dp_rank();
  return {first, first + per_rank};
}

torch::Tensor ParallelPolicy::autocast(const std::function<torch::Tensor()>& forward) {
  AutocastScope scope(device_, autocast_dtype_);
  return forward();
}

Completion ParallelPolicy::sample(const std::vector<int64_t>& prompt, const models::SamplingOptions& options,
                                  at::Generator& generator) {
  LOOM_REQUIRE_USAGE(!prompt.empty(), "a prompt needs at least one token");
  // No grad rather than inference mode: FSDP's gathered parameters are reused by the update.
  torch::NoGradGuard no_grad;
  AutocastScope scope(device_, autocast_dtype_);
  models::Generator cache(*decoder_, static_cast<int64_t>(prompt.size()) + options.max_new_tokens);
  Completion out;
  torch::Tensor logits = cache.forward(prompt);
  bool active = true;
  for (int64_t i = 0;; ++i) {
    if (active) {
      int64_t next = models::sample_token(logits, options, generator);
      double logp = torch::log_softmax(logits.to(torch::kFloat32) / options.temperature, 0)[next].item<double>();
      if (tp_) {
        // The replica's ranks hold the same logits; rank 0's choice makes sure they never part.
        torch::Tensor chosen = torch::tensor({static_cast<double>(next), logp}, torch::kFloat64);
        tp_->broadcast(chosen, 0);
        next = static_cast<int64_t>(chosen[0].item<double>());
        logp = chosen[1].item<double>();
      }
      out.tokens.push_back(next);
      out.logp.push_back(logp);
      if (next == options.stop_id || i + 1 == options.max_new_tokens) active = false;
    }
    // Every forward gathers FSDP's parameters over the data-parallel ranks: they all run as many
    // as the longest completion needs; a rank whose completion has ended feeds its last token
    // again (the cache holds prompt + max_new_tokens positions, more than any rank reaches).
    const bool any_active = dp_ ? max_over_replicas(active ? 1.0 : 0.0) > 0 : active;
    if (!any_active) break;
    logits = cache.forward({out.tokens.back()});
  }
  return out;
}

std::vector<double> ParallelPolicy::replica_rewards(std::vector<double> rewards, size_t count) {
  if (!tp_) return rewards;
  if (!scores_rewards()) rewards.assign(count, 0.0);
  LOOM_REQUIRE(rewards.size() == count, "replica_rewards: ", rewards.size(), " rewards for ", count, " rows");
  torch::Tensor t = torch::tensor(rewards, torch::kFloat64);
  tp_->broadcast(t, 0);
  return std::vector<double>(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
}

std::vector<double> ParallelPolicy::sum_over_replicas(std::vector<double> values) {
  if (!dp_ || values.empty()) return values;
  torch::Tensor t = torch::tensor(values, torch::kFloat64);
  dp_->all_reduce(t, distributed::ReduceOp::kSum);
  return std::vector<double>(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
}

double ParallelPolicy::max_over_replicas(double value) {
  if (!dp_) return value;
  torch::Tensor t = torch::tensor({value}, torch::kFloat64);
  dp_->all_reduce(t, distributed::ReduceOp::kMax);
  return t.item<double>();
}

ParallelPolicy::Update ParallelPolicy::update(const std::function<torch::Tensor()>& objective, double max_norm) {
  parallel_model_->zero_grad();
  Update out;
  const double replicas = static_cast<double>(dims_->dp_degree());
  // The composition averages the data-parallel gradients; the global loss is the sum of the
  // ranks' shares, so each share enters the backward dp times.
  out.loss = parallel_model_->forward_backward([&] {
    torch::Tensor share = autocast(objective);
    return replicas > 1 ? share * replicas : share;
  });
  if (replicas > 1) out.loss = out.loss / replicas;
  out.grad_norm = parallel_model_->clip_grad_norm_(max_norm).item<double>();
  out.lr = optimizer_->lr();
  // Every rank sees the global norm: all stop together.
  LOOM_REQUIRE(std::isfinite(out.grad_norm) && std::isfinite(out.loss.item<double>()),
               "loom rl: non-finite GRPO loss (", out.loss.item<double>(), ") or gradient norm (", out.grad_norm,
               "); the adapters were not updated; lower optimizer.lr or training.max_norm");
  optimizer_->step();
  schedule_->step();
  return out;
}

void ParallelPolicy::save_adapters(const fs::path& dir, int64_t step) {
  const std::string base = fs::absolute(job_.checkpoint.initial_load_path).string();
  const lora::LoRAOptions lora_options = lora::LoRAOptions::from(job_.lora);
  if (dist_->world_size() == 1) {
    fs::remove_all(dir);
    fs::create_directories(dir.parent_path());
    models::export_peft_dir(*spec_, *decoder_, lora_options, base, dir);
    log::info("rl: adapters saved to ", dir.string());
    return;
  }
  // Each rank's pieces of the adapters (the frozen base is referenced, not copied), as a LoRA
  // run's checkpoint records them: the model, the adapters' settings and the base.
  checkpoint::ShardedStateDict state;
  parallel_model_->add_to_state_dict(state, *optimizer_, /*frozen=*/false);
  state.json()["step"] = step;
  state.json()[models::kModelConfigKey] = spec_->model_config_json(*args_);
  state.json()[lora::kCheckpointKey] = lora::to_json(lora_options);
  state.json()[models::kBaseKey] = models::base_reference(base);
  checkpoint::CheckpointOptions options;
  options.folder = dir.parent_path();
  options.keep_latest_k = 0;
  options.validate();
  checkpoint::Checkpointer saver(options, checkpoint::comm_group(dist_->world()));
  saver.save(step, state);
  saver.wait();
  log::info("rl: adapters saved to ", (dir.parent_path() / c10::str("step-", step)).string());
}

}  // namespace loom::rl
