#include "loom/plan/published.h"

#include <cmath>
#include <tuple>

namespace loom::plan {

const std::vector<PublishedRow>& published_rows() {
  static const std::string nemo =
      "NeMo AutoModel performance summary, DGX-H100 BF16 "
      "(https://docs.nvidia.com/nemo/automodel/latest/performance/performance-summary.md)";
  static const std::string megatron =
      "Megatron-Bridge performance summary, DGX-H100 "
      "(NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md, NeMo containers 25.11 and 26.02)";
  static const std::string titan = "TorchTitan's Llama 3.1 H100 benchmarks (/work/shared/ANCHORS.md)";
  static const std::vector<PublishedRow> rows = {
      {"llama3", "70B", 64, 8192, 128, "CP 2 x FSDP 32, MBS 1, GA 4", 866.77, nemo},
      {"qwen3_moe", "30B-A3B", 8, 4096, 512, "EP 8 x FSDP 8, MBS 4, GA 16", 12040, nemo},
      {"deepseek_v3", "671B", 256, 4096, 512, "PP 4 (VP 8) x EP 64 x FSDP 64, MBS 1, LBS 8", 1002, nemo},
      {"deepseek_v3", "671B", 1024, 4096, 8192, "PP 4 (VP 8) x EP 64 x FSDP 256, MBS 1, LBS 8, GA 4", 865, nemo},
      {"gpt_oss", "20B", 8, 4096, 256, "EP 8 x FSDP 8, MBS 2, GA 16 (ep_size from NeMo's benchmark config)", 13058, nemo},
      {"gpt_oss", "120B", 64, 4096, 512, "EP 64 x FSDP 64, MBS 2, GA 4 (ep_size from NeMo's benchmark config)", 7626, nemo},
      {"llama3", "8B", 8, 8192, 128, "FSDP 8, MBS 1, GA 16, FP8 current scaling (25.11)", 14451, megatron, true},
      {"llama3", "70B", 64, 8192, 128, "TP 4 x PP 8 (VP 5) x DP 2, MBS 1, FP8 current scaling (25.11)", 1602, megatron, true},
      {"llama3", "70B", 64, 8192, 256, "TP 4 x PP 8 (VP 5) x DP 2, MBS 1, FP8 (26.02)", 1621, megatron, true},
      {"llama3", "405B", 1024, 8192, 512, "TP 8 x PP 8 (VP 8) x CP 2 x DP 8, MBS 1, FP8 current scaling (25.11)", 292,
       megatron, true},
      {"llama3", "405B", 1024, 8192, 1536, "TP 8 x PP 8 (VP 8) x CP 2 x DP 8, MBS 1, FP8 (26.02)", 311, megatron, true},
      {"gpt_oss", "120B", 64, 4096, 512, "PP 4 x EP 8 x DP 16, MBS 4 (25.11)", 5630, megatron},
      {"gpt_oss", "120B", 64, 4096, 1280, "PP 4 x EP 8 x DP 16, MBS 1 (26.02)", 5993, megatron},
      {"llama3", "8B", 8, 8192, 16, "FSDP 8, local batch 2, per-op SAC", 5762, titan},
      {"llama3", "8B", 128, 8192, 256, "FSDP 128, local batch 2, per-op SAC", 5605, titan},
      {"llama3", "405B", 512, 8192, 128, "FSDP 8 x TP 8 x PP 8, Interleaved1F1B", 128, titan},
  };
  return rows;
}

const PublishedRow* nearest_published(const std::string& model, const std::string& flavor, int gpus, int64_t seq_len,
                                      int64_t global_batch, bool float8) {
  const PublishedRow* best = nullptr;
  std::tuple<int, bool, double, double> best_key;
  for (const PublishedRow& row : published_rows()) {
    const int match = row.model == model ? (row.flavor == flavor ? 0 : 1) : 2;
    const double devices = std::abs(std::log(static_cast<double>(row.gpus) / std::max(1, gpus)));
    const double tokens = std::abs(std::log(static_cast<double>(row.seq_len * row.global_batch) /
                                            std::max<double>(1.0, static_cast<double>(seq_len * global_batch))));
    const auto key = std::make_tuple(match, row.float8 != float8, devices, tokens);
    if (best == nullptr || key < best_key) best = &row, best_key = key;
  }
  return best;
}

}  // namespace loom::plan
