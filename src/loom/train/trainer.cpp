#include "loom/core/dtype.h"
#include "loom/train/trainer.h"
#include "loom/train/training_data.h"

#include "loom/train/compatibility.h"
#include "loom/train/layout_check.h"

#include <ATen/record_function.h>

#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include "loom/core/autocast.h"
#include "loom/core/device.h"
#include "loom/core/error.h"
#include "loom/core/logging.h"
#include "loom/core/memory.h"
#include "loom/core/timer.h"
#include "loom/distributed/launch_env.h"
#include "loom/fsdp/sharded_muon.h"
#include "loom/fsdp/sharded_optimizer.h"
#include "loom/lora/lora.h"
#include "loom/models/common/adapter_dir.h"
#include "loom/models/common/model_dir.h"
#include "loom/nn/fused.h"
#include "loom/optim/adamw.h"
#include "loom/optim/clip_grad.h"
#include "loom/checkpoint/metadata.h"
#include "loom/optim/optimizer.h"
#include "loom/train/plot.h"

namespace loom::train {
namespace fs = std::filesystem;

namespace {

// Whether two paths name one folder (after resolving `.`, `..` and symbolic links of the parts
// that exist), so one process never takes a second flock on a file it already holds.
bool same_folder(const fs::path& a, const fs::path& b) {
  const auto resolved = [](const fs::path& p, std::error_code& ec) {
    fs::path r = fs::weakly_canonical(fs::absolute(p), ec).lexically_normal();
    return r.has_filename() ? r : r.parent_path();  // "out/" and "out" are one folder
  };
  std::error_code ec1, ec2;
  const fs::path ra = resolved(a, ec1), rb = resolved(b, ec2);
  return !ec1 && !ec2 && ra == rb;
}

}  // namespace

namespace {

std::vector<uint8_t> rng_state_bytes(const at::Generator& generator) {
  const torch::Tensor state = generator.get_state();
  return std::vector<uint8_t>(state.data_ptr<uint8_t>(), state.data_ptr<uint8_t>() + state.numel());
}

void restore_rng_state(const nlohmann::json& rank_json, const std::string& key, at::Generator generator) {
  if (!rank_json.contains(key)) return;
  const auto bytes = rank_json.at(key).get<std::vector<uint8_t>>();
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(torch::tensor(bytes, torch::kUInt8));
}

}  // namespace

Trainer::Trainer(JobConfig config, TrainerHooks hooks)
    : config_(std::move(config)), hooks_(std::move(hooks)) {
  validate(config_);
  // 1. The model's spec, and the layout checked before any process group exists (a bad
  //    combination is then the same one line on every rank, not a rendezvous): degrees against the
  //    world size, the model against the tensor-parallel degree. Then the world, device and mesh.
  const distributed::LaunchEnv env = hooks_.world ? hooks_.world->env() : distributed::detect_launch_env();
  check_layout(env);
  // The data inputs are resolved before rendezvous (stat only: nothing is opened or read), so a
  // missing path, a FIFO or a device is one line with exit 2 on every rank, not a job that waits.
  check_training_inputs(config_.training);
  if (config_.validation.enable) data::resolve_inputs({config_.validation.dataset_path}, "validation.dataset_path");
  init_distributed(env);
  check_same_model_on_every_rank();
  // From here on every allocation of this thread is watched, so the step's peak can be split into
  // the parts it is made of (train/memory_accounting.h). Torch's profiler needs the same slot.
  if (config_.metrics.memory_breakdown && !config_.profiling.enable_profiling) {
    memory_accounts_ = std::make_unique<StepMemoryAccounts>(device_);
  }
  // TF32 tensor cores for float32 matmuls and convolutions on CUDA (PyTorch's allow_tf32 flags);
  // the CPU ignores it.
  if (config_.training.allow_tf32) {
    auto& ctx = at::globalContext();
    ctx.setFloat32Precision(at::Float32Backend::CUDA, at::Float32Op::MATMUL, at::Float32Precision::TF32);
    ctx.setFloat32Precision(at::Float32Backend::CUDA, at::Float32Op::CONV, at::Float32Precision::TF32);
  }
  // Loom's CUDA kernels the config keeps (all by default; the ATen compositions for the others).
  const nn::CudaKernelSet cuda_kernels = nn::parse_cuda_kernels(config_.training.cuda_kernels);
  nn::set_cuda_kernels(cuda_kernels);
  block_causal_ = config_.model.attention_mask == nn::AttentionMask::kBlockCausal;
  optim::set_cuda_adamw_kernel(cuda_kernels.has(nn::CudaKernel::kAdamW));
  // One job per run folder: a second one would interleave metrics and mix checkpoints.
  if (dist_->rank() == 0) run_folder_lock_ = std::make_unique<RunFolderLock>(config_.job.dump_folder);
  // 2. Determinism: same seed + same layout => bitwise-identical losses. CPU kernels are
  //    deterministic for a fixed thread count; the flag also makes any nondeterministic op fail.
  torch::manual_seed(static_cast<uint64_t>(config_.training.seed));
  if (config_.training.deterministic) {
    at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
  }
  init_data();         // 3. tokenizer + this rank's loader
  build_model();       // 4. meta-device model (the spec's), counts, FLOPs/token
  parallelize();       // 5+6. the spec's plan: TP, FSDP or DDP; materialize, init
  init_optimizer();    // 7. AdamW + LR schedule
  base_reference_ = frozen_base_reference();  // 8. what a frozen base is (LoRA), then resume or
  init_checkpointing();                       //    initial weights

  // 9. Run folder: resolved config and metrics.
  const fs::path dump(config_.job.dump_folder);
  if (dist_->rank() == 0) {
    fs::create_directories(dump);
    // Checked: a full disk at start must fail here, naming the file, not after the first step.
    write_file_atomically(dump / "config.toml", config_.to_toml());
    if (config_.job.print_config) log::info("resolved config:\n", config_.to_toml());
  }
  MetricsLoggerOptions metrics_options{dump, config_.metrics.enable_jsonl, dist_->rank()};
  if (step_ > 0) metrics_options.resumed_from_step = step_;
  metrics_options.attempt = dist_->env().restart_count;
  metrics_options.enable_tensorboard = config_.metrics.enable_tensorboard;
  metrics_ = std::make_unique<MetricsLogger>(metrics_options);
  for (const nlohmann::json& event : hooks_.metrics_events) metrics_->log_event(event);
  init_validation();   // 10. held-out data
  init_profiling();  // 11. traces and memory records, when asked for
}

Trainer::~Trainer() {
  if (dist_ && std::uncaught_exceptions() == 0 && !abandoned_) dist_->shutdown();
}

void Trainer::abandon() {
  abandoned_ = true;
  if (dist_) dist_->abandon();
}

void Trainer::mark_applied() {
  applied_step_ = step_;
  applied_loader_state_ = loader_->state_dict();
  updating_ = false;
}

void Trainer::apply_restored_json(const nlohmann::json& json, const std::optional<nlohmann::json>& rank_json) {
  step_ = json.at("step").get<int64_t>();
  loader_->load_state_dict(json.at("data_loader"));
  lr_scheduler_->load_state_dict(lr_scheduler_state_);
  if (rank_json && rank_json->contains("rng")) {
    // The CPU stream always; the device's own when this run and the saved one both have it.
    restore_rng_state(*rank_json, "rng", at::detail::getDefaultCPUGenerator());
    if (!device_.is_cpu()) {
      restore_rng_state(*rank_json, "rng_" + device_.str(), at::globalContext().defaultGenerator(device_));
    }
  }
  mark_applied();
}

bool Trainer::restore_from_hooks() {
  if (!hooks_.restore_state) return false;
  checkpoint::ShardedStateDict state = state_dict();
  if (!hooks_.restore_state(state)) return false;
  std::optional<nlohmann::json> rank_json;
  if (!state.rank_json().empty()) rank_json = state.rank_json();
  apply_restored_json(state.json(), rank_json);
  return true;
}

void Trainer::check_layout(const distributed::LaunchEnv& env) {
  model_spec_ = &models::get_spec(config_.model.name);
  // The tokenizer (for the vocabulary) and the model's args are read once the degrees passed.
  parallel_dims_ = train::check_layout(config_, env.world_size, env.rank, *model_spec_,
                                       [this]() -> const models::ModelArgs& {
                                         tokenizer_ = std::make_unique<data::Tokenizer>(
                                             data::Tokenizer::from_file(config_.model.tokenizer_path));
                                         // model.flavor = "hf" reads config.json here, on every
                                         // rank, before any process group.
                                         model_args_ = model_spec_->build_args(models::model_request(
                                             config_.model, config_.checkpoint.initial_load_path,
                                             model_vocab_size(), config_.training.seq_len));
                                         return *model_args_;
                                       })
                       .dims;
}

void Trainer::init_distributed(const distributed::LaunchEnv& env) {
  // The device, once, before anything is allocated: the model is materialized there and every
  // batch is moved there.
  device_ = select_device(config_.training.device, env.local_rank, "training.device",
                          config_.comm.device_transport == distributed::DeviceTransport::kHost);
  set_current_device(device_);  // before NCCL creates its communicators on it
  dist_ = hooks_.world ? hooks_.world : distributed::init_distributed(env, config_.comm, device_);
  const auto& pd = *parallel_dims_;
  mesh_ = std::make_unique<distributed::DeviceMesh>(pd.build_mesh(dist_));
  // Where this rank's last collectives go when the job stops on a stalled or broken collective
  // (the watchdog, a failed collective, a peer's failure, the launcher's SIGTERM).
  if (dist_->world_size() > 1) {
    distributed::flight_recorder().set_dump_file(fs::path(config_.job.dump_folder) / "flight_recorder" /
                                                 c10::str("rank", dist_->rank(), ".json"));
  }
  log::info("parallelism: ", pd.describe(), "; device: ", device_.str());
}

void Trainer::init_profiling() {
  const profiling::ProfilingConfig& p = config_.profiling;
  const fs::path dump(config_.job.dump_folder);
  if (p.enable_profiling) {
    profiling::ProfilerOptions options;
    options.traces_folder = dump / p.save_traces_folder;
    options.rank = dist_->rank();
    options.world_size = dist_->world_size();
    options.schedule = {p.profile_freq, p.profiler_warmup, p.profiler_active};
    options.device = device_;
    profiler_ = std::make_unique<profiling::Profiler>(options);
  }
  if (p.enable_memory_snapshot) {
    memory_profiler_ = std::make_unique<profiling::MemoryProfiler>(profiling::MemoryProfilerOptions{
        dump / p.save_memory_snapshot_folder, dist_->rank(), p.profile_freq, device_});
  }
}

PersistentMemory Trainer::persistent_memory() {
  PersistentMemory m;
  m.parameters = storage_bytes(parallel_model_->resident_parameters());
  m.gradients = storage_bytes(parallel_model_->resident_gradients());
  std::vector<torch::Tensor> state;
  for (const auto& [name, t] : optimizer_->state_dict()) state.push_back(t);
  m.optimizer_state = storage_bytes(state);
  m.gradients_persist = parallel_model_->gradients_persist();
  return m;
}

void Trainer::init_data() {
  const auto& t = config_.training;
  Timer timer;
  // Token ids are checked against the embedding here, so a token file from another tokenizer
  // fails at load naming the file, not mid-step inside the embedding lookup.
  auto corpus = load_training_corpus(t, config_.sft, *tokenizer_, model_vocab_size());
  data::DataLoaderOptions options;
  options.seq_len = t.seq_len;
  options.local_batch_size = t.local_batch_size;
  options.dp_rank = parallel_dims_->dp_rank();
  options.dp_world_size = parallel_dims_->dp_degree();
  options.seq_len_setting = "training.seq_len";
  loader_ = std::make_unique<data::DataLoader>(corpus, options);
  grad_accum_steps_ = gradient_accumulation_steps(config_, parallel_dims_->dp_degree());
  log::info("data: ", training_data_name(t), ": ", corpus->num_documents(), " documents, ", corpus->num_tokens(),
            " tokens",
            corpus->masked() ? c10::str(" (", corpus->num_trained_tokens(), " trained, the rest masked)") : "",
            ", ", loader_->packer().rows_per_epoch(),
            " rows of ", t.seq_len, " per epoch (", timer.seconds(), " s); global batch ",
            loader_->global_batch_size() * grad_accum_steps_, " rows, ", grad_accum_steps_,
            " micro-batch(es) per step");
  // A corpus smaller than the run would otherwise repeat without a word (the loader also logs each
  // new epoch as it starts).
  const int64_t rows_per_epoch = loader_->packer().rows_per_epoch();
  const int64_t total_rows = t.steps * loader_->global_batch_size() * grad_accum_steps_;
  if (dist_->rank() == 0 && total_rows > rows_per_epoch) {
    char epochs[32];  // rounded up, so a run just past one epoch does not read "1.0"
    std::snprintf(epochs, sizeof(epochs), "%.1f",
                  std::ceil(10.0 * static_cast<double>(total_rows) / static_cast<double>(rows_per_epoch)) / 10.0);
    log::warn("data: training.steps = ", t.steps, " takes ", total_rows, " rows, ", epochs,
              " epochs of this corpus's ", rows_per_epoch,
              " rows: the data repeats in the same order (use more data or fewer steps to avoid it)");
  }
}

int64_t Trainer::model_vocab_size() const {
  const int64_t tokenizer_vocab = tokenizer_->vocab_size();
  const int64_t vocab = config_.model.vocab_size > 0 ? config_.model.vocab_size : tokenizer_vocab;
  LOOM_REQUIRE_USAGE(vocab >= tokenizer_vocab, "model.vocab_size ", vocab,
                     " is smaller than the tokenizer's vocabulary (", tokenizer_vocab,
                     "); raise it or set 0 to use the tokenizer's");
  return vocab;
}

void Trainer::build_model() {
  model_ = model_spec_->build_model(*model_args_, torch::TensorOptions().device(torch::kMeta));
  const auto counts = model_spec_->count_parameters(*model_args_);
  flops_per_token_ = model_spec_->flops_per_token(*model_args_, config_.training.seq_len);
  log::info("model: ", model_spec_->name, " ", config_.model.flavor, " (", model_args_->summary(),
            "): ", counts.total, " parameters, ", counts.non_embedding, " non-embedding, ",
            counts.active != counts.total ? c10::str(counts.active, " active per token, ") : std::string(),
            flops_per_token_ / 1e6, " MFLOP/token");
}

void Trainer::parallelize() {
  const models::ParallelizeOptions options = parallelize_options(config_, *parallel_dims_, device_);
  parallel_model_ = model_spec_->parallelize(model_, *model_args_, *parallel_dims_, *mesh_, options);
  log::info("parallelized: ", parallel_model_->describe());
}

void Trainer::init_optimizer() {
  optimizer_ = parallel_model_->build_optimizer(parallel::optimizer_spec(config_.optimizer.name),
                                               config_.optimizer.request(), device_);
  lr_scheduler_ = std::make_unique<optim::LRScheduler>(*optimizer_, config_.lr_scheduler,
                                                  config_.training.steps);
  // Deferring the read-back pays where the host and the device run apart (a GPU): the host no
  // longer waits for the backward before queueing the update. On the CPU there is nothing to
  // overlap, so "auto" keeps the every-step read-back (and its exact clipping).
  const StepReadback readback = config_.training.step_readback;
  deferred_readback_ = optimizer_->applies_step_guard() &&
                       (readback == StepReadback::kLogSteps || (readback == StepReadback::kAuto && !device_.is_cpu()));
}

void Trainer::init_validation() {
  if (!config_.validation.enable) return;
  ValidatorOptions options;
  options.config = config_.validation;
  if (options.config.local_batch_size == 0) options.config.local_batch_size = config_.training.local_batch_size;
  if (options.config.seq_len == 0) options.config.seq_len = config_.training.seq_len;
  options.dp_rank = parallel_dims_->dp_rank();
  options.dp_degree = parallel_dims_->dp_degree();
  if (parallel_dims_->dp_cp_enabled()) options.dp_cp = mesh_->comm("dp_cp");
  if (config_.training.token_cache) options.token_cache_dir = data::default_token_cache_dir();
  options.sft = config_.sft;
  validator_ = std::make_unique<Validator>(options, *tokenizer_, model_vocab_size(), *parallel_model_,
                                           [this](const data::Batch& batch) { return model_batch(batch); });
}

void Trainer::init_checkpointing() {
  const auto& c = config_.checkpoint;
  const int attempt = dist_->env().restart_count;
  // (An elastic membership after the first restores from memory: the warning was said at the start.)
  if (!c.enable && dist_->env().max_restarts > 0 && dist_->rank() == 0 && !hooks_.restore_state) {
    // A restart without checkpoints repeats the whole run; say so instead of starting silently.
    if (attempt > 0) {
      log::warn("restart ", attempt, " of ", dist_->env().max_restarts, ": checkpoint.enable is "
                "false, so training starts again from step 1");
    } else {
      log::warn("--max-restarts ", dist_->env().max_restarts, " without checkpoint.enable: a "
                "restart would start again from step 1; set checkpoint.enable = true to resume");
    }
  }
  if (c.enable) {
    checkpoint::CheckpointOptions options;
    options.folder = fs::path(config_.job.dump_folder) / c.folder;
    options.interval = c.interval;
    options.keep_latest_k = static_cast<int>(c.keep_latest_k);
    options.async = c.async_mode == checkpoint::AsyncMode::kAsync;
    options.last_save_model_only = c.model_only;
    // export_dtype applies to the final model-only save (TorchTitan's model_weights_only).
    if (c.model_only) options.export_dtype = checkpoint::scalar_type(c.export_dtype);
    options.validate();
    // Every rank writes its own files: find an unwritable or blocked folder now, not at the first
    // save after `interval` steps of compute.
    require_writable_folder(options.folder, dist_->rank(),
                            "the checkpoint folder (job.dump_folder/checkpoint.folder)");
    // The dump folder's lock does not cover a checkpoint folder elsewhere (an absolute
    // checkpoint.folder): two runs sharing one would resume from and prune each other's steps.
    // Taken before anything is read from it.
    if (dist_->rank() == 0 && !same_folder(options.folder, config_.job.dump_folder)) {
      checkpoint_folder_lock_ = std::make_unique<RunFolderLock>(
          options.folder, "checkpoint.folder (with job.dump_folder)");
    }
    auto group = dist_->world_size() > 1 ? checkpoint::comm_group(dist_->world())
                                         : checkpoint::single_process_group();
    checkpointer_ = std::make_unique<checkpoint::Checkpointer>(options, group);
    // A frozen base (LoRA's) is no part of the training checkpoints, which hold the adapters: it
    // is loaded first, resuming or not, and must be the base the checkpoint records.
    if (base_reference_.is_object() && !c.initial_load_path.empty()) load_initial_weights(c.initial_load_path);
    // Elastic training's in-memory state (train/elastic_run.h) rather than the newest checkpoint.
    if (restore_from_hooks()) return;
    checkpoint::LoadOptions load_options;
    load_options.skip_model_only = true;  // a model-only last save cannot resume training
    // The base and adapter settings it was trained with, before any tensor is read.
    load_options.check_state = [this](const fs::path& dir, const nlohmann::json& state) {
      check_resumed_model(dir, state);
      check_resumed_base(dir, state);
    };
    const checkpoint::ShardedStateDict state = state_dict();
    if (auto loaded = checkpointer_->load(state, load_options)) {
      LOOM_REQUIRE(!loaded->model_only, "checkpoint ", loaded->path.string(),
                   " holds only model weights and cannot resume training; set "
                   "checkpoint.initial_load_path to it instead, or remove it");
      require_finite_weights(state, loaded->path.string());
      step_ = loaded->json.at("step").get<int64_t>();
      LOOM_REQUIRE_USAGE(step_ < config_.training.steps, "checkpoint ", loaded->path.string(),
                         " is at step ", step_, ", which is not before training.steps = ",
                         config_.training.steps, ": nothing left to train; raise training.steps "
                         "to continue, or set job.dump_folder to a new folder for a new run");
      apply_restored_json(loaded->json, loaded->rank_json);
      log::info("resumed from ", loaded->path.string(), " at step ", step_);
      return;
    }
  }
  if (!c.initial_load_path.empty() && !(checkpointer_ && base_reference_.is_object())) {
    load_initial_weights(c.initial_load_path);
  }
  if (!checkpointer_) restore_from_hooks();
  applied_loader_state_ = loader_->state_dict();
  applied_step_ = step_;
}

nlohmann::json Trainer::frozen_base_reference() {
  if (!parallel_model_->has_frozen_parameters()) return nullptr;
  const std::string& path = config_.checkpoint.initial_load_path;
  if (path.empty()) return {{"seed", config_.training.seed}};
  // Rank 0 reads the base's files; every rank gets its answer, so a mismatch on resume fails all.
  std::string reference;
  if (dist_->rank() == 0) reference = models::base_reference(path).dump();
  auto group = dist_->world_size() > 1 ? checkpoint::comm_group(dist_->world()) : checkpoint::single_process_group();
  return nlohmann::json::parse(group->all_gather(reference).at(0));
}

void Trainer::check_resumed_base(const fs::path& checkpoint, const nlohmann::json& state) const {
  if (!base_reference_.is_object()) return;
  const nlohmann::json saved = state.value(models::kBaseKey, nlohmann::json());
  // The path may move; the checksum (or the seed) is what identifies the base.
  const auto identity = [](const nlohmann::json& base) {
    return base.is_object() && base.contains("checksum") ? base.at("checksum") : base.value("seed", nlohmann::json());
  };
  LOOM_REQUIRE_USAGE(identity(saved) == identity(base_reference_), "checkpoint ", checkpoint.string(),
                     " trained adapters on the base ", saved.dump(), " but this run's base is ", base_reference_.dump(),
                     "; set checkpoint.initial_load_path (and training.seed) to the base it was trained on, or "
                     "start a new run in another job.dump_folder");
  // The adapters' own settings: resuming with others would rescale or drop trained adapters.
  if (state.contains(lora::kCheckpointKey)) {
    const lora::LoRAOptions trained = lora::from_json(state.at(lora::kCheckpointKey), checkpoint.string());
    const std::string mismatch = lora::resume_mismatch(trained, lora::LoRAOptions::from(config_.lora));
    LOOM_REQUIRE_USAGE(mismatch.empty(), "checkpoint ", checkpoint.string(), " trained its adapters with ", mismatch,
                       "; resume with the settings it was trained with, or start a new run in another job.dump_folder");
  }
}

namespace {
// The first field where two recorded models differ ("model_args.n_heads 4 in the checkpoint, 6 in
// this run"); empty when they do not. The RoPE table's length (max_seq_len) is no parameter's
// shape and follows training.seq_len, so it is not compared.
std::string first_model_difference(const nlohmann::json& saved, const nlohmann::json& current,
                                   const std::string& path = "", const char* saved_is = "in the checkpoint",
                                   const char* current_is = "in this run") {
  if (saved.is_object() && current.is_object()) {
    std::set<std::string> keys;
    for (const auto& [key, value] : saved.items()) keys.insert(key);
    for (const auto& [key, value] : current.items()) keys.insert(key);
    for (const std::string& key : keys) {
      if (path == "model_args" && key == "max_seq_len") continue;
      const std::string where = path.empty() ? key : path + "." + key;
      if (!saved.contains(key) || !current.contains(key)) {
        return c10::str(where, " ", saved.contains(key) ? saved.at(key).dump() : "(none)", " ", saved_is, ", ",
                        current.contains(key) ? current.at(key).dump() : "(none)", " ", current_is);
      }
      std::string difference = first_model_difference(saved.at(key), current.at(key), where, saved_is, current_is);
      if (!difference.empty()) return difference;
    }
    return "";
  }
  if (saved == current) return "";
  return c10::str(path, " ", saved.dump(), " ", saved_is, ", ", current.dump(), " ", current_is);
}
}  // namespace

void Trainer::check_resumed_model(const fs::path& checkpoint, const nlohmann::json& state) const {
  if (!state.contains(models::kModelConfigKey)) return;  // saved before checkpoints recorded their model
  nlohmann::json saved = state.at(models::kModelConfigKey);
  // Read back through this family's reader when it is this family's, so a key a later Loom added
  // (with its default) is not taken for a difference.
  if (saved.is_object() && saved.value("name", "") == model_spec_->name) {
    try {
      saved = model_spec_->model_config_json(*model_spec_->model_args_from_config_json(saved, checkpoint.string()));
    } catch (const Error&) {
      // Compared as recorded: the difference names the field.
    }
  }
  const std::string difference = first_model_difference(saved, model_spec_->model_config_json(*model_args_));
  if (difference.empty()) return;
  const bool hf = config_.model.flavor == models::kHfFlavor;
  fail_usage("checkpoint ", checkpoint.string(), " holds a model of another shape than this run's (", difference, ")",
             hf ? c10::str("; model.flavor = \"hf\" read this run's shape from '",
                           models::resolve_hf_config(config_.model.hf_config, config_.checkpoint.initial_load_path)
                               .string(),
                           "': resume with the config.json the checkpoint was trained with")
                : std::string("; resume with the model.flavor, model.n_layers and model.vocab_size it was trained "
                              "with"),
             ", or start a new run in another job.dump_folder");
}

void Trainer::check_same_model_on_every_rank() const {
  // Each rank built its model args itself (model.flavor = "hf" reads config.json on every node):
  // one small all-gather at start says so before any rank builds a model of another shape.
  const std::string mine = model_spec_->model_config_json(*model_args_).dump();
  const std::vector<std::string> all = checkpoint::comm_group(dist_->world())->all_gather(mine);
  for (size_t rank = 1; rank < all.size(); ++rank) {
    LOOM_REQUIRE_USAGE(all[rank] == all[0], "rank ", rank, " built another model shape than rank 0 (",
                       first_model_difference(nlohmann::json::parse(all[0]), nlohmann::json::parse(all[rank]), "",
                                              "on rank 0", c10::str("on rank ", rank).c_str()),
                       "); every node must see the same config (with model.flavor = \"hf\", the same config.json)");
  }
}

void Trainer::save_checkpoint_to(const fs::path& folder) { save_to(folder, state_dict()); }

void Trainer::save_gradients_to(const fs::path& folder) {
  checkpoint::ShardedStateDict sd;
  parallel_model_->add_gradients_to_state_dict(sd);
  sd.json()["step"] = step_;
  save_to(folder, sd);
}

void Trainer::save_to(const fs::path& folder, const checkpoint::ShardedStateDict& state) {
  checkpoint::CheckpointOptions options;
  options.folder = folder;
  options.keep_latest_k = 0;
  options.validate();
  auto group = dist_->world_size() > 1 ? checkpoint::comm_group(dist_->world())
                                       : checkpoint::single_process_group();
  checkpoint::Checkpointer saver(options, group);
  saver.save(step_, state);
  saver.wait();
}

checkpoint::ShardedStateDict Trainer::state_dict() {
  checkpoint::ShardedStateDict sd;
  // Each rank's pieces of the parameters and optimizer state, with their global shapes (TP boxes,
  // FSDP ranges): the checkpoint reshards on load.
  // A frozen base that comes from checkpoint.initial_load_path is referenced, not copied (LoRA's
  // adapter-only checkpoints); one no file holds (a seeded initialization) is saved with them.
  parallel_model_->add_to_state_dict(sd, *optimizer_, /*frozen=*/config_.checkpoint.initial_load_path.empty());
  lr_scheduler_state_ = lr_scheduler_->state_dict();
  for (const auto& [name, t] : lr_scheduler_state_) sd.add_full("lr_scheduler." + name, "lr_scheduler", t);
  sd.json()["step"] = applied_step_;
  // The model config makes the checkpoint self-describing: `loom score` and `loom convert` read it.
  sd.json()[models::kModelConfigKey] = model_spec_->model_config_json(*model_args_);
  // Adapters on a frozen base: their settings and the base they adapt (which is not copied).
  if (base_reference_.is_object()) {
    sd.json()[lora::kCheckpointKey] = lora::to_json(lora::LoRAOptions::from(config_.lora));
    sd.json()[models::kBaseKey] = base_reference_;
  }
  sd.json()["data_loader"] = applied_loader_state_.is_null() ? loader_->state_dict() : applied_loader_state_;
  sd.rank_json()["rng"] = rng_state_bytes(at::detail::getDefaultCPUGenerator());
  if (!device_.is_cpu()) {
    sd.rank_json()["rng_" + device_.str()] =
        rng_state_bytes(at::globalContext().defaultGenerator(device_));
  }
  return sd;
}

void Trainer::load_initial_weights(const std::string& path) {
  train::load_initial_weights(*parallel_model_, *model_spec_, path, dist_->rank(),
                              [this](const checkpoint::ShardedStateDict& base, const std::string& source) {
                                require_finite_weights(base, source);
                              });
}

void load_initial_weights(parallel::ParallelizedModel& model, const models::ModelSpec& spec, const std::string& path,
                          int rank, const std::function<void(const checkpoint::ShardedStateDict&, const std::string&)>& check) {
  const models::InitialWeights weights = spec.read_initial_weights(path);
  if (!weights.loom_checkpoint.empty()) {
    // A Loom checkpoint (`loom convert --to loom`, or another run's step-N): each rank reads only
    // the pieces of its own shards, whatever layout saved them; optimizer state is not read.
    const fs::path& dir = weights.loom_checkpoint;
    // The base's parameters (every one, or the frozen ones under LoRA adapters).
    checkpoint::ShardedStateDict base;
    model.add_base_to_state_dict(base);
    checkpoint::load_checkpoint(dir, base, rank);
    if (check) check(base, dir.string());
    log::info("initial weights loaded from ", dir.string());
    return;
  }
  // Another format (Hugging Face), read whole by the model's spec.
  model.load_full_parameters(weights.full_parameters);  // each rank keeps only its pieces
  log::info("initial weights loaded from ", path);
}

namespace {

// Fault injection for restart tests and drills (README, "Fault injection"): each variable is
// "<rank>:<step>" and acts on the launcher's first attempt only (LOOM_RESTART_COUNT 0 or unset).
//   LOOM_FAULT_KILL   that rank SIGKILLs itself after finishing that step
//   LOOM_FAULT_THROW  that rank throws an error after finishing that step
//   LOOM_FAULT_NAN    that rank's loss becomes NaN in that step (before backward)
//   LOOM_FAULT_HANG   that rank stops making progress after finishing that step (sleeps, as a
//                     rank stuck in a kernel or a deadlock would): its peers' collective watchdogs
//                     fire after comm.timeout_seconds
struct FaultSpec {
  int rank = -1;
  int64_t step = -1;
};

// "<rank>:<step>" or a comma-separated list of them.
std::vector<FaultSpec> fault_specs(const char* variable) {
  const char* spec = std::getenv(variable);
  if (spec == nullptr) return {};
  const char* attempt = std::getenv("LOOM_RESTART_COUNT");
  if (attempt != nullptr && std::string(attempt) != "0") return {};
  std::vector<FaultSpec> out;
  std::stringstream list(spec);
  std::string item;
  while (std::getline(list, item, ',')) {
    FaultSpec f;
    long long step = -1;
    char extra = 0;
    LOOM_REQUIRE_USAGE(std::sscanf(item.c_str(), "%d:%lld%c", &f.rank, &step, &extra) == 2, variable,
                       " must be <rank>:<step>[,<rank>:<step>...], got '", spec, "'");
    f.step = step;
    out.push_back(f);
  }
  return out;
}

bool fault_due(const char* variable, int rank, int64_t step) {
  // In an elastic job ranks change with the membership: a fault names the member (never reused),
  // so it strikes once.
  if (const char* member = std::getenv("LOOM_ELASTIC_MEMBER")) rank = std::atoi(member);
  for (const FaultSpec& f : fault_specs(variable)) {
    if (f.rank == rank && f.step == step) return true;
  }
  return false;
}

}  // namespace

void Trainer::maybe_inject_fault(bool after_step) {
  const int rank = dist_->rank();
  if (!after_step) return;
  if (fault_due("LOOM_FAULT_KILL", rank, step_)) {
    log::warn("LOOM_FAULT_KILL: rank ", rank, " kills itself after step ", step_);
    std::raise(SIGKILL);
  }
  if (fault_due("LOOM_FAULT_THROW", rank, step_)) {
    fail("LOOM_FAULT_THROW: injected failure on rank ", rank, " after step ", step_);
  }
  if (fault_due("LOOM_FAULT_HANG", rank, step_)) {
    log::warn("LOOM_FAULT_HANG: rank ", rank, " hangs after step ", step_);
    for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
  }
}

double Trainer::global_mean_loss(double local_loss) {
  // Data-parallel ranks see different rows and context-parallel ranks different tokens of them
  // (as many on each): the mean over both is the batch's.
  if (!parallel_dims_->dp_cp_enabled()) return local_loss;
  torch::Tensor t = torch::tensor({local_loss}, torch::kFloat64);
  mesh_->comm("dp_cp")->all_reduce(t, distributed::ReduceOp::kAvg);
  return t.item<double>();
}

torch::Tensor Trainer::global_mean_loss(const torch::Tensor& local_loss) {
  torch::Tensor t = local_loss.detach().to(torch::kFloat64).reshape({1});
  if (parallel_dims_->dp_cp_enabled()) {
    t = t.clone();
    mesh_->comm("dp_cp")->all_reduce(t, distributed::ReduceOp::kAvg);
  }
  return t[0];
}

parallel::ModelBatch Trainer::model_batch(const data::Batch& batch) const {
  // The loader's row-local document index of every token (data/loader.h): the packed documents
  // themselves, whatever their text holds (a BOS id inside a document, or a tokenizer whose BOS is
  // also its EOS, would cut a document counted by BOS tokens).
  torch::Tensor documents;
  if (block_causal_) documents = batch.document_ids;
  parallel::ModelBatch local = parallel_model_->prepare_batch(batch.inputs, batch.labels, documents);
  local.tokens = to_device(local.tokens);
  local.labels = to_device(local.labels);
  if (local.layout.positions.defined()) local.layout.positions = to_device(local.layout.positions);
  if (local.layout.document_ids.defined()) local.layout.document_ids = to_device(local.layout.document_ids);
  return local;
}

torch::Tensor Trainer::to_device(const torch::Tensor& host) const {
  if (device_.is_cpu()) return host;
  // Through pinned (page-locked) memory, so the copy is a real asynchronous DMA that overlaps the
  // work already queued on the device (from pageable memory it would stage and block).
  return host.pin_memory().to(device_, /*non_blocking=*/true);
}

StepResult Trainer::train_step() {
  Timer timer;
  ++step_;
  parallel_model_->zero_grad();
  if (memory_accounts_) memory_accounts_->begin_step();  // after the gradients set to None are gone
  // The step's batches (more than one with gradient accumulation), packed on the host and copied
  // to the device; the parallelized model runs their forward and backward (a pipeline schedule,
  // or one micro-batch after another) and synchronises the gradients.
  std::vector<parallel::ModelBatch> batches;
  for (int64_t micro = 0; micro < grad_accum_steps_; ++micro) batches.push_back(model_batch(loader_->next()));
  // Test-only fault: this rank dies inside the step, its rows taken and its update not made.
  if (fault_due("LOOM_FAULT_KILL_MID_STEP", dist_->rank(), step_)) {
    log::warn("LOOM_FAULT_KILL_MID_STEP: rank ", dist_->rank(), " kills itself inside step ", step_);
    std::raise(SIGKILL);
  }
  parallel::LossHook hook;
  if (fault_due("LOOM_FAULT_NAN", dist_->rank(), step_)) {
    hook = [](int64_t index, const torch::Tensor& loss) {
      return index == 0 ? loss * std::numeric_limits<float>::quiet_NaN() : loss;
    };
  }
  const torch::Tensor loss_sum = parallel_model_->forward_backward(batches, hook);
  if (deferred_readback_) {
    // Nothing read back: the global loss and norm decide clipping and skipping on the device,
    // inside the fused update; the values wait in pending_values_ for the next log step.
    const torch::Tensor loss = global_mean_loss(loss_sum);
    torch::Tensor norm;
    {
      RECORD_USER_SCOPE("loom::grad_norm");
      norm = parallel_model_->grad_norm();
    }
    const optim::StepGuard step_guard = optim::clip_and_skip_guard(norm, loss, config_.training.max_norm);
    StepResult result;
    result.step = step_;
    result.lr = optimizer_->lr();
    result.loss = result.grad_norm = std::numeric_limits<double>::quiet_NaN();
    result.pending = true;
    if (checkpointer_) checkpointer_->wait_staged();
    {
      RECORD_USER_SCOPE("loom::optimizer_step");
      updating_ = true;
      optimizer_->step_with_guard(step_guard);
      lr_scheduler_->step();
      mark_applied();
    }
    pending_values_.push_back(
        torch::stack({loss, norm.detach().reshape({}).to(loss.device(), torch::kFloat64),
                      step_guard.found_inf.to(loss.device(), torch::kFloat64)}));
    result.seconds = timer.seconds();
    return result;
  }
  // The norm over every mesh dim; gradients scaled on the device.
  torch::Tensor grad_norm_t;
  {
    RECORD_USER_SCOPE("loom::clip_grad_norm");  // profiler range (profiling/profiler.h)
    grad_norm_t = parallel_model_->clip_grad_norm_(config_.training.max_norm);
  }
  const torch::Tensor host = torch::stack({loss_sum, grad_norm_t.detach().to(loss_sum.device(), torch::kFloat64)})
                                 .to(torch::kCPU);
  const double local_loss = host[0].item<double>();
  const double grad_norm = host[1].item<double>();
  StepResult result;
  result.step = step_;
  result.lr = optimizer_->lr();
  result.grad_norm = grad_norm;
  // Global (identical on every rank) before the optimizer step, so the guard below decides the
  // same everywhere.
  result.loss = global_mean_loss(local_loss);
  if (!std::isfinite(result.loss) || !std::isfinite(grad_norm)) {
    handle_nonfinite_step(result);  // throws unless the step may be skipped
    result.skipped = true;
    mark_applied();
    result.seconds = timer.seconds();
    return result;
  }
  // An async save of the previous step may still be copying parameters and optimizer state out
  // (it overlapped this step's forward and backward); the optimizer step is the first thing that
  // changes them.
  if (checkpointer_) checkpointer_->wait_staged();
  {
    RECORD_USER_SCOPE("loom::optimizer_step");
    updating_ = true;
    optimizer_->step();
    lr_scheduler_->step();
    mark_applied();
  }
  result.seconds = timer.seconds();
  return result;
}

void Trainer::resolve_pending_steps(std::vector<StepResult>& results, RunProgress& progress) {
  if (pending_values_.empty()) return;
  const size_t n = pending_values_.size();
  LOOM_REQUIRE(results.size() >= n, "more pending step values than step results");
  const torch::Tensor host = torch::stack(pending_values_).to(torch::kCPU).contiguous();
  pending_values_.clear();
  const auto values = host.accessor<double, 2>();
  for (size_t i = 0; i < n; ++i) {
    StepResult& r = results[results.size() - n + i];
    LOOM_REQUIRE(r.pending, "step ", r.step, "'s result is not pending");
    r.pending = false;
    r.loss = values[static_cast<int64_t>(i)][0];
    r.grad_norm = values[static_cast<int64_t>(i)][1];
    r.skipped = values[static_cast<int64_t>(i)][2] != 0.0;
    progress.record_loss(r.step, r.loss);
    if (r.skipped) handle_nonfinite_step(r, /*skipped_on_device=*/true);  // throws past the allowance
  }
}

std::string Trainer::first_nonfinite_gradient() {
  // Indices into the whole model's parameter order, which every rank knows (a pipeline rank holds
  // only its stages' parameters).
  const std::vector<nn::NamedParameter> all = model_->named_parameters();
  std::map<std::string, int64_t> index;
  for (size_t i = 0; i < all.size(); ++i) index.emplace(all[i].name, static_cast<int64_t>(i));
  const auto none = static_cast<int64_t>(all.size());
  int64_t first = none;
  for (const auto& [name, g] : parallel_model_->local_gradients()) {
    if (g.defined() && g.numel() > 0 && !torch::isfinite(g).all().item<bool>()) {
      auto it = index.find(name);
      if (it != index.end()) first = std::min(first, it->second);
    }
  }
  if (dist_->world_size() > 1) {
    torch::Tensor t = torch::tensor({-first}, torch::kInt64);  // max of -index = min index
    dist_->world()->all_reduce(t, distributed::ReduceOp::kMax);
    first = -t.item<int64_t>();
  }
  return first < none ? all[static_cast<size_t>(first)].name : "";
}

void Trainer::require_finite_weights(const checkpoint::ShardedStateDict& loaded, const std::string& source) {
  // The whole model's parameter (and buffer) order, which every rank knows: the first non-finite
  // one any rank holds is named on all of them (a pipeline rank holds only its stages').
  std::vector<std::string> names;
  for (const auto& p : model_->named_parameters()) names.push_back(p.name);
  for (const auto& b : model_->named_buffers()) names.push_back(b.name);
  std::map<std::string, int64_t> index;
  for (size_t i = 0; i < names.size(); ++i) index.emplace(names[i], static_cast<int64_t>(i));
  const auto none = static_cast<int64_t>(names.size());
  int64_t first = none;
  for (const auto& [name, tensor] : loaded.tensors()) {
    const auto it = index.find(name);
    if (it == index.end() || it->second >= first) continue;
    for (const auto& chunk : tensor.chunks) {
      const torch::Tensor& t = chunk.data;
      if (t.defined() && t.is_floating_point() && t.numel() > 0 && !torch::isfinite(t).all().item<bool>()) {
        first = it->second;
        break;
      }
    }
  }
  if (dist_->world_size() > 1) {
    torch::Tensor t = torch::tensor({-first}, torch::kInt64);  // max of -index = min index
    dist_->world()->all_reduce(t, distributed::ReduceOp::kMax);
    first = -t.item<int64_t>();
  }
  LOOM_REQUIRE_USAGE(first == none, "'", source, "' holds non-finite weights: tensor '",
                     names[static_cast<size_t>(std::min(first, none - 1))],
                     "' has NaN/inf values; the file is corrupt or was saved from a diverged run: use an earlier "
                     "checkpoint or a fresh copy");
}

void Trainer::handle_nonfinite_step(const StepResult& r, bool skipped_on_device) {
  // Where the step was decided: on the host before its update (the first non-finite gradient is
  // still there to name), or on the device, read back at a later log step (its gradients are gone).
  const std::string where =
      skipped_on_device
          ? c10::str(" (found at step ", step_, "'s read-back; set training.step_readback = \"every_step\" to name "
                     "the first non-finite gradient)")
          : [this] {
              const std::string param = first_nonfinite_gradient();
              return param.empty() ? std::string() : c10::str(" (first non-finite gradient: ", param, ")");
            }();
  const std::string what = c10::str("non-finite ", !std::isfinite(r.loss) ? c10::str("loss ", r.loss, " ") : "",
                                    !std::isfinite(r.loss) && !std::isfinite(r.grad_norm) ? "and " : "",
                                    !std::isfinite(r.grad_norm) ? c10::str("gradient norm ", r.grad_norm, " ") : "",
                                    "at step ", r.step, where);
  const int64_t allowed = config_.training.skip_nonfinite_steps;
  if (nonfinite_steps_skipped_ < allowed) {
    ++nonfinite_steps_skipped_;
    log::warn(what, skipped_on_device ? "; the device skipped its update (" : "; step skipped (",
              nonfinite_steps_skipped_, " of ", allowed, " allowed by training.skip_nonfinite_steps): ",
              skipped_on_device ? "weights and optimizer state unchanged, the LR schedule advanced"
                                : "weights, optimizer state and LR schedule unchanged");
    return;
  }
  // A checkpoint still being written holds the last finite state: let it land before stopping.
  if (checkpointer_) checkpointer_->wait();
  throw DivergedError(c10::str(
      "training diverged: ", what,
      skipped_on_device ? "; its update was skipped on the device" : "; stopped before applying it",
      ", so every checkpoint holds finite weights. Lower optimizer.lr, raise lr_scheduler.warmup_steps or lower "
      "training.max_norm, or allow skipping with training.skip_nonfinite_steps"));
}

std::vector<StepResult> Trainer::train() {
  const auto& t = config_.training;
  // MFU's denominator: metrics.peak_flops when set; else the CPU's fp32 GEMM peak, measured now,
  // or an accelerator's dense bf16 peak from its data sheet (TorchTitan's convention, whatever the
  // run's dtype). An accelerator the table does not know gets no MFU rather than a guess.
  const DeviceInfo info = device_info(device_);
  double peak_flops = std::numeric_limits<double>::quiet_NaN();
  if (config_.metrics.peak_flops > 0) {
    peak_flops = config_.metrics.peak_flops;
    log::info("training ", t.steps, " steps; MFU against metrics.peak_flops = ", peak_flops / 1e9,
              " GFLOP/s per rank");
  } else if (device_.is_cpu()) {
    peak_flops = measure_peak_fp32_flops();
    log::info("training ", t.steps, " steps; MFU against a peak of ", peak_flops / 1e9,
              " GFLOP/s per rank (this CPU's measured fp32 GEMM peak)");
  } else if (info.peak_bf16_flops) {
    peak_flops = *info.peak_bf16_flops;
    log::info("training ", t.steps, " steps on ", info.name, "; MFU against its dense bf16 peak of ",
              peak_flops / 1e12, " TFLOP/s");
  } else {
    log::warn("training ", t.steps, " steps on ", info.name, ": its peak FLOP/s is not in Loom's "
              "table, so MFU is not reported; set metrics.peak_flops to the device's dense bf16 "
              "peak to get it");
  }
  std::vector<StepResult> results;
  // Tokens per step per rank, as TorchTitan counts them: the ranks of a tensor-parallel group work
  // on the same tokens, so each is credited with 1/t of them (and MFU with 1/t of the FLOPs).
  const int64_t tokens_per_step = t.local_batch_size * t.seq_len * grad_accum_steps_;
  const double ranks_per_batch = parallel_dims_->non_data_parallel_size();
  RunProgressOptions progress_options;
  progress_options.total_steps = t.steps;
  progress_options.start_step = step_;
  progress_options.global_tokens_per_step = loader_->global_batch_size() * grad_accum_steps_ * t.seq_len;
  progress_options.rank_tokens_per_step = static_cast<double>(tokens_per_step) / ranks_per_batch;
  progress_options.flops_per_token = flops_per_token_;
  progress_options.peak_flops = peak_flops;
  RunProgress progress(progress_options);
  const Timer run_timer;
  double window_seconds = 0.0;
  int64_t window_steps = 0;
  memory::reset_peak(device_);
  // The peak memory of the steps since the last log line: the memory profiler resets the peak
  // after every step (its timeline has per-step peaks), so the window's is the max over its steps.
  int64_t window_peak_bytes = 0;
  // The breakdown of the window's highest step peak.
  std::optional<MemoryBreakdown> window_memory;
  distributed::comm_stats().reset();
  if (profiler_) profiler_->step(step_);  // the first step may already be recorded
  // The latest loss read back (the status line's, between log steps).
  double last_loss = std::numeric_limits<double>::quiet_NaN();
  while (step_ < t.steps) {
    // A step's time is the whole iteration: the training step plus the checkpoint call after it,
    // so what a save costs (planning, waiting for the previous one) shows in tps and MFU.
    Timer iteration;
    StepResult r;
    {
      // torch.profiler's per-step range: trace viewers and HTA cut a trace into steps by it.
      RECORD_USER_SCOPE(c10::str("ProfilerStep#", step_ + 1));
      const int64_t rows_before = applied_loader_state_.at("rows_consumed").get<int64_t>();
      r = train_step();
      if (hooks_.after_update) hooks_.after_update(*this);
      if (hooks_.row_ledger) {
        metrics_->log_event({{"event", "rows"}, {"step", step_},
                             {"rows", {rows_before, applied_loader_state_.at("rows_consumed").get<int64_t>()}}});
      }
      // Before the checkpoint call, whose staging copies are not the step's memory.
      if (memory_accounts_ && !r.skipped) {
        const MemoryBreakdown b = memory_accounts_->end_step(persistent_memory());
        if (!window_memory || b.peak > window_memory->peak) window_memory = b;
        if (results.empty()) log::info("memory at step ", r.step, "'s peak: ", b.describe());
      }
      if (checkpointer_) {
        checkpointer_->maybe_save(step_, [this] { return state_dict(); }, step_ == t.steps);
      }
    }
    const bool log_step = step_ == 1 || step_ % config_.metrics.log_freq == 0 || step_ == t.steps;
    // The host runs ahead of an accelerator: at a log step, wait for the device so the window's
    // time covers all the work queued in it (between log steps, either the next step's loss
    // read-back keeps the host at most one step ahead, or with training.step_readback =
    // "log_steps" it runs ahead until the queue's depth holds it back).
    if (log_step) synchronize(device_);
    r.seconds = iteration.seconds();
    window_peak_bytes = std::max(window_peak_bytes, memory::peak_bytes(device_));
    if (memory_profiler_) memory_profiler_->step(step_, r.seconds);
    results.push_back(r);
    progress.record_time(r.step, r.seconds, run_timer.seconds());
    if (!r.pending) progress.record_loss(r.step, r.loss);
    if (log_step) {
      resolve_pending_steps(results, progress);  // throws past the non-finite steps allowed
      r = results.back();
    }
    if (!r.pending) last_loss = r.loss;
    window_seconds += r.seconds;
    ++window_steps;
    if (log_step) {
      StepMetrics m;
      m.step = r.step;
      m.loss = r.loss;
      m.grad_norm = r.grad_norm;
      m.lr = r.lr;
      m.tps = tokens_per_second(tokens_per_step * window_steps, window_seconds) / ranks_per_batch;
      m.mfu = std::isnan(peak_flops) ? peak_flops : mfu_percent(m.tps, flops_per_token_, peak_flops);
      const int64_t peak_bytes = window_peak_bytes;
      m.mem_peak_gib = static_cast<double>(peak_bytes) / (1024.0 * 1024.0 * 1024.0);
      if (!device_.is_cpu()) {
        m.extra["mem_reserved_gib"] =
            static_cast<double>(memory::reserved_bytes(device_)) / (1024.0 * 1024.0 * 1024.0);
        if (info.total_memory_bytes > 0) {
          m.extra["mem_peak_pct"] = 100.0 * static_cast<double>(peak_bytes) /
                                    static_cast<double>(info.total_memory_bytes);
        }
      }
      if (window_memory) {
        m.file_only = window_memory->as_metrics();
      }
      add_comm_metrics(m, distributed::comm_stats().snapshot(), window_steps,
                       window_seconds / static_cast<double>(window_steps));
      // What the applied parallelisms and layers report of the last step (MoE expert loads).
      for (const auto& [key, value] : parallel_model_->step_metrics()) m.file_only[key] = value;
      progress.record_log(m);
      metrics_->log(m, progress.prefix());
      window_seconds = 0.0;
      window_steps = 0;
      window_peak_bytes = 0;
      window_memory.reset();
      memory::reset_peak(device_);
      distributed::comm_stats().reset();
    } else {
      // Between log steps, a terminal shows where the run is on one line redrawn in place.
      log::status(progress.status_line(last_loss));
    }
    // After the step's metrics, so its time is not in the step's tokens/s.
    if (validator_) validator_->maybe_validate(step_, t.steps, *metrics_);
    if (profiler_) profiler_->step(step_);  // writes the trace of a window that ended here
    maybe_inject_fault(/*after_step=*/true);
    if (hooks_.at_step_boundary) hooks_.at_step_boundary(*this);
  }
  if (profiler_) profiler_->finish(step_);
  if (memory_profiler_) memory_profiler_->finish(step_);
  if (checkpointer_) checkpointer_->wait();
  finish_run(progress.summary());
  return results;
}

void Trainer::finish_run(RunSummary summary) {
  if (dist_->rank() != 0) return;
  const fs::path dump(config_.job.dump_folder);
  summary.run_folder = dump.string();
  if (config_.metrics.enable_jsonl) {
    summary.metrics_path = metrics_->jsonl_path().string();
    // Training is done and its results are on disk: a plot that cannot be drawn is a warning, not
    // a failed run.
    try {
      write_plot({dump}, dump / "loss.svg");
      summary.plot_path = (dump / "loss.svg").string();
    } catch (const std::exception& e) {
      log::warn("the loss plot was not written: ", e.what());
    }
  }
  if (checkpointer_) {
    const fs::path folder = dump / config_.checkpoint.folder;
    summary.checkpoint_folder = folder.string();
    summary.last_checkpoint = (folder / checkpoint::step_dir_name(step_)).string();
    summary.tokenizer_path = config_.model.tokenizer_path;
  }
  summary.tensorboard_folder = metrics_->tensorboard_folder().string();
  for (const std::string& line : format_run_summary(summary)) log::info(line);
}

}  // namespace loom::train
