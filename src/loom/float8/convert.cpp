#include "loom/float8/convert.h"

#include <sstream>

#include "loom/core/error.h"
#include "loom/nn/layers.h"
#include "loom/tensor/placement.h"

namespace loom::float8 {
namespace {

std::string trim(const std::string& s) {
  const auto begin = s.find_first_not_of(" \t");
  if (begin == std::string::npos) return "";
  const auto end = s.find_last_not_of(" \t");
  return s.substr(begin, end - begin + 1);
}

bool filtered(const std::string& fqn, const std::vector<std::string>& filters) {
  for (const auto& f : filters) {
    if (fqn.find(f) != std::string::npos) return true;
  }
  return false;
}

// Which groups split the weight `slot` holds, from its layout (TP's Shard(0) / Shard(1)).
Float8Sharding weight_sharding(const nn::ParameterSlot& slot,
                               const std::map<std::string, std::shared_ptr<distributed::Comm>>& groups) {
  Float8Sharding sharding;
  if (!slot.layout || groups.empty()) return sharding;
  for (const auto& p : slot.layout->placements) {
    const auto* shard = std::get_if<tensor::Shard>(&p.placement);
    const auto it = groups.find(p.mesh_dim);
    if (shard == nullptr || it == groups.end() || p.size <= 1) continue;
    (shard->dim == 0 ? sharding.out_features : sharding.in_features) = it->second;
  }
  return sharding;
}

}  // namespace

const options::Section& float8_section() {
  using S = Float8Config;
  static const options::Section section{
      "float8",
      {
          {LOOM_OPTION(S, enable),
           "Train the linear layers in Float8 (see docs/float8.md): every linear whose name matches none "
           "of `filter_fqns` runs its forward and backward GEMMs on float8 operands with dynamic "
           "scaling, its weights staying in high precision. On the CPU the float8 GEMMs are emulated "
           "exactly (quantize, dequantize, float32 matmul); on CUDA they are `_scaled_mm`. Needs the "
           "converted layers' dims to be multiples of 16. Composes with FSDP, tensor parallelism (the "
           "shards quantized with the whole weights' scales; not with async TP) and pipeline parallelism."},
          {LOOM_OPTION(S, recipe),
           "torchao's recipes. `rowwise`: inputs, weights and output gradients in float8_e4m3fn, one "
           "scale per row along each GEMM's contracted dim, scales rounded down to powers of 2. "
           "`tensorwise`: one scale per tensor, inputs and weights in e4m3fn, output gradients in e5m2."},
          {LOOM_OPTION(S, filter_fqns),
           "Comma-separated substrings: a linear whose fully qualified name (`layers.0.attention.wq`, "
           "`output`) contains one stays in high precision. The default keeps the output head, as "
           "TorchTitan does."},
      }};
  return section;
}

Float8Options Float8Options::from(const Float8Config& config) {
  Float8Options o;
  o.recipe = config.recipe;
  o.filter_fqns.clear();
  std::stringstream in(config.filter_fqns);
  std::string item;
  while (std::getline(in, item, ',')) {
    item = trim(item);
    if (!item.empty()) o.filter_fqns.push_back(item);
  }
  return o;
}

std::string ConversionReport::describe(Recipe recipe) const {
  std::ostringstream os;
  os << converted.size() << " linears to float8 (" << options::enum_name(recipe) << "), " << kept.size()
     << " kept in high precision";
  for (size_t i = 0; i < kept.size(); ++i) os << (i == 0 ? ": " : ", ") << kept[i];
  return os.str();
}

ConversionReport convert_to_float8(nn::Module& model, const Float8Options& options) {
  ConversionReport report;
  const Recipe recipe = options.recipe;
  for (const auto& [fqn, module] : model.named_modules()) {
    auto* linear = dynamic_cast<nn::Linear*>(module);
    if (linear == nullptr) continue;
    if (filtered(fqn, options.filter_fqns)) {
      report.kept.push_back(fqn);
      continue;
    }
    const int64_t in = linear->in_features(), out = linear->out_features();
    LOOM_REQUIRE_USAGE(in % 16 == 0 && out % 16 == 0, "float8: linear '", fqn, "' is ", in, " -> ", out,
                       " features, but float8 GEMMs need both to be multiples of 16; add it to "
                       "float8.filter_fqns (e.g. \"output,", fqn, "\") to keep it in high precision, or "
                       "change the model's dims");
    LOOM_REQUIRE(!linear->forward_override(), "float8: linear '", fqn,
                 "' already has an around-hook; convert_to_float8 must run before any parallelism");
    const auto groups = options.sharding_groups;
    linear->set_forward_override([recipe, groups](nn::Module& m, const torch::Tensor& x, const nn::ForwardFn&) {
      auto& l = static_cast<nn::Linear&>(m);
      torch::Tensor y = float8_linear(x, l.weight(), recipe, weight_sharding(l.parameter_slot("weight"), groups));
      // The bias is added in high precision, as torchao's Float8Linear does.
      // (Not when a rowwise-parallel linear adds it once after its reduction: Linear::adds_bias.)
      return l.adds_bias() ? y + l.parameter("bias") : y;
    });
    report.converted.push_back(fqn);
  }
  return report;
}

}  // namespace loom::float8
