#include "loom/core/dtype.h"
#include "loom/checkpoint/checkpointer.h"

#include "loom/core/error.h"

namespace loom::checkpoint {

void CheckpointOptions::validate() const {
  LOOM_REQUIRE_USAGE(!folder.empty(), "checkpoint.folder is empty; set it to the directory that "
                     "holds step-N checkpoints");
  LOOM_REQUIRE_USAGE(interval >= 0, "checkpoint.interval must be >= 0 (0 = only the last step), "
                     "got ", interval);
  LOOM_REQUIRE_USAGE(keep_latest_k >= 0, "checkpoint.keep_latest_k must be >= 0 (0 keeps all), "
                     "got ", keep_latest_k);
  LOOM_REQUIRE_USAGE(staging_max_bytes >= 4096, "checkpoint staging memory must be at least 4096 "
                     "bytes, got ", staging_max_bytes);
  LOOM_REQUIRE_USAGE(!export_dtype || c10::isFloatingType(*export_dtype),
                     "checkpoint.export_dtype must be float32, bfloat16 or float16");
  LOOM_REQUIRE_USAGE(!export_dtype || last_save_model_only,
                     "checkpoint.export_dtype applies to the model-only last save; set "
                     "checkpoint.last_save_model_only = true as well");
  LOOM_REQUIRE_USAGE(!load_step || *load_step >= 0, "checkpoint.load_step must be >= 0, got ",
                     *load_step);
  LOOM_REQUIRE_USAGE(finalize_timeout.count() > 0, "checkpoint finalize timeout must be positive");
}


namespace {
SaverOptions saver_options(const CheckpointOptions& o) {
  o.validate();
  return {o.keep_latest_k, o.staging_max_bytes, o.finalize_timeout};
}
}  // namespace

Checkpointer::Checkpointer(CheckpointOptions options, std::shared_ptr<CheckpointGroup> group)
    : options_(std::move(options)),
      group_(std::move(group)),
      saver_(group_, saver_options(options_)) {}

bool Checkpointer::due(int64_t step, bool last_step) const {
  return last_step || (options_.interval > 0 && step % options_.interval == 0);
}

bool Checkpointer::maybe_save(int64_t step, const StateProvider& state, bool last_step) {
  if (!due(step, last_step)) return false;
  SaveOptions save_options;
  if (last_step && options_.last_save_model_only) {
    save_options.model_only = true;
    save_options.export_dtype = options_.export_dtype;
  }
  save(step, state(), save_options);
  if (last_step) saver_.wait();  // the run ends here: the last checkpoint must be on disk
  return true;
}

void Checkpointer::save(int64_t step, const ShardedStateDict& state, const SaveOptions& options) {
  if (options_.async) {
    saver_.begin_async_save(state, options_.folder, step, options);
  } else {
    saver_.save(state, options_.folder, step, options);
  }
}

std::optional<LoadResult> Checkpointer::load(const ShardedStateDict& dest,
                                             const LoadOptions& options) {
  saver_.wait();
  if (options_.load_step) return load_step(options_.folder, *options_.load_step, dest, *group_, options);
  return load_latest(options_.folder, dest, *group_, options);
}

}  // namespace loom::checkpoint
