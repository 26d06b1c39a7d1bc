#include "loom/core/dtype.h"

#include "loom/core/error.h"

namespace loom {

c10::ScalarType parse_dtype(std::string_view name, std::string_view setting) {
  if (name == "float32" || name == "fp32") return c10::kFloat;
  if (name == "bfloat16" || name == "bf16") return c10::kBFloat16;
  if (name == "float16" || name == "fp16") return c10::kHalf;
  fail_usage(setting, ": unknown dtype '", name, "'; use float32, bfloat16 or float16");
}

const options::EnumNames<Precision>& option_names(Precision) {
  static const options::EnumNames<Precision> names = {{"float32", Precision::kFloat32},
                                                      {"bfloat16", Precision::kBFloat16}};
  return names;
}

c10::ScalarType scalar_type(Precision precision) {
  return precision == Precision::kBFloat16 ? c10::kBFloat16 : c10::kFloat;
}

}  // namespace loom
