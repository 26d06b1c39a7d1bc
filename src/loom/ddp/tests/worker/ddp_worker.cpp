// Per-rank scenarios for the DDP tests, started by `loom launch --exec`. Each rank trains the same
// small Llama under DataParallel on its own batch, and also rebuilds every rank's batch locally to
// compute the single-process reference gradient (the mean over the ranks' batches) on an unwrapped
// copy. Exit code 0 = the DDP gradients equal the reference.
#include <cstdio>
#include <string>

#include "loom/core/error.h"
#include "loom/ddp/ddp.h"
#include "loom/distributed/launch_env.h"
#include "loom/distributed/process_group.h"
#include "loom/models/llama3/model.h"

namespace {
using namespace loom;

llama3::ModelArgs tiny_args() {
  llama3::ModelArgs a = llama3::flavor("debugmodel", 96);
  a.dim = 32;
  a.n_layers = 2;
  a.n_heads = 4;
  a.n_kv_heads = 2;
  a.max_seq_len = 16;
  return a;
}

std::shared_ptr<llama3::Transformer> make_model() {
  auto m = std::make_shared<llama3::Transformer>(tiny_args());
  m->init_weights(7);
  return m;
}

torch::Tensor batch_of(int rank, int micro) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(1000 + 17 * rank + micro);
  return torch::randint(0, 96, {2, 9}, g);
}

torch::Tensor loss_of(llama3::Transformer& m, const torch::Tensor& tokens) {
  auto inputs = tokens.narrow(1, 0, 8);
  auto labels = tokens.narrow(1, 1, 8);
  return torch::nn::functional::cross_entropy(m.forward(inputs).flatten(0, 1), labels.flatten());
}

// micro_batches > 1 exercises gradient accumulation with sync only on the last micro-batch.
int run(int micro_batches, int64_t bucket_cap_bytes) {
  auto env = distributed::detect_launch_env();
  auto world = distributed::init_distributed(env);
  const int rank = world->rank(), size = world->world_size();

  auto model = make_model();
  auto reference = make_model();  // the unwrapped single-process run, stepped alongside
  ddp::DataParallel ddp(*model, world->world(), {bucket_cap_bytes, true});
  if (bucket_cap_bytes < 4096 && ddp.num_buckets() < 3) {
    std::fprintf(stderr, "expected several buckets, got %d\n", ddp.num_buckets());
    return 1;
  }
  for (int step = 0; step < 2; ++step) {  // twice: buckets must re-arm after a step
    ddp.zero_grad();
    for (int micro = 0; micro < micro_batches; ++micro) {
      ddp.set_gradient_sync(micro + 1 == micro_batches);
      (loss_of(*model, batch_of(rank, micro + step * 10)) / micro_batches).backward();
    }
    ddp.finish_gradient_sync();

    reference->zero_grad();
    for (int r = 0; r < size; ++r) {
      for (int micro = 0; micro < micro_batches; ++micro) {
        (loss_of(*reference, batch_of(r, micro + step * 10)) / (micro_batches * size)).backward();
      }
    }
    auto got = model->named_parameters();
    auto want = reference->named_parameters();
    for (size_t i = 0; i < got.size(); ++i) {
      const auto& g = got[i].tensor().grad();
      const auto& w = want[i].tensor().grad();
      const double diff = (g - w).abs().max().item<double>();
      if (!(diff <= 1e-6)) {
        std::fprintf(stderr, "rank %d step %d: grad of %s differs by %g\n", rank, step,
                     got[i].name.c_str(), diff);
        return 1;
      }
    }
    // Keep replicas identical for the next step, as an optimizer would.
    torch::NoGradGuard no_grad;
    for (auto& p : got) p.slot->tensor.sub_(p.tensor().grad(), 0.1);
    for (auto& p : want) p.slot->tensor.sub_(p.tensor().grad(), 0.1);
  }
  std::printf("rank %d: ddp gradients match the reference (%d buckets)\n", rank, ddp.num_buckets());
  world->shutdown();
  return 0;
}
}  // namespace

int main(int argc, char** argv) {
  const std::string scenario = argc > 1 ? argv[1] : "";
  try {
    if (scenario == "grads") return run(1, 25 << 20);
    if (scenario == "small_buckets") return run(1, 2048);
    if (scenario == "accumulate") return run(3, 2048);
    std::fprintf(stderr, "unknown scenario '%s'\n", scenario.c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
