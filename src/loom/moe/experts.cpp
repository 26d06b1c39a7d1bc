#include "loom/moe/experts.h"

#include "loom/core/error.h"
#include "loom/nn/layers.h"

namespace loom::moe {

void ExpertsOptions::validate() const {
  if (activation != ExpertActivation::kClampedSwiGLU) return;
  LOOM_REQUIRE_USAGE(swiglu_limit > 0, "MoE: swiglu_limit must be > 0, got ", swiglu_limit);
  LOOM_REQUIRE_USAGE(swiglu_alpha > 0, "MoE: swiglu_alpha must be > 0, got ", swiglu_alpha);
}

torch::Tensor expert_activation(const torch::Tensor& gate, const torch::Tensor& up, const ExpertsOptions& o) {
  if (o.activation == ExpertActivation::kSwiGLU) return nn::swiglu(gate, up);
  // transformers' GptOssExperts._apply_gate, op for op (clamp's gradient passes where the value is
  // within the bounds, ends included, as torch's).
  const torch::Tensor g = gate.clamp_max(o.swiglu_limit);
  const torch::Tensor u = up.clamp(-o.swiglu_limit, o.swiglu_limit);
  const torch::Tensor glu = g * torch::sigmoid(g * o.swiglu_alpha);
  return (u + 1) * glu;
}

namespace {

void check_stack(const torch::Tensor& t, int64_t dims, const char* what) {
  TORCH_CHECK(t.dim() == dims, what, " must have ", dims, " dims, got ", t.sizes());
}

}  // namespace

std::pair<torch::Tensor, torch::Tensor> split_interleaved_gate_up(const torch::Tensor& gate_up) {
  check_stack(gate_up, 3, "gate_up_proj [E, dim, 2 hidden]");
  TORCH_CHECK(gate_up.size(2) % 2 == 0, "gate_up_proj's last dim must be even, got ", gate_up.sizes());
  using torch::indexing::Slice;
  return {gate_up.index({Slice(), Slice(), Slice(0, torch::indexing::None, 2)}).transpose(1, 2).contiguous(),
          gate_up.index({Slice(), Slice(), Slice(1, torch::indexing::None, 2)}).transpose(1, 2).contiguous()};
}

torch::Tensor interleave_gate_up(const torch::Tensor& w1, const torch::Tensor& w3) {
  check_stack(w1, 3, "w1 [E, hidden, dim]");
  TORCH_CHECK(w1.sizes() == w3.sizes(), "w1 ", w1.sizes(), " and w3 ", w3.sizes(), " differ");
  // [E, hidden, dim] x 2 -> [E, dim, hidden, 2] -> [E, dim, 2 hidden]: column 2j is w1's row j.
  return torch::stack({w1.transpose(1, 2), w3.transpose(1, 2)}, -1).reshape({w1.size(0), w1.size(2), 2 * w1.size(1)});
}

std::pair<torch::Tensor, torch::Tensor> split_interleaved_gate_up_bias(const torch::Tensor& gate_up_bias) {
  check_stack(gate_up_bias, 2, "gate_up_proj_bias [E, 2 hidden]");
  TORCH_CHECK(gate_up_bias.size(1) % 2 == 0, "gate_up_proj_bias's last dim must be even, got ", gate_up_bias.sizes());
  using torch::indexing::Slice;
  return {gate_up_bias.index({Slice(), Slice(0, torch::indexing::None, 2)}).contiguous(),
          gate_up_bias.index({Slice(), Slice(1, torch::indexing::None, 2)}).contiguous()};
}

torch::Tensor interleave_gate_up_bias(const torch::Tensor& b1, const torch::Tensor& b3) {
  check_stack(b1, 2, "b1 [E, hidden]");
  TORCH_CHECK(b1.sizes() == b3.sizes(), "b1 ", b1.sizes(), " and b3 ", b3.sizes(), " differ");
  return torch::stack({b1, b3}, -1).reshape({b1.size(0), 2 * b1.size(1)});
}

torch::Tensor down_proj_to_w2(const torch::Tensor& down) {
  check_stack(down, 3, "down_proj [E, hidden, dim]");
  return down.transpose(1, 2).contiguous();
}

torch::Tensor w2_to_down_proj(const torch::Tensor& w2) {
  check_stack(w2, 3, "w2 [E, dim, hidden]");
  return w2.transpose(1, 2).contiguous();
}

GroupedExperts::GroupedExperts(int64_t n_experts, int64_t dim, int64_t hidden_dim, const torch::TensorOptions& options,
                               ExpertsOptions experts_options)
    : nn::Module("GroupedExperts"), n_experts_(n_experts), dim_(dim), hidden_dim_(hidden_dim), options_(experts_options) {
  TORCH_CHECK(n_experts > 0 && dim > 0 && hidden_dim > 0, "GroupedExperts needs positive sizes");
  options_.validate();
  w1_ = register_parameter("w1", torch::empty({n_experts, hidden_dim, dim}, options));
  w2_ = register_parameter("w2", torch::empty({n_experts, dim, hidden_dim}, options));
  w3_ = register_parameter("w3", torch::empty({n_experts, hidden_dim, dim}, options));
  if (options_.bias) {
    b1_ = register_parameter("b1", torch::empty({n_experts, hidden_dim}, options));
    b2_ = register_parameter("b2", torch::empty({n_experts, dim}, options));
    b3_ = register_parameter("b3", torch::empty({n_experts, hidden_dim}, options));
  }
}

std::vector<std::string> GroupedExperts::stacked_parameter_names() const {
  if (!options_.bias) return {"w1", "w2", "w3"};
  return {"w1", "w2", "w3", "b1", "b2", "b3"};
}

namespace {

// Identity whose backward hands on a contiguous gradient: at::_grouped_mm's backward rejects the
// expanded (stride-0) gradients that e.g. a sum() produces.
struct ContiguousGrad : torch::autograd::Function<ContiguousGrad> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x) { return x.view_as(x); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list g) {
    return {g[0].contiguous()};
  }
};

}  // namespace

bool GroupedExperts::grouped_mm_supported(const torch::Tensor& x, const torch::Tensor& w) {
  if (x.device() != w.device() || x.scalar_type() != w.scalar_type()) return false;
  // Every operand's rows must start on 16 bytes (both dims of the expert matrices).
  const int64_t element = static_cast<int64_t>(c10::elementSize(x.scalar_type()));
  if ((w.size(1) * element) % 16 != 0 || (w.size(2) * element) % 16 != 0) return false;
  if (x.device().is_cpu()) return at::isFloatingType(x.scalar_type());
  return x.device().is_cuda() && x.scalar_type() == torch::kBFloat16;
}

torch::Tensor GroupedExperts::forward(const torch::Tensor& x, const std::vector<int64_t>& counts) {
  return forward(x, torch::tensor(counts, torch::kLong));
}

torch::Tensor GroupedExperts::forward(const torch::Tensor& x, const torch::Tensor& counts_in) {
  return call_with_hooks(x, [this, &counts_in](const torch::Tensor& in) {
    const torch::Tensor& w1 = w1_->tensor;
    const torch::Tensor& w2 = w2_->tensor;
    const torch::Tensor& w3 = w3_->tensor;
    const bool bias = b1_ != nullptr;
    // Under expert parallelism the slots hold this rank's experts only: counts follow them.
    const int64_t local = w1.size(0);
    TORCH_CHECK(counts_in.dim() == 1 && counts_in.size(0) == local, "GroupedExperts: ", counts_in.sizes(),
                " token counts for ", local, " experts");
    TORCH_CHECK(in.dim() == 2 && in.size(1) == dim_, "GroupedExperts: input must be [M, ", dim_, "], got ",
                in.sizes());
    const int64_t rows = in.size(0);
    if (rows > 0 && grouped_mm_ && grouped_mm_supported(in, w1)) {
      // Each expert's rows end at offs[e] (int32, cumulative), computed where the counts are: on
      // the GPU no count comes to the host (their sum is M by construction: the caller sorted M rows
      // by these counts; a host-side check would wait for the device).
      const torch::Tensor c = counts_in.to(in.device(), torch::kLong);
      if (!c.is_cuda()) {
        TORCH_CHECK(c.sum().item<int64_t>() == rows, "GroupedExperts: counts sum to ", c.sum().item<int64_t>(),
                    " but ", rows, " rows came");
      }
      const torch::Tensor offs = c.cumsum(0).to(torch::kInt32);
      const torch::Tensor x = in.contiguous();
      torch::Tensor gate = at::_grouped_mm(x, w1.transpose(-2, -1), offs);
      torch::Tensor up = at::_grouped_mm(x, w3.transpose(-2, -1), offs);
      torch::Tensor expert_of_row;
      if (bias) {
        // Each row's expert's biases, gathered (their gradient sums back per expert); the output
        // size given, repeat_interleave reads nothing back.
        expert_of_row = torch::repeat_interleave(torch::arange(local, c.options()), c, /*dim=*/0, rows);
        gate = gate + b1_->tensor.index_select(0, expert_of_row);
        up = up + b3_->tensor.index_select(0, expert_of_row);
      }
      const torch::Tensor h = expert_activation(gate, up, options_);
      torch::Tensor out = ContiguousGrad::apply(at::_grouped_mm(h, w2.transpose(-2, -1), offs));
      if (bias) out = out + b2_->tensor.index_select(0, expert_of_row);
      return out;
    }
    const torch::Tensor host = counts_in.to(torch::kCPU, torch::kLong).contiguous();
    const std::vector<int64_t> counts(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + local);
    int64_t total = 0;
    for (int64_t n : counts) total += n;
    TORCH_CHECK(total == rows, "GroupedExperts: counts sum to ", total, " but ", rows, " rows came");
    // One GEMM pair per expert over its contiguous rows.
    std::vector<torch::Tensor> outputs;
    int64_t begin = 0;
    for (int64_t e = 0; e < local; ++e) {
      const int64_t n = counts[e];
      if (n == 0) continue;
      const torch::Tensor xe = in.narrow(0, begin, n);
      if (bias) {
        const torch::Tensor h = expert_activation(at::linear(xe, w1[e], b1_->tensor[e]),
                                                  at::linear(xe, w3[e], b3_->tensor[e]), options_);
        outputs.push_back(at::linear(h, w2[e], b2_->tensor[e]));
      } else {
        const torch::Tensor h = expert_activation(at::linear(xe, w1[e]), at::linear(xe, w3[e]), options_);
        outputs.push_back(at::linear(h, w2[e]));
      }
      begin += n;
    }
    TORCH_CHECK(begin == in.size(0), "GroupedExperts: counts sum to ", begin, " but ", in.size(0), " rows came");
    if (outputs.empty()) {
      // No token here: an empty output that still reaches every weight, so backward gives them
      // zero gradients (a rank whose tokens all went elsewhere must reduce like the others), and
      // the (empty) input, so the backward of whatever brought it runs on every rank alike (expert
      // parallelism's all-to-all is a collective).
      torch::Tensor all = w1.sum() + w2.sum() + w3.sum();
      if (bias) all = all + b1_->tensor.sum() + b2_->tensor.sum() + b3_->tensor.sum();
      return in * 0 + all * 0;
    }
    return outputs.size() == 1 ? outputs[0] : torch::cat(outputs);
  });
}

}  // namespace loom::moe
