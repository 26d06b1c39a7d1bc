#include "loom/models/common/hf_names.h"

#include <regex>

#include "loom/core/error.h"

#include <array>
#include <utility>

#include "loom/models/common/decoder.h"

namespace loom::models {
namespace {
// Per-layer names: HF suffix after "model.layers.N.", Loom suffix after "layers.N.". The last two
// exist only with QK-norm.
constexpr std::array<std::pair<const char*, const char*>, 11> kLayerNames = {{
    {"input_layernorm.weight", "attention_norm.weight"},
    {"self_attn.q_proj.weight", "attention.wq.weight"},
    {"self_attn.k_proj.weight", "attention.wk.weight"},
    {"self_attn.v_proj.weight", "attention.wv.weight"},
    {"self_attn.o_proj.weight", "attention.wo.weight"},
    {"post_attention_layernorm.weight", "ffn_norm.weight"},
    {"mlp.gate_proj.weight", "feed_forward.w1.weight"},
    {"mlp.down_proj.weight", "feed_forward.w2.weight"},
    {"mlp.up_proj.weight", "feed_forward.w3.weight"},
    {"self_attn.q_norm.weight", "attention.q_norm.weight"},
    {"self_attn.k_norm.weight", "attention.k_norm.weight"},
}};
constexpr size_t kQkNormNames = 2;
constexpr std::array<std::pair<const char*, const char*>, 3> kGlobalNames = {{
    {"model.embed_tokens.weight", "tok_embeddings.weight"},
    {"model.norm.weight", "norm.weight"},
    {"lm_head.weight", "output.weight"},
}};

size_t layer_names(bool qk_norm) { return kLayerNames.size() - (qk_norm ? 0 : kQkNormNames); }

}  // namespace

std::optional<std::string> hf_to_loom_decoder_name(const std::string& hf_name, bool qk_norm) {
  for (const auto& [hf, loom] : kGlobalNames) {
    if (hf_name == hf) return std::string(loom);
  }
  const std::string prefix = "model.";
  if (hf_name.rfind(prefix, 0) != 0) return std::nullopt;
  const auto layer = split_layer_name(hf_name.substr(prefix.size()));
  if (!layer) return std::nullopt;
  for (size_t i = 0; i < layer_names(qk_norm); ++i) {
    if (layer->second == kLayerNames[i].first) return c10::str("layers.", layer->first, ".", kLayerNames[i].second);
  }
  return std::nullopt;
}

std::optional<std::string> loom_to_hf_decoder_name(const std::string& loom_name, bool qk_norm) {
  for (const auto& [hf, loom] : kGlobalNames) {
    if (loom_name == loom) return std::string(hf);
  }
  const auto layer = split_layer_name(loom_name);
  if (!layer) return std::nullopt;
  for (size_t i = 0; i < layer_names(qk_norm); ++i) {
    if (layer->second == kLayerNames[i].second) {
      return c10::str("model.layers.", layer->first, ".", kLayerNames[i].first);
    }
  }
  return std::nullopt;
}

namespace {

const std::regex kHfExpert(R"(model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight)");
const std::regex kHfFusedExperts(R"(model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj))");
const std::regex kLoomExperts(R"(layers\.(\d+)\.moe\.experts\.(w1|w2|w3))");

const char* loom_expert_weight(const std::string& proj) { return proj == "gate" ? "w1" : proj == "up" ? "w3" : "w2"; }
const char* hf_expert_proj(const std::string& w) { return w == "w1" ? "gate" : w == "w3" ? "up" : "down"; }

}  // namespace

std::vector<HfFormat::Piece> hf_expert_pieces(const std::string& name, c10::IntArrayRef shape) {
  std::smatch m;
  if (std::regex_match(name, m, kHfExpert)) {
    return {{c10::str("layers.", m[1], ".moe.experts.", loom_expert_weight(m[3])), std::stoll(m[2].str())}};
  }
  if (std::regex_match(name, m, kHfFusedExperts)) {
    const std::string prefix = c10::str("layers.", m[1], ".moe.experts.");
    if (m[2] == "down_proj") return {{prefix + "w2"}};
    // gate_up_proj [E, 2F, D]: gate rows first, then up (transformers' chunk(2) order).
    LOOM_REQUIRE(shape.size() == 3 && shape[1] % 2 == 0, "'", name, "' must be [E, 2 x F, D], got ", shape);
    const int64_t f = shape[1] / 2;
    return {{prefix + "w1", std::nullopt, 1, 0, f}, {prefix + "w3", std::nullopt, 1, f, f}};
  }
  return {};
}

std::optional<std::vector<std::pair<std::string, torch::Tensor>>> experts_to_hf_tensors(const std::string& name,
                                                                                       const torch::Tensor& value) {
  std::smatch m;
  if (!std::regex_match(name, m, kLoomExperts)) return std::nullopt;
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (int64_t e = 0; e < value.size(0); ++e) {
    out.emplace_back(c10::str("model.layers.", m[1], ".mlp.experts.", e, ".", hf_expert_proj(m[2]), "_proj.weight"),
                     value[e]);
  }
  return out;
}

bool is_ignorable_hf_tensor(const std::string& hf_name) {
  const std::string suffix = "rotary_emb.inv_freq";
  return hf_name.size() >= suffix.size() &&
         hf_name.compare(hf_name.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace loom::models
