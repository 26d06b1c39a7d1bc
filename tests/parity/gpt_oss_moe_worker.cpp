// For tests/parity/test_hf_gpt_oss_moe_parity.py: reads transformers' GptOssMLP tensors in their
// own layout (router weight [E, D] and bias [E]; experts gate_up_proj [E, D, 2I] with interleaved
// gate/up columns, gate_up_proj_bias [E, 2I], down_proj [E, I, D], down_proj_bias [E, D]) with
// tokens x [T, D] and an output gradient dy [T, D]; maps them to Loom's MoE layer with GPT-OSS's
// options (moe::split_interleaved_gate_up and friends), runs forward and backward in float32 and
// writes y, dx and every parameter's gradient mapped back to transformers' layout.
//   loom_gpt_oss_moe_parity_worker <in.safetensors> <out.safetensors> <top_k> <grouped|loop>
#include <torch/torch.h>

#include <cstdio>
#include <exception>
#include <string>

#include "loom/checkpoint/safetensors.h"
#include "loom/moe/moe.h"

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s <in.safetensors> <out.safetensors> <top_k> <grouped|loop>\n", argv[0]);
    return 2;
  }
  try {
    using namespace loom;
    const checkpoint::SafetensorsFile in(argv[1]);
    const torch::Tensor gate_up = in.tensor("gate_up_proj");
    const int64_t n_experts = gate_up.size(0), dim = gate_up.size(1), hidden = gate_up.size(2) / 2;
    moe::MoEOptions o;
    o.router.n_experts = n_experts;
    o.router.top_k = std::stoll(argv[3]);
    o.router.score_function = moe::ScoreFunction::kSoftmaxAfterTopK;
    o.router.gate_bias = true;
    o.hidden_dim = hidden;
    o.experts.bias = true;
    o.experts.activation = moe::ExpertActivation::kClampedSwiGLU;
    moe::MoE layer(dim, o, torch::TensorOptions().dtype(torch::kFloat));
    layer.experts().set_grouped_mm(std::string(argv[4]) == "grouped");
    {
      torch::NoGradGuard no_grad;
      const auto [w1, w3] = moe::split_interleaved_gate_up(gate_up);
      const auto [b1, b3] = moe::split_interleaved_gate_up_bias(in.tensor("gate_up_proj_bias"));
      auto& ex = layer.experts();
      ex.parameter_slot("w1").tensor.copy_(w1);
      ex.parameter_slot("w3").tensor.copy_(w3);
      ex.parameter_slot("w2").tensor.copy_(moe::down_proj_to_w2(in.tensor("down_proj")));
      ex.parameter_slot("b1").tensor.copy_(b1);
      ex.parameter_slot("b3").tensor.copy_(b3);
      ex.parameter_slot("b2").tensor.copy_(in.tensor("down_proj_bias"));
      layer.router().gate().parameter_slot("weight").tensor.copy_(in.tensor("router_weight"));
      layer.router().gate().parameter_slot("bias").tensor.copy_(in.tensor("router_bias"));
    }
    const torch::Tensor x = in.tensor("x").clone().requires_grad_(true);
    const torch::Tensor y = layer.forward(x);
    y.backward(in.tensor("dy"));
    auto& ex = layer.experts();
    auto grad = [&](const char* name) { return ex.parameter_slot(name).tensor.grad(); };
    checkpoint::save_safetensors(
        argv[2], {{"y", y.detach()},
                  {"dx", x.grad()},
                  {"router_weight", layer.router().gate().parameter_slot("weight").tensor.grad()},
                  {"router_bias", layer.router().gate().parameter_slot("bias").tensor.grad()},
                  {"gate_up_proj", moe::interleave_gate_up(grad("w1"), grad("w3"))},
                  {"gate_up_proj_bias", moe::interleave_gate_up_bias(grad("b1"), grad("b3"))},
                  {"down_proj", moe::w2_to_down_proj(grad("w2"))},
                  {"down_proj_bias", grad("b2")}});
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
