// The registered models. Registration is this list rather than static initializers in each
// model's file: the models are a static library, and a linker drops an object file nothing
// refers to, registration included.
#include <algorithm>

#include "loom/core/error.h"
#include "loom/models/deepseek_v3/spec.h"
#include "loom/models/gpt_oss/spec.h"
#include "loom/models/llama3/spec.h"
#include "loom/models/qwen3/spec.h"
#include "loom/models/qwen3_moe/spec.h"
#include "loom/models/spec.h"

namespace loom::models {
namespace {

const std::vector<ModelSpec>& registered_specs() {
  static const std::vector<ModelSpec> specs = {llama3::model_spec(), qwen3::model_spec(), qwen3_moe::model_spec(),
                                                deepseek_v3::model_spec(), gpt_oss::model_spec()};
  return specs;
}

}  // namespace

const std::vector<std::string_view>& spec_names() {
  static const std::vector<std::string_view> names = [] {
    std::vector<std::string_view> n;
    for (const ModelSpec& spec : registered_specs()) n.emplace_back(spec.name);
    return n;
  }();
  return names;
}

const ModelSpec& get_spec(const std::string& name) {
  const auto& specs = registered_specs();
  const auto it = std::find_if(specs.begin(), specs.end(), [&](const ModelSpec& s) { return s.name == name; });
  if (it == specs.end()) {
    std::string available;
    for (const std::string_view n : spec_names()) available += (available.empty() ? "" : ", ") + std::string(n);
    fail_usage("unknown model.name '", name, "'; available: ", available);
  }
  return *it;
}

const ModelSpec& spec_for_hf_model_type(const std::string& model_type, const std::string& source) {
  std::string supported;
  for (const ModelSpec& spec : registered_specs()) {
    if (!spec.hf) continue;
    for (const std::string& type : spec.hf->model_types) {
      if (type == model_type) return spec;
      supported += (supported.empty() ? "\"" : ", \"") + type + "\"";
    }
  }
  fail(source, ": model_type '", model_type, "' is not supported; Loom reads ", supported);
}

}  // namespace loom::models
