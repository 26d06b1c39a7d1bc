// Llama 3 as a registered model (models/spec.h): its flavors, builder, counts, TP checks,
// parallelize plan, checkpoint entry and model-directory reader, behind the ModelSpec functions.
#pragma once
#include "loom/models/llama3/model_args.h"
#include "loom/models/spec.h"

namespace loom::llama3 {

models::ModelSpec model_spec();

// The Llama 3 args behind a spec's models::ModelArgs (built by model_spec()'s build_args or
// model_args_from_config_json); anything else is an internal error.
const ModelArgs& args_of(const models::ModelArgs& args);

}  // namespace loom::llama3
