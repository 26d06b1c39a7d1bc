// On-disk layout of a sharded checkpoint, its metadata, and how to find a usable one.
//
//   <folder>/step-<N>/rank-<R>.safetensors   rank R's chunks: one 1-D tensor "<name>@<begin>" each
//   <folder>/step-<N>/rank-<R>.meta.json     rank R's chunk records (written last: "R is done")
//   <folder>/step-<N>/metadata.json          every tensor's global shape, dtype and chunks (file,
//                                            flat range, byte range, CRC-32C), the JSON state
//   <folder>/step-<N>/COMPLETE               written last by rank 0: {"step", "metadata_crc32c"}
// A save writes into step-<N>.tmp and rank 0 renames it once every rank has reported; a checkpoint
// counts only with its COMPLETE marker, whose recorded CRC also covers metadata.json.
#pragma once
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "loom/checkpoint/safetensors.h"
#include "loom/core/error.h"

#include "loom/checkpoint/region.h"

namespace loom::checkpoint {

inline constexpr const char* kMetadataFile = "metadata.json";
inline constexpr const char* kCompleteMarker = "COMPLETE";
inline constexpr const char* kMetadataFormat = "loom.checkpoint/1";

// A checkpoint that is truncated, corrupted or half-written: callers skip it for an earlier one.
// The message names the offending file.
class CorruptCheckpointError : public Error {
 public:
  using Error::Error;
};

std::string step_dir_name(int64_t step);                          // "step-100"
std::optional<int64_t> parse_step_dir_name(const std::string& name);  // "step-100" -> 100
std::string rank_file_name(int rank);                             // "rank-3.safetensors"
std::string rank_meta_name(int rank);                             // "rank-3.meta.json"
// The chunk's name in its rank file: "<tensor>@<begin>" for a range of the whole tensor (every
// checkpoint's format before boxes), "<tensor>@<o0>,<o1>,...@<begin>" for a range of a box.
std::string chunk_key(const std::string& tensor, const Region& region);
// Empty when `regions` hold every element of a tensor of `shape` exactly once, else what is wrong.
std::string tiling_error(const std::vector<int64_t>& shape, const std::vector<Region>& regions);

struct SavedChunk {
  int64_t begin = 0;  // flat element range [begin, end) of the global tensor, or of the box
  int64_t end = 0;
  std::vector<int64_t> box_offsets;  // empty: the whole tensor (checkpoint/region.h)
  std::vector<int64_t> box_sizes;
  std::string file;   // rank file name inside the checkpoint directory
  std::string key;    // tensor name inside that file
  int64_t byte_begin = 0;  // absolute byte range in the file
  int64_t byte_end = 0;
  uint32_t crc32c = 0;     // of bytes [byte_begin, byte_end)
  Region region() const { return {box_offsets, box_sizes, begin, end}; }
};

struct SavedTensor {
  std::string component;
  std::vector<int64_t> shape;
  c10::ScalarType dtype = c10::kFloat;  // as stored (after any export conversion)
  std::vector<SavedChunk> chunks;       // sorted by region; together they hold every element once
  int64_t numel() const;
};

struct CheckpointMetadata {
  int64_t step = 0;
  int world_size = 1;
  bool model_only = false;
  std::optional<c10::ScalarType> export_dtype;
  std::map<std::string, SavedTensor> tensors;
  std::map<std::string, int64_t> file_bytes;  // rank file name -> its size
  nlohmann::json json = nlohmann::json::object();  // global state (from rank 0)
  std::vector<nlohmann::json> rank_json;           // per saving rank

  nlohmann::json to_json() const;
  // Parses and validates (chunks tile each tensor, files are listed, byte ranges match sizes);
  // any violation is a CorruptCheckpointError naming `where`.
  static CheckpointMetadata from_json(const nlohmann::json& j, const std::string& where);
  // Reads <dir>/metadata.json.
  static CheckpointMetadata read(const std::filesystem::path& dir);
};

struct CheckpointInfo {
  int64_t step = 0;
  std::filesystem::path path;  // <folder>/step-<N>
};

// Complete checkpoints (COMPLETE marker present) in `folder`, newest first, unverified. A missing
// folder has none.
std::vector<CheckpointInfo> list_complete_checkpoints(const std::filesystem::path& folder);

enum class Verification {
  kStructure,  // marker, metadata (and its CRC), every rank file present with its recorded size
  kChecksums,  // kStructure, then every chunk's CRC-32C (reads the whole checkpoint)
};

// Checks <dir> and returns its metadata; throws CorruptCheckpointError naming the first bad file.
CheckpointMetadata verify_checkpoint(const std::filesystem::path& dir, Verification level);

// A mapped rank file and where its data section starts (8 + header length), since metadata byte
// ranges are absolute file offsets.
struct RankFile {
  SafetensorsFile file;
  int64_t data_start = 0;
};

// Opens rank file `name` of checkpoint `dir` after checking its size against the metadata, so a
// truncated file is reported as such. Throws CorruptCheckpointError.
RankFile open_rank_file(const std::filesystem::path& dir, const std::string& name,
                        const CheckpointMetadata& metadata);

// A saved chunk's data: a 1-D view of the mapped file (copy-on-write, so the file never changes),
// after checking that the file's entry matches the metadata and, when `check_crc`, its CRC-32C.
// Throws CorruptCheckpointError naming the file.
torch::Tensor read_saved_chunk(const RankFile& file, const SavedChunk& chunk,
                               c10::ScalarType dtype, bool check_crc);

// The newest complete checkpoint that verifies at `level`; a broken newer one is skipped with a
// warning naming the file. nullopt when there is none.
std::optional<CheckpointInfo> find_latest_complete(const std::filesystem::path& folder,
                                                   Verification level = Verification::kChecksums);

// Restart policy for a supervisor (`loom launch --max-restarts`): after a rank failure, restart
// the whole job while fewer than `max_restarts` restarts happened; the ranks then resume from the
// newest complete checkpoint (load_latest verifies checksums and falls back further if needed).
struct RestartDecision {
  bool restart = false;
  std::optional<CheckpointInfo> resume_from;  // nullopt: start from scratch
  std::string message;  // one line for the supervisor's log
};
RestartDecision decide_restart(const std::filesystem::path& folder, int restarts_done,
                               int max_restarts);

}  // namespace loom::checkpoint
