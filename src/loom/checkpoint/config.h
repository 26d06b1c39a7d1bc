// The [checkpoint] section of a job config: what the Trainer's checkpointer is asked to do.
#pragma once
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>

#include "loom/core/options.h"

namespace loom::checkpoint {

// checkpoint.async_mode: "disabled" (save inside the step) | "async" (CheckpointOptions::async).
enum class AsyncMode { kDisabled, kAsync };
const options::EnumNames<AsyncMode>& option_names(AsyncMode);

// checkpoint.export_dtype: the dtype of model-only final weights.
enum class ExportDtype { kFloat32, kBFloat16, kFloat16 };
const options::EnumNames<ExportDtype>& option_names(ExportDtype);
c10::ScalarType scalar_type(ExportDtype dtype);

struct CheckpointConfig {
  bool enable = false;
  std::string folder = "checkpoint";  // relative to job.dump_folder
  int64_t interval = 500;
  int64_t keep_latest_k = 10;  // 0 = keep all
  AsyncMode async_mode = AsyncMode::kDisabled;
  bool model_only = false;
  ExportDtype export_dtype = ExportDtype::kFloat32;
  std::string initial_load_path;  // empty = none

  bool operator==(const CheckpointConfig&) const = default;
};
const options::Section& checkpoint_section();

}  // namespace loom::checkpoint
