#include "loom/data/arrow_sources.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "loom/core/error.h"
#include "loom/core/files.h"

#ifdef LOOM_WITH_ARROW
#include <arrow/api.h>
#include <arrow/io/file.h>
#include <arrow/ipc/reader.h>
#include <parquet/arrow/reader.h>
#include <parquet/exception.h>
#include <parquet/file_reader.h>
#include <parquet/metadata.h>
#include <parquet/schema.h>
#endif

namespace loom::data {
namespace {

bool starts_with_bytes(const std::string& path, const void* magic, size_t size) {
  const int fd = open_regular_file(path, "data file");
  char head[8] = {};
  const bool match = size <= sizeof(head) && ::pread(fd, head, size, 0) == static_cast<ssize_t>(size) &&
                     std::memcmp(head, magic, size) == 0;
  ::close(fd);
  return match;
}

#ifdef LOOM_WITH_ARROW

// Arrow's messages can span lines; Loom's errors are one line.
std::string one_line(std::string text) {
  std::replace(text.begin(), text.end(), '\n', ' ');
  return text;
}

const char* kind_of(SourceFormat format) { return format == SourceFormat::kParquet ? "Parquet" : "Arrow"; }

// A file Arrow cannot read: bad input that no restart fixes (exit 2), before any training step.
[[noreturn]] void fail_unreadable(const std::string& path, SourceFormat format, const SourceOptions& options,
                                  const std::string& why) {
  fail_usage("data file '", path, "' is not a readable ", kind_of(format), " file (", one_line(why),
             "); it may be truncated or corrupt: re-download it, or set ", options.format_setting,
             " to the file's format");
}

template <typename T>
T value_or_fail(arrow::Result<T> result, const std::string& path, SourceFormat format, const SourceOptions& options) {
  if (!result.ok()) fail_unreadable(path, format, options, result.status().ToString());
  return std::move(result).ValueUnsafe();
}

void ok_or_fail(const arrow::Status& status, const std::string& path, SourceFormat format,
                const SourceOptions& options) {
  if (!status.ok()) fail_unreadable(path, format, options, status.ToString());
}

[[noreturn]] void fail_missing_column(const std::string& path, const arrow::Schema& schema,
                                      const SourceOptions& options) {
  std::string columns;
  for (const auto& field : schema.fields()) columns += (columns.empty() ? "" : ", ") + field->name();
  fail_usage("data file '", path, "' has no column '", options.text_column, "' (its columns: ",
             columns.empty() ? std::string("none") : columns, "); set ", options.text_column_setting,
             " to the column holding the document text");
}

void check_string_type(const std::string& path, const arrow::Field& field, const SourceOptions& options) {
  const arrow::Type::type id = field.type()->id();
  LOOM_REQUIRE_USAGE(id == arrow::Type::STRING || id == arrow::Type::LARGE_STRING || id == arrow::Type::STRING_VIEW,
                     "data file '", path, "': column '", field.name(), "' holds ", field.type()->ToString(),
                     ", not text (string); set ", options.text_column_setting, " to the column holding the ",
                     "document text");
}

template <typename ArrayType>
void emit_strings(const ArrayType& array, const SourceOptions& options, const std::function<void(std::string_view)>& fn) {
  for (int64_t i = 0; i < array.length(); ++i) {
    if (array.IsNull(i)) continue;
    const std::string_view text = array.GetView(i);
    if (!text.empty() || !options.skip_empty) fn(text);
  }
}

void emit_column(const arrow::Array& array, const SourceOptions& options,
                 const std::function<void(std::string_view)>& fn) {
  switch (array.type_id()) {
    case arrow::Type::STRING: return emit_strings(static_cast<const arrow::StringArray&>(array), options, fn);
    case arrow::Type::LARGE_STRING:
      return emit_strings(static_cast<const arrow::LargeStringArray&>(array), options, fn);
    case arrow::Type::STRING_VIEW:
      return emit_strings(static_cast<const arrow::StringViewArray&>(array), options, fn);
    default: TORCH_INTERNAL_ASSERT(false, "emit_column on ", array.type()->ToString());
  }
}

void read_parquet(const std::string& path, const SourceOptions& options,
                  const std::function<void(std::string_view)>& fn) {
  const SourceFormat format = SourceFormat::kParquet;
  auto file = value_or_fail(arrow::io::ReadableFile::Open(path), path, format, options);
  std::unique_ptr<parquet::arrow::FileReader> reader;
  try {
    reader = value_or_fail(parquet::arrow::OpenFile(file, arrow::default_memory_pool()), path, format, options);
  } catch (const parquet::ParquetException& e) {
    fail_unreadable(path, format, options, e.what());
  }
  std::shared_ptr<arrow::Schema> schema;
  ok_or_fail(reader->GetSchema(&schema), path, format, options);
  const int field = schema->GetFieldIndex(options.text_column);
  if (field < 0) fail_missing_column(path, *schema, options);
  check_string_type(path, *schema->field(field), options);
  // The leaf column of the field (ReadRowGroup takes Parquet's leaf indices, which differ from the
  // Arrow field's when a nested column comes before it).
  const int leaf = reader->parquet_reader()->metadata()->schema()->ColumnIndex(options.text_column);
  TORCH_INTERNAL_ASSERT(leaf >= 0, "Parquet column '", options.text_column, "' has no leaf in ", path);
  for (int group = 0; group < reader->num_row_groups(); ++group) {
    std::shared_ptr<arrow::Table> table;
    try {
      table = value_or_fail(reader->ReadRowGroup(group, {leaf}), path, format, options);
    } catch (const parquet::ParquetException& e) {
      fail_unreadable(path, format, options, e.what());
    }
    for (const auto& chunk : table->column(0)->chunks()) emit_column(*chunk, options, fn);
  }
}

void read_arrow(const std::string& path, const SourceOptions& options, const std::function<void(std::string_view)>& fn) {
  const SourceFormat format = SourceFormat::kArrow;
  // Memory-mapped: record batches point into the mapping, nothing is copied but what is tokenized.
  auto file = value_or_fail(arrow::io::MemoryMappedFile::Open(path, arrow::io::FileMode::READ), path, format, options);
  auto visit = [&](const arrow::RecordBatch& batch, int column) { emit_column(*batch.column(column), options, fn); };
  auto column_of = [&](const arrow::Schema& schema) {
    const int column = schema.GetFieldIndex(options.text_column);
    if (column < 0) fail_missing_column(path, schema, options);
    check_string_type(path, *schema.field(column), options);
    return column;
  };
  static constexpr char kFileMagic[6] = {'A', 'R', 'R', 'O', 'W', '1'};
  if (starts_with_bytes(path, kFileMagic, sizeof(kFileMagic))) {
    auto reader = value_or_fail(arrow::ipc::RecordBatchFileReader::Open(file), path, format, options);
    const int column = column_of(*reader->schema());
    for (int i = 0; i < reader->num_record_batches(); ++i) {
      visit(*value_or_fail(reader->ReadRecordBatch(i), path, format, options), column);
    }
    return;
  }
  auto reader = value_or_fail(arrow::ipc::RecordBatchStreamReader::Open(file), path, format, options);
  const int column = column_of(*reader->schema());
  while (true) {
    std::shared_ptr<arrow::RecordBatch> batch;
    ok_or_fail(reader->ReadNext(&batch), path, format, options);
    if (!batch) break;
    visit(*batch, column);
  }
}

#endif  // LOOM_WITH_ARROW

}  // namespace

bool arrow_formats_available() {
#ifdef LOOM_WITH_ARROW
  return true;
#else
  return false;
#endif
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
#ifdef LOOM_WITH_ARROW
  if (format == SourceFormat::kParquet) {
    read_parquet(path, options, fn);
  } else {
    read_arrow(path, options, fn);
  }
#else
  (void)fn;
  fail_usage("data file '", path, "' is read as ", source_format_name(format), " (", options.format_setting,
             "), but this Loom was built without Apache Arrow; run 'make setup' (it installs pyarrow) and ",
             "rebuild, or convert the data to JSONL");
#endif
}

}  // namespace loom::data
