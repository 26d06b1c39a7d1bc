#include "loom/checkpoint/metadata.h"

#include <algorithm>
#include <cctype>
#include <fstream>
#include <sstream>

#include "loom/checkpoint/crc32c.h"
#include "loom/core/logging.h"

namespace loom::checkpoint {
namespace fs = std::filesystem;
using Json = nlohmann::json;

namespace {

[[noreturn]] void corrupt(const std::string& message) { throw CorruptCheckpointError(message); }

std::string read_file_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) corrupt(c10::str("cannot read '", path.string(), "'"));
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08x", v);
  return buf;
}

}  // namespace

std::string step_dir_name(int64_t step) { return c10::str("step-", step); }

std::optional<int64_t> parse_step_dir_name(const std::string& name) {
  const std::string prefix = "step-";
  if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0 ||
      name.size() - prefix.size() > 18) {
    return std::nullopt;
  }
  int64_t step = 0;
  for (size_t i = prefix.size(); i < name.size(); ++i) {
    if (!std::isdigit(static_cast<unsigned char>(name[i]))) return std::nullopt;
    step = step * 10 + (name[i] - '0');
  }
  return step;
}

std::string rank_file_name(int rank) { return c10::str("rank-", rank, ".safetensors"); }
std::string rank_meta_name(int rank) { return c10::str("rank-", rank, ".meta.json"); }
std::string chunk_key(const std::string& tensor, const Region& region) {
  if (region.whole_tensor_box()) return c10::str(tensor, "@", region.begin);
  std::string key = tensor + "@";
  for (size_t i = 0; i < region.box_offsets.size(); ++i) key += c10::str(i ? "," : "", region.box_offsets[i]);
  return c10::str(key, "@", region.begin);
}

std::string tiling_error(const std::vector<int64_t>& shape, const std::vector<Region>& regions) {
  int64_t numel = 1;
  for (const int64_t d : shape) numel *= d;
  struct Owned {
    Run run;
    size_t region;
  };
  std::vector<Owned> owned;
  for (size_t i = 0; i < regions.size(); ++i) {
    const std::string error = region_error(shape, regions[i]);
    if (!error.empty()) return c10::str("chunk ", describe(regions[i]), ": ", error);
    for (const Run& r : runs_of(shape, regions[i])) owned.push_back({r, i});
  }
  std::sort(owned.begin(), owned.end(), [](const Owned& a, const Owned& b) { return a.run.global < b.run.global; });
  int64_t next = 0;
  for (size_t i = 0; i < owned.size(); ++i) {
    const Run& r = owned[i].run;
    if (r.global < next) {
      return c10::str("chunks ", describe(regions[owned[i - 1].region]), " and ",
                      describe(regions[owned[i].region]), " overlap");
    }
    if (r.global > next) return c10::str("elements [", next, ", ", r.global, ") are held by no chunk");
    next = r.global + r.length;
  }
  if (next != numel) return c10::str("elements [", next, ", ", numel, ") are held by no chunk");
  return "";
}

int64_t SavedTensor::numel() const {
  int64_t n = 1;
  for (const int64_t d : shape) n *= d;
  return n;
}

// ---------------------------------------------------------------------------------------------
// metadata.json

Json CheckpointMetadata::to_json() const {
  Json tensors_json = Json::object();
  for (const auto& [name, t] : tensors) {
    Json chunks = Json::array();
    for (const SavedChunk& c : t.chunks) {
      Json cj = {{"begin", c.begin},
                 {"end", c.end},
                 {"file", c.file},
                 {"key", c.key},
                 {"bytes", {c.byte_begin, c.byte_end}},
                 {"crc32c", c.crc32c}};
      if (!c.box_offsets.empty()) cj["box"] = {{"offsets", c.box_offsets}, {"sizes", c.box_sizes}};
      chunks.push_back(std::move(cj));
    }
    tensors_json[name] = {{"component", t.component},
                          {"shape", t.shape},
                          {"dtype", safetensors_dtype_name(t.dtype)},
                          {"chunks", std::move(chunks)}};
  }
  return {{"format", kMetadataFormat},
          {"step", step},
          {"world_size", world_size},
          {"model_only", model_only},
          {"export_dtype",
           export_dtype ? Json(safetensors_dtype_name(*export_dtype)) : Json(nullptr)},
          {"files", file_bytes},
          {"tensors", std::move(tensors_json)},
          {"json", json},
          {"rank_json", rank_json}};
}

CheckpointMetadata CheckpointMetadata::from_json(const Json& j, const std::string& where) {
  CheckpointMetadata m;
  try {
    if (!j.is_object() || j.value("format", "") != kMetadataFormat) {
      corrupt(c10::str("'", where, "' is not a Loom checkpoint metadata file (expected format \"",
                       kMetadataFormat, "\")"));
    }
    m.step = j.at("step").get<int64_t>();
    m.world_size = j.at("world_size").get<int>();
    m.model_only = j.at("model_only").get<bool>();
    if (!j.at("export_dtype").is_null()) {
      m.export_dtype = safetensors_dtype(j.at("export_dtype").get<std::string>());
    }
    m.file_bytes = j.at("files").get<std::map<std::string, int64_t>>();
    m.json = j.at("json");
    m.rank_json = j.at("rank_json").get<std::vector<Json>>();
    for (const auto& [name, tj] : j.at("tensors").items()) {
      SavedTensor t;
      t.component = tj.at("component").get<std::string>();
      t.shape = tj.at("shape").get<std::vector<int64_t>>();
      t.dtype = safetensors_dtype(tj.at("dtype").get<std::string>());
      const auto elem = static_cast<int64_t>(c10::elementSize(t.dtype));
      std::vector<Region> regions;
      for (const auto& cj : tj.at("chunks")) {
        SavedChunk c;
        c.begin = cj.at("begin").get<int64_t>();
        c.end = cj.at("end").get<int64_t>();
        if (cj.contains("box")) {
          c.box_offsets = cj.at("box").at("offsets").get<std::vector<int64_t>>();
          c.box_sizes = cj.at("box").at("sizes").get<std::vector<int64_t>>();
        }
        c.file = cj.at("file").get<std::string>();
        c.key = cj.at("key").get<std::string>();
        const auto bytes = cj.at("bytes").get<std::vector<int64_t>>();
        if (bytes.size() != 2) corrupt(c10::str("'", where, "': chunk '", c.key, "' needs bytes [begin, end]"));
        c.byte_begin = bytes[0];
        c.byte_end = bytes[1];
        c.crc32c = cj.at("crc32c").get<uint32_t>();
        const auto file = m.file_bytes.find(c.file);
        if (c.end <= c.begin) {
          corrupt(c10::str("'", where, "': chunk '", c.key, "' of tensor '", name, "' is empty"));
        }
        if (file == m.file_bytes.end()) {
          corrupt(c10::str("'", where, "': chunk '", c.key, "' is in file '", c.file,
                           "', which is not listed under \"files\""));
        }
        if (c.byte_begin < 0 || c.byte_end - c.byte_begin != (c.end - c.begin) * elem ||
            c.byte_end > file->second) {
          corrupt(c10::str("'", where, "': chunk '", c.key, "' has byte range [", c.byte_begin,
                           ", ", c.byte_end, ") inconsistent with its ", c.end - c.begin, " ",
                           c10::toString(t.dtype), " elements or the ", file->second,
                           "-byte file"));
        }
        regions.push_back(c.region());
        t.chunks.push_back(std::move(c));
      }
      // Every element exactly once, whatever mix of ranges and boxes saved it.
      const std::string tiling = tiling_error(t.shape, regions);
      if (!tiling.empty()) {
        corrupt(c10::str("'", where, "': the chunks of tensor '", name, "' do not tile it: ", tiling));
      }
      std::sort(t.chunks.begin(), t.chunks.end(),
                [](const SavedChunk& a, const SavedChunk& b) { return a.region() < b.region(); });
      m.tensors.emplace(name, std::move(t));
    }
  } catch (const Json::exception& e) {
    corrupt(c10::str("'", where, "' is malformed (", e.what(), ")"));
  } catch (const CorruptCheckpointError&) {
    throw;
  } catch (const Error& e) {  // e.g. an unknown dtype name
    corrupt(c10::str("'", where, "': ", e.what()));
  }
  return m;
}

CheckpointMetadata CheckpointMetadata::read(const fs::path& dir) {
  const fs::path path = dir / kMetadataFile;
  const std::string text = read_file_bytes(path);
  Json j;
  try {
    j = Json::parse(text);
  } catch (const Json::exception& e) {
    corrupt(c10::str("'", path.string(), "' is not valid JSON (", e.what(), ")"));
  }
  return from_json(j, path.string());
}

// ---------------------------------------------------------------------------------------------
// Finding and verifying checkpoints

std::vector<CheckpointInfo> list_complete_checkpoints(const fs::path& folder) {
  std::vector<CheckpointInfo> out;
  std::error_code ec;
  if (!fs::is_directory(folder, ec)) return out;
  for (const auto& entry : fs::directory_iterator(folder, ec)) {
    if (!entry.is_directory(ec)) continue;
    const auto step = parse_step_dir_name(entry.path().filename().string());
    if (!step) continue;
    if (!fs::exists(entry.path() / kCompleteMarker, ec)) {
      log::debug("ignoring incomplete checkpoint '", entry.path().string(), "' (no ",
                 kCompleteMarker, " marker)");
      continue;
    }
    out.push_back({*step, entry.path()});
  }
  std::sort(out.begin(), out.end(),
            [](const CheckpointInfo& a, const CheckpointInfo& b) { return a.step > b.step; });
  return out;
}

RankFile open_rank_file(const fs::path& dir, const std::string& name,
                        const CheckpointMetadata& metadata) {
  const fs::path path = dir / name;
  const auto expected = metadata.file_bytes.find(name);
  if (expected == metadata.file_bytes.end()) {
    corrupt(c10::str("'", path.string(), "' is not listed in ", kMetadataFile));
  }
  std::error_code ec;
  const auto size = fs::file_size(path, ec);
  if (ec) corrupt(c10::str("checkpoint file '", path.string(), "' is missing (", ec.message(), ")"));
  if (static_cast<int64_t>(size) != expected->second) {
    corrupt(c10::str("checkpoint file '", path.string(), "' is ", size < static_cast<uintmax_t>(expected->second) ? "truncated" : "oversized", ": ", size,
                     " bytes, ", kMetadataFile, " records ", expected->second));
  }
  try {
    uint64_t header_len = 0;
    {
      std::ifstream in(path, std::ios::binary);
      in.read(reinterpret_cast<char*>(&header_len), 8);
    }
    RankFile rf{SafetensorsFile(path), static_cast<int64_t>(8 + header_len)};
    return rf;
  } catch (const CorruptCheckpointError&) {
    throw;
  } catch (const Error& e) {
    corrupt(e.what());
  }
}

torch::Tensor read_saved_chunk(const RankFile& rf, const SavedChunk& chunk, c10::ScalarType dtype,
                               bool check_crc) {
  const std::string& where = rf.file.path().string();
  if (!rf.file.contains(chunk.key)) {
    corrupt(c10::str("checkpoint file '", where, "' lacks chunk '", chunk.key, "'"));
  }
  const SafetensorsEntry& e = rf.file.entry(chunk.key);
  if (e.dtype != dtype || e.shape != std::vector<int64_t>{chunk.end - chunk.begin} ||
      rf.data_start + e.begin != chunk.byte_begin || rf.data_start + e.end != chunk.byte_end) {
    corrupt(c10::str("checkpoint file '", where, "': chunk '", chunk.key,
                     "' does not match ", kMetadataFile, " (dtype, length or byte range)"));
  }
  torch::Tensor data = rf.file.tensor(chunk.key);
  if (check_crc) {
    const uint32_t crc = crc32c(data.data_ptr(), data.nbytes());
    if (crc != chunk.crc32c) {
      corrupt(c10::str("checkpoint file '", where, "' is corrupted: chunk '", chunk.key,
                       "' (bytes ", chunk.byte_begin, "..", chunk.byte_end, ") has CRC-32C ",
                       hex32(crc), " but ", kMetadataFile, " records ", hex32(chunk.crc32c)));
    }
  }
  return data;
}

CheckpointMetadata verify_checkpoint(const fs::path& dir, Verification level) {
  const fs::path marker = dir / kCompleteMarker;
  std::error_code ec;
  if (!fs::exists(marker, ec)) {
    corrupt(c10::str("'", marker.string(), "' is missing: the checkpoint was never completed"));
  }
  Json marker_json;
  try {
    marker_json = Json::parse(read_file_bytes(marker));
    (void)marker_json.at("metadata_crc32c").get<uint32_t>();
  } catch (const Json::exception& e) {
    corrupt(c10::str("'", marker.string(), "' is malformed (", e.what(), ")"));
  }
  const fs::path metadata_path = dir / kMetadataFile;
  const std::string metadata_text = read_file_bytes(metadata_path);
  const uint32_t crc = crc32c(metadata_text.data(), metadata_text.size());
  const auto recorded = marker_json.at("metadata_crc32c").get<uint32_t>();
  if (crc != recorded) {
    corrupt(c10::str("'", metadata_path.string(), "' is corrupted: CRC-32C ", hex32(crc), ", ",
                     kCompleteMarker, " records ", hex32(recorded)));
  }
  Json j;
  try {
    j = Json::parse(metadata_text);
  } catch (const Json::exception& e) {
    corrupt(c10::str("'", metadata_path.string(), "' is not valid JSON (", e.what(), ")"));
  }
  CheckpointMetadata m = CheckpointMetadata::from_json(j, metadata_path.string());
  for (const auto& [name, bytes] : m.file_bytes) {
    const fs::path path = dir / name;
    const auto size = fs::file_size(path, ec);
    if (ec) corrupt(c10::str("checkpoint file '", path.string(), "' is missing"));
    if (static_cast<int64_t>(size) != bytes) {
      corrupt(c10::str("checkpoint file '", path.string(), "' is ",
                       static_cast<int64_t>(size) < bytes ? "truncated" : "oversized", ": ", size,
                       " bytes, ", kMetadataFile, " records ", bytes));
    }
  }
  if (level == Verification::kChecksums) {
    std::map<std::string, std::vector<std::pair<const SavedChunk*, c10::ScalarType>>> by_file;
    for (const auto& [name, t] : m.tensors) {
      for (const SavedChunk& c : t.chunks) by_file[c.file].emplace_back(&c, t.dtype);
    }
    for (const auto& [file, chunks] : by_file) {
      const RankFile rf = open_rank_file(dir, file, m);
      for (const auto& [chunk, dtype] : chunks) read_saved_chunk(rf, *chunk, dtype, true);
    }
  }
  return m;
}

std::optional<CheckpointInfo> find_latest_complete(const fs::path& folder, Verification level) {
  for (const CheckpointInfo& info : list_complete_checkpoints(folder)) {
    try {
      verify_checkpoint(info.path, level);
      return info;
    } catch (const CorruptCheckpointError& e) {
      log::warn("skipping checkpoint '", info.path.string(), "': ", e.what(),
                "; falling back to an earlier one");
    }
  }
  return std::nullopt;
}

RestartDecision decide_restart(const fs::path& folder, int restarts_done, int max_restarts) {
  RestartDecision d;
  if (restarts_done >= max_restarts) {
    d.message = c10::str("not restarting: ", restarts_done, " of ", max_restarts,
                         " allowed restarts already used");
    return d;
  }
  d.restart = true;
  d.resume_from = find_latest_complete(folder, Verification::kStructure);
  d.message = d.resume_from
                  ? c10::str("restart ", restarts_done + 1, " of ", max_restarts,
                             ": resuming from checkpoint '", d.resume_from->path.string(), "'")
                  : c10::str("restart ", restarts_done + 1, " of ", max_restarts,
                             ": no complete checkpoint in '", folder.string(),
                             "', starting from scratch");
  return d;
}

}  // namespace loom::checkpoint
