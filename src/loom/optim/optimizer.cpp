#include "loom/optim/optimizer.h"

#include "loom/core/error.h"

namespace loom::optim {

bool is_weight_decayed(std::string_view name, c10::IntArrayRef full_shape) {
  const bool is_bias = name == "bias" || (name.size() >= 5 && name.substr(name.size() - 5) == ".bias");
  return full_shape.size() >= 2 && !is_bias;
}

std::vector<ParamGroup> weight_decay_param_groups(const NamedTensors& named_params,
                                                  double weight_decay) {
  ParamGroup decay{"decay", {}, {}, weight_decay};
  ParamGroup no_decay{"no_decay", {}, {}, 0.0};
  for (const auto& [name, param] : named_params) {
    LOOM_REQUIRE(param.defined(), "parameter '", name, "' is undefined; materialize the model ",
                 "before building its optimizer");
    ParamGroup& group = is_weight_decayed(name, param.sizes()) ? decay : no_decay;
    group.param_names.push_back(name);
    group.params.push_back(param);
  }
  std::vector<ParamGroup> groups;
  if (!decay.params.empty()) groups.push_back(std::move(decay));
  if (!no_decay.params.empty()) groups.push_back(std::move(no_decay));
  return groups;
}

ParamGroup single_param_group(const NamedTensors& named_params, double weight_decay,
                              std::string name) {
  ParamGroup group{std::move(name), {}, {}, weight_decay};
  for (const auto& [param_name, param] : named_params) {
    group.param_names.push_back(param_name);
    group.params.push_back(param);
  }
  return group;
}

}  // namespace loom::optim
