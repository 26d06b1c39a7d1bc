// Model weights on disk, in two formats:
//   Hugging Face: config.json (LlamaForCausalLM) + model.safetensors or a sharded
//                 model.safetensors.index.json, HF parameter names.
//   Loom:         a sharded checkpoint directory as the trainer writes it (loom/checkpoint:
//                 rank-R.safetensors, metadata.json with CRC-32C per chunk, COMPLETE), Loom
//                 parameter names. Its global JSON state carries the model config under "model"
//                 ({"name": "llama3", "model_args": {...}}), so the directory describes itself;
//                 the trainer's own checkpoints carry it too. A checkpoint folder (holding
//                 step-N directories) stands for its newest complete checkpoint that loads
//                 (a corrupt newest one is skipped, as a training resume does).
// load_model_dir tells them apart (metadata.json or step-N directories vs config.json).
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "loom/models/llama3/model.h"
#include "loom/models/spec.h"

namespace loom::llama3 {

enum class ModelDirFormat { kLoom, kHuggingFace };

// Loom when `dir` is a checkpoint directory or a folder of them, else Hugging Face when
// dir/config.json is one; throws a one-line loom::Error otherwise.
ModelDirFormat detect_model_dir_format(const std::filesystem::path& dir);

// The checkpoint directory `path` stands for: itself when it holds metadata.json, else the newest
// complete step-N inside it. Throws a one-line loom::Error when it is neither.
std::filesystem::path resolve_loom_checkpoint(const std::filesystem::path& path);

// The checkpoint JSON entry that makes a Loom checkpoint self-describing (key kModelConfigKey).
using models::kModelConfigKey;
nlohmann::json model_config_json(const ModelArgs& args);
// The ModelArgs of such an entry; `source` names its file. Another model's entry, or one without
// model_args, is a one-line loom::Error.
ModelArgs model_args_from_config_json(const nlohmann::json& model, const std::string& source);
// The ModelArgs recorded in checkpoint `dir` (resolved); a one-line error when it has none.
ModelArgs read_checkpoint_model_args(const std::filesystem::path& dir);
// The ModelArgs of a model directory of either format (HF config.json or the Loom checkpoint's
// record), without reading or allocating any weights: callers check their limits against them
// (`loom generate`: the prompt and new tokens against max_seq_len) before loading.
ModelArgs read_model_dir_args(const std::filesystem::path& dir);

struct LoadOptions {
  // dtype and device of the built model; checkpoint tensors are converted on load.
  torch::TensorOptions options = torch::TensorOptions().dtype(torch::kFloat32);
  // Length of the RoPE cache; default: the checkpoint's (HF: max_position_embeddings).
  std::optional<int64_t> max_seq_len;
  // What the command's user can change when the model does not fit in memory (e.g. "use --dtype
  // bfloat16"); the allocation error names it after the sizes.
  std::string memory_hint = "use a machine with more memory or a smaller model";
};

struct LoadedModel {
  std::shared_ptr<Transformer> model;
  ModelDirFormat format;
  // The directory the weights came from: `dir` itself, or the step-N a checkpoint folder resolved
  // to (an earlier one when the newest was corrupt; see load_loom_checkpoint).
  std::filesystem::path source;
};

// Builds the model on the meta device, materializes it on the target device and fills every
// parameter from the directory. Missing, extra or mis-shaped tensors are errors.
LoadedModel load_model_dir(const std::filesystem::path& dir, const LoadOptions& options = {});
std::shared_ptr<Transformer> load_hf_model_dir(const std::filesystem::path& dir,
                                               const LoadOptions& options = {});
// `dir` is a checkpoint (step-N) or a checkpoint folder. A folder loads like a training resume
// (checkpoint::load_latest): a newest step that turns out corrupt while loading (a chunk's CRC-32C)
// is skipped with a warning naming it and why, for the previous complete one. `loaded_from`, when
// given, receives the step directory actually loaded.
std::shared_ptr<Transformer> load_loom_checkpoint(const std::filesystem::path& dir,
                                                  const LoadOptions& options = {},
                                                  std::filesystem::path* loaded_from = nullptr);

// Writes `dir` as a model-only Loom checkpoint (step 0, one rank file), floating-point tensors in
// `dtype` when given. `dir` must not exist yet; it appears complete or not at all.
void save_loom_checkpoint(Transformer& model, const std::filesystem::path& dir,
                          std::optional<c10::ScalarType> dtype = std::nullopt);

// Writes a directory transformers can load with LlamaForCausalLM.from_pretrained: config.json and
// safetensors in `dtype` (default: the model's), sharded above max_shard_bytes.
void export_hf_model_dir(Transformer& model, const std::filesystem::path& dir,
                         std::optional<c10::ScalarType> dtype = std::nullopt,
                         int64_t max_shard_bytes = int64_t{5} << 30);

}  // namespace loom::llama3
