// Per-rank scenarios of the tensor-parallel tests, started as
//   loom launch --nproc N --exec -- loom_tp_worker <scenario>
// Every rank builds the single-process Llama (the reference) and the same model under the TP plan
// (models::apply_tp with llama3::tp_plan) from the same seed, runs forward_loss and backward on the same batch, and
// compares the loss and every parameter's gradient (this rank's shard of it) with the reference's,
// for sequence parallel and loss parallel on and off (and async TP, with SP), then takes a few SGD steps and compares the
// losses again. Exits 1 with one line naming the rank, configuration and mismatch.
#include <cstdio>
#include <string>

#include "loom/core/error.h"
#include "loom/models/common/parallelize.h"
#include "loom/models/llama3/spec.h"
#include "loom/testing/worker.h"

namespace {

using namespace loom;

llama3::ModelArgs tiny_args() {
  llama3::ModelArgs a;
  a.dim = 64, a.n_layers = 2, a.n_heads = 8, a.n_kv_heads = 4, a.vocab_size = 96;
  a.multiple_of = 32, a.max_seq_len = 16, a.rope_theta = 10000.0;
  return a;  // ffn hidden 192
}

double max_relative_diff(const torch::Tensor& a, const torch::Tensor& b) {
  const double scale = std::max(b.abs().max().item<double>(), 1e-12);
  return (a - b).abs().max().item<double>() / scale;
}

// This rank's piece of `full` under the plan's layout of `name`.
torch::Tensor local_piece(const tp::TensorParallel& plan, const std::string& name, const torch::Tensor& full) {
  const tensor::Box box = plan.layout_of(name, full.sizes().vec()).local_box();
  torch::Tensor piece = full;
  for (size_t d = 0; d < box.sizes.size(); ++d) piece = piece.narrow(static_cast<int64_t>(d), box.offsets[d], box.sizes[d]);
  return piece;
}

void check_configuration(const tensor::CommPtr& comm, bool sp, bool loss_parallel, bool async = false) {
  const std::string config =
      c10::str("tp=", comm->size(), " sp=", sp, " loss_parallel=", loss_parallel, async ? " async" : "");
  const llama3::ModelArgs args = tiny_args();
  constexpr uint64_t kSeed = 7;
  llama3::Transformer reference(args);
  reference.init_weights(kSeed);
  llama3::Transformer model(args, torch::TensorOptions().device(torch::kMeta));
  const models::TensorParallelOptions options{sp, loss_parallel, async};
  models::validate_tp_degree(args, comm->size(), 16, options);
  auto plan = models::apply_tp(model, comm, llama3::tp_plan(), options);
  model.to_empty(torch::kCPU);
  models::init_tp_weights(model, *plan, kSeed);

  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  const torch::Tensor tokens = torch::randint(0, args.vocab_size, {3, 16}, gen);
  torch::Tensor labels = torch::randint(0, args.vocab_size, {3, 16}, gen);
  labels.index_put_({0, 3}, -100);  // an ignored position

  auto ref_params = reference.named_parameters();
  auto params = model.named_parameters();
  LOOM_REQUIRE(ref_params.size() == params.size(), config, ": parameter lists differ");
  for (size_t i = 0; i < params.size(); ++i) {
    LOOM_REQUIRE(torch::equal(params[i].tensor(), local_piece(*plan, params[i].name, ref_params[i].tensor())),
                 config, ": initial ", params[i].name, " is not the reference's shard");
  }
  constexpr double kLr = 0.05;
  for (int step = 0; step < 3; ++step) {
    reference.zero_grad();
    model.zero_grad();
    const torch::Tensor ref_loss = reference.forward_loss(tokens, labels);
    distributed::comm_stats().reset();
    const torch::Tensor loss = model.forward_loss(tokens, labels);
    ref_loss.backward();
    loss.backward();
    std::vector<torch::Tensor> partial;
    for (const auto& name : plan->partial_gradient_parameters()) partial.push_back(model.parameter_slot(name).tensor.grad());
    plan->sum_partial_gradients(partial);
    // What went over the group equals the documented formula, call for call and byte for byte.
    const distributed::CommSnapshot sent = distributed::comm_stats().snapshot();
    const auto expected = models::tp_comm_volume(args, tokens.size(0), tokens.size(1), comm->size(), options);
    for (auto op : {distributed::CommOp::kAllGather, distributed::CommOp::kReduceScatter, distributed::CommOp::kAllReduce,
                    distributed::CommOp::kSend, distributed::CommOp::kRecv}) {
      const distributed::CommCounter got = sent.get(op, comm->name());
      const auto it = expected.find(op);
      const distributed::CommCounter want = it == expected.end() ? distributed::CommCounter{} : it->second;
      LOOM_REQUIRE(got.calls == want.calls && got.payload_bytes == want.payload_bytes && got.wire_bytes == want.wire_bytes,
                   config, ": ", distributed::to_string(op), " sent ", got.calls, " calls, ", got.payload_bytes,
                   " payload bytes, ", got.wire_bytes.value(), " wire bytes; the formula says ", want.calls, ", ",
                   want.payload_bytes, ", ", want.wire_bytes.value());
    }
    LOOM_REQUIRE(sent.total().calls == sent.total_for_dim(comm->name()).calls, config,
                 ": collectives outside the tp group: ", sent.format());
    const double loss_diff = std::abs(loss.item<double>() - ref_loss.item<double>()) / ref_loss.item<double>();
    LOOM_REQUIRE(loss_diff <= 1e-6, config, " step ", step, ": loss ", loss.item<double>(), " vs reference ",
                 ref_loss.item<double>());
    double worst = 0;
    std::string worst_name;
    for (size_t i = 0; i < params.size(); ++i) {
      const torch::Tensor& g = params[i].tensor().grad();
      LOOM_REQUIRE(g.defined(), config, ": no gradient for ", params[i].name);
      const double d = max_relative_diff(g, local_piece(*plan, params[i].name, ref_params[i].tensor().grad()));
      if (d > worst) worst = d, worst_name = params[i].name;
    }
    LOOM_REQUIRE(worst <= 1e-5, config, " step ", step, ": gradient of ", worst_name,
                 " differs by ", worst, " (relative to its largest element)");
    if (comm->rank() == 0) {
      std::printf("%s step %d: loss %.7f (reference %.7f), worst gradient difference %.2e (%s)\n", config.c_str(),
                  step, loss.item<double>(), ref_loss.item<double>(), worst, worst_name.c_str());
    }
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].slot->tensor.sub_(params[i].tensor().grad(), kLr);
      ref_params[i].slot->tensor.sub_(ref_params[i].tensor().grad(), kLr);
    }
  }
}

// GPT-OSS's attention under the shared TransformerBlock plan: sinks (headwise, Shard(0)), biased
// wq, wk, wv (sharded with their outputs) and wo (replicated, added once after the reduction), a
// sliding window on layer 0. The family itself comes later; this decoder turns the options on.
struct SinkArgs : llama3::ModelArgs {
  nn::AttentionOptions attention_options(int64_t layer_id) const override {
    nn::AttentionOptions o = llama3::ModelArgs::attention_options(layer_id);
    o.sinks = true;
    o.bias = true;
    o.sliding_window = layer_id == 0 ? 5 : 0;
    return o;
  }
};

class SinkDecoder : public models::Decoder {
 public:
  SinkDecoder(const SinkArgs& args, const torch::TensorOptions& options)
      : models::Decoder("SinkDecoder", std::make_shared<const SinkArgs>(args),
                        [](int64_t id, const models::DecoderArgs& a, const torch::TensorOptions& o) {
                          return std::make_shared<models::TransformerBlock>(id, a, o);
                        },
                        options),
        args_(args) {}
  nn::ParameterInit parameter_init(const std::string& name) const override {
    auto ends_with = [&](std::string_view suffix) {
      return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
    };
    if (ends_with(".attention.sinks")) return nn::ParameterInit::normal(1.0);
    if (ends_with(".bias")) return nn::ParameterInit::normal(0.1);
    return llama3::parameter_init(args_, name);
  }

 private:
  SinkArgs args_;
};

void check_attention_features(const tensor::CommPtr& comm, bool sp) {
  const std::string config = c10::str("tp=", comm->size(), " sp=", sp, " sinks+bias+window");
  SinkArgs args;
  static_cast<llama3::ModelArgs&>(args) = tiny_args();
  constexpr uint64_t kSeed = 7;
  SinkDecoder reference(args, torch::TensorOptions());
  reference.init_weights(kSeed);
  SinkDecoder model(args, torch::TensorOptions().device(torch::kMeta));
  const models::TensorParallelOptions options{sp, true, false};
  auto plan = models::apply_tp(model, comm, models::transformer_tp_plan(), options);
  model.to_empty(torch::kCPU);
  models::init_tp_weights(model, *plan, kSeed);
  // The placements: sinks and the colwise biases split by heads, wo's bias whole.
  const int t = comm->size();
  for (const char* name : {"layers.0.attention.sinks", "layers.1.attention.wq.bias", "layers.1.attention.wk.bias",
                           "layers.1.attention.wv.bias"}) {
    LOOM_REQUIRE(plan->is_sharded(name), config, ": ", name, " is not sharded");
  }
  LOOM_REQUIRE(!plan->is_sharded("layers.0.attention.wo.bias"), config, ": wo.bias is sharded");
  LOOM_REQUIRE(model.parameter("layers.0.attention.sinks").size(0) == args.n_heads / t, config, ": sinks shard is ",
               model.parameter("layers.0.attention.sinks").sizes());

  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  const torch::Tensor tokens = torch::randint(0, args.vocab_size, {3, 16}, gen);
  const torch::Tensor labels = torch::randint(0, args.vocab_size, {3, 16}, gen);
  auto ref_params = reference.named_parameters();
  auto params = model.named_parameters();
  LOOM_REQUIRE(ref_params.size() == params.size(), config, ": parameter lists differ");
  for (size_t i = 0; i < params.size(); ++i) {
    LOOM_REQUIRE(torch::equal(params[i].tensor(), local_piece(*plan, params[i].name, ref_params[i].tensor())),
                 config, ": initial ", params[i].name, " is not the reference's shard");
  }
  const torch::Tensor ref_loss = reference.forward_loss(tokens, labels);
  distributed::comm_stats().reset();
  const torch::Tensor loss = model.forward_loss(tokens, labels);
  ref_loss.backward();
  loss.backward();
  std::vector<torch::Tensor> partial;
  for (const auto& name : plan->partial_gradient_parameters()) partial.push_back(model.parameter_slot(name).tensor.grad());
  plan->sum_partial_gradients(partial);
  // What went over the group equals the formula (the replicated wo biases' gradient sum included).
  const distributed::CommSnapshot sent = distributed::comm_stats().snapshot();
  const auto expected = models::tp_comm_volume(args, tokens.size(0), tokens.size(1), comm->size(), options);
  for (auto op : {distributed::CommOp::kAllGather, distributed::CommOp::kReduceScatter, distributed::CommOp::kAllReduce}) {
    const distributed::CommCounter got = sent.get(op, comm->name());
    const auto it = expected.find(op);
    const distributed::CommCounter want = it == expected.end() ? distributed::CommCounter{} : it->second;
    LOOM_REQUIRE(got.calls == want.calls && got.payload_bytes == want.payload_bytes, config, ": ",
                 distributed::to_string(op), " sent ", got.calls, " calls, ", got.payload_bytes,
                 " payload bytes; the formula says ", want.calls, ", ", want.payload_bytes);
  }
  const double loss_diff = std::abs(loss.item<double>() - ref_loss.item<double>()) / ref_loss.item<double>();
  LOOM_REQUIRE(loss_diff <= 1e-6, config, ": loss ", loss.item<double>(), " vs reference ", ref_loss.item<double>());
  double worst = 0, worst_sinks = 0;
  std::string worst_name;
  for (size_t i = 0; i < params.size(); ++i) {
    const torch::Tensor& g = params[i].tensor().grad();
    LOOM_REQUIRE(g.defined(), config, ": no gradient for ", params[i].name);
    const double d = max_relative_diff(g, local_piece(*plan, params[i].name, ref_params[i].tensor().grad()));
    if (d > worst) worst = d, worst_name = params[i].name;
    if (params[i].name.find("sinks") != std::string::npos) worst_sinks = std::max(worst_sinks, d);
  }
  LOOM_REQUIRE(worst <= 1e-5, config, ": gradient of ", worst_name, " differs by ", worst);
  if (comm->rank() == 0) {
    std::printf("%s: loss %.7f (reference %.7f), worst gradient difference %.2e (%s), sinks %.2e\n", config.c_str(),
                loss.item<double>(), ref_loss.item<double>(), worst, worst_name.c_str(), worst_sinks);
  }
}

void scenario_attention_features(const tensor::CommPtr& comm) {
  for (bool sp : {true, false}) check_attention_features(comm, sp);
}

void scenario_llama(const tensor::CommPtr& comm) {
  for (bool sp : {true, false}) {
    for (bool loss_parallel : {true, false}) check_configuration(comm, sp, loss_parallel);
  }
  for (bool loss_parallel : {true, false}) check_configuration(comm, true, loss_parallel, /*async=*/true);
}

}  // namespace

int main(int argc, char** argv) {
  return loom::testing::worker_main(argc, argv, {{"llama", scenario_llama}, {"attention_features", scenario_attention_features}});
}
