#include "loom/models/llama3/parallelize.h"

#include "loom/core/autocast.h"
#include "loom/core/error.h"
#include "loom/core/logging.h"
#include "loom/nn/init.h"

namespace loom::llama3 {

FSDPReshardSetting FSDPReshardSetting::parse(const std::string& text) {
  if (text == "default") return {fsdp::ReshardAfterForward::always(), false};
  if (text == "always") return {fsdp::ReshardAfterForward::always(), true};
  if (text == "never") return {fsdp::ReshardAfterForward::never(), true};
  const bool digits = !text.empty() && text.find_first_not_of("0123456789") == std::string::npos;
  LOOM_REQUIRE_USAGE(digits, "parallelism.fsdp_reshard_after_forward '", text,
                     "' is not one of default, always, never or a positive integer");
  return {fsdp::ReshardAfterForward::parse(text), true};
}

std::shared_ptr<fsdp::FSDPModule> apply_fsdp(Transformer& model, const fsdp::FSDPMesh& mesh,
                                             const fsdp::FSDPPolicy& policy,
                                             bool reshard_last_block) {
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

std::shared_ptr<fsdp::FSDPModule> apply_fsdp(Transformer& model, const distributed::DeviceMesh& mesh,
                                             const fsdp::FSDPPolicy& policy,
                                             bool reshard_last_block) {
  return apply_fsdp(model, fsdp::make_fsdp_mesh(mesh, policy), policy, reshard_last_block);
}

void init_sharded_weights(Transformer& model, fsdp::FSDPModule& fsdp, uint64_t seed,
                          c10::Device device, const tp::TensorParallel* tp) {
  for (const auto& b : model.named_buffers()) {
    if (b.slot->tensor.is_meta()) {
      b.slot->tensor = torch::empty(b.slot->tensor.sizes(), b.slot->tensor.options().device(device));
    }
  }
  model.reset_buffers();
  const ModelArgs& args = model.args();
  auto draw = [&](const std::string& name, torch::Tensor& full) {
    nn::init_parameter(parameter_init(args, name), name, seed, full);
  };
  fsdp.init_parameters([&](const std::string& name, torch::Tensor& full) {
    if (tp != nullptr) {
      tp->init_local(name, full, draw);
    } else {
      draw(name, full);
    }
  });
}

namespace {

// The degrees up to 2x `degree` that divide every size, for the error message.
std::string divisors_near(const std::vector<int64_t>& sizes, int64_t degree) {
  std::string out;
  for (int64_t d = 1; d <= std::max<int64_t>(8, 2 * degree); ++d) {
    bool ok = true;
    for (int64_t s : sizes) ok = ok && s % d == 0;
    if (ok) out += c10::str(out.empty() ? "" : ", ", d);
  }
  return out;
}

}  // namespace

void validate_tp_degree(const ModelArgs& args, int64_t degree, int64_t seq_len, const TensorParallelOptions& options) {
  LOOM_REQUIRE_USAGE(degree >= 1, "parallelism.tensor_parallel_degree must be >= 1, got ", degree);
  LOOM_REQUIRE_USAGE(!options.async || options.sequence_parallel,
                     "parallelism.enable_async_tensor_parallel needs sequence parallelism (it overlaps the "
                     "sequence all-gathers and reduce-scatters); set parallelism.disable_sequence_parallel = false");
  if (degree == 1) return;
  std::vector<int64_t> sizes = {args.n_heads, args.n_kv_heads, args.ffn_hidden_dim(), args.vocab_size};
  const char* names[] = {"n_heads", "n_kv_heads", "the FFN hidden size", "the vocabulary size"};
  if (options.sequence_parallel) sizes.push_back(seq_len);
  for (size_t i = 0; i < sizes.size(); ++i) {
    const std::string what = i < 4 ? std::string(names[i]) + " of the model" : "training.seq_len (sequence parallel)";
    LOOM_REQUIRE_USAGE(sizes[i] % degree == 0, "parallelism.tensor_parallel_degree = ", degree,
                       " does not divide ", what, " (", sizes[i], "); degrees that split this model: ",
                       divisors_near(sizes, degree),
                       i == 3 ? " (or pad the vocabulary with model.vocab_size)" : "");
  }
}

std::shared_ptr<tp::TensorParallel> apply_tp(Transformer& model, tensor::CommPtr comm,
                                             const TensorParallelOptions& options) {
  auto tp = std::make_shared<tp::TensorParallel>(std::move(comm), options.sequence_parallel, options.async);
  apply_tp(model, *tp, options);
  return tp;
}

void apply_tp(Transformer& model, tp::TensorParallel& plan, const TensorParallelOptions& options) {
  tp::TensorParallel* tp = &plan;
  // A pipeline stage holds the embedding only on the first stage and the head only on the last.
  if (model.has_embedding()) tp->rowwise_embedding(model.tok_embeddings(), "tok_embeddings");
  for (const auto& [id, layer] : model.layers().named_children()) {
    auto& block = static_cast<TransformerBlock&>(*layer);
    const std::string prefix = "layers." + id + ".";
    tp->sequence_parallel(block.attention_norm(), prefix + "attention_norm");
    auto& attention = block.attention();
    tp->prepare_input(attention, {&attention.wq(), &attention.wk(), &attention.wv()});
    tp->colwise(block.attention().wq(), prefix + "attention.wq");
    tp->colwise(block.attention().wk(), prefix + "attention.wk");
    tp->colwise(block.attention().wv(), prefix + "attention.wv");
    tp->rowwise(block.attention().wo(), prefix + "attention.wo");
    tp->sequence_parallel(block.ffn_norm(), prefix + "ffn_norm");
    auto& ffn = block.feed_forward();
    tp->prepare_input(ffn, {&ffn.w1(), &ffn.w3()});
    tp->colwise(block.feed_forward().w1(), prefix + "feed_forward.w1");
    tp->colwise(block.feed_forward().w3(), prefix + "feed_forward.w3");
    tp->rowwise(block.feed_forward().w2(), prefix + "feed_forward.w2");
  }
  if (!model.has_head()) return;
  tp->sequence_parallel(model.norm(), "norm");
  tp->colwise_output(model.output(), "output", options.loss_parallel);
  if (options.loss_parallel) {
    const tensor::CommPtr& group = tp->comm();
    const bool sp = options.sequence_parallel;
    model.set_head_loss([group, sp](const torch::Tensor& hidden, nn::Linear& output, const torch::Tensor& labels) {
      // The head's input as colwise needs it (every token on every rank); the gather's backward
      // sums the ranks' partial gradients of it.
      const torch::Tensor full = sp ? tensor::all_gather(hidden, tp::kSequenceDim, group,
                                                         tensor::ReplicatedGrad::kPartial)
                                    : tensor::all_reduce_in_backward(hidden, group);
      const torch::Tensor& weight = output.weight();
      return tp::vocab_parallel_cross_entropy(full.flatten(0, 1), weight, labels.flatten(0, 1),
                                              weight.size(0) * group->rank(), group);
    });
  }
}

int64_t apply_ac(Transformer& model, const ac::ACOptions& options) {
  int64_t wrapped = 0;
  for (const auto& [id, layer] : model.layers().named_children()) {
    auto& block = static_cast<TransformerBlock&>(*layer);
    if (!options.wraps(block.layer_id())) continue;
    ac::checkpoint_module(block, options.per_op);
    ++wrapped;
  }
  return wrapped;
}

void apply_cp(Transformer& model, tensor::CommPtr comm, cp::RotateMethod method) {
  for (const auto& [id, layer] : model.layers().named_children()) {
    static_cast<TransformerBlock&>(*layer).attention().set_attend(
        [comm, method](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       const nn::TokenLayout& layout) {
          // [B, T, H, D] -> ring attention's [B, H, T, D] and back to [B, T, H * D].
          const torch::Tensor out = cp::ring_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                       comm, method, layout.document_ids);
          return out.transpose(1, 2).reshape({q.size(0), q.size(1), q.size(2) * q.size(3)});
        });
  }
}

parallel::ParallelParts compose(const std::vector<std::shared_ptr<Transformer>>& models,
                                const distributed::ParallelDims& dims, const distributed::DeviceMesh& mesh,
                                const PlanOptions& options) {
  parallel::ParallelParts parts;
  for (const auto& model : models) parts.modules.push_back(model);
  // 0. Float8: the linears' GEMMs become float8 ones (an around-hook on each converted linear; the
  //    parameters stay high precision), before any parallelism as TorchTitan's model converters.
  //    So FSDP below gathers high-precision weights the hooks quantize, and AC recomputes them.
  if (options.float8) {
    LOOM_REQUIRE(!dims.tp_enabled() && !dims.pp_enabled(),
                 "float8 with tensor or pipeline parallelism is refused by the model's spec");
    for (const auto& model : models) {
      const auto report = float8::convert_to_float8(*model, *options.float8);
      log::info("float8: ", report.describe(options.float8->recipe));
    }
  }
  // 1. Tensor parallelism: parameters become this rank's shards (still on the meta device); one
  //    plan records every part's parameters.
  if (dims.tp_enabled()) {
    parts.tp = std::make_shared<tp::TensorParallel>(mesh.comm("tp"), options.tp.sequence_parallel, options.tp.async);
    for (const auto& model : models) apply_tp(*model, *parts.tp, options.tp);
  }
  // 2. Context parallelism: attention over the sequence chunks of the cp group (the batches carry
  //    each chunk's positions and documents to every part).
  if (dims.cp_enabled()) {
    parts.cp = mesh.comm("cp");
    for (const auto& model : models) apply_cp(*model, parts.cp, options.cp_rotate_method);
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
    parts.fsdp = apply_fsdp(*models[0], mesh, policy, options.fsdp_reshard_last_block);
    init_sharded_weights(*models[0], *parts.fsdp, options.seed, options.device, parts.tp.get());
  } else {
    for (const auto& model : models) {
      model->to_empty(options.device);
      if (parts.tp) {
        init_tp_weights(*model, *parts.tp, options.seed);
      } else {
        model->init_weights(options.seed);
      }
    }
  }
  return parts;
}

std::unique_ptr<parallel::ParallelizedModel> parallelize(std::shared_ptr<Transformer> model,
                                                         const distributed::ParallelDims& dims,
                                                         const distributed::DeviceMesh& mesh,
                                                         const PlanOptions& options) {
  parallel::ParallelParts parts = compose({model}, dims, mesh, options);
  Transformer* raw = model.get();
  const auto autocast = options.autocast_dtype;
  const c10::Device device = options.device;
  parts.forward_loss = [raw, autocast, device](const parallel::ModelBatch& batch) {
    // Autocast covers the forward only; backward runs each op in the dtype its forward used.
    AutocastScope scope(device, autocast);
    return raw->forward_loss(batch.tokens, batch.labels, batch.layout);
  };
  // 5. Without sharding, replicas average their gradients in backward (DDP's buckets).
  if (!parts.fsdp && dims.dp_replicate_enabled()) {
    parts.ddp = std::make_unique<ddp::DataParallel>(*model, mesh.comm("dp_replicate"));
  }
  return std::make_unique<parallel::ParallelizedModel>(std::move(parts));
}

void init_tp_weights(Transformer& model, const tp::TensorParallel& tp, uint64_t seed) {
  const ModelArgs& args = model.args();
  for (const auto& p : model.named_parameters()) {
    tp.init_local(p.name, p.slot->tensor, [&](const std::string& name, torch::Tensor& full) {
      nn::init_parameter(parameter_init(args, name), name, seed, full);
    });
  }
  model.reset_buffers();
}

std::map<distributed::CommOp, distributed::CommCounter> tp_comm_volume(const ModelArgs& args, int64_t batch, int64_t seq,
                                                         int degree, const TensorParallelOptions& options,
                                                         int64_t element_bytes, int64_t chunk_tokens) {
  std::map<distributed::CommOp, distributed::CommCounter> volume;
  if (degree <= 1) return volume;
  auto add = [&](distributed::CommOp op, int64_t calls, int64_t payload_each) {
    distributed::CommCounter& c = volume[op];
    c.calls += calls;
    c.payload_bytes += calls * payload_each;
    for (int64_t i = 0; i < calls; ++i) c.wire_bytes += distributed::ring_wire_bytes(op, payload_each, degree);
  };
  using distributed::CommOp;
  const int64_t L = args.n_layers, tokens = batch * seq;
  const int64_t activation = tokens * args.dim * element_bytes;  // one [b, s, h] tensor, whole
  if (options.sequence_parallel) {
    // Per block: forward gathers the sequence before attention and the FFN and reduce-scatters
    // after wo and w2; backward does the opposite of each. The embedding reduce-scatters (backward:
    // gathers) and the head gathers (backward: reduce-scatters).
    const int64_t block_collectives = options.async ? 0 : 4 * L;
    add(CommOp::kAllGather, block_collectives + 2, activation);
    add(CommOp::kReduceScatter, block_collectives + 2, activation);
    if (options.async) {
      // The blocks' 8 L gathers and reduce-scatters as rings of collective matmuls: each passes
      // t-1 chunks of 1/t of the activation to the next rank and receives as many, the same wire
      // bytes as the ring collective it replaces.
      add(CommOp::kSend, 8 * L * (degree - 1), activation / degree);
      add(CommOp::kRecv, 8 * L * (degree - 1), activation / degree);
    }
    // Once per step: the SP norms' gradients (2 per block + the final norm), fp32.
    add(CommOp::kAllReduce, 1, (2 * L + 1) * args.dim * 4);
  } else {
    // Per block: all-reduce after wo and w2, and of the input gradients of attention and the FFN;
    // the embedding's output, and the head input's gradient.
    add(CommOp::kAllReduce, 4 * L + 2, activation);
  }
  if (options.loss_parallel) {
    // Per chunk of tokens: the row max [n], then sum-exp and target logit [2, n], fp32.
    for (int64_t begin = 0; begin < tokens; begin += chunk_tokens) {
      const int64_t n = std::min(chunk_tokens, tokens - begin);
      add(CommOp::kAllReduce, 1, n * 4);
      add(CommOp::kAllReduce, 1, 2 * n * 4);
    }
  } else {
    // The vocabulary-sharded logits gathered for the plain loss (backward keeps the local piece).
    add(CommOp::kAllGather, 1, tokens * args.vocab_size * element_bytes);
  }
  return volume;
}

}  // namespace loom::llama3
