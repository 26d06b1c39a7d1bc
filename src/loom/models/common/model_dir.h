// A decoder's weights on disk, for every registered family, in two formats:
//   Hugging Face: config.json (<Family>ForCausalLM; its model_type picks the family) +
//                 model.safetensors or a sharded model.safetensors.index.json, HF parameter names.
//   Loom:         a sharded checkpoint directory as the trainer writes it (loom/checkpoint:
//                 rank-R.safetensors, metadata.json with CRC-32C per chunk, COMPLETE), Loom
//                 parameter names. Its global JSON state carries the model under "model"
//                 ({"name": "<family>", "model_args": {...}}), so the directory describes itself;
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

#include "loom/models/common/adapter_dir.h"
#include "loom/models/common/decoder.h"
#include "loom/models/spec.h"

namespace loom::models {

enum class ModelDirFormat { kLoom, kHuggingFace };

// Loom when `dir` is a checkpoint directory or a folder of them, else Hugging Face when
// dir/config.json is one; throws a one-line loom::Error otherwise.
ModelDirFormat detect_model_dir_format(const std::filesystem::path& dir);

// The checkpoint directory `path` stands for: itself when it holds metadata.json, else the newest
// complete step-N inside it. Throws a one-line loom::Error when it is neither.
std::filesystem::path resolve_loom_checkpoint(const std::filesystem::path& path);

// A model directory's family and args, read without any weights: callers check their limits
// against them (`loom generate`: the prompt and new tokens against max_seq_len) before loading.
struct ModelDirArgs {
  const ModelSpec* spec = nullptr;
  std::unique_ptr<ModelArgs> args;
  bool hf_tied = false;  // Hugging Face: config.json's tie_word_embeddings

  const DecoderArgs& decoder() const;  // a one-line loom::Error for a family that is not a decoder
};
ModelDirArgs read_model_dir_args(const std::filesystem::path& dir);
// A Hugging Face config.json by itself (no weights): its model_type's family and the args that
// family's one reader (HfFormat::read_config, also behind read_model_dir_args, `loom score`,
// `convert`, `generate`) makes of it. What the family cannot express is a one-line UsageError
// naming the file, the field, its value and what Loom supports.
ModelDirArgs read_hf_config(const std::filesystem::path& config_json);
// The config.json that model.flavor = "hf" reads: model.hf_config (the file, or a directory
// holding it) when set, else checkpoint.initial_load_path's when that is a Hugging Face model
// directory. Anything else is a one-line UsageError saying which to set.
std::filesystem::path resolve_hf_config(const std::string& hf_config, const std::string& initial_load_path);
// The args recorded in checkpoint `dir` (resolved); a one-line error when it has none.
ModelDirArgs read_checkpoint_model_args(const std::filesystem::path& dir);

struct LoadOptions {
  // dtype and device of the built model; checkpoint tensors are converted on load.
  torch::TensorOptions options = torch::TensorOptions().dtype(torch::kFloat32);
  // Length of the RoPE cache; default: the checkpoint's (HF: max_position_embeddings).
  std::optional<int64_t> max_seq_len;
  // What the command's user can change when the model does not fit in memory (e.g. "use --dtype
  // bfloat16"); the allocation error names it after the sizes.
  std::string memory_hint = "use a machine with more memory or a smaller model";
  // For an adapter directory: the base to put it on, instead of the one it records.
  std::optional<std::filesystem::path> base;
};

struct LoadedModel {
  const ModelSpec* spec = nullptr;
  std::shared_ptr<Decoder> model;
  ModelDirFormat format = ModelDirFormat::kLoom;
  // The directory the weights came from: `dir` itself, or the step-N a checkpoint folder resolved
  // to (an earlier one when the newest was corrupt; see load_loom_checkpoint).
  std::filesystem::path source;
  // Set when `dir` was an adapter directory: the adapters now on the model (`source` is then the
  // base's directory).
  std::optional<AdapterDir> adapter;
};

// Builds the model on the meta device, materializes it on the target device and fills every
// parameter from the directory. Missing, extra or mis-shaped tensors are errors. An adapter
// directory (adapter_dir.h: a PEFT directory, or a checkpoint of a LoRA run) loads its base
// (options.base, else the one it records) and attaches the adapters to it.
LoadedModel load_model_dir(const std::filesystem::path& dir, const LoadOptions& options = {});
LoadedModel load_hf_model_dir(const std::filesystem::path& dir, const LoadOptions& options = {});
// `dir` is a checkpoint (step-N) or a checkpoint folder. A folder loads like a training resume
// (checkpoint::load_latest): a newest step that turns out corrupt while loading (a chunk's CRC-32C)
// is skipped with a warning naming it and why, for the previous complete one.
LoadedModel load_loom_checkpoint(const std::filesystem::path& dir, const LoadOptions& options = {});

// Writes `dir` as a model-only Loom checkpoint (step 0, one rank file) of `spec`'s model,
// floating-point tensors in `dtype` when given. `dir` must not exist yet; it appears complete or
// not at all.
void save_loom_checkpoint(const ModelSpec& spec, Decoder& model, const std::filesystem::path& dir,
                          std::optional<c10::ScalarType> dtype = std::nullopt);

// Writes a directory transformers can load with <Family>ForCausalLM.from_pretrained: config.json
// and safetensors in `dtype` (default: the model's), sharded above max_shard_bytes. A tied head
// writes no lm_head.weight.
void export_hf_model_dir(const ModelSpec& spec, Decoder& model, const std::filesystem::path& dir,
                         std::optional<c10::ScalarType> dtype = std::nullopt,
                         int64_t max_shard_bytes = int64_t{5} << 30);

// checkpoint.initial_load_path for `spec`'s decoder (ModelSpec::read_initial_weights): a Loom
// checkpoint by path, or a Hugging Face directory of the same family read whole.
InitialWeights read_initial_weights(const ModelSpec& spec, const std::filesystem::path& path);

// MXFP4 (GPT-OSS's published expert weights, read by the Hugging Face loader for any tensor stored
// as `<name>_blocks` + `<name>_scales`): blocks [..., R, G, 16] uint8, two e2m1 values per byte,
// low nibble first; scales [..., R, G] uint8, 2^(s - 127) per block of 32. Returns float32
// [..., G * 32, R] (transformers' layout for them), exactly: every value is representable.
torch::Tensor dequantize_mxfp4(const torch::Tensor& blocks, const torch::Tensor& scales);

}  // namespace loom::models
