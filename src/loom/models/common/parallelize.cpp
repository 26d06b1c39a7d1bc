#include "loom/models/common/parallelize.h"

#include <algorithm>

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
  plan.fsdp_bucket_bytes = resolve_fsdp_bucket_mb(options.fsdp_bucket_mb);
  plan.fsdp_accumulate_unsharded = options.fsdp_accumulate_unsharded;
  LOOM_REQUIRE_USAGE(options.fsdp_prefetch_depth >= 0, "parallelism.fsdp_prefetch_depth must be >= 0, got ",
                     options.fsdp_prefetch_depth, "; fix: 1 prefetches the next FSDP group, 2 the next two, 0 none");
  plan.fsdp.prefetch_depth = static_cast<int>(std::min<int64_t>(options.fsdp_prefetch_depth, 1 << 20));
  plan.fsdp.mixed_precision = options.fsdp_mixed_precision;
  plan.fsdp.parameter_granularity = options.fsdp_parameter_granularity;
  plan.fsdp.device = options.device;  // FSDP's buffers on the rank's device (caching allocator on GPUs)
  plan.ac = ac::ACOptions::from(options.activation_checkpoint);
  if (options.float8.enable) plan.float8 = float8::Float8Options::from(options.float8);
  if (options.lora.rank > 0) plan.lora = lora::LoRAOptions::from(options.lora);
  plan.seed = options.seed;
  plan.device = options.device;
  plan.autocast_dtype = options.autocast_dtype;
  return plan;
}

int64_t resolve_fsdp_bucket_mb(double bucket_mb) {
  if (bucket_mb == kAutoBucketMb) return kAutoBucketBytes;
  LOOM_REQUIRE_USAGE(bucket_mb >= 0 && bucket_mb < 1e9, "parallelism.fsdp_bucket_mb must be 0 (one FSDP group per "
                     "block), -1 (automatic) or a size in MB > 0, got ", bucket_mb);
  return static_cast<int64_t>(bucket_mb * (1 << 20));
}

namespace {

// Bytes of the parameters of `module` that no FSDP group below it holds already (an MoE layer's
// experts, LoRA adapters): what its own group would gather.
int64_t unsharded_parameter_bytes(nn::Module& module) {
  std::vector<std::string> sharded;
  for (const auto& [path, m] : module.named_modules()) {
    if (!path.empty() && fsdp::fsdp_state(*m)) sharded.push_back(path + ".");
  }
  int64_t bytes = 0;
  for (const auto& p : module.named_parameters()) {
    const bool below = std::any_of(sharded.begin(), sharded.end(),
                                   [&](const std::string& prefix) { return p.name.rfind(prefix, 0) == 0; });
    if (!below) bytes += p.tensor().numel() * static_cast<int64_t>(p.tensor().element_size());
  }
  return bytes;
}

}  // namespace

std::shared_ptr<fsdp::FSDPModule> apply_fsdp(Decoder& model, const fsdp::FSDPMesh& mesh,
                                             const fsdp::FSDPPolicy& policy, const FSDPGrouping& grouping) {
  fsdp::FSDPPolicy kept = policy;  // the groups whose backward comes first, unless told otherwise
  if (!grouping.reshard_last_block) kept.reshard_after_forward = fsdp::ReshardAfterForward::never();
  const auto layers = model.layers().named_children();
  std::vector<int64_t> bytes;
  for (const auto& [id, layer] : layers) bytes.push_back(unsharded_parameter_bytes(*layer));
  const auto buckets = fsdp::plan_buckets(bytes, grouping.bucket_bytes);
  for (const auto& [begin, end] : buckets) {
    const fsdp::FSDPPolicy& bucket_policy = end == layers.size() ? kept : policy;
    if (end - begin == 1) {
      fsdp::fully_shard(*layers[begin].second, mesh, bucket_policy, "layers." + layers[begin].first);
      continue;
    }
    std::vector<std::pair<std::string, nn::Module*>> blocks;
    for (size_t i = begin; i < end; ++i) blocks.emplace_back("layers." + layers[i].first, layers[i].second.get());
    fsdp::fully_shard(blocks, mesh, bucket_policy,
                      "layers." + layers[begin].first + ".." + layers[end - 1].first);
  }
  // The head's own group needs its weight used between output's hooks: the fused loss does that
  // unless a HeadLoss (loss parallel) or a parallel style on the output reads or wraps it.
  if (model.has_head() && model.has_output() && !model.has_head_loss() && !model.output().has_forward_hooks()) {
    fsdp::fully_shard({{"norm", &model.norm()}, {"output", &model.output()}}, mesh, kept, "head");
  }
  return fsdp::fully_shard(model, mesh, policy, "root");
}

std::shared_ptr<fsdp::FSDPModule> apply_fsdp(Decoder& model, const distributed::DeviceMesh& mesh,
                                             const fsdp::FSDPPolicy& policy, const FSDPGrouping& grouping) {
  return apply_fsdp(model, fsdp::make_fsdp_mesh(mesh, policy), policy, grouping);
}

namespace {

// Draws parameter `name`'s value into `piece`, this rank's part of it: the whole tensor drawn as
// init_weights(seed) would, then the box its slot's layout (TP, EP) gives this rank.
void draw_piece(Decoder& model, const std::map<std::string, tensor::TensorLayout>& layouts, const std::string& name,
                torch::Tensor& piece, uint64_t seed) {
  const auto it = layouts.find(name);
  if (it == layouts.end()) {
    nn::init_parameter(model.initializer(name), name, seed, piece);
    return;
  }
  torch::Tensor full = torch::empty(it->second.global_shape, piece.options());
  nn::init_parameter(model.initializer(name), name, seed, full);
  const tensor::Box box = it->second.local_box();
  torch::Tensor part = full;
  for (size_t d = 0; d < box.sizes.size(); ++d) part = part.narrow(static_cast<int64_t>(d), box.offsets[d], box.sizes[d]);
  torch::NoGradGuard no_grad;
  piece.copy_(part);
}

std::map<std::string, tensor::TensorLayout> slot_layouts(Decoder& model) {
  std::map<std::string, tensor::TensorLayout> layouts;
  for (const auto& p : model.named_parameters()) {
    if (p.slot->layout) layouts.emplace(p.name, *p.slot->layout);
  }
  return layouts;
}

}  // namespace

void init_sharded_weights(Decoder& model, fsdp::FSDPModule& fsdp, uint64_t seed, c10::Device device) {
  for (const auto& b : model.named_buffers()) {
    if (b.slot->tensor.is_meta()) {
      b.slot->tensor = torch::empty(b.slot->tensor.sizes(), b.slot->tensor.options().device(device));
    }
  }
  model.reset_buffers();
  const auto layouts = slot_layouts(model);
  fsdp.init_parameters([&](const std::string& name, torch::Tensor& full) { draw_piece(model, layouts, name, full, seed); });
}

void init_placed_weights(Decoder& model, uint64_t seed) {
  const auto layouts = slot_layouts(model);
  for (const auto& p : model.named_parameters()) draw_piece(model, layouts, p.name, p.slot->tensor, seed);
  model.reset_buffers();
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
                       const nn::TokenLayout& layout, const nn::AttendFeatures& features) {
          // Ring attention moves keys and values as one tensor: narrower value heads (MLA's) travel
          // zero-padded to the key width, and the padding's (zero) outputs are dropped.
          const int64_t v_dim = v.size(3), k_dim = k.size(3);
          const torch::Tensor values = v_dim == k_dim ? v : at::constant_pad_nd(v, {0, k_dim - v_dim});
          // [B, T, H, D] -> ring attention's [B, H, T, D] and back to [B, T, H * Dv].
          torch::Tensor out = cp::ring_attention(q.transpose(1, 2), k.transpose(1, 2), values.transpose(1, 2), comm,
                                                 method, layout.document_ids, features.sinks,
                                                 features.sliding_window);
          if (v_dim != k_dim) out = out.narrow(-1, 0, v_dim);
          return out.transpose(1, 2).reshape({q.size(0), q.size(1), q.size(2) * v_dim});
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
  //    Under TP the hooks quantize the weights' shards with the whole weights' scales, reduced
  //    over the tp group their layouts (set by step 2) name.
  if (options.float8) {
    float8::Float8Options float8 = *options.float8;
    if (dims.tp_enabled()) float8.sharding_groups[tp::kMeshDim] = mesh.comm(tp::kMeshDim);
    for (const auto& model : models) {
      const auto report = float8::convert_to_float8(*model, float8);
      log::info("float8: ", report.describe(options.float8->recipe));
    }
  }
  // 0b. LoRA: adapters on the targeted linears (their around-hooks chained after Float8's), the
  //     base frozen; the adapters' initialization joins the model's (A kaiming-uniform, B zero).
  if (options.lora) {
    for (const auto& model : models) {
      const auto report = lora::apply_lora(*model, *options.lora, options.lora_names, options.lora_whole_model);
      model->add_initializer(lora::adapter_init);
      log::info("lora: ", report.describe(), " (rank ", options.lora->rank, ", scaling ", options.lora->scaling(), ")");
    }
  }
  // 1. Expert parallelism: each MoE layer keeps its share of the routed experts (Shard(0) on "ep",
  //    in the slots' layouts) and sends its tokens to them by all-to-all. Before TP, whose
  //    token-wise MoE rule then leaves the experts' gradients alone (the dispatch completes them).
  std::shared_ptr<ep::ExpertParallel> ep;
  if (dims.ep_enabled()) {
    ep = std::make_shared<ep::ExpertParallel>(mesh.comm(ep::kMeshDim));
    int64_t layers = 0;
    for (const auto& model : models) {
      for (const auto& [fqn, layer] : moe_layers(*model)) {
        ep->apply(*layer, fqn);
        ++layers;
      }
    }
    LOOM_REQUIRE(layers > 0 || models.empty() || dims.pp_enabled(),
                 "expert parallelism on a model without MoE layers (refused by the model's validate_layout)");
    parts.synchronizers.push_back(std::make_shared<parallel::ExpertParallelSync>(ep));
  }
  // 2. Tensor parallelism: parameters become this rank's shards (still on the meta device, each
  //    slot carrying its layout); one plan records every part's parameters.
  std::shared_ptr<tp::TensorParallel> tp;
  if (dims.tp_enabled()) {
    tp = std::make_shared<tp::TensorParallel>(mesh.comm("tp"), options.tp.sequence_parallel, options.tp.async);
    for (const auto& model : models) apply_tp(*model, *tp, tp_plan, options.tp);
    parts.synchronizers.push_back(std::make_shared<parallel::TensorParallelSync>(tp));
  }
  // 3. Context parallelism: attention over the sequence chunks of the cp group (the batches carry
  //    each chunk's positions and documents to every part).
  if (dims.cp_enabled()) {
    const tensor::CommPtr cp = mesh.comm("cp");
    for (const auto& model : models) apply_cp(*model, cp, options.cp_rotate_method);
    parts.synchronizers.push_back(std::make_shared<parallel::ContextParallelSync>(cp));
  }
  // 4. Activation checkpointing: the blocks' forwards become checkpointed ones. Between TP/CP and
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
  // 5. FSDP over the TP-local parameters, or materialization; then every parameter from the seed
  //    by its global name (a part keeps the whole model's names, so each gets the whole model's
  //    values: each TP/EP rank its piece, each FSDP rank its shard of that). The cp ranks hold the
  //    same parameters and see different tokens: FSDP shards over dp_shard x cp (TorchTitan's
  //    dp_shard_cp), so its gradient average spans them. Under expert parallelism each MoE layer's
  //    experts are their own FSDP group over efsdp (the ranks of dp_shard x cp x tp that hold the
  //    same experts), created before their block's so the block leaves them out. Their gradients
  //    arrive summed over the ep ranks' tokens, so they are divided by the data-parallel degree
  //    (dp_replicate x dp_shard x cp) rather than by efsdp: the same mean as every other gradient.
  if (dims.fsdp_enabled()) {
    // Each model part is its own FSDP root (a pipeline rank's stages: PyTorch's pipelining does
    // the same); the meshes are made once, every rank in the same order.
    fsdp::FSDPPolicy policy = options.fsdp;
    if (dims.cp_enabled()) policy.shard_dim = "dp_shard_cp";
    std::optional<fsdp::FSDPPolicy> experts;
    std::optional<fsdp::FSDPMesh> experts_mesh;
    if (ep) {
      experts = policy;
      experts->shard_dim = "efsdp";
      experts->gradient_divide_factor = static_cast<double>(dims.dp_replicate()) * dims.dp_shard() * dims.cp();
      experts_mesh = fsdp::make_fsdp_mesh(mesh, *experts);
    }
    const fsdp::FSDPMesh fsdp_mesh = fsdp::make_fsdp_mesh(mesh, policy);
    std::vector<std::shared_ptr<fsdp::FSDPModule>> roots;
    for (const auto& model : models) {
      if (experts) {
        fsdp::FSDPPolicy part_experts = *experts;
        const auto layers = moe_layers(*model);
        if (!layers.empty() && layers.front().second->experts().w1().size(0) % dims.efsdp() == 0) {
          // Whole experts per rank where they divide evenly (veScale's structure-aware planning).
          part_experts.granularity = tensor::Granularity::row();
        }
        const std::string last_block = model->layers().named_children().empty()
                                           ? std::string()
                                           : "layers." + model->layers().named_children().back().first + ".";
        for (const auto& [fqn, layer] : layers) {
          fsdp::FSDPPolicy layer_policy = part_experts;
          if (!options.fsdp_reshard_last_block && fqn.rfind(last_block, 0) == 0) {
            layer_policy.reshard_after_forward = fsdp::ReshardAfterForward::never();
          }
          fsdp::fully_shard(layer->experts(), *experts_mesh, layer_policy, fqn + ".experts");
        }
      }
      if (options.lora) {
        // Each adapter is its own (trainable) group, so the frozen base groups carry no gradient
        // and no optimizer state.
        for (const auto& [path, module] : model->named_modules()) {
          if (dynamic_cast<lora::Adapter*>(module) != nullptr) fsdp::fully_shard(*module, fsdp_mesh, policy, path);
        }
      }
      auto root = apply_fsdp(*model, fsdp_mesh, policy,
                             FSDPGrouping{.reshard_last_block = options.fsdp_reshard_last_block,
                                          .bucket_bytes = options.fsdp_bucket_bytes});
      init_sharded_weights(*model, *root, options.seed, options.device);
      roots.push_back(std::move(root));
    }
    // One queue of in-flight reductions for the rank's roots: HSDP's all-reduces in one order.
    if (roots.size() > 1) fsdp::FSDPModule::share_reductions(roots);
    std::vector<tensor::CommPtr> shard_comms{fsdp_mesh.shard};
    if (experts_mesh) shard_comms.push_back(experts_mesh->shard);
    parts.storage = std::make_unique<parallel::FsdpParameters>(fsdp::FSDPRoots(roots), std::move(shard_comms));
    parts.synchronizers.push_back(
        std::make_shared<parallel::FsdpSync>(fsdp::FSDPRoots(roots), options.fsdp_accumulate_unsharded));
  } else {
    for (const auto& model : models) {
      model->to_empty(options.device);
      if (tp || ep) {
        init_placed_weights(*model, options.seed);
      } else {
        model->init_weights(options.seed);
      }
    }
  }
  // 6. MoE load balancing: the selection biases move after each step's last backward, from the
  //    token counts of every rank that routed a share of the batch through the same layers.
  std::vector<std::pair<std::string, moe::MoE*>> balanced;
  for (const auto& model : models) {
    for (auto& layer : balanced_moe_layers(*model)) balanced.push_back(layer);
  }
  if (!balanced.empty()) {
    std::vector<tensor::CommPtr> comms;
    if (dims.dp_cp_enabled()) comms.push_back(mesh.comm("dp_cp"));
    if (dims.tp_enabled()) comms.push_back(mesh.comm("tp"));
    // Under LoRA the base is frozen, its selection biases included: PEFT exports and restores only
    // the adapters, and adapters scored over one base must all see the base's routing.
    parts.synchronizers.push_back(
        std::make_shared<MoEBalanceSync>(std::move(balanced), std::move(comms), /*update_biases=*/!options.lora));
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
  // 7. Without sharding, replicas average their gradients in backward (DDP's buckets).
  if (!dims.fsdp_enabled() && dims.dp_replicate_enabled()) {
    parts.synchronizers.push_back(std::make_shared<parallel::DdpSync>(
        std::make_unique<ddp::DataParallel>(*model, mesh.comm("dp_replicate"))));
  }
  return std::make_unique<parallel::ParallelizedModel>(std::move(parts));
}

}  // namespace loom::models
