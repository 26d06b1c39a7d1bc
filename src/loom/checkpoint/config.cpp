#include "loom/checkpoint/config.h"

namespace loom::checkpoint {

const options::EnumNames<AsyncMode>& option_names(AsyncMode) {
  static const options::EnumNames<AsyncMode> names = {{"disabled", AsyncMode::kDisabled}, {"async", AsyncMode::kAsync}};
  return names;
}

const options::EnumNames<ExportDtype>& option_names(ExportDtype) {
  static const options::EnumNames<ExportDtype> names = {
      {"float32", ExportDtype::kFloat32}, {"bfloat16", ExportDtype::kBFloat16}, {"float16", ExportDtype::kFloat16}};
  return names;
}

c10::ScalarType scalar_type(ExportDtype dtype) {
  switch (dtype) {
    case ExportDtype::kFloat32: return c10::kFloat;
    case ExportDtype::kBFloat16: return c10::kBFloat16;
    case ExportDtype::kFloat16: return c10::kHalf;
  }
  return c10::kFloat;
}

namespace {
void check(const CheckpointConfig& c) {
  const options::Section& s = checkpoint_section();
  options::require(!c.folder.empty(), s, "folder", "a non-empty path", &c);
  options::require(c.interval > 0, s, "interval", "> 0", &c);
  options::require(c.keep_latest_k == 0 || c.keep_latest_k >= 2, s, "keep_latest_k", "0 (keep all) or >= 2", &c);
}
}  // namespace

const options::Section& checkpoint_section() {
  using S = CheckpointConfig;
  static const options::Section section{
      "checkpoint",
      {
          {LOOM_OPTION(S, enable), "Save checkpoints (and resume from the newest one in the folder at startup)."},
          {LOOM_OPTION(S, folder), "Checkpoint folder, relative to `job.dump_folder`."},
          {LOOM_OPTION(S, interval), "Save every this many steps, and at the last step."},
          {LOOM_OPTION(S, keep_latest_k),
           "Keep only the newest k checkpoints; `0` keeps all. `1` is rejected: the newest may still "
           "be being written when the previous one would be deleted."},
          {LOOM_OPTION(S, async_mode),
           "`disabled`: save inside the training loop. `async`: the save returns after planning; "
           "background threads copy the state into reused host buffers while the next step's forward "
           "and backward run (its optimizer step waits for the copy, not for the write) and write it "
           "with O_DIRECT where the filesystem allows."},
          {LOOM_OPTION(S, model_only),
           "The final save holds model weights only (in `export_dtype`), without optimizer, "
           "scheduler, data loader and RNG state; it cannot resume training."},
          {LOOM_OPTION(S, export_dtype), "Dtype of model-only final weights."},
          {LOOM_OPTION(S, initial_load_path),
           "Model weights to start from when the run's own checkpoint folder is empty: a Loom "
           "checkpoint (`loom convert --to loom` output, another run's `step-N`, or a checkpoint "
           "folder = its newest complete step; model tensors only, resharded to this layout) or a "
           "Hugging Face directory of the same model family (read by its config.json's model_type); "
           "empty = none."},
      },
      {},
      {},
      &options::validate_as<S, check>};
  return section;
}

}  // namespace loom::checkpoint
