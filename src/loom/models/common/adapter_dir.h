// LoRA adapters on disk, apart from the base they adapt (issue 27), in two formats:
//   Loom: a checkpoint a LoRA run saved (loom/checkpoint layout). It holds the adapters only
//         (`layers.0.attention.wq.lora.a` [r, in], `.lora.b` [out, r]); its global JSON records
//         the model ("model"), the adapters' settings ("lora") and the base ("base": the path of
//         checkpoint.initial_load_path and its checksum, or the seed of a randomly initialized one).
//   PEFT: what peft's save_pretrained writes: adapter_config.json (peft_type LORA, r, lora_alpha,
//         lora_dropout, target_modules, use_rslora, bias, base_model_name_or_path) and
//         adapter_model.safetensors with base_model.model.<HF module path>.lora_A.weight [r, in]
//         and .lora_B.weight [out, r]. Loom keeps Hugging Face's q/k layout (it applies no rotary
//         permutation on import), so the factors are the same numbers in both.
// A resident base (models/common/model_dir.h's load_model_dir) takes one adapter after another:
// attach_adapter adds and fills it (reading only the adapter's bytes), lora::remove_lora takes it
// off again.
#pragma once
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "loom/lora/lora.h"
#include "loom/models/common/decoder.h"
#include "loom/models/spec.h"

namespace loom::models {

enum class AdapterFormat { kLoom, kPeft };

// The name under which the checkpoint's global JSON records the frozen base (see above).
inline constexpr const char* kBaseKey = "base";

// A family's Hugging Face module path of each Loom linear ("layers.0.attention.wq" ->
// "model.layers.0.self_attn.q_proj"): LoRA's targets and PEFT's tensor names.
lora::HfModuleName hf_module_names(const HfFormat& hf);

// Whether `dir` holds adapters: a PEFT directory (adapter_config.json), or a Loom checkpoint (or a
// folder of them) whose JSON has a "lora" entry.
bool is_adapter_dir(const std::filesystem::path& dir);

struct AdapterDir {
  AdapterFormat format = AdapterFormat::kLoom;
  std::filesystem::path source;  // the PEFT directory, or the checkpoint's resolved step-N
  // Loom: the checkpoint folder `source` was resolved from (empty when a step-N was given): its
  // tensors are read as a resume reads them, from an earlier step when the newest is corrupt.
  std::filesystem::path folder;
  lora::LoRAOptions options;
  // Where the base is: the Loom checkpoint's base path (empty for a seed-initialized base), or
  // PEFT's base_model_name_or_path (a path or a Hub name).
  std::string base_path;
  nlohmann::json base;  // Loom: the checkpoint's "base" entry; PEFT: a loom rl revision's, else null
  std::string describe() const;  // "peft adapter DIR (rank 4, alpha 8, q_proj,v_proj)"
};

// Reads an adapter directory's settings (not its tensors); a one-line loom::UsageError for one
// Loom cannot represent (another peft_type, bias other than "none", DoRA, per-module ranks, a
// regular-expression target_modules, fan_in_fan_out).
AdapterDir read_adapter_dir(const std::filesystem::path& dir);

// Adds `adapter`'s adapters to `model` (lora::apply_lora with its settings: the model must carry
// none) and fills them. A tensor whose shape does not fit the model's linear, or a missing or
// unexpected tensor, is a one-line loom::UsageError naming the file (an adapter made for another
// base). Returns the bytes of adapter tensors read.
int64_t attach_adapter(const ModelSpec& spec, Decoder& model, const AdapterDir& adapter);

// Warns when a Loom adapter was trained on a base whose checksum is not `base`'s (its numbers
// then mean something else). PEFT directories record no checksum, except a `loom rl` revision's
// loom_revision.json (its "base" entry, read into AdapterDir::base). A warning, not a refusal: the
// checksum is of the base's files, so the same weights in another format (a Loom checkpoint and its
// Hugging Face export) differ.
void check_adapter_base(const AdapterDir& adapter, const std::filesystem::path& base);

// Many adapters over one resident base (`loom score` / `generate --adapter`): each of `adapters`
// in turn is read, checked against the base (check_adapter_base with `base_dir`), attached (only
// its bytes are read), handed to `use` (its index, settings, attach seconds and bytes read) and
// removed again, so the base is never reloaded. The model must carry no adapter to begin with.
using AdapterUse = std::function<void(size_t index, const AdapterDir& adapter, double attach_seconds, int64_t bytes)>;
void with_each_adapter(const ModelSpec& spec, Decoder& model, const std::filesystem::path& base_dir,
                       const std::vector<std::string>& adapters, const AdapterUse& use);

// Writes `model`'s adapters (applied with `options`) as a PEFT directory `dir` (must not exist),
// tensors in `dtype` (default: the adapters'). `base_name`: adapter_config's
// base_model_name_or_path.
void export_peft_dir(const ModelSpec& spec, Decoder& model, const lora::LoRAOptions& options,
                     const std::string& base_name, const std::filesystem::path& dir,
                     std::optional<c10::ScalarType> dtype = std::nullopt);

// What identifies a base model directory (Hugging Face or Loom): {"path": absolute path,
// "checksum": "crc32c:xxxxxxxx"}. The checksum covers the bytes that define the weights: a Loom
// checkpoint's metadata.json (which holds every chunk's CRC-32C), a Hugging Face directory's
// config.json and safetensors files (read once, at about the disk's speed).
nlohmann::json base_reference(const std::filesystem::path& base);

}  // namespace loom::models
