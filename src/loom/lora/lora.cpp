#include "loom/lora/lora.h"

#include <cmath>
#include <set>
#include <sstream>

#include "loom/core/error.h"

namespace loom::lora {
namespace {

std::string trim(const std::string& s) {
  const auto begin = s.find_first_not_of(" \t");
  if (begin == std::string::npos) return "";
  return s.substr(begin, s.find_last_not_of(" \t") - begin + 1);
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string last_component(const std::string& path) {
  const auto dot = path.rfind('.');
  return dot == std::string::npos ? path : path.substr(dot + 1);
}

std::string human(int64_t n) {
  std::ostringstream os;
  os.precision(3);
  if (n >= 1'000'000'000) {
    os << std::fixed << n / 1e9 << "B";
  } else if (n >= 1'000'000) {
    os << std::fixed << n / 1e6 << "M";
  } else if (n >= 1'000) {
    os << std::fixed << n / 1e3 << "K";
  } else {
    os << n;
  }
  return os.str();
}

}  // namespace

const options::Section& lora_section() {
  using S = LoRAConfig;
  static const options::Section section{
      "lora",
      {
          {LOOM_OPTION(S, rank),
           "LoRA adapter rank r (see docs/lora.md); `0` = no adapters (full training). With r > 0 every "
           "targeted linear gets y = base(x) + s B A dropout(x) (A [r, in] kaiming-uniform, B [out, r] zero, "
           "so training starts from the base model exactly) and every other parameter is frozen: no "
           "gradient, no optimizer state, no gradient communication."},
          {LOOM_OPTION(S, alpha), "LoRA scaling numerator: s = alpha / r (alpha / sqrt(r) with use_rslora). > 0."},
          {LOOM_OPTION(S, dropout),
           "Dropout on the adapters' input during training, in [0, 1) (PEFT's lora_dropout). Not with "
           "activation checkpointing (its recompute would draw another mask)."},
          {LOOM_OPTION(S, target_modules),
           "Comma-separated Hugging Face module names to adapt, as PEFT's target_modules (`q_proj`, `k_proj`, "
           "`v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj`, ...; MLA: `q_a_proj`, `q_b_proj`, "
           "`kv_a_proj_with_mqa`, `kv_b_proj`), or `all-linear` (every linear but the output head). A name "
           "matching no linear is a one-line error listing the model's."},
          {LOOM_OPTION(S, use_rslora), "Rank-stabilised LoRA: s = alpha / sqrt(r) instead of alpha / r."},
      },
      "",
      "",
      [](const void* p) {
        const auto& c = *static_cast<const S*>(p);
        options::require(c.rank >= 0, lora_section(), "rank", ">= 0 (0 = off)", &c);
        options::require(c.alpha > 0, lora_section(), "alpha", "> 0", &c);
        options::require(c.dropout >= 0 && c.dropout < 1, lora_section(), "dropout", "in [0, 1)", &c);
        options::require(!trim(c.target_modules).empty(), lora_section(), "target_modules",
                         "a comma-separated list of module names or all-linear", &c);
      }};
  return section;
}

double LoRAOptions::scaling() const {
  return use_rslora ? alpha / std::sqrt(static_cast<double>(rank)) : alpha / static_cast<double>(rank);
}

LoRAOptions LoRAOptions::from(const LoRAConfig& config) {
  LoRAOptions o;
  o.rank = config.rank;
  o.alpha = config.alpha;
  o.dropout = config.dropout;
  o.use_rslora = config.use_rslora;
  o.target_modules.clear();
  std::stringstream in(config.target_modules);
  std::string item;
  while (std::getline(in, item, ',')) {
    item = trim(item);
    if (!item.empty()) o.target_modules.push_back(item);
  }
  return o;
}

Adapter::Adapter(int64_t in_features, int64_t out_features, int64_t rank, const torch::TensorOptions& options)
    : nn::Module("LoRAAdapter") {
  LOOM_REQUIRE_USAGE(rank > 0, "LoRA rank must be > 0, got ", rank);
  a_ = register_parameter("a", torch::empty({rank, in_features}, options));
  b_ = register_parameter("b", torch::empty({out_features, rank}, options));
}

torch::Tensor Adapter::forward(const torch::Tensor& x, double scaling) {
  return call_with_hooks(x, [this, scaling](const torch::Tensor& in) {
    return at::linear(at::linear(in, a_->tensor), b_->tensor) * scaling;
  });
}

std::string LoRAReport::describe() const {
  return c10::str(adapted.size(), " linears adapted: ", human(adapter_parameters), " adapter parameters, ",
                  human(frozen_parameters), " frozen");
}

namespace {

// The linears of `model` lora.target_modules names, by path. With `whole`, `model` is the whole
// model: a target name no linear has, or none matched at all, is a loom::UsageError listing its
// linears; a pipeline stage (not whole) may lack some or all of them.
std::vector<std::pair<std::string, nn::Linear*>> find_targets(nn::Module& model, const LoRAOptions& options,
                                                              const HfModuleName& hf_name, bool whole) {
  LOOM_REQUIRE_USAGE(options.rank > 0, "lora.rank must be > 0 to apply adapters, got ", options.rank);
  const bool all_linear =
      std::find(options.target_modules.begin(), options.target_modules.end(), "all-linear") != options.target_modules.end();
  std::set<std::string> wanted(options.target_modules.begin(), options.target_modules.end());
  std::set<std::string> matched_names, available;
  std::vector<std::pair<std::string, nn::Linear*>> targets;
  for (const auto& [path, module] : model.named_modules()) {
    auto* linear = dynamic_cast<nn::Linear*>(module);
    if (linear == nullptr || path == "output" || path.empty()) continue;
    const std::optional<std::string> hf = hf_name ? hf_name(path) : std::nullopt;
    const std::string name = last_component(hf.value_or(path));
    available.insert(name);
    if (all_linear || wanted.count(name)) {
      targets.emplace_back(path, linear);
      matched_names.insert(name);
    }
  }
  if (whole && !all_linear) {
    for (const std::string& w : wanted) {
      if (matched_names.count(w)) continue;
      std::string list;
      for (const std::string& a : available) list += (list.empty() ? "" : ", ") + a;
      fail_usage("lora.target_modules names '", w, "', which is no linear of this model; its linears: ", list,
                 " (or all-linear)");
    }
  }
  LOOM_REQUIRE_USAGE(!whole || !targets.empty(), "lora.target_modules matches no linear of this model");
  // B A has rank at most min(in, out): a larger r only adds parameters (a rank of 100,000 on a
  // 256-wide model would allocate a billion of them), so it is refused before any adapter exists.
  for (const auto& [path, linear] : targets) {
    const int64_t in = linear->weight().size(1), out = linear->weight().size(0);
    LOOM_REQUIRE_USAGE(options.rank <= std::min(in, out), "lora.rank = ", options.rank, " exceeds what linear '",
                       path, "' (", in, " -> ", out, ") can use: an adapter's rank is at most min(in, out) = ",
                       std::min(in, out), "; set lora.rank <= ", std::min(in, out),
                       " or leave that linear out of lora.target_modules");
  }
  return targets;
}

}  // namespace

void check_lora_targets(nn::Module& model, const LoRAOptions& options, const HfModuleName& hf_name) {
  find_targets(model, options, hf_name, /*whole=*/true);
}

LoRAReport apply_lora(nn::Module& model, const LoRAOptions& options, const HfModuleName& hf_name, bool whole_model) {
  const auto targets = find_targets(model, options, hf_name, whole_model);
  LoRAReport report;
  const double scaling = options.scaling();
  const double dropout = options.dropout;
  for (const auto& [path, linear] : targets) {
    const torch::Tensor& w = linear->weight();
    LOOM_REQUIRE(linear->find_submodule(kAdapterName) == nullptr, "linear '", path, "' already has a LoRA adapter");
    auto adapter = std::make_shared<Adapter>(w.size(1), w.size(0), options.rank, w.options());
    linear->register_module(kAdapterName, adapter);
    Adapter* raw = adapter.get();
    nn::ForwardOverride previous = linear->forward_override();
    raw->set_previous_override(previous);
    linear->set_forward_override([previous, raw, scaling, dropout](nn::Module& m, const torch::Tensor& x,
                                                                 const nn::ForwardFn& forward) {
      const torch::Tensor base = previous ? previous(m, x, forward) : forward(x);
      if (!raw->enabled()) return base;
      const bool training = torch::GradMode::is_enabled();
      const torch::Tensor in = dropout > 0 && training ? torch::dropout(x, dropout, true) : x;
      return base + raw->forward(in, scaling).to(base.scalar_type());
    });
    report.adapted.push_back(path);
  }
  // Freeze everything but the adapters.
  for (const auto& p : model.named_parameters()) {
    const bool adapter = p.name.find(std::string(".") + kAdapterName + ".") != std::string::npos;
    if (adapter) {
      report.adapter_parameters += p.tensor().numel();
    } else {
      p.slot->requires_grad = false;
      if (p.slot->tensor.is_leaf()) p.slot->tensor.requires_grad_(false);
      report.frozen_parameters += p.tensor().numel();
    }
  }
  return report;
}

Adapter* find_adapter(nn::Module& model, const std::string& linear_path) {
  nn::Module* linear = linear_path.empty() ? &model : model.find_submodule(linear_path);
  if (linear == nullptr) return nullptr;
  return dynamic_cast<Adapter*>(linear->find_submodule(kAdapterName));
}

int64_t remove_lora(nn::Module& model) {
  std::vector<std::pair<nn::Module*, Adapter*>> adapted;
  for (const auto& [path, module] : model.named_modules()) {
    if (auto* adapter = dynamic_cast<Adapter*>(module->find_submodule(kAdapterName))) adapted.emplace_back(module, adapter);
  }
  for (auto& [linear, adapter] : adapted) {
    linear->set_forward_override(adapter->previous_override());
    linear->remove_module(kAdapterName);  // the adapter is destroyed here
  }
  return static_cast<int64_t>(adapted.size());
}

void merge_lora(nn::Module& model, const LoRAOptions& options) {
  const double scaling = options.scaling();
  torch::NoGradGuard no_grad;
  for (const auto& [path, module] : model.named_modules()) {
    auto* linear = dynamic_cast<nn::Linear*>(module);
    Adapter* adapter = linear != nullptr ? dynamic_cast<Adapter*>(linear->find_submodule(kAdapterName)) : nullptr;
    if (adapter == nullptr) continue;
    torch::Tensor w = linear->weight();
    const torch::Tensor delta = at::matmul(adapter->b().to(torch::kFloat32), adapter->a().to(torch::kFloat32)) * scaling;
    w.copy_((w.to(torch::kFloat32) + delta.to(w.device())).to(w.scalar_type()));
  }
  remove_lora(model);
}

nlohmann::json to_json(const LoRAOptions& options) {
  return {{"rank", options.rank},
          {"alpha", options.alpha},
          {"dropout", options.dropout},
          {"target_modules", options.target_modules},
          {"use_rslora", options.use_rslora}};
}

LoRAOptions from_json(const nlohmann::json& entry, const std::string& source) {
  static const std::set<std::string> keys = {"rank", "alpha", "dropout", "target_modules", "use_rslora"};
  LOOM_REQUIRE(entry.is_object(), source, ": the \"", kCheckpointKey, "\" entry is not an object: ", entry.dump());
  for (const auto& [key, value] : entry.items()) {
    LOOM_REQUIRE(keys.count(key), source, ": unknown key '", key, "' in the \"", kCheckpointKey, "\" entry");
  }
  LoRAOptions o;
  try {
    o.rank = entry.at("rank").get<int64_t>();
    o.alpha = entry.at("alpha").get<double>();
    o.dropout = entry.value("dropout", 0.0);
    o.target_modules = entry.at("target_modules").get<std::vector<std::string>>();
    o.use_rslora = entry.value("use_rslora", false);
  } catch (const nlohmann::json::exception& e) {
    fail(source, ": malformed \"", kCheckpointKey, "\" entry ", entry.dump(), " (", e.what(), ")");
  }
  LOOM_REQUIRE(o.rank > 0 && o.alpha > 0 && !o.target_modules.empty(), source, ": the \"", kCheckpointKey,
               "\" entry needs rank > 0, alpha > 0 and target modules: ", entry.dump());
  return o;
}

std::string resume_mismatch(const LoRAOptions& saved, const LoRAOptions& now) {
  auto list = [](const std::vector<std::string>& v) {
    std::string out;
    for (const auto& s : std::set<std::string>(v.begin(), v.end())) out += (out.empty() ? "" : ",") + s;
    return out;
  };
  if (saved.rank != now.rank) return c10::str("lora.rank = ", saved.rank, ", not ", now.rank);
  if (list(saved.target_modules) != list(now.target_modules)) {
    return c10::str("lora.target_modules = \"", list(saved.target_modules), "\", not \"", list(now.target_modules),
                    "\" (the adapters of a target left out would be dropped from every later checkpoint)");
  }
  if (saved.scaling() != now.scaling()) {
    return c10::str("lora.alpha = ", saved.alpha, saved.use_rslora ? " with use_rslora" : "", " (scaling ",
                    saved.scaling(), "), not lora.alpha = ", now.alpha, now.use_rslora ? " with use_rslora" : "",
                    " (scaling ", now.scaling(), "; the trained adapters would be rescaled)");
  }
  return {};
}

std::optional<nn::ParameterInit> adapter_init(const std::string& name) {
  const std::string a = std::string(".") + kAdapterName + ".a", b = std::string(".") + kAdapterName + ".b";
  if (ends_with(name, a)) return nn::ParameterInit::kaiming_uniform();
  if (ends_with(name, b)) return nn::ParameterInit::zeros();
  return std::nullopt;
}

}  // namespace loom::lora
