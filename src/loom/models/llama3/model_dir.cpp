#include "loom/models/llama3/model_dir.h"

#include <nlohmann/json.hpp>

#include <fstream>
#include <set>

#include "loom/checkpoint/safetensors.h"
#include "loom/core/error.h"
#include "loom/models/llama3/hf_adapter.h"

namespace loom::llama3 {
namespace fs = std::filesystem;
namespace {
constexpr const char* kLoomFormat = "loom.llama3";
constexpr int kLoomFormatVersion = 1;

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path);
  LOOM_REQUIRE(in.good(), "cannot read '", path.string(), "'");
  try {
    return nlohmann::json::parse(in);
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
std::shared_ptr<Transformer> build_empty(const ModelArgs& args, const LoadOptions& load) {
  auto model = std::make_shared<Transformer>(args, load.options.device(torch::kMeta));
  model->to_empty(load.options.device());
  model->reset_buffers();
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

ModelDirFormat detect_model_dir_format(const fs::path& dir) {
  const fs::path config = dir / "config.json";
  LOOM_REQUIRE(fs::exists(config), "no config.json in '", dir.string(),
               "'; expected a Hugging Face Llama or Loom model directory");
  const nlohmann::json j = read_json(config);
  if (j.is_object() && j.contains("format") && j["format"] == kLoomFormat) {
    return ModelDirFormat::kLoom;
  }
  if (j.is_object() && (j.contains("model_type") || j.contains("architectures"))) {
    return ModelDirFormat::kHuggingFace;
  }
  fail("'", config.string(), "' is neither a Loom (\"format\": \"", kLoomFormat,
       "\") nor a Hugging Face (\"model_type\") model config");
}

LoadedModel load_model_dir(const fs::path& dir, const LoadOptions& options) {
  const ModelDirFormat format = detect_model_dir_format(dir);
  return {format == ModelDirFormat::kLoom ? load_loom_model_dir(dir, options)
                                          : load_hf_model_dir(dir, options),
          format};
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

std::shared_ptr<Transformer> load_loom_model_dir(const fs::path& dir, const LoadOptions& options) {
  const fs::path config_path = dir / "config.json";
  const nlohmann::json config = read_json(config_path);
  LOOM_REQUIRE(config.value("format", "") == kLoomFormat, "'", config_path.string(),
               "' is not a Loom model config (\"format\": \"", kLoomFormat, "\")");
  const int version = config.value("format_version", 0);
  LOOM_REQUIRE(version == kLoomFormatVersion, "'", config_path.string(), "' has format_version ",
               version, "; this Loom reads version ", kLoomFormatVersion);
  LOOM_REQUIRE(config.contains("model_args"), "'", config_path.string(), "' has no model_args");
  ModelArgs args = model_args_from_json(config["model_args"], config_path.string());
  if (options.max_seq_len) args.max_seq_len = *options.max_seq_len;
  const auto ckpt = checkpoint::SafetensorsCheckpoint::open(dir);
  auto model = build_empty(args, options);
  std::set<std::string> expected;
  for (const auto& p : model->named_parameters()) {
    expected.insert(p.name);
    LOOM_REQUIRE(ckpt.contains(p.name), "'", ckpt.source().string(), "' is missing parameter '",
                 p.name, "'");
    fill(*model, p.name, ckpt, p.name);
  }
  for (const auto& name : ckpt.names()) {
    LOOM_REQUIRE(expected.count(name), "unexpected tensor '", name, "' in '",
                 ckpt.source().string(), "'; it does not belong to this model's config");
  }
  return model;
}

void save_model_dir(Transformer& model, const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  LOOM_REQUIRE(!ec, "cannot create directory '", dir.string(), "': ", ec.message());
  checkpoint::save_safetensors(dir / "model.safetensors", model.state_dict(),
                               {{"format", kLoomFormat}});
  const nlohmann::json config = {{"format", kLoomFormat},
                                 {"format_version", kLoomFormatVersion},
                                 {"model_args", to_json(model.args())}};
  checkpoint::write_text_file_atomically(dir / "config.json", config.dump(2) + "\n");
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
