#include "loom/models/common/tp_plan.h"

#include "loom/models/common/parallelize.h"

#include "loom/core/error.h"
#include "loom/nn/init.h"

namespace loom::models {
namespace {

std::vector<std::string> segments(const std::string& path) {
  std::vector<std::string> out;
  size_t begin = 0;
  while (true) {
    const size_t dot = path.find('.', begin);
    out.push_back(path.substr(begin, dot == std::string::npos ? std::string::npos : dot - begin));
    if (dot == std::string::npos) return out;
    begin = dot + 1;
  }
}

template <typename M>
M& as(nn::Module& module, const std::string& fqn, const char* what) {
  auto* typed = dynamic_cast<M*>(&module);
  LOOM_REQUIRE(typed != nullptr, "the TP plan applies a ", what, " style to '", fqn, "', which is a ",
               module.type_name());
  return *typed;
}

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

const TPPlan& transformer_tp_plan() {
  static const TPPlan plan = {
      {"tok_embeddings", TPStyle::kRowwiseEmbedding},
      {"layers.*.attention_norm", TPStyle::kSequenceParallel},
      {"layers.*.attention", TPStyle::kPrepareInput, {"wq", "wk", "wv"}},
      {"layers.*.attention.wq", TPStyle::kColwise},
      {"layers.*.attention.wk", TPStyle::kColwise},
      {"layers.*.attention.wv", TPStyle::kColwise},
      {"layers.*.attention.wo", TPStyle::kRowwise},
      {"layers.*.attention.q_norm", TPStyle::kReplicatePartialGrad},
      {"layers.*.attention.k_norm", TPStyle::kReplicatePartialGrad},
      {"layers.*.attention.sinks", TPStyle::kHeadwise},
      {"layers.*.ffn_norm", TPStyle::kSequenceParallel},
      {"layers.*.feed_forward", TPStyle::kPrepareInput, {"w1", "w3"}},
      {"layers.*.feed_forward.w1", TPStyle::kColwise},
      {"layers.*.feed_forward.w3", TPStyle::kColwise},
      {"layers.*.feed_forward.w2", TPStyle::kRowwise},
      {"norm", TPStyle::kSequenceParallel},
      {"output", TPStyle::kColwiseOutput},
  };
  return plan;
}

const TPRule* match_tp_rule(const TPPlan& plan, const std::string& fqn) {
  const std::vector<std::string> parts = segments(fqn);
  for (const TPRule& rule : plan) {
    const std::vector<std::string> pattern = segments(rule.pattern);
    if (pattern.size() != parts.size()) continue;
    bool match = true;
    for (size_t i = 0; i < parts.size() && match; ++i) match = pattern[i] == "*" || pattern[i] == parts[i];
    if (match) return &rule;
  }
  return nullptr;
}

void apply_tp(Decoder& model, tp::TensorParallel& tp, const TPPlan& plan, const TensorParallelOptions& options) {
  for (const auto& [fqn, module] : model.named_modules()) {
    const TPRule* rule = fqn.empty() ? nullptr : match_tp_rule(plan, fqn);
    if (rule == nullptr) continue;
    switch (rule->style) {
      case TPStyle::kColwise: tp.colwise(as<nn::Linear>(*module, fqn, "colwise"), fqn); break;
      case TPStyle::kRowwise: tp.rowwise(as<nn::Linear>(*module, fqn, "rowwise"), fqn); break;
      case TPStyle::kRowwiseEmbedding:
        tp.rowwise_embedding(as<nn::Embedding>(*module, fqn, "rowwise embedding"), fqn);
        break;
      case TPStyle::kSequenceParallel:
        tp.sequence_parallel(as<nn::RMSNorm>(*module, fqn, "sequence-parallel"), fqn);
        break;
      case TPStyle::kPrepareInput: {
        std::vector<nn::Linear*> consumers;
        for (const std::string& child : rule->consumers) {
          consumers.push_back(&as<nn::Linear>(module->submodule(child), fqn + "." + child, "prepared consumer"));
        }
        tp.prepare_input(*module, consumers);
        break;
      }
      case TPStyle::kColwiseOutput:
        tp.colwise_output(as<nn::Linear>(*module, fqn, "colwise output"), fqn, options.loss_parallel);
        break;
      case TPStyle::kReplicatePartialGrad: tp.replicate_partial_grad(*module, fqn); break;
      case TPStyle::kTokenwise:
        if (options.sequence_parallel) tp.replicate_partial_grad(*module, fqn);
        break;
      case TPStyle::kHeadwise:
        LOOM_REQUIRE(false, "the TP plan's headwise rule '", rule->pattern, "' names the module '", fqn,
                     "'; it must name a parameter");
    }
  }
  // The headwise rules name parameters: each matched one is sharded on its module.
  TPPlan headwise;
  for (const TPRule& rule : plan) {
    if (rule.style == TPStyle::kHeadwise) headwise.push_back(rule);
  }
  if (!headwise.empty()) {
    std::vector<std::string> names;
    for (const auto& p : model.named_parameters()) {
      if (match_tp_rule(headwise, p.name) != nullptr) names.push_back(p.name);
    }
    for (const std::string& name : names) {
      const size_t dot = name.rfind('.');
      const std::string path = dot == std::string::npos ? "" : name.substr(0, dot);
      nn::Module& owner = path.empty() ? static_cast<nn::Module&>(model) : model.submodule(path);
      tp.headwise(owner, path, dot == std::string::npos ? name : name.substr(dot + 1));
    }
  }
  if (!model.has_head() || !options.loss_parallel) return;
  const tensor::CommPtr& group = tp.comm();
  const bool sp = options.sequence_parallel;
  model.set_head_loss([group, sp](const torch::Tensor& hidden, const torch::Tensor& weight, const torch::Tensor& labels) {
    // The head's input as colwise needs it (every token on every rank); the gather's backward
    // sums the ranks' partial gradients of it.
    const torch::Tensor full = sp ? tensor::all_gather(hidden, tp::kSequenceDim, group, tensor::ReplicatedGrad::kPartial)
                                  : tensor::all_reduce_in_backward(hidden, group);
    return tp::vocab_parallel_cross_entropy(full.flatten(0, 1), weight, labels.flatten(0, 1),
                                            weight.size(0) * group->rank(), group);
  });
}

std::shared_ptr<tp::TensorParallel> apply_tp(Decoder& model, tensor::CommPtr comm, const TPPlan& plan,
                                             const TensorParallelOptions& options) {
  auto tp = std::make_shared<tp::TensorParallel>(std::move(comm), options.sequence_parallel, options.async);
  apply_tp(model, *tp, plan, options);
  return tp;
}

void init_tp_weights(Decoder& model, const tp::TensorParallel& /*tp*/, uint64_t seed) {
  // The plan recorded each shard's layout in its slot.
  init_placed_weights(model, seed);
}

void validate_tp_degree(const DecoderArgs& args, int64_t degree, int64_t seq_len, const TensorParallelOptions& options) {
  LOOM_REQUIRE_USAGE(degree >= 1, "parallelism.tensor_parallel_degree must be >= 1, got ", degree);
  if (degree == 1) return;
  std::vector<int64_t> sizes = {args.n_heads, args.n_kv_heads, args.ffn_hidden_dim(), args.vocab_size};
  const char* names[] = {"n_heads", "n_kv_heads", "the FFN hidden size", "the vocabulary size"};
  if (options.sequence_parallel) sizes.push_back(seq_len);
  for (size_t i = 0; i < sizes.size(); ++i) {
    const std::string what = i < 4 ? std::string(names[i]) + " of the model" : "training.seq_len (sequence parallel)";
    LOOM_REQUIRE_USAGE(sizes[i] % degree == 0, "parallelism.tensor_parallel_degree = ", degree,
                       " does not divide ", what, " (", sizes[i], "); degrees that split this model: ",
                       divisors_near(sizes, degree), i == 3 ? " (or pad the vocabulary with model.vocab_size)" : "");
  }
  // A tied head is the rowwise embedding's vocabulary shard: only loss parallel reads it as such.
  LOOM_REQUIRE_USAGE(!args.tie_embeddings || options.loss_parallel,
                     "this model ties its output head to the token embedding, which tensor parallelism "
                     "shards by vocabulary; set parallelism.disable_loss_parallel = false");
}

std::map<distributed::CommOp, distributed::CommCounter> tp_comm_volume(const DecoderArgs& args, int64_t batch,
                                                                       int64_t seq, int degree,
                                                                       const TensorParallelOptions& options,
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
  // Once per step, fp32: the gradients each rank holds only part of. The SP norms (2 per block +
  // the final norm) and the QK-norms (2 per block, which see this rank's heads with or without SP).
  // Under SP also the replicated biases of the rowwise wo (added once after the reduce-scatter, to
  // this rank's tokens only).
  int64_t rowwise_biases = 0;
  for (int64_t l = 0; l < L; ++l) rowwise_biases += args.attention_options(l).bias ? args.dim : 0;
  const int64_t partial_elements = (options.sequence_parallel ? (2 * L + 1) * args.dim + rowwise_biases : 0) +
                                   (args.qk_norm ? 2 * L * args.head_dim() : 0);
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
  } else {
    // Per block: all-reduce after wo and w2, and of the input gradients of attention and the FFN;
    // the embedding's output, and the head input's gradient.
    add(CommOp::kAllReduce, 4 * L + 2, activation);
  }
  if (partial_elements > 0) add(CommOp::kAllReduce, 1, partial_elements * 4);
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

}  // namespace loom::models
