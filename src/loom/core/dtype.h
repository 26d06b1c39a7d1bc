// Floating dtypes by name, as configs and CLIs write them.
#pragma once
#include <c10/core/ScalarType.h>

#include <string_view>

#include "loom/core/options.h"

namespace loom {

// "float32"/"fp32", "bfloat16"/"bf16", "float16"/"fp16" -> the dtype; anything else is a
// loom::UsageError naming `setting` (e.g. "training.mixed_precision_param", "--dtype") and the
// accepted names.
c10::ScalarType parse_dtype(std::string_view name, std::string_view setting);

// training.mixed_precision_param and _reduce: the dtype parameters are computed in or gradients
// reduced in (core/options.h's enum protocol).
enum class Precision { kFloat32, kBFloat16 };
const options::EnumNames<Precision>& option_names(Precision);
c10::ScalarType scalar_type(Precision precision);

}  // namespace loom
