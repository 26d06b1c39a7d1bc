// Document sources for tokenizer training and the data loader.
//
// An input spec is a file, a directory (every regular file below it, recursively) or a glob
// ("data/*.jsonl"); the files it names are taken in sorted order so every rank and every run sees
// the same documents in the same order. A file's format is the one the caller configures
// (SourceOptions::format; a token file given as text, or a non-token file given as tokens, is an
// error), or, when none is configured, is guessed from its content and name:
//   token file  starts with the magic "LOOMTOK\0" (written by TokenFileWriter / `loom tokenizer
//               pretokenize`): pre-tokenized documents, memory-mapped;
//   JSONL       name ends in .jsonl or .ndjson: one JSON object per line, the document is the
//               string field `jsonl_field` ("text" by default); blank lines are skipped;
//   text        anything else: the whole file is one document, or, with a `text_separator`
//               (e.g. "\n\n"), the pieces between separators are (empty pieces are skipped).
//   Parquet     starts with "PAR1": each value of the column `text_column` is a document;
//   Arrow       an Arrow IPC stream or file (a `datasets` cache's data-*.arrow): likewise.
// Parquet and Arrow are read by arrow_sources.h, one row group / record batch at a time. A
// directory read as "parquet" or "arrow" contributes only its *.parquet / *.arrow files (a
// `datasets` folder also holds dataset_info.json and state.json).
// A further format is never guessed, only configured: `sft`, JSONL of prompt/completion pairs or
// chat conversations, rendered with a chat template and trained on the answers only (sft.h).
//
// Token file format (version 1, all integers little-endian):
//   offset  size  field
//        0     8  magic "LOOMTOK\0"
//        8     4  uint32 version = 1
//       12     4  uint32 bytes per token: 2 (uint16 ids, vocab_size <= 65536) or 4 (uint32)
//       16     8  uint64 num_tokens     (including the EOS after every document)
//       24     8  uint64 num_documents
//       32     8  int64  vocab_size     of the tokenizer that wrote it
//       40     8  int64  bos_id         (-1 if none)
//       48     8  int64  eos_id
//       56     8  reserved, zero
//       64        num_tokens token ids; every document's tokens are followed by eos_id, so the
//                 file is the documents' tokens each terminated by EOS (BOS is not stored: the
//                 loader adds it when packing).
#pragma once
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "loom/core/options.h"
#include "loom/data/sft.h"

namespace loom::data {

enum class SourceFormat { kText, kJsonl, kTokens, kSft, kParquet, kArrow };
const char* source_format_name(SourceFormat format);

struct SourceOptions {
  std::string text_separator;        // empty: one text file is one document
  std::string jsonl_field = "text";  // the JSONL field holding a document's text
  std::string text_column = "text";  // the Parquet/Arrow column holding a document's text
  // Threads that tokenize text while it is read (ParallelEncoder); 1 = on the reading thread.
  int64_t workers = 1;
  bool skip_empty = true;            // false: empty documents are passed on too (as "")
  // Non-empty: TokenCorpus::load tokenizes each text or JSONL file once and keeps its tokens as a
  // token file in this folder, keyed by the file's and the tokenizer's contents and the options
  // above; a later load with the same key memory-maps it instead of tokenizing again.
  std::string token_cache_dir;
  // Every file's format; unset = guess each file's (detect_format).
  std::optional<SourceFormat> format;
  // How `sft` files are rendered (format kSft only).
  SftConfig sft;
  // How the user sets `format` and `jsonl_field` where these options come from (a config key or a
  // command-line flag): error messages name them as the fix.
  std::string format_setting = "the data format option";
  std::string jsonl_field_setting = "the jsonl_field option";
  std::string text_column_setting = "the text_column option";
  // The setting that names the inputs (e.g. "training.dataset_path"): errors about the inputs
  // themselves (missing, not a regular file, no documents, too short) name it, so a problem with
  // the validation set is not reported as one with the training data. Empty: "data input".
  std::string inputs_setting;
};

// "training.dataset_path = \"x\"" for a spec given through `setting`, "data input 'x'" without one:
// how errors about an input name it.
std::string input_description(const std::string& spec, const std::string& setting);

// The files named by input specs (file, directory or glob), sorted within each spec, in spec
// order, without duplicates. Throws loom::UsageError (naming `setting`, see SourceOptions) for a
// spec that names no file, and for one that names (or a glob that matches) something other than
// a regular file or directory: a FIFO, device or socket would block or never end when read.
// Directories contribute their regular files only. Only metadata is read (stat, never open).
// `directory_extension` (".parquet"): a directory contributes only files with that extension.
std::vector<std::string> resolve_inputs(const std::vector<std::string>& specs, const std::string& setting = {},
                                        const std::string& directory_extension = {});
// The extension a directory's files need when read in `format` (".parquet", ".arrow"), else "".
std::string directory_extension(std::optional<SourceFormat> format);


// Where tokenized inputs are cached (SourceOptions::token_cache_dir): $LOOM_CACHE_DIR/tokens, else
// $XDG_CACHE_HOME/loom/tokens, else $HOME/.cache/loom/tokens; empty when none of them is set.
std::string default_token_cache_dir();

// "text", "jsonl", "tokens", "parquet" or "arrow"; throws loom::UsageError for anything else (`sft` is the trainer's
// only: it needs a chat template and yields masks, not text).
SourceFormat parse_source_format(std::string_view name);
// training.dataset_format and validation.dataset_format: one format for every file, or kAuto
// (guess each file's; core/options.h's enum protocol).
enum class DatasetFormat { kJsonl, kText, kTokens, kSft, kParquet, kArrow, kAuto };
const options::EnumNames<DatasetFormat>& option_names(DatasetFormat);
// The format every file is read in; nullopt for kAuto (SourceOptions::format).
std::optional<SourceFormat> source_format(DatasetFormat format);

// One `[[training.datasets]]` entry: a source of a weighted mixture (loader.h, TokenCorpus::mix).
struct DatasetSource {
  std::string path;                             // a file, a directory or a glob
  DatasetFormat format = DatasetFormat::kAuto;  // how its files are read
  double weight = 1.0;                          // its share of the documents is weight / sum
  std::string text_column;                      // Parquet/Arrow column; "" = training.text_column

  bool operator==(const DatasetSource&) const = default;
};
const options::Section& option_section(const DatasetSource*);

// Whether the file starts with the token file magic.
bool is_token_file(const std::string& path);
// The format guessed from the file: the token, Parquet or Arrow magic, else the name
// (.jsonl/.ndjson), else text.
SourceFormat detect_format(const std::string& path);
// The format to read `path` in: options.format when set (throws loom::UsageError naming the file,
// the format and the setting to change when the file is a token file and the format is not
// "tokens", or the other way round), else detect_format(path).
SourceFormat resolve_format(const std::string& path, const SourceOptions& options);

// Calls fn(document) for every document of a text or JSONL file (format: resolve_format), in file
// order. Throws loom::Error naming file:line for a JSONL line that is not an object with a string
// field `jsonl_field`, and for a token file (which holds ids, not text) or an sft file.
void for_each_text_document(const std::string& path, const SourceOptions& options,
                            const std::function<void(std::string_view)>& fn);

// Calls fn(record, line_no) for every non-blank line of a JSONL file, parsed, in file order
// (streamed: the file may exceed memory). Throws loom::Error naming file:line for a line that is
// not valid JSON (when options.format is set, the message says which setting to change).
void for_each_jsonl_record(const std::string& path, const SourceOptions& options,
                           const std::function<void(const nlohmann::json& record, int64_t line_no)>& fn);

// The whole file as bytes; `what` names the file's role in the error message.
std::string read_file(const std::string& path, const char* what);

inline constexpr char kTokenFileMagic[8] = {'L', 'O', 'O', 'M', 'T', 'O', 'K', '\0'};
inline constexpr uint32_t kTokenFileVersion = 1;
inline constexpr int64_t kTokenFileHeaderBytes = 64;

struct TokenFileHeader {
  uint32_t bytes_per_token = 0;
  int64_t num_tokens = 0;
  int64_t num_documents = 0;
  int64_t vocab_size = 0;
  int64_t bos_id = -1;
  int64_t eos_id = -1;
};

// Streams documents into a token file. The file appears under `path` only when close() succeeds
// (it is written to "<path>.tmp" and renamed), so a crash never leaves a truncated token file.
class TokenFileWriter {
 public:
  TokenFileWriter(const std::string& path, int64_t vocab_size, int64_t bos_id, int64_t eos_id);
  ~TokenFileWriter();  // without close(): discards the temporary file
  TokenFileWriter(const TokenFileWriter&) = delete;
  TokenFileWriter& operator=(const TokenFileWriter&) = delete;

  // Appends the document's tokens and an EOS. Empty documents are skipped. Throws for an id
  // outside [0, vocab_size).
  void add_document(const std::vector<int64_t>& tokens);
  void close();

  const TokenFileHeader& header() const { return header_; }

 private:
  void flush();

  std::string path_, tmp_path_;
  std::FILE* file_ = nullptr;
  TokenFileHeader header_;
  std::vector<char> buffer_;
};

// A token file opened read-only and memory-mapped: the tokens are paged in on demand, never
// copied, so corpora larger than memory work.
class TokenFile {
 public:
  explicit TokenFile(const std::string& path);  // validates magic, version, dtype and size
  ~TokenFile();
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  const TokenFileHeader& header() const { return header_; }
  const std::string& path() const { return path_; }
  int64_t size() const { return header_.num_tokens; }
  int64_t operator[](int64_t i) const {
    return header_.bytes_per_token == 2 ? static_cast<int64_t>(reinterpret_cast<const uint16_t*>(data_)[i])
                                        : static_cast<int64_t>(reinterpret_cast<const uint32_t*>(data_)[i]);
  }
  // Copies tokens [start, start + count) into out.
  void read(int64_t start, int64_t count, int64_t* out) const;
  // The documents, each as its tokens without the EOS (scans the file once).
  std::vector<std::vector<int64_t>> documents() const;

 private:
  std::string path_;
  TokenFileHeader header_;
  void* mapping_ = nullptr;
  size_t mapping_bytes_ = 0;
  const unsigned char* data_ = nullptr;
};

}  // namespace loom::data
