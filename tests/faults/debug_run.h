// What the fault suite's cases share: the `loom train` arguments of a small debug run (seq 64,
// `rows` rows per rank, `steps` steps, logged every step) in a dump folder, through the source tree.
#pragma once
#include <filesystem>
#include <string>

#include "loom/core/build_paths.h"

namespace loom::faults {

inline std::string src(const std::string& rel) { return std::string(loom::kSourceDir) + "/" + rel; }

inline std::string debug_train_args(const std::filesystem::path& dump, int steps, int rows,
                                    const std::string& extra = "") {
  return " train --config " + src("configs/llama3_debug.toml") + " --validation.enable=false" +
         " --model.tokenizer_path=" + src("data/default/tokenizer.json") +
         " --training.dataset_path=" + src("data/default/corpus.jsonl") +
         " --job.dump_folder=" + dump.string() + " --training.seq_len=64 --training.local_batch_size=" +
         std::to_string(rows) + " --training.steps=" + std::to_string(steps) +
         " --lr_scheduler.warmup_steps=2 --metrics.log_freq=1 --metrics.peak_flops=1e11"
         " --comm.timeout_seconds=120" + extra;
}

}  // namespace loom::faults
