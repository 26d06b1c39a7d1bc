#include "loom/models/llama3/spec.h"

#include "loom/core/error.h"
#include "loom/models/common/decoder_spec.h"
#include "loom/models/llama3/hf_adapter.h"
#include "loom/models/llama3/model.h"

namespace loom::llama3 {

const models::TPPlan& tp_plan() { return models::transformer_tp_plan(); }

const ModelArgs& args_of(const models::ModelArgs& args) {
  const auto* llama = dynamic_cast<const ModelArgs*>(&args);
  LOOM_REQUIRE(llama != nullptr, "llama3's spec was given another model's args");
  return *llama;
}

models::ModelSpec model_spec() {
  models::DecoderFamily family;
  family.name = "llama3";
  family.flavors = flavor_names();
  family.flavor = [](const std::string& name, int64_t vocab_size) {
    // vocab_size 0: the flavor's own.
    return std::unique_ptr<models::DecoderArgs>(std::make_unique<ModelArgs>(
        flavor(name, vocab_size > 0 ? std::optional<int64_t>(vocab_size) : std::nullopt)));
  };
  family.build = [](const models::DecoderArgs& args, const torch::TensorOptions& options) {
    return std::static_pointer_cast<models::Decoder>(std::make_shared<Transformer>(args_of(args), options));
  };
  family.tp_plan = tp_plan();
  family.args_to_json = [](const models::DecoderArgs& args) { return to_json(args_of(args)); };
  family.args_from_json = [](const nlohmann::json& json, const std::string& source) {
    return std::unique_ptr<models::DecoderArgs>(std::make_unique<ModelArgs>(model_args_from_json(json, source)));
  };
  family.hf = hf_format();
  return models::decoder_spec(std::move(family));
}

}  // namespace loom::llama3
