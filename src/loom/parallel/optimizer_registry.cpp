#include "loom/parallel/optimizer_registry.h"

#include <algorithm>

#include "loom/core/error.h"
#include "loom/fsdp/sharded_muon.h"
#include "loom/optim/adamw8bit.h"

namespace loom::parallel {
namespace {

// Under TP every matrix is split over the TP ranks; the optimizers below need whole ones (Muon's
// Newton-Schulz) or per-block scales that TP boxes would cut (AdamW8bit), and neither gathers yet.
void refuse_tensor_parallel(const OptimizerLayout& layout, const std::string& name, const char* why) {
  LOOM_REQUIRE_USAGE(layout.tensor_parallel_degree == 1, "optimizer.name = \"", name,
                     "\" does not support tensor parallelism yet (", why,
                     "); set parallelism.tensor_parallel_degree = 1 or optimizer.name = \"AdamW\"");
}

OptimizerSpec adamw_spec() {
  OptimizerSpec s;
  s.name = "AdamW";
  s.applies_step_guard = true;
  s.build = [](const optim::NamedTensors& params, const OptimizerRequest& r) -> std::unique_ptr<optim::Optimizer> {
    return std::make_unique<optim::AdamW>(optim::weight_decay_param_groups(params, r.weight_decay), r.adamw);
  };
  s.build_sharded = [](fsdp::FSDPRoots fsdp,
                       const OptimizerRequest& r) -> std::unique_ptr<fsdp::ShardedOptimizer> {
    return std::make_unique<fsdp::ShardedAdamW>(std::move(fsdp), r.adamw, r.weight_decay);
  };
  return s;
}

OptimizerSpec adamw8bit_spec() {
  OptimizerSpec s;
  s.name = "AdamW8bit";
  s.check_layout = [name = s.name](const OptimizerRequest& r, const OptimizerLayout& layout) {
    LOOM_REQUIRE_USAGE(layout.device != "cuda" && layout.device.rfind("cuda:", 0) != 0, "optimizer.name = \"",
                       name, "\" runs on the CPU only (its fused loop is a CPU kernel), but training.device is ",
                       layout.device, "; set training.device = \"cpu\" or optimizer.name = \"AdamW\"");
    // The FSDP planner sizes every rank's shard in 16-byte units of the flat buffer's smallest
    // element (float32: 4 elements; a bfloat16 gather or reduce: 8). Blocks made of whole units
    // start and end on that grid wherever a block-aligned tensor lands in the shard.
    const int64_t unit = layout.half_precision_shards ? 8 : 4, b = r.block_size;
    LOOM_REQUIRE_USAGE(b >= unit && b % unit == 0, "optimizer.block_size = ", b, " is not a positive multiple of ",
                       unit, " elements, the FSDP planner's 16-byte shard alignment",
                       layout.half_precision_shards ? " under bfloat16 mixed precision" : " for float32",
                       "; use a multiple of ", unit, " such as 256");
    refuse_tensor_parallel(layout, name, "its per-block scales are not split into TP boxes");
  };
  s.fsdp_granularity = [](const OptimizerRequest& r) { return fsdp::adamw8bit_granularity(r.block_size); };
  s.build = [](const optim::NamedTensors& params, const OptimizerRequest& r) -> std::unique_ptr<optim::Optimizer> {
    return std::make_unique<optim::AdamW8bit>(optim::weight_decay_param_groups(params, r.weight_decay), r.adamw,
                                              r.block_size);
  };
  s.build_sharded = [](fsdp::FSDPRoots fsdp,
                       const OptimizerRequest& r) -> std::unique_ptr<fsdp::ShardedOptimizer> {
    return std::make_unique<fsdp::ShardedAdamW8bit>(std::move(fsdp), r.adamw, r.weight_decay, r.block_size);
  };
  return s;
}

OptimizerSpec muon_spec() {
  OptimizerSpec s;
  s.name = "Muon";
  s.check_layout = [name = s.name](const OptimizerRequest&, const OptimizerLayout& layout) {
    refuse_tensor_parallel(layout, name, "its Newton-Schulz step needs whole matrices");
  };
  // Muon orthogonalises whole matrices: FSDP places each on one rank, so its step needs no gather.
  s.fsdp_granularity = [](const OptimizerRequest&) { return fsdp::muon_granularity(); };
  s.build = [](const optim::NamedTensors& params, const OptimizerRequest& r) -> std::unique_ptr<optim::Optimizer> {
    return std::make_unique<optim::Muon>(optim::weight_decay_param_groups(params, r.weight_decay), r.adamw, r.muon);
  };
  s.build_sharded = [](fsdp::FSDPRoots fsdp,
                       const OptimizerRequest& r) -> std::unique_ptr<fsdp::ShardedOptimizer> {
    return std::make_unique<fsdp::ShardedMuon>(std::move(fsdp), r.adamw, r.muon, r.weight_decay);
  };
  return s;
}

const std::vector<OptimizerSpec>& registered() {
  static const std::vector<OptimizerSpec> specs = {adamw_spec(), adamw8bit_spec(), muon_spec()};
  return specs;
}

}  // namespace

const std::vector<std::string_view>& optimizer_names() {
  static const std::vector<std::string_view> names = [] {
    std::vector<std::string_view> n;
    for (const OptimizerSpec& s : registered()) n.emplace_back(s.name);
    return n;
  }();
  return names;
}

const OptimizerSpec& optimizer_spec(std::string_view name) {
  const auto& specs = registered();
  const auto it = std::find_if(specs.begin(), specs.end(), [&](const OptimizerSpec& s) { return s.name == name; });
  if (it == specs.end()) {
    std::string available;
    for (const std::string_view n : optimizer_names()) available += (available.empty() ? "" : ", ") + std::string(n);
    fail_usage("unknown optimizer.name '", name, "'; available: ", available);
  }
  return *it;
}

}  // namespace loom::parallel
