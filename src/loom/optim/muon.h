// Muon (Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024; Liu et al.,
// "Muon is Scalable for LLM Training", arXiv:2502.16982, "Moonlight") for 2-D weight matrices, and
// AdamW for every other parameter.
//
// Per Muon matrix W with gradient G and momentum buffer B (no bias correction):
//   B = mu * B + G
//   U = G + mu * B (Nesterov) or B
//   O = NS(U): Newton-Schulz iterations towards the orthogonal polar factor of U (U = P S Q^T ->
//       roughly P Q^T), in float32, on the transposed matrix when rows > cols so X X^T is small
//   W *= 1 - lr * weight_decay
//   W -= lr * scale(rows, cols) * O
// scale "match_rms_adamw" (Moonlight, torch.optim.Muon's adjust_lr_fn = "match_rms_adamw") is
// 0.2 * sqrt(max(rows, cols)): the update's RMS is then about 0.2, like AdamW's, so Muon shares
// AdamW's lr and weight decay. "original" is Keller Jordan's sqrt(max(1, rows / cols)).
//
// Which parameters are Muon's is one rule, is_muon_parameter: 2-D matrices except the token
// embedding and the output head (their rows are per-token lookups, not a linear map of the
// residual stream; Moonlight and Keller Jordan leave them to AdamW) and anything in a routed
// experts stack ("experts": 3-D weights, and 2-D stacks of per-expert bias vectors). Everything
// else (embedding, head, norm scales, biases, experts) is updated by optim::AdamW with the same
// options and weight decay.
//
// Every step is plain ATen (matmuls, element-wise ops), so it runs wherever the parameters live.
#pragma once
#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "loom/optim/adamw.h"
#include "loom/optim/optimizer.h"

namespace loom::optim {

enum class MuonLRAdjust { kMatchRmsAdamW, kOriginal };

// optimizer.muon_adjust_lr: "match_rms_adamw" | "original" (core/options.h's enum protocol).
const options::EnumNames<MuonLRAdjust>& option_names(MuonLRAdjust);

struct MuonOptions {
  double momentum = 0.95;
  bool nesterov = true;
  int64_t ns_steps = 5;
  MuonLRAdjust adjust_lr = MuonLRAdjust::kMatchRmsAdamW;
  double ns_eps = 1e-7;  // added to the Frobenius norm before normalising (Keller Jordan's)
};

// Keller Jordan's quintic coefficients: the iteration x -> a x + b x^3 + c x^5 on each singular
// value pushes [~0, 1] towards a band around 1 as fast as possible in 5 steps (not exactly to 1).
constexpr double kNewtonSchulzA = 3.4445;
constexpr double kNewtonSchulzB = -4.7750;
constexpr double kNewtonSchulzC = 2.0315;

// The Muon/AdamW split: 2-D and not the token embedding or the output head (any dotted component
// of `name` equal to "tok_embeddings" or "output"). `full_shape` is the unsharded shape, so FSDP
// (whose shards are flat) applies the same rule.
bool is_muon_parameter(std::string_view name, c10::IntArrayRef full_shape);

// NS(X) for a 2-D X: `steps` quintic Newton-Schulz iterations in float32 after X / (||X||_F + eps).
// Returns a float32 matrix shaped like X.
at::Tensor newton_schulz(const at::Tensor& x, int64_t steps, double eps = 1e-7);

// The factor the orthogonalised update is multiplied by for a rows x cols matrix.
double muon_lr_scale(int64_t rows, int64_t cols, MuonLRAdjust adjust);

// One Muon update of one whole matrix: momentum, orthogonalisation, decoupled weight decay and
// the step (see the top of this file). `param` and `momentum_buffer` are updated in place.
void muon_update(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& momentum_buffer,
                 double lr, double weight_decay, const MuonOptions& options);

void check_muon_options(const MuonOptions& options);

// Muon on whole parameters (one process, DDP, pipeline stages). The groups are the usual
// weight-decay groups; inside each, is_muon_parameter picks Muon's matrices and the rest go to an
// optim::AdamW built from the same groups.
class Muon : public Optimizer {
 public:
  // Throws loom::Error on duplicates, undefined or non-floating parameters, or a bad option.
  Muon(std::vector<ParamGroup> groups, AdamWOptions adamw_options, MuonOptions muon_options);

  void step() override;
  void zero_grad(bool set_to_none = true) override;
  void set_lr(double lr) override;
  double lr() const override { return adamw_options_.lr; }

  // Muon matrices: "<p>.momentum_buffer" (shaped like p) and "<p>.step" (float32 0-dim); the
  // others: AdamW's "<p>.step", "<p>.exp_avg", "<p>.exp_avg_sq".
  TensorDict state_dict() const override;
  void load_state_dict(const TensorDict& state) override;

  const MuonOptions& muon_options() const { return muon_options_; }
  // Names of the parameters Muon updates (the rest: AdamW's), in group order.
  std::vector<std::string> muon_parameter_names() const;
  const AdamW& adamw() const { return *adamw_; }

 private:
  struct Slot {
    std::string name;
    at::Tensor param;
    at::Tensor momentum_buffer;
    at::Tensor step;
    double weight_decay = 0.0;
  };
  std::vector<Slot> slots_;
  std::unique_ptr<AdamW> adamw_;
  AdamWOptions adamw_options_;
  MuonOptions muon_options_;
};

// "<param_name>.momentum_buffer": the state key of a Muon matrix's momentum buffer (whole, or an
// FSDP rank's piece of it), shared by Muon and fsdp::ShardedMuon so checkpoints move between them.
std::string muon_momentum_key(const std::string& param_name);

}  // namespace loom::optim
