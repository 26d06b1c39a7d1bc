// The training loop, TorchTitan-style: the constructor spells out the build order, train() runs
// the steps. Parallelism is applied to the model from outside (parallelize()), the model code
// itself knows nothing of ranks.
//
// Build order:
//   1. the model's spec (models::get_spec(model.name)) and the layout checked before any process
//      group (ParallelDims against the world size, the model against the TP degree), then the
//      distributed world (device -> rendezvous -> DeviceMesh) and the run folder: rank 0 locks
//      job.dump_folder (one job per folder)
//   2. determinism and seeds
//   3. the data loader for this rank's data-parallel slice (the tokenizer came with the layout)
//   4. model on the meta device (no memory), parameter count and FLOPs/token
//   5. parallelize (the spec's plan for the model): with pp > 1 the split into this rank's
//      pipeline stages and the schedule that runs them; else tensor parallel over tp, context
//      parallel over cp, then FSDP over dp_shard (HSDP with dp_replicate) or DDP over dp_replicate
//   6. materialize and initialize every parameter from the seed (sharded: each rank only its pieces)
//   7. optimizer (AdamW, weight-decay groups) and LR schedule
//   8. checkpointer: folder checked writable on every rank, then resume from the newest complete
//      full checkpoint (or start from initial_load_path)
//   9. metrics (console + metrics.jsonl + TensorBoard) and the resolved config saved in the run
//      folder; after the last step, rank 0 draws loss.svg and prints the run summary
//  10. validation (when validation.enable): the held-out data, evaluated through the parallelized
//      model every validation.freq steps and at the last step
//  11. profiling, when [profiling] asks for it: Kineto traces on TorchTitan's schedule, and memory
//      snapshots (CUDA) or an RSS timeline (CPU); see profiling/profiler.h
#pragma once
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "loom/checkpoint/checkpointer.h"
#include "loom/data/loader.h"
#include "loom/data/tokenizer.h"
#include "loom/distributed/device_mesh.h"
#include "loom/distributed/launch_env.h"
#include "loom/distributed/parallel_dims.h"
#include "loom/distributed/process_group.h"
#include "loom/models/spec.h"
#include "loom/optim/adamw.h"
#include "loom/parallel/parallelized_model.h"
#include "loom/train/memory_accounting.h"
#include "loom/profiling/profiler.h"
#include "loom/optim/lr_scheduler.h"
#include "loom/train/config.h"
#include "loom/train/metrics.h"
#include "loom/train/run_folder.h"
#include "loom/train/summary.h"
#include "loom/train/validate.h"

namespace loom::train {

// What one optimizer step produced (rank-local view; loss is the global mean over the DP group).
struct StepResult {
  int64_t step = 0;
  double loss = 0.0;
  double grad_norm = 0.0;
  double lr = 0.0;
  double seconds = 0.0;
  // The loss or gradient norm was not finite and training.skip_nonfinite_steps allowed skipping:
  // no optimizer or LR-schedule step was taken.
  bool skipped = false;
  // training.step_readback = "log_steps": loss, grad_norm and skipped are still on the device
  // (loss and grad_norm NaN here); the Trainer fills them in at the next log step.
  bool pending = false;
};

class Trainer;

// checkpoint.initial_load_path into `model` (the Trainer's step 8, and `loom rl`'s): a Loom
// checkpoint is read piece by piece (each rank only its shards, whatever layout saved them; the
// frozen base only under LoRA adapters), then handed to `check` with its folder (the Trainer
// refuses non-finite weights there); another format (Hugging Face) is read whole by `spec` and
// each rank keeps its pieces.
void load_initial_weights(parallel::ParallelizedModel& model, const models::ModelSpec& spec, const std::string& path,
                          int rank,
                          const std::function<void(const checkpoint::ShardedStateDict&, const std::string&)>& check = nullptr);

// How a Trainer runs inside something that outlives it (elastic training: train/elastic_run.h).
// Every member is optional; the defaults make a plain `loom train` rank.
struct TrainerHooks {
  // The world, already formed (one membership's ranks); null: detect_launch_env() and rendezvous.
  std::shared_ptr<distributed::Distributed> world;
  // Fills the training state (views into the live parameters, optimizer and LR schedule, plus its
  // JSON: step, data loader) in place of resuming from checkpoint.folder; collective. Returns
  // whether it did.
  std::function<bool(checkpoint::ShardedStateDict&)> restore_state;
  // Right after each step's update, before its checkpoint call and metrics.
  std::function<void(Trainer&)> after_update;
  // At the end of each step (after its checkpoint call, metrics and validation); may throw to
  // end training at this boundary.
  std::function<void(Trainer&)> at_step_boundary;
  // Lines for metrics.jsonl when it opens (elastic: the membership event).
  std::vector<nlohmann::json> metrics_events;
  // A {"event": "rows", "step": N, "rows": [first, end)} line per step: the global rows each step
  // trained on (the data loader's cursor before and after), the ledger elastic runs are checked by.
  bool row_ledger = false;
};

class Trainer {
 public:
  explicit Trainer(JobConfig config, TrainerHooks hooks = {});
  // A normal end waits for every rank at a barrier; unwinding from an error does not (the peers
  // may never arrive: the error report tells them to stop instead, see distributed/peer_abort.h).
  ~Trainer();

  // Runs training.steps steps; returns every step's result (loss etc.), identical on all ranks.
  std::vector<StepResult> train();
  // One optimizer step. With the read-back deferred (reads_back_every_step() false) the result is
  // pending until resolve_pending_steps.
  StepResult train_step();
  // training.step_readback resolved for this run's device and optimizer.
  bool reads_back_every_step() const { return !deferred_readback_; }
  // Saves the current state (the step reached, or the one resumed from) as <folder>/step-<N>,
  // synchronously, on every rank (collective): e.g. to move a checkpoint to another layout without
  // training (load in this layout, save, and any layout reads it back bitwise).
  void save_checkpoint_to(const std::filesystem::path& folder);
  // Saves the gradients the last step left (train_step clipped them in place) as
  // <folder>/step-<N>, like save_checkpoint_to: each parameter's pieces under its name, component
  // "model", so the gradients of any layout load whole in one process (`loom check-layouts`).
  void save_gradients_to(const std::filesystem::path& folder);

  nn::Module& model() { return *model_; }
  // The model with its parallelisms applied: the modules this rank holds (pipeline stages), its
  // gradients. For tools that look at a step from outside (`loom check-layouts`' hooks).
  parallel::ParallelizedModel& parallelized_model() { return *parallel_model_; }
  const distributed::ParallelDims& parallel_dims() const { return *parallel_dims_; }
  const JobConfig& config() const { return config_; }
  const c10::Device& device() const { return device_; }
  int64_t step() const { return step_; }
  // The last step whose update is complete (== step() between steps); the training state is at it.
  int64_t applied_step() const { return applied_step_; }
  // True while an optimizer update is under way: a state taken now would be torn.
  bool updating() const { return updating_; }
  // Everything a checkpoint holds (views into the live state), at applied_step().
  checkpoint::ShardedStateDict training_state() { return state_dict(); }
  const distributed::DeviceMesh& mesh() const { return *mesh_; }
  // Leaves the world without the closing barrier (elastic training: some peers are gone); see
  // distributed::Distributed::abandon.
  void abandon();

 private:
  // The tokenizer (for the vocabulary), then train::check_layout: degrees against the world size,
  // the settings that do not compose, the model against the layout, before any process group.
  void check_layout(const distributed::LaunchEnv& env);
  void init_distributed(const distributed::LaunchEnv& env);
  void init_data();
  void build_model();
  // The model's embedding rows: model.vocab_size, or the tokenizer's vocabulary when it is 0.
  int64_t model_vocab_size() const;
  void parallelize();
  void init_optimizer();
  void init_checkpointing();
  // validation.* resolved (batch size, seq_len), over this rank's data-parallel slice.
  void init_validation();
  void init_profiling();
  // What the rank keeps between steps: parameters, gradients and optimizer state (their bytes).
  PersistentMemory persistent_memory();
  // Everything a checkpoint holds, as views into the live state (used for save and for load).
  checkpoint::ShardedStateDict state_dict();
  // Saves `state` as <folder>/step-<step_>, synchronously, on every rank (collective).
  void save_to(const std::filesystem::path& folder, const checkpoint::ShardedStateDict& state);
  void load_initial_weights(const std::string& path);
  // The base a model with frozen parameters (LoRA) trains on: {"path", "checksum"} of
  // checkpoint.initial_load_path, or {"seed"} of a randomly initialized one; null when nothing is
  // frozen. Checkpoints record it (and copy the base's weights only when no file holds them).
  nlohmann::json frozen_base_reference();
  // A checkpoint to resume (its folder and saved state) must record this run's base and, for
  // LoRA adapters, the adapter settings they were trained with (lora::resume_mismatch).
  void check_resumed_base(const std::filesystem::path& checkpoint, const nlohmann::json& state) const;
  // A checkpoint to resume must hold a model of this run's shape: the model entry it records
  // (models::kModelConfigKey, every shape field, not a flavor's name) against this run's, so a
  // model.flavor = "hf" run resumed with another config.json is one line naming the field.
  void check_resumed_model(const std::filesystem::path& checkpoint, const nlohmann::json& state) const;
  // Every rank built its model args itself (model.flavor = "hf" reads config.json on each node):
  // they must be the same shape.
  void check_same_model_on_every_rank() const;
  // The loaded batch as this rank's model takes it (documents, context-parallel chunks), on the
  // device.
  parallel::ModelBatch model_batch(const data::Batch& batch) const;
  double global_mean_loss(double local_loss_sum);
  // The same mean on the device (a collective on device tensors; no host sync).
  torch::Tensor global_mean_loss(const torch::Tensor& local_loss);
  // Reads every pending step's [loss, grad norm, skipped] in one device-to-host copy and fills in
  // their results (from `results`'s back); a skipped step counts against
  // training.skip_nonfinite_steps, past which it throws DivergedError like every_step mode.
  void resolve_pending_steps(std::vector<StepResult>& results, RunProgress& progress);
  // The non-finite guard: called when the step's global loss or gradient norm is NaN/inf (the
  // same on every rank). Skips the step while training.skip_nonfinite_steps allows, else waits for
  // any checkpoint still being written (it holds the last finite state) and throws DivergedError
  // naming the step and the first parameter with a non-finite gradient. Nothing non-finite is ever
  // applied to the weights, so no checkpoint can hold it.
  // `skipped_on_device`: the step was found at a later log step's read-back (step_readback =
  // "log_steps"); its update was skipped on the device and its gradients are gone.
  void handle_nonfinite_step(const StepResult& result, bool skipped_on_device = false);
  // A one-line usage error on every rank (collective) when any rank's pieces of the model's
  // parameters or buffers in `loaded` (just read from `source`) hold a NaN/inf, naming the first
  // tensor in module order: training from them would stop as a "divergence" blaming the LR.
  void require_finite_weights(const checkpoint::ShardedStateDict& loaded, const std::string& source);
  // The first parameter (module order) whose gradient has a NaN/inf on any rank; "" if none.
  std::string first_nonfinite_gradient();
  void maybe_inject_fault(bool after_step);
  // Rank 0, after the last step: draws <dump_folder>/loss.svg from metrics.jsonl and prints the
  // run summary (the figures from `summary`, the paths from the config).
  void finish_run(RunSummary summary);
  // A batch tensor packed on the host, on this rank's device (the tensor itself on the CPU).
  torch::Tensor to_device(const torch::Tensor& host) const;

  JobConfig config_;
  std::shared_ptr<distributed::Distributed> dist_;
  std::unique_ptr<RunFolderLock> run_folder_lock_;         // rank 0 only
  std::unique_ptr<RunFolderLock> checkpoint_folder_lock_;  // rank 0 only; none inside the above
  c10::Device device_{c10::kCPU};  // this rank's device (training.device), chosen once
  // metrics.memory_breakdown: created before the model and optimizer it accounts for, destroyed
  // after them.
  std::unique_ptr<StepMemoryAccounts> memory_accounts_;
  std::unique_ptr<distributed::ParallelDims> parallel_dims_;
  std::unique_ptr<distributed::DeviceMesh> mesh_;
  std::unique_ptr<data::Tokenizer> tokenizer_;
  std::unique_ptr<data::DataLoader> loader_;
  // The model as its spec (model.name) builds, counts, parallelizes and describes it: the Trainer
  // holds the module and the flavor's args and reads neither's fields.
  const models::ModelSpec* model_spec_ = nullptr;
  std::unique_ptr<models::ModelArgs> model_args_;  // the flavor, this run's vocabulary and seq_len
  std::shared_ptr<nn::Module> model_;
  // The model with its parallelisms applied: every step, optimizer and checkpoint call goes through
  // it, so nothing below knows which parallelisms a run uses.
  std::unique_ptr<parallel::ParallelizedModel> parallel_model_;
  std::unique_ptr<optim::Optimizer> optimizer_;
  std::unique_ptr<optim::LRScheduler> lr_scheduler_;
  std::unique_ptr<MetricsLogger> metrics_;
  std::unique_ptr<checkpoint::Checkpointer> checkpointer_;
  std::unique_ptr<Validator> validator_;  // null: validation.enable = false
  std::unique_ptr<profiling::Profiler> profiler_;              // profiling.enable_profiling
  std::unique_ptr<profiling::MemoryProfiler> memory_profiler_;  // profiling.enable_memory_snapshot
  nlohmann::json base_reference_;  // frozen_base_reference()
  optim::TensorDict lr_scheduler_state_;  // staging for the schedule's state in checkpoints
  int64_t grad_accum_steps_ = 1;
  double flops_per_token_ = 0.0;
  int64_t step_ = 0;
  int64_t nonfinite_steps_skipped_ = 0;
  bool deferred_readback_ = false;  // training.step_readback resolved (init_optimizer)
  // model.attention_mask = "block_causal": batches carry document ids (model_batch).
  bool block_causal_ = false;
  // Per pending step: [global loss, gradient norm, found_inf] (float64, on the device).
  std::vector<torch::Tensor> pending_values_;
  TrainerHooks hooks_;
  int64_t applied_step_ = 0;
  nlohmann::json applied_loader_state_;  // the data loader's state at applied_step_
  bool updating_ = false;
  bool abandoned_ = false;
  // Step, data loader, LR schedule and RNG from a restored or loaded state's JSON.
  void apply_restored_json(const nlohmann::json& json, const std::optional<nlohmann::json>& rank_json);
  // TrainerHooks::restore_state, when set: true when it restored the state.
  bool restore_from_hooks();
  // The update is complete: the state is at step_.
  void mark_applied();
};

}  // namespace loom::train
