// Adapter revisions of a `loom rl` run (issue 51): every rl.save_every steps and at the end,
// job.dump_folder/adapters/step-N is written, whole or not at all (built in step-N.partial and
// renamed), holding
//   adapter_config.json, adapter_model.safetensors  a PEFT directory (models/common/adapter_dir.h):
//                      what `loom generate/score --adapter` and PeftModel.from_pretrained serve;
//   loom_revision.json {"step", "prompt_cursor", "rewards": {"mean", "std", "min", "max", "count"} of
//                      every completion scored since the previous revision (std: population),
//                      "base": {"path", "checksum"}: models::base_reference of the base, a CRC-32C
//                      of the files that define its weights (a Loom checkpoint's metadata.json, a
//                      Hugging Face folder's config.json and safetensors), not of the weights'
//                      values};
//   rl_state.safetensors the optimizer's and the LR schedule's state (AdapterOptimizer::state_dict).
// With the adapters, that is everything a run needs to continue exactly: rollouts are seeded by
// (training.seed, step, index) and prompts are taken in file order from the cursor.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "loom/lora/lora.h"
#include "loom/models/common/decoder.h"
#include "loom/models/spec.h"
#include "loom/rl/adapter_update.h"

namespace loom::rl {

inline constexpr const char* kRevisionFile = "loom_revision.json";
inline constexpr const char* kRlStateFile = "rl_state.safetensors";

// The rewards scored since the previous revision.
class RewardStats {
 public:
  void add(const std::vector<double>& rewards);
  nlohmann::json to_json() const;  // {"mean", "std", "min", "max", "count"}; nulls when empty
  void clear() { rewards_.clear(); }

 private:
  std::vector<double> rewards_;
};

struct RevisionInfo {
  int64_t step = 0;
  int64_t prompt_cursor = 0;
  nlohmann::json rewards;  // RewardStats::to_json()
  nlohmann::json base;     // models::base_reference of the base
};

// Writes `adapters_dir`/step-<info.step> (see above) from `model`'s adapters (applied with
// `options`) and `optimizer`'s state. An existing step-<N> is a loom::Error: revisions are never
// overwritten. Returns the directory.
std::filesystem::path write_revision(const std::filesystem::path& adapters_dir, const models::ModelSpec& spec,
                                     models::Decoder& model, const lora::LoRAOptions& options,
                                     const AdapterOptimizer& optimizer, const RevisionInfo& info);

// Reads a revision's loom_revision.json; a directory that is not one (no loom_revision.json or no
// rl_state.safetensors) is a one-line loom::UsageError naming it.
RevisionInfo read_revision(const std::filesystem::path& dir);

// The revisions in `adapters_dir` (step-N with a loom_revision.json), by step.
std::vector<std::filesystem::path> list_revisions(const std::filesystem::path& adapters_dir);

// Loads a revision's optimizer and LR-schedule state into `optimizer` (built over the adapters
// attached from the same revision).
void load_revision_state(const std::filesystem::path& dir, AdapterOptimizer& optimizer);

// Moves every revision of `adapters_dir` later than `step` into adapters_dir/rolled-back-<unix
// time>/ (same names); returns that folder, or nullopt when there was none.
std::optional<std::filesystem::path> move_later_revisions_aside(const std::filesystem::path& adapters_dir,
                                                                int64_t step);

// The revision a run starts from: `rollback` when set (its step; this run's later revisions in
// `adapters_dir` are moved aside first and the folder logged), else with `resume` the newest in
// `adapters_dir` (nullopt when there is none: step 1). Without either, an `adapters_dir` that
// already holds revisions is a one-line loom::UsageError: a fresh run would write over them.
std::optional<std::filesystem::path> revision_to_start_from(bool resume, const std::string& rollback,
                                                            const std::filesystem::path& adapters_dir);

}  // namespace loom::rl
