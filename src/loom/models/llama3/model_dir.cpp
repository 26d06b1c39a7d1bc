#include "loom/models/llama3/model_dir.h"

#include <nlohmann/json.hpp>

#include <fstream>
#include <set>

#include "loom/checkpoint/loader.h"
#include "loom/checkpoint/metadata.h"
#include "loom/checkpoint/safetensors.h"
#include "loom/checkpoint/saver.h"
#include "loom/core/error.h"
#include "loom/data/sources.h"
#include "loom/core/logging.h"
#include "loom/core/memory.h"
#include "loom/models/llama3/hf_adapter.h"

namespace loom::llama3 {
namespace fs = std::filesystem;
namespace {
constexpr const char* kModelName = "llama3";

nlohmann::json read_json(const fs::path& path) {
  // A model folder is the user's: its files are opened without blocking, regular files only.
  const std::string text = data::read_file(path.string(), "model folder file");
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail("'", path.string(), "' is not valid JSON (", e.what(), ")");
  }
}

std::string hf_dtype_name(c10::ScalarType dtype) {
  switch (dtype) {
    case torch::kFloat32: return "float32";
    case torch::kBFloat16: return "bfloat16";
    case torch::kFloat16: return "float16";
    default: fail("cannot export a Hugging Face checkpoint in ", c10::toString(dtype),
                  "; use float32, bfloat16 or float16");
  }
}

// Builds `args` on the meta device, then gives it uninitialized storage on the target device.
// Parameters and the RoPE table are sized by the checkpoint's config and the command's options,
// so running out of memory here is reported with those sizes and what to lower instead of the
// allocator's bare "can't allocate memory".
std::shared_ptr<Transformer> build_empty(const ModelArgs& args, const LoadOptions& load) {
  auto model = std::make_shared<Transformer>(args, load.options.device(torch::kMeta));
  int64_t bytes = 0;
  for (const auto& p : model->named_parameters()) bytes += p.tensor().numel() * p.tensor().element_size();
  // The RoPE table: cos and sin for every position (Transformer's "freqs" buffer).
  bytes += 2 * args.max_seq_len * args.head_dim() * static_cast<int64_t>(sizeof(float));
  memory::with_allocation_context(
      [&] {
        model->to_empty(load.options.device());
        model->reset_buffers();
      },
      c10::str("the model (", args.summary(), ", max_seq_len ", args.max_seq_len, ", ",
               c10::toString(load.options.dtype().toScalarType()), ")"),
      bytes, load.options.device(), load.memory_hint);
  return model;
}

// Copies checkpoint tensor `source_name` into the model's parameter `name`.
void fill(Transformer& model, const std::string& name, const checkpoint::SafetensorsCheckpoint& ckpt,
          const std::string& source_name) {
  nn::ParameterSlot& slot = model.parameter_slot(name);
  torch::Tensor value = ckpt.tensor(source_name);
  LOOM_REQUIRE(value.sizes() == slot.tensor.sizes(), "tensor '", source_name, "' in '",
               ckpt.source().string(), "' has shape ", value.sizes(), " but parameter '", name,
               "' of the model has ", slot.tensor.sizes());
  torch::NoGradGuard no_grad;
  slot.tensor.copy_(value);
}
}  // namespace

namespace {
bool is_checkpoint_dir(const fs::path& dir) {
  return fs::exists(dir / checkpoint::kMetadataFile);
}
bool holds_checkpoints(const fs::path& dir) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (entry.is_directory(ec) && checkpoint::parse_step_dir_name(entry.path().filename().string())) {
      return true;
    }
  }
  return false;
}
}  // namespace

ModelDirFormat detect_model_dir_format(const fs::path& dir) {
  LOOM_REQUIRE(fs::is_directory(dir), "'", dir.string(), "' is not a directory; expected a Loom "
               "checkpoint or a Hugging Face Llama model directory");
  if (is_checkpoint_dir(dir) || holds_checkpoints(dir)) return ModelDirFormat::kLoom;
  const fs::path config = dir / "config.json";
  LOOM_REQUIRE(fs::exists(config), "'", dir.string(), "' has neither metadata.json nor "
               "config.json; expected a Loom checkpoint or a Hugging Face Llama model directory");
  const nlohmann::json j = read_json(config);
  if (j.is_object() && (j.contains("model_type") || j.contains("architectures"))) {
    return ModelDirFormat::kHuggingFace;
  }
  fail("'", config.string(), "' is not a Hugging Face model config (no \"model_type\"); expected "
       "a Loom checkpoint or a Hugging Face Llama model directory");
}

fs::path resolve_loom_checkpoint(const fs::path& path) {
  if (is_checkpoint_dir(path)) return path;
  LOOM_REQUIRE(holds_checkpoints(path), "'", path.string(), "' is not a Loom checkpoint (no "
               "metadata.json) nor a folder of step-N checkpoints");
  const auto latest = checkpoint::find_latest_complete(path, checkpoint::Verification::kStructure);
  LOOM_REQUIRE(latest.has_value(), "'", path.string(), "' holds no complete checkpoint (no step-N "
               "with a COMPLETE marker)");
  return latest->path;
}

nlohmann::json model_config_json(const ModelArgs& args) {
  return {{"name", kModelName}, {"model_args", to_json(args)}};
}

ModelArgs read_checkpoint_model_args(const fs::path& path) {
  const fs::path dir = resolve_loom_checkpoint(path);
  const checkpoint::CheckpointMetadata metadata = checkpoint::CheckpointMetadata::read(dir);
  const std::string where = (dir / checkpoint::kMetadataFile).string();
  LOOM_REQUIRE(metadata.json.contains(kModelConfigKey), "checkpoint '", dir.string(),
               "' records no model config (\"", kModelConfigKey, "\" in ", where,
               "); it was saved by an older Loom, so pass the model flavor explicitly");
  return model_args_from_config_json(metadata.json.at(kModelConfigKey), where);
}

ModelArgs read_model_dir_args(const fs::path& dir) {
  if (detect_model_dir_format(dir) == ModelDirFormat::kLoom) return read_checkpoint_model_args(dir);
  const fs::path config_path = dir / "config.json";
  return hf_config_to_model_args(read_json(config_path), config_path.string()).args;
}

ModelArgs model_args_from_config_json(const nlohmann::json& model, const std::string& source) {
  LOOM_REQUIRE(model.is_object() && model.value("name", "") == kModelName, "'", source,
               "' holds a '", model.is_object() ? model.value("name", "") : model.dump(),
               "' model; this loader reads ", kModelName);
  LOOM_REQUIRE(model.contains("model_args"), "'", source, "' has no model.model_args");
  return model_args_from_json(model.at("model_args"), source);
}

LoadedModel load_model_dir(const fs::path& dir, const LoadOptions& options) {
  const ModelDirFormat format = detect_model_dir_format(dir);
  LoadedModel loaded{nullptr, format, dir};
  loaded.model = format == ModelDirFormat::kLoom ? load_loom_checkpoint(dir, options, &loaded.source)
                                                 : load_hf_model_dir(dir, options);
  return loaded;
}

std::shared_ptr<Transformer> load_hf_model_dir(const fs::path& dir, const LoadOptions& options) {
  const fs::path config_path = dir / "config.json";
  HfLlamaConfig config = hf_config_to_model_args(read_json(config_path), config_path.string());
  if (options.max_seq_len) config.args.max_seq_len = *options.max_seq_len;
  const auto ckpt = checkpoint::SafetensorsCheckpoint::open(dir);
  auto model = build_empty(config.args, options);

  std::set<std::string> filled;
  for (const std::string& hf_name : ckpt.names()) {
    if (is_ignorable_hf_tensor(hf_name)) continue;
    const auto loom_name = hf_to_loom_name(hf_name);
    LOOM_REQUIRE(loom_name.has_value(), "unexpected tensor '", hf_name, "' in '",
                 ckpt.source().string(), "'; not a LlamaForCausalLM weight");
    LOOM_REQUIRE(model->find_submodule(loom_name->substr(0, loom_name->rfind('.'))) != nullptr,
                 "tensor '", hf_name, "' in '", ckpt.source().string(),
                 "' does not fit config.json (num_hidden_layers = ", config.args.n_layers, ")");
    fill(*model, *loom_name, ckpt, hf_name);
    filled.insert(*loom_name);
  }
  // Tied checkpoints (Llama 3.2 1B/3B) store no lm_head: Loom's untied head starts as a copy.
  if (!filled.count("output.weight") && filled.count("tok_embeddings.weight")) {
    LOOM_REQUIRE(config.tie_word_embeddings, "'", ckpt.source().string(),
                 "' has no lm_head.weight and config.json does not set tie_word_embeddings");
    fill(*model, "output.weight", ckpt, "model.embed_tokens.weight");
    filled.insert("output.weight");
  }
  for (const auto& p : model->named_parameters()) {
    LOOM_REQUIRE(filled.count(p.name), "'", ckpt.source().string(), "' is missing '",
                 loom_to_hf_name(p.name).value_or(p.name), "'");
  }
  return model;
}

std::shared_ptr<Transformer> load_loom_checkpoint(const fs::path& path, const LoadOptions& options,
                                                  fs::path* loaded_from) {
  const fs::path dir = resolve_loom_checkpoint(path);
  ModelArgs args = read_checkpoint_model_args(dir);
  if (options.max_seq_len) args.max_seq_len = *options.max_seq_len;
  auto model = build_empty(args, options);
  checkpoint::ShardedStateDict dest;
  for (const auto& p : model->named_parameters()) dest.add_full(p.name, checkpoint::kModelComponent, p.tensor().detach());
  // The recorded config and the saved model tensors must agree both ways; optimizer and other
  // state of a training checkpoint is simply not read.
  const auto saved = checkpoint::CheckpointMetadata::read(dir).tensors;
  for (const auto& [name, t] : saved) {
    LOOM_REQUIRE(t.component != checkpoint::kModelComponent || dest.contains(name),
                 "unexpected model tensor '", name, "' in checkpoint '", dir.string(),
                 "'; it does not belong to the model its config describes");
  }
  for (const auto& [name, t] : dest.tensors()) {
    LOOM_REQUIRE(saved.count(name), "checkpoint '", dir.string(), "' is missing parameter '", name,
                 "' of the model its config describes");
  }
  torch::NoGradGuard no_grad;
  if (is_checkpoint_dir(path)) {
    checkpoint::load_checkpoint(dir, dest);
    if (loaded_from) *loaded_from = dir;
  } else {
    // A checkpoint folder: the structure check in resolve_loom_checkpoint does not read the
    // chunks, so a CRC-corrupt newest step only shows while loading. Training's resume
    // (load_latest) then falls back to the previous complete step with a warning; score, generate
    // and convert read the folder the same way, so a folder a run would resume from also loads
    // here. The steps of one folder share the model config read from `dir` above; one that does
    // not fit it is an error, not a fallback.
    checkpoint::LoadOptions quiet;
    quiet.log_loaded = false;  // stdout is the command's output (generated text, scores)
    const auto result = checkpoint::load_latest(path, dest, *checkpoint::single_process_group(), quiet);
    LOOM_REQUIRE(result.has_value(), "'", path.string(), "' holds no complete checkpoint");
    if (loaded_from) *loaded_from = result->path;
  }
  return model;
}

void save_loom_checkpoint(Transformer& model, const fs::path& dir, std::optional<c10::ScalarType> dtype) {
  LOOM_REQUIRE_USAGE(!fs::exists(dir), "'", dir.string(), "' already exists; choose a new output "
                     "directory or remove it");
  checkpoint::ShardedStateDict state;
  for (const auto& p : model.named_parameters()) {
    state.add_full(p.name, checkpoint::kModelComponent, p.tensor().detach());
  }
  state.json()[kModelConfigKey] = model_config_json(model.args());
  state.json()["step"] = 0;
  // The saver publishes <folder>/step-0 atomically; a scratch folder next to `dir` holds it until
  // it is renamed into place.
  const fs::path scratch = dir.string() + ".saving";
  std::error_code ec;
  fs::remove_all(scratch, ec);
  checkpoint::SaveOptions options;
  options.model_only = true;
  options.export_dtype = dtype;
  checkpoint::ShardedSaver saver(checkpoint::single_process_group());
  const fs::path saved = saver.save(state, scratch, /*step=*/0, options);
  fs::rename(saved, dir, ec);
  LOOM_REQUIRE(!ec, "cannot move the checkpoint '", saved.string(), "' to '", dir.string(), "': ",
               ec.message());
  fs::remove_all(scratch, ec);
}

void export_hf_model_dir(Transformer& model, const fs::path& dir,
                         std::optional<c10::ScalarType> dtype, int64_t max_shard_bytes) {
  const c10::ScalarType out_dtype =
      dtype.value_or(model.tok_embeddings().weight().scalar_type());
  const std::string dtype_name = hf_dtype_name(out_dtype);
  checkpoint::NamedTensors tensors;
  for (auto& [name, tensor] : model.state_dict()) {
    const auto hf_name = loom_to_hf_name(name);
    TORCH_CHECK(hf_name.has_value(), "no Hugging Face name for Loom parameter '", name, "'");
    tensors.emplace_back(*hf_name, tensor.to(out_dtype));
  }
  checkpoint::save_safetensors_sharded(dir, tensors, max_shard_bytes, "model",
                                       {{"format", "pt"}});
  checkpoint::write_text_file_atomically(
      dir / "config.json", model_args_to_hf_config(model.args(), dtype_name).dump(2) + "\n");
}

}  // namespace loom::llama3
