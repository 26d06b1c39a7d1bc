// The training job configuration: a typed JobConfig whose sections mirror TorchTitan's job config,
// loaded from a TOML file and then overridden from the command line (--section.key=value or
// --section.key value).
//
// Each section (struct and options::Section schema: every key with its type, field binding, help
// and allowed values) is declared by its feature's folder; this file puts them together, and the
// schema drives parsing, overrides, validation of choices, printing (to_toml) and the key reference
// in docs/config.md. Every mistake becomes one loom::UsageError line (exit code 2)
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

#include "loom/ac/activation_checkpoint.h"
#include "loom/checkpoint/config.h"
#include "loom/core/options.h"
#include "loom/data/sft.h"
#include "loom/distributed/config.h"
#include "loom/float8/convert.h"
#include "loom/lora/lora.h"
#include "loom/models/config.h"
#include "loom/optim/lr_scheduler.h"
#include "loom/parallel/config.h"
#include "loom/elastic/config.h"
#include "loom/profiling/config.h"
#include "loom/train/sections.h"

namespace loom::train {

using distributed::kMaxCommTimeoutSeconds;

// Every section, each declared (struct and schema) by the folder of its feature.
struct JobConfig {
  JobSection job;
  models::ModelConfig model;
  parallel::OptimizerConfig optimizer;
  optim::LRScheduleOptions lr_scheduler;
  TrainingSection training;
  parallel::ParallelismConfig parallelism;
  ac::ACConfig activation_checkpoint;
  float8::Float8Config float8;
  lora::LoRAConfig lora;
  data::SftConfig sft;
  MetricsSection metrics;
  checkpoint::CheckpointConfig checkpoint;
  ValidationSection validation;
  distributed::CommConfig comm;
  elastic::FaultToleranceConfig fault_tolerance;
  profiling::ProfilingConfig profiling;

  // The resolved configuration as TOML, every key in schema order; parsing it gives back an equal
  // config. The trainer prints it and saves it as config.toml in the run folder.
  std::string to_toml() const;

  bool operator==(const JobConfig&) const = default;
};

// ---- Schema ---------------------------------------------------------------------------------

// A typed pointer to one field of a JobConfig.
using ConfigField = options::FieldRef;

// One key of a section, bound to its place in a JobConfig.
struct ConfigKey {
  std::string_view section;    // "float8"
  std::string_view key;        // "recipe"
  std::string_view help;
  const options::Key* spec;    // the section's declaration of the key
  void* (*section_of)(JobConfig&);

  std::string name() const;  // "section.key"
  ConfigField field(JobConfig& config) const { return spec->field(section_of(config)); }
  // The value held in `config`, as TOML.
  std::string value_as_toml(const JobConfig& config) const;
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

using loom::edit_distance;  // (core/strings.h) the nearest-name suggestions use it

}  // namespace loom::train
