#include "loom/moe/experts.h"

#include "loom/core/error.h"
#include "loom/nn/layers.h"

namespace loom::moe {

GroupedExperts::GroupedExperts(int64_t n_experts, int64_t dim, int64_t hidden_dim, const torch::TensorOptions& options)
    : nn::Module("GroupedExperts"), n_experts_(n_experts), dim_(dim), hidden_dim_(hidden_dim) {
  TORCH_CHECK(n_experts > 0 && dim > 0 && hidden_dim > 0, "GroupedExperts needs positive sizes");
  w1_ = register_parameter("w1", torch::empty({n_experts, hidden_dim, dim}, options));
  w2_ = register_parameter("w2", torch::empty({n_experts, dim, hidden_dim}, options));
  w3_ = register_parameter("w3", torch::empty({n_experts, hidden_dim, dim}, options));
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
  return call_with_hooks(x, [this, &counts](const torch::Tensor& in) {
    const torch::Tensor& w1 = w1_->tensor;
    const torch::Tensor& w2 = w2_->tensor;
    const torch::Tensor& w3 = w3_->tensor;
    // Under expert parallelism the slots hold this rank's experts only: counts follow them.
    const int64_t local = w1.size(0);
    TORCH_CHECK(static_cast<int64_t>(counts.size()) == local, "GroupedExperts: ", counts.size(),
                " token counts for ", local, " experts");
    TORCH_CHECK(in.dim() == 2 && in.size(1) == dim_, "GroupedExperts: input must be [M, ", dim_, "], got ",
                in.sizes());
    int64_t rows = 0;
    for (int64_t n : counts) rows += n;
    TORCH_CHECK(rows == in.size(0), "GroupedExperts: counts sum to ", rows, " but ", in.size(0), " rows came");
    if (rows > 0 && grouped_mm_ && grouped_mm_supported(in, w1)) {
      // Each expert's rows end at offs[e] (int32, cumulative).
      std::vector<int32_t> ends(counts.size());
      int64_t end = 0;
      for (size_t e = 0; e < counts.size(); ++e) ends[e] = static_cast<int32_t>(end += counts[e]);
      const torch::Tensor offs = torch::tensor(ends, torch::kInt32).to(in.device());
      const torch::Tensor x = in.contiguous();
      const torch::Tensor h = nn::swiglu(at::_grouped_mm(x, w1.transpose(-2, -1), offs),
                                         at::_grouped_mm(x, w3.transpose(-2, -1), offs));
      return ContiguousGrad::apply(at::_grouped_mm(h, w2.transpose(-2, -1), offs));
    }
    // One GEMM pair per expert over its contiguous rows.
    std::vector<torch::Tensor> outputs;
    int64_t begin = 0;
    for (int64_t e = 0; e < local; ++e) {
      const int64_t n = counts[e];
      if (n == 0) continue;
      const torch::Tensor xe = in.narrow(0, begin, n);
      const torch::Tensor h = nn::swiglu(at::linear(xe, w1[e]), at::linear(xe, w3[e]));
      outputs.push_back(at::linear(h, w2[e]));
      begin += n;
    }
    TORCH_CHECK(begin == in.size(0), "GroupedExperts: counts sum to ", begin, " but ", in.size(0), " rows came");
    if (outputs.empty()) {
      // No token here: an empty output that still reaches every weight, so backward gives them
      // zero gradients (a rank whose tokens all went elsewhere must reduce like the others), and
      // the (empty) input, so the backward of whatever brought it runs on every rank alike (expert
      // parallelism's all-to-all is a collective).
      return in * 0 + (w1.sum() + w2.sum() + w3.sum()) * 0;
    }
    return outputs.size() == 1 ? outputs[0] : torch::cat(outputs);
  });
}

}  // namespace loom::moe
