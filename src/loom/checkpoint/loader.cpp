#include "loom/checkpoint/loader.h"
#include "loom/core/strings.h"

#include <algorithm>
#include <exception>
#include <unordered_map>

#include "loom/checkpoint/metadata.h"
#include "loom/core/error.h"
#include "loom/core/error_report.h"
#include "loom/core/logging.h"
#include "loom/core/timer.h"

namespace loom::checkpoint {
namespace fs = std::filesystem;
using Json = nlohmann::json;

namespace {

// Saved chunks opened and checksummed on first use; each is verified once however many
// destination chunks it feeds.
class ChunkReader {
 public:
  ChunkReader(fs::path dir, const CheckpointMetadata& metadata)
      : dir_(std::move(dir)), metadata_(metadata) {}

  const torch::Tensor& data(const SavedChunk& chunk, c10::ScalarType dtype) {
    auto it = chunks_.find(chunk.key);
    if (it != chunks_.end()) return it->second;
    auto file = files_.find(chunk.file);
    if (file == files_.end()) {
      file = files_
                 .emplace(chunk.file, std::make_unique<RankFile>(
                                          open_rank_file(dir_, chunk.file, metadata_)))
                 .first;
    }
    torch::Tensor t = read_saved_chunk(*file->second, chunk, dtype, /*check_crc=*/true);
    bytes_read_ += static_cast<int64_t>(t.nbytes());
    return chunks_.emplace(chunk.key, std::move(t)).first->second;
  }
  int64_t bytes_read() const { return bytes_read_; }

 private:
  fs::path dir_;
  const CheckpointMetadata& metadata_;
  std::unordered_map<std::string, std::unique_ptr<RankFile>> files_;
  std::unordered_map<std::string, torch::Tensor> chunks_;
  int64_t bytes_read_ = 0;
};

// Every saved chunk of one tensor cut into runs (checkpoint/region.h), sorted by global position.
struct SavedRuns {
  struct Piece {
    Run run;
    const SavedChunk* chunk;
  };
  std::vector<Piece> pieces;

  explicit SavedRuns(const SavedTensor& saved) {
    for (const SavedChunk& c : saved.chunks) {
      for (const Run& r : runs_of(saved.shape, c.region())) pieces.push_back({r, &c});
    }
    std::sort(pieces.begin(), pieces.end(),
              [](const Piece& a, const Piece& b) { return a.run.global < b.run.global; });
  }
};

// Fills `dest` from the saved chunks it overlaps: each destination run takes the pieces of the
// saved runs it intersects (for two ranges of the whole tensor that is one copy per overlap).
void copy_overlaps(const SavedTensor& saved, const SavedRuns& saved_runs, const LocalChunk& dest,
                   ChunkReader& reader) {
  const bool in_place = dest.data.is_contiguous();
  torch::Tensor flat = in_place ? dest.data.view(-1) : torch::empty({dest.data.numel()},
                                                                     dest.data.options());
  const auto& pieces = saved_runs.pieces;
  for (const Run& want : runs_of(saved.shape, dest.region())) {
    const int64_t want_end = want.global + want.length;
    // The first saved run ending after the start, then every one starting before the end.
    auto it = std::upper_bound(pieces.begin(), pieces.end(), want.global,
                               [](int64_t v, const SavedRuns::Piece& p) { return v < p.run.global + p.run.length; });
    for (; it != pieces.end() && it->run.global < want_end; ++it) {
      const int64_t lo = std::max(want.global, it->run.global);
      const int64_t hi = std::min(want_end, it->run.global + it->run.length);
      const torch::Tensor& src = reader.data(*it->chunk, saved.dtype);
      flat.narrow(0, want.local + (lo - want.global), hi - lo)
          .copy_(src.narrow(0, it->run.local + (lo - it->run.global), hi - lo));
    }
  }
  if (!in_place) dest.data.copy_(flat.view(dest.data.sizes()));
}

}  // namespace

LoadResult load_checkpoint(const fs::path& dir, const ShardedStateDict& dest, int rank,
                           const LoadOptions& options) {
  std::error_code ec;
  LOOM_REQUIRE_USAGE(fs::is_directory(dir, ec), "checkpoint '", dir.string(),
                     "' does not exist; check the checkpoint folder and step");
  const CheckpointMetadata metadata = verify_checkpoint(dir, Verification::kStructure);
  if (metadata.model_only && options.skip_model_only) {
    throw ModelOnlyCheckpointError(c10::str(
        "checkpoint '", dir.string(), "' holds model weights only (checkpoint.model_only) and "
        "cannot resume training; start a new run from it with checkpoint.initial_load_path = '",
        dir.string(), "'"));
  }
  LoadResult result;
  result.step = metadata.step;
  result.path = dir;
  result.saved_world_size = metadata.world_size;
  result.model_only = metadata.model_only;
  result.json = metadata.json;
  if (options.check_state) options.check_state(dir, metadata.json);
  if (rank >= 0 && rank < static_cast<int>(metadata.rank_json.size())) {
    result.rank_json = metadata.rank_json[static_cast<size_t>(rank)];
  }
  ChunkReader reader(dir, metadata);
  for (const auto& [name, t] : dest.tensors()) {
    const auto it = metadata.tensors.find(name);
    if (it == metadata.tensors.end()) {
      if (!options.strict) {
        result.missing.push_back(name);
        continue;
      }
      if (metadata.model_only && t.component != kModelComponent) {
        fail("tensor '", name, "' is not in checkpoint '", dir.string(),
             "', which holds model weights only; load just the model state "
             "(ShardedStateDict::only(\"model\")) or load non-strictly");
      }
      fail_incompatible_checkpoint(
          "tensor '", name, "' is not in checkpoint '", dir.string(), "' (", metadata.tensors.size(),
          " tensors saved); it was saved from another model or configuration");
    }
    const SavedTensor& saved = it->second;
    LOOM_REQUIRE_COMPATIBLE(saved.shape == t.shape, "tensor '", name, "' has shape ", shape_text(saved.shape),
                 " in checkpoint '", dir.string(), "' but ", shape_text(t.shape),
                 " here; it was saved from another model configuration");
    const SavedRuns saved_runs(saved);
    for (const LocalChunk& chunk : t.chunks) copy_overlaps(saved, saved_runs, chunk, reader);
  }
  result.bytes_read = reader.bytes_read();
  return result;
}

std::optional<LoadResult> load_latest(const fs::path& folder, const ShardedStateDict& dest,
                                      CheckpointGroup& group, const LoadOptions& options) {
  // Rank 0's listing decides, so no two ranks can pick different checkpoints.
  Json steps = Json::array();
  if (group.rank() == 0) {
    for (const CheckpointInfo& info : list_complete_checkpoints(folder)) steps.push_back(info.step);
  }
  steps = Json::parse(group.all_gather(steps.dump())[0]);
  std::vector<fs::path> model_only;
  for (const auto& step_json : steps) {
    const auto step = step_json.get<int64_t>();
    const fs::path dir = folder / step_dir_name(step);
    Timer timer;
    std::optional<LoadResult> result;
    std::exception_ptr error;
    // 0 loaded; 1 corrupt, 2 model-only (both: try an earlier one); 3 unusable here (stop).
    int code = 0;
    try {
      result = load_checkpoint(dir, dest, group.rank(), options);
    } catch (const CorruptCheckpointError& e) {
      code = 1;
      log::warn("checkpoint '", dir.string(), "' is unusable: ", e.what());
    } catch (const ModelOnlyCheckpointError&) {
      code = 2;
      model_only.push_back(dir);
    } catch (const std::exception&) {
      code = 3;
      error = std::current_exception();
    }
    const int64_t worst = group.all_reduce_max(code);
    if (worst == 0) {
      if (group.rank() == 0 && options.log_loaded) {
        log::info("loaded checkpoint '", dir.string(), "' (saved by ", result->saved_world_size,
                  " ranks; ", result->bytes_read >> 20, " MiB read on rank 0 in ", timer.seconds(),
                  " s)");
      }
      return result;
    }
    if (worst == 3) {
      // Every rank ends with the failing ranks' exit code, so an incompatible checkpoint is exit
      // 2 on all of them (not 1 where only a peer saw it), and `loom launch` does not restart.
      const int own_code = error ? describe_exception(error).exit_code : 0;
      const auto code_of_failure = static_cast<int>(group.all_reduce_max(own_code));
      if (error) std::rethrow_exception(error);
      throw Error(c10::str("loading checkpoint '", dir.string(), "' failed on another rank (see its log)"),
                  code_of_failure);
    }
    if (group.rank() == 0) {
      if (worst == 2) {
        log::info("checkpoint '", dir.string(), "' holds model weights only; resuming from an "
                  "earlier full checkpoint instead");
      } else {
        log::warn("skipping corrupt checkpoint '", dir.string(), "'; falling back to an earlier one");
      }
    }
  }
  if (!model_only.empty() && model_only.size() == steps.size()) {
    fail_usage("checkpoint folder '", folder.string(), "' holds only model-only checkpoints (newest: '",
               model_only.front().string(), "'), which cannot resume training; to continue from "
               "those weights set checkpoint.initial_load_path to it and checkpoint.folder (or "
               "job.dump_folder) to a new folder; to train again from scratch, move '",
               folder.parent_path().string(), "' away (a finished `make train` leaves such a folder)");
  }
  LOOM_REQUIRE(steps.empty(), "none of the ", steps.size(), " complete checkpoints in '",
               folder.string(), "' could be loaded (see the warnings above); move them away to "
               "start from scratch");
  return std::nullopt;
}

LoadResult load_step(const fs::path& folder, int64_t step, const ShardedStateDict& dest,
                     CheckpointGroup& group, const LoadOptions& options) {
  const fs::path dir = folder / step_dir_name(step);
  std::optional<LoadResult> result;
  std::exception_ptr error;
  try {
    result = load_checkpoint(dir, dest, group.rank(), options);
  } catch (const std::exception&) {
    error = std::current_exception();
  }
  if (group.all_reduce_max(error ? 1 : 0) != 0) {
    if (error) std::rethrow_exception(error);
    fail("loading checkpoint '", dir.string(), "' failed on another rank (see its log)");
  }
  return std::move(*result);
}

}  // namespace loom::checkpoint
