#include "loom/float8/convert.h"

#include <sstream>

#include "loom/core/error.h"
#include "loom/nn/layers.h"

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

}  // namespace

Float8Options Float8Options::parse(const std::string& recipe, const std::string& filter_fqns) {
  Float8Options o;
  o.recipe = parse_recipe(recipe);
  o.filter_fqns.clear();
  std::stringstream in(filter_fqns);
  std::string item;
  while (std::getline(in, item, ',')) {
    item = trim(item);
    if (!item.empty()) o.filter_fqns.push_back(item);
  }
  return o;
}

std::string ConversionReport::describe(Recipe recipe) const {
  std::ostringstream os;
  os << converted.size() << " linears to float8 (" << recipe_name(recipe) << "), " << kept.size()
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
    const bool bias = linear->has_bias();
    linear->set_forward_override([recipe, bias](nn::Module& m, const torch::Tensor& x, const nn::ForwardFn&) {
      auto& l = static_cast<nn::Linear&>(m);
      torch::Tensor y = float8_linear(x, l.weight(), recipe);
      // The bias is added in high precision, as torchao's Float8Linear does.
      return bias ? y + l.parameter("bias") : y;
    });
    report.converted.push_back(fqn);
  }
  return report;
}

}  // namespace loom::float8
