// For tests/parity/test_float8_parity.py: reads x [M, K], w [N, K] and dy [M, N] from a
// safetensors file, runs Loom's Float8 linear forward and backward with the given recipe (CPU
// emulation) and writes y, dx and dw to another.
//   loom_float8_parity_worker <in.safetensors> <out.safetensors> <rowwise|tensorwise>
#include <torch/torch.h>

#include <cstdio>
#include <exception>

#include "loom/checkpoint/safetensors.h"
#include "loom/float8/float8.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s <in.safetensors> <out.safetensors> <rowwise|tensorwise>\n", argv[0]);
    return 2;
  }
  try {
    const loom::checkpoint::SafetensorsFile in(argv[1]);
    const torch::Tensor x = in.tensor("x").clone().requires_grad_(true);
    const torch::Tensor w = in.tensor("w").clone().requires_grad_(true);
    const torch::Tensor y = loom::float8::float8_linear(x, w, loom::options::parse_enum<loom::float8::Recipe>(argv[3], "recipe"));
    y.backward(in.tensor("dy"));
    loom::checkpoint::save_safetensors(argv[2], {{"y", y.detach()}, {"dx", x.grad()}, {"dw", w.grad()}});
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
