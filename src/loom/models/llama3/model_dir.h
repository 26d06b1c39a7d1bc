// Model directories on disk, in two formats:
//   Hugging Face: config.json (LlamaForCausalLM) + model.safetensors or a sharded
//                 model.safetensors.index.json, HF parameter names.
//   Loom:         config.json {"format": "loom.llama3", "model_args": {...}} + model.safetensors
//                 with Loom parameter names (to be superseded by sharded checkpoints).
// load_model_dir tells them apart from config.json.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include "loom/models/llama3/model.h"

namespace loom::llama3 {

enum class ModelDirFormat { kLoom, kHuggingFace };

// Reads dir/config.json; throws a one-line loom::Error if it is missing or neither format.
ModelDirFormat detect_model_dir_format(const std::filesystem::path& dir);

struct LoadOptions {
  // dtype and device of the built model; checkpoint tensors are converted on load.
  torch::TensorOptions options = torch::TensorOptions().dtype(torch::kFloat32);
  // Length of the RoPE cache; default: the checkpoint's (HF: max_position_embeddings).
  std::optional<int64_t> max_seq_len;
};

struct LoadedModel {
  std::shared_ptr<Transformer> model;
  ModelDirFormat format;
};

// Builds the model on the meta device, materializes it on the target device and fills every
// parameter from the directory. Missing, extra or mis-shaped tensors are errors.
LoadedModel load_model_dir(const std::filesystem::path& dir, const LoadOptions& options = {});
std::shared_ptr<Transformer> load_hf_model_dir(const std::filesystem::path& dir,
                                               const LoadOptions& options = {});
std::shared_ptr<Transformer> load_loom_model_dir(const std::filesystem::path& dir,
                                                 const LoadOptions& options = {});

// Writes the Loom format (creates `dir`).
void save_model_dir(Transformer& model, const std::filesystem::path& dir);

// Writes a directory transformers can load with LlamaForCausalLM.from_pretrained: config.json and
// safetensors in `dtype` (default: the model's), sharded above max_shard_bytes.
void export_hf_model_dir(Transformer& model, const std::filesystem::path& dir,
                         std::optional<c10::ScalarType> dtype = std::nullopt,
                         int64_t max_shard_bytes = int64_t{5} << 30);

}  // namespace loom::llama3
