// Floating dtypes by name, as configs and CLIs write them.
#pragma once
#include <c10/core/ScalarType.h>

#include <string_view>

namespace loom {

// "float32"/"fp32", "bfloat16"/"bf16", "float16"/"fp16" -> the dtype; anything else is a
// loom::UsageError naming `setting` (e.g. "training.mixed_precision_param", "--dtype") and the
// accepted names.
c10::ScalarType parse_dtype(std::string_view name, std::string_view setting);

}  // namespace loom
