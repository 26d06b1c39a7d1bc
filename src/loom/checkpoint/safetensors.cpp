#include "loom/checkpoint/safetensors.h"
#include "loom/core/strings.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "loom/core/error.h"

namespace loom::checkpoint {
namespace fs = std::filesystem;
static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; big-endian hosts would need byte swapping");

namespace {
// The reference implementation refuses headers above 100 MB; so do we (a corrupt length field
// must not make us allocate gigabytes).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

const std::vector<std::pair<std::string, c10::ScalarType>>& dtype_table() {
  static const std::vector<std::pair<std::string, c10::ScalarType>> table = {
      {"BOOL", c10::kBool},          {"U8", c10::kByte},
      {"I8", c10::kChar},            {"I16", c10::kShort},
      {"U16", c10::kUInt16},         {"I32", c10::kInt},
      {"U32", c10::kUInt32},         {"I64", c10::kLong},
      {"U64", c10::kUInt64},         {"F16", c10::kHalf},
      {"BF16", c10::kBFloat16},      {"F32", c10::kFloat},
      {"F64", c10::kDouble},         {"F8_E4M3", c10::kFloat8_e4m3fn},
      {"F8_E5M2", c10::kFloat8_e5m2}, {"C64", c10::kComplexFloat},
  };
  return table;
}

}  // namespace

c10::ScalarType safetensors_dtype(const std::string& name) {
  for (const auto& [n, t] : dtype_table()) {
    if (n == name) return t;
  }
  fail("unsupported safetensors dtype '", name, "'");
}

std::string safetensors_dtype_name(c10::ScalarType dtype) {
  for (const auto& [n, t] : dtype_table()) {
    if (t == dtype) return n;
  }
  fail("dtype ", c10::toString(dtype), " cannot be stored in safetensors");
}

// ---------------------------------------------------------------------------------------------
// Reading

struct SafetensorsFile::Mapping {
  void* base = MAP_FAILED;
  size_t size = 0;
  ~Mapping() {
    if (base != MAP_FAILED) munmap(base, size);
  }
};

SafetensorsFile::SafetensorsFile(const fs::path& path) : path_(path) {
  const std::string where = c10::str("safetensors file '", path.string(), "'");
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  LOOM_REQUIRE(fd >= 0, "cannot open ", where, ": ", errno_text());
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    ::close(fd);
    fail("cannot stat ", where, ": ", errno_text());
  }
  const auto file_size = static_cast<uint64_t>(st.st_size);
  if (file_size < 8) {
    ::close(fd);
    fail(where, " is truncated: ", file_size, " bytes, shorter than the 8-byte header length");
  }
  mapping_ = std::make_shared<Mapping>();
  mapping_->size = file_size;
  // Private + writable: tensors may be modified in place without touching the file.
  mapping_->base = mmap(nullptr, file_size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  ::close(fd);
  LOOM_REQUIRE(mapping_->base != MAP_FAILED, "cannot map ", where, ": ", errno_text());
  const auto* bytes = static_cast<const uint8_t*>(mapping_->base);

  uint64_t header_len = 0;
  std::memcpy(&header_len, bytes, 8);
  LOOM_REQUIRE(header_len <= kMaxHeaderBytes, where, " is not a safetensors file (header length ",
               header_len, " is implausible)");
  LOOM_REQUIRE(8 + header_len <= file_size, where, " is truncated: its header needs ",
               8 + header_len, " bytes, the file has ", file_size);
  data_ = bytes + 8 + header_len;
  const auto data_size = static_cast<int64_t>(file_size - 8 - header_len);

  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes + 8, bytes + 8 + header_len);
  } catch (const nlohmann::json::exception& e) {
    fail(where, " has a malformed JSON header (", e.what(), ")");
  }
  LOOM_REQUIRE(header.is_object(), where, " has a header that is not a JSON object");

  std::vector<SafetensorsEntry> entries;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      LOOM_REQUIRE(value.is_object(), where, ": __metadata__ is not an object");
      for (const auto& [k, v] : value.items()) {
        LOOM_REQUIRE(v.is_string(), where, ": __metadata__ value of '", k, "' is not a string");
        metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    SafetensorsEntry e;
    e.name = name;
    try {
      e.dtype_name = value.at("dtype").get<std::string>();
      e.shape = value.at("shape").get<std::vector<int64_t>>();
      const auto offsets = value.at("data_offsets").get<std::vector<int64_t>>();
      LOOM_REQUIRE(offsets.size() == 2, where, ": tensor '", name,
                   "' needs data_offsets [begin, end]");
      e.begin = offsets[0];
      e.end = offsets[1];
    } catch (const nlohmann::json::exception& ex) {
      fail(where, ": bad entry for tensor '", name, "' (", ex.what(), ")");
    }
    try {
      e.dtype = safetensors_dtype(e.dtype_name);
    } catch (const Error&) {
      fail(where, ": tensor '", name, "' has unsupported dtype '", e.dtype_name, "'");
    }
    int64_t numel = 1;
    for (const int64_t d : e.shape) {
      LOOM_REQUIRE(d >= 0, where, ": tensor '", name, "' has a negative dimension");
      numel *= d;
    }
    const int64_t expected = numel * static_cast<int64_t>(c10::elementSize(e.dtype));
    LOOM_REQUIRE(e.begin >= 0 && e.end >= e.begin && e.nbytes() == expected, where, ": tensor '",
                 name, "' spans ", e.nbytes(), " bytes but its shape and dtype need ", expected);
    LOOM_REQUIRE(e.end <= data_size, where, " is truncated: tensor '", name, "' ends at byte ",
                 e.end, " of a data section of ", data_size, " bytes");
    entries.push_back(std::move(e));
  }
  std::sort(entries.begin(), entries.end(),
            [](const auto& a, const auto& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < entries.size(); ++i) {
    LOOM_REQUIRE(entries[i].begin >= entries[i - 1].end, where, ": tensors '", entries[i - 1].name,
                 "' and '", entries[i].name, "' overlap");
  }
  for (auto& e : entries) {
    names_.push_back(e.name);
    entries_.emplace(e.name, std::move(e));
  }
}

const SafetensorsEntry& SafetensorsFile::entry(const std::string& name) const {
  const auto it = entries_.find(name);
  LOOM_REQUIRE(it != entries_.end(), "tensor '", name, "' is not in safetensors file '",
               path_.string(), "'");
  return it->second;
}

torch::Tensor SafetensorsFile::tensor(const std::string& name) const {
  const SafetensorsEntry& e = entry(name);
  const auto options = torch::TensorOptions().dtype(e.dtype).device(torch::kCPU);
  auto* ptr = const_cast<uint8_t*>(data_ + e.begin);
  const size_t alignment = c10::elementSize(e.dtype);
  if (reinterpret_cast<uintptr_t>(ptr) % alignment == 0) {
    std::shared_ptr<Mapping> keep_alive = mapping_;
    return torch::from_blob(
        ptr, e.shape, [keep_alive](void*) mutable { keep_alive.reset(); }, options);
  }
  torch::Tensor out = torch::empty(e.shape, options);
  std::memcpy(out.data_ptr(), ptr, static_cast<size_t>(e.nbytes()));
  return out;
}

// ---------------------------------------------------------------------------------------------
// Writing

namespace {
struct PreparedTensor {
  std::string name;
  torch::Tensor data;  // contiguous CPU
};

std::vector<PreparedTensor> prepare(const NamedTensors& tensors, const fs::path& path) {
  std::vector<PreparedTensor> out;
  std::unordered_map<std::string, int> seen;
  out.reserve(tensors.size());
  for (const auto& [name, tensor] : tensors) {
    LOOM_REQUIRE(!name.empty() && name != "__metadata__", "cannot save a tensor named '", name,
                 "' to '", path.string(), "'");
    LOOM_REQUIRE(seen.emplace(name, 1).second, "tensor '", name, "' given twice for '",
                 path.string(), "'");
    LOOM_REQUIRE(tensor.defined() && !tensor.is_meta(), "tensor '", name,
                 "' has no data (undefined or on the meta device); cannot save it to '",
                 path.string(), "'");
    safetensors_dtype_name(tensor.scalar_type());  // rejects unsupported dtypes early
    out.push_back({name, tensor.detach().to(torch::kCPU).contiguous()});
  }
  return out;
}

void write_all(int fd, const void* data, size_t size, const fs::path& tmp) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    LOOM_REQUIRE(n > 0, "cannot write '", tmp.string(), "': ", errno_text());
    p += n;
    size -= static_cast<size_t>(n);
  }
}

// Writes `contents` via a temporary file and an atomic rename.
template <typename WriteFn>
void write_atomically(const fs::path& path, WriteFn&& write) {
  const fs::path tmp = path.string() + c10::str(".tmp.", ::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  LOOM_REQUIRE(fd >= 0, "cannot create '", tmp.string(), "': ", errno_text(),
               "; check that the directory exists and is writable");
  try {
    write(fd, tmp);
    LOOM_REQUIRE(::fsync(fd) == 0, "cannot flush '", tmp.string(), "': ", errno_text());
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = errno_text();
    ::unlink(tmp.c_str());
    fail("cannot rename '", tmp.string(), "' to '", path.string(), "': ", why);
  }
}

void save_prepared(const fs::path& path, const std::vector<PreparedTensor>& tensors,
                   const std::map<std::string, std::string>& metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  int64_t offset = 0;
  for (const auto& t : tensors) {
    const auto nbytes = static_cast<int64_t>(t.data.nbytes());
    header[t.name] = {{"dtype", safetensors_dtype_name(t.data.scalar_type())},
                      {"shape", t.data.sizes().vec()},
                      {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string header_text = header.dump();
  // Pad with spaces so the data section starts 8-byte aligned (zero-copy reads).
  header_text.append((8 - header_text.size() % 8) % 8, ' ');
  const uint64_t header_len = header_text.size();
  write_atomically(path, [&](int fd, const fs::path& tmp) {
    write_all(fd, &header_len, 8, tmp);
    write_all(fd, header_text.data(), header_text.size(), tmp);
    for (const auto& t : tensors) write_all(fd, t.data.data_ptr(), t.data.nbytes(), tmp);
  });
}
}  // namespace

void save_safetensors(const fs::path& path, const NamedTensors& tensors,
                      const std::map<std::string, std::string>& metadata) {
  save_prepared(path, prepare(tensors, path), metadata);
}

void write_text_file_atomically(const fs::path& path, const std::string& text) {
  write_atomically(path, [&](int fd, const fs::path& tmp) {
    write_all(fd, text.data(), text.size(), tmp);
  });
}

std::vector<fs::path> save_safetensors_sharded(const fs::path& dir, const NamedTensors& tensors,
                                               int64_t max_shard_bytes, const std::string& prefix,
                                               const std::map<std::string, std::string>& metadata) {
  LOOM_REQUIRE(max_shard_bytes > 0, "max_shard_bytes must be positive, got ", max_shard_bytes);
  std::error_code ec;
  fs::create_directories(dir, ec);
  LOOM_REQUIRE(!ec, "cannot create directory '", dir.string(), "': ", ec.message());
  // Group in order; a shard closes when the next tensor would push it over the limit.
  std::vector<NamedTensors> shards(1);
  int64_t shard_bytes = 0;
  int64_t total_bytes = 0;
  for (const auto& nt : tensors) {
    const auto nbytes = static_cast<int64_t>(nt.second.numel() * nt.second.element_size());
    if (!shards.back().empty() && shard_bytes + nbytes > max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(nt);
    shard_bytes += nbytes;
    total_bytes += nbytes;
  }
  if (shards.size() == 1) {
    const fs::path path = dir / (prefix + ".safetensors");
    save_safetensors(path, shards[0], metadata);
    return {path};
  }
  std::vector<fs::path> written;
  nlohmann::json weight_map = nlohmann::json::object();
  const size_t n = shards.size();
  for (size_t i = 0; i < n; ++i) {
    char name[64];
    std::snprintf(name, sizeof(name), "-%05zu-of-%05zu.safetensors", i + 1, n);
    const std::string file = prefix + name;
    save_safetensors(dir / file, shards[i], metadata);
    for (const auto& nt : shards[i]) weight_map[nt.first] = file;
    written.push_back(dir / file);
  }
  nlohmann::json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
  for (const auto& [k, v] : metadata) index["metadata"][k] = v;
  const fs::path index_path = dir / (prefix + ".safetensors.index.json");
  write_text_file_atomically(index_path, index.dump(2) + "\n");
  written.push_back(index_path);
  return written;
}

// ---------------------------------------------------------------------------------------------
// Single file or sharded index

SafetensorsCheckpoint SafetensorsCheckpoint::open(const fs::path& path) {
  fs::path target = path;
  if (fs::is_directory(path)) {
    if (fs::exists(path / "model.safetensors.index.json")) {
      target = path / "model.safetensors.index.json";
    } else if (fs::exists(path / "model.safetensors")) {
      target = path / "model.safetensors";
    } else {
      fail("no model.safetensors or model.safetensors.index.json in '", path.string(), "'");
    }
  }
  LOOM_REQUIRE(fs::exists(target), "checkpoint file '", target.string(), "' does not exist");
  SafetensorsCheckpoint ckpt;
  ckpt.source_ = target;
  const std::string filename = target.filename().string();
  const std::string index_suffix = ".index.json";
  const bool is_index = filename.size() > index_suffix.size() &&
                        filename.compare(filename.size() - index_suffix.size(),
                                         index_suffix.size(), index_suffix) == 0;
  if (!is_index) {
    ckpt.files_.push_back(std::make_shared<SafetensorsFile>(target));
    for (const auto& name : ckpt.files_[0]->names()) {
      ckpt.file_of_[name] = 0;
      ckpt.names_.push_back(name);
    }
    return ckpt;
  }
  nlohmann::json index;
  {
    std::ifstream in(target);
    LOOM_REQUIRE(in.good(), "cannot read safetensors index '", target.string(), "'");
    try {
      index = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      fail("safetensors index '", target.string(), "' is not valid JSON (", e.what(), ")");
    }
  }
  LOOM_REQUIRE(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(),
               "safetensors index '", target.string(), "' has no \"weight_map\" object");
  std::map<std::string, size_t> file_ids;
  for (const auto& [name, file_json] : index["weight_map"].items()) {
    LOOM_REQUIRE(file_json.is_string(), "safetensors index '", target.string(),
                 "': weight_map entry '", name, "' is not a file name");
    const std::string file = file_json.get<std::string>();
    auto it = file_ids.find(file);
    if (it == file_ids.end()) {
      const fs::path shard = target.parent_path() / file;
      LOOM_REQUIRE(fs::exists(shard), "shard '", shard.string(), "' listed in '", target.string(),
                   "' does not exist");
      it = file_ids.emplace(file, ckpt.files_.size()).first;
      ckpt.files_.push_back(std::make_shared<SafetensorsFile>(shard));
    }
    LOOM_REQUIRE(ckpt.files_[it->second]->contains(name), "tensor '", name, "' is mapped to '",
                 file, "' by '", target.string(), "' but that shard does not hold it");
    ckpt.file_of_[name] = it->second;
    ckpt.names_.push_back(name);
  }
  return ckpt;
}

const SafetensorsEntry& SafetensorsCheckpoint::entry(const std::string& name) const {
  const auto it = file_of_.find(name);
  LOOM_REQUIRE(it != file_of_.end(), "tensor '", name, "' is not in checkpoint '",
               source_.string(), "'");
  return files_[it->second]->entry(name);
}

torch::Tensor SafetensorsCheckpoint::tensor(const std::string& name) const {
  const auto it = file_of_.find(name);
  LOOM_REQUIRE(it != file_of_.end(), "tensor '", name, "' is not in checkpoint '",
               source_.string(), "'");
  return files_[it->second]->tensor(name);
}

}  // namespace loom::checkpoint
