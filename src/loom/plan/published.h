// Published H100 training throughput that `loom plan --explain` compares a layout with
// (docs/planner.md has the table of predicted vs published and which rows fitted constants).
#pragma once
#include <string>
#include <vector>

namespace loom::plan {

struct PublishedRow {
  std::string model, flavor;  // Loom's model name and flavor
  int gpus = 0;
  int64_t seq_len = 0, global_batch = 0;
  std::string layout;         // as published
  double tokens_per_gpu_s = 0;
  std::string source;         // where it is published
  bool float8 = false;        // FP8 linears (Megatron-Bridge's FP8 current scaling; TorchTitan's Float8)
};

// NeMo AutoModel's DGX-H100 bf16 pre-training rows, Megatron-Bridge's DGX-H100 rows that Loom can
// express (dense FP8 current scaling, GPT-OSS bf16) and TorchTitan's Llama 3.1 rows.
const std::vector<PublishedRow>& published_rows();

// The row nearest a run: the same model and flavor first (else the same model, else any), then the
// same precision (FP8 linears or not), then the closest device count (by ratio), then the closest
// global batch in tokens. nullptr: no rows.
const PublishedRow* nearest_published(const std::string& model, const std::string& flavor, int gpus, int64_t seq_len,
                                      int64_t global_batch, bool float8 = false);

}  // namespace loom::plan
