#include "loom/models/common/adapter_dir.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <vector>

#include "loom/checkpoint/crc32c.h"
#include "loom/checkpoint/loader.h"
#include "loom/checkpoint/metadata.h"
#include "loom/checkpoint/safetensors.h"
#include "loom/core/error.h"
#include "loom/core/logging.h"
#include "loom/models/common/model_dir.h"

namespace loom::models {
namespace {
namespace fs = std::filesystem;

constexpr const char* kPeftConfig = "adapter_config.json";
constexpr const char* kRevisionMetadata = "loom_revision.json";  // rl/revisions.h's kRevisionFile
constexpr const char* kPeftWeights = "adapter_model.safetensors";
constexpr const char* kPeftPrefix = "base_model.model.";
constexpr const char* kLoraA = ".lora_A.weight";
constexpr const char* kLoraB = ".lora_B.weight";

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

nlohmann::json read_json_file(const fs::path& path) {
  std::ifstream in(path);
  LOOM_REQUIRE_USAGE(in.good(), "cannot read '", path.string(), "'");
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    fail_usage("'", path.string(), "' is not valid JSON: ", e.what());
  }
}

// The checkpoint's global JSON when `dir` is a Loom checkpoint (or a folder of them) recording
// adapters; nullopt otherwise.
std::optional<std::pair<fs::path, nlohmann::json>> loom_adapter_checkpoint(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec) || detect_model_dir_format(dir) != ModelDirFormat::kLoom) return std::nullopt;
  const fs::path step = resolve_loom_checkpoint(dir);
  nlohmann::json json = checkpoint::CheckpointMetadata::read(step).json;
  if (!json.contains(lora::kCheckpointKey)) return std::nullopt;
  return std::make_pair(step, std::move(json));
}

AdapterDir read_peft_dir(const fs::path& dir) {
  const fs::path config_path = dir / kPeftConfig;
  const std::string where = config_path.string();
  const nlohmann::json c = read_json_file(config_path);
  LOOM_REQUIRE_USAGE(c.is_object(), "'", where, "' is not a JSON object");
  const std::string peft_type = c.value("peft_type", "");
  LOOM_REQUIRE_USAGE(peft_type == "LORA", "'", where, "' is a ", peft_type.empty() ? "?" : peft_type,
                     " adapter; Loom reads LoRA adapters (peft_type \"LORA\")");
  const auto unsupported = [&](const char* key, const std::string& what) {
    fail_usage("'", where, "' sets ", key, " (", what, "), which Loom's LoRA does not have; save the adapter without it");
  };
  if (c.value("bias", std::string("none")) != "none") unsupported("bias", c.at("bias").dump());
  if (c.value("use_dora", false)) unsupported("use_dora", "DoRA");
  if (c.value("fan_in_fan_out", false)) unsupported("fan_in_fan_out", "Conv1D weights");
  for (const char* key : {"rank_pattern", "alpha_pattern"}) {
    if (c.contains(key) && !c.at(key).is_null() && !c.at(key).empty()) unsupported(key, "per-module ranks");
  }
  for (const char* key : {"modules_to_save", "layers_to_transform", "exclude_modules"}) {
    if (c.contains(key) && !c.at(key).is_null() && !c.at(key).empty()) unsupported(key, c.at(key).dump());
  }
  AdapterDir out;
  out.format = AdapterFormat::kPeft;
  out.source = dir;
  try {
    out.options.rank = c.at("r").get<int64_t>();
    out.options.alpha = c.at("lora_alpha").get<double>();
    out.options.dropout = c.value("lora_dropout", 0.0);
    out.options.use_rslora = c.value("use_rslora", false);
    const nlohmann::json& targets = c.at("target_modules");
    if (targets.is_string()) {
      const std::string t = targets.get<std::string>();
      LOOM_REQUIRE_USAGE(t == "all-linear", "'", where, "' gives target_modules as the regular expression '", t,
                         "'; Loom reads a list of module names or \"all-linear\"");
      out.options.target_modules = {t};
    } else {
      out.options.target_modules = targets.get<std::vector<std::string>>();
      std::sort(out.options.target_modules.begin(), out.options.target_modules.end());
    }
    if (c.contains("base_model_name_or_path") && c.at("base_model_name_or_path").is_string()) {
      out.base_path = c.at("base_model_name_or_path").get<std::string>();
    }
  } catch (const nlohmann::json::exception& e) {
    fail_usage("'", where, "' is not a LoRA adapter config Loom can read (", e.what(), ")");
  }
  LOOM_REQUIRE_USAGE(out.options.rank > 0, "'", where, "' has r = ", out.options.rank, "; a LoRA rank is > 0");
  LOOM_REQUIRE_USAGE(fs::exists(dir / kPeftWeights), "'", dir.string(), "' has ", kPeftConfig, " but no ",
                     kPeftWeights, " (Loom reads safetensors adapters: save with safe_serialization=True)");
  // A `loom rl` revision (rl/revisions.h) records its base's path and checksum next to the PEFT
  // files; check_adapter_base compares it as it does a Loom checkpoint's.
  if (fs::exists(dir / kRevisionMetadata)) {
    try {
      const nlohmann::json revision = nlohmann::json::parse(std::ifstream(dir / kRevisionMetadata));
      if (revision.contains(kBaseKey) && revision.at(kBaseKey).is_object()) out.base = revision.at(kBaseKey);
    } catch (const nlohmann::json::exception& e) {
      fail_usage("'", (dir / kRevisionMetadata).string(), "' is malformed (", e.what(), ")");
    }
  }
  return out;
}

// "<prefix>.lora_A.weight" -> (HF module path, is A); nullopt for another name.
std::optional<std::pair<std::string, bool>> peft_tensor(const std::string& name) {
  if (name.rfind(kPeftPrefix, 0) != 0) return std::nullopt;
  const std::string rest = name.substr(std::string(kPeftPrefix).size());
  if (ends_with(rest, kLoraA)) return std::make_pair(rest.substr(0, rest.size() - std::string(kLoraA).size()), true);
  if (ends_with(rest, kLoraB)) return std::make_pair(rest.substr(0, rest.size() - std::string(kLoraB).size()), false);
  return std::nullopt;
}

uint32_t crc_of_file(const fs::path& path, uint32_t crc) {
  std::ifstream in(path, std::ios::binary);
  LOOM_REQUIRE(in.good(), "cannot read '", path.string(), "'");
  std::vector<char> buffer(size_t{16} << 20);
  while (in) {
    in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    crc = checkpoint::crc32c_extend(crc, buffer.data(), static_cast<size_t>(in.gcount()));
  }
  return crc;
}

}  // namespace

lora::HfModuleName hf_module_names(const HfFormat& hf) {
  const auto to_hf = hf.to_hf_name;
  return [to_hf](const std::string& path) -> std::optional<std::string> {
    const auto name = to_hf(path + ".weight");
    if (!name || !ends_with(*name, ".weight")) return std::nullopt;
    return name->substr(0, name->size() - std::string(".weight").size());
  };
}

bool is_adapter_dir(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return false;
  if (fs::exists(dir / kPeftConfig)) return true;
  if (!fs::exists(dir / checkpoint::kMetadataFile) && fs::exists(dir / "config.json")) return false;
  try {
    return loom_adapter_checkpoint(dir).has_value();
  } catch (const Error&) {
    return false;  // not a checkpoint at all: load_model_dir says what it is not
  }
}

std::string AdapterDir::describe() const {
  std::string targets;
  for (const auto& t : options.target_modules) targets += (targets.empty() ? "" : ",") + t;
  return c10::str(format == AdapterFormat::kPeft ? "peft" : "loom", " adapter ", source.string(), " (rank ",
                  options.rank, ", alpha ", options.alpha, ", ", targets, ")");
}

AdapterDir read_adapter_dir(const fs::path& dir) {
  LOOM_REQUIRE_USAGE(fs::is_directory(dir), "adapter '", dir.string(), "' is not a directory");
  if (fs::exists(dir / kPeftConfig)) return read_peft_dir(dir);
  const auto loom = loom_adapter_checkpoint(dir);
  LOOM_REQUIRE_USAGE(loom.has_value(), "'", dir.string(), "' holds no adapters: expected a PEFT directory (",
                     kPeftConfig, ") or a checkpoint of a run with lora.rank > 0");
  const auto& [step, json] = *loom;
  const std::string where = (step / checkpoint::kMetadataFile).string();
  AdapterDir out;
  out.format = AdapterFormat::kLoom;
  out.source = step;
  if (step != dir) out.folder = dir;
  out.options = lora::from_json(json.at(lora::kCheckpointKey), where);
  if (json.contains(kBaseKey)) {
    out.base = json.at(kBaseKey);
    if (out.base.is_object() && out.base.contains("path")) out.base_path = out.base.at("path").get<std::string>();
  }
  return out;
}

int64_t attach_adapter(const ModelSpec& spec, Decoder& model, const AdapterDir& adapter) {
  LOOM_REQUIRE_USAGE(spec.hf.has_value(), "model '", spec.name, "' has no Hugging Face module names for LoRA targets");
  LOOM_REQUIRE(lora::remove_lora(model) == 0, "attach_adapter: the model already carries adapters");
  const lora::HfModuleName hf_names = hf_module_names(*spec.hf);
  const std::string where = adapter.source.string();
  lora::LoRAReport report;
  try {
    report = lora::apply_lora(model, adapter.options, hf_names);
  } catch (const UsageError& e) {
    // The settings are the adapter's, not this run's lora.* keys: a target this base lacks means
    // the adapter was made for another model (family or shape).
    std::string why = e.what();
    const std::string config_key = "lora.target_modules names ";
    if (why.rfind(config_key, 0) == 0) why = "its target_modules name " + why.substr(config_key.size());
    fail_usage("adapter '", where, "' does not fit this ", spec.name, " base: ", why,
               "; it was made for another model", adapter.base_path.empty() ? "" : c10::str(" (", adapter.base_path, ")"),
               ": attach it to the base it was trained on");
  }
  int64_t bytes = 0;
  torch::NoGradGuard no_grad;
  // The adapters to fill, by their Loom parameter names.
  std::map<std::string, torch::Tensor> dest;
  for (const std::string& path : report.adapted) {
    lora::Adapter* a = lora::find_adapter(model, path);
    dest[path + "." + lora::kAdapterName + ".a"] = a->a();
    dest[path + "." + lora::kAdapterName + ".b"] = a->b();
  }
  const auto check_shape = [&](const std::string& name, const std::string& loom_name, c10::IntArrayRef shape) {
    const torch::Tensor& target = dest.at(loom_name);
    LOOM_REQUIRE_USAGE(shape == target.sizes(), "adapter '", where, "': tensor '", name, "' is ", shape,
                       " but this base's ", loom_name, " is ", target.sizes(),
                       ": the adapter was made for a model of another shape; use its own base");
  };
  if (adapter.format == AdapterFormat::kPeft) {
    const auto ckpt = checkpoint::SafetensorsCheckpoint::open(adapter.source / kPeftWeights);
    std::set<std::string> filled;
    for (const std::string& name : ckpt.names()) {
      const auto parsed = peft_tensor(name);
      LOOM_REQUIRE_USAGE(parsed.has_value(), "adapter '", where, "': unexpected tensor '", name,
                         "' (expected base_model.model.<module>.lora_A.weight / .lora_B.weight)");
      const auto loom_weight = spec.hf->to_loom_name(parsed->first + ".weight");
      LOOM_REQUIRE_USAGE(loom_weight.has_value() && ends_with(*loom_weight, ".weight"), "adapter '", where,
                         "': tensor '", name, "' names module '", parsed->first, "', which this ", spec.name,
                         " model does not have");
      const std::string linear = loom_weight->substr(0, loom_weight->size() - std::string(".weight").size());
      const std::string loom_name = linear + "." + lora::kAdapterName + (parsed->second ? ".a" : ".b");
      LOOM_REQUIRE_USAGE(dest.count(loom_name), "adapter '", where, "': tensor '", name, "' adapts '", parsed->first,
                         "', which its target_modules do not select in this model (or the model has no such layer)");
      check_shape(name, loom_name, ckpt.entry(name).shape);
      const torch::Tensor value = ckpt.tensor(name);
      dest.at(loom_name).copy_(value);
      bytes += value.numel() * value.element_size();
      filled.insert(loom_name);
    }
    for (const auto& [loom_name, t] : dest) {
      LOOM_REQUIRE_USAGE(filled.count(loom_name), "adapter '", where, "' has no tensor for ", loom_name,
                         " (its target_modules select it in this model); the adapter was made for another base");
    }
    return bytes;
  }
  // A Loom adapter checkpoint: its model tensors are the adapters (and the persistent buffers,
  // e.g. an MoE layer's selection bias, which stays the base's under LoRA).
  const auto saved = checkpoint::CheckpointMetadata::read(adapter.source).tensors;
  checkpoint::ShardedStateDict state;
  for (const auto& [name, t] : saved) {
    if (t.component != checkpoint::kModelComponent) continue;
    if (dest.count(name)) {
      std::vector<int64_t> shape = t.shape;
      check_shape(name, name, shape);
      state.add_full(name, checkpoint::kModelComponent, dest.at(name));
      continue;
    }
    nn::BufferSlot* buffer = nullptr;
    for (const auto& b : model.named_buffers()) {
      if (b.name == name && b.slot->persistent) buffer = b.slot;
    }
    // A run on a seeded base saved that base with its adapters; attached to another base, the
    // saved copy is not read.
    bool base_parameter = false;
    for (const auto& p : model.named_parameters()) base_parameter = base_parameter || p.name == name;
    if (buffer == nullptr && base_parameter) continue;
    LOOM_REQUIRE_USAGE(buffer != nullptr, "adapter '", where, "' holds '", name,
                       "', which is neither an adapter its settings give this model nor one of its buffers");
    state.add_full(name, checkpoint::kModelComponent, buffer->tensor);
  }
  for (const auto& [name, t] : dest) {
    LOOM_REQUIRE_USAGE(state.contains(name), "adapter '", where, "' has no tensor ", name,
                       " (its settings select that linear in this model); it was made for another base");
  }
  checkpoint::LoadOptions quiet;
  quiet.log_loaded = false;
  if (adapter.folder.empty()) {
    bytes += checkpoint::load_checkpoint(adapter.source, state, /*rank=*/0, quiet).bytes_read;
    return bytes;
  }
  // A run's checkpoint folder: like a resume, a newest step whose chunks turn out corrupt is
  // skipped, with a warning, for the previous complete one (the same run: the same adapters).
  const auto loaded = checkpoint::load_latest(adapter.folder, state, *checkpoint::single_process_group(), quiet);
  LOOM_REQUIRE_USAGE(loaded.has_value(), "adapter '", adapter.folder.string(), "' holds no complete checkpoint");
  if (loaded->path != adapter.source) {
    log::warn("adapter '", adapter.folder.string(), "': read ", loaded->path.string(), " (", adapter.source.string(),
              " is unusable)");
  }
  bytes += loaded->bytes_read;
  return bytes;
}

void check_adapter_base(const AdapterDir& adapter, const fs::path& base) {
  if (!adapter.base.is_object() || !adapter.base.contains("checksum")) return;
  const nlohmann::json here = base_reference(base);
  if (here.at("checksum") != adapter.base.at("checksum")) {
    log::warn("adapter '", adapter.source.string(), "' was trained on a base with checksum ",
              adapter.base.at("checksum").get<std::string>(), " (", adapter.base_path, "), but '", base.string(),
              "' has ", here.at("checksum").get<std::string>());
  }
}

void with_each_adapter(const ModelSpec& spec, Decoder& model, const fs::path& base_dir,
                       const std::vector<std::string>& adapters, const AdapterUse& use) {
  for (size_t i = 0; i < adapters.size(); ++i) {
    const AdapterDir adapter = read_adapter_dir(adapters[i]);
    check_adapter_base(adapter, base_dir);
    const auto start = std::chrono::steady_clock::now();
    const int64_t bytes = attach_adapter(spec, model, adapter);
    use(i, adapter, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), bytes);
    lora::remove_lora(model);
  }
}

void export_peft_dir(const ModelSpec& spec, Decoder& model, const lora::LoRAOptions& options,
                     const std::string& base_name, const fs::path& dir, std::optional<c10::ScalarType> dtype) {
  LOOM_REQUIRE_USAGE(spec.hf.has_value(), "model '", spec.name, "' has no Hugging Face format for PEFT");
  LOOM_REQUIRE_USAGE(!fs::exists(dir), "'", dir.string(), "' already exists; choose a new output directory or remove it");
  const lora::HfModuleName hf_names = hf_module_names(*spec.hf);
  checkpoint::NamedTensors tensors;
  for (const auto& [path, module] : model.named_modules()) {
    lora::Adapter* a = lora::find_adapter(model, path);
    if (a == nullptr || dynamic_cast<lora::Adapter*>(module) != nullptr) continue;
    const auto hf = hf_names(path);
    LOOM_REQUIRE_USAGE(hf.has_value(), "the adapted linear '", path, "' has no Hugging Face module name, so PEFT "
                       "cannot hold its adapter");
    const c10::ScalarType out = dtype.value_or(a->a().scalar_type());
    tensors.emplace_back(kPeftPrefix + *hf + kLoraA, a->a().to(torch::kCPU, out).contiguous());
    tensors.emplace_back(kPeftPrefix + *hf + kLoraB, a->b().to(torch::kCPU, out).contiguous());
  }
  LOOM_REQUIRE_USAGE(!tensors.empty(), "the model carries no LoRA adapters to export");
  std::vector<std::string> targets = options.target_modules;
  std::sort(targets.begin(), targets.end());
  nlohmann::json config = {
      {"peft_type", "LORA"},
      {"task_type", "CAUSAL_LM"},
      {"r", options.rank},
      {"lora_alpha", options.alpha},
      {"lora_dropout", options.dropout},
      {"use_rslora", options.use_rslora},
      {"bias", "none"},
      {"fan_in_fan_out", false},
      {"init_lora_weights", true},
      {"inference_mode", true},
      {"modules_to_save", nullptr},
      {"base_model_name_or_path", base_name},
      {"revision", nullptr},
  };
  if (targets.size() == 1 && targets[0] == "all-linear") {
    config["target_modules"] = "all-linear";
  } else {
    config["target_modules"] = targets;
  }
  // Written into a scratch folder renamed into place: the directory appears whole or not at all.
  const fs::path scratch = dir.string() + ".saving";
  std::error_code ec;
  fs::remove_all(scratch, ec);
  fs::create_directories(scratch);
  checkpoint::save_safetensors(scratch / kPeftWeights, tensors, {{"format", "pt"}});
  checkpoint::write_text_file_atomically(scratch / kPeftConfig, config.dump(2) + "\n");
  fs::rename(scratch, dir, ec);
  LOOM_REQUIRE(!ec, "cannot move '", scratch.string(), "' to '", dir.string(), "': ", ec.message());
}

nlohmann::json base_reference(const fs::path& base) {
  const fs::path absolute = fs::absolute(base).lexically_normal();
  uint32_t crc = 0;
  if (detect_model_dir_format(base) == ModelDirFormat::kLoom) {
    crc = crc_of_file(resolve_loom_checkpoint(base) / checkpoint::kMetadataFile, 0);
  } else {
    std::vector<fs::path> files;
    for (const auto& entry : fs::directory_iterator(base)) {
      const std::string name = entry.path().filename().string();
      if (entry.is_regular_file() && (name == "config.json" || ends_with(name, ".safetensors"))) {
        files.push_back(entry.path());
      }
    }
    std::sort(files.begin(), files.end());
    for (const fs::path& f : files) crc = crc_of_file(f, crc);
  }
  char hex[16];
  std::snprintf(hex, sizeof(hex), "%08x", crc);
  return {{"path", absolute.string()}, {"checksum", std::string("crc32c:") + hex}};
}

}  // namespace loom::models
