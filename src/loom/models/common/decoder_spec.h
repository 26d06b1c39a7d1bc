// A decoder family as a registered model (TorchTitan's TrainSpec for its decoder-only models):
// the family states what is its own as data and functions (a DecoderFamily), and decoder_spec()
// fills every ModelSpec slot with the shared implementation: the composition
// (common/parallelize.h), the pipeline split (common/pipeline.h), the layout checks, the
// checkpoint entry and the initial-weights reader (common/model_dir.h).
#pragma once
#include <nlohmann/json.hpp>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "loom/models/common/decoder.h"
#include "loom/models/common/tp_plan.h"
#include "loom/models/spec.h"

namespace loom::models {

struct DecoderFamily {
  std::string name;                  // model.name
  std::vector<std::string> flavors;  // model.flavor's valid values
  // The named flavor with its vocabulary set to `vocab_size`; an unknown name is a
  // loom::UsageError listing the valid ones.
  std::function<std::unique_ptr<DecoderArgs>(const std::string& flavor, int64_t vocab_size)> flavor;
  // The family's decoder with `options` (torch::kMeta: shapes only), parameters uninitialized.
  std::function<std::shared_ptr<Decoder>(const DecoderArgs&, const torch::TensorOptions&)> build;
  TPPlan tp_plan;
  // Parameter counts from the shapes alone (default: a stack of TransformerBlocks).
  std::function<ParameterCounts(const DecoderArgs&)> count_parameters = count_transformer_parameters;
  // The family's args as the checkpoint's model entry stores them, and back (`source` names the
  // file in errors; unknown keys are errors).
  std::function<nlohmann::json(const DecoderArgs&)> args_to_json;
  std::function<std::unique_ptr<DecoderArgs>(const nlohmann::json&, const std::string& source)> args_from_json;
  std::optional<HfFormat> hf;
};

ModelSpec decoder_spec(DecoderFamily family);

// The family args behind a spec's ModelArgs; anything else is an internal error naming `family`.
const DecoderArgs& decoder_args_of(const ModelArgs& args, const std::string& family);

}  // namespace loom::models
