// Runs Loom's Muon on tensors from a safetensors file, for the Python parity check
// tests/parity/test_muon_parity.py:
//   loom_muon_reference IN OUT LR WEIGHT_DECAY MOMENTUM NESTEROV(0|1) ADJUST_LR
// IN holds matrices "x.<k>" (OUT gets newton_schulz(x.<k>, 5) as "ns.<k>") and optionally a matrix
// "param" with gradients "grad.0", "grad.1", ... (OUT gets "param" after one optim::Muon step per
// gradient, in order).
#include <cstdio>
#include <cstdlib>
#include <string>

#include "loom/checkpoint/safetensors.h"
#include "loom/core/error.h"
#include "loom/optim/muon.h"

int main(int argc, char** argv) {
  try {
    LOOM_REQUIRE_USAGE(argc == 8, "usage: loom_muon_reference IN OUT LR WEIGHT_DECAY MOMENTUM NESTEROV ADJUST_LR");
    const loom::checkpoint::SafetensorsFile in(argv[1]);
    const double lr = std::stod(argv[3]), weight_decay = std::stod(argv[4]);
    loom::optim::MuonOptions options;
    options.momentum = std::stod(argv[5]);
    options.nesterov = std::string(argv[6]) == "1";
    options.adjust_lr = loom::options::parse_enum<loom::optim::MuonLRAdjust>(argv[7], "adjust_lr");
    loom::checkpoint::NamedTensors out;
    for (const auto& name : in.names()) {
      if (name.rfind("x.", 0) == 0) {
        out.emplace_back("ns." + name.substr(2), loom::optim::newton_schulz(in.tensor(name), options.ns_steps));
      }
    }
    if (in.contains("param")) {
      torch::Tensor param = in.tensor("param").clone();
      loom::optim::Muon muon(loom::optim::weight_decay_param_groups({{"layers.0.w.weight", param}}, weight_decay),
                             loom::optim::AdamWOptions{.lr = lr}, options);
      for (int t = 0; in.contains("grad." + std::to_string(t)); ++t) {
        param.mutable_grad() = in.tensor("grad." + std::to_string(t)).clone();
        muon.step();
      }
      out.emplace_back("param", param);
    }
    loom::checkpoint::save_safetensors(argv[2], out);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
