// libloom_arrow_reader.so: see arrow_reader.h.
#include "loom/data/arrow_reader/arrow_reader.h"

#include <arrow/api.h>
#include <arrow/io/file.h>
#include <arrow/ipc/reader.h>
#include <parquet/arrow/reader.h>
#include <parquet/exception.h>
#include <parquet/file_reader.h>
#include <parquet/metadata.h>
#include <parquet/schema.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <string_view>

namespace {

// A failed read: its status and message, thrown inside this module only.
struct Failure {
  int32_t status;
  std::string message;
};

template <typename T>
T value_or_fail(arrow::Result<T> result) {
  if (!result.ok()) throw Failure{kLoomArrowUnreadable, result.status().ToString()};
  return std::move(result).ValueUnsafe();
}

void ok_or_fail(const arrow::Status& status) {
  if (!status.ok()) throw Failure{kLoomArrowUnreadable, status.ToString()};
}

struct Stopped {};

struct Reader {
  std::string column;
  bool skip_empty;
  LoomArrowEmit emit;
  void* context;

  int column_of(const arrow::Schema& schema) const {
    const int index = schema.GetFieldIndex(column);
    if (index < 0) {
      std::string columns;
      for (const auto& field : schema.fields()) columns += (columns.empty() ? "" : ", ") + field->name();
      throw Failure{kLoomArrowMissingColumn, columns.empty() ? std::string("none") : columns};
    }
    const std::shared_ptr<arrow::DataType>& type = schema.field(index)->type();
    // A dictionary-encoded column (pandas' categoricals, pyarrow's dictionary_encode) is text when
    // its values are.
    const arrow::DataType& values =
        type->id() == arrow::Type::DICTIONARY ? *static_cast<const arrow::DictionaryType&>(*type).value_type() : *type;
    if (!is_text(values.id())) throw Failure{kLoomArrowNotText, type->ToString()};
    return index;
  }

  static bool is_text(arrow::Type::type id) {
    return id == arrow::Type::STRING || id == arrow::Type::LARGE_STRING || id == arrow::Type::STRING_VIEW;
  }

  // Each non-null entry of a dictionary-encoded array, looked up in its dictionary.
  template <typename ArrayType>
  void emit_dictionary_strings(const arrow::DictionaryArray& array, const ArrayType& dictionary) const {
    for (int64_t i = 0; i < array.length(); ++i) {
      if (array.IsNull(i)) continue;
      const std::string_view text = dictionary.GetView(array.GetValueIndex(i));
      if (text.empty() && skip_empty) continue;
      if (emit(context, text.data(), text.size()) != 0) throw Stopped{};
    }
  }

  template <typename ArrayType>
  void emit_strings(const ArrayType& array) const {
    for (int64_t i = 0; i < array.length(); ++i) {
      if (array.IsNull(i)) continue;
      const std::string_view text = array.GetView(i);
      if (text.empty() && skip_empty) continue;
      if (emit(context, text.data(), text.size()) != 0) throw Stopped{};
    }
  }

  void emit_column(const arrow::Array& array) const {
    switch (array.type_id()) {
      case arrow::Type::STRING: return emit_strings(static_cast<const arrow::StringArray&>(array));
      case arrow::Type::LARGE_STRING: return emit_strings(static_cast<const arrow::LargeStringArray&>(array));
      case arrow::Type::STRING_VIEW: return emit_strings(static_cast<const arrow::StringViewArray&>(array));
      case arrow::Type::DICTIONARY: {
        const auto& encoded = static_cast<const arrow::DictionaryArray&>(array);
        const arrow::Array& dictionary = *encoded.dictionary();
        switch (dictionary.type_id()) {
          case arrow::Type::STRING:
            return emit_dictionary_strings(encoded, static_cast<const arrow::StringArray&>(dictionary));
          case arrow::Type::LARGE_STRING:
            return emit_dictionary_strings(encoded, static_cast<const arrow::LargeStringArray&>(dictionary));
          case arrow::Type::STRING_VIEW:
            return emit_dictionary_strings(encoded, static_cast<const arrow::StringViewArray&>(dictionary));
          default: throw Failure{kLoomArrowNotText, array.type()->ToString()};
        }
      }
      default: throw Failure{kLoomArrowNotText, array.type()->ToString()};
    }
  }

  void read_parquet(const std::string& path) const {
    auto file = value_or_fail(arrow::io::ReadableFile::Open(path));
    std::unique_ptr<parquet::arrow::FileReader> reader =
        value_or_fail(parquet::arrow::OpenFile(file, arrow::default_memory_pool()));
    std::shared_ptr<arrow::Schema> schema;
    ok_or_fail(reader->GetSchema(&schema));
    column_of(*schema);
    // The leaf column of the field: ReadRowGroup takes Parquet's leaf indices, which differ from
    // the Arrow field's when a nested column comes before it.
    const int leaf = reader->parquet_reader()->metadata()->schema()->ColumnIndex(column);
    if (leaf < 0) throw Failure{kLoomArrowNotText, "a nested column"};
    for (int group = 0; group < reader->num_row_groups(); ++group) {
      const std::shared_ptr<arrow::Table> table = value_or_fail(reader->ReadRowGroup(group, {leaf}));
      for (const auto& chunk : table->column(0)->chunks()) emit_column(*chunk);
    }
  }

  void read_arrow(const std::string& path) const {
    // Memory-mapped: record batches point into the mapping; nothing is copied but what is emitted.
    auto file = value_or_fail(arrow::io::MemoryMappedFile::Open(path, arrow::io::FileMode::READ));
    char magic[6] = {};
    std::FILE* f = std::fopen(path.c_str(), "rb");
    const bool ipc_file = f != nullptr && std::fread(magic, 1, 6, f) == 6 && std::memcmp(magic, "ARROW1", 6) == 0;
    if (f != nullptr) std::fclose(f);
    if (ipc_file) {
      auto reader = value_or_fail(arrow::ipc::RecordBatchFileReader::Open(file));
      const int index = column_of(*reader->schema());
      for (int i = 0; i < reader->num_record_batches(); ++i) {
        emit_column(*value_or_fail(reader->ReadRecordBatch(i))->column(index));
      }
      return;
    }
    auto reader = value_or_fail(arrow::ipc::RecordBatchStreamReader::Open(file));
    const int index = column_of(*reader->schema());
    while (true) {
      std::shared_ptr<arrow::RecordBatch> batch;
      ok_or_fail(reader->ReadNext(&batch));
      if (!batch) break;
      emit_column(*batch->column(index));
    }
  }
};

void write_message(const std::string& text, char* message, size_t size) {
  if (message == nullptr || size == 0) return;
  std::snprintf(message, size, "%s", text.c_str());
}

}  // namespace

extern "C" int32_t loom_arrow_read_text(const char* path, int32_t parquet, const char* column, int32_t skip_empty,
                                        LoomArrowEmit emit, void* context, char* message, size_t message_size) {
  const Reader reader{column, skip_empty != 0, emit, context};
  try {
    if (parquet != 0) {
      reader.read_parquet(path);
    } else {
      reader.read_arrow(path);
    }
    return kLoomArrowOk;
  } catch (const Stopped&) {
    return kLoomArrowStopped;
  } catch (const Failure& f) {
    write_message(f.message, message, message_size);
    return f.status;
  } catch (const parquet::ParquetException& e) {
    write_message(e.what(), message, message_size);
    return kLoomArrowUnreadable;
  } catch (const std::exception& e) {
    write_message(e.what(), message, message_size);
    return kLoomArrowUnreadable;
  }
}
