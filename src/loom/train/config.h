// The training job configuration: a typed JobConfig whose sections mirror TorchTitan's job config,
// loaded from a TOML file and then overridden from the command line (--section.key=value or
// --section.key value).
//
// One schema table (config_schema(): one entry per key with its name, type, field binding, help
// and allowed values) drives parsing, overrides, validation of choices, printing (to_toml) and the
// key reference in docs/config.md. Every mistake becomes one loom::UsageError line (exit code 2)
// that names the key, the problem, where it came from, and the nearest valid name when a key or
// section is unknown.
#pragma once
#include "loom/core/strings.h"
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "loom/optim/adamw.h"
#include "loom/optim/lr_scheduler.h"
#include "loom/optim/muon.h"
#include "loom/parallel/optimizer_registry.h"

namespace loom::train {

struct JobSection {
  std::string dump_folder = "outputs";
  std::string description = "default job";
  bool print_config = false;

  bool operator==(const JobSection&) const = default;
};

struct ModelSection {
  std::string name = "llama3";
  std::string flavor = "debugmodel";
  std::string tokenizer_path = "data/default/tokenizer.json";
  int64_t vocab_size = 0;  // 0 = the tokenizer's vocabulary size
  int64_t n_layers = 0;    // 0 = the flavor's
  std::string attention_mask = "causal";  // "causal" | "block_causal" (no attention across documents)

  bool operator==(const ModelSection&) const = default;
};

struct OptimizerSection {
  std::string name = "AdamW";
  double lr = 8e-4;
  double eps = 1e-8;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double weight_decay = 0.1;
  std::string implementation = "fused";  // "fused" | "foreach"
  int64_t block_size = 256;  // AdamW8bit: elements per quantization block
  double muon_momentum = 0.95;                   // Muon: momentum buffer decay mu
  bool muon_nesterov = true;                     // Muon: orthogonalise G + mu * B instead of B
  int64_t muon_ns_steps = 5;                     // Muon: Newton-Schulz iterations
  std::string muon_adjust_lr = "match_rms_adamw";  // Muon: "match_rms_adamw" | "original"

  bool operator==(const OptimizerSection&) const = default;
};

struct LRSchedulerSection {
  int64_t warmup_steps = 200;
  // Unset (or negative in TOML) = decay over all steps after warmup; otherwise WSD: stable, then
  // decay over the last decay_ratio of the steps.
  std::optional<double> decay_ratio;
  std::string decay_type = "linear";  // "linear" | "sqrt" | "cosine"
  double min_lr_factor = 0.0;

  bool operator==(const LRSchedulerSection&) const = default;
};

struct TrainingSection {
  std::string dataset_path = "data/default/corpus.jsonl";
  std::string dataset_format = "jsonl";  // "jsonl" | "text" | "tokens" | "auto"
  std::string jsonl_field = "text";      // the JSONL field holding each document's text
  int64_t local_batch_size = 8;
  int64_t global_batch_size = -1;  // -1 = local_batch_size x data-parallel degree
  int64_t seq_len = 2048;
  double max_norm = 1.0;
  int64_t steps = 10000;
  int64_t seed = 0;
  bool deterministic = false;
  std::string mixed_precision_param = "float32";   // "float32" | "bfloat16"
  std::string mixed_precision_reduce = "float32";  // "float32" | "bfloat16"
  int64_t skip_nonfinite_steps = 0;  // NaN/inf loss or grad norm: steps skipped before stopping
  // "auto" | "cpu" | "cuda". The default stays "cpu" so `make train` (2 FSDP ranks on the CPU)
  // behaves the same on a machine that has a GPU.
  std::string device = "cpu";
  bool allow_tf32 = false;  // TF32 tensor cores for float32 matmuls/convolutions on CUDA
  std::string cuda_kernels = "all";  // Loom's CUDA kernels in use: "all" | "none" | a list
  // When the host reads a step's loss and gradient norm: "auto" | "every_step" | "log_steps".
  std::string step_readback = "auto";

  bool operator==(const TrainingSection&) const = default;
};

struct ParallelismSection {
  int64_t data_parallel_replicate_degree = 1;
  int64_t data_parallel_shard_degree = -1;  // -1 = the ranks left over by the other degrees
  std::string fsdp_reshard_after_forward = "default";  // "default" | "always" | "never" | int
  int64_t tensor_parallel_degree = 1;
  bool disable_sequence_parallel = false;  // TP: keep the residual stream whole between blocks
  bool disable_loss_parallel = false;      // TP: gather the logits for the loss
  bool enable_async_tensor_parallel = false;
  int64_t context_parallel_degree = 1;
  std::string context_parallel_rotate_method = "allgather";  // "allgather" | "ring"
  int64_t pipeline_parallel_degree = 1;
  std::string pipeline_parallel_schedule = "1F1B";  // TorchTitan's names (pipeline/generators.h)
  std::string pipeline_parallel_schedule_csv;       // a hand-written schedule; "" = none
  int64_t pipeline_parallel_microbatch_size = 1;    // rows per micro-batch
  int64_t pipeline_parallel_layers_per_stage = 0;   // 0 = not set
  std::string pipeline_parallel_split_points;       // "layers.2,layers.4"; "" = not set

  bool operator==(const ParallelismSection&) const = default;
};

struct ActivationCheckpointSection {
  std::string mode = "none";  // "none" | "full" | "selective"
  std::string selective_ac_option = "2";  // selective: "op" or every N-th block (TorchTitan's default 2)

  bool operator==(const ActivationCheckpointSection&) const = default;
};

// Float8 linears (loom/float8/, docs/float8.md): every nn::Linear not matched by filter_fqns runs
// its GEMMs on float8 operands with dynamic scaling.
struct Float8Section {
  bool enable = false;
  std::string recipe = "rowwise";     // "rowwise" | "tensorwise" (torchao's recipe names)
  std::string filter_fqns = "output";  // comma-separated FQN substrings kept in high precision

  bool operator==(const Float8Section&) const = default;
};

struct MetricsSection {
  int64_t log_freq = 10;
  bool enable_jsonl = true;
  bool enable_tensorboard = false;
  bool memory_breakdown = true;  // train/memory_accounting.h
  double peak_flops = 0.0;  // FLOP/s per rank for MFU; 0 = measure this machine's fp32 GEMM peak

  bool operator==(const MetricsSection&) const = default;
};

struct CheckpointSection {
  bool enable = false;
  std::string folder = "checkpoint";  // relative to job.dump_folder
  int64_t interval = 500;
  int64_t keep_latest_k = 10;  // 0 = keep all
  std::string async_mode = "disabled";  // "disabled" | "async"
  bool model_only = false;
  std::string export_dtype = "float32";  // "float32" | "bfloat16" | "float16"
  std::string initial_load_path;         // empty = none

  bool operator==(const CheckpointSection&) const = default;
};

// TorchTitan's [validation]: the loss on held-out data every `freq` steps and at the last step.
struct ValidationSection {
  bool enable = false;
  std::string dataset_path;              // held-out data, in any form training.dataset_path takes
  std::string dataset_format = "auto";   // "jsonl" | "text" | "tokens" | "auto"
  int64_t freq = 100;                    // every this many steps, and at the last step
  int64_t steps = -1;                    // batches per evaluation; -1 = the whole file once
  int64_t local_batch_size = 0;          // 0 = training.local_batch_size
  int64_t seq_len = 0;                   // 0 = training.seq_len

  bool operator==(const ValidationSection&) const = default;
};

struct CommSection {
  int64_t timeout_seconds = 300;  // at most kMaxCommTimeoutSeconds

  bool operator==(const CommSection&) const = default;
};

// TorchTitan's [profiling] keys (profiling/profiler.h): Kineto traces of a few steps in every
// window of profile_freq, and a memory record (CUDA allocator snapshots, or an RSS timeline on the
// CPU). Both folders are relative to job.dump_folder.
struct ProfilingSection {
  bool enable_profiling = false;
  std::string save_traces_folder = "profile_traces";
  int64_t profile_freq = 10;
  int64_t profiler_active = 1;
  int64_t profiler_warmup = 3;
  bool enable_memory_snapshot = false;
  std::string save_memory_snapshot_folder = "memory_snapshot";

  bool operator==(const ProfilingSection&) const = default;
};

// comm.timeout_seconds is turned into std::chrono milliseconds (and nanoseconds deeper down);
// one week is far beyond any real rendezvous or collective and far from overflowing them.
inline constexpr int64_t kMaxCommTimeoutSeconds = 7 * 24 * 3600;

struct JobConfig {
  JobSection job;
  ModelSection model;
  OptimizerSection optimizer;
  LRSchedulerSection lr_scheduler;
  TrainingSection training;
  ParallelismSection parallelism;
  ActivationCheckpointSection activation_checkpoint;
  Float8Section float8;
  MetricsSection metrics;
  CheckpointSection checkpoint;
  ValidationSection validation;
  CommSection comm;
  ProfilingSection profiling;

  // The resolved configuration as TOML, every key in schema order; parsing it gives back an equal
  // config. The trainer prints it and saves it as config.toml in the run folder.
  std::string to_toml() const;

  bool operator==(const JobConfig&) const = default;
};

// ---- Schema ---------------------------------------------------------------------------------

// A typed pointer to one field of a JobConfig.
using ConfigField =
    std::variant<bool*, int64_t*, double*, std::string*, std::optional<double>*>;

struct ConfigKey {
  std::string_view section;
  std::string_view key;
  ConfigField (*field)(JobConfig&);  // binds the key to a config's field
  std::string_view help;
  std::vector<std::string_view> choices;  // allowed string values; empty = any
  bool integer_allowed = false;           // string key that also takes a positive integer

  std::string name() const;  // "section.key"
  // "a boolean" / "an integer" / "a number" / "a string" / "a number or none" / ...
  std::string type_description() const;
  // The value held in `config`, as TOML.
  std::string value_as_toml(const JobConfig& config) const;
  // The type column of docs/config.md: bool, int, float, string, or the allowed values.
  std::string doc_type() const;
};

// Every key, grouped by section in a fixed order.
const std::vector<ConfigKey>& config_schema();
// Section names in schema order.
std::vector<std::string_view> config_sections();
// The reference part of docs/config.md (one table per section, with the section's prose), generated
// from the schema: `loom train --config-reference` prints it and `make docs` writes it; a unit test
// fails when the page differs.
std::string config_reference_markdown();

// ---- Loading --------------------------------------------------------------------------------

// Parses a TOML file over the defaults. Unknown sections/keys, wrong types, disallowed values,
// malformed TOML and a missing file are loom::UsageError.
JobConfig load_config_file(const std::string& path);
// Same for TOML text; `origin` names it in messages (e.g. a file name).
JobConfig parse_config_toml(std::string_view toml_text, const std::string& origin);

// Applies command-line overrides in order: "--section.key=value", or "--section.key" "value" as
// two arguments; a boolean key given without a value is set to true. Values are converted to the
// key's type ("none" unsets decay_ratio).
void apply_overrides(JobConfig& config, const std::vector<std::string>& args);

// Defaults, then the file (if `path` is non-empty), then the overrides, then validate().
JobConfig load_job_config(const std::string& path, const std::vector<std::string>& overrides = {});

// Cross-field and range checks that do not depend on the world size (every number finite,
// positive sizes, beta ranges, global batch a multiple of the local batch, ...). Throws
// loom::UsageError.
void validate(const JobConfig& config);

// Gradient-accumulation steps per optimizer step for `data_parallel_degree` ranks: 1 when
// training.global_batch_size is -1, else global / (local x dp), which must divide exactly.
int64_t gradient_accumulation_steps(const JobConfig& config, int64_t data_parallel_degree);

// The optimizer and LR-schedule options a config asks for. Weight decay is per parameter group:
// pass optimizer.weight_decay to optim::weight_decay_param_groups.
optim::AdamWOptions adamw_options(const JobConfig& config);
// optimizer.muon_* (Muon's matrices; its other parameters use adamw_options).
optim::MuonOptions muon_options(const JobConfig& config);
// optimizer.* as the registered optimizers (parallel/optimizer_registry.h) read it.
parallel::OptimizerRequest optimizer_request(const JobConfig& config);
optim::LRScheduleOptions lr_schedule_options(const JobConfig& config);

using loom::edit_distance;  // (core/strings.h) the nearest-name suggestions use it

}  // namespace loom::train
