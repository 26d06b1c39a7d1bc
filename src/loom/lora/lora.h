// LoRA (Hu et al.; PEFT's LoraLayer, TorchTitan's LoRA converter), applied to a model from outside
// like Float8: every nn::Linear the targets name gets a child "lora" (an Adapter with A [r, in] and
// B [out, r]) and an around-hook computing
//
//     y = base(x) + s * B (A (dropout(x))),   s = alpha / r   (alpha / sqrt(r) with rsLoRA)
//
// chained after any hook already there (a Float8 base). A is kaiming-uniform (PEFT's
// kaiming_uniform_(a = sqrt(5)): U(-1/sqrt(in), 1/sqrt(in))), B zero, so the adapted model starts
// as the base, bitwise. Every parameter outside the adapters is frozen (requires_grad false): no
// gradient, no optimizer state, no gradient reduction.
//
// Targets are the Hugging Face module names PEFT's target_modules uses (q_proj, k_proj, v_proj,
// o_proj, gate_proj, up_proj, down_proj, ...; a family's HF name map turns each Loom linear into its
// HF path), or "all-linear" (every linear but the output head, as PEFT).
#pragma once
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "loom/core/options.h"
#include "loom/nn/init.h"
#include "loom/nn/layers.h"
#include "loom/nn/module.h"

namespace loom::lora {

// The [lora] section of a job config (lora_section() is its schema). rank 0 = off.
struct LoRAConfig {
  int64_t rank = 0;
  double alpha = 16.0;
  double dropout = 0.0;
  std::string target_modules = "q_proj,k_proj,v_proj,o_proj";
  bool use_rslora = false;

  bool operator==(const LoRAConfig&) const = default;
};
const options::Section& lora_section();

struct LoRAOptions {
  int64_t rank = 8;
  double alpha = 16.0;
  double dropout = 0.0;
  std::vector<std::string> target_modules = {"q_proj", "k_proj", "v_proj", "o_proj"};  // or {"all-linear"}
  bool use_rslora = false;

  double scaling() const;
  // target_modules split at commas, blanks trimmed.
  static LoRAOptions from(const LoRAConfig& config);
};

// The adapter of one linear: a [rank, in] and b [out, rank] (PEFT's lora_A.weight, lora_B.weight).
class Adapter : public nn::Module {
 public:
  Adapter(int64_t in_features, int64_t out_features, int64_t rank, const torch::TensorOptions& options);
  // s * b (a (x)) for x [..., in] (dropout applied by the caller's hook).
  torch::Tensor forward(const torch::Tensor& x, double scaling);
  const torch::Tensor& a() const { return a_->tensor; }
  const torch::Tensor& b() const { return b_->tensor; }
  // The around-hook its linear had before the adapter's (a Float8 base's), which remove_lora
  // puts back.
  const nn::ForwardOverride& previous_override() const { return previous_; }
  void set_previous_override(nn::ForwardOverride previous) { previous_ = std::move(previous); }
  // Off: its linear computes the base alone, the adapter's parameters untouched wherever they live
  // (TP shards, FSDP's flat buffers): the reference policy of `loom rl`'s KL term.
  void set_enabled(bool enabled) { enabled_ = enabled; }
  bool enabled() const { return enabled_; }

 private:
  nn::ParameterSlot* a_;
  nn::ParameterSlot* b_;
  nn::ForwardOverride previous_;
  bool enabled_ = true;
};

inline constexpr const char* kAdapterName = "lora";  // the child a linear's adapter is registered as

// Maps a linear's Loom path ("layers.0.attention.wq") to its HF module path
// ("model.layers.0.self_attn.q_proj"); nullopt when the family has none.
using HfModuleName = std::function<std::optional<std::string>(const std::string& loom_path)>;

struct LoRAReport {
  std::vector<std::string> adapted;  // Loom paths of the adapted linears, in module order
  int64_t adapter_parameters = 0;
  int64_t frozen_parameters = 0;
  std::string describe() const;  // "28 linears adapted (rank 8): 1.84M adapter parameters, 494.03M frozen"
};

// Adds the adapters and their hooks to every targeted linear of `model` and freezes every other
// parameter. The output head ("output") is never adapted. A target name no linear has (or a list
// that matches none) is a loom::UsageError listing the HF (or Loom) names of the model's linears,
// as is a rank above a target's min(in, out). `whole_model` false: `model` is one pipeline stage,
// which may lack some targets (a later stage without the dense layers' down_proj) or all of them;
// check_lora_targets has checked the whole model.
LoRAReport apply_lora(nn::Module& model, const LoRAOptions& options, const HfModuleName& hf_name,
                      bool whole_model = true);
// apply_lora's checks of the target list against the whole model, without adapting anything (a
// pipeline run checks the whole meta model before building its stages).
void check_lora_targets(nn::Module& model, const LoRAOptions& options, const HfModuleName& hf_name);

// Removes every adapter of `model` (children "lora" and their hooks; the previous hooks are put
// back): the model computes the base again, so another adapter can be applied to the same
// resident base. Returns how many were removed. Frozen parameters stay frozen.
int64_t remove_lora(nn::Module& model);

// Folds every adapter into its base weight, W <- W + s B A (computed in float32, stored in W's
// dtype), then removes the adapters (PEFT's merge_and_unload). `options` must be those applied.
void merge_lora(nn::Module& model, const LoRAOptions& options);

// The adapter of the linear at `linear_path`, or null.
Adapter* find_adapter(nn::Module& model, const std::string& linear_path);

// A checkpoint's record of its adapters (the "lora" entry of its global JSON): rank, alpha,
// dropout, target_modules (a list), use_rslora. from_json: a one-line loom::Error naming `source`
// for a malformed entry.
nlohmann::json to_json(const LoRAOptions& options);
LoRAOptions from_json(const nlohmann::json& entry, const std::string& source);
// Why a run with adapter settings `now` cannot resume adapters trained with `saved` (empty when it
// can): another rank or set of target modules (the adapters of a dropped target would be
// discarded from every later checkpoint), or another scaling (alpha, use_rslora: the trained
// adapters would be silently rescaled). A different dropout is allowed (it shapes training, not
// the adapters), and so is an alpha/rsLoRA change that keeps the scaling.
std::string resume_mismatch(const LoRAOptions& saved, const LoRAOptions& now);
inline constexpr const char* kCheckpointKey = "lora";

// The initialization of an adapter parameter by name ("...lora.a": kaiming-uniform over its fan-in,
// "...lora.b": zeros); nullopt for any other parameter.
std::optional<nn::ParameterInit> adapter_init(const std::string& name);

}  // namespace loom::lora
