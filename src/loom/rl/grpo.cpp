#include "loom/rl/grpo.h"

#include "loom/core/error.h"

namespace loom::rl {

const options::EnumNames<AdvantageScale>& option_names(AdvantageScale) {
  static const options::EnumNames<AdvantageScale> names = {{"group", AdvantageScale::kGroupStd},
                                                           {"none", AdvantageScale::kNone}};
  return names;
}

const options::EnumNames<LossAggregation>& option_names(LossAggregation) {
  static const options::EnumNames<LossAggregation> names = {{"grpo", LossAggregation::kSequenceMean},
                                                            {"bnpo", LossAggregation::kTokenMean},
                                                            {"dr_grpo", LossAggregation::kDrGrpo}};
  return names;
}

torch::Tensor group_advantages(const torch::Tensor& rewards, int64_t group_size, AdvantageScale scale, double eps) {
  LOOM_REQUIRE_USAGE(group_size >= 2, "GRPO needs at least 2 completions per prompt to compare, got ", group_size);
  LOOM_REQUIRE_USAGE(rewards.dim() == 1 && rewards.numel() % group_size == 0, "GRPO rewards ", rewards.sizes(),
                     " are not whole groups of ", group_size, " completions");
  const torch::Tensor r = rewards.to(torch::kFloat32).view({-1, group_size});
  const torch::Tensor centred = r - r.mean(1, /*keepdim=*/true);
  if (scale == AdvantageScale::kNone) return centred.reshape({-1});
  // Unbiased, as torch.std (TRL): a group of equal rewards has std 0 and advantages 0.
  return (centred / (r.std(1, /*unbiased=*/true, /*keepdim=*/true) + eps)).reshape({-1});
}

void GrpoOptions::validate() const {
  LOOM_REQUIRE_USAGE(clip_low > 0 && clip_low < 1, "GRPO clip_low must be in (0, 1), got ", clip_low);
  LOOM_REQUIRE_USAGE(clip_high > 0, "GRPO clip_high must be > 0, got ", clip_high);
  LOOM_REQUIRE_USAGE(kl_beta >= 0, "GRPO kl_beta must be >= 0, got ", kl_beta);
  LOOM_REQUIRE_USAGE(max_completion_length >= 0, "GRPO max_completion_length must be >= 0, got ", max_completion_length);
}

GrpoLoss grpo_loss(const torch::Tensor& logp, const torch::Tensor& logp_old, const torch::Tensor& logp_ref,
                   const torch::Tensor& advantages, const torch::Tensor& mask, const GrpoOptions& o) {
  o.validate();
  LOOM_REQUIRE(logp.dim() == 2 && logp_old.sizes() == logp.sizes() && mask.sizes() == logp.sizes() &&
                   advantages.dim() == 1 && advantages.size(0) == logp.size(0),
               "grpo_loss: logp ", logp.sizes(), ", logp_old ", logp_old.sizes(), ", mask ", mask.sizes(),
               " and advantages ", advantages.sizes(), " do not fit [B, T], [B, T], [B, T], [B]");
  const bool kl = o.kl_beta > 0;
  LOOM_REQUIRE(!kl || (logp_ref.defined() && logp_ref.sizes() == logp.sizes()),
               "grpo_loss: kl_beta > 0 needs logp_ref of shape ", logp.sizes());
  const torch::Tensor m = mask.to(logp.scalar_type());
  const torch::Tensor tokens = m.sum(1);
  LOOM_REQUIRE((tokens > 0).all().item<bool>(), "grpo_loss: a completion without a trained token");
  const torch::Tensor a = advantages.to(logp.scalar_type()).unsqueeze(1);
  const torch::Tensor ratio = torch::exp(logp - logp_old.detach());
  const torch::Tensor clipped = torch::clamp(ratio, 1.0 - o.clip_low, 1.0 + o.clip_high);
  torch::Tensor per_token = -torch::min(ratio * a, clipped * a);
  torch::Tensor k3;
  if (kl) {
    const torch::Tensor delta = logp_ref.detach() - logp;
    k3 = torch::exp(delta) - delta - 1.0;
    per_token = per_token + o.kl_beta * k3;
  }
  GrpoLoss out;
  switch (o.aggregation) {
    case LossAggregation::kSequenceMean: out.loss = ((per_token * m).sum(1) / tokens).mean(); break;
    case LossAggregation::kTokenMean: out.loss = (per_token * m).sum() / m.sum(); break;
    case LossAggregation::kDrGrpo:
      out.loss = (per_token * m).sum() /
                 static_cast<double>(logp.size(0) * (o.max_completion_length > 0 ? o.max_completion_length : logp.size(1)));
      break;
  }
  torch::NoGradGuard no_grad;
  const double n = m.sum().item<double>();
  out.ratio = (ratio * m).sum().item<double>() / n;
  out.clipped_low = ((ratio < 1.0 - o.clip_low).logical_and(a < 0).to(m.scalar_type()) * m).sum().item<double>() / n;
  out.clipped_high = ((ratio > 1.0 + o.clip_high).logical_and(a > 0).to(m.scalar_type()) * m).sum().item<double>() / n;
  if (kl) out.kl = (k3 * m).sum().item<double>() / n;
  return out;
}

}  // namespace loom::rl
