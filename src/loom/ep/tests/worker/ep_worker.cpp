// Per-rank scenarios of the expert-parallel tests, started as
//   loom launch --nproc N --exec -- loom_ep_worker <scenario>
// Every rank builds the same MoE layer (seeded weights) and draws its own tokens and output
// gradient. The reference is the whole layer on this rank's tokens; the EP layer holds this rank's
// E/N experts and dispatches by all-to-all. Outputs, input gradients and router gradients must
// match the reference's on every rank; each local expert's weight gradient must match the sum of
// every rank's reference gradient for that expert (the tokens of all ranks reach it). Exits 1
// with one line naming the rank, case and mismatch.
//   dispatch   softmax and sigmoid routing, several token counts per rank (the ranks differ)
//   starved    a selection bias sends every token to experts 0 and 1: the other experts get no
//              token and the ranks holding only those receive no rows at all; one rank brings
//              no tokens either
//   gpt_oss    GPT-OSS's options (router gate bias, softmax after top-k, expert biases b1/b2/b3
//              sharded with their experts, the clamped SwiGLU with both clamps engaged), and the
//              same with an expert that gets no token
//   gpt_oss_steps  GPT-OSS's options through 6 SGD steps against one process that sees every
//              rank's tokens: per step the loss and the gradient norm (router replicated, experts
//              and their biases sharded over ep), then every parameter after the last step
//   gpt_oss_efsdp  (4 ranks, its own main: it makes the groups) EP 2 x FSDP 2 of the experts:
//              ep {0,1} {2,3}, the experts' FSDP over {0,2} {1,3} (whole experts per rank, as the
//              composition plans them), against one process on every rank's tokens: the loss,
//              the gradient norm, and each rank's gradient shard of every expert stack (biases
//              included) and of the replicated router
#include <cmath>
#include <cstdio>
#include <map>
#include <string>

#include "loom/core/error.h"
#include "loom/ep/expert_parallel.h"
#include "loom/fsdp/fully_shard.h"
#include "loom/testing/worker.h"

namespace ep_worker {

using namespace loom;

double max_relative_diff(const torch::Tensor& a, const torch::Tensor& b) {
  if (b.numel() == 0) return a.numel() == 0 ? 0.0 : 1.0;
  const double scale = std::max(b.abs().max().item<double>(), 1e-12);
  return (a - b).abs().max().item<double>() / scale;
}

moe::MoEOptions layer_options(int64_t n_experts, int64_t top_k, moe::ScoreFunction score, bool bias) {
  moe::MoEOptions o;
  o.router.n_experts = n_experts;
  o.router.top_k = top_k;
  o.router.score_function = score;
  o.router.normalize = score == moe::ScoreFunction::kSigmoid;
  o.hidden_dim = 12;
  o.shared_hidden_dim = score == moe::ScoreFunction::kSigmoid ? 8 : 0;
  o.load_balance_coeff = bias ? 1e-3 : 0.0;
  return o;
}

moe::MoEOptions gpt_oss_options(int64_t n_experts) {
  moe::MoEOptions o;
  o.router.n_experts = n_experts;
  o.router.top_k = 4;
  o.router.score_function = moe::ScoreFunction::kSoftmaxAfterTopK;
  o.router.gate_bias = true;
  o.hidden_dim = 12;
  o.experts.bias = true;
  o.experts.activation = moe::ExpertActivation::kClampedSwiGLU;
  return o;
}

std::shared_ptr<moe::MoE> build(int64_t dim, const moe::MoEOptions& o, double std) {
  auto layer = std::make_shared<moe::MoE>(dim, o, torch::TensorOptions().dtype(torch::kFloat));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  torch::NoGradGuard no_grad;
  for (const auto& p : layer->named_parameters()) p.slot->tensor.copy_(torch::randn(p.slot->tensor.sizes(), gen) * std);
  return layer;
}

// `std`: the weights' scale; `x_scale`: the tokens'.
void check_case(const tensor::CommPtr& comm, const std::string& name, const moe::MoEOptions& o, int64_t tokens,
                const torch::Tensor& bias, double std = 0.3, double x_scale = 1.0) {
  const int n = comm->size(), r = comm->rank();
  constexpr int64_t kDim = 16;
  auto reference = build(kDim, o, std);
  auto parallel = build(kDim, o, std);
  if (bias.defined()) {
    torch::NoGradGuard no_grad;
    reference->expert_bias().copy_(bias);
    parallel->expert_bias().copy_(bias);
  }
  ep::ExpertParallel ep(comm);
  ep.apply(*parallel, "moe");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + r);
  const torch::Tensor x = torch::randn({tokens, kDim}, gen) * x_scale;
  const torch::Tensor dout = torch::randn({tokens, kDim}, gen);

  torch::Tensor x_ref = x.clone().requires_grad_();
  const torch::Tensor out_ref = reference->forward(x_ref);
  out_ref.backward(dout);
  torch::Tensor x_ep = x.clone().requires_grad_();
  const distributed::CommSnapshot before = distributed::comm_stats().snapshot();
  const torch::Tensor out = parallel->forward(x_ep);
  out.backward(dout);
  const distributed::CommSnapshot after = distributed::comm_stats().snapshot();
  const double sent = after.get(distributed::CommOp::kAllToAll, comm->name()).wire_bytes.value() -
                      before.get(distributed::CommOp::kAllToAll, comm->name()).wire_bytes.value();

  double worst_expert = 0;
  const int64_t local = o.router.n_experts / n;
  // Every expert stack: the weights and, with GPT-OSS's options, the biases b1, b2, b3.
  for (const std::string& w : reference->experts().stacked_parameter_names()) {
    torch::Tensor summed = reference->experts().parameter_slot(w).tensor.grad().clone();
    comm->all_reduce(summed);
    const torch::Tensor mine = summed.narrow(0, r * local, local);
    worst_expert = std::max(worst_expert, max_relative_diff(parallel->experts().parameter_slot(w).tensor.grad(), mine));
  }
  const double d_out = max_relative_diff(out, out_ref);
  const double d_x = max_relative_diff(x_ep.grad(), x_ref.grad());
  double d_router = max_relative_diff(parallel->router().gate().weight().grad(),
                                      reference->router().gate().weight().grad());
  if (o.router.gate_bias) {
    // The gate's bias stays replicated: every rank's gradient is its own tokens', as without EP.
    d_router = std::max(d_router, max_relative_diff(parallel->router().gate().parameter("bias").grad(),
                                                    reference->router().gate().parameter("bias").grad()));
  }
  LOOM_REQUIRE(d_out <= 1e-5 && d_x <= 1e-5 && d_router <= 1e-5 && worst_expert <= 1e-5, name, " rank ", r,
               ": relative differences from the whole layer: out ", d_out, ", dx ", d_x, ", router ", d_router,
               ", experts ", worst_expert);
  LOOM_REQUIRE(torch::equal(parallel->tokens_per_expert(), reference->tokens_per_expert()), name, " rank ", r,
               ": the EP layer counted other tokens per expert than the whole layer");
  // The all-to-all bytes of the forward and backward against the formula, from every rank's counts.
  torch::Tensor all_counts = torch::empty({n * o.router.n_experts});
  comm->all_gather_into_tensor(all_counts, parallel->tokens_per_expert().contiguous());
  std::vector<std::vector<int64_t>> counts(n, std::vector<int64_t>(o.router.n_experts));
  for (int s = 0; s < n; ++s) {
    for (int64_t e = 0; e < o.router.n_experts; ++e) {
      counts[s][e] = static_cast<int64_t>(all_counts[s * o.router.n_experts + e].item<float>());
    }
  }
  const int64_t want_bytes = ep::dispatch_wire_bytes(counts, r, kDim, 4);
  LOOM_REQUIRE(sent == static_cast<double>(want_bytes), name, " rank ", r, ": all-to-all sent ", sent,
               " bytes, the formula says ", want_bytes);
  if (r == 0) {
    std::printf("%s: max relative difference out %.2e dx %.2e router %.2e experts %.2e; all-to-all %lld bytes "
                "(formula %lld)\n",
                name.c_str(), d_out, d_x, d_router, worst_expert, static_cast<long long>(sent),
                static_cast<long long>(want_bytes));
  }
}

void scenario_dispatch(const tensor::CommPtr& comm) {
  const int n = comm->size();
  for (auto score : {moe::ScoreFunction::kSoftmax, moe::ScoreFunction::kSigmoid}) {
    const moe::MoEOptions o = layer_options(4 * n, 2, score, false);
    for (int64_t tokens : {5, 24}) {
      // Ranks bring different numbers of tokens.
      check_case(comm, c10::str("ep=", n, " ", score == moe::ScoreFunction::kSoftmax ? "softmax" : "sigmoid",
                                " tokens=", tokens),
                 o, tokens + comm->rank(), torch::Tensor());
    }
  }
}

void scenario_starved(const tensor::CommPtr& comm) {
  const int n = comm->size();
  const moe::MoEOptions o = layer_options(4 * n, 2, moe::ScoreFunction::kSigmoid, true);
  torch::Tensor bias = torch::zeros({4 * n});
  bias.narrow(0, 0, 2).fill_(10.0);  // every token picks experts 0 and 1, on rank 0
  // The last rank brings no token at all.
  check_case(comm, c10::str("ep=", n, " starved"), o, comm->rank() + 1 == n ? 0 : 7, bias);
}

void scenario_gpt_oss(const tensor::CommPtr& comm) {
  const int n = comm->size();
  moe::MoEOptions o = gpt_oss_options(4 * n);
  // Weights and tokens large enough that the gate (above 7) and up (outside +-7) clamps engage on a
  // real share of the values (the one-process tests count them; here the same scale).
  for (int64_t tokens : {5, 24}) {
    check_case(comm, c10::str("ep=", n, " gpt_oss tokens=", tokens), o, tokens + comm->rank(), torch::Tensor(), 0.6,
               2.0);
  }
  // With the selection bias of loss-free balancing steering every token to experts 0-3 (rank 0's
  // experts on 2 ranks): the other experts' biases get no token, the last rank brings none.
  o.load_balance_coeff = 1e-3;
  torch::Tensor bias = torch::zeros({4 * n});
  bias.narrow(0, 0, 4).fill_(100.0);
  check_case(comm, c10::str("ep=", n, " gpt_oss starved"), o, comm->rank() + 1 == n ? 0 : 7, bias, 0.6, 2.0);
}

// Training steps as a data-parallel run would take them: rank s holds tokens x_s (different counts
// per rank) and targets; the loss is sum over all ranks' tokens of |y - target|^2 / N_total. The
// reference (one process) runs the whole layer on every rank's tokens at once. The EP layer's
// router gradients are each rank's share, summed over the ranks (as FSDP/DDP reduce the
// replicated parameters); the experts' arrive complete from the dispatch's backward. The gradient
// norm sums the router's squares once and the experts' squares over the ep ranks.
void scenario_gpt_oss_steps(const tensor::CommPtr& comm) {
  const int n = comm->size(), r = comm->rank();
  constexpr int64_t kDim = 16;
  constexpr int kSteps = 6;
  constexpr double kLr = 2e-3;
  const moe::MoEOptions o = gpt_oss_options(4 * n);
  auto reference = build(kDim, o, 0.6);
  auto parallel = build(kDim, o, 0.6);
  ep::ExpertParallel ep(comm);
  ep.apply(*parallel, "moe");
  const int64_t local = o.router.n_experts / n;
  double worst_loss = 0, worst_norm = 0, worst_param = 0;
  for (int step = 0; step < kSteps; ++step) {
    std::vector<torch::Tensor> xs, targets;
    int64_t total = 0;
    for (int s = 0; s < n; ++s) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * step + s);
      const int64_t tokens = 9 + 3 * s;
      xs.push_back(torch::randn({tokens, kDim}, gen) * 2.0);
      targets.push_back(torch::randn({tokens, kDim}, gen));
      total += tokens;
    }
    // One process: every token.
    for (auto& p : reference->named_parameters()) p.slot->tensor.mutable_grad() = torch::Tensor();
    const torch::Tensor y_ref = reference->forward(torch::cat(xs));
    const torch::Tensor loss_ref = (y_ref - torch::cat(targets)).pow(2).sum() / static_cast<double>(total);
    loss_ref.backward();
    double sq_ref = 0;
    for (auto& p : reference->named_parameters()) sq_ref += p.slot->tensor.grad().pow(2).sum().item<double>();
    // Expert parallel: this rank's tokens.
    for (auto& p : parallel->named_parameters()) p.slot->tensor.mutable_grad() = torch::Tensor();
    const torch::Tensor y = parallel->forward(xs[r]);
    const torch::Tensor loss_local = (y - targets[r]).pow(2).sum() / static_cast<double>(total);
    loss_local.backward();
    torch::Tensor loss = loss_local.detach().clone();
    comm->all_reduce(loss);
    double sq_router = 0;
    torch::Tensor sq_experts = torch::zeros({1}, torch::kDouble);
    for (auto& p : parallel->named_parameters()) {
      torch::Tensor& g = p.slot->tensor.mutable_grad();
      if (p.slot->layout) {
        sq_experts += g.to(torch::kDouble).pow(2).sum();
      } else {
        comm->all_reduce(g);
        sq_router += g.to(torch::kDouble).pow(2).sum().item<double>();
      }
    }
    comm->all_reduce(sq_experts);
    const double norm = std::sqrt(sq_router + sq_experts.item<double>()), norm_ref = std::sqrt(sq_ref);
    const double d_loss = std::abs(loss.item<double>() - loss_ref.item<double>()) / std::abs(loss_ref.item<double>());
    const double d_norm = std::abs(norm - norm_ref) / norm_ref;
    LOOM_REQUIRE(d_loss <= 1e-5 && d_norm <= 1e-5, "gpt_oss_steps rank ", r, " step ", step + 1, ": loss ",
                 loss.item<double>(), " vs ", loss_ref.item<double>(), ", grad norm ", norm, " vs ", norm_ref);
    worst_loss = std::max(worst_loss, d_loss);
    if (r == 0) std::printf("  step %d: loss %.6f (one process %.6f), grad norm %.6f (%.6f)\n", step + 1,
                            loss.item<double>(), loss_ref.item<double>(), norm, norm_ref);
    worst_norm = std::max(worst_norm, d_norm);
    torch::NoGradGuard no_grad;
    for (auto* layer : {reference.get(), parallel.get()}) {
      for (auto& p : layer->named_parameters()) p.slot->tensor.sub_(kLr * p.slot->tensor.grad());
    }
  }
  // Every parameter after the steps: the router whole, the experts' rows this rank holds.
  std::map<std::string, torch::Tensor> want;
  for (auto& p : reference->named_parameters()) want[p.name] = p.slot->tensor;
  for (auto& p : parallel->named_parameters()) {
    const torch::Tensor w = p.slot->layout ? want.at(p.name).narrow(0, r * local, local) : want.at(p.name);
    worst_param = std::max(worst_param, max_relative_diff(p.slot->tensor, w));
  }
  LOOM_REQUIRE(worst_param <= 1e-5, "gpt_oss_steps rank ", r, ": parameters after ", kSteps,
               " steps differ from one process's by ", worst_param, " (relative)");
  if (r == 0) {
    std::printf("ep=%d gpt_oss %d steps: max relative difference from one process: loss %.2e, grad norm %.2e, "
                "parameters %.2e\n",
                n, kSteps, worst_loss, worst_norm, worst_param);
  }
}

// EP 2 x FSDP 2 (see the header). Rank r: ep group {r - r % 2, r - r % 2 + 1} (ep rank r % 2),
// efsdp group {r % 2, r % 2 + 2}.
void scenario_gpt_oss_efsdp(distributed::Distributed& d) {
  const auto& world = d.world();
  const int r = world->rank();
  LOOM_REQUIRE(world->size() == 4, "gpt_oss_efsdp runs on 4 ranks, got ", world->size());
  const auto ep_comm = d.new_group({r - r % 2, r - r % 2 + 1}, "ep");
  const auto efsdp_comm = d.new_group({r % 2, r % 2 + 2}, "efsdp");
  constexpr int64_t kDim = 16;
  const moe::MoEOptions o = gpt_oss_options(8);
  auto reference = build(kDim, o, 0.6);
  auto parallel = build(kDim, o, 0.6);
  ep::ExpertParallel ep(ep_comm);
  ep.apply(*parallel, "moe");
  fsdp::FSDPPolicy policy;
  policy.granularity = tensor::Granularity::row();  // whole experts per rank
  policy.gradient_divide_factor = 1.0;              // the loss is already a mean over every token
  fsdp::FSDPMesh mesh;
  mesh.shard = efsdp_comm;
  auto root = fsdp::fully_shard(parallel->experts(), mesh, policy, "moe.experts");

  std::vector<torch::Tensor> xs, targets;
  int64_t total = 0;
  for (int s = 0; s < 4; ++s) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + s);
    const int64_t tokens = 7 + 4 * s;
    xs.push_back(torch::randn({tokens, kDim}, gen) * 2.0);
    targets.push_back(torch::randn({tokens, kDim}, gen));
    total += tokens;
  }
  const torch::Tensor loss_ref =
      (reference->forward(torch::cat(xs)) - torch::cat(targets)).pow(2).sum() / static_cast<double>(total);
  loss_ref.backward();
  double sq_ref = 0;
  for (auto& p : reference->named_parameters()) sq_ref += p.slot->tensor.grad().to(torch::kDouble).pow(2).sum().item<double>();

  const torch::Tensor loss_local = (parallel->forward(xs[r]) - targets[r]).pow(2).sum() / static_cast<double>(total);
  loss_local.backward();
  root->finalize_backward();
  torch::Tensor loss = loss_local.detach().clone();
  world->all_reduce(loss);
  // The router: replicated, each rank's gradient its tokens' share.
  double sq = 0, worst_grad = 0;
  for (auto& p : parallel->router().named_parameters()) {
    torch::Tensor g = p.slot->tensor.grad().clone();
    world->all_reduce(g);
    sq += g.to(torch::kDouble).pow(2).sum().item<double>();
    worst_grad = std::max(worst_grad, max_relative_diff(g, reference->router().parameter_slot(p.name).tensor.grad()));
  }
  // The experts: this rank's shard of its ep rank's experts, against the same elements of the
  // reference's gradient (the sum over all four ranks' tokens).
  torch::Tensor sq_experts = torch::zeros({1}, torch::kDouble);
  const int64_t local = 8 / 2;
  torch::Tensor checked = torch::zeros({1}, torch::kLong);
  int64_t stacks = 0, local_elements = 0;
  for (fsdp::FSDPParamGroup* g : root->param_groups()) {
    for (const auto& p : g->params()) {
      const auto range = g->params_buffer().global_range(p.index);
      const torch::Tensor want = reference->experts()
                                     .parameter_slot(p.name)
                                     .tensor.grad()
                                     .narrow(0, (r % 2) * local, local)
                                     .reshape(-1)
                                     .narrow(0, range.begin, range.size());
      const torch::Tensor got = p.sharded_grad.reshape(-1);
      LOOM_REQUIRE(got.numel() == want.numel(), p.name, ": shard of ", got.numel(), " elements, expected ", want.numel());
      if (want.numel() > 0) worst_grad = std::max(worst_grad, max_relative_diff(got, want));
      sq_experts += got.to(torch::kDouble).pow(2).sum();
      checked += got.numel();
      ++stacks;
      local_elements += reference->experts().parameter_slot(p.name).tensor.numel() / 2;
    }
  }
  // The efsdp pair's shards together cover every element of the six stacks of their ep rank.
  efsdp_comm->all_reduce(checked);
  LOOM_REQUIRE(stacks == 6 && checked.item<int64_t>() == local_elements, "gpt_oss_efsdp rank ", r, ": ", stacks,
               " expert stacks, their shards over efsdp hold ", checked.item<int64_t>(), " elements, expected ",
               local_elements);
  world->all_reduce(sq_experts);
  const double norm = std::sqrt(sq + sq_experts.item<double>()), norm_ref = std::sqrt(sq_ref);
  const double d_loss = std::abs(loss.item<double>() - loss_ref.item<double>()) / std::abs(loss_ref.item<double>());
  const double d_norm = std::abs(norm - norm_ref) / norm_ref;
  LOOM_REQUIRE(d_loss <= 1e-5 && d_norm <= 1e-5 && worst_grad <= 1e-5, "gpt_oss_efsdp rank ", r,
               ": relative differences from one process: loss ", d_loss, ", grad norm ", d_norm, ", gradients ",
               worst_grad);
  if (r == 0) {
    std::printf("ep=2 x efsdp=2 gpt_oss: loss %.6f (one process %.6f), grad norm %.6f (%.6f); max relative "
                "difference loss %.2e, grad norm %.2e, gradients %.2e\n",
                loss.item<double>(), loss_ref.item<double>(), norm, norm_ref, d_loss, d_norm, worst_grad);
  }
}

}  // namespace ep_worker

int main(int argc, char** argv) {
  if (argc == 2 && std::string(argv[1]) == "gpt_oss_efsdp") {
    // Its own rendezvous (worker_main hands scenarios the world only; this one makes groups).
    int rank = -1;
    try {
      const auto env = loom::distributed::detect_launch_env();
      rank = env.rank;
      torch::set_num_threads(1);
      auto d = loom::distributed::init_distributed(env, std::chrono::seconds(60));
      ep_worker::scenario_gpt_oss_efsdp(*d);
      std::printf("rank %d/%d gpt_oss_efsdp: ok\n", env.rank, env.world_size);
      std::fflush(stdout);
      d->shutdown();
      return 0;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank %d: error: %s\n", rank, e.what());
    }
    return 1;
  }
  return loom::testing::worker_main(argc, argv,
                                    {{"dispatch", ep_worker::scenario_dispatch}, {"starved", ep_worker::scenario_starved},
                                     {"gpt_oss", ep_worker::scenario_gpt_oss},
                                     {"gpt_oss_steps", ep_worker::scenario_gpt_oss_steps}});
}
