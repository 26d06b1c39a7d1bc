// A model as the Trainer knows it: a ModelSpec registered by name (TorchTitan's TrainSpec), which
// builds the model, counts it, checks a layout against it, parallelizes it, describes it in
// checkpoints and reads its initial weights. The Trainer holds an nn::Module, the spec and the
// spec's ModelArgs, so it names no model.
//
// Trainer flow:
//   const models::ModelSpec& spec = models::get_spec(config.model.name);
//   auto args = spec.build_args({flavor, vocab_size, seq_len});
//   spec.validate_layout(*args, dims, seq_len, tp, pipeline);         // before any process group
//   auto model = spec.build_model(*args, meta);                     // shapes only
//   auto parallel_model = spec.parallelize(model, *args, dims, mesh, options);
//   checkpoint json[kModelConfigKey] = spec.model_config_json(*args);
//
// Slots TorchTitan's TrainSpec has and a ModelSpec has not: the loss (a model's forward_loss fuses
// its output head and loss, and parallelize may replace it, e.g. loss parallel); the optimizer,
// LR schedule, data loader and tokenizer (the same for every model today, built by the Trainer).
#pragma once
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <filesystem>
#include <functional>
#include <optional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "loom/ac/activation_checkpoint.h"
#include "loom/cp/ring_attention.h"
#include "loom/distributed/device_mesh.h"
#include "loom/distributed/parallel_dims.h"
#include "loom/float8/convert.h"
#include "loom/lora/lora.h"
#include "loom/fsdp/fully_shard.h"
#include "loom/models/model_args.h"
#include "loom/nn/module.h"
#include "loom/optim/optimizer.h"
#include "loom/parallel/parallelized_model.h"

namespace loom::models {

// The key under which a checkpoint's global JSON records its model ({"name", "model_args"}), so
// `loom score` and `loom convert` can rebuild it from the checkpoint alone.
inline constexpr const char* kModelConfigKey = "model";

// model.flavor's spelling for "the shape a Hugging Face config.json gives" (ModelRequest::hf_config).
inline constexpr const char* kHfFlavor = "hf";

// What a run asks of a flavor (TorchTitan's update_from_config).
struct ModelRequest {
  std::string flavor;
  int64_t vocab_size = 0;  // embedding rows: model.vocab_size, or the tokenizer's vocabulary
  int64_t seq_len = 0;     // training.seq_len: the positional tables must cover it
  int64_t n_layers = 0;    // model.n_layers: overrides the flavor's when > 0
  // flavor == kHfFlavor: the config.json whose shape to build (models::resolve_hf_config), read by
  // the family's HfFormat::read_config. Its model_type must be this family's; the shape is the
  // file's own, so vocab_size and n_layers, when > 0, must equal its vocab_size and
  // num_hidden_layers (else a one-line UsageError), and min_vocab_size (the tokenizer's
  // vocabulary) must fit in its vocab_size.
  std::filesystem::path hf_config;
  int64_t min_vocab_size = 0;
};

struct TensorParallelOptions {
  bool sequence_parallel = true;  // parallelism.disable_sequence_parallel = false
  bool loss_parallel = true;      // parallelism.disable_loss_parallel = false
  bool async = false;             // parallelism.enable_async_tensor_parallel
};

// Pipeline parallelism as a run asks for it (parallelism.pipeline_parallel_*). The model decides
// how its layers become stages; the schedule comes from pipeline/generators.h.
struct PipelineOptions {
  std::string schedule = "1F1B";  // parallelism.pipeline_parallel_schedule
  std::string schedule_csv;       // parallelism.pipeline_parallel_schedule_csv; "" = none
  int64_t microbatch_size = 1;    // rows per micro-batch
  int64_t microbatches = 1;       // per loaded batch: training.local_batch_size / microbatch_size
  int64_t seq_len = 0;            // tokens per row on this rank: the activations' length
  int64_t layers_per_stage = 0;   // 0 = not set
  std::vector<std::string> split_points;  // empty = not set
  // parallelism.fsdp_reshard_after_forward as written: with FSDP inside the stages, "default" and
  // "never" hold each stage gathered from its UNSHARD to its RESHARD action (TorchTitan's default
  // under PP), "always" or N re-gather it for every micro-batch's forward and backward.
  std::string fsdp_reshard_after_forward = "default";
};

// The parallelism and training settings a model's plan reads (TorchTitan hands parallelize_fn the
// job config; here the models library sits below train/, so the Trainer passes these). Which
// parallelisms apply is decided by the mesh.
struct ParallelizeOptions {
  TensorParallelOptions tp;
  cp::RotateMethod cp_rotate_method = cp::RotateMethod::kAllGather;  // parallelism.context_parallel_rotate_method
  // parallelism.fsdp_reshard_after_forward as written: which of its modules a model reshards
  // ("default" keeps the last block gathered) is the model's plan, so the model parses it.
  std::string fsdp_reshard_after_forward = "default";
  // parallelism.fsdp_bucket_mb: consecutive blocks merged into FSDP groups of about this many MB;
  // 0 = one group per block, -1 (models::kAutoBucketMb) = automatic.
  double fsdp_bucket_mb = 0;
  int64_t fsdp_prefetch_depth = 1;  // parallelism.fsdp_prefetch_depth (FSDPPolicy::prefetch_depth)
  bool fsdp_accumulate_unsharded = false;  // parallelism.fsdp_accumulate_unsharded (FsdpSync)
  fsdp::MixedPrecisionPolicy fsdp_mixed_precision;  // FSDP's param and reduce dtypes
  // What the optimizer needs FSDP's planner never to cut (FSDPPolicy::parameter_granularity):
  // AdamW8bit's quantization blocks (fsdp::adamw8bit_granularity), Muon's whole matrices
  // (fsdp::muon_granularity); unset = element granularity.
  fsdp::ParameterGranularity fsdp_parameter_granularity;
  // [activation_checkpoint]: which modules a model checkpoints is its plan (the decoder: its
  // blocks, see ac::ACOptions).
  ac::ACConfig activation_checkpoint;
  // [float8]: which linears a model converts is its plan (all but the filtered ones, before any
  // parallelism; see float8::convert_to_float8).
  float8::Float8Config float8;
  // [lora]: which linears get adapters is the model's plan (by its Hugging Face module names);
  // rank 0 = none.
  lora::LoRAConfig lora;
  PipelineOptions pipeline;        // read when the mesh has "pp"
  // Autocast around each forward (mixed precision without FSDP); nullopt = full precision.
  std::optional<c10::ScalarType> autocast_dtype;
  uint64_t seed = 0;               // initialization: the single-process values, whatever the layout
  c10::Device device = c10::kCPU;  // the rank's device: parameters, buffers and FSDP's storage
};

// checkpoint.initial_load_path as a model reads it: a Loom checkpoint the Trainer loads through
// the checkpointer (each rank reads only its pieces, whatever layout saved them), or every
// parameter's whole value read from another format (Hugging Face) by Loom parameter name.
struct InitialWeights {
  std::filesystem::path loom_checkpoint;  // non-empty: this checkpoint directory (resolved)
  optim::TensorDict full_parameters;      // else: these, for ParallelizedModel::load_full_parameters
};

// A family's Hugging Face format (transformers' <Family>ForCausalLM): config.json and weight names.
struct HfFormat {
  std::vector<std::string> model_types;  // config.json "model_type" values this family reads
  struct Config {
    std::unique_ptr<ModelArgs> args;      // max_seq_len = max_position_embeddings
    bool tie_word_embeddings = false;     // as the file says (the family's args may untie it)
  };
  // Reads config.json; what the family cannot represent is a one-line loom::Error naming `source`.
  std::function<Config(const nlohmann::json& config, const std::string& source)> read_config;
  // A config.json transformers loads (`torch_dtype` given).
  std::function<nlohmann::json(const ModelArgs&, const std::string& torch_dtype)> write_config;
  // Name mapping; nullopt for a name that is not one of the family's weights.
  std::function<std::optional<std::string>(const std::string& hf_name)> to_loom_name;
  std::function<std::optional<std::string>(const std::string& loom_name)> to_hf_name;

  // Families whose Loom tensors are not one HF tensor each (an MoE layer's experts, stacked in
  // Loom, one tensor per expert or fused gate_up in HF) state where each HF tensor goes: a piece
  // of which Loom tensor. A name without pieces falls back to to_loom_name.
  struct Piece {
    std::string loom_name;
    std::optional<int64_t> row;  // fills the Loom tensor's row `row` (dim 0); nullopt: all of it
    int64_t hf_dim = -1;         // >= 0: from the HF tensor's [hf_begin, hf_begin + hf_length) along hf_dim
    int64_t hf_begin = 0;
    int64_t hf_length = 0;
  };
  std::function<std::vector<Piece>(const std::string& hf_name, c10::IntArrayRef hf_shape)> to_loom_pieces;
  // Families whose HF tensors are transforms of Loom tensors rather than copies (GPT-OSS's fused
  // gate_up_proj with interleaved gate and up columns, its transposed down_proj): the Loom tensors
  // an HF tensor gives, by name (nullopt: not such a tensor; pieces or to_loom_name then apply).
  std::function<std::optional<std::vector<std::pair<std::string, torch::Tensor>>>(const std::string& hf_name,
                                                                                  const torch::Tensor& value)>
      to_loom_tensors;
  // Export of a Loom tensor that is not one HF tensor: its HF tensors (empty: a Loom-only tensor HF
  // has no place for, or one another Loom tensor's HF tensor includes). `loom_tensor` reads any
  // Loom tensor of the model by name, for an HF tensor made of several (GPT-OSS's gate_up_proj of
  // w1 and w3). Unset, or nullopt for a name: to_hf_name.
  using LoomTensorLookup = std::function<torch::Tensor(const std::string& loom_name)>;
  std::function<std::optional<std::vector<std::pair<std::string, torch::Tensor>>>(
      const std::string& loom_name, const torch::Tensor& value, const LoomTensorLookup& loom_tensor)>
      to_hf_tensors;
};

struct ModelSpec {
  std::string name;                  // model.name
  std::vector<std::string> flavors;  // model.flavor's valid values

  // The flavor's args for this run; an unknown flavor is a loom::UsageError listing the valid ones.
  std::function<std::unique_ptr<ModelArgs>(const ModelRequest&)> build_args;
  // The model on `options`' device (torch::kMeta: shapes only, no memory), parameters uninitialized.
  std::function<std::shared_ptr<nn::Module>(const ModelArgs&, const torch::TensorOptions&)> build_model;
  std::function<ParameterCounts(const ModelArgs&)> count_parameters;
  // Training FLOPs per token at `seq_len` (TorchTitan's 6N + attention), for MFU.
  std::function<double(const ModelArgs&, int64_t seq_len)> flops_per_token;

  // Refuses, with a one-line loom::UsageError (exit 2) naming the value and what would work, a
  // layout the model cannot be split into (e.g. a TP degree not dividing the heads). Called before
  // any process group exists.
  // With pp > 1 it also plans the pipeline (stage split and schedule), so a split that cannot be
  // made or too few micro-batches for the schedule fail here. (Settings that do not compose with
  // each other whatever the model are train/compatibility.h's table.)
  std::function<void(const ModelArgs&, const distributed::ParallelDims&, int64_t seq_len,
                     const TensorParallelOptions&, const PipelineOptions&)>
      validate_layout;
  // Applies the model's plan to `model` (built by build_model on the meta device): TP, then FSDP or
  // DDP, as the mesh has them; materializes on options.device and initializes from options.seed.
  // With "pp" in the mesh (TorchTitan's pipelining_fn) the model is first split into this rank's
  // stages, and the result runs each step through the pipeline schedule.
  std::function<std::unique_ptr<parallel::ParallelizedModel>(
      std::shared_ptr<nn::Module> model, const ModelArgs&, const distributed::ParallelDims&,
      const distributed::DeviceMesh&, const ParallelizeOptions&)>
      parallelize;
  // The checkpoint's model entry (under kModelConfigKey) and back; `source` names the file in
  // errors, and an entry for another model or with unknown keys is a one-line error.
  std::function<nlohmann::json(const ModelArgs&)> model_config_json;
  std::function<std::unique_ptr<ModelArgs>(const nlohmann::json&, const std::string& source)>
      model_args_from_config_json;
  // What checkpoint.initial_load_path holds (see InitialWeights); a one-line loom::Error when it is
  // nothing this model reads.
  std::function<InitialWeights(const std::filesystem::path&)> read_initial_weights;
  // The Hugging Face format `loom convert`, `score`, `generate` and initial loads read and write;
  // unset: none.
  std::optional<HfFormat> hf;
};

// The registered spec named `name`; an unknown name is a loom::UsageError listing the registered
// ones.
const ModelSpec& get_spec(const std::string& name);
// The registered names, in registration order (the config schema's choices for model.name).
const std::vector<std::string_view>& spec_names();
// The registered spec whose Hugging Face format reads config.json's `model_type`; a one-line
// loom::Error naming `source` and the supported types otherwise.
const ModelSpec& spec_for_hf_model_type(const std::string& model_type, const std::string& source);

}  // namespace loom::models
