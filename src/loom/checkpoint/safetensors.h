// The safetensors format (Hugging Face): an 8-byte little-endian header length N, N bytes of JSON
// {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}},
// then the raw little-endian tensor bytes. Plus the sharded form: `<prefix>.safetensors.index.json`
// {"metadata": {..}, "weight_map": {"name": "<prefix>-00001-of-00003.safetensors", ...}}.
//
// Reading maps the file privately (copy-on-write): tensors are zero-copy views that keep the
// mapping alive, and writing into them never changes the file. Writing is atomic (temporary file in
// the same directory, fsync, rename), so a crash never leaves a half-written checkpoint under the
// final name.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace loom::checkpoint {

struct SafetensorsEntry {
  std::string name;
  std::string dtype_name;  // as in the file: "F32", "BF16", ...
  c10::ScalarType dtype;
  std::vector<int64_t> shape;
  int64_t begin = 0;  // byte offsets into the data section
  int64_t end = 0;
  int64_t nbytes() const { return end - begin; }
};

// safetensors dtype name <-> ScalarType; both throw loom::Error on a type the format lacks.
c10::ScalarType safetensors_dtype(const std::string& name);
std::string safetensors_dtype_name(c10::ScalarType dtype);

class SafetensorsFile {
 public:
  // Maps and validates the whole header; a missing, truncated or malformed file throws a
  // one-line loom::Error naming it.
  explicit SafetensorsFile(const std::filesystem::path& path);

  const std::filesystem::path& path() const { return path_; }
  const std::vector<std::string>& names() const { return names_; }  // in data order
  bool contains(const std::string& name) const { return entries_.count(name) > 0; }
  const SafetensorsEntry& entry(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // CPU tensor of `name`: a zero-copy view of the mapping when its bytes are aligned for the
  // dtype, else a copy. Either way independent of the file on disk.
  torch::Tensor tensor(const std::string& name) const;

 private:
  struct Mapping;
  std::filesystem::path path_;
  std::shared_ptr<Mapping> mapping_;
  const uint8_t* data_ = nullptr;  // start of the data section inside the mapping
  std::vector<std::string> names_;
  std::unordered_map<std::string, SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

// Writes `tensors` (any device/layout; copied to contiguous CPU as needed) in the given order.
void save_safetensors(const std::filesystem::path& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// Hugging Face's sharded layout in `dir`: shards of at most max_shard_bytes (a larger tensor gets
// a shard of its own) named <prefix>-00001-of-0000N.safetensors plus <prefix>.safetensors.index.json;
// a single shard is written as <prefix>.safetensors with no index, as transformers does.
// Returns the files written.
std::vector<std::filesystem::path> save_safetensors_sharded(
    const std::filesystem::path& dir, const NamedTensors& tensors, int64_t max_shard_bytes,
    const std::string& prefix = "model", const std::map<std::string, std::string>& metadata = {});

// Writes a small text file (index, config.json) with the same temporary-file-and-rename
// atomicity as the tensor files.
void write_text_file_atomically(const std::filesystem::path& path, const std::string& text);

// Tensors by name from a single safetensors file or a sharded checkpoint's index.
class SafetensorsCheckpoint {
 public:
  // `path`: a .safetensors file, a .safetensors.index.json, or a directory holding
  // model.safetensors.index.json or model.safetensors.
  static SafetensorsCheckpoint open(const std::filesystem::path& path);

  const std::vector<std::string>& names() const { return names_; }
  bool contains(const std::string& name) const { return file_of_.count(name) > 0; }
  const SafetensorsEntry& entry(const std::string& name) const;
  torch::Tensor tensor(const std::string& name) const;
  const std::filesystem::path& source() const { return source_; }
  size_t num_files() const { return files_.size(); }

 private:
  std::filesystem::path source_;
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::unordered_map<std::string, size_t> file_of_;
  std::vector<std::string> names_;
};

}  // namespace loom::checkpoint
