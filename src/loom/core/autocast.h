// Automatic mixed precision for runs without FSDP (one device, or DDP): TorchTitan's
// `torch.autocast(device_type, dtype=mixed_precision_param)`. Inside the scope, ops on the
// autocast lists (matmuls, linear, attention) run in the low-precision dtype while the parameters,
// their gradients and the optimizer state stay float32 (the master weights); precision-sensitive
// ops (softmax, norms, losses) stay float32. FSDP does its own casting (param_dtype) and does not
// use this.
#pragma once
#include <ATen/autocast_mode.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <optional>

namespace loom {

class AutocastScope {
 public:
  // nullopt: no autocast (full precision); the scope does nothing.
  AutocastScope(c10::Device device, std::optional<c10::ScalarType> dtype)
      : type_(device.type()), active_(dtype.has_value()) {
    if (!active_) return;
    prev_enabled_ = at::autocast::is_autocast_enabled(type_);
    prev_dtype_ = at::autocast::get_autocast_dtype(type_);
    at::autocast::set_autocast_enabled(type_, true);
    at::autocast::set_autocast_dtype(type_, *dtype);
    at::autocast::increment_nesting();
  }
  ~AutocastScope() {
    if (!active_) return;
    // Leaving the outermost scope drops the casts of weights cached during it (they are stale
    // once the optimizer updates the float32 weights).
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(type_, prev_enabled_);
    at::autocast::set_autocast_dtype(type_, prev_dtype_);
  }
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  c10::DeviceType type_;
  bool active_;
  bool prev_enabled_ = false;
  c10::ScalarType prev_dtype_ = c10::kFloat;
};

}  // namespace loom
