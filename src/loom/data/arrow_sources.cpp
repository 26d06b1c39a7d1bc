#include "loom/data/arrow_sources.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <filesystem>
#include <mutex>
#include <string>
#include <vector>

#include "loom/core/error.h"
#include "loom/core/files.h"
#include "loom/data/arrow_reader/arrow_reader.h"

namespace loom::data {
namespace {

namespace fs = std::filesystem;

constexpr const char* kReaderLibrary = "libloom_arrow_reader.so";

bool starts_with_bytes(const std::string& path, const void* magic, size_t size) {
  const int fd = open_regular_file(path, "data file");
  char head[8] = {};
  const bool match = size <= sizeof(head) && ::pread(fd, head, size, 0) == static_cast<ssize_t>(size) &&
                     std::memcmp(head, magic, size) == 0;
  ::close(fd);
  return match;
}

// The reader module's entry point, loaded once: from the folder of the running binary (the build's
// bin/, where CMake puts it next to `loom` and the tests), else by the dynamic loader's search.
// Null when this build has no module (built without pyarrow) or it cannot be loaded (`why`).
LoomArrowReadText reader_entry(std::string& why) {
  static std::once_flag once;
  static LoomArrowReadText entry = nullptr;
  static std::string error;
  std::call_once(once, [] {
    std::error_code ec;
    const fs::path self = fs::read_symlink("/proc/self/exe", ec);
    std::vector<std::string> candidates;
    if (!ec) candidates.push_back((self.parent_path() / kReaderLibrary).string());
    candidates.push_back(kReaderLibrary);
    for (const std::string& candidate : candidates) {
      void* handle = ::dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (handle == nullptr) {
        if (error.empty()) error = ::dlerror();
        continue;
      }
      entry = reinterpret_cast<LoomArrowReadText>(::dlsym(handle, "loom_arrow_read_text"));
      if (entry != nullptr) return;
      error = c10::str(candidate, " has no loom_arrow_read_text");
    }
  });
  why = error;
  return entry;
}

// Arrow's messages can span lines; Loom's errors are one line.
std::string one_line(std::string text) {
  std::replace(text.begin(), text.end(), '\n', ' ');
  return text;
}

struct EmitContext {
  const std::function<void(std::string_view)>* fn;
  std::exception_ptr error;  // what fn threw, rethrown once the module has returned
};

int32_t emit_document(void* context, const char* text, size_t size) {
  auto* c = static_cast<EmitContext*>(context);
  try {
    (*c->fn)(std::string_view(text, size));
    return 0;
  } catch (...) {
    c->error = std::current_exception();
    return 1;
  }
}

}  // namespace

bool arrow_formats_available() {
  std::string why;
  return reader_entry(why) != nullptr;
}

bool has_parquet_magic(const std::string& path) {
  static constexpr char kMagic[4] = {'P', 'A', 'R', '1'};
  return starts_with_bytes(path, kMagic, sizeof(kMagic));
}

bool has_arrow_magic(const std::string& path) {
  // An IPC stream starts with a message's continuation marker; an IPC file with "ARROW1".
  static constexpr unsigned char kStream[4] = {0xff, 0xff, 0xff, 0xff};
  static constexpr char kFile[6] = {'A', 'R', 'R', 'O', 'W', '1'};
  return starts_with_bytes(path, kStream, sizeof(kStream)) || starts_with_bytes(path, kFile, sizeof(kFile));
}

void for_each_table_document(const std::string& path, SourceFormat format, const SourceOptions& options,
                             const std::function<void(std::string_view)>& fn) {
  TORCH_INTERNAL_ASSERT(format == SourceFormat::kParquet || format == SourceFormat::kArrow);
  const bool parquet = format == SourceFormat::kParquet;
  std::string why;
  const LoomArrowReadText read = reader_entry(why);
  LOOM_REQUIRE_USAGE(read != nullptr, "data file '", path, "' is read as ", source_format_name(format), " (",
                     options.format_setting, "), but this Loom cannot load its Arrow reader (", one_line(why),
                     "); run 'make setup' (it installs pyarrow) and rebuild, or convert the data to JSONL");
  EmitContext context{&fn, nullptr};
  char message[1024] = {};
  const int32_t status = read(path.c_str(), parquet ? 1 : 0, options.text_column.c_str(), options.skip_empty ? 1 : 0,
                              &emit_document, &context, message, sizeof(message));
  if (context.error) std::rethrow_exception(context.error);
  switch (status) {
    case kLoomArrowOk: return;
    case kLoomArrowMissingColumn:
      fail_usage("data file '", path, "' has no column '", options.text_column, "' (its columns: ", message, "); set ",
                 options.text_column_setting, " to the column holding the document text");
    case kLoomArrowNotText:
      fail_usage("data file '", path, "': column '", options.text_column, "' holds ", message,
                 ", not text (string); set ", options.text_column_setting, " to the column holding the document text");
    default:
      // Bad input that no restart fixes (exit 2), before any training step.
      fail_usage("data file '", path, "' is not a readable ", parquet ? "Parquet" : "Arrow", " file (",
                 one_line(message), "); it may be truncated or corrupt: re-download it, or set ",
                 options.format_setting, " to the file's format");
  }
}

}  // namespace loom::data
