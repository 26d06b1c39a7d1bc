#include "loom/data/sources.h"

#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <unordered_set>

#include "loom/core/error.h"
#include "loom/data/arrow_sources.h"
#include "loom/core/files.h"
#include "loom/core/strings.h"

namespace loom::data {

namespace fs = std::filesystem;

// The token file stores little-endian integers and is read by mapping it: the host must match.
static_assert(std::endian::native == std::endian::little, "token files assume a little-endian host");

const char* source_format_name(SourceFormat format) {
  switch (format) {
    case SourceFormat::kText: return "text";
    case SourceFormat::kJsonl: return "jsonl";
    case SourceFormat::kTokens: return "tokens";
    case SourceFormat::kSft: return "sft";
    case SourceFormat::kParquet: return "parquet";
    case SourceFormat::kArrow: return "arrow";
  }
  return "?";
}

namespace {

bool is_hidden(const fs::path& p) {
  const std::string name = p.filename().string();
  return !name.empty() && name[0] == '.';
}

void add_directory(const fs::path& dir, const std::string& extension, std::vector<std::string>& out) {
  std::vector<std::string> files;
  for (auto it = fs::recursive_directory_iterator(dir, fs::directory_options::follow_directory_symlink);
       it != fs::recursive_directory_iterator(); ++it) {
    if (is_hidden(it->path())) {
      if (it->is_directory()) it.disable_recursion_pending();
      continue;
    }
    // Only regular files: a FIFO, device or socket in a data folder is not data and reading it
    // could block forever.
    if (it->is_regular_file() && (extension.empty() || it->path().extension() == extension)) {
      files.push_back(it->path().string());
    }
  }
  std::sort(files.begin(), files.end());
  out.insert(out.end(), files.begin(), files.end());
}

// Closes a descriptor on every way out of a reader.
struct FdGuard {
  int fd;
  ~FdGuard() {
    if (fd >= 0) ::close(fd);
  }
};

// Reads a file line by line (std::getline's contract: a line without its '\n', a last line
// without one too) from a descriptor it owns.
class LineReader {
 public:
  LineReader(const std::string& path, int fd) : path_(path), file_(::fdopen(fd, "rb")) {
    if (file_ == nullptr) {
      const std::string why = errno_text();
      ::close(fd);
      fail("cannot read JSONL file '", path, "': ", why);
    }
  }
  ~LineReader() {
    std::fclose(file_);
    std::free(buffer_);
  }
  LineReader(const LineReader&) = delete;
  LineReader& operator=(const LineReader&) = delete;

  bool next(std::string& line) {
    const ssize_t n = ::getline(&buffer_, &capacity_, file_);
    if (n < 0) {
      LOOM_REQUIRE(!std::ferror(file_), "cannot read JSONL file '", path_, "': ", errno_text());
      return false;
    }
    line.assign(buffer_, static_cast<size_t>(n) - (n > 0 && buffer_[n - 1] == '\n' ? 1 : 0));
    return true;
  }

 private:
  std::string path_;
  FILE* file_;
  char* buffer_ = nullptr;
  size_t capacity_ = 0;
};

}  // namespace

std::string input_description(const std::string& spec, const std::string& setting) {
  return setting.empty() ? c10::str("data input '", spec, "'") : c10::str(setting, " = \"", spec, "\"");
}

std::string directory_extension(std::optional<SourceFormat> format) {
  if (format == SourceFormat::kParquet) return ".parquet";
  if (format == SourceFormat::kArrow) return ".arrow";
  return "";
}

std::vector<std::string> resolve_inputs(const std::vector<std::string>& specs, const std::string& setting,
                                        const std::string& directory_extension) {
  LOOM_REQUIRE_USAGE(!specs.empty(), "no data input given: pass files, directories or globs");
  std::vector<std::string> files;
  // stat() follows symlinks and never opens, so a FIFO is recognised without blocking on it.
  auto add = [&](const std::string& path, const std::string& who) {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) return false;
    if (S_ISDIR(st.st_mode)) {
      add_directory(path, directory_extension, files);
    } else if (S_ISREG(st.st_mode)) {
      files.push_back(path);
    } else {
      fail_not_regular_file(who, st.st_mode);
    }
    return true;
  };
  for (const std::string& spec : specs) {
    const size_t before = files.size();
    const std::string who = input_description(spec, setting);
    if (add(spec, who)) {
      // a file or directory
    } else if (spec.find_first_of("*?[") != std::string::npos) {
      glob_t g{};
      const int rc = ::glob(spec.c_str(), 0, nullptr, &g);
      std::vector<std::string> matches;
      if (rc == 0) matches.assign(g.gl_pathv, g.gl_pathv + g.gl_pathc);
      globfree(&g);
      std::sort(matches.begin(), matches.end());
      for (const std::string& m : matches) {
        if (is_hidden(m)) continue;
        add(m, c10::str("'", m, "' (matched by ", who, ")"));
      }
    } else {
      fail_usage(who, " does not exist; point it at a file, a directory or a glob");
    }
    LOOM_REQUIRE_USAGE(files.size() > before, who, " names no file");
  }
  std::unordered_set<std::string> seen;
  std::vector<std::string> unique;
  for (std::string& f : files) {
    if (seen.insert(fs::weakly_canonical(f).string()).second) unique.push_back(std::move(f));
  }
  return unique;
}

SourceFormat parse_source_format(std::string_view name) {
  for (SourceFormat f : {SourceFormat::kText, SourceFormat::kJsonl, SourceFormat::kTokens, SourceFormat::kParquet,
                         SourceFormat::kArrow}) {
    if (name == source_format_name(f)) return f;
  }
  fail_usage("unknown data format '", name, "'; use \"jsonl\", \"text\", \"tokens\", \"parquet\" or \"arrow\"");
}

const options::EnumNames<DatasetFormat>& option_names(DatasetFormat) {
  static const options::EnumNames<DatasetFormat> names = {{"jsonl", DatasetFormat::kJsonl},
                                                          {"text", DatasetFormat::kText},
                                                          {"tokens", DatasetFormat::kTokens},
                                                          {"sft", DatasetFormat::kSft},
                                                          {"parquet", DatasetFormat::kParquet},
                                                          {"arrow", DatasetFormat::kArrow},
                                                          {"auto", DatasetFormat::kAuto}};
  return names;
}

std::optional<SourceFormat> source_format(DatasetFormat format) {
  switch (format) {
    case DatasetFormat::kJsonl: return SourceFormat::kJsonl;
    case DatasetFormat::kText: return SourceFormat::kText;
    case DatasetFormat::kTokens: return SourceFormat::kTokens;
    case DatasetFormat::kSft: return SourceFormat::kSft;
    case DatasetFormat::kParquet: return SourceFormat::kParquet;
    case DatasetFormat::kArrow: return SourceFormat::kArrow;
    case DatasetFormat::kAuto: return std::nullopt;
  }
  return std::nullopt;
}

const options::Section& option_section(const DatasetSource*) {
  using S = DatasetSource;
  static const options::Section section{
      "datasets",
      {
          {LOOM_OPTION(S, path), "The source's data: a file, a directory or a glob, as `training.dataset_path`."},
          {LOOM_OPTION(S, format), "How its files are read (the formats of `training.dataset_format`)."},
          {LOOM_OPTION(S, weight),
           "Its share of the mixture's documents is `weight / sum of weights`; `>= 0`, not all 0."},
          {LOOM_OPTION(S, text_column), "Parquet/Arrow column with the text; empty = `training.text_column`."},
      }};
  return section;
}

bool is_token_file(const std::string& path) {
  FdGuard fd{open_regular_file(path, "data file")};
  char magic[sizeof(kTokenFileMagic)] = {};
  return ::pread(fd.fd, magic, sizeof(magic), 0) == static_cast<ssize_t>(sizeof(magic)) &&
         std::memcmp(magic, kTokenFileMagic, sizeof(magic)) == 0;
}

SourceFormat detect_format(const std::string& path) {
  if (is_token_file(path)) return SourceFormat::kTokens;
  if (has_parquet_magic(path)) return SourceFormat::kParquet;
  if (has_arrow_magic(path)) return SourceFormat::kArrow;
  const std::string ext = fs::path(path).extension().string();
  if (ext == ".jsonl" || ext == ".ndjson") return SourceFormat::kJsonl;
  return SourceFormat::kText;
}

SourceFormat resolve_format(const std::string& path, const SourceOptions& options) {
  if (!options.format) {
    const SourceFormat detected = detect_format(path);
    // A name that says Parquet or Arrow with content that is neither: most often a git-lfs pointer
    // (a clone without git-lfs), which would otherwise train as a few lines of text.
    const std::string ext = fs::path(path).extension().string();
    const bool parquet_name = ext == ".parquet" || ext == ".pq";
    const bool arrow_name = ext == ".arrow" || ext == ".feather" || ext == ".ipc";
    if ((parquet_name || arrow_name) && detected != SourceFormat::kParquet && detected != SourceFormat::kArrow) {
      std::string head(64, '\0');
      {
        FdGuard fd{open_regular_file(path, "data file")};
        const ssize_t n = ::pread(fd.fd, head.data(), head.size(), 0);
        head.resize(n > 0 ? static_cast<size_t>(n) : 0);
      }
      const bool lfs = head.rfind("version https://git-lfs", 0) == 0;
      fail_usage("data file '", path, "' is named like ", parquet_name ? "a Parquet" : "an Arrow", " file but has no ",
                 parquet_name ? "PAR1" : "Arrow", " magic",
                 lfs ? " (it is a git-lfs pointer: fetch the data with 'git lfs pull')" : "",
                 "; replace it with the real file, or set ", options.format_setting,
                 " to \"text\" or \"jsonl\" to read it as that");
    }
    return detected;
  }
  const SourceFormat format = *options.format;
  const char* name = source_format_name(format);
  // Only the token magic is checked here: it is certain, where JSONL and text can hold each other
  // (a JSONL line that is not JSON fails later, naming its line).
  const bool tokens = is_token_file(path);
  if (format == SourceFormat::kTokens) {
    LOOM_REQUIRE_USAGE(tokens, "data file '", path, "' is not a loom token file (no LOOMTOK magic) but ",
                       options.format_setting, " is \"tokens\"; pre-tokenize it with 'loom tokenizer ",
                       "pretokenize', or set ", options.format_setting,
                       " to the file's format (\"jsonl\", \"text\" or \"auto\")");
  } else {
    LOOM_REQUIRE_USAGE(!tokens, "data file '", path, "' is a loom token file but ", options.format_setting,
                       " is \"", name, "\"; set ", options.format_setting, " to \"tokens\" (or \"auto\")");
  }
  // Parquet and Arrow files carry magic bytes too; a file without them is refused before reading.
  if (format == SourceFormat::kParquet || format == SourceFormat::kArrow) {
    const bool parquet = format == SourceFormat::kParquet;
    LOOM_REQUIRE_USAGE(parquet ? has_parquet_magic(path) : has_arrow_magic(path), "data file '", path,
                       "' is not ", parquet ? "a Parquet file (no PAR1 magic)" : "an Arrow IPC file (no stream or ARROW1 magic)",
                       " but ", options.format_setting, " is \"", name, "\"; set ", options.format_setting,
                       " to the file's format (or \"auto\")");
  }
  return format;
}

std::string read_file(const std::string& path, const char* what) {
  FdGuard fd{open_regular_file(path, what)};
  struct stat st {};
  LOOM_REQUIRE(::fstat(fd.fd, &st) == 0, "cannot read ", what, " '", path, "': ", errno_text());
  std::string data(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::read(fd.fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    LOOM_REQUIRE(n >= 0, "cannot read ", what, " '", path, "': ", errno_text());
    LOOM_REQUIRE(n > 0, "cannot read ", what, " '", path, "': it shrank while being read");
    done += static_cast<size_t>(n);
  }
  return data;
}

void for_each_text_document(const std::string& path, const SourceOptions& options,
                            const std::function<void(std::string_view)>& fn) {
  const SourceFormat format = resolve_format(path, options);
  LOOM_REQUIRE(format != SourceFormat::kTokens, "'", path,
               "' is a pre-tokenized token file, not text; use it as loader input directly");
  // An sft line is a conversation, not one text: only the loader renders it (with its template).
  LOOM_REQUIRE_USAGE(format != SourceFormat::kSft, "'", path, "' is read as sft data (", options.format_setting,
                     "), which only the trainer's loader takes; use \"jsonl\" for plain JSONL text");
  if (format == SourceFormat::kParquet || format == SourceFormat::kArrow) {
    for_each_table_document(path, format, options, fn);
    return;
  }
  if (format == SourceFormat::kText) {
    const std::string text = read_file(path, "text file");
    if (options.text_separator.empty()) {
      if (!text.empty() || !options.skip_empty) fn(text);
      return;
    }
    std::string_view rest = text;
    while (!rest.empty()) {
      const size_t p = rest.find(options.text_separator);
      const std::string_view doc = rest.substr(0, p);
      if (!doc.empty() || !options.skip_empty) fn(doc);
      if (p == std::string_view::npos) break;
      rest.remove_prefix(p + options.text_separator.size());
    }
    return;
  }
  for_each_jsonl_record(path, options, [&](const nlohmann::json& record, int64_t line_no) {
    auto field = record.is_object() ? record.find(options.jsonl_field) : record.end();
    LOOM_REQUIRE(record.is_object() && field != record.end() && field->is_string(), path, ":", line_no,
                 ": no string field '", options.jsonl_field, "' (each JSONL line must be an object with the",
                 " document text in that field; choose the field with ", options.jsonl_field_setting, ")");
    const std::string& text = field->get_ref<const std::string&>();
    if (!text.empty() || !options.skip_empty) fn(text);
  });
}

void for_each_jsonl_record(const std::string& path, const SourceOptions& options,
                           const std::function<void(const nlohmann::json& record, int64_t line_no)>& fn) {
  // Streamed line by line (a JSONL corpus can exceed memory) from a descriptor opened without
  // blocking (open_regular_file).
  LineReader in(path, open_regular_file(path, "JSONL file"));
  std::string line;
  for (int64_t line_no = 1; in.next(line); ++line_no) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json record;
    try {
      record = nlohmann::json::parse(line);
    } catch (const nlohmann::json::parse_error& e) {
      std::string m = e.what();
      if (const size_t close = m.find("] "); m[0] == '[' && close != std::string::npos) m = m.substr(close + 2);
      // nlohmann quotes what it read ("last read: '<the record so far>'"), which is the whole
      // record when it is one long token: quote its start only, with its size.
      const std::string kLastRead = "last read: '";
      if (const size_t at = m.find(kLastRead); at != std::string::npos && m.back() == '\'') {
        const size_t begin = at + kLastRead.size();
        m = m.substr(0, begin) + excerpt(std::string_view(m).substr(begin, m.size() - 1 - begin)) + "'";
      }
      m = excerpt(m, 240);  // any other message that quotes the record
      // A configured format may be the mistake (plain text read as JSONL): say how to change it.
      fail(path, ":", line_no, ": not valid JSON: ", m,
           options.format ? c10::str(" (", options.format_setting, " is \"", source_format_name(*options.format),
                                     "\"; set it to \"text\" for plain text)")
                          : std::string());
    }
    fn(record, line_no);
  }
}

// ---- token files ------------------------------------------------------------------------------

namespace {

void put_u32(char* p, uint32_t v) { std::memcpy(p, &v, sizeof(v)); }
void put_i64(char* p, int64_t v) { std::memcpy(p, &v, sizeof(v)); }
uint32_t get_u32(const unsigned char* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
int64_t get_i64(const unsigned char* p) {
  int64_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

void encode_header(const TokenFileHeader& h, char* out) {
  std::memset(out, 0, kTokenFileHeaderBytes);
  std::memcpy(out, kTokenFileMagic, sizeof(kTokenFileMagic));
  put_u32(out + 8, kTokenFileVersion);
  put_u32(out + 12, h.bytes_per_token);
  put_i64(out + 16, h.num_tokens);
  put_i64(out + 24, h.num_documents);
  put_i64(out + 32, h.vocab_size);
  put_i64(out + 40, h.bos_id);
  put_i64(out + 48, h.eos_id);
}

constexpr size_t kWriteBufferBytes = 1 << 20;

}  // namespace

std::string default_token_cache_dir() {
  for (const char* var : {"LOOM_CACHE_DIR", "XDG_CACHE_HOME", "HOME"}) {
    const char* value = std::getenv(var);
    if (value == nullptr || *value == '\0') continue;
    const fs::path base(value);
    if (std::string_view(var) == "LOOM_CACHE_DIR") return (base / "tokens").string();
    if (std::string_view(var) == "XDG_CACHE_HOME") return (base / "loom" / "tokens").string();
    return (base / ".cache" / "loom" / "tokens").string();
  }
  return {};
}

TokenFileWriter::TokenFileWriter(const std::string& path, int64_t vocab_size, int64_t bos_id, int64_t eos_id)
    // The temporary name is the process's own: several processes (the ranks of a job filling the
    // token cache) may write the same file at once, and each renames a complete file into place.
    : path_(path), tmp_path_(c10::str(path, ".tmp.", ::getpid())) {
  LOOM_REQUIRE(vocab_size > 0 && vocab_size <= (int64_t{1} << 32), "token file '", path,
               "': vocab size ", vocab_size, " does not fit in uint32 ids");
  LOOM_REQUIRE(eos_id >= 0 && eos_id < vocab_size, "token file '", path, "': EOS id ", eos_id,
               " is not in [0, ", vocab_size, "); documents are delimited by EOS, so the tokenizer needs one");
  LOOM_REQUIRE(bos_id >= -1 && bos_id < vocab_size, "token file '", path, "': BOS id ", bos_id,
               " is not in [0, ", vocab_size, ") or -1");
  std::error_code dir_ec;
  LOOM_REQUIRE(!fs::is_directory(path, dir_ec), "cannot write token file '", path,
               "': it is a directory; pass a file path such as ", (fs::path(path) / "corpus.bin").string());
  header_.bytes_per_token = vocab_size <= 65536 ? 2 : 4;
  header_.vocab_size = vocab_size;
  header_.bos_id = bos_id;
  header_.eos_id = eos_id;
  const fs::path p(path);
  if (p.has_parent_path()) {
    std::error_code ec;
    fs::create_directories(p.parent_path(), ec);
  }
  file_ = std::fopen(tmp_path_.c_str(), "wb");
  LOOM_REQUIRE(file_, "cannot write token file '", path, "': ", std::strerror(errno));
  char header[kTokenFileHeaderBytes];
  encode_header(header_, header);
  buffer_.assign(header, header + kTokenFileHeaderBytes);
  buffer_.reserve(kWriteBufferBytes + 8);
}

TokenFileWriter::~TokenFileWriter() {
  if (file_) {
    std::fclose(file_);
    std::remove(tmp_path_.c_str());
  }
}

void TokenFileWriter::flush() {
  if (!buffer_.empty() && std::fwrite(buffer_.data(), 1, buffer_.size(), file_) != buffer_.size()) {
    fail("cannot write token file '", path_, "': ", std::strerror(errno));
  }
  buffer_.clear();
}

void TokenFileWriter::add_document(const std::vector<int64_t>& tokens) {
  LOOM_REQUIRE(file_, "token file '", path_, "' is already closed");
  if (tokens.empty()) return;
  auto append = [&](int64_t id) {
    LOOM_REQUIRE(id >= 0 && id < header_.vocab_size, "token file '", path_, "': token id ", id,
                 " is not in [0, ", header_.vocab_size, ")");
    if (header_.bytes_per_token == 2) {
      const auto v = static_cast<uint16_t>(id);
      buffer_.insert(buffer_.end(), reinterpret_cast<const char*>(&v), reinterpret_cast<const char*>(&v) + 2);
    } else {
      const auto v = static_cast<uint32_t>(id);
      buffer_.insert(buffer_.end(), reinterpret_cast<const char*>(&v), reinterpret_cast<const char*>(&v) + 4);
    }
  };
  for (int64_t id : tokens) {
    append(id);
    if (buffer_.size() >= kWriteBufferBytes) flush();
  }
  append(header_.eos_id);
  header_.num_tokens += static_cast<int64_t>(tokens.size()) + 1;
  header_.num_documents += 1;
}

void TokenFileWriter::close() {
  LOOM_REQUIRE(file_, "token file '", path_, "' is already closed");
  flush();
  char header[kTokenFileHeaderBytes];
  encode_header(header_, header);
  const bool ok = std::fseek(file_, 0, SEEK_SET) == 0 &&
                  std::fwrite(header, 1, kTokenFileHeaderBytes, file_) == kTokenFileHeaderBytes;
  const bool closed = std::fclose(file_) == 0;
  file_ = nullptr;
  if (!ok || !closed) {
    std::remove(tmp_path_.c_str());
    fail("cannot write token file '", path_, "': ", std::strerror(errno));
  }
  std::error_code ec;
  fs::rename(tmp_path_, path_, ec);
  if (ec) {
    std::remove(tmp_path_.c_str());  // a failed write leaves nothing behind
    fail("cannot move token file into place at '", path_, "': ", ec.message());
  }
}

TokenFile::TokenFile(const std::string& path) : path_(path) {
  const int fd = open_regular_file(path, "token file");
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    fail("cannot read token file '", path, "': ", std::strerror(errno));
  }
  const auto file_bytes = static_cast<int64_t>(st.st_size);
  if (file_bytes < kTokenFileHeaderBytes) {
    ::close(fd);
    fail("'", path, "' is not a loom token file (", file_bytes, " bytes, shorter than the header)");
  }
  mapping_ = ::mmap(nullptr, static_cast<size_t>(file_bytes), PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);  // the mapping keeps the file open
  LOOM_REQUIRE(mapping_ != MAP_FAILED, "cannot map token file '", path, "': ", std::strerror(errno));
  mapping_bytes_ = static_cast<size_t>(file_bytes);
  const auto* base = static_cast<const unsigned char*>(mapping_);
  auto reject = [&](const auto&... why) {
    ::munmap(mapping_, mapping_bytes_);
    mapping_ = nullptr;
    fail("token file '", path, "' ", why...);
  };
  if (std::memcmp(base, kTokenFileMagic, sizeof(kTokenFileMagic)) != 0) {
    reject("has no LOOMTOK magic: it was not written by 'loom tokenizer pretokenize'");
  }
  if (const uint32_t version = get_u32(base + 8); version != kTokenFileVersion) {
    reject("has format version ", version, "; this build reads version ", kTokenFileVersion);
  }
  header_.bytes_per_token = get_u32(base + 12);
  header_.num_tokens = get_i64(base + 16);
  header_.num_documents = get_i64(base + 24);
  header_.vocab_size = get_i64(base + 32);
  header_.bos_id = get_i64(base + 40);
  header_.eos_id = get_i64(base + 48);
  if (header_.bytes_per_token != 2 && header_.bytes_per_token != 4) {
    reject("has ", header_.bytes_per_token, " bytes per token; expected 2 or 4");
  }
  if (header_.num_tokens < 0 ||
      kTokenFileHeaderBytes + header_.num_tokens * header_.bytes_per_token != file_bytes) {
    reject("is ", file_bytes, " bytes but its header promises ", header_.num_tokens, " tokens of ",
           header_.bytes_per_token, " bytes: it is truncated or corrupt");
  }
  if (header_.eos_id < 0 || header_.eos_id >= header_.vocab_size) {
    reject("has EOS id ", header_.eos_id, " outside its vocabulary of ", header_.vocab_size);
  }
  data_ = base + kTokenFileHeaderBytes;
  if (header_.num_tokens > 0 && (*this)[header_.num_tokens - 1] != header_.eos_id) {
    reject("does not end with EOS: it is truncated or corrupt");
  }
}

TokenFile::~TokenFile() {
  if (mapping_) ::munmap(mapping_, mapping_bytes_);
}

void TokenFile::read(int64_t start, int64_t count, int64_t* out) const {
  TORCH_CHECK(start >= 0 && count >= 0 && start + count <= header_.num_tokens, "token file read [", start,
              ", ", start + count, ") out of range ", header_.num_tokens);
  if (header_.bytes_per_token == 2) {
    const auto* p = reinterpret_cast<const uint16_t*>(data_) + start;
    for (int64_t i = 0; i < count; ++i) out[i] = p[i];
  } else {
    const auto* p = reinterpret_cast<const uint32_t*>(data_) + start;
    for (int64_t i = 0; i < count; ++i) out[i] = p[i];
  }
}

std::vector<std::vector<int64_t>> TokenFile::documents() const {
  std::vector<std::vector<int64_t>> docs;
  docs.reserve(static_cast<size_t>(header_.num_documents));
  std::vector<int64_t> current;
  for (int64_t i = 0; i < header_.num_tokens; ++i) {
    const int64_t id = (*this)[i];
    if (id == header_.eos_id) {
      docs.push_back(std::move(current));
      current.clear();
    } else {
      current.push_back(id);
    }
  }
  return docs;
}

}  // namespace loom::data
