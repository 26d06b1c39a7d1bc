#include "loom/models/common/model_dir.h"

#include <nlohmann/json.hpp>

#include <fstream>
#include <map>
#include <set>

#include "loom/checkpoint/loader.h"
#include "loom/checkpoint/metadata.h"
#include "loom/checkpoint/safetensors.h"
#include "loom/checkpoint/saver.h"
#include "loom/core/error.h"
#include "loom/data/sources.h"
#include "loom/core/logging.h"
#include "loom/core/memory.h"
#include "loom/models/common/hf_names.h"

namespace loom::models {
namespace fs = std::filesystem;
namespace {
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
std::shared_ptr<Decoder> build_empty(const ModelSpec& spec, const ModelArgs& args, const LoadOptions& load) {
  auto model = std::dynamic_pointer_cast<Decoder>(spec.build_model(args, load.options.device(torch::kMeta)));
  LOOM_REQUIRE(model != nullptr, "model '", spec.name, "' is not a decoder this loader reads");
  const DecoderArgs& a = model->decoder_args();
  int64_t bytes = 0;
  for (const auto& p : model->named_parameters()) bytes += p.tensor().numel() * p.tensor().element_size();
  // The RoPE table: cos and sin for every position (the decoder's "freqs" buffer).
  bytes += 2 * a.max_seq_len * a.rope_dim() * static_cast<int64_t>(sizeof(float));
  memory::with_allocation_context(
      [&] {
        model->to_empty(load.options.device());
        model->reset_buffers();
      },
      c10::str("the model (", args.summary(), ", max_seq_len ", a.max_seq_len, ", ",
               c10::toString(load.options.dtype().toScalarType()), ")"),
      bytes, load.options.device(), load.memory_hint);
  return model;
}

// Copies checkpoint tensor `source_name` into the model's parameter `name`.
// The scale tensor of a block-quantised fp8 weight (DeepSeek-V3's published checkpoints).
constexpr const char* kScaleInvSuffix = "_scale_inv";
constexpr int64_t kFp8Block = 128;

bool is_fp8_scale(const checkpoint::SafetensorsCheckpoint& ckpt, const std::string& name) {
  const std::string suffix = kScaleInvSuffix;
  return name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0 &&
         ckpt.contains(name.substr(0, name.size() - suffix.size()));
}

// MXFP4 (OCP microscaling, GPT-OSS's published expert weights): `<name>_blocks` [..., R, G, 16]
// uint8 holds two 4-bit e2m1 values per byte (low nibble first) for G blocks of 32 values per row,
// `<name>_scales` [..., R, G] uint8 one power of two per block (e8m0: 2^(s - 127)). The tensor
// `<name>` they stand for is [..., G * 32, R]: transformers dequantises rows of R and transposes
// the last two dims (its GPT-OSS experts keep [experts, in, out]).
constexpr const char* kMxfp4Blocks = "_blocks";
constexpr const char* kMxfp4Scales = "_scales";

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() > suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
std::string strip(const std::string& s, const std::string& suffix) { return s.substr(0, s.size() - suffix.size()); }

// Whether `name` is an MXFP4 companion: the blocks or scales of a tensor stored as MXFP4.
bool is_mxfp4_part(const checkpoint::SafetensorsCheckpoint& ckpt, const std::string& name, bool blocks) {
  const std::string own = blocks ? kMxfp4Blocks : kMxfp4Scales;
  const std::string other = blocks ? kMxfp4Scales : kMxfp4Blocks;
  return ends_with(name, own) && ckpt.contains(strip(name, own) + other);
}

}  // namespace

torch::Tensor dequantize_mxfp4(const torch::Tensor& blocks, const torch::Tensor& scales) {
  LOOM_REQUIRE(blocks.scalar_type() == torch::kUInt8 && scales.scalar_type() == torch::kUInt8 && blocks.dim() >= 3 &&
                   blocks.size(-1) == 16 && scales.sizes() == blocks.sizes().slice(0, blocks.dim() - 1),
               "MXFP4 blocks ", blocks.sizes(), " (", blocks.scalar_type(), ") and scales ", scales.sizes(), " (",
               scales.scalar_type(), ") are not uint8 [..., R, G, 16] and [..., R, G]");
  static const float kE2m1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                  -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  const torch::Tensor lut = torch::from_blob(const_cast<float*>(kE2m1), {16}, torch::kFloat32);
  const torch::Tensor bytes = blocks.to(torch::kLong);
  // [..., R, G, 16, 2]: each byte's low nibble, then its high one.
  const torch::Tensor values = torch::stack({lut.index({bytes.bitwise_and(0x0F)}), lut.index({bytes.bitwise_right_shift(4)})}, -1);
  const torch::Tensor exponents = scales.to(torch::kInt32) - 127;
  // Exact: a 4-bit e2m1 value times a power of two is a float32 (and a bfloat16) as it is.
  torch::Tensor out = torch::ldexp(values.flatten(-2), exponents.unsqueeze(-1));  // [..., R, G, 32]
  out = out.flatten(-2);                                                            // [..., R, G * 32]
  return out.transpose(-1, -2).contiguous();
}

namespace {

// A checkpoint tensor as float: a float8 weight with a `<name>_scale_inv` companion (one float32
// scale per 128 x 128 block, DeepSeek's layout) is dequantised, w = q * scale of its block; a name
// stored as MXFP4 blocks and scales (GPT-OSS) is dequantised from them.
torch::Tensor read_hf_tensor(const checkpoint::SafetensorsCheckpoint& ckpt, const std::string& name) {
  if (!ckpt.contains(name) && ckpt.contains(name + kMxfp4Blocks) && ckpt.contains(name + kMxfp4Scales)) {
    try {
      return dequantize_mxfp4(ckpt.tensor(name + kMxfp4Blocks), ckpt.tensor(name + kMxfp4Scales));
    } catch (const Error& e) {
      fail("'", name, kMxfp4Blocks, "' and '", name, kMxfp4Scales, "' in '", ckpt.source().string(),
           "' are not MXFP4: ", e.what());
    }
  }
  torch::Tensor value = ckpt.tensor(name);
  const c10::ScalarType type = value.scalar_type();
  if (type != c10::kFloat8_e4m3fn && type != c10::kFloat8_e5m2) return value;
  const std::string scale_name = name + kScaleInvSuffix;
  LOOM_REQUIRE(ckpt.contains(scale_name), "tensor '", name, "' in '", ckpt.source().string(),
               "' is float8 without '", scale_name, "' (its block scales); only block-quantised fp8 checkpoints load");
  const torch::Tensor scale = ckpt.tensor(scale_name).to(torch::kFloat32);
  LOOM_REQUIRE(value.dim() == 2 && scale.dim() == 2 && scale.size(0) == (value.size(0) + kFp8Block - 1) / kFp8Block &&
                   scale.size(1) == (value.size(1) + kFp8Block - 1) / kFp8Block,
               "'", scale_name, "' in '", ckpt.source().string(), "' has shape ", scale.sizes(), ", not one scale per ",
               kFp8Block, "x", kFp8Block, " block of ", value.sizes());
  const torch::Tensor blocks = scale.repeat_interleave(kFp8Block, 0)
                                   .narrow(0, 0, value.size(0))
                                   .repeat_interleave(kFp8Block, 1)
                                   .narrow(1, 0, value.size(1));
  return value.to(torch::kFloat32) * blocks;
}

void fill(Decoder& model, const std::string& name, const checkpoint::SafetensorsCheckpoint& ckpt,
          const std::string& source_name) {
  torch::Tensor value = read_hf_tensor(ckpt, source_name);
  // A persistent buffer (an MoE layer's selection bias, HF's e_score_correction_bias) loads too.
  for (const auto& b : model.named_buffers()) {
    if (b.name != name || !b.slot->persistent) continue;
    LOOM_REQUIRE(value.sizes() == b.slot->tensor.sizes(), "tensor '", source_name, "' in '", ckpt.source().string(),
                 "' has shape ", value.sizes(), " but buffer '", name, "' of the model config.json describes has ",
                 b.slot->tensor.sizes(), "; config.json does not match the weights: correct the size it gives");
    b.slot->tensor.copy_(value);
    return;
  }
  nn::ParameterSlot& slot = model.parameter_slot(name);
  LOOM_REQUIRE(value.sizes() == slot.tensor.sizes(), "tensor '", source_name, "' in '",
               ckpt.source().string(), "' has shape ", value.sizes(), " but parameter '", name,
               "' of the model config.json describes has ", slot.tensor.sizes(),
               "; config.json does not match the weights: correct the size it gives");
  torch::NoGradGuard no_grad;
  slot.tensor.copy_(value);
}

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

void set_max_seq_len(ModelArgs& args, std::optional<int64_t> max_seq_len) {
  if (!max_seq_len) return;
  auto* decoder = dynamic_cast<DecoderArgs*>(&args);
  LOOM_REQUIRE(decoder != nullptr, "this model has no RoPE table to resize");
  decoder->max_seq_len = *max_seq_len;
}

ModelDirArgs read_hf_config_file(const fs::path& config_path) {
  const nlohmann::json config = read_json(config_path);
  LOOM_REQUIRE(config.is_object(), config_path.string(), " is not a JSON object");
  // transformers itself needs model_type to pick a config class; reading a config without one as
  // Llama would misread any other family's.
  LOOM_REQUIRE_USAGE(config.contains("model_type") && config.at("model_type").is_string(), config_path.string(),
                     " has no \"model_type\"; add the family's (\"llama\", \"qwen3\", \"qwen3_moe\" or "
                     "\"deepseek_v3\"), as transformers' config.json files carry it");
  const std::string model_type = config.at("model_type").get<std::string>();
  ModelDirArgs out;
  out.spec = &spec_for_hf_model_type(model_type, config_path.string());
  HfFormat::Config c = out.spec->hf->read_config(config, config_path.string());
  out.args = std::move(c.args);
  out.hf_tied = c.tie_word_embeddings;
  return out;
}
ModelDirArgs read_hf_args(const fs::path& dir) { return read_hf_config_file(dir / "config.json"); }
// Loaded weights must be finite: a NaN or inf in a file (a save of a diverged run, a corrupt
// conversion) would otherwise surface as NaN scores with exit 0, or as a "divergence" that blames
// the learning rate. Names the first tensor (module order) and how many of its values are bad.
void require_finite_weights(nn::Module& model, const std::string& source) {
  torch::NoGradGuard no_grad;
  auto check = [&](const std::string& name, const torch::Tensor& t) {
    if (!t.defined() || !t.is_floating_point() || t.numel() == 0) return;
    const torch::Tensor bad = t.isfinite().logical_not();
    if (!bad.any().item<bool>()) return;
    const int64_t count = bad.sum().item<int64_t>();
    const int64_t first = bad.reshape(-1).nonzero().min().item<int64_t>();
    fail_usage("'", source, "' holds non-finite weights: tensor '", name, "' has ", count, " NaN/inf value",
               count == 1 ? "" : "s", " of ", t.numel(), " (the first at flat index ", first,
               ", value ", t.reshape(-1)[first].item<double>(),
               "); the file is corrupt or was saved from a diverged run: use an earlier checkpoint or a fresh copy");
  };
  for (const auto& p : model.named_parameters()) check(p.name, p.tensor().detach());
  for (const auto& b : model.named_buffers()) {
    if (b.slot->persistent) check(b.name, b.slot->tensor);
  }
}
}  // namespace

const DecoderArgs& ModelDirArgs::decoder() const {
  const auto* decoder = dynamic_cast<const DecoderArgs*>(args.get());
  LOOM_REQUIRE(decoder != nullptr, "model '", spec ? spec->name : "?", "' is not a decoder");
  return *decoder;
}

// What a model directory or checkpoint given as input can be wrong in (a missing path, a config
// that lies about sizes, a missing or truncated shard, misshaped fp8 scales, an unsupported rope or
// model type) is the input's fault: a restart reads the same files and fails the same way. So every
// error of the readers below leaves as a usage error (exit 2, never retried by `loom launch
// --max-restarts`), with its message unchanged; running out of memory stays what it is.
template <typename Fn>
static auto as_input_error(Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const UsageError&) {
    throw;
  } catch (const MemoryError&) {
    throw;
  } catch (const c10::OutOfMemoryError&) {
    throw;
  } catch (const Error& e) {
    if (e.exit_code() != kExitFailure) throw;
    throw UsageError(e.what());
  } catch (const c10::Error& e) {
    throw UsageError(e.what_without_backtrace());
  }
}

static ModelDirFormat detect_model_dir_format_unchecked(const fs::path& dir) {
  LOOM_REQUIRE(fs::is_directory(dir), "'", dir.string(), "' is not a directory; expected a Loom "
               "checkpoint or a Hugging Face model directory");
  if (is_checkpoint_dir(dir) || holds_checkpoints(dir)) return ModelDirFormat::kLoom;
  const fs::path config = dir / "config.json";
  LOOM_REQUIRE(fs::exists(config), "'", dir.string(), "' has neither metadata.json nor "
               "config.json; expected a Loom checkpoint or a Hugging Face model directory");
  const nlohmann::json j = read_json(config);
  if (j.is_object() && (j.contains("model_type") || j.contains("architectures"))) {
    return ModelDirFormat::kHuggingFace;
  }
  fail("'", config.string(), "' is not a Hugging Face model config (no \"model_type\"); expected "
       "a Loom checkpoint or a Hugging Face model directory");
}

static fs::path resolve_loom_checkpoint_unchecked(const fs::path& path) {
  if (is_checkpoint_dir(path)) return path;
  LOOM_REQUIRE(holds_checkpoints(path), "'", path.string(), "' is not a Loom checkpoint (no "
               "metadata.json) nor a folder of step-N checkpoints");
  const auto latest = checkpoint::find_latest_complete(path, checkpoint::Verification::kStructure);
  LOOM_REQUIRE(latest.has_value(), "'", path.string(), "' holds no complete checkpoint (no step-N "
               "with a COMPLETE marker)");
  return latest->path;
}

static ModelDirArgs read_checkpoint_model_args_unchecked(const fs::path& path) {
  const fs::path dir = resolve_loom_checkpoint(path);
  const checkpoint::CheckpointMetadata metadata = checkpoint::CheckpointMetadata::read(dir);
  const std::string where = (dir / checkpoint::kMetadataFile).string();
  LOOM_REQUIRE(metadata.json.contains(kModelConfigKey), "checkpoint '", dir.string(),
               "' records no model config (\"", kModelConfigKey, "\" in ", where,
               "); it was saved by an older Loom, so pass the model flavor explicitly");
  const nlohmann::json& model = metadata.json.at(kModelConfigKey);
  LOOM_REQUIRE(model.is_object() && model.contains("name") && model.at("name").is_string(), "'", where,
               "' has a model entry without a name: ", model.dump());
  ModelDirArgs out;
  out.spec = &get_spec(model.at("name").get<std::string>());
  out.args = out.spec->model_args_from_config_json(model, where);
  return out;
}

static ModelDirArgs read_model_dir_args_unchecked(const fs::path& dir) {
  // A PEFT directory has no model config of its own: its base's.
  if (is_adapter_dir(dir) && !fs::exists(dir / checkpoint::kMetadataFile) && !holds_checkpoints(dir)) {
    const AdapterDir adapter = read_adapter_dir(dir);
    LOOM_REQUIRE_USAGE(!adapter.base_path.empty() && fs::is_directory(adapter.base_path), "adapter '", dir.string(),
                       "' records no base model directory (base_model_name_or_path = '", adapter.base_path,
                       "'); pass the base as --checkpoint and the adapter as --adapter");
    return read_model_dir_args(adapter.base_path);
  }
  if (detect_model_dir_format(dir) == ModelDirFormat::kLoom) return read_checkpoint_model_args(dir);
  return read_hf_args(dir);
}

static LoadedModel load_model_dir_unchecked(const fs::path& dir, const LoadOptions& options) {
  // An adapter on a base elsewhere. (A LoRA run on a seeded base saved that base with its
  // adapters: load_loom_checkpoint reads both.)
  std::optional<AdapterDir> adapter_dir;
  if (is_adapter_dir(dir)) adapter_dir = read_adapter_dir(dir);
  if (adapter_dir && (adapter_dir->format == AdapterFormat::kPeft || !adapter_dir->base_path.empty() || options.base)) {
    AdapterDir adapter = std::move(*adapter_dir);
    fs::path base = options.base.value_or(fs::path(adapter.base_path));
    LOOM_REQUIRE_USAGE(fs::is_directory(base), "adapter '", dir.string(), "' needs its base model '", base.string(),
                       "', which is not a directory; pass the base model directory with --base");
    LOOM_REQUIRE_USAGE(!is_adapter_dir(base), "the base of adapter '", dir.string(), "' is '", base.string(),
                       "', itself an adapter; pass the base model directory with --base");
    LoadedModel loaded = load_model_dir(base, options);
    if (adapter.format == AdapterFormat::kLoom) {
      const ModelDirArgs recorded = read_checkpoint_model_args(adapter.source);
      LOOM_REQUIRE_USAGE(recorded.spec->name == loaded.spec->name, "adapter '", dir.string(), "' adapts a ",
                         recorded.spec->name, " model but its base '", base.string(), "' is a ", loaded.spec->name);
    }
    check_adapter_base(adapter, base);
    attach_adapter(*loaded.spec, *loaded.model, adapter);
    require_finite_weights(*loaded.model, dir.string());
    loaded.adapter = std::move(adapter);
    return loaded;
  }
  return detect_model_dir_format(dir) == ModelDirFormat::kLoom ? load_loom_checkpoint(dir, options)
                                                               : load_hf_model_dir(dir, options);
}

static LoadedModel load_hf_model_dir_unchecked(const fs::path& dir, const LoadOptions& options) {
  ModelDirArgs config = read_hf_args(dir);
  set_max_seq_len(*config.args, options.max_seq_len);
  const HfFormat& hf = *config.spec->hf;
  const auto ckpt = checkpoint::SafetensorsCheckpoint::open(dir);
  auto model = build_empty(*config.spec, *config.args, options);

  std::set<std::string> filled;
  // Loom tensors gathered from pieces: the rows (or row slices) filled so far, by name.
  std::map<std::string, int64_t> piece_elements;
  for (const std::string& stored_name : ckpt.names()) {
    if (is_ignorable_hf_tensor(stored_name) || is_fp8_scale(ckpt, stored_name) ||
        is_mxfp4_part(ckpt, stored_name, /*blocks=*/false)) {
      continue;
    }
    // An MXFP4 pair stands for the tensor named without "_blocks", of the dequantised shape.
    const bool mxfp4 = is_mxfp4_part(ckpt, stored_name, /*blocks=*/true);
    const std::string hf_name = mxfp4 ? strip(stored_name, kMxfp4Blocks) : stored_name;
    if (hf.to_loom_tensors) {
      if (auto converted = hf.to_loom_tensors(hf_name, read_hf_tensor(ckpt, hf_name))) {
        for (auto& [loom_name, value] : *converted) {
          LOOM_REQUIRE(model->find_submodule(loom_name.substr(0, loom_name.rfind('.'))) != nullptr, "tensor '",
                       hf_name, "' in '", ckpt.source().string(), "' does not fit config.json");
          nn::ParameterSlot& slot = model->parameter_slot(loom_name);
          LOOM_REQUIRE(value.sizes() == slot.tensor.sizes(), "tensor '", hf_name, "' in '", ckpt.source().string(),
                       "' gives shape ", value.sizes(), " for ", loom_name, ", which has ", slot.tensor.sizes(),
                       "; config.json does not match the weights: correct the size it gives");
          torch::NoGradGuard no_grad;
          slot.tensor.copy_(value);
          filled.insert(loom_name);
        }
        continue;
      }
    }
    if (hf.to_loom_pieces) {
      std::vector<int64_t> shape = ckpt.entry(stored_name).shape;
      if (mxfp4 && shape.size() >= 3) {
        const int64_t rows = shape[shape.size() - 3], columns = shape[shape.size() - 2] * 32;
        shape.resize(shape.size() - 3);
        shape.push_back(columns);
        shape.push_back(rows);
      }
      const std::vector<HfFormat::Piece> pieces = hf.to_loom_pieces(hf_name, shape);
      if (!pieces.empty()) {
        const torch::Tensor value = read_hf_tensor(ckpt, hf_name);
        for (const HfFormat::Piece& piece : pieces) {
          LOOM_REQUIRE(model->find_submodule(piece.loom_name.substr(0, piece.loom_name.rfind('.'))) != nullptr,
                       "tensor '", hf_name, "' in '", ckpt.source().string(), "' does not fit config.json");
          nn::ParameterSlot& slot = model->parameter_slot(piece.loom_name);
          torch::Tensor source = piece.hf_dim >= 0 ? value.narrow(piece.hf_dim, piece.hf_begin, piece.hf_length) : value;
          torch::Tensor target = slot.tensor;
          if (piece.row) {
            LOOM_REQUIRE(*piece.row >= 0 && *piece.row < target.size(0), "tensor '", hf_name, "' in '",
                         ckpt.source().string(), "' is row ", *piece.row, " of '", piece.loom_name, "', which has ",
                         target.size(0));
            target = target[*piece.row];
          }
          LOOM_REQUIRE(source.sizes() == target.sizes(), "tensor '", hf_name, "' in '", ckpt.source().string(),
                       "' gives shape ", source.sizes(), " for ", piece.loom_name,
                       piece.row ? c10::str("[", *piece.row, "]") : std::string(), ", which has ", target.sizes());
          torch::NoGradGuard no_grad;
          target.copy_(source);
          piece_elements[piece.loom_name] += target.numel();
        }
        continue;
      }
    }
    const auto loom_name = hf.to_loom_name(hf_name);
    LOOM_REQUIRE(loom_name.has_value(), "unexpected tensor '", hf_name, "' in '",
                 ckpt.source().string(), "'; not a weight of this ", config.spec->name, " model");
    // A tied model has no output head: a checkpoint that still stores lm_head must hold the
    // embedding's values (transformers writes both names for a tied model in some versions).
    if (*loom_name == "output.weight" && !model->has_output()) {
      LOOM_REQUIRE(config.decoder().tie_embeddings, "'", ckpt.source().string(), "' holds '", hf_name,
                   "' but the model has no output head");
      continue;
    }
    LOOM_REQUIRE(model->find_submodule(loom_name->substr(0, loom_name->rfind('.'))) != nullptr,
                 "tensor '", hf_name, "' in '", ckpt.source().string(),
                 "' does not fit config.json (num_hidden_layers = ", config.decoder().n_layers, ")");
    fill(*model, *loom_name, ckpt, hf_name);
    filled.insert(*loom_name);
  }
  // Tied checkpoints (Llama 3.2 1B/3B) store no lm_head: an untied head starts as a copy.
  if (model->has_output() && !filled.count("output.weight") && filled.count("tok_embeddings.weight")) {
    LOOM_REQUIRE(config.hf_tied, "'", ckpt.source().string(),
                 "' has no lm_head.weight and config.json does not set tie_word_embeddings");
    fill(*model, "output.weight", ckpt, *hf.to_hf_name("tok_embeddings.weight"));
    filled.insert("output.weight");
  }
  for (const auto& [name, elements] : piece_elements) {
    // Every row exactly once (a duplicate would overfill, a missing expert underfill).
    const int64_t want = model->parameter_slot(name).tensor.numel();
    LOOM_REQUIRE(elements == want, "'", ckpt.source().string(), "' fills ", elements, " of the ", want,
                 " values of '", name, "' (an expert missing or given twice)");
    filled.insert(name);
  }
  for (const auto& p : model->named_parameters()) {
    LOOM_REQUIRE(filled.count(p.name), "'", ckpt.source().string(), "' is missing '",
                 hf.to_hf_name(p.name).value_or(p.name), "'");
  }
  require_finite_weights(*model, dir.string());
  return {config.spec, model, ModelDirFormat::kHuggingFace, dir};
}

static LoadedModel load_loom_checkpoint_unchecked(const fs::path& path, const LoadOptions& options) {
  const fs::path dir = resolve_loom_checkpoint(path);
  ModelDirArgs recorded = read_checkpoint_model_args(dir);
  set_max_seq_len(*recorded.args, options.max_seq_len);
  auto model = build_empty(*recorded.spec, *recorded.args, options);
  LoadedModel loaded{recorded.spec, model, ModelDirFormat::kLoom, dir};
  // A LoRA run's checkpoint that holds its (seeded) base too: the adapters are part of the model.
  if (is_adapter_dir(dir)) {
    AdapterDir adapter = read_adapter_dir(dir);
    LOOM_REQUIRE_USAGE(recorded.spec->hf.has_value(), "model '", recorded.spec->name, "' has no module names for LoRA");
    lora::apply_lora(*model, adapter.options, hf_module_names(*recorded.spec->hf));
    loaded.adapter = std::move(adapter);
  }
  checkpoint::ShardedStateDict dest;
  for (const auto& p : model->named_parameters()) dest.add_full(p.name, checkpoint::kModelComponent, p.tensor().detach());
  for (const auto& b : model->named_buffers()) {
    if (b.slot->persistent) dest.add_full(b.name, checkpoint::kModelComponent, b.slot->tensor);
  }
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
    loaded.source = result->path;
  }
  require_finite_weights(*model, loaded.source.string());
  return loaded;
}

void save_loom_checkpoint(const ModelSpec& spec, Decoder& model, const fs::path& dir,
                          std::optional<c10::ScalarType> dtype) {
  LOOM_REQUIRE_USAGE(!fs::exists(dir), "'", dir.string(), "' already exists; choose a new output "
                     "directory or remove it");
  checkpoint::ShardedStateDict state;
  for (const auto& p : model.named_parameters()) {
    state.add_full(p.name, checkpoint::kModelComponent, p.tensor().detach());
  }
  for (const auto& b : model.named_buffers()) {
    if (b.slot->persistent) state.add_full(b.name, checkpoint::kModelComponent, b.slot->tensor);
  }
  state.json()[kModelConfigKey] = spec.model_config_json(model.decoder_args());
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

void export_hf_model_dir(const ModelSpec& spec, Decoder& model, const fs::path& dir,
                         std::optional<c10::ScalarType> dtype, int64_t max_shard_bytes) {
  LOOM_REQUIRE_USAGE(spec.hf.has_value(), "model '", spec.name, "' has no Hugging Face format to export");
  const c10::ScalarType out_dtype = dtype.value_or(model.tok_embeddings().weight().scalar_type());
  const std::string dtype_name = hf_dtype_name(out_dtype);
  checkpoint::NamedTensors tensors;
  const auto state = model.state_dict();
  const HfFormat::LoomTensorLookup lookup = [&state](const std::string& loom_name) {
    for (const auto& [name, tensor] : state) {
      if (name == loom_name) return tensor;
    }
    fail("export: no Loom tensor '", loom_name, "' in the model");
  };
  for (auto& [name, tensor] : state) {
    if (spec.hf->to_hf_tensors) {
      if (auto pieces = spec.hf->to_hf_tensors(name, tensor, lookup)) {
        for (auto& [hf_name, value] : *pieces) tensors.emplace_back(hf_name, value.to(out_dtype).contiguous());
        continue;
      }
    }
    const auto hf_name = spec.hf->to_hf_name(name);
    TORCH_CHECK(hf_name.has_value(), "no Hugging Face name for Loom parameter '", name, "'");
    tensors.emplace_back(*hf_name, tensor.to(out_dtype));
  }
  checkpoint::save_safetensors_sharded(dir, tensors, max_shard_bytes, "model", {{"format", "pt"}});
  checkpoint::write_text_file_atomically(
      dir / "config.json", spec.hf->write_config(model.decoder_args(), dtype_name).dump(2) + "\n");
}

static InitialWeights read_initial_weights_unchecked(const ModelSpec& spec, const fs::path& path) {
  InitialWeights weights;
  if (detect_model_dir_format(path) == ModelDirFormat::kLoom) {
    weights.loom_checkpoint = resolve_loom_checkpoint(path);
    return weights;
  }
  const LoadedModel loaded = load_hf_model_dir(path);
  LOOM_REQUIRE_USAGE(loaded.spec->name == spec.name, "checkpoint.initial_load_path '", path.string(),
                     "' holds a ", loaded.spec->name, " model but model.name is ", spec.name);
  for (const auto& p : loaded.model->named_parameters()) weights.full_parameters[p.name] = p.tensor().detach();
  // Persistent buffers (the selection bias) travel with them; load_full_parameters sets them.
  for (const auto& b : loaded.model->named_buffers()) {
    if (b.slot->persistent) weights.full_parameters[b.name] = b.slot->tensor;
  }
  return weights;
}

ModelDirFormat detect_model_dir_format(const fs::path& dir) {
  return as_input_error([&] { return detect_model_dir_format_unchecked(dir); });
}

fs::path resolve_loom_checkpoint(const fs::path& path) {
  return as_input_error([&] { return resolve_loom_checkpoint_unchecked(path); });
}

ModelDirArgs read_checkpoint_model_args(const fs::path& path) {
  return as_input_error([&] { return read_checkpoint_model_args_unchecked(path); });
}

ModelDirArgs read_model_dir_args(const fs::path& dir) {
  return as_input_error([&] { return read_model_dir_args_unchecked(dir); });
}

LoadedModel load_model_dir(const fs::path& dir, const LoadOptions& options) {
  return as_input_error([&] { return load_model_dir_unchecked(dir, options); });
}

LoadedModel load_hf_model_dir(const fs::path& dir, const LoadOptions& options) {
  return as_input_error([&] { return load_hf_model_dir_unchecked(dir, options); });
}

LoadedModel load_loom_checkpoint(const fs::path& path, const LoadOptions& options) {
  return as_input_error([&] { return load_loom_checkpoint_unchecked(path, options); });
}

InitialWeights read_initial_weights(const ModelSpec& spec, const fs::path& path) {
  return as_input_error([&] { return read_initial_weights_unchecked(spec, path); });
}

ModelDirArgs read_hf_config(const fs::path& config_json) {
  return as_input_error([&] { return read_hf_config_file(config_json); });
}

fs::path resolve_hf_config(const std::string& hf_config, const std::string& initial_load_path) {
  return as_input_error([&] {
    if (!hf_config.empty()) {
      const fs::path path(hf_config);
      const fs::path file = fs::is_directory(path) ? path / "config.json" : path;
      LOOM_REQUIRE_USAGE(fs::is_regular_file(file), "model.hf_config '", hf_config, "' ",
                         fs::is_directory(path) ? "is a directory without a config.json"
                         : fs::exists(path)     ? "is not a regular file"
                                                : "does not exist",
                         "; give a Hugging Face config.json or the model directory holding it");
      return file;
    }
    LOOM_REQUIRE_USAGE(!initial_load_path.empty(), "model.flavor = \"", kHfFlavor,
                       "\" takes the model's shape from a Hugging Face config.json, and there is none: set "
                       "checkpoint.initial_load_path to a Hugging Face model directory, or model.hf_config to its "
                       "config.json");
    const fs::path dir(initial_load_path);
    LOOM_REQUIRE_USAGE(detect_model_dir_format(dir) == ModelDirFormat::kHuggingFace, "model.flavor = \"",
                       kHfFlavor, "\" takes the model's shape from a Hugging Face config.json, but "
                       "checkpoint.initial_load_path '", initial_load_path,
                       "' is a Loom checkpoint; set model.hf_config to the config.json of the shape to train, or "
                       "model.flavor to the one the checkpoint was trained with");
    return dir / "config.json";
  });
}

}  // namespace loom::models
