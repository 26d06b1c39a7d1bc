#include "loom/models/common/parallelize.h"

#include "loom/core/autocast.h"
#include "loom/core/error.h"
#include "loom/core/logging.h"
#include "loom/nn/init.h"
#include "loom/models/common/moe_balance.h"
#include "loom/parallel/synchronizers.h"

namespace loom::models {

FSDPReshardSetting FSDPReshardSetting::parse(const std::string& text) {
  if (text == "default") return {fsdp::ReshardAfterForward::always(), false};
  if (text == "always") return {fsdp::ReshardAfterForward::always(), true};
  if (text == "never") return {fsdp::ReshardAfterForward::never(), true};
  const bool digits = !text.empty() && text.find_first_not_of("0123456789") == std::string::npos;
  LOOM_REQUIRE_USAGE(digits, "parallelism.fsdp_reshard_after_forward '", text,
                     "' is not one of default, always, never or a positive integer");
  return {fsdp::ReshardAfterForward::parse(text), true};
}

PlanOptions PlanOptions::from(const ParallelizeOptions& options) {
  PlanOptions plan;
  plan.tp = options.tp;
  plan.cp_rotate_method = options.cp_rotate_method;
  const auto reshard = FSDPReshardSetting::parse(options.fsdp_reshard_after_forward);
  plan.fsdp.reshard_after_forward = reshard.blocks;
  plan.fsdp_reshard_last_block = reshard.last_block;
  plan.fsdp.mixed_precision = options.fsdp_mixed_precision;
  plan.fsdp.parameter_granularity = options.fsdp_parameter_granularity;
  plan.fsdp.device = options.device;  // FSDP's buffers on the rank's device (caching allocator on GPUs)
  plan.ac = ac::ACOptions::from(options.activation_checkpoint);
  if (options.float8.enable) plan.float8 = float8::Float8Options::from(options.float8);
  plan.seed = options.seed;
  plan.device = options.device;
  plan.autocast_dtype = options.autocast_dtype;
  return plan;
}

std::shared_ptr<fsdp::FSDPModule> apply_fsdp(Decoder& model, const fsdp::FSDPMesh& mesh,
                                             const fsdp::FSDPPolicy& policy, bool reshard_last_block) {
  const auto layers = model.layers().named_children();
  for (size_t i = 0; i < layers.size(); ++i) {
    fsdp::FSDPPolicy block_policy = policy;
    if (!reshard_last_block && i + 1 == layers.size()) {
      block_policy.reshard_after_forward = fsdp::ReshardAfterForward::never();
    }
    fsdp::fully_shard(*layers[i].second, mesh, block_policy, "layers." + layers[i].first);
  }
  return fsdp::fully_shard(model, mesh, policy, "root");
}

std::shared_ptr<fsdp::FSDPModule> apply_fsdp(Decoder& model, const distributed::DeviceMesh& mesh,
                                             const fsdp::FSDPPolicy& policy, bool reshard_last_block) {
  return apply_fsdp(model, fsdp::make_fsdp_mesh(mesh, policy), policy, reshard_last_block);
}

void init_sharded_weights(Decoder& model, fsdp::FSDPModule& fsdp, uint64_t seed, c10::Device device,
                          const tp::TensorParallel* tp) {
  for (const auto& b : model.named_buffers()) {
    if (b.slot->tensor.is_meta()) {
      b.slot->tensor = torch::empty(b.slot->tensor.sizes(), b.slot->tensor.options().device(device));
    }
  }
  model.reset_buffers();
  auto draw = [&](const std::string& name, torch::Tensor& full) {
    nn::init_parameter(model.parameter_init(name), name, seed, full);
  };
  fsdp.init_parameters([&](const std::string& name, torch::Tensor& full) {
    if (tp != nullptr) {
      tp->init_local(name, full, draw);
    } else {
      draw(name, full);
    }
  });
}

int64_t apply_ac(Decoder& model, const ac::ACOptions& options) {
  int64_t wrapped = 0;
  for (const auto& [id, layer] : model.layers().named_children()) {
    auto& block = static_cast<DecoderBlock&>(*layer);
    if (!options.wraps(block.layer_id())) continue;
    ac::checkpoint_module(block, options.per_op);
    ++wrapped;
  }
  return wrapped;
}

void apply_cp(Decoder& model, tensor::CommPtr comm, cp::RotateMethod method) {
  for (const auto& [id, layer] : model.layers().named_children()) {
    static_cast<DecoderBlock&>(*layer).attention().set_attend(
        [comm, method](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       const nn::TokenLayout& layout) {
          // [B, T, H, D] -> ring attention's [B, H, T, D] and back to [B, T, H * D].
          const torch::Tensor out = cp::ring_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                       comm, method, layout.document_ids);
          return out.transpose(1, 2).reshape({q.size(0), q.size(1), q.size(2) * q.size(3)});
        });
  }
}

parallel::ParallelParts compose(const std::vector<std::shared_ptr<Decoder>>& models,
                                const distributed::ParallelDims& dims, const distributed::DeviceMesh& mesh,
                                const TPPlan& tp_plan, const PlanOptions& options) {
  parallel::ParallelParts parts;
  for (const auto& model : models) parts.modules.push_back(model);
  // 0. Float8: the linears' GEMMs become float8 ones (an around-hook on each converted linear; the
  //    parameters stay high precision), before any parallelism as TorchTitan's model converters.
  //    So FSDP below gathers high-precision weights the hooks quantize, and AC recomputes them.
  if (options.float8) {
    LOOM_REQUIRE(!dims.tp_enabled() && !dims.pp_enabled(),
                 "float8 with tensor or pipeline parallelism (refused by train/compatibility.cpp)");
    for (const auto& model : models) {
      const auto report = float8::convert_to_float8(*model, *options.float8);
      log::info("float8: ", report.describe(options.float8->recipe));
    }
  }
  // 1. Tensor parallelism: parameters become this rank's shards (still on the meta device, each
  //    slot carrying its layout); one plan records every part's parameters.
  std::shared_ptr<tp::TensorParallel> tp;
  if (dims.tp_enabled()) {
    tp = std::make_shared<tp::TensorParallel>(mesh.comm("tp"), options.tp.sequence_parallel, options.tp.async);
    for (const auto& model : models) apply_tp(*model, *tp, tp_plan, options.tp);
    parts.synchronizers.push_back(std::make_shared<parallel::TensorParallelSync>(tp));
  }
  // 2. Context parallelism: attention over the sequence chunks of the cp group (the batches carry
  //    each chunk's positions and documents to every part).
  if (dims.cp_enabled()) {
    const tensor::CommPtr cp = mesh.comm("cp");
    for (const auto& model : models) apply_cp(*model, cp, options.cp_rotate_method);
    parts.synchronizers.push_back(std::make_shared<parallel::ContextParallelSync>(cp));
  }
  // 3. Activation checkpointing: the blocks' forwards become checkpointed ones. Between TP/CP and
  //    FSDP: the TP/CP hooks inside a block are part of its recomputed forward (the sequence
  //    collectives and ring attention run again in backward, as in Megatron-LM / TorchTitan), while
  //    FSDP's hooks, added after this on the block itself, stay outside it: the all-gather before
  //    the forward and the reshard after it run once, and in backward FSDP's pre-backward hook on
  //    the block's output re-gathers the parameters before the recompute reads them, so the
  //    recompute triggers no extra all-gather, no second reduce-scatter and no second hook.
  if (options.ac.mode != ac::Mode::kNone) {
    int64_t wrapped = 0, blocks = 0;
    for (const auto& model : models) {
      wrapped += apply_ac(*model, options.ac);
      blocks += static_cast<int64_t>(model->layers().size());
    }
    log::info("activation checkpointing: ", options.ac.describe(), " (", wrapped, " of ", blocks,
              " blocks on this rank)");
  }
  // 4. FSDP over the TP-local parameters, or materialization; then every parameter from the seed
  //    by its global name (a part keeps the whole model's names, so each gets the whole model's
  //    values: each TP rank its piece, each FSDP rank its shard of that). The cp ranks hold the same
  //    parameters and see different tokens: FSDP shards over dp_shard x cp (TorchTitan's
  //    dp_shard_cp), so its gradient average spans them.
  if (dims.fsdp_enabled()) {
    LOOM_REQUIRE(models.size() == 1, "FSDP needs one model part per rank (one pipeline stage)");
    fsdp::FSDPPolicy policy = options.fsdp;
    if (dims.cp_enabled()) policy.shard_dim = "dp_shard_cp";
    auto fsdp = apply_fsdp(*models[0], mesh, policy, options.fsdp_reshard_last_block);
    init_sharded_weights(*models[0], *fsdp, options.seed, options.device, tp.get());
    parts.storage = std::make_unique<parallel::FsdpParameters>(fsdp);
    parts.synchronizers.push_back(std::make_shared<parallel::FsdpSync>(fsdp));
  } else {
    for (const auto& model : models) {
      model->to_empty(options.device);
      if (tp) {
        init_tp_weights(*model, *tp, options.seed);
      } else {
        model->init_weights(options.seed);
      }
    }
  }
  // 5. MoE load balancing: the selection biases move after each step's last backward, from the
  //    token counts of every rank that routed a share of the batch through the same layers.
  std::vector<std::pair<std::string, moe::MoE*>> balanced;
  for (const auto& model : models) {
    for (auto& layer : balanced_moe_layers(*model)) balanced.push_back(layer);
  }
  if (!balanced.empty()) {
    std::vector<tensor::CommPtr> comms;
    if (dims.dp_cp_enabled()) comms.push_back(mesh.comm("dp_cp"));
    if (dims.tp_enabled()) comms.push_back(mesh.comm("tp"));
    parts.synchronizers.push_back(std::make_shared<MoEBalanceSync>(std::move(balanced), std::move(comms)));
  }
  return parts;
}

std::unique_ptr<parallel::ParallelizedModel> parallelize(std::shared_ptr<Decoder> model,
                                                         const distributed::ParallelDims& dims,
                                                         const distributed::DeviceMesh& mesh, const TPPlan& tp_plan,
                                                         const PlanOptions& options) {
  parallel::ParallelParts parts = compose({model}, dims, mesh, tp_plan, options);
  Decoder* raw = model.get();
  const auto autocast = options.autocast_dtype;
  const c10::Device device = options.device;
  parts.step = std::make_unique<parallel::LossStep>([raw, autocast, device](const parallel::ModelBatch& batch) {
    // Autocast covers the forward only; backward runs each op in the dtype its forward used.
    AutocastScope scope(device, autocast);
    return raw->forward_loss(batch.tokens, batch.labels, batch.layout);
  });
  // 6. Without sharding, replicas average their gradients in backward (DDP's buckets).
  if (!dims.fsdp_enabled() && dims.dp_replicate_enabled()) {
    parts.synchronizers.push_back(std::make_shared<parallel::DdpSync>(
        std::make_unique<ddp::DataParallel>(*model, mesh.comm("dp_replicate"))));
  }
  return std::make_unique<parallel::ParallelizedModel>(std::move(parts));
}

}  // namespace loom::models
