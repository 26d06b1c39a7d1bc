// loom_plan_report: plans every FSDP group of Llama 3 8B / 70B / 405B (one group per transformer
// block plus the root group, as TorchTitan wraps them; fp32) at W = 8, 64, 512 with element, row
// and 32-row-block granularity, and prints a markdown table of the planner's padding against
// FSDP2's Shard(0) padding and the planning time. docs/fsdp_planner.md holds its output.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "loom/core/error.h"
#include "loom/core/timer.h"
#include "loom/fsdp/planner.h"

namespace {

using loom::fsdp::GroupSpec;
using loom::fsdp::Plan;
using loom::fsdp::TensorSpec;
using loom::tensor::Granularity;

// Shapes only; defined here so the report does not depend on the model code.
struct LlamaShape {
  const char* name;
  int64_t dim;
  int64_t n_layers;
  int64_t n_heads;
  int64_t n_kv_heads;
  int64_t ffn_dim;
  int64_t vocab;
};

constexpr int64_t kHeadDim = 128;
constexpr int64_t kFp32Bytes = 4;
constexpr LlamaShape kModels[] = {
    {"8B", 4096, 32, 32, 8, 14336, 128256},
    {"70B", 8192, 80, 64, 8, 28672, 128256},
    {"405B", 16384, 126, 128, 8, 53248, 128256},
};
constexpr int64_t kWorldSizes[] = {8, 64, 512};
constexpr int kRepeats = 5;

// A granularity policy for a whole model. 1-D parameters (the norm weights) are element-granular
// under every policy, as in veScale-FSDP: for "row" that is what a row of a 1-D tensor is anyway,
// and for "32-row block" a 32-element block of a norm vector serves no block-wise consumer.
struct Policy {
  const char* label;
  Granularity matrix;  // for parameters with 2+ dims
};
const Policy kPolicies[] = {
    {"element", Granularity::element()},
    {"row", Granularity::row()},
    {"32-row block", Granularity::row_block(32)},
};

TensorSpec spec(const std::string& name, std::vector<int64_t> shape, const Policy& policy) {
  const Granularity g = shape.size() >= 2 ? policy.matrix : Granularity::element();
  return {name, std::move(shape), kFp32Bytes, g};
}

std::vector<GroupSpec> llama_groups(const LlamaShape& m, const Policy& p) {
  const int64_t q_rows = m.n_heads * kHeadDim;
  const int64_t kv_rows = m.n_kv_heads * kHeadDim;
  std::vector<GroupSpec> groups;
  groups.reserve(static_cast<size_t>(m.n_layers) + 1);
  for (int64_t i = 0; i < m.n_layers; ++i) {
    const std::string b = "layers." + std::to_string(i) + ".";
    groups.push_back({"layers." + std::to_string(i),
                      {spec(b + "attention_norm.weight", {m.dim}, p),
                       spec(b + "attention.wq.weight", {q_rows, m.dim}, p),
                       spec(b + "attention.wk.weight", {kv_rows, m.dim}, p),
                       spec(b + "attention.wv.weight", {kv_rows, m.dim}, p),
                       spec(b + "attention.wo.weight", {m.dim, q_rows}, p),
                       spec(b + "ffn_norm.weight", {m.dim}, p),
                       spec(b + "feed_forward.w1.weight", {m.ffn_dim, m.dim}, p),
                       spec(b + "feed_forward.w2.weight", {m.dim, m.ffn_dim}, p),
                       spec(b + "feed_forward.w3.weight", {m.ffn_dim, m.dim}, p)}});
  }
  groups.push_back({"root",
                    {spec("tok_embeddings.weight", {m.vocab, m.dim}, p),
                     spec("norm.weight", {m.dim}, p),
                     spec("output.weight", {m.vocab, m.dim}, p)}});
  return groups;
}

void report() {
  std::printf(
      "| model | W | granularity | params | planner padding | planner padding elements | "
      "FSDP2 Shard(0) padding | groups not in module order | tensors split by padding | "
      "planning time, all groups (best of %d) |\n"
      "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|\n",
      kRepeats);
  for (const LlamaShape& model : kModels) {
    for (int64_t world : kWorldSizes) {
      for (const Policy& policy : kPolicies) {
        const std::vector<GroupSpec> groups = llama_groups(model, policy);
        // Best of a few runs: the machine is shared, and the planner is deterministic, so the
        // fastest run is the planner's cost without scheduler noise.
        std::vector<Plan> plans;
        double ms = 0;
        for (int rep = 0; rep < kRepeats; ++rep) {
          loom::Timer timer;
          plans = loom::fsdp::plan_groups(groups, world);
          const double t = timer.seconds() * 1e3;
          ms = rep == 0 ? t : std::min(ms, t);
        }
        int64_t numel = 0, buffer = 0, shard0_buffer = 0, reordered = 0, split = 0;
        for (const Plan& plan : plans) {
          loom::fsdp::validate_plan(plan);  // outside the timed region
          numel += plan.total_numel();
          buffer += plan.buffer_elems();
          shard0_buffer += plan.shard0_buffer_elems();
          reordered += plan.order != loom::fsdp::TensorOrder::kModule;
          for (size_t i = 0; i < plan.tensors.size(); ++i) split += !plan.contiguous(i);
        }
        std::printf("| %s | %lld | %s | %.3fB | %.4f %% | %lld | %.4f %% | %lld / %zu | %lld | "
                    "%.2f ms |\n",
                    model.name, static_cast<long long>(world), policy.label, numel / 1e9,
                    100.0 * static_cast<double>(buffer - numel) / static_cast<double>(buffer),
                    static_cast<long long>(buffer - numel),
                    100.0 * static_cast<double>(shard0_buffer - numel) /
                        static_cast<double>(shard0_buffer),
                    static_cast<long long>(reordered), plans.size(),
                    static_cast<long long>(split), ms);
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) {
    std::fprintf(stderr,
                 "usage: %s\nPrints the FSDP planner's padding and planning time on Llama 3 "
                 "8B/70B/405B shapes as a markdown table (takes no arguments).\n",
                 argv[0]);
    return loom::kExitUsage;
  }
  try {
    report();
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return e.exit_code();
  }
  return 0;
}
