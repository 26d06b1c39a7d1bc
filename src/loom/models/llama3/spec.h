// Llama 3 as a registered model (models/spec.h): the shared decoder (models/common/) with its
// flavors, initialization, TP plan, checkpoint entry and Hugging Face format.
#pragma once
#include "loom/models/common/tp_plan.h"
#include "loom/models/llama3/model.h"
#include "loom/models/spec.h"

namespace loom::llama3 {

models::ModelSpec model_spec();

// Llama 3's tensor-parallel plan: the shared TransformerBlock plan (models::transformer_tp_plan).
const models::TPPlan& tp_plan();

// The Llama 3 args behind a spec's models::ModelArgs (built by model_spec()'s build_args or
// model_args_from_config_json); anything else is an internal error.
const ModelArgs& args_of(const models::ModelArgs& args);

}  // namespace loom::llama3
