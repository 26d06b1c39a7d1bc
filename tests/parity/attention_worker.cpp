// For tests/parity/test_hf_gpt_oss_attention_parity.py: reads a GPT-OSS attention layer's weights
// (Hugging Face names), its input x [B, T, dim], the RoPE cos/sin [T, head_dim/2] transformers
// computed, an output gradient dout and `config` = [n_heads, n_kv_heads, head_dim, sliding_window]
// from a safetensors file; runs Loom's nn::Attention with sinks, biases and that window (0: full)
// forward and backward, and writes y, dx and every parameter's gradient (HF names) to another.
//   loom_attention_parity_worker <in.safetensors> <out.safetensors>
#include <torch/torch.h>

#include <cstdio>
#include <exception>
#include <map>
#include <string>

#include "loom/checkpoint/safetensors.h"
#include "loom/nn/attention.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s <in.safetensors> <out.safetensors>\n", argv[0]);
    return 2;
  }
  try {
    using namespace loom;
    const checkpoint::SafetensorsFile in(argv[1]);
    const torch::Tensor config = in.tensor("config").to(torch::kInt64);
    const int64_t heads = config[0].item<int64_t>(), kv_heads = config[1].item<int64_t>(),
                  head_dim = config[2].item<int64_t>(), window = config[3].item<int64_t>();
    const torch::Tensor x = in.tensor("x").to(torch::kFloat32).clone().requires_grad_(true);
    nn::AttentionOptions o;
    o.head_dim = head_dim;
    o.sinks = true;
    o.bias = true;
    o.sliding_window = window;
    nn::Attention attention(x.size(2), heads, kv_heads, torch::kFloat32, o);
    const std::map<std::string, std::string> hf = {
        {"sinks", "sinks"},         {"wq.weight", "q_proj.weight"}, {"wq.bias", "q_proj.bias"},
        {"wk.weight", "k_proj.weight"}, {"wk.bias", "k_proj.bias"}, {"wv.weight", "v_proj.weight"},
        {"wv.bias", "v_proj.bias"}, {"wo.weight", "o_proj.weight"}, {"wo.bias", "o_proj.bias"}};
    for (const auto& [name, hf_name] : hf) {
      attention.set_parameter(name, in.tensor(hf_name).to(torch::kFloat32).clone().requires_grad_(true));
    }
    // Loom's rotate-half cache: cos with the half-frequencies repeated, sin with its first half negated.
    const torch::Tensor cos = in.tensor("cos").to(torch::kFloat32), sin = in.tensor("sin").to(torch::kFloat32);
    const torch::Tensor rope = torch::stack({torch::cat({cos, cos}, -1), torch::cat({-sin, sin}, -1)});
    const torch::Tensor y = attention.forward(x, rope);
    y.backward(in.tensor("dout").to(torch::kFloat32));
    std::vector<std::pair<std::string, torch::Tensor>> out = {{"y", y.detach()}, {"dx", x.grad()}};
    for (const auto& [name, hf_name] : hf) out.emplace_back("d." + hf_name, attention.parameter(name).grad());
    checkpoint::save_safetensors(argv[2], out);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
